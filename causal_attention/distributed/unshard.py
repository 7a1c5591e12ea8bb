"""The whole sequence back from every rank's shard (:func:`unshard_sequence`, an all-gather),
after the handshake: the ranks' shards must agree in dtype and shape, or an all-gather of unequal
messages would abort a rank and leave its peers with entries never filled."""

import torch
from torch import Tensor

from .call_checks import handshake
from .collectives import _AllGather
from .layout import _check_layout, _global_order, resolve_group


def unshard_sequence(x: Tensor, group=None, dim: int = 2, layout: str = "zigzag") -> Tensor:
    """The whole sequence along ``dim`` from every rank's shard ``x`` (an all-gather), on every
    rank; differentiable: a shard's gradient sums what every rank's use of the whole sent it.
    The ranks' shards must have one dtype and shape, and ``dim`` and ``layout`` one value: every
    rank raises the same error otherwise (TypeError for a dtype, ValueError else)."""
    caller = "causal_attention.distributed.unshard_sequence"
    group, _, world = resolve_group(caller, group)
    handshake(caller, group, {"x": x}, {"dim": dim, "layout": layout})
    _check_layout(caller, layout)
    if not isinstance(x, Tensor):
        raise TypeError(f"{caller}: x must be a Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{caller}: dim must be an int in [-{x.dim()}, {x.dim()}) for x of "
                         f"shape {tuple(x.shape)}, got dim={dim!r}")
    if layout == "zigzag" and x.shape[dim] % 2:
        raise ValueError(f"{caller}: a zigzag shard holds two equal chunks, so x.shape[{dim}] "
                         f"must be even, got {x.shape[dim]}")
    whole = torch.cat(_AllGather.apply(x, group).unbind(0), dim)
    order = _global_order(x.shape[dim], world, layout, x.device)
    return whole if order is None else whole.index_select(dim, order.to_sequence)
