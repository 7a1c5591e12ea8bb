"""The group and the layout: which process group a call runs over, and which tokens of the
sequence each rank's shard holds (``"zigzag"`` or ``"contiguous"``, see the package's
docstring), with a sequence's shards and their order (unshard.py gathers them back)."""

import functools
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("zigzag", "contiguous")


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
