"""The group and the layout: which process group a call runs over, and which tokens of the
sequence, or of the packed batch of documents (``cu_seqlens``), each rank's shard holds
(``"zigzag"`` or ``"contiguous"``, see the package's docstring), with the shards' order
(unshard.py gathers them back)."""

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
    """Rows ``[start, start + length)`` of a shard hold positions from ``position`` of document
    ``document`` of a packed batch (a dense sequence is document 0, its positions global)."""

    start: int
    length: int
    position: int
    document: int = 0


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


def _check_cu_seqlens(caller: str, cu_seqlens) -> Tuple[int, ...]:
    """The documents' boundaries of a packed batch: int32 ``(documents + 1,)`` from 0, never
    decreasing (varlen_attention's cu_seqlens, the same on every rank)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32:
        seen = cu_seqlens.dtype if isinstance(cu_seqlens, Tensor) else type(cu_seqlens).__name__
        raise TypeError(f"{caller}: cu_seqlens must be an int32 Tensor, got {seen}")
    bounds = tuple(cu_seqlens.tolist()) if cu_seqlens.dim() == 1 else ()
    if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{caller}: cu_seqlens must be 1-D (documents + 1,), from 0 and never "
                         f"decreasing, got shape {tuple(cu_seqlens.shape)}: "
                         f"{cu_seqlens.tolist()}")
    return bounds


def _cuts(length: int, parts: int) -> List[int]:
    """The bounds of ``length`` rows cut into ``parts`` as equal as they can be."""
    return [length * i // parts for i in range(parts + 1)]


@functools.lru_cache(maxsize=256)  # per batch of documents, not per call
def _packed_chunks(cu_seqlens: Tuple[int, ...], rank: int, world: int,
                   layout: str) -> Tuple[Chunk, ...]:
    """The chunks of rank ``rank``'s shard of a packed batch: ``"zigzag"`` cuts each document
    into 2N near-equal chunks and gives rank r chunks r and 2N - 1 - r of every document (so the
    ranks' causal work is equal whatever the documents' lengths); ``"contiguous"`` gives rank r
    tokens ``[r T/N, (r + 1) T/N)`` of the batch, cut where documents end."""
    chunks: List[Chunk] = []

    def add(length: int, position: int, document: int) -> None:
        if length <= 0:
            return
        last = chunks[-1] if chunks else Chunk(0, 0, 0, -1)
        if last.document == document and last.position + last.length == position:
            # Rank N - 1's two chunks of a document meet: one chunk, one kernel call a pair.
            chunks[-1] = last._replace(length=last.length + length)
        else:
            chunks.append(Chunk(last.start + last.length, length, position, document))

    documents = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
    if layout == "zigzag":
        for d, (begin, end) in enumerate(documents):
            cuts = _cuts(end - begin, 2 * world)
            for c in (rank, 2 * world - 1 - rank):
                add(cuts[c + 1] - cuts[c], cuts[c], d)
    else:
        low, high = _cuts(cu_seqlens[-1], world)[rank:rank + 2]
        for d, (begin, end) in enumerate(documents):
            add(min(end, high) - max(begin, low), max(begin, low) - begin, d)
    return tuple(chunks)


class Sharding(NamedTuple):
    """How ``length`` tokens are cut over ``world`` ranks in ``layout``: one sequence, or a
    packed batch of documents with boundaries ``cu_seqlens``. Every rank derives every rank's
    chunks from it (receive buffers are sized by them)."""

    length: int
    world: int
    layout: str
    cu_seqlens: Optional[Tuple[int, ...]] = None

    def chunks(self, rank: int) -> List[Chunk]:
        if self.cu_seqlens is None:
            return shard_chunks(self.length // self.world, rank, self.world, self.layout)
        return list(_packed_chunks(self.cu_seqlens, rank, self.world, self.layout))

    def shard_length(self, rank: int) -> int:
        return sum(c.length for c in self.chunks(rank))

    def first_token(self, chunk: Chunk) -> int:
        """The chunk's first token's index in the whole sequence (or packed batch)."""
        if self.cu_seqlens is None:
            return chunk.position
        return self.cu_seqlens[chunk.document] + chunk.position


def _sharding(caller: str, group, layout: str, name: str, length: int,
              cu_seqlens) -> Tuple[Sharding, int]:
    """The sharding of ``length`` tokens (``name``; a dense sequence's must divide into the
    layout's equal chunks, a packed batch's must be cu_seqlens' last value), and this rank."""
    _check_layout(caller, layout)
    _, rank, world = resolve_group(caller, group)
    if cu_seqlens is None:
        _check_divisible(caller, name, length, world, layout)
        return Sharding(length, world, layout), rank
    bounds = _check_cu_seqlens(caller, cu_seqlens)
    if bounds[-1] != length:
        raise ValueError(f"{caller}: cu_seqlens must end at the packed batch's length, {name}="
                         f"{length}, got cu_seqlens[-1]={bounds[-1]}")
    return Sharding(length, world, layout, bounds), rank


def _token_index(sharding: Sharding, rank: int, device=None) -> Tensor:
    """The index in the whole sequence (or packed batch) of each token of rank ``rank``'s
    shard."""
    return torch.cat([torch.arange(sharding.first_token(c), sharding.first_token(c) + c.length,
                                   device=device) for c in sharding.chunks(rank)]
                     or [torch.empty(0, dtype=torch.long, device=device)])


def shard_positions(seq_len: int, group=None, layout: str = "zigzag", device=None, *,
                    cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """The positions (int64, one per token of this rank's shard) of this rank's shard of a
    sequence of ``seq_len`` tokens: global ones, or with ``cu_seqlens`` (a packed batch of
    ``seq_len`` tokens) each token's position within its document. What rotary embeddings of
    the shard need."""
    caller = "causal_attention.distributed.shard_positions"
    sharding, rank = _sharding(caller, group, layout, "seq_len", seq_len, cu_seqlens)
    return _positions(sharding.chunks(rank), device)


def _positions(chunks: List[Chunk], device) -> Tensor:
    return torch.cat([torch.arange(c.position, c.position + c.length, device=device)
                      for c in chunks] or [torch.empty(0, dtype=torch.long, device=device)])


def shard_cu_seqlens(cu_seqlens: Tensor, group=None, layout: str = "zigzag") -> Tensor:
    """This rank's document boundaries (int32 ``(documents + 1,)``, a document this rank holds
    no token of is empty): the shard's tokens of document ``i`` are rows
    ``[local[i], local[i + 1])`` of :func:`shard_sequence`'s result."""
    caller = "causal_attention.distributed.shard_cu_seqlens"
    bounds = _check_cu_seqlens(caller, cu_seqlens)
    sharding, rank = _sharding(caller, group, layout, "cu_seqlens[-1]", bounds[-1],
                               cu_seqlens)
    lengths = [0] * (len(bounds) - 1)
    for c in sharding.chunks(rank):
        lengths[c.document] += c.length
    return torch.tensor([0] + lengths, dtype=torch.int32, device=cu_seqlens.device).cumsum(
        0, dtype=torch.int32)


def shard_sequence(x: Tensor, group=None, dim: Optional[int] = None, layout: str = "zigzag", *,
                   cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """This rank's shard of ``x`` (the whole sequence along ``dim``, the same on every rank);
    differentiable (a slice). With ``cu_seqlens``, ``x`` is a packed batch of documents along
    ``dim`` (varlen_attention's ``(tokens, H, D)``: ``dim`` 0, the default then; else 2)."""
    caller = "causal_attention.distributed.shard_sequence"
    dim = _sequence_dim(dim, cu_seqlens)
    sharding, rank = _sharding(caller, group, layout, f"x.shape[{dim}]", x.shape[dim],
                               cu_seqlens)
    if cu_seqlens is not None:
        return x.index_select(dim, _token_index(sharding, rank, x.device))
    return torch.cat([x.narrow(dim, c.position, c.length) for c in sharding.chunks(rank)], dim)


def _sequence_dim(dim: Optional[int], cu_seqlens) -> int:
    """The sequence's dim by default: a packed batch's tokens (0) or (B, H, L, D)'s L (2)."""
    if dim is not None:
        return dim
    return 2 if cu_seqlens is None else 0


class _Order(NamedTuple):
    """``to_sequence`` puts the ranks' shards, concatenated in rank order (each padded to the
    longest), in sequence order; ``to_shards`` puts them back (where none is padded)."""

    to_sequence: Tensor
    to_shards: Tensor


@functools.lru_cache(maxsize=64)  # per sharding and device, not per call (the tensors are shared)
def _global_order(sharding: Sharding, device: torch.device,
                  padded: bool = True) -> Optional[_Order]:
    """The orders of a sequence sharded by ``sharding``, its shards concatenated each padded to
    the longest (or not); None where the concatenated shards are in sequence order already (a
    contiguous layout's equal shards)."""
    lengths = [sharding.shard_length(r) for r in range(sharding.world)]
    if sharding.layout == "contiguous" and min(lengths) == max(lengths):
        return None
    order = torch.cat([_token_index(sharding, r) for r in range(sharding.world)])
    if padded:
        starts = [r * max(lengths) for r in range(sharding.world)]
    else:
        starts = [sum(lengths[:r]) for r in range(sharding.world)]
    places = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, lengths)])
    to_sequence = torch.empty_like(order)
    to_sequence[order] = places
    return _Order(to_sequence.to(device), torch.argsort(to_sequence).to(device))
