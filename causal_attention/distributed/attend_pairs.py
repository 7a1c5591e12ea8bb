"""Attention over (query chunk, key chunk) pairs, what the ring and the all-gather run at each of
their steps: the call's entry (the handshake and checks, a packed batch seen as one sequence),
a pair's partial output merged into the running one by their lse, the sinks joined once, and a
pair's gradients from the rows' lse and delta over every key they see, with the sinks'."""

import math
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import ops
from .call_checks import _begin_call
from .layout import Chunk, Sharding
from .ring_schedule import _Pair


class _PairOptions(NamedTuple):
    """The score options every pair's kernel call takes."""

    scale: float
    window: Tuple[int, int]
    softcap: Optional[float]
    alibi_slopes: Optional[Tensor]


class _Call(NamedTuple):
    """A checked call: the group, this rank, the sharding, q, k and v as ``(B, H, L/N, D)``
    (a packed batch's tokens as one sequence of ``(1, H, tokens, D)``) and the options."""

    group: object
    rank: int
    sharding: Sharding
    q: Tensor
    k: Tensor
    v: Tensor
    options: _PairOptions


def _begin_attention(caller: str, q, k, v, group, *, scale, window, softcap, alibi_slopes,
                     sinks, layout, cu_seqlens, max_seqlen) -> _Call:
    """The handshake and every check of a ring or all-gather call, alike on every rank."""
    group, rank, window, sharding = _begin_call(
        caller, group,
        [("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes), ("sinks", sinks)],
        scale=scale, window=window, softcap=softcap, layout=layout, cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen)
    if cu_seqlens is not None:
        # The packed tokens seen as one sequence of (1, H, tokens, D), a view (the kernel ops
        # read any strides): the pairs keep to their documents, and the ops take each pair's
        # rows and keys as dense slices.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    elif k.shape[-2] != q.shape[-2]:
        raise ValueError(f"{caller}: q and k must hold the same tokens (the shards of one "
                         f"sequence), got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # The op's own checks (heads, dims, options) on this rank's call: every rank's call has the
    # same shapes but a packed shard's length, so each raises the same error.
    ops.attention_forward(q[..., :0, :], k[..., :0, :], v[..., :0, :], scale, window=window,
                          softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    return _Call(group, rank, sharding, q, k, v,
                 _PairOptions(scale, window, softcap, alibi_slopes))


def _end_attention(call: _Call, out: Tensor, lse: Tensor, return_lse: bool):
    """The call's result in its inputs' layout (a packed batch's: ``(tokens, Hq, Dv)`` and the
    lse ``(Hq, tokens)``)."""
    if call.sharding.cu_seqlens is not None:
        # squeeze, not [0]: its gradient is a view, where select's copies the whole output.
        out, lse = out.squeeze(0).transpose(0, 1), lse.squeeze(0)  # laid out as q
    return (out, lse) if return_lse else out


def _rows(t: Tensor, chunk: Chunk) -> Tensor:
    return t.narrow(-2, chunk.start, chunk.length)


def _lse_rows(t: Tensor, chunk: Chunk) -> Tensor:
    return t.narrow(-1, chunk.start, chunk.length)


def _memory_order(t: Tensor) -> List[int]:
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def _zeros_in_order(like: Tensor, last: int, dtype: torch.dtype) -> Tensor:
    """Zeros of ``like``'s shape but ``last`` in its last dim, laid out in memory as ``like`` is
    (its dims by decreasing stride): for a packed batch's (1, H, tokens, D) view, a view of a
    (tokens, H, last) tensor, which its caller gets (and autograd passes on) without a copy."""
    order = _memory_order(like)
    shape = [*like.shape[:-1], last]
    zeros = torch.zeros([shape[d] for d in order], dtype=dtype, device=like.device)
    return zeros.permute([order.index(d) for d in range(like.dim())])


def _joined_rows(parts: List[Tensor], like: Tensor) -> Tensor:
    """The parts joined along the rows, laid out as ``like`` (one part so laid out already is
    not copied)."""
    if len(parts) == 1 and _memory_order(parts[0]) == _memory_order(like):
        return parts[0]
    joined = _zeros_in_order(like, parts[0].shape[-1], parts[0].dtype)
    start = 0
    for part in parts:
        joined.narrow(-2, start, part.shape[-2]).copy_(part)
        start += part.shape[-2]
    return joined


def _running_output(q: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """The merged output (laid out as q) and lse before any pair, in the accumulation dtype."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (_zeros_in_order(q, v.shape[-1], acc),
            q.new_full(q.shape[:-1], -math.inf, dtype=acc))


def _merge_into(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """``out`` and ``lse`` (in the accumulation dtype) over the union of their keys and a
    disjoint set's (``part_out``, ``part_lse``), in place; rows that see neither stay zero with
    lse -inf."""
    merged = torch.logaddexp(lse, part_lse)
    finite = merged.masked_fill(torch.isneginf(merged), 0)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1))
    out.addcmul_(part_out, torch.exp(part_lse - finite).unsqueeze(-1))
    lse.copy_(merged)


def _forward_operand(t: Tensor) -> Tensor:
    """What a step's forward computes with: bfloat16 and float16 widened to float32, so that
    each step's output is not rounded to 8 or 11 bits before the merge (in float32) and the
    backward's delta = rowsum(dO o O) is formed from it: from rounded outputs it measured up to
    1.9x the single-process op's dQ error, from these exactly the op's; float32 and float64 as
    they are. (The backward's own steps keep the inputs' dtype: they recompute P in float32.)"""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _attend_pairs(q: Tensor, k: Tensor, v: Tensor, pairs: List[_Pair], out: Tensor, lse: Tensor,
                  options: _PairOptions) -> None:
    """The pairs' rows' output and lse merged with the pairs' keys (``k`` and ``v`` hold them;
    ``q`` is the forward operand, :func:`_forward_operand`)."""
    if not pairs:
        return
    k, v = _forward_operand(k), _forward_operand(v)
    for pair in pairs:
        rows, keys = pair.rows, pair.keys
        part_out, part_lse = ops.attention_forward(
            _rows(q, rows), _rows(k, keys), _rows(v, keys), options.scale,
            window=options.window, softcap=options.softcap, alibi_slopes=options.alibi_slopes,
            query_offset=pair.query_offset)
        _merge_into(_rows(out, rows), _lse_rows(lse, rows), part_out, part_lse)


def _with_sinks(out: Tensor, lse: Tensor, sinks: Optional[Tensor]):
    """Each row's output and lse with its head's sink in the softmax denominator, from those
    without it (the sink joins once, after every step is merged)."""
    if sinks is None:
        return out, lse
    sink = sinks.to(lse.dtype).view(-1, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    finite = total.masked_fill(torch.isneginf(total), 0)
    return out * torch.exp(lse - finite).unsqueeze(-1), total


def _forward_result(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor],
                    out_acc: Tensor, lse: Tensor, options: _PairOptions):
    """The merged output with the sinks, rounded once to q's dtype, and its lse; the autograd
    context keeps what the backward needs."""
    out_acc, lse = _with_sinks(out_acc, lse, sinks)
    out = out_acc.to(q.dtype)
    ctx.save_for_backward(q, k, v, out_acc, out, lse, sinks)
    ctx.options = options
    ctx.mark_non_differentiable(lse)
    return out, lse


# Rows at a time of _rowsum_of_products: its float64 scratch stays small.
_ROWSUM_ROWS = 256


def _rowsum_of_products(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``rowsum(a o b)`` in ``dtype``, the products in ``dtype`` summed in float64, a block of
    rows at a time: a float32 sum's rounding, amplified in dS = P o (dP - delta) where dP and
    delta nearly cancel, measured up to 1.45x the single-process op's float32 dQ error (which
    then had another summation order than the op's own delta), 1.08x summed so."""
    out = torch.empty(a.shape[:-1], dtype=dtype, device=a.device)
    for start in range(0, a.shape[-2], _ROWSUM_ROWS):
        rows = min(_ROWSUM_ROWS, a.shape[-2] - start)
        products = a.narrow(-2, start, rows).to(dtype) * b.narrow(-2, start, rows)
        out.narrow(-1, start, rows).copy_(products.sum(-1, dtype=torch.float64))
    return out


class _RowStatistics:
    """The rows' lse and delta = rowsum(dO o O) over every key they see, delta from the merged
    output in the accumulation dtype, summed in float64 (each pair's kernel takes both as
    given); a row part's, contiguous, for every key part it meets."""

    def __init__(self, grad_out: Tensor, out_acc: Tensor, lse: Tensor):
        self.lse = lse
        self.delta = _rowsum_of_products(grad_out, out_acc, lse.dtype)
        self.parts: Dict[Chunk, Tuple[Tensor, Tensor]] = {}

    def of(self, rows: Chunk) -> Tuple[Tensor, Tensor]:
        if rows not in self.parts:
            self.parts[rows] = (_lse_rows(self.lse, rows).contiguous(),
                                _lse_rows(self.delta, rows).contiguous())
        return self.parts[rows]


def _pair_gradients(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    statistics: _RowStatistics, pair: _Pair, options: _PairOptions):
    """The pair's shares of dQ (its rows) and dK, dV (its keys), in the accumulation dtype."""
    rows, keys = pair.rows, pair.keys
    rows_lse, rows_delta = statistics.of(rows)
    dq, dk, dv, _ = ops.attention_backward(
        _rows(grad_out, rows), _rows(q, rows), _rows(k, keys), _rows(v, keys), _rows(out, rows),
        rows_lse, options.scale, window=options.window, softcap=options.softcap,
        alibi_slopes=options.alibi_slopes, query_offset=pair.query_offset, delta=rows_delta)
    return dq, dk, dv


def _backward_start(ctx, grad_out: Tensor):
    """What the forward kept, the rows' statistics and dQ's sum (zeros) for the backward."""
    q, k, v, out_acc, out, lse, sinks = ctx.saved_tensors
    dq = _zeros_in_order(q, q.shape[-1], lse.dtype)
    return q, k, v, out, sinks, _RowStatistics(grad_out, out_acc, lse), dq


def _backward_result(ctx, q, k, v, sinks, statistics: _RowStatistics, dq, dk, dv):
    """The gradients of the Function's inputs (q, k, v, sinks, then two not differentiable),
    in their dtypes. The sinks': d lse / d sink_h = P_sink, and d out / d sink_h = -P_sink out:
    this rank's rows' share, which the gradient sync of replicated parameters sums over the
    group."""
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[3]:
        lse = statistics.lse
        p_sink = torch.exp(sinks.to(lse.dtype).view(-1, 1) - lse)
        dsinks = -(p_sink * statistics.delta).sum(-1).reshape(-1, sinks.shape[0]).sum(0).to(
            sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None
