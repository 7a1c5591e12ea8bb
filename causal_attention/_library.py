"""Loads the compiled op library that the build writes next to this file, after checking that it
was built against the torch imported now: loaded into another torch, a C++ extension fails with an
undefined symbol at best and corrupts memory at worst, so a mismatch is refused up front with both
versions named."""

from pathlib import Path

import torch

LIBRARY_NAME = "libcausal_attention_ops.so"
# CMakeLists.txt writes "<library>.torch_version" next to the library: the version of the torch
# it was compiled against (Torch_VERSION, e.g. "2.13.0").
TORCH_VERSION_SUFFIX = ".torch_version"


def _release(version: str) -> str:
    """"2.13.0+cpu" -> "2.13.0": CMake knows torch's release only, not pip's local build tag."""
    return version.split("+", 1)[0]


def check_torch_version(library: Path, running: str = torch.__version__) -> None:
    """Raises ImportError unless ``library`` was built against torch ``running``."""
    record = library.with_name(library.name + TORCH_VERSION_SUFFIX)
    rebuild = (
        "rebuild it against this torch with `pip install --no-build-isolation -e .` or "
        "`scripts/test.sh`"
    )
    try:
        built = record.read_text().strip()
    except FileNotFoundError:
        raise ImportError(
            f"causal_attention: {record} is missing, so the torch version that {library.name} "
            f"was built against is unknown (torch {running} is imported); {rebuild}"
        ) from None
    if _release(built) != _release(running):
        raise ImportError(
            f"causal_attention: {library} was built against torch {built}, but torch {running} "
            f"is imported; {rebuild}, or install torch=={built}"
        )


def load() -> Path:
    path = Path(__file__).resolve().parent / LIBRARY_NAME
    if not path.exists():
        raise ImportError(
            f"causal_attention: the compiled library {path} is missing; build it with "
            "`pip install --no-build-isolation -e .` or `scripts/test.sh`"
        )
    check_torch_version(path)
    torch.ops.load_library(str(path))
    return path
