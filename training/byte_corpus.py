"""Training text that every machine already has and nobody here wrote: the top-level ``.py``
files of Python's standard library, read from disk in sorted order, as raw bytes (a byte-level
vocabulary of 256 tokens, no tokenizer to download or train)."""

import sysconfig
from pathlib import Path
from typing import Any, Dict, Tuple

import torch
from torch import Tensor

VOCAB_SIZE = 256


def stdlib_source_bytes() -> Tensor:
    """The concatenated sources, a uint8 tensor (about 4.7 MB on CPython 3.11)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"byte_corpus: no .py files in the standard library at {root}")
    return torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)


def decode(tokens: Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def encode(text: str) -> Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


class RandomWindows:
    """Batches of ``batch_size`` windows of ``seq_len + 1`` bytes at random offsets: inputs are
    the first ``seq_len`` bytes, targets the last ``seq_len``. Offsets come from the sampler's own
    generator, so its state is the whole data position: checkpoint ``state_dict()`` and a resumed
    run draws exactly the batches the uninterrupted one would have."""

    def __init__(self, data: Tensor, batch_size: int, seq_len: int, seed: int):
        if data.numel() <= seq_len + 1:
            raise ValueError(
                f"RandomWindows: {data.numel()} bytes of text are too few for seq_len={seq_len}"
            )
        self.data = data
        self.batch_size = batch_size
        self.window = torch.arange(seq_len + 1)
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> Tuple[Tensor, Tensor]:
        """``(inputs, targets)``, both ``(batch_size, seq_len)`` int64."""
        starts = torch.randint(
            self.data.numel() - self.window.numel(), (self.batch_size, 1), generator=self.generator
        )
        rows = self.data[starts + self.window].long()
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> Dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
