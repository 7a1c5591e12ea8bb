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
    chunks = shard_chunks(seq_len // world, rank, world, layout)
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


def _global_order(shard_length: int, world: int, layout: str) -> Optional[Tensor]:
    """The index that puts the ranks' shards, concatenated in rank order, in sequence order;
    None where they already are (contiguous)."""
    if layout == "contiguous":
        return None
    order = torch.empty(shard_length * world, dtype=torch.long)
    for r in range(world):
        for c in shard_chunks(shard_length, r, world, layout):
            order[c.position:c.position + c.length] = torch.arange(
                r * shard_length + c.start, r * shard_length + c.start + c.length)
    return order


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
    order = _global_order(x.shape[dim], world, layout)
    return whole if order is None else whole.index_select(dim, order.to(x.device))


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


def _describe(t: Optional[Tensor]) -> List[int]:
    """A tensor as ints: dtype code (-1 absent, 99 other), dims, sizes padded to _MAX_DIMS."""
    if t is None:
        return [-1, 0] + [0] * _MAX_DIMS
    sizes = list(t.shape)[:_MAX_DIMS]
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
    return [dtype, t.dim()] + sizes + [0] * (_MAX_DIMS - len(sizes))


def _shape_of(row: Sequence[int]) -> str:
    if row[0] == -1:
        return "None"
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
    device = named[0][1].device
    if dist.get_backend(group) != "gloo":
        mine = mine.to(device)
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


def _settings(window, softcap, layout: Optional[str]) -> List[int]:
    """The options as ints, for the handshake (softcap's bits, so that any difference shows)."""
    cap = -1 if softcap is None else int(torch.tensor(float(softcap), dtype=torch.float64)
                                         .view(torch.int64).item())
    return [window[0], window[1], cap, -1 if layout is None else LAYOUTS.index(layout)]


def _check_local(caller: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """The checks the gathered shapes do not make: layout of the tensors (B, H, L, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{caller}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{caller}: {name} must be (B, H, L/N, D), 4 dims, got "
                             f"{name}.shape={tuple(t.shape)}")


# --- merging partial results ----------------------------------------------------------------


def _merge(out: Optional[Tensor], lse: Optional[Tensor], part_out: Tensor, part_lse: Tensor):
    """The output and lse over the union of two disjoint key sets, from each one's (out in the
    accumulation dtype, lse); rows that see neither stay zero with lse -inf."""
    part_out = part_out.to(part_lse.dtype)
    if out is None:
        return part_out, part_lse
    merged = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isneginf(merged), torch.zeros_like(merged), merged)
    out = (out * torch.exp(lse - finite).unsqueeze(-1)
           + part_out * torch.exp(part_lse - finite).unsqueeze(-1))
    return out, merged


def _with_sinks(out: Tensor, lse: Tensor, sinks: Optional[Tensor]):
    """Each row's output and lse with its head's sink in the softmax denominator, from those
    without it (the sink joins once, after every step is merged)."""
    if sinks is None:
        return out, lse
    sink = sinks.to(lse.dtype).view(-1, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    finite = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
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


class _Ring:
    """The ring of one call: this rank's chunks and those of the shard it holds at each step,
    the steps that compute something on some rank, and the peers."""

    def __init__(self, group, rank: int, world: int, shard_length: int, layout: str, window):
        self.group, self.rank, self.world = group, rank, world
        self.q_chunks = shard_chunks(shard_length, rank, world, layout)
        self.global_next = dist.get_global_rank(group, (rank + 1) % world)
        self.global_prev = dist.get_global_rank(group, (rank - 1) % world)
        self.steps = self.steps_needed(shard_length, world, layout, window)
        self.step_pairs = [
            _pairs(self.q_chunks, shard_chunks(shard_length, (rank - t) % world, world, layout),
                   window) for t in range(self.steps)
        ]

    @staticmethod
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

    def exchange(self, send: Sequence[Tensor], receive: Sequence[Tensor], to: int, source: int,
                 tag: int):
        """Starts sending ``send`` to global rank ``to`` and receiving ``receive`` from
        ``source``; returns the requests to wait on."""
        if not send and not receive:
            return []
        p2p = [dist.P2POp(dist.isend, t, to, self.group, tag + i) for i, t in enumerate(send)]
        p2p += [dist.P2POp(dist.irecv, t, source, self.group, tag + i)
                for i, t in enumerate(receive)]
        return dist.batch_isend_irecv(p2p)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _rows(t: Tensor, chunk: Chunk) -> Tensor:
    return t.narrow(-2, chunk.start, chunk.length)


def _lse_rows(t: Tensor, chunk: Chunk) -> Tensor:
    return t.narrow(-1, chunk.start, chunk.length)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, ring: _Ring, scale: float, window, softcap, alibi_slopes):
        k, v = k.contiguous(), v.contiguous()
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        outs: List[Optional[Tensor]] = [None] * len(ring.q_chunks)
        lses: List[Optional[Tensor]] = [None] * len(ring.q_chunks)
        held = (k, v)
        for t in range(ring.steps):
            incoming = (torch.empty_like(k), torch.empty_like(v)) if t + 1 < ring.steps else ()
            requests = ring.exchange(held if incoming else (), incoming, ring.global_next,
                                     ring.global_prev, tag=0)
            for pair in ring.step_pairs[t]:
                a = ring.q_chunks.index(pair.rows)
                part_out, part_lse = ops.attention_forward(
                    _rows(q, pair.rows), _rows(held[0], pair.keys), _rows(held[1], pair.keys),
                    scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    query_offset=pair.query_offset)
                outs[a], lses[a] = _merge(outs[a], lses[a], part_out, part_lse)
            _wait(requests)
            if incoming:
                held = incoming
        # A chunk no step reached sees no key: zeros, lse -inf.
        shape = q.shape[:-2]
        for a, c in enumerate(ring.q_chunks):
            if outs[a] is None:
                outs[a] = q.new_zeros(*shape, c.length, v.shape[-1], dtype=acc)
                lses[a] = q.new_full((*shape, c.length), -math.inf, dtype=acc)
        out_acc, lse = torch.cat(outs, -2), torch.cat(lses, -1)
        out_acc, lse = _with_sinks(out_acc, lse, sinks)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_acc, lse, sinks)
        ctx.options = (ring, scale, window, softcap, alibi_slopes)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out_acc, lse, sinks = ctx.saved_tensors
        ring, scale, window, softcap, alibi_slopes = ctx.options
        acc = lse.dtype
        grad_out = grad_out.contiguous()
        # delta = rowsum(dO o O) over every key a row sees, from the merged output in the
        # accumulation dtype: each step's kernel takes it as given, with the merged lse.
        delta = (grad_out.to(acc) * out_acc).sum(-1)
        out = out_acc.to(q.dtype)  # read only for its shape: the kernel takes delta as given
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        held = (k, v)
        # dK, dV of the shard held, summed over the ranks it has visited, in ring order.
        carried: Tuple[Tensor, ...] = ()
        carried_requests: list = []
        for t in range(ring.steps):
            incoming = (torch.empty_like(k), torch.empty_like(v)) if t + 1 < ring.steps else ()
            requests = ring.exchange(held if incoming else (), incoming, ring.global_next,
                                     ring.global_prev, tag=0)
            own = [torch.zeros(k.shape, dtype=acc, device=k.device),
                   torch.zeros(v.shape, dtype=acc, device=v.device)]
            for pair in ring.step_pairs[t]:
                rows, keys = pair.rows, pair.keys
                dq_part, dk_part, dv_part, _ = ops.attention_backward(
                    _rows(grad_out, rows), _rows(q, rows), _rows(held[0], keys),
                    _rows(held[1], keys), _rows(out, rows),
                    _lse_rows(lse, rows).contiguous(), scale, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, query_offset=pair.query_offset,
                    delta=_lse_rows(delta, rows).contiguous())
                _rows(dq, rows).add_(dq_part)
                _rows(own[0], keys).add_(dk_part)
                _rows(own[1], keys).add_(dv_part)
            _wait(carried_requests)
            if carried:
                own[0] = carried[0].add_(own[0])
                own[1] = carried[1].add_(own[1])
            # The last step sends each shard's sums home: the owner of the shard held then is
            # steps - 1 ranks back (the next rank when every step runs).
            last = t + 1 == ring.steps
            to = ring.global_rank(-(ring.steps - 1)) if last else ring.global_next
            source = ring.global_rank(ring.steps - 1) if last else ring.global_prev
            carried = (torch.empty_like(own[0]), torch.empty_like(own[1]))
            carried_requests = ring.exchange(own, carried, to, source, tag=2)
            _wait(requests)
            if incoming:
                held = incoming
        _wait(carried_requests)
        dk, dv = carried
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d lse / d sink_h = P_sink, and d out / d sink_h = -P_sink out: this rank's rows'
            # share, which the gradient sync of replicated parameters sums over the group.
            sink = sinks.to(acc).view(-1, 1)
            p_sink = torch.exp(sink - lse)
            dsinks = -(p_sink * delta).sum(-1).reshape(-1, sinks.shape[0]).sum(0).to(sinks.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None,
                None)


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
    _check_layout(caller, layout)
    window = check_window(caller, window)
    group, rank, world = resolve_group(caller, group)
    _check_local(caller, q, k, v)
    handshake(caller, group, [("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes),
                              ("sinks", sinks)], _settings(window, softcap, layout),
              "window, softcap and layout")
    if k.shape[-2] != q.shape[-2]:
        raise ValueError(f"{caller}: q and k must hold the same tokens (the shards of one "
                         f"sequence), got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}")
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"{caller}: a zigzag shard holds chunks r and 2N-1-r of equal length, so "
                         f"the shard length must be even (the sequence a multiple of 2N="
                         f"{2 * world}), got q.shape[-2]={q.shape[-2]}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # The op's own checks (heads, dims, options) on this rank's call: every rank's call has the
    # same shapes, so each raises the same error.
    ops.attention_forward(q[..., :0, :], k[..., :0, :], v[..., :0, :], scale, window=window,
                          softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    ring = _Ring(group, rank, world, q.shape[-2], layout, window)
    out, lse = _RingAttention.apply(q, k, v, sinks, ring, scale, window, softcap, alibi_slopes)
    return (out, lse) if return_lse else out


# --- Ulysses --------------------------------------------------------------------------------


def _sequence_to_heads(x: Tensor, group, world: int, order: Optional[Tensor]) -> Tensor:
    """(B, H, L/N, D) sequence shards -> (B, H/N, L, D) head shards, in sequence order."""
    b, h, length, d = x.shape
    send = x.reshape(b, world, h // world, length, d).transpose(0, 1).contiguous()
    received = _AllToAll.apply(send, group)
    whole = received.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * length, d)
    return whole if order is None else whole.index_select(2, order.to(x.device))


def _heads_to_sequence(x: Tensor, group, world: int, order: Optional[Tensor]) -> Tensor:
    """The inverse of _sequence_to_heads."""
    b, h_local, total, d = x.shape
    if order is not None:
        x = x.index_select(2, torch.argsort(order).to(x.device))
    length = total // world
    send = x.reshape(b, h_local, world, length, d).permute(2, 0, 1, 3, 4).contiguous()
    received = _AllToAll.apply(send, group)
    return received.transpose(0, 1).reshape(b, world * h_local, length, d)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *,
                      scale: Optional[float] = None, key_mask: Optional[Tensor] = None,
                      window: Sequence[int] = (-1, 0), softcap: Optional[float] = None,
                      alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
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
        layout: of the shards, ``"zigzag"`` or ``"contiguous"``.

    Returns:
        ``(B, Hq, L/N, Dv)``, this rank's rows, differentiable in q, k, v and sinks.
    """
    caller = "causal_attention.distributed.ulysses_attention"
    _check_layout(caller, layout)
    window = check_window(caller, window)
    group, rank, world = resolve_group(caller, group)
    _check_local(caller, q, k, v)
    handshake(caller, group, [("q", q), ("k", k), ("v", v), ("key_mask", key_mask),
                              ("alibi_slopes", alibi_slopes), ("sinks", sinks)],
              _settings(window, softcap, layout), "window, softcap and layout")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q % world:
        raise ValueError(f"{caller}: Ulysses gives each of the N={world} ranks Hq/N query heads, "
                         f"so Hq must be a multiple of N, got q.shape={tuple(q.shape)}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{caller}: Hq must be a multiple of Hkv, got q.shape={tuple(q.shape)}, "
                         f"k.shape={tuple(k.shape)}")
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"{caller}: a zigzag shard holds two equal chunks, so the shard length "
                         f"must be even, got q.shape[-2]={q.shape[-2]}")
    if heads_kv % world:
        repeated = next(h for h in range(heads_kv, heads_q + 1, heads_kv)
                        if h % world == 0 and heads_q % h == 0)
        warnings.warn(f"{caller}: Hkv={heads_kv} is not a multiple of N={world}: K/V heads are "
                      f"repeated to {repeated} so that each rank gets whole K/V heads",
                      stacklevel=2)
        k = k.repeat_interleave(repeated // heads_kv, dim=1)
        v = v.repeat_interleave(repeated // heads_kv, dim=1)
    order = _global_order(q.shape[-2], world, layout)
    q_heads, k_heads, v_heads = (_sequence_to_heads(t, group, world, order) for t in (q, k, v))
    local = slice(rank * heads_q // world, (rank + 1) * heads_q // world)
    whole_mask = None
    if key_mask is not None:
        whole_mask = torch.cat(_AllGather.apply(key_mask, group).unbind(0), -1)
        if order is not None:
            whole_mask = whole_mask.index_select(-1, order.to(key_mask.device))
    out = ops.attention(q_heads, k_heads, v_heads, scale=scale, key_mask=whole_mask,
                        window=window, softcap=softcap,
                        alibi_slopes=None if alibi_slopes is None else alibi_slopes[..., local],
                        sinks=None if sinks is None else sinks[local])
    return _heads_to_sequence(out, group, world, order)


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

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], **options):
        """This rank's rows of attention over the whole sequence."""
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, self.group, key_mask=key_mask, layout=self.layout,
                                     **options)
        if key_mask is not None:
            raise ValueError("causal_attention.distributed: a key_mask under context parallelism "
                             "is served by method='ulysses' (each rank sees whole sequences); "
                             "ring attention takes none")
        return ring_attention(q, k, v, self.group, layout=self.layout, **options)

    def positions(self, shard_length: int, device=None) -> Tensor:
        """The global positions of this rank's shard of ``shard_length`` tokens."""
        _, _, world = resolve_group("causal_attention.distributed", self.group)
        return shard_positions(shard_length * world, self.group, self.layout, device)
