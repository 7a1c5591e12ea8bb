"""flash-attn's ``flash_attn_with_kvcache``: the new keys rotated (``_Rotary``) and written
into the cache, then the queries attending to it (``_KVCacheCall``), without gradients."""

from typing import Optional, Union

import torch
from torch import Tensor

from ._checks import _PREFIX, _as_int, _check_scale, _resolve_scale
from ._kvcache_call import _KVCacheCall
from ._rotary import _Rotary
from ._scores import _Scores


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
    """
    fn = f"{_PREFIX}.flash_attn_with_kvcache"
    with torch.no_grad():
        cache = _KVCacheCall(fn, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table)
        scores = _Scores.of(fn, causal, window_size, softcap, alibi_slopes, q.size(1),
                            cache.capacity, q.size(0), q.size(2))
        _as_int(fn, "num_splits", num_splits)
        softmax_scale = _check_scale(fn, softmax_scale)
        rotary = _Rotary.of(fn, rotary_cos, rotary_sin, rotary_interleaved, q, cache,
                            queries_share_position=scores.window == (-1, -1))
        if rotary is not None:
            q = rotary.apply(q, cache.seqlens, rotary.queries_share_position)
            k = rotary.apply(k, cache.seqlens)
        cache.append(k, v)
        return cache.attend(q, _resolve_scale(softmax_scale, q), scores, bool(return_softmax_lse))
