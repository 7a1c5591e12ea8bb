"""The ring's schedule: which (query chunk, key chunk) pairs each ring step computes, the parts
a step's K/V shard travels in, the steps that compute something on some rank, the peers, and
the tags that match each receive with its send."""

import functools
from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import Chunk, Sharding, _cuts


class _Pair(NamedTuple):
    """A query chunk against a key chunk of one ring step, with the kernel's query_offset."""

    rows: Chunk
    keys: Chunk
    query_offset: int


def _pairs(q_chunks: List[Chunk], k_chunks: List[Chunk], window) -> List[_Pair]:
    """The (query chunk, key chunk) pairs of one document in which some row sees some key under
    ``window`` (positions within the document), in a fixed order."""
    left, right = window
    by_document = {}
    for b in k_chunks:
        by_document.setdefault(b.document, []).append(b)
    pairs = []
    for a in q_chunks:
        for b in by_document.get(a.document, ()):
            last_row, last_key = a.position + a.length - 1, b.position + b.length - 1
            # Some row i sees some key j: j <= i + right and j >= i - left for i in a, j in b.
            reaches_keys = right < 0 or b.position <= last_row + right
            reaches_rows = left < 0 or last_key >= a.position - left
            if a.length and b.length and reaches_keys and reaches_rows:
                pairs.append(_Pair(a, b, a.position - b.position))
    return pairs


# In the backward a ring step's K/V shard travels in parts of at least MIN_PART_KEYS keys (at
# most MAX_PARTS of them): a rank holds the parts of one step in flight beside the part it
# computes, never two whole shards and two shards of dK/dV sums, and every kernel call keeps all
# the heads (so the backward keeps its one-pass schedule). The forward, which holds no sums,
# sends whole chunks: fewer calls, fewer merges.
MIN_PART_KEYS = 512
MAX_PARTS = 16
# And its calls take query rows in parts of at least this many, so that their dQ shares and
# scratch are small too.
MIN_PART_ROWS = 1024


def _part_count(sharding: Sharding, min_part_keys: Optional[int]) -> int:
    """How many parts every shard travels in (each cut into that many near-equal row ranges):
    a dense shard's chunks each in equal parts of at least ``min_part_keys`` (None: whole
    chunks); a packed shard, whose chunks are documents' pieces, as a whole in parts of at least
    ``min_part_keys`` keys of the shortest shard (None: two parts, as a dense zigzag shard's two
    chunks: the next step's first part arrives while the second is computed, so that a rank
    holds one shard and a half, not two)."""
    if sharding.cu_seqlens is None:
        chunks = sharding.chunks(0)
        per_chunk = 1 if min_part_keys is None else max(
            1, min(MAX_PARTS // len(chunks), chunks[0].length // min_part_keys))
        return len(chunks) * per_chunk
    if min_part_keys is None:
        return 2
    shortest = min(sharding.shard_length(r) for r in range(sharding.world))
    return max(1, min(MAX_PARTS, shortest // min_part_keys))


def _part_chunks(chunks: List[Chunk], begin: int, end: int) -> List[Chunk]:
    """The pieces of ``chunks`` in shard rows ``[begin, end)``, their rows counted from
    ``begin``."""
    pieces = []
    for c in chunks:
        low, high = max(c.start, begin), min(c.start + c.length, end)
        if low < high:
            pieces.append(c._replace(start=low - begin, length=high - low,
                                     position=c.position + low - c.start))
    return pieces


class _Unit(NamedTuple):
    """What travels at once: part ``part`` of the K/V shard held at ring step ``step``."""

    step: int
    part: int


class _Ring:
    """The ring of one call: this rank's chunks, the parts of the shard it holds at each step and
    the (query chunk, key chunk) pairs each part computes, the steps that compute something on
    some rank, and the peers. Messages are tagged by the unit they belong to, so that each
    receive matches its send."""

    def __init__(self, group, rank: int, sharding: Sharding, window,
                 min_part_keys: Optional[int]):
        self.group, self.rank, self.world = group, rank, sharding.world
        self.q_chunks = sharding.chunks(rank)
        self.steps = self.steps_needed(sharding, window)
        self.parts = _part_count(sharding, min_part_keys)
        # Every rank's parts' rows, so that receive buffers are sized by the sender's shard.
        self.bounds = [list(zip(cuts[:-1], cuts[1:])) for cuts in
                       (_cuts(sharding.shard_length(r), self.parts) for r in range(self.world))]
        self.units = [_Unit(t, p) for t in range(self.steps) for p in range(self.parts)]
        self.unit_pairs = []
        for unit in self.units:
            begin, end = self.bounds[self.source(unit)][unit.part]
            keys = _part_chunks(sharding.chunks(self.source(unit)), begin, end)
            self.unit_pairs.append(_pairs(self.q_chunks, keys, window))
        self.next, self.prev = self.global_rank(1), self.global_rank(-1)
        # After the last step each part's dK/dV sums go home: steps - 1 ranks back.
        self.home_to = self.global_rank(1 - self.steps)
        self.home_from = self.global_rank(self.steps - 1)

    @staticmethod
    @functools.lru_cache(maxsize=256)  # O(N^2) pairs checked: once per sharding and window
    def steps_needed(sharding: Sharding, window) -> int:
        """The steps up to the last one in which some rank computes something: the later ones
        are not run, and their shards are never sent. Every rank derives the same count from the
        sharding and the window."""
        world = sharding.world
        live = [t for t in range(world)
                if any(_pairs(sharding.chunks(r), sharding.chunks((r - t) % world), window)
                       for r in range(world))]
        return max(live, default=0) + 1

    def source(self, unit: _Unit) -> int:
        """The rank whose shard's part this rank holds at ``unit``."""
        return (self.rank - unit.step) % self.world

    def part_rows(self, unit: _Unit) -> int:
        begin, end = self.bounds[self.source(unit)][unit.part]
        return end - begin

    def global_rank(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.world)

    def own_part(self, t: Tensor, part: int) -> Tensor:
        begin, end = self.bounds[self.rank][part]
        return t.narrow(-2, begin, end - begin)

    def tag(self, stream: int, unit: _Unit, piece: int) -> int:
        """The tag of piece ``piece`` (K or V, dK or dV) of ``unit`` in ``stream``: 0 K/V, 1
        dK/dV along the ring, 2 dK/dV home."""
        index = unit.step * self.parts + unit.part
        return (stream * (self.steps + 1) * self.parts + index) * 2 + piece

    def send(self, tensors: Sequence[Tensor], to: int, stream: int, unit: _Unit):
        """Starts sending ``tensors`` (copied where they are not contiguous); returns the
        requests and the tensors they read."""
        tensors = [t.contiguous() for t in tensors]
        return [dist.isend(t, to, self.group, self.tag(stream, unit, i))
                for i, t in enumerate(tensors)], tensors

    def receive(self, like: Sequence[Tensor], rows: int, source: int, stream: int, unit: _Unit,
                dtype: Optional[torch.dtype] = None):
        """Posts the receives of a unit into new tensors of ``rows`` rows, shaped like ``like``
        otherwise (in ``dtype``). Returns the tensors and the requests."""
        buffers = [torch.empty((*t.shape[:-2], rows, t.shape[-1]), dtype=dtype or t.dtype,
                               device=t.device) for t in like]
        return buffers, [dist.irecv(b, source, self.group, self.tag(stream, unit, i))
                         for i, b in enumerate(buffers)]


def _row_parts(pairs: List[_Pair]) -> List[_Pair]:
    """The pairs with their query chunks cut as the key parts are: the backward's dQ share of a
    call (and its scratch) is then a part's size, not a chunk's."""
    parts = []
    for pair in pairs:
        rows = pair.rows
        count = max(1, min(MAX_PARTS, rows.length // MIN_PART_ROWS))
        cuts = [rows.length * i // count for i in range(count + 1)]
        for begin, end in zip(cuts[:-1], cuts[1:]):
            part = rows._replace(start=rows.start + begin, length=end - begin,
                                 position=rows.position + begin)
            parts.append(_Pair(part, pair.keys, pair.query_offset + begin))
    return parts
