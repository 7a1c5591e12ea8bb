"""Ulysses attention (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head shards,
the op runs on whole sequences (or varlen_attention on a whole packed batch) for ``H / N``
heads, and an all-to-all turns the output back; with the per-rank dropout generator it draws."""

import warnings
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from .. import ops
from .call_checks import _begin_call
from .collectives import _AllGather, _AllToAll
from .layout import _global_order, _Order


def _sequence_to_heads(x: Tensor, group, world: int, order: Optional[_Order]) -> Tensor:
    """(B, H, L/N, D) sequence shards -> (B, H/N, L, D) head shards, in sequence order."""
    b, h, length, d = x.shape
    send = x.reshape(b, world, h // world, length, d).transpose(0, 1).contiguous()
    received = _AllToAll.apply(send, group)
    whole = received.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * length, d)
    return whole if order is None else whole.index_select(2, order.to_sequence)


def _heads_to_sequence(x: Tensor, group, world: int, order: Optional[_Order]) -> Tensor:
    """The inverse of _sequence_to_heads."""
    b, h_local, total, d = x.shape
    if order is not None:
        x = x.index_select(2, order.to_shards)
    length = total // world
    send = x.reshape(b, h_local, world, length, d).permute(2, 0, 1, 3, 4).contiguous()
    received = _AllToAll.apply(send, group)
    return received.transpose(0, 1).reshape(b, world * h_local, length, d)


def _packed_to_heads(x: Tensor, group, world: int, lengths: List[int],
                     order: Optional[_Order]) -> Tensor:
    """This rank's tokens of a packed batch, (tokens, H, D) -> every token of the batch for
    H/N heads, (T, H/N, D), in the batch's order (the ranks' shards may differ in length)."""
    tokens, h, d = x.shape
    send = x.reshape(tokens, world, h // world, d).transpose(0, 1).reshape(-1, h // world, d)
    whole = _AllToAll.apply(send, group, [tokens] * world, lengths)
    return whole if order is None else whole.index_select(0, order.to_sequence)


def _heads_to_packed(x: Tensor, group, world: int, lengths: List[int], rank: int,
                     order: Optional[_Order]) -> Tensor:
    """The inverse of _packed_to_heads."""
    if order is not None:
        x = x.index_select(0, order.to_shards)
    tokens, h_local, d = lengths[rank], x.shape[1], x.shape[2]
    received = _AllToAll.apply(x, group, lengths, [tokens] * world)
    return received.reshape(world, tokens, h_local, d).transpose(0, 1).reshape(tokens, -1, d)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *,
                      scale: Optional[float] = None, key_mask: Optional[Tensor] = None,
                      window: Sequence[int] = (-1, 0), softcap: Optional[float] = None,
                      alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                      dropout_p: float = 0.0, generator: Optional[torch.Generator] = None,
                      layout: str = "zigzag", cu_seqlens: Optional[Tensor] = None,
                      max_seqlen: Optional[int] = None) -> Tensor:
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
        dropout_p, generator: attention dropout as :func:`causal_attention.attention`'s. Each
            rank draws one seed from ``generator`` (the default generator when None; seeded alike
            on every rank, it gives every rank the same draw) and drops its heads' probabilities
            with a generator seeded ``seed * N + rank``: the ranks' heads drop independently,
            and the same generator state gives the same masks. The masks are not the ones the
            unsharded call would draw (their heads are numbered per rank).
        layout: of the shards, ``"zigzag"`` or ``"contiguous"``.
        cu_seqlens, max_seqlen: a packed batch of documents, as :func:`ring_attention` takes
            it (``(tokens, H, D)`` shards, no ``key_mask``): each rank attends every document
            for its heads by varlen_attention (``alibi_slopes`` ``(Hq,)`` or
            ``(documents, Hq)``).

    Returns:
        ``(B, Hq, L/N, Dv)``, this rank's rows (packed: ``(tokens, Hq, Dv)``), differentiable
        in q, k, v and sinks.
    """
    caller = "causal_attention.distributed.ulysses_attention"
    group, rank, window, sharding = _begin_call(
        caller, group,
        [("q", q), ("k", k), ("v", v), ("key_mask", key_mask), ("alibi_slopes", alibi_slopes),
         ("sinks", sinks)],
        scale=scale, window=window, softcap=softcap, layout=layout, dropout_p=dropout_p,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    world = sharding.world
    if cu_seqlens is not None and key_mask is not None:
        raise ValueError(f"{caller}: a packed batch (cu_seqlens) has no padding to mask: "
                         "key_mask must be None with cu_seqlens")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q % world:
        raise ValueError(f"{caller}: Ulysses gives each of the N={world} ranks Hq/N query heads, "
                         f"so Hq must be a multiple of N, got q.shape={tuple(q.shape)}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{caller}: Hq must be a multiple of Hkv, got q.shape={tuple(q.shape)}, "
                         f"k.shape={tuple(k.shape)}")
    if heads_kv % world:
        repeated = next(h for h in range(heads_kv, heads_q + 1, heads_kv)
                        if h % world == 0 and heads_q % h == 0)
        warnings.warn(f"{caller}: Hkv={heads_kv} is not a multiple of N={world}: K/V heads are "
                      f"repeated to {repeated} so that each rank gets whole K/V heads",
                      stacklevel=2)
        k = k.repeat_interleave(repeated // heads_kv, dim=1)
        v = v.repeat_interleave(repeated // heads_kv, dim=1)
    local = slice(rank * heads_q // world, (rank + 1) * heads_q // world)
    options = dict(scale=scale, window=window, softcap=softcap,
                   alibi_slopes=None if alibi_slopes is None else alibi_slopes[..., local],
                   sinks=None if sinks is None else sinks[local], dropout_p=dropout_p,
                   generator=rank_generator(generator, rank, world) if dropout_p else None)
    if cu_seqlens is not None:
        lengths = [sharding.shard_length(r) for r in range(world)]
        order = _global_order(sharding, q.device, padded=False)
        q_heads, k_heads, v_heads = (_packed_to_heads(t, group, world, lengths, order)
                                     for t in (q, k, v))
        longest = max(b - a for a, b in zip(sharding.cu_seqlens, sharding.cu_seqlens[1:]))
        out = ops.varlen_attention(q_heads, k_heads, v_heads, cu_seqlens, cu_seqlens, longest,
                                   longest, **options)
        return _heads_to_packed(out, group, world, lengths, rank, order)
    order = _global_order(sharding, q.device)
    q_heads, k_heads, v_heads = (_sequence_to_heads(t, group, world, order) for t in (q, k, v))
    whole_mask = None
    if key_mask is not None:
        whole_mask = torch.cat(_AllGather.apply(key_mask, group).unbind(0), -1)
        if order is not None:
            whole_mask = whole_mask.index_select(-1, order.to_sequence)
    out = ops.attention(q_heads, k_heads, v_heads, key_mask=whole_mask, **options)
    return _heads_to_sequence(out, group, world, order)


def rank_generator(generator: Optional[torch.Generator], rank: int, world: int):
    """This rank's dropout generator for a Ulysses call: one seed drawn from ``generator``,
    offset by the rank (see :func:`ulysses_attention`)."""
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator))
    return torch.Generator().manual_seed((seed * world + rank) % 2**64)
