"""Loads the compiled op library that the build writes next to this file."""

from pathlib import Path

import torch

LIBRARY_NAME = "libcausal_attention_ops.so"


def load() -> Path:
    path = Path(__file__).resolve().parent / LIBRARY_NAME
    if not path.exists():
        raise ImportError(
            f"causal_attention: the compiled library {path} is missing; build it with "
            "`pip install --no-build-isolation -e .` or `scripts/test.sh`"
        )
    torch.ops.load_library(str(path))
    return path
