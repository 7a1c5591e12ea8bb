"""A serving step on a paged KV cache (:mod:`causal_attention.paged_kv_cache`): the new tokens'
keys and values written into their slots of the pages (:func:`paged_cache_append`, vLLM's
``reshape_and_cache``), and each layer's new queries attending through the pages
(:class:`PagedStep`, which :meth:`PagedKVCache.step` returns)."""

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .ops import paged_attention

if TYPE_CHECKING:  # for the annotation only: paged_kv_cache imports this module
    from .paged_kv_cache import PagedKVCache


def paged_cache_append(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                       slot_mapping: Tensor) -> None:
    """Writes token t's keys ``k[t] (Hkv, D)`` and values ``v[t] (Hkv, Dv)`` into slot
    ``slot_mapping[t]`` of the pages, in place: slot ``s`` is row ``s % page_size`` of page
    ``s // page_size`` (vLLM's ``reshape_and_cache``). Slots must be distinct and inside the
    pool; the cache is left untouched when any argument is refused."""
    fn = "causal_attention.paged_cache_append"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (num_pages, page_size, Hkv, D), got "
                             f"{_shape(t)}")
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous (its slots are rows of one "
                             f"view), got strides {t.stride()}")
    pages, page_size, heads, dim = k_cache.shape
    if tuple(v_cache.shape[:3]) != (pages, page_size, heads):
        raise ValueError(f"{fn}: k_cache and v_cache must agree in (num_pages, page_size, Hkv), "
                         f"got k_cache.shape={tuple(k_cache.shape)}, "
                         f"v_cache.shape={tuple(v_cache.shape)}")
    if not isinstance(slot_mapping, Tensor) or slot_mapping.dim() != 1:
        raise ValueError(f"{fn}: slot_mapping must be 1-D (tokens,), got {_shape(slot_mapping)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    tokens = slot_mapping.numel()
    expected = {"k": (tokens, heads, dim), "v": (tokens, heads, v_cache.size(3))}
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or tuple(t.shape) != expected[name]:
            raise ValueError(f"{fn}: {name} must be (tokens, Hkv, D{'v' if name == 'v' else ''})"
                             f" = {expected[name]} for slot_mapping.shape=({tokens},) and the "
                             f"cache's heads, got {_shape(t)}")
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if t.dtype != cache.dtype:
            raise TypeError(f"{fn}: {name} must have {name}_cache's dtype {cache.dtype}, got "
                            f"{t.dtype}")
        if t.device != cache.device or slot_mapping.device != cache.device:
            raise ValueError(f"{fn}: {name}, {name}_cache and slot_mapping must be on one device, "
                             f"got {t.device}, {cache.device}, {slot_mapping.device}")
    if tokens == 0:
        return
    slots = slot_mapping.long()
    low, high = int(slots.min()), int(slots.max())
    if low < 0 or high >= pages * page_size:
        raise ValueError(f"{fn}: slot_mapping entries must lie in [0, {pages * page_size}) "
                         f"(num_pages * page_size), got entries from {low} to {high}")
    if torch.unique(slots).numel() != tokens:
        raise ValueError(f"{fn}: slot_mapping entries must be distinct (two tokens in one slot "
                         f"leave it to the order of the writes), got {slot_mapping.tolist()}")
    k_cache.view(pages * page_size, heads, dim).index_copy_(0, slots, k)
    v_cache.view(pages * page_size, heads, v_cache.size(3)).index_copy_(0, slots, v)


class PagedStep(NamedTuple):
    """One serving step's geometry (:meth:`PagedKVCache.step`): the new tokens' slots
    ``(total,)`` int64, in request order; the requests' block table ``(B, max_pages)`` and
    lengths ``(B,)`` int32 after the step; ``cu_seqlens_q (B + 1,)`` int32 over the new tokens
    and the most any request adds; and each new token's position in its sequence ``(total,)``
    int64 (for position embeddings)."""

    cache: "PagedKVCache"
    slot_mapping: Tensor
    block_table: Tensor
    seqlens: Tensor
    cu_seqlens_q: Tensor
    max_seqlen_q: int
    positions: Tensor

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
        """Writes one layer's new keys ``(total, Hkv, D)`` and values ``(total, Hkv, Dv)`` into
        their slots, then attends the new queries ``(total, Hq, D)`` to every key of their
        requests through the pages (:func:`causal_attention.paged_attention` with ``options``):
        ``(total, Hq, Dv)``."""
        self.cache.append(layer, k, v, self.slot_mapping)
        return paged_attention(q, self.cache.key_pages[layer], self.cache.value_pages[layer],
                               self.block_table, self.seqlens, cu_seqlens_q=self.cu_seqlens_q,
                               max_seqlen_q=self.max_seqlen_q, **options)


def _shape(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else f"a {type(t).__name__}"
