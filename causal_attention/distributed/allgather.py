"""All-gather attention (llama3's context parallelism): each rank gathers every rank's K/V, one
part of each shard at a time (the next part's gather in flight while the current one is
computed), attends its own rows to them, and in the backward sends each part's dK/dV shares to
the part's owner, which sums them in rank order; and the public :func:`allgather_attention`."""

from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import ring_schedule
from .attend_pairs import (_attend_pairs, _backward_result, _backward_start, _begin_attention,
                           _end_attention, _forward_operand, _forward_result, _joined_rows,
                           _pair_gradients, _PairOptions, _rows, _running_output)
from .layout import Sharding, _cuts
from .ring_schedule import _pairs, _part_chunks, _part_count, _row_parts


class _Gathering:
    """The schedule of one call: every shard cut in the same number of parts (near-equal row
    ranges, as the ring's), gathered part by part, each rank's padded to the part's longest
    (gloo gathers equal messages), and the pairs this rank's rows make with each rank's part."""

    def __init__(self, group, rank: int, sharding: Sharding, window, min_part_keys: int):
        self.group, self.world = group, sharding.world
        self.parts = _part_count(sharding, min_part_keys)
        self.bounds = [list(zip(cuts[:-1], cuts[1:])) for cuts in
                       (_cuts(sharding.shard_length(r), self.parts) for r in range(self.world))]
        self.longest = [max(b[p][1] - b[p][0] for b in self.bounds) for p in range(self.parts)]
        q_chunks = sharding.chunks(rank)
        # pairs[p][s]: this rank's rows against rank s's part p.
        self.pairs = [[_pairs(q_chunks, _part_chunks(sharding.chunks(s), *self.bounds[s][p]),
                              window) for s in range(self.world)] for p in range(self.parts)]
        self.own = self.bounds[rank]

    def own_part(self, t: Tensor, part: int) -> Tensor:
        begin, end = self.own[part]
        return t.narrow(-2, begin, end - begin)

    def _flat(self, tensors: Sequence[Tensor], part: int) -> Tensor:
        """The tensors' rows of ``part`` padded to the part's longest, as one flat message."""
        return torch.cat([F.pad(t, (0, 0, 0, self.longest[part] - t.shape[-2])).reshape(-1)
                          for t in tensors])

    def _unflat(self, flat: Tensor, like: Sequence[Tensor], part: int,
                rows: int) -> List[Tensor]:
        """The tensors of a message of ``_flat``, ``rows`` rows of each."""
        out, start = [], 0
        for t in like:
            shape = (*t.shape[:-2], self.longest[part], t.shape[-1])
            size = torch.Size(shape).numel()
            out.append(flat[start:start + size].view(shape).narrow(-2, 0, rows))
            start += size
        return out

    def _gather(self, k: Tensor, v: Tensor, part: int):
        """Starts gathering every rank's K/V part ``part``."""
        mine = self._flat([self.own_part(k, part), self.own_part(v, part)], part)
        received = [torch.empty_like(mine) for _ in range(self.world)]
        return received, dist.all_gather(received, mine, group=self.group, async_op=True)

    def each_part(self, k: Tensor, v: Tensor) -> Iterator[Tuple[int, List[List[Tensor]]]]:
        """Each part and every rank's K and V of it, in part order, the next part's gather
        started before the current one is given."""
        pending = self._gather(k, v, 0)
        for part in range(self.parts):
            received, work = pending
            work.wait()
            if part + 1 < self.parts:
                pending = self._gather(k, v, part + 1)
            yield part, [self._unflat(flat, (k, v), part, end - begin)
                         for flat, (begin, end) in zip(received, (b[part] for b in self.bounds))]
            del received

    def send_home(self, sums: List[List[Tensor]], part: int):
        """Starts sending each rank's part's dK/dV shares (``sums[s]``) to rank s; returns what
        :meth:`home` waits for."""
        mine = torch.stack([self._flat(s, part) for s in sums])
        received = torch.empty_like(mine)
        work = dist.all_to_all_single(received, mine, group=self.group, async_op=True)
        return part, received, work

    def home(self, like: Sequence[Tensor], pending) -> List[Tensor]:
        """This rank's part's dK/dV: every rank's shares summed in rank order."""
        part, received, work = pending
        work.wait()
        begin, end = self.own[part]
        total = received[0].clone()
        for share in received[1:]:
            total += share
        return self._unflat(total, like, part, end - begin)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, gathering: _Gathering, options: _PairOptions):
        out_acc, lse = _running_output(q, v)
        q_forward = _forward_operand(q)
        for p, parts in gathering.each_part(k, v):
            for s, (held_k, held_v) in enumerate(parts):
                _attend_pairs(q_forward, held_k, held_v, gathering.pairs[p][s], out_acc, lse,
                              options)
            del parts
        out, lse = _forward_result(ctx, q, k, v, sinks, out_acc, lse, options)
        ctx.gathering = gathering
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, sinks, statistics, dq = _backward_start(ctx, grad_out)
        gathering, acc = ctx.gathering, dq.dtype
        # Each part's dK/dV go home while the next part is computed, then are taken: a rank
        # holds the shares of two parts at most.
        sending, homes = None, []
        for p, parts in gathering.each_part(k, v):
            sums = []
            for s, (held_k, held_v) in enumerate(parts):
                dk_s = torch.zeros(held_k.shape, dtype=acc, device=k.device)
                dv_s = torch.zeros(held_v.shape, dtype=acc, device=v.device)
                for pair in _row_parts(gathering.pairs[p][s]):
                    dq_part, dk_part, dv_part = _pair_gradients(
                        grad_out, q, held_k, held_v, out, statistics, pair, ctx.options)
                    _rows(dq, pair.rows).add_(dq_part)
                    _rows(dk_s, pair.keys).add_(dk_part)
                    _rows(dv_s, pair.keys).add_(dv_part)
                sums.append([dk_s, dv_s])
            del parts
            if sending is not None:
                homes.append(gathering.home((k, v), sending))
            sending = gathering.send_home(sums, p)
            del sums
        homes.append(gathering.home((k, v), sending))
        dk, dv = (_joined_rows([home[i] for home in homes], like) for i, like in ((0, k), (1, v)))
        return _backward_result(ctx, q, k, v, sinks, statistics, dq, dk, dv)


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *,
                        scale: Optional[float] = None, window: Sequence[int] = (-1, 0),
                        softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                        sinks: Optional[Tensor] = None, layout: str = "zigzag",
                        return_lse: bool = False, cu_seqlens: Optional[Tensor] = None,
                        max_seqlen: Optional[int] = None):
    """Exact attention of this rank's queries over the whole sharded sequence (or packed batch),
    by all-gather (llama3's context parallelism): arguments, results and errors as
    :func:`ring_attention`'s.

    Every rank gathers every rank's K/V in parts of at least ``ring_schedule.MIN_PART_KEYS``
    keys of the shortest shard (at most ``MAX_PARTS``), so that it holds N parts at once (and
    the next N in flight), never the whole sequence; the backward sends each part's dK/dV shares
    to its owner (an all-to-all), which sums them in rank order: bitwise the same results on
    every run. It moves every K/V shard to every rank once, where the ring moves them around
    the ring in N steps, each overlapped with a step's computation.
    """
    call = _begin_attention(
        "causal_attention.distributed.allgather_attention", q, k, v, group, scale=scale,
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, layout=layout,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    gathering = _Gathering(call.group, call.rank, call.sharding, call.options.window,
                           ring_schedule.MIN_PART_KEYS)
    out, lse = _AllGatherAttention.apply(call.q, call.k, call.v, sinks, gathering, call.options)
    return _end_attention(call, out, lse, return_lse)
