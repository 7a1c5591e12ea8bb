"""The whole sequence back from every rank's shard (:func:`unshard_sequence`, an all-gather),
after the handshake: the ranks' shards must agree in dtype and shape (a packed batch's in length
as cu_seqlens gives each rank's), or an all-gather of unequal messages would abort a rank and
leave its peers with entries never filled."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .call_checks import ShardRows, handshake
from .collectives import _AllGather
from .layout import Sharding, _check_cu_seqlens, _check_layout, _global_order, _sequence_dim
from .layout import resolve_group


def unshard_sequence(x: Tensor, group=None, dim: Optional[int] = None, layout: str = "zigzag",
                     *, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """The whole sequence along ``dim`` from every rank's shard ``x`` (an all-gather), on every
    rank; differentiable: a shard's gradient sums what every rank's use of the whole sent it.
    With ``cu_seqlens``, ``x`` is this rank's shard of a packed batch of documents (as
    :func:`shard_sequence` cuts it; ``dim`` 0 by default, else 2). The ranks' shards must have
    one dtype and shape (a packed batch's: the lengths cu_seqlens gives), and ``dim``,
    ``layout`` and ``cu_seqlens`` one value: every rank raises the same error otherwise
    (TypeError for a dtype, ValueError else)."""
    caller = "causal_attention.distributed.unshard_sequence"
    group, _, world = resolve_group(caller, group)
    dim = _sequence_dim(dim, cu_seqlens)
    rows = None if cu_seqlens is None else ShardRows.of(dim, cu_seqlens, world, layout)
    handshake(caller, group, {"x": x, "cu_seqlens": cu_seqlens}, {"dim": dim, "layout": layout},
              rows)
    _check_layout(caller, layout)
    if not isinstance(x, Tensor):
        raise TypeError(f"{caller}: x must be a Tensor, got {type(x).__name__}")
    if not _valid_dim(dim, x):
        raise ValueError(f"{caller}: dim must be an int in [-{x.dim()}, {x.dim()}) for x of "
                         f"shape {tuple(x.shape)}, got dim={dim!r}")
    if cu_seqlens is None:
        if layout == "zigzag" and x.shape[dim] % 2:
            raise ValueError(f"{caller}: a zigzag shard holds two equal chunks, so "
                             f"x.shape[{dim}] must be even, got {x.shape[dim]}")
        sharding = Sharding(x.shape[dim] * world, world, layout)
    else:
        bounds = _check_cu_seqlens(caller, cu_seqlens)
        sharding = Sharding(bounds[-1], world, layout, bounds)
        # Each shard padded to the longest (gloo gathers equal messages); the order skips the
        # padding.
        longest = max(sharding.shard_length(r) for r in range(world))
        pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, longest - x.shape[dim]]
        x = F.pad(x, pad)
    whole = torch.cat(_AllGather.apply(x, group).unbind(0), dim)
    order = _global_order(sharding, x.device)
    return whole if order is None else whole.index_select(dim, order.to_sequence)


def _valid_dim(dim, x: Tensor) -> bool:
    return not isinstance(dim, bool) and isinstance(dim, int) and -x.dim() <= dim < x.dim()
