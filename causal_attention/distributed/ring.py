"""Ring attention: the autograd Function that runs the ring's steps forward (partial outputs
merged by their lse) and backward (dK/dV sums passed along the ring and sent home), and the
public :func:`ring_attention`."""

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from . import ring_schedule
from .attend_pairs import (_attend_pairs, _backward_result, _backward_start, _begin_attention,
                           _end_attention, _forward_operand, _forward_result, _joined_rows,
                           _pair_gradients, _PairOptions, _rows, _running_output)
from .ring_schedule import _Ring, _Unit, _row_parts
from .ring_streams import _Inbox, _KVStream, _Outbox, _wait


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, rings: List[_Ring], options: _PairOptions):
        ring = rings[0]  # the forward's, whole chunks; rings[1] is the backward's
        out_acc, lse = _running_output(q, v)
        q_forward = _forward_operand(q)
        kv = _KVStream(ring, k, v)
        for i in range(len(ring.units)):
            held_k, held_v = kv.get(i)
            _attend_pairs(q_forward, held_k, held_v, ring.unit_pairs[i], out_acc, lse, options)
            del held_k, held_v  # held by the outbox while they are sent, else freed
        kv.finish()
        out, lse = _forward_result(ctx, q, k, v, sinks, out_acc, lse, options)
        ctx.ring = rings[1]
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, sinks, statistics, dq = _backward_start(ctx, grad_out)
        ring, acc = ctx.ring, dq.dtype
        kv = _KVStream(ring, k, v)
        # Each part's dK/dV sums travel with it: received from the previous rank (the sums of
        # the ranks it has visited), this rank's share added in pair order, passed on; after the
        # last step they go home. The same bits on every run.
        sums_inbox = _Inbox(ring, 1, ring.prev, (k, v), dtype=acc)
        outbox, home = _Outbox(), {}

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
                dq_part, dk_part, dv_part = _pair_gradients(grad_out, q, held_k, held_v, out,
                                                            statistics, pair, ctx.options)
                _rows(dq, pair.rows).add_(dq_part)
                if sums is None:  # waited for after the first pair's products
                    sums = sums_so_far(i, held_k, held_v)
                _rows(sums[0], pair.keys).add_(dk_part)
                _rows(sums[1], pair.keys).add_(dv_part)
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
        dk, dv = (_joined_rows([home[p][0][piece] for p in range(ring.parts)], like)
                  for piece, like in ((0, k), (1, v)))
        return _backward_result(ctx, q, k, v, sinks, statistics, dq, dk, dv)


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
    call = _begin_attention(
        "causal_attention.distributed.ring_attention", q, k, v, group, scale=scale,
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, layout=layout,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    # MIN_PART_KEYS read from its module at each call, as _Ring reads MAX_PARTS and
    # MIN_PART_ROWS, so that setting ring_schedule.MIN_PART_KEYS reaches every call.
    rings = [_Ring(call.group, call.rank, call.sharding, call.options.window, part_keys)
             for part_keys in (None, ring_schedule.MIN_PART_KEYS)]
    out, lse = _RingAttention.apply(call.q, call.k, call.v, sinks, rings, call.options)
    return _end_attention(call, out, lse, return_lse)
