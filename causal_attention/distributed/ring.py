"""Ring attention: the autograd Function that runs the ring's steps forward (partial outputs
merged by their lse) and backward (dK/dV sums passed along the ring and sent home), and the
public :func:`ring_attention`."""

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import ops
from . import ring_schedule
from .call_checks import _begin_call
from .layout import Chunk
from .ring_schedule import _Ring, _Unit, _row_parts
from .ring_streams import _Inbox, _KVStream, _Outbox, _wait


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
        sums_inbox = _Inbox(ring, 1, ring.prev, (k, v), dtype=acc)
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
                own = kv.own[unit.part]
                home[unit.part] = ring.receive(own, own[0].shape[-2], ring.home_from, 2, unit,
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
                   layout: str = "zigzag", return_lse: bool = False,
                   cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None):
    """Exact attention of this rank's queries over the whole sharded sequence, by ring attention.

    Args:
        q, k, v: this rank's shard, ``(B, Hq, L/N, D)``, ``(B, Hkv, L/N, D)``,
            ``(B, Hkv, L/N, Dv)``, the same shapes and dtype on every rank, in ``layout``. With
            ``cu_seqlens``, this rank's tokens of a packed batch in varlen_attention's layout,
            ``(tokens, Hq, D)``, ``(tokens, Hkv, D)``, ``(tokens, Hkv, Dv)``, as
            :func:`shard_sequence` (``cu_seqlens=cu_seqlens``) cuts them.
        group: a ProcessGroup, a 1-D DeviceMesh, or None (the default group).
        scale, window, softcap, alibi_slopes, sinks: as :func:`causal_attention.attention`, over
            global positions (the window and ALiBi's distances are between tokens of the whole
            sequence; of a packed batch, between positions within each document). ``sinks`` is
            differentiable; its gradient on each rank is that rank's rows' share, summed over
            the group by the gradient sync of replicated parameters (DDP, or ``all_reduce``),
            like every other parameter's.
        layout: ``"zigzag"`` or ``"contiguous"`` (see the module's docstring).
        return_lse: also return the rows' lse (float32, float64 for float64), not
            differentiable.
        cu_seqlens: the packed batch's document boundaries, int32 ``(documents + 1,)`` from 0,
            the same on every rank (varlen_attention's, of the whole batch): each document
            attends only to itself, causally and windowed on its own positions.
        max_seqlen: optional, at least the longest document's length (flash-attn's argument).

    Returns:
        ``(B, Hq, L/N, Dv)``, this rank's rows of the output, in q's dtype (and the lse,
        ``(B, Hq, L/N)``); packed: ``(tokens, Hq, Dv)`` (and ``(Hq, tokens)``).

    The same inputs give bitwise the same results on every run, at any thread count: the steps,
    the merges and the dK/dV sums run in a fixed order. Differentiable in q, k, v and sinks;
    dropout, key_mask and attn_mask are not taken (:func:`ulysses_attention` takes key_mask).
    """
    caller = "causal_attention.distributed.ring_attention"
    group, rank, window, sharding = _begin_call(
        caller, group,
        [("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes), ("sinks", sinks)],
        scale=scale, window=window, softcap=softcap, layout=layout, cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen)
    packed = cu_seqlens is not None
    if packed:
        # The packed tokens as one sequence of (1, H, tokens, D): the ring's pairs keep to their
        # documents, and the kernel ops take each pair's rows and keys as dense slices.
        q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    elif k.shape[-2] != q.shape[-2]:
        raise ValueError(f"{caller}: q and k must hold the same tokens (the shards of one "
                         f"sequence), got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # The op's own checks (heads, dims, options) on this rank's call: every rank's call has the
    # same shapes, so each raises the same error.
    ops.attention_forward(q[..., :0, :], k[..., :0, :], v[..., :0, :], scale, window=window,
                          softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    # MIN_PART_KEYS read from its module at each call, as _Ring reads MAX_PARTS and
    # MIN_PART_ROWS, so that setting ring_schedule.MIN_PART_KEYS reaches every call.
    rings = [_Ring(group, rank, sharding, window, part_keys)
             for part_keys in (None, ring_schedule.MIN_PART_KEYS)]
    out, lse = _RingAttention.apply(q, k, v, sinks, rings, scale, window, softcap, alibi_slopes)
    if packed:
        out, lse = out[0].transpose(0, 1).contiguous(), lse[0]
    return (out, lse) if return_lse else out
