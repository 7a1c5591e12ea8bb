"""Differentiable collectives: an all-to-all and an all-gather whose gradients go back over the
same collectives (what unsharding a sequence and Ulysses' head exchange are built on)."""

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 to rank i, and rank i's chunk to place i: equal chunks, or ``sent[i]``
    rows to rank i and ``received[i]`` from it; its gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, group, sent=None, received=None) -> Tensor:
        ctx.group, ctx.sizes = group, (sent, received)
        if received is None:
            out = torch.empty_like(x)
        else:
            out = x.new_empty((sum(received), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=received,
                               input_split_sizes=sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        sent, received = ctx.sizes
        return _AllToAll.apply(grad.contiguous(), ctx.group, received, sent), None, None, None


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
