"""flash-attn's ``flash_attn_with_kvcache``: the new keys rotated (``_Rotary``) and written
into the cache, then the queries attending to it (``_KVCacheCall``), without gradients."""

from typing import Optional, Union

import torch
from torch import Tensor

from ._checks import _PREFIX, _as_int, _check_scale, _resolve_scale
from ._kvcache_call import _KVCacheCall
from ._quantize import check_descales
from ._rotary import _Rotary
from ._scores import _Scores


def _check_spec_mask(fn: str, spec_mask, q: Tensor, causal: bool) -> Optional[Tensor]:
    """spec_mask as the cache call takes it: bool (batch, seqlen_q, seqlen_q), with causal."""
    if spec_mask is None:
        return None
    if not isinstance(spec_mask, Tensor) or spec_mask.dtype != torch.bool:
        raise TypeError(f"{fn}: spec_mask must be a bool tensor, got "
                        f"{getattr(spec_mask, 'dtype', type(spec_mask).__name__)}")
    shape = (q.size(0), q.size(1), q.size(1))
    if tuple(spec_mask.shape) != shape:
        raise ValueError(f"{fn}: spec_mask must be (batch, seqlen_q, seqlen_q)={shape}, got "
                         f"spec_mask.shape={tuple(spec_mask.shape)}")
    if not causal:
        raise ValueError(f"{fn}: spec_mask narrows the causal mask over the new tokens: it needs "
                         "causal=True")
    return spec_mask


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, Tensor]] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    spec_mask=None,
):
    """flash-attn's ``flash_attn_with_kvcache``: ``q (batch, seqlen_q, nheads, headdim)``
    against ``k_cache``/``v_cache`` ``(batch_cache, seqlen_cache, nheads_k, headdim[_v])`` (or
    ``(num_blocks, page_block_size, nheads_k, headdim[_v])`` with ``block_table``), after
    writing the new ``k``/``v`` ``(batch, seqlen_new, nheads_k, headdim[_v])`` into the cache in
    place at ``cache_seqlens``. Returns ``out (batch, seqlen_q, nheads, headdim_v)``, or
    ``(out, softmax_lse (batch, nheads, seqlen_q))`` with ``return_softmax_lse=True``.

    Batch row ``b`` attends to its keys ``cache_leftpad[b] <= j < cache_seqlens[b] +
    seqlen_new``, flash-attn's mask and ALiBi aligned to that length. Rows whose keys end at the
    same place are computed together on a view of the cache; with one query row and no ALiBi,
    every row is, its keys (and window) given to the op as a key mask. Everything is validated
    before the cache is written.

    8-bit caches (``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.int8``, both of one
    dtype, beside a float32, bfloat16 or float16 ``q``) are read in place by
    ``causal_attention.paged_attention``, a cache without ``block_table`` as pages of one cache
    row each. flash-attn 3's keyword arguments ``k_descale``/``v_descale`` dequantize them
    (stored value x descale = key or value): one per tensor (a float or a one-element tensor),
    flash-attn 3's float32 ``(batch, nheads_k)`` (batch row b's keys, wherever they lie, scaled
    by ``descale[b]``: served where rows that share a cache row or page have the same scales,
    else ``ValueError``), or float32 one per token and KV head beside the cache,
    ``(batch_cache, seqlen_cache, nheads_k)`` (``(num_blocks, page_block_size, nheads_k)`` with
    ``block_table``); 1 where not given. New ``k``/``v`` in ``q``'s dtype are quantized as they
    are written (round to nearest, saturating to the format's finite range; int8 symmetric, to
    +-127) with the given scale, or, per token, with scales computed for them (their largest
    magnitude over the format's) and written into the descale tensors in place; ``k``/``v``
    already in the cache's dtype are written as they are (not with per-token descales, nor
    rotary embeddings). ``q_descale`` (an fp8 ``q``) is refused (``NotImplementedError``).

    ``spec_mask`` (keyword, beyond flash-attn's; with ``causal=True``): bool ``(batch, seqlen_q,
    seqlen_q)``, which of its row's new tokens (the last ``seqlen_q`` keys) each query sees, for a
    step that verifies a tree of draft tokens (``causal_attention.paged_attention``'s, which
    serves paged and 8-bit caches in place; a dense cache takes it as an ``attn_mask`` over its
    keys).
    """
    fn = f"{_PREFIX}.flash_attn_with_kvcache"
    with torch.no_grad():
        cache = _KVCacheCall(fn, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, k_descale, v_descale)
        check_descales(fn, q_descale, k_descale, v_descale, cache.eight_bit, k_cache.dtype)
        scores = _Scores.of(fn, causal, window_size, softcap, alibi_slopes, q.size(1),
                            cache.capacity, q.size(0), q.size(2))
        cache.spec_mask = _check_spec_mask(fn, spec_mask, q, causal)
        _as_int(fn, "num_splits", num_splits)
        softmax_scale = _check_scale(fn, softmax_scale)
        rotary = _Rotary.of(fn, rotary_cos, rotary_sin, rotary_interleaved, q, cache,
                            queries_share_position=scores.window == (-1, -1))
        if rotary is not None and cache.eight_bit and k.dtype == k_cache.dtype:
            raise NotImplementedError(
                f"{fn}: rotary_cos/rotary_sin with k already in the cache's dtype "
                f"{k_cache.dtype} is not supported: pass k and v in q's dtype {q.dtype}, "
                "rotated, then quantized as they are written"
            )
        if rotary is not None:
            q = rotary.apply(q, cache.seqlens, rotary.queries_share_position)
            k = rotary.apply(k, cache.seqlens)
        cache.append(k, v)
        return cache.attend(q, _resolve_scale(softmax_scale, q), scores, bool(return_softmax_lse))
