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
    return stdlib_source_documents()[0]


def stdlib_source_documents() -> Tuple[Tensor, Tensor]:
    """The concatenated sources and where each file starts in them (int64, from 0): the
    documents of --pack-documents."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"byte_corpus: no .py files in the standard library at {root}")
    texts = [f.read_bytes() for f in files]
    starts = torch.tensor([0] + [len(t) for t in texts[:-1]]).cumsum(0)
    return torch.frombuffer(bytearray(b"".join(texts)), dtype=torch.uint8), starts


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
        rows = self.data[self._starts() + self.window].long()
        return rows[:, :-1], rows[:, 1:]

    def _starts(self) -> Tensor:
        """The next batch's windows' offsets, ``(batch_size, 1)``."""
        return torch.randint(
            self.data.numel() - self.window.numel(), (self.batch_size, 1), generator=self.generator
        )

    def state_dict(self) -> Dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


class PackedWindows(RandomWindows):
    """Packed batches: ``batch_size * seq_len + 1`` consecutive bytes at a random offset, cut
    where the corpus' files (``document_starts``) begin: the documents of one packed row, each
    of at most ``seq_len`` bytes (a longer file's piece is cut into ``seq_len`` pieces, so that
    positions stay below the model's ``max_len``). A document's last byte predicts nothing
    (its target is -100: the next byte begins another document)."""

    def __init__(self, data: Tensor, document_starts: Tensor, batch_size: int, seq_len: int,
                 seed: int):
        super().__init__(data, 1, batch_size * seq_len, seed)
        self.document_starts, self.seq_len = document_starts, seq_len

    def next(self) -> Tuple[Tensor, Tensor, Tensor]:
        """``(inputs, targets, cu_seqlens)``: ``(tokens,)`` int64 twice and int32 boundaries."""
        begin = int(self._starts()[0, 0])
        row = self.data[begin + self.window].long()
        inputs, targets = row[:-1], row[1:].clone()
        tokens = inputs.numel()
        inside = self.document_starts[(self.document_starts > begin) &
                                      (self.document_starts < begin + tokens)] - begin
        bounds = torch.cat([torch.tensor([0]), inside, torch.tensor([tokens])])
        # Files longer than seq_len are cut into pieces of seq_len.
        cuts = [torch.arange(a, b, self.seq_len) for a, b in zip(bounds[:-1].tolist(),
                                                                  bounds[1:].tolist())]
        cu_seqlens = torch.cat(cuts + [torch.tensor([tokens])]).to(torch.int32)
        targets[inside - 1] = -100
        return inputs, targets, cu_seqlens
