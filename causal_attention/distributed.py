"""Context parallelism: exact attention over a sequence sharded across the ranks of a
``torch.distributed`` process group, forward and backward, on torch.distributed's own backends
(gloo on the CPU; NCCL or any other unchanged where the tensors live elsewhere).

- :func:`ring_attention`: each rank keeps its queries; the K/V shards travel the ring with
  ``batch_isend_irecv``, the next shard in flight while the current one is computed, and each
  step's partial output is merged with the running one by their log-sum-exp. The backward passes
  dK/dV around the ring with the shards (ring-flash-attention's scheme), recomputing every block
  from the merged lse. A rank holds at most two K/V shards (and two dK/dV) at once.
- :func:`ulysses_attention` (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head
  shards, the op runs on whole sequences for ``H / N`` heads, and an all-to-all turns the output
  back.

Layouts. ``"contiguous"``: rank ``r`` holds tokens ``[r L/N, (r + 1) L/N)``. ``"zigzag"`` (the
default, for causal load balance): the sequence is cut into ``2N`` chunks and rank ``r`` holds
chunks ``r`` and ``2N - 1 - r``, so every rank sees the same number of (query, key) pairs.
:func:`shard_sequence`, :func:`unshard_sequence` and :func:`shard_positions` (the global
positions of a shard, for rotary embeddings) convert.

Every step calls the kernel ops with ``query_offset``, the key position of its first query row,
so the caller's window and ALiBi apply to global positions unchanged; the backward gives the
kernel the rows' delta, which is over all the keys a row sees, not the step's. Steps whose key
shard lies outside every local row's window are skipped, and steps dead for every rank are not
run, so their shards are never sent. Sinks join each row once, after the merge.

Each call first exchanges a description of its arguments (dtypes, shapes, options) among the
ranks, with a timeout, and every rank raises the same error when they disagree, so no rank is
left waiting in a collective its peers never reach.
"""

import datetime
import functools
import math
import warnings
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from .ops import check_window

LAYOUTS = ("zigzag", "contiguous")

# How long a call waits for every rank to describe its arguments before it gives up.
HANDSHAKE_TIMEOUT = datetime.timedelta(seconds=120)


# --- the group and the layout ---------------------------------------------------------------


def resolve_group(caller: str, group) -> Tuple[dist.ProcessGroup, int, int]:
    """``(group, rank, world_size)`` for a ProcessGroup, a 1-D DeviceMesh or None (the default
    group). Raises ValueError when the caller is not a member."""
    if not dist.is_initialized():
        raise ValueError(f"{caller}: torch.distributed is not initialized "
                         "(torch.distributed.init_process_group)")
    if hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"{caller}: group must be a ProcessGroup or a 1-D DeviceMesh, got a "
                             f"DeviceMesh of {group.ndim} dims (pass mesh[dim_name])")
        group = group.get_group()
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{caller}: this process (global rank {dist.get_rank()}) is not a member "
                         "of group")
    return group, rank, dist.get_world_size(group)


class Chunk(NamedTuple):
    """Rows ``[start, start + length)`` of a shard hold global positions from ``position``."""

    start: int
    length: int
    position: int


def shard_chunks(shard_length: int, rank: int, world_size: int, layout: str) -> List[Chunk]:
    """The chunks of rank ``rank``'s shard of ``shard_length`` tokens."""
    if layout == "contiguous":
        return [Chunk(0, shard_length, rank * shard_length)]
    half = shard_length // 2
    return [Chunk(0, half, rank * half), Chunk(half, half, (2 * world_size - 1 - rank) * half)]


def _check_layout(caller: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{caller}: layout must be one of {LAYOUTS}, got layout={layout!r}")


def _check_divisible(caller: str, name: str, length: int, world_size: int, layout: str) -> None:
    parts = 2 * world_size if layout == "zigzag" else world_size
    if length % parts:
        raise ValueError(f"{caller}: the {layout} layout cuts the sequence into {parts} equal "
                         f"chunks ({'2N' if layout == 'zigzag' else 'N'}, N={world_size}), so "
                         f"{name} must be a multiple of {parts}, got {length}")


def shard_positions(seq_len: int, group=None, layout: str = "zigzag",
                    device=None) -> Tensor:
    """The global positions (int64, ``(seq_len / N,)``) of this rank's shard of a sequence of
    ``seq_len`` tokens: what rotary embeddings of the shard need."""
    caller = "causal_attention.distributed.shard_positions"
    _check_layout(caller, layout)
    _, rank, world = resolve_group(caller, group)
    _check_divisible(caller, "seq_len", seq_len, world, layout)
    return _positions(shard_chunks(seq_len // world, rank, world, layout), device)


def _positions(chunks: List[Chunk], device) -> Tensor:
    return torch.cat([torch.arange(c.position, c.position + c.length, device=device)
                      for c in chunks])


def shard_sequence(x: Tensor, group=None, dim: int = 2, layout: str = "zigzag") -> Tensor:
    """This rank's shard of ``x`` (the whole sequence along ``dim``, the same on every rank);
    differentiable (a slice)."""
    caller = "causal_attention.distributed.shard_sequence"
    _check_layout(caller, layout)
    _, rank, world = resolve_group(caller, group)
    _check_divisible(caller, f"x.shape[{dim}]", x.shape[dim], world, layout)
    chunks = shard_chunks(x.shape[dim] // world, rank, world, layout)
    return torch.cat([x.narrow(dim, c.position, c.length) for c in chunks], dim)


class _Order(NamedTuple):
    """``to_sequence`` puts the ranks' shards, concatenated in rank order, in sequence order;
    ``to_shards`` puts them back."""

    to_sequence: Tensor
    to_shards: Tensor


@functools.lru_cache(maxsize=64)  # per shape and device, not per call (the tensors are shared)
def _global_order(shard_length: int, world: int, layout: str,
                  device: torch.device) -> Optional[_Order]:
    """The orders of a sequence sharded in ``layout``; None where the shards are in sequence
    order already (contiguous)."""
    if layout == "contiguous":
        return None
    order = torch.empty(shard_length * world, dtype=torch.long)
    for r in range(world):
        for c in shard_chunks(shard_length, r, world, layout):
            order[c.position:c.position + c.length] = torch.arange(
                r * shard_length + c.start, r * shard_length + c.start + c.length)
    return _Order(order.to(device), torch.argsort(order).to(device))


def unshard_sequence(x: Tensor, group=None, dim: int = 2, layout: str = "zigzag") -> Tensor:
    """The whole sequence along ``dim`` from every rank's shard ``x`` (an all-gather), on every
    rank; differentiable: a shard's gradient sums what every rank's use of the whole sent it."""
    caller = "causal_attention.distributed.unshard_sequence"
    _check_layout(caller, layout)
    group, _, world = resolve_group(caller, group)
    if layout == "zigzag" and x.shape[dim] % 2:
        raise ValueError(f"{caller}: a zigzag shard holds two equal chunks, so x.shape[{dim}] "
                         f"must be even, got {x.shape[dim]}")
    whole = torch.cat(_AllGather.apply(x, group).unbind(0), dim)
    order = _global_order(x.shape[dim], world, layout, x.device)
    return whole if order is None else whole.index_select(dim, order.to_sequence)


# --- differentiable collectives ------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 to rank i, and rank i's chunk to place i; its gradient goes back the same
    way."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


class _AllGather(torch.autograd.Function):
    """Every rank's x stacked along a new dim 0, in rank order; a rank's gradient is the sum of
    what every rank's use sent it, summed in rank order (the same bits on every run)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        received = _AllToAll.apply(grad.contiguous(), ctx.group)
        total = received[0].clone()
        for part in received[1:]:
            total += part
        return total, None


# --- the handshake --------------------------------------------------------------------------

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_MAX_DIMS = 6


def _describe(t) -> List[int]:
    """A tensor as ints: dtype code (-1 absent, 98 not a tensor, 99 another dtype), dims, sizes
    padded to _MAX_DIMS."""
    if t is None:
        return [-1, 0] + [0] * _MAX_DIMS
    if not isinstance(t, Tensor):
        return [98, 0] + [0] * _MAX_DIMS
    sizes = list(t.shape)[:_MAX_DIMS]
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
    return [dtype, t.dim()] + sizes + [0] * (_MAX_DIMS - len(sizes))


def _shape_of(row: Sequence[int]) -> str:
    if row[0] in (-1, 98):
        return "None" if row[0] == -1 else "not a tensor"
    dtype = _DTYPES[row[0]] if row[0] < len(_DTYPES) else "another dtype"
    return f"{tuple(row[2:2 + row[1]])} {dtype}"


def handshake(caller: str, group, named: Sequence[Tuple[str, Optional[Tensor]]],
              settings: Sequence[int], setting_names: str) -> None:
    """Every rank describes the tensors ``named`` and the ints ``settings``; raises the same
    error on every rank when any of them differs between ranks (TypeError for a dtype,
    ValueError else), naming the argument and what each rank gave. Waits HANDSHAKE_TIMEOUT for
    the peers, then raises RuntimeError (a peer that never called)."""
    rows = [_describe(t) for _, t in named]
    mine = torch.tensor([x for row in rows for x in row] + list(settings), dtype=torch.long)
    if dist.get_backend(group) != "gloo":
        mine = mine.to(next(t.device for _, t in named if isinstance(t, Tensor)))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    try:
        work.wait(timeout=HANDSHAKE_TIMEOUT)
    except RuntimeError as error:
        raise RuntimeError(f"{caller}: not every rank of the group called within "
                           f"{HANDSHAKE_TIMEOUT}: {error}") from error
    table = torch.stack(gathered).cpu().tolist()
    width = len(rows[0])
    for i, (name, _) in enumerate(named):
        per_rank = [row[i * width:(i + 1) * width] for row in table]
        if any(r[0] != per_rank[0][0] for r in per_rank):
            seen = ", ".join(f"rank {r}: {_shape_of(x)}" for r, x in enumerate(per_rank))
            raise TypeError(f"{caller}: {name} must have the same dtype on every rank, got {seen}")
        if any(r != per_rank[0] for r in per_rank):
            seen = ", ".join(f"rank {r}: {_shape_of(x)}" for r, x in enumerate(per_rank))
            raise ValueError(f"{caller}: {name} must have the same shape on every rank (equal "
                             f"shards), got {seen}")
    tail = [row[len(rows) * width:] for row in table]
    if any(t != tail[0] for t in tail):
        seen = ", ".join(f"rank {r}: {t}" for r, t in enumerate(tail))
        raise ValueError(f"{caller}: {setting_names} must be the same on every rank, got {seen}")


def _bits(value: Optional[float]) -> int:
    """A float option as an int for the handshake (its bits, so that any difference shows)."""
    if value is None:
        return -1
    return int(torch.tensor(float(value), dtype=torch.float64).view(torch.int64).item())


def _settings(window, softcap, dropout_p: float, layout: str) -> List[int]:
    return [window[0], window[1], _bits(softcap), _bits(dropout_p), LAYOUTS.index(layout)]


def _begin_call(caller: str, group, layout: str, window, softcap, named, dropout_p=0.0):
    """What every call checks first, on this rank and then among the ranks (the handshake over
    ``named``, q, k and v first): returns the group, this rank, the world size and the window."""
    _check_layout(caller, layout)
    window = check_window(caller, window)
    group, rank, world = resolve_group(caller, group)
    handshake(caller, group, named, _settings(window, softcap, dropout_p, layout),
              "window, softcap, dropout_p and layout")
    # After the handshake: every rank has the same kinds and shapes, so raises alike.
    q, k, v = (t for _, t in named[:3])
    _check_local(caller, q, k, v)
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"{caller}: a zigzag shard holds chunks r and 2N-1-r of equal length, so "
                         f"the shard length must be even (the sequence a multiple of 2N="
                         f"{2 * world}), got q.shape[-2]={q.shape[-2]}")
    return group, rank, world, window


def _check_local(caller: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """q, k and v are tensors (B, H, L/N, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{caller}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{caller}: {name} must be (B, H, L/N, D), 4 dims, got "
                             f"{name}.shape={tuple(t.shape)}")


# --- merging partial results ----------------------------------------------------------------


def _merge_into(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """``out`` and ``lse`` (in the accumulation dtype) over the union of their keys and a
    disjoint set's (``part_out``, ``part_lse``), in place; rows that see neither stay zero with
    lse -inf."""
    merged = torch.logaddexp(lse, part_lse)
    finite = merged.masked_fill(torch.isneginf(merged), 0)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1))
    out.addcmul_(part_out, torch.exp(part_lse - finite).unsqueeze(-1))
    lse.copy_(merged)


def _with_sinks(out: Tensor, lse: Tensor, sinks: Optional[Tensor]):
    """Each row's output and lse with its head's sink in the softmax denominator, from those
    without it (the sink joins once, after every step is merged)."""
    if sinks is None:
        return out, lse
    sink = sinks.to(lse.dtype).view(-1, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    finite = total.masked_fill(torch.isneginf(total), 0)
    return out * torch.exp(lse - finite).unsqueeze(-1), total


# --- ring attention -------------------------------------------------------------------------


class _Pair(NamedTuple):
    """A query chunk against a key chunk of one ring step, with the kernel's query_offset."""

    rows: Chunk
    keys: Chunk
    query_offset: int


def _pairs(q_chunks: List[Chunk], k_chunks: List[Chunk], window) -> List[_Pair]:
    """The (query chunk, key chunk) pairs in which some row sees some key under ``window``
    (global positions), in a fixed order."""
    left, right = window
    pairs = []
    for a in q_chunks:
        for b in k_chunks:
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


def _part_bounds(chunks: List[Chunk], min_part_keys: Optional[int]) -> List[Tuple[int, int]]:
    """The shard rows ``[begin, end)`` of each part: every chunk cut into equal parts of at least
    ``min_part_keys`` (None: whole chunks)."""
    per_chunk = 1 if min_part_keys is None else max(
        1, min(MAX_PARTS // len(chunks), chunks[0].length // min_part_keys))
    bounds = []
    for c in chunks:
        cuts = [c.start + c.length * i // per_chunk for i in range(per_chunk + 1)]
        bounds += list(zip(cuts[:-1], cuts[1:]))
    return bounds


class _Unit(NamedTuple):
    """What travels at once: part ``part`` of the K/V shard held at ring step ``step``."""

    step: int
    part: int


class _Ring:
    """The ring of one call: this rank's chunks, the parts of the shard it holds at each step and
    the (query chunk, key chunk) pairs each part computes, the steps that compute something on
    some rank, and the peers. Messages are tagged by the unit they belong to, so that each
    receive matches its send."""

    def __init__(self, group, rank: int, world: int, shard_length: int, layout: str, window,
                 min_part_keys: Optional[int]):
        self.group, self.rank, self.world = group, rank, world
        self.q_chunks = shard_chunks(shard_length, rank, world, layout)
        self.steps = self.steps_needed(shard_length, world, layout, window)
        self.bounds = _part_bounds(self.q_chunks, min_part_keys)
        self.parts = len(self.bounds)
        self.units = [_Unit(t, p) for t in range(self.steps) for p in range(self.parts)]
        self.unit_pairs = []
        for unit in self.units:
            source = shard_chunks(shard_length, (rank - unit.step) % world, world, layout)
            begin, end = self.bounds[unit.part]
            chunk = next(c for c in source if c.start <= begin < c.start + c.length)
            keys = Chunk(0, end - begin, chunk.position + begin - chunk.start)
            self.unit_pairs.append(_pairs(self.q_chunks, [keys], window))
        self.next, self.prev = self.global_rank(1), self.global_rank(-1)
        # After the last step each part's dK/dV sums go home: steps - 1 ranks back.
        self.home_to = self.global_rank(1 - self.steps)
        self.home_from = self.global_rank(self.steps - 1)

    @staticmethod
    @functools.lru_cache(maxsize=256)  # O(N^2) pairs checked: once per shape and window
    def steps_needed(shard_length: int, world: int, layout: str, window) -> int:
        """The steps up to the last one in which some rank computes something: the later ones
        are not run, and their shards are never sent. Every rank derives the same count from the
        layout and the window."""
        live = [
            t for t in range(world)
            if any(_pairs(shard_chunks(shard_length, r, world, layout),
                          shard_chunks(shard_length, (r - t) % world, world, layout), window)
                   for r in range(world))
        ]
        return max(live, default=0) + 1

    def global_rank(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.world)

    def own_part(self, t: Tensor, part: int) -> Tensor:
        begin, end = self.bounds[part]
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

    def receive(self, like: Sequence[Tensor], source: int, stream: int, unit: _Unit,
                dtype: Optional[torch.dtype] = None):
        """Posts the receives of a unit into new tensors shaped like ``like`` (in ``dtype``).
        Returns the tensors and the requests."""
        buffers = [torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for t in like]
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
            part = Chunk(rows.start + begin, end - begin, rows.position + begin)
            parts.append(_Pair(part, pair.keys, pair.query_offset + begin))
    return parts


def _wait(works) -> None:
    for work in works:
        work.wait()


class _Inbox:
    """The receives of one stream from one peer, posted a step ahead: the receive of unit i + P
    (the same part, next step) when unit i is taken, so that it is posted when the peer sends it
    (a large message waits for its receive). Units of step 0 are this rank's own."""

    def __init__(self, ring: _Ring, stream: int, source: int, like, dtype=None):
        self.ring, self.stream, self.source = ring, stream, source
        self.like, self.dtype = like, dtype
        self.pending = {}
        for i in range(ring.parts):
            self.post(i + ring.parts)

    def post(self, i: int) -> None:
        units = self.ring.units
        if i < len(units) and units[i].step > 0 and i not in self.pending:
            self.pending[i] = self.ring.receive(self.like(units[i].part), self.source,
                                                self.stream, units[i], self.dtype)

    def take(self, i: int) -> List[Tensor]:
        """Unit i's tensors, once here; posts the receive of unit i + P."""
        self.post(i + self.ring.parts)
        buffers, works = self.pending.pop(i)
        _wait(works)
        return buffers


class _Outbox:
    """The send in flight, with the tensors it reads: waited for when the next one starts (the
    peer posted its receive a step ahead), so one unit's tensors outlive its computation."""

    def __init__(self):
        self.in_flight = None

    def send(self, works_and_tensors) -> None:
        self.finish()
        self.in_flight = works_and_tensors

    def finish(self) -> None:
        if self.in_flight is not None:
            _wait(self.in_flight[0])
            self.in_flight = None


class _KVStream:
    """The K/V parts of a pass along the ring, in unit order: this rank's own at step 0, then
    each received from the previous rank, and passed on to the next rank as soon as it is here."""

    def __init__(self, ring: _Ring, k: Tensor, v: Tensor):
        self.ring = ring
        self.own = [(ring.own_part(k, p), ring.own_part(v, p)) for p in range(ring.parts)]
        self.inbox = _Inbox(ring, 0, ring.prev, lambda p: self.own[p])
        self.outbox = _Outbox()

    def get(self, i: int) -> Sequence[Tensor]:
        """Unit i's K and V, passed on to the next rank."""
        ring, unit = self.ring, self.ring.units[i]
        kv = self.own[unit.part] if unit.step == 0 else self.inbox.take(i)
        if unit.step + 1 < ring.steps:
            self.outbox.send(ring.send(kv, ring.next, 0, _Unit(unit.step + 1, unit.part)))
        return kv

    def finish(self) -> None:
        self.outbox.finish()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, rings: List[_Ring], scale: float, window, softcap,
                alibi_slopes):
        ring = rings[0]  # the forward's, whole chunks; rings[1] is the backward's
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out_acc = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=acc)
        lse = q.new_full(q.shape[:-1], -math.inf, dtype=acc)
        kv = _KVStream(ring, k, v)
        for i in range(len(ring.units)):
            held_k, held_v = kv.get(i)
            for pair in ring.unit_pairs[i]:
                rows, keys = pair.rows, pair.keys
                part_out, part_lse = ops.attention_forward(
                    _rows(q, rows), _rows(held_k, keys), _rows(held_v, keys), scale,
                    window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    query_offset=pair.query_offset)
                _merge_into(_rows(out_acc, rows), _lse_rows(lse, rows), part_out, part_lse)
            del held_k, held_v  # held by the outbox while they are sent, else freed
        kv.finish()
        out_acc, lse = _with_sinks(out_acc, lse, sinks)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_acc, out, lse, sinks)
        ctx.options = (rings[1], scale, window, softcap, alibi_slopes)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out_acc, out, lse, sinks = ctx.saved_tensors
        ring, scale, window, softcap, alibi_slopes = ctx.options
        acc = lse.dtype
        # delta = rowsum(dO o O) over every key a row sees, from the merged output in the
        # accumulation dtype: each step's kernel takes it as given, with the merged lse.
        delta = (grad_out.to(acc) * out_acc).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = _KVStream(ring, k, v)
        # Each part's dK/dV sums travel with it: received from the previous rank (the sums of
        # the ranks it has visited), this rank's share added in pair order, passed on; after the
        # last step they go home. The same bits on every run.
        sums_inbox = _Inbox(ring, 1, ring.prev, lambda p: kv.own[p], dtype=acc)
        outbox, home = _Outbox(), {}
        statistics = {}  # a row part's lse and delta, contiguous, for every key part it meets

        def statistics_of(rows: Chunk) -> Tuple[Tensor, Tensor]:
            if rows not in statistics:
                statistics[rows] = (_lse_rows(lse, rows).contiguous(),
                                    _lse_rows(delta, rows).contiguous())
            return statistics[rows]

        def sums_so_far(i: int, held_k: Tensor, held_v: Tensor) -> List[Tensor]:
            """Unit i's sums from the ranks before this one (zeros at this rank's own shard)."""
            if ring.units[i].step == 0:
                return [torch.zeros(held_k.shape, dtype=acc, device=k.device),
                        torch.zeros(held_v.shape, dtype=acc, device=v.device)]
            return sums_inbox.take(i)

        for i, unit in enumerate(ring.units):
            held_k, held_v = kv.get(i)
            if unit.step + 1 == ring.steps and ring.steps > 1:
                home[unit.part] = ring.receive(kv.own[unit.part], ring.home_from, 2, unit,
                                               dtype=acc)
            sums = None
            for pair in _row_parts(ring.unit_pairs[i]):
                rows, keys = pair.rows, pair.keys
                rows_lse, rows_delta = statistics_of(rows)
                dq_part, dk_part, dv_part, _ = ops.attention_backward(
                    _rows(grad_out, rows), _rows(q, rows), _rows(held_k, keys),
                    _rows(held_v, keys), _rows(out, rows), rows_lse, scale, window=window,
                    softcap=softcap, alibi_slopes=alibi_slopes, query_offset=pair.query_offset,
                    delta=rows_delta)
                _rows(dq, rows).add_(dq_part)
                if sums is None:  # waited for after the first pair's products
                    sums = sums_so_far(i, held_k, held_v)
                _rows(sums[0], keys).add_(dk_part)
                _rows(sums[1], keys).add_(dv_part)
                del dq_part, dk_part, dv_part
            if sums is None:  # no pair on this rank: the sums pass through
                sums = sums_so_far(i, held_k, held_v)
            if unit.step + 1 < ring.steps:
                outbox.send(ring.send(sums, ring.next, 1, _Unit(unit.step + 1, unit.part)))
            elif ring.steps > 1:
                outbox.send(ring.send(sums, ring.home_to, 2, unit))
            else:  # one step: the sums are home
                home[unit.part] = (sums, [])
            # What the outbox or the inbox does not hold is freed before the next unit.
            del held_k, held_v, sums
        kv.finish()
        outbox.finish()
        # The parts' sums, allocated as their last step comes, joined once the ring's buffers
        # are gone.
        for _, works in home.values():
            _wait(works)
        dk, dv = (torch.cat([home[p][0][piece] for p in range(ring.parts)], -2)
                  if ring.parts > 1 else home[0][0][piece] for piece in (0, 1))
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d lse / d sink_h = P_sink, and d out / d sink_h = -P_sink out: this rank's rows'
            # share, which the gradient sync of replicated parameters sums over the group.
            sink = sinks.to(acc).view(-1, 1)
            p_sink = torch.exp(sink - lse)
            dsinks = -(p_sink * delta).sum(-1).reshape(-1, sinks.shape[0]).sum(0).to(sinks.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None,
                None)


def _rows(t: Tensor, chunk: Chunk) -> Tensor:
    return t.narrow(-2, chunk.start, chunk.length)


def _lse_rows(t: Tensor, chunk: Chunk) -> Tensor:
    return t.narrow(-1, chunk.start, chunk.length)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *, scale: Optional[float] = None,
                   window: Sequence[int] = (-1, 0), softcap: Optional[float] = None,
                   alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                   layout: str = "zigzag", return_lse: bool = False):
    """Exact attention of this rank's queries over the whole sharded sequence, by ring attention.

    Args:
        q, k, v: this rank's shard, ``(B, Hq, L/N, D)``, ``(B, Hkv, L/N, D)``,
            ``(B, Hkv, L/N, Dv)``, the same shapes and dtype on every rank, in ``layout``.
        group: a ProcessGroup, a 1-D DeviceMesh, or None (the default group).
        scale, window, softcap, alibi_slopes, sinks: as :func:`causal_attention.attention`, over
            global positions (the window and ALiBi's distances are between tokens of the whole
            sequence). ``sinks`` is differentiable; its gradient on each rank is that rank's rows'
            share, summed over the group by the gradient sync of replicated parameters (DDP, or
            ``all_reduce``), like every other parameter's.
        layout: ``"zigzag"`` or ``"contiguous"`` (see the module's docstring).
        return_lse: also return the rows' lse (float32, float64 for float64), not
            differentiable.

    Returns:
        ``(B, Hq, L/N, Dv)``, this rank's rows of the output, in q's dtype (and the lse).

    The same inputs give bitwise the same results on every run, at any thread count: the steps,
    the merges and the dK/dV sums run in a fixed order. Differentiable in q, k, v and sinks;
    dropout, key_mask and attn_mask are not taken (:func:`ulysses_attention` takes key_mask).
    """
    caller = "causal_attention.distributed.ring_attention"
    group, rank, world, window = _begin_call(
        caller, group, layout, window, softcap,
        [("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes), ("sinks", sinks)])
    if k.shape[-2] != q.shape[-2]:
        raise ValueError(f"{caller}: q and k must hold the same tokens (the shards of one "
                         f"sequence), got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # The op's own checks (heads, dims, options) on this rank's call: every rank's call has the
    # same shapes, so each raises the same error.
    ops.attention_forward(q[..., :0, :], k[..., :0, :], v[..., :0, :], scale, window=window,
                          softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    rings = [_Ring(group, rank, world, q.shape[-2], layout, window, part_keys)
             for part_keys in (None, MIN_PART_KEYS)]
    out, lse = _RingAttention.apply(q, k, v, sinks, rings, scale, window, softcap, alibi_slopes)
    return (out, lse) if return_lse else out


# --- Ulysses --------------------------------------------------------------------------------


def _sequence_to_heads(x: Tensor, group, world: int, order: Optional[_Order]) -> Tensor:
    """(B, H, L/N, D) sequence shards -> (B, H/N, L, D) head shards, in sequence order."""
    b, h, length, d = x.shape
    send = x.reshape(b, world, h // world, length, d).transpose(0, 1).contiguous()
    received = _AllToAll.apply(send, group)
    whole = received.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * length, d)
    return whole if order is None else whole.index_select(2, order.to_sequence)


def _heads_to_sequence(x: Tensor, group, world: int, order: Optional[_Order]) -> Tensor:
    """The inverse of _sequence_to_heads."""
    b, h_local, total, d = x.shape
    if order is not None:
        x = x.index_select(2, order.to_shards)
    length = total // world
    send = x.reshape(b, h_local, world, length, d).permute(2, 0, 1, 3, 4).contiguous()
    received = _AllToAll.apply(send, group)
    return received.transpose(0, 1).reshape(b, world * h_local, length, d)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *,
                      scale: Optional[float] = None, key_mask: Optional[Tensor] = None,
                      window: Sequence[int] = (-1, 0), softcap: Optional[float] = None,
                      alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                      dropout_p: float = 0.0, generator: Optional[torch.Generator] = None,
                      layout: str = "zigzag") -> Tensor:
    """Exact attention of the sharded sequence by all-to-all (DeepSpeed-Ulysses): each rank
    attends whole sequences for ``Hq / N`` of the query heads.

    Args:
        q, k, v: this rank's shard as for :func:`ring_attention`; ``Hq`` must be a multiple of
            N. Where ``Hkv`` is not, K/V heads are repeated (with a warning) to the fewest that
            N divides and that divide ``Hq``.
        key_mask: optional bool ``(B, L/N)``, this rank's shard of the key mask.
        scale, window, softcap, alibi_slopes, sinks: as :func:`causal_attention.attention`;
            ``alibi_slopes`` and ``sinks`` are per query head (``(Hq,)`` or ``(B, Hq)``), each rank
            uses its heads'. ``sinks``' gradient on each rank is its heads' share (summed over
            the group by the gradient sync, as in :func:`ring_attention`).
        dropout_p, generator: attention dropout as :func:`causal_attention.attention`'s. Each
            rank draws one seed from ``generator`` (the default generator when None; seeded alike
            on every rank, it gives every rank the same draw) and drops its heads' probabilities
            with a generator seeded ``seed * N + rank``: the ranks' heads drop independently,
            and the same generator state gives the same masks. The masks are not the ones the
            unsharded call would draw (their heads are numbered per rank).
        layout: of the shards, ``"zigzag"`` or ``"contiguous"``.

    Returns:
        ``(B, Hq, L/N, Dv)``, this rank's rows, differentiable in q, k, v and sinks.
    """
    caller = "causal_attention.distributed.ulysses_attention"
    group, rank, world, window = _begin_call(
        caller, group, layout, window, softcap,
        [("q", q), ("k", k), ("v", v), ("key_mask", key_mask), ("alibi_slopes", alibi_slopes),
         ("sinks", sinks)], dropout_p)
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q % world:
        raise ValueError(f"{caller}: Ulysses gives each of the N={world} ranks Hq/N query heads, "
                         f"so Hq must be a multiple of N, got q.shape={tuple(q.shape)}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{caller}: Hq must be a multiple of Hkv, got q.shape={tuple(q.shape)}, "
                         f"k.shape={tuple(k.shape)}")
    if heads_kv % world:
        repeated = next(h for h in range(heads_kv, heads_q + 1, heads_kv)
                        if h % world == 0 and heads_q % h == 0)
        warnings.warn(f"{caller}: Hkv={heads_kv} is not a multiple of N={world}: K/V heads are "
                      f"repeated to {repeated} so that each rank gets whole K/V heads",
                      stacklevel=2)
        k = k.repeat_interleave(repeated // heads_kv, dim=1)
        v = v.repeat_interleave(repeated // heads_kv, dim=1)
    order = _global_order(q.shape[-2], world, layout, q.device)
    q_heads, k_heads, v_heads = (_sequence_to_heads(t, group, world, order) for t in (q, k, v))
    local = slice(rank * heads_q // world, (rank + 1) * heads_q // world)
    whole_mask = None
    if key_mask is not None:
        whole_mask = torch.cat(_AllGather.apply(key_mask, group).unbind(0), -1)
        if order is not None:
            whole_mask = whole_mask.index_select(-1, order.to_sequence)
    out = ops.attention(q_heads, k_heads, v_heads, scale=scale, key_mask=whole_mask,
                        window=window, softcap=softcap,
                        alibi_slopes=None if alibi_slopes is None else alibi_slopes[..., local],
                        sinks=None if sinks is None else sinks[local], dropout_p=dropout_p,
                        generator=rank_generator(generator, rank, world) if dropout_p else None)
    return _heads_to_sequence(out, group, world, order)


def rank_generator(generator: Optional[torch.Generator], rank: int, world: int):
    """This rank's dropout generator for a Ulysses call: one seed drawn from ``generator``,
    offset by the rank (see :func:`ulysses_attention`)."""
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator))
    return torch.Generator().manual_seed((seed * world + rank) % 2**64)


# --- for modules ----------------------------------------------------------------------------

METHODS = ("ring", "ulysses")


class ContextParallel(NamedTuple):
    """How a module attends a sharded sequence: the group, ``"ring"`` or ``"ulysses"``, and the
    shards' layout (see :meth:`causal_attention.CausalSelfAttention.set_context_parallel`)."""

    group: object
    method: str = "ring"
    layout: str = "zigzag"

    @staticmethod
    def of(caller: str, group, method: str, layout: str) -> "ContextParallel":
        if method not in METHODS:
            raise ValueError(f"{caller}: method must be one of {METHODS}, got method={method!r}")
        _check_layout(caller, layout)
        resolve_group(caller, group)
        return ContextParallel(group, method, layout)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
               dropout_p: float = 0.0, **options):
        """This rank's rows of attention over the whole sequence."""
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, self.group, key_mask=key_mask, layout=self.layout,
                                     dropout_p=dropout_p, **options)
        if key_mask is not None or dropout_p > 0:
            raise ValueError("causal_attention.distributed: a key_mask or attention dropout under "
                             "context parallelism is served by method='ulysses' (each rank sees "
                             "whole sequences); ring attention takes neither")
        return ring_attention(q, k, v, self.group, layout=self.layout, **options)

    def positions(self, shard_length: int, device=None) -> Tensor:
        """The global positions of this rank's shard of ``shard_length`` tokens."""
        caller = "causal_attention.distributed"
        _, rank, world = resolve_group(caller, self.group)
        _check_divisible(caller, "the sequence's length (N shards)", shard_length * world, world,
                         self.layout)
        return _positions(shard_chunks(shard_length, rank, world, self.layout), device)
