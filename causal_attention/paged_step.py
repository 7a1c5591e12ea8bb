"""A serving step on a paged KV cache (:mod:`causal_attention.paged_kv_cache`): the new tokens'
keys and values written into their slots of the pages (:func:`paged_cache_append`, vLLM's
``reshape_and_cache``), and each layer's new queries attending through the pages
(:class:`PagedStep`, which :meth:`PagedKVCache.step` returns)."""

from typing import TYPE_CHECKING, NamedTuple, Optional, Union

import torch
from torch import Tensor

from .ops import paged_attention
from .quantization import is_eight_bit, quantize, token_scales, write_scale

if TYPE_CHECKING:  # for the annotation only: paged_kv_cache imports this module
    from .paged_kv_cache import PagedKVCache

_PADDING = -1  # vLLM's slot for a batch's padding tokens: skipped


def paged_cache_append(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                       slot_mapping: Tensor, *, k_scale: Union[float, Tensor, None] = None,
                       v_scale: Union[float, Tensor, None] = None) -> None:
    """Writes token t's keys ``k[t] (Hkv, D)`` and values ``v[t] (Hkv, Dv)`` into slot
    ``slot_mapping[t]`` of the pages, in place: slot ``s`` is row ``s % page_size`` of page
    ``s // page_size`` (vLLM's ``reshape_and_cache``). Slots must be distinct and inside the
    pool, but for vLLM's padding slot ``-1``, whose token is not written. The caches may be
    views with any strides whose slots do not share memory (vLLM's interleaved
    ``kv_cache[:, 0]`` and ``kv_cache[:, 1]`` of a ``(num_pages, 2, page_size, Hkv, D)``
    tensor, pages apart in memory). The cache is left untouched when any argument is refused.

    A cache in a float dtype takes ``k``/``v`` in its dtype, stored as given. An 8-bit cache
    (``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.int8``) takes floating ``k``/``v``
    and stores them quantized (:func:`causal_attention.quantization.quantize`: ``value /
    scale`` rounded to nearest, ties to even, saturated to the format's finite range, int8
    symmetric in [-127, 127]); :func:`causal_attention.paged_attention` reads them back with
    the same scales. Each of ``k_scale``/``v_scale`` is, by what is passed:

    - a float32 tensor of the pool's scale shape ``(num_pages, page_size, Hkv)``: per token
      and KV head, computed here (the row's largest ``|value|`` over D / the format's largest
      value; 1 for a row of zeros) and written into it at the token's slot, the pages' scales
      beside them;
    - a float or a one-element floating tensor: the whole cache's scale, used as given
      (vLLM's per-layer ``k_scale``), positive and finite in float32;
    - None: 1.

    NaN or inf in a token written into an 8-bit cache raises ValueError naming ``k`` or ``v``
    (no scale stores them); a float cache stores them as they are. ``k`` and ``v`` are written
    detached: no gradient flows into or through the cache."""
    fn = "causal_attention.paged_cache_append"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (num_pages, page_size, Hkv, D), got "
                             f"{_shape(t)}")
        # A stride of 0 (an expanded tensor) makes slots share memory: a write into one would
        # change the others.
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            raise ValueError(f"{fn}: {name}'s slots must not share memory (each slot is written "
                             f"alone), got strides {t.stride()} for shape {tuple(t.shape)}")
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
        if is_eight_bit(cache.dtype):
            if not t.is_floating_point():
                raise TypeError(f"{fn}: {name} must be floating to be quantized into "
                                f"{name}_cache's {cache.dtype}, got {t.dtype}")
        elif t.dtype != cache.dtype:
            raise TypeError(f"{fn}: {name} must have {name}_cache's dtype {cache.dtype}, got "
                            f"{t.dtype}")
        if t.device != cache.device or slot_mapping.device != cache.device:
            raise ValueError(f"{fn}: {name}, {name}_cache and slot_mapping must be on one device, "
                             f"got {t.device}, {cache.device}, {slot_mapping.device}")
    scales = (write_scale(fn, "k_scale", k_scale, k_cache),
              write_scale(fn, "v_scale", v_scale, v_cache))
    slots = slot_mapping.long()
    written = slots != _PADDING  # vLLM pads a batch with slot -1: those tokens are not written
    kept = slots[written]
    if kept.numel() == 0:
        return
    low, high = int(kept.min()), int(kept.max())
    if low < 0 or high >= pages * page_size:
        raise ValueError(f"{fn}: slot_mapping entries must lie in [0, {pages * page_size}) "
                         f"(num_pages * page_size), or be -1 (padding, not written), got "
                         f"entries from {low} to {high}")
    if torch.unique(kept).numel() != kept.numel():
        raise ValueError(f"{fn}: slot_mapping entries must be distinct (two tokens in one slot "
                         f"leave it to the order of the writes), got {slot_mapping.tolist()}")
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if not is_eight_bit(cache.dtype):
            continue
        bad = ~torch.isfinite(t) & written.view(-1, 1, 1)
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise ValueError(f"{fn}: {name} must be finite to be quantized into {name}_cache's "
                             f"{cache.dtype}, got {t[tuple(where)].item()} at "
                             f"{name}[{where[0]}][{where[1]}][{where[2]}]")
    # The pages take the values, not their autograd history: paged attention is inference only,
    # and pages written from tensors requiring grad would join every later step's graph (a
    # serving loop run in grad mode would grow without end).
    k, v = k.detach(), v.detach()
    if kept.numel() != tokens:
        k, v = k[written], v[written]
    # Every argument is checked: now the writes. Advanced indexing by (page, row) writes any
    # strided view of the pages in place (a view of them as (num_pages * page_size) rows exists
    # only for some strides).
    page, row = kept // page_size, kept % page_size
    for t, cache, scale in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        if scale is None:
            cache[page, row] = t
            continue
        if scale.per_token:
            values = token_scales(t, cache.dtype)  # (tokens, Hkv)
            scale.value[page, row] = values
            stored = quantize(t, values.unsqueeze(-1), cache.dtype)
        else:
            stored = quantize(t, scale.value, cache.dtype)
        # torch lacks some indexing kernels for float8 (index_copy_): write their bytes.
        _bytes(cache)[page, row] = _bytes(stored)


class PagedStep(NamedTuple):
    """One serving step's geometry (:meth:`PagedKVCache.step`): the new tokens' slots
    ``(total,)`` int64, in request order; the requests' block table ``(B, max_pages)`` and
    lengths ``(B,)`` int32 after the step; ``cu_seqlens_q (B + 1,)`` int32 over the new tokens
    and the most any request adds; each new token's position in its sequence ``(total,)``
    int64 (for position embeddings); and where the step verifies trees of draft tokens, which of
    its request's new tokens each new token sees, bool ``(total, max_seqlen_q)``
    (:func:`causal_attention.paged_attention`'s ``spec_mask``), else None."""

    cache: "PagedKVCache"
    slot_mapping: Tensor
    block_table: Tensor
    seqlens: Tensor
    cu_seqlens_q: Tensor
    max_seqlen_q: int
    positions: Tensor
    spec_mask: Optional[Tensor] = None

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
        """Writes one layer's new keys ``(total, Hkv, D)`` and values ``(total, Hkv, Dv)`` into
        their slots, then attends the new queries ``(total, Hq, D)`` to every key of their
        requests through the pages (:func:`causal_attention.paged_attention` with ``options``,
        and the layer's scales where the pages are 8-bit, and the step's ``spec_mask``):
        ``(total, Hq, Dv)``."""
        cache = self.cache
        cache.append(layer, k, v, self.slot_mapping)
        return paged_attention(q, cache.key_pages[layer], cache.value_pages[layer],
                               self.block_table, self.seqlens, cu_seqlens_q=self.cu_seqlens_q,
                               max_seqlen_q=self.max_seqlen_q, k_scale=cache.key_scales[layer],
                               v_scale=cache.value_scales[layer], spec_mask=self.spec_mask,
                               **options)


def _bytes(t: Tensor) -> Tensor:
    """``t``, float8 viewed as its bytes (uint8, same strides)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _shape(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else f"a {type(t).__name__}"
