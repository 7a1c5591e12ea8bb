"""flash-attn 2's Python functions on causal_attention's CPU op.

Code written for flash-attn runs on the CPU by changing one import::

    from causal_attention.integrations.flash_attn import (
        flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
    )

and likewise for the packed forms ``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``,
``flash_attn_varlen_qkvpacked_func`` and ``flash_attn_varlen_kvpacked_func``. The functions keep
flash-attn 2's signatures (names, order, defaults) and layouts: ``q (batch, seqlen, nheads,
headdim)``, packed ``(total, nheads, headdim)`` for varlen, K/V with fewer heads for GQA/MQA;
``qkv (batch, seqlen, 3, nheads, headdim)`` and ``kv (batch, seqlen_k, 2, nheads_k, headdim)``
(varlen: ``(total, 3, nheads, headdim)`` and ``(total_k, 2, nheads_k, headdim)``) for the packed
forms, which are ``flash_attn_func`` / ``flash_attn_varlen_func`` on views of the packed tensor
(nothing copied; the qkv-packed varlen call uses ``cu_seqlens`` and ``max_seqlen`` for queries
and keys alike): the same options and results, gradients into the packed tensor, and errors
naming the packed function and its own arguments. They compute what flash-attn computes, and
raise ``NotImplementedError`` naming the argument for the little they do not serve, so a program
is never silently computed differently than with flash-attn. Served, with flash-attn's semantics:

- the mask: row i of a sequence with ``seqlen_q`` queries and ``seqlen_k`` keys sees keys
  ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` for
  ``window_size=(left, right)`` (a tuple or list of two ints, or a CPU int tensor of shape
  ``(2,)`` as flash-attn's tests pass it), a negative bound unbounded; ``causal=True`` sets
  ``right = 0`` (bottom-right causal), and ``causal=False`` with ``(-1, -1)`` is full attention.
  flash-attn's rewriting of the window is reproduced exactly (flash_api.cpp): a bound at least
  ``seqlen_k`` (``max_seqlen_k`` for varlen, the cache's capacity for the KV cache) is
  unbounded, causal is dropped for one query row without ALiBi, and then a window with one
  negative bound gets ``seqlen_k`` for it, which only differs from unbounded for rows more than
  ``seqlen_k`` keys before the last one. Rows that see no key return zeros.
- ``softcap > 0``: scores ``softcap * tanh(scores / softcap)`` (``<= 0``: off);
  ``alibi_slopes``, float32 ``(nheads,)`` or ``(batch, nheads)``: a bias of
  ``-slope * |i + seqlen_k - seqlen_q - j|`` after softcapping; ``dropout_p`` in ``[0, 1)``:
  dropout on the probabilities, its seed drawn from torch's default (CPU) generator, so the same
  generator state gives the same result bit for bit (flash-attn draws from the CUDA generator;
  flash-attn refuses softcap with dropout, which is served here). ``softmax_scale`` defaults to
  ``1 / sqrt(headdim)``; ``deterministic`` and ``num_splits`` are accepted and change nothing
  (the op is always deterministic and picks its own key splits).
- ``return_attn_probs=True`` (without dropout): ``(out, softmax_lse, S_dmask)``, ``softmax_lse``
  ``(batch, nheads, seqlen_q)`` (varlen: ``(nheads, total_q)``), float32 (float64 for float64
  inputs), and ``S_dmask`` the empty tensor flash-attn itself returns when ``dropout_p=0``. With
  ALiBi and flash-attn's causal kernel (``window_size`` left unbounded, ``right = 0``),
  ``softmax_lse`` is flash-attn's: that kernel adds ``slope * j`` rather than the bias above,
  the same probabilities, but a log-sum-exp larger by ``slope * (i + seqlen_k - seqlen_q)``.
  The one difference: a row that sees no key has ``lse = -inf`` (the log of an empty sum),
  where flash-attn's unsplit kernel writes ``+inf``.
- gradients through ``flash_attn_func``, ``flash_attn_varlen_func`` and their packed forms
  (none for the slopes, as in flash-attn).
- ``flash_attn_with_kvcache``: ``k``/``v`` written into ``k_cache``/``v_cache`` in place at
  ``cache_seqlens`` (an int or an int32 ``(batch,)`` tensor), then every batch row attends to its
  own keys ``cache_leftpad[b] <= j < cache_seqlens[b] + seqlen_new``, the mask and ALiBi aligned
  to its own length (flash-attn counts the ALiBi lse shift from ``cache_leftpad[b]``);
  ``cache_batch_idx`` (rows of the cache), ``cache_leftpad``, ``block_table`` (a paged cache,
  its pages read in place by ``causal_attention.paged_attention``, in one call for the batch)
  and rotary embeddings (``rotary_cos``/``rotary_sin``, interleaved or not, applied to ``q`` and
  the new keys at positions ``cache_seqlens[b] + i`` as flash-attn does, every query row at
  ``cache_seqlens[b]`` where the mask is neither causal nor local) are served; ``return_softmax_lse`` returns ``(out, softmax_lse)``. As in
  flash-attn it is not differentiable (it runs under ``torch.no_grad()``). With repeated
  ``cache_batch_idx`` entries the last row's new keys are the ones left in the cache, and every
  row attends to the cache as left after all the writes.
- ``flash_attn_varlen_func(..., block_table=...)``: ``k``/``v`` a paged cache
  ``(num_blocks, page_block_size, nheads_k, headdim)``, sequence b's keys the first
  ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` rows of its pages, read in place by
  ``paged_attention``; inference only (inputs that require grad, or dropout, are refused).

Refused (``NotImplementedError``): ``return_attn_probs=True`` with ``dropout_p > 0`` (flash-attn's
testing-only S_dmask encoding of the dropout pattern), ``block_table`` in
``flash_attn_varlen_func`` with gradients or dropout, and ``block_table`` with
``cache_batch_idx`` or ``cache_leftpad``
(flash-attn refuses those pairs too). flash-attn's CUDA-only limits (fp16/bf16, head
dimension at most 256, a multiple of 8, page sizes a multiple of 256) do not apply: float32 and
float64 work, and ``v`` may have a head dimension of its own. Bad types raise ``TypeError``,
bad shapes and values ``ValueError``, each naming the argument. ``softmax_scale``, ``softcap``
and ``dropout_p`` are real numbers (int, float, numpy; not bool) or tensors holding one; a
tensor that requires grad is refused (``TypeError``), as the number it holds would get no
gradient.
"""

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..ops import attention, attention_forward, paged_attention, varlen_attention
from .._arguments import refuse_tensor_requiring_grad

_PREFIX = "causal_attention.integrations.flash_attn"


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_func``: ``q (batch, seqlen_q, nheads, headdim)``, ``k
    (batch, seqlen_k, nheads_k, headdim)``, ``v (batch, seqlen_k, nheads_k, headdim_v)`` ->
    ``out (batch, seqlen_q, nheads, headdim_v)``, contiguous, differentiable; with
    ``return_attn_probs=True``, ``(out, softmax_lse (batch, nheads, seqlen_q), S_dmask)``.
    The mask, softcap, ALiBi and dropout are flash-attn's; see the module docstring."""
    return _dense_call(f"{_PREFIX}.flash_attn_func", q, k, v, dropout_p, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_qkvpacked_func``: ``qkv (batch, seqlen, 3, nheads, headdim)``
    -> ``out (batch, seqlen, nheads, headdim)``, ``flash_attn_func`` on the views
    ``qkv[:, :, 0]``, ``qkv[:, :, 1]``, ``qkv[:, :, 2]`` (nothing copied; the gradient goes to
    ``qkv``); with ``return_attn_probs=True``, ``(out, softmax_lse (batch, nheads, seqlen),
    S_dmask)``."""
    fn = f"{_PREFIX}.flash_attn_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    return _dense_call(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_kvpacked_func``: ``q (batch, seqlen_q, nheads, headdim)``,
    ``kv (batch, seqlen_k, 2, nheads_k, headdim)`` -> ``out (batch, seqlen_q, nheads,
    headdim)``, ``flash_attn_func`` on ``q`` and the views ``kv[:, :, 0]``, ``kv[:, :, 1]``
    (GQA/MQA with ``nheads_k`` dividing ``nheads``; the gradient goes to ``kv``); with
    ``return_attn_probs=True``, ``(out, softmax_lse (batch, nheads, seqlen_q), S_dmask)``."""
    fn = f"{_PREFIX}.flash_attn_kvpacked_func"
    _check_rank(fn, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    k, v = _unpack(fn, "kv", kv, 5, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    _check_packed_kv(fn, q, kv, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return _dense_call(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, return_attn_probs)


def _dense_call(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, return_attn_probs):
    """``flash_attn_func`` and its packed forms, errors naming ``fn``."""
    _check_batched(fn, q, k, v)
    batch, lq, heads, _ = q.shape
    lk = k.size(1)
    scores = _Scores.of(fn, causal, window_size, softcap, alibi_slopes, lq, lk, batch, heads)
    dropout_p = _check_dropout(fn, dropout_p, return_attn_probs)
    softmax_scale = _check_scale(fn, softmax_scale)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if return_attn_probs:
        out, lse = attention_forward(qh, kh, vh, _resolve_scale(softmax_scale, q),
                                     **scores.kwargs())
        if scores.alibi_lse_shift:
            lse = lse + scores.alibi_slopes.unsqueeze(-1) * (torch.arange(lq) + (lk - lq))
        return out.transpose(1, 2).contiguous(), lse, _no_dropout_mask(q)
    out = attention(qh, kh, vh, scale=softmax_scale, dropout_p=dropout_p, **scores.kwargs())
    return out.transpose(1, 2).contiguous()


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn's ``flash_attn_varlen_func``: packed ``q (total_q, nheads, headdim)``,
    ``k (total_k, nheads_k, headdim)``, ``v (total_k, nheads_k, headdim_v)``, int32
    ``cu_seqlens_q``/``cu_seqlens_k`` ``(batch + 1,)`` -> ``out (total_q, nheads, headdim_v)``,
    differentiable; with ``return_attn_probs=True``, ``(out, softmax_lse (nheads, total_q),
    S_dmask)``. Each sequence attends only to itself, with flash-attn's mask aligned to its own
    lengths (the window rewritten by ``max_seqlen_q``/``max_seqlen_k``, as flash-attn does)."""
    return _varlen_call(f"{_PREFIX}.flash_attn_varlen_func", q, k, v, cu_seqlens_q,
                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                        causal, window_size, softcap, alibi_slopes, return_attn_probs,
                        block_table)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: packed ``qkv (total, 3, nheads,
    headdim)`` and int32 ``cu_seqlens (batch + 1,)`` -> ``out (total, nheads, headdim)``,
    ``flash_attn_varlen_func`` on the views ``qkv[:, 0]``, ``qkv[:, 1]``, ``qkv[:, 2]`` with
    ``cu_seqlens``/``max_seqlen`` for queries and keys alike (the gradient goes to ``qkv``);
    with ``return_attn_probs=True``, ``(out, softmax_lse (nheads, total), S_dmask)``."""
    fn = f"{_PREFIX}.flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, 4, 3, "(total, 3, nheads, headdim)")
    # cu_seqlens and max_seqlen serve queries and keys alike: the op checks them, naming its
    # cu_seqlens_q and max_seqlen_q, as for flash_attn_varlen_func.
    return _varlen_call(fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                        softmax_scale, causal, window_size, softcap, alibi_slopes,
                        return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: packed ``q (total_q, nheads, headdim)``,
    ``kv (total_k, 2, nheads_k, headdim)`` -> ``out (total_q, nheads, headdim)``,
    ``flash_attn_varlen_func`` on ``q`` and the views ``kv[:, 0]``, ``kv[:, 1]`` (GQA/MQA; the
    gradient goes to ``kv``); with ``return_attn_probs=True``, ``(out, softmax_lse (nheads,
    total_q), S_dmask)``."""
    fn = f"{_PREFIX}.flash_attn_varlen_kvpacked_func"
    _check_rank(fn, "q", q, 3, "(total_q, nheads, headdim)")
    k, v = _unpack(fn, "kv", kv, 4, 2, "(total_k, 2, nheads_k, headdim)")
    _check_packed_kv(fn, q, kv, "(total_k, 2, nheads_k, headdim)")
    return _varlen_call(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        return_attn_probs)


def _varlen_call(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                 block_table=None):
    """``flash_attn_varlen_func`` and its packed forms, errors naming ``fn``; with
    ``block_table``, k and v are a paged cache (``_paged_varlen_call``)."""
    if block_table is not None:
        return _paged_varlen_call(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, return_attn_probs, block_table)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(fn, name, t, 3, "(total, nheads, headdim)")
    _check_head_dim(fn, q)
    max_q = _as_int(fn, "max_seqlen_q", max_seqlen_q)
    max_k = _as_int(fn, "max_seqlen_k", max_seqlen_k)
    _check_rank(fn, "cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    # flash-attn rewrites the window by the longest lengths (max_seqlen_k, max_seqlen_q == 1);
    # the op checks that every sequence fits them.
    batch = cu_seqlens_q.numel() - 1
    scores = _Scores.of(fn, causal, window_size, softcap, alibi_slopes, max_q, max_k, batch,
                        q.size(1))
    dropout_p = _check_dropout(fn, dropout_p, return_attn_probs)
    softmax_scale = _check_scale(fn, softmax_scale)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    if return_attn_probs:
        out, lse = attention_forward(q, k, v, _resolve_scale(softmax_scale, q),
                                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                     max_seqlen_q=max_q, max_seqlen_k=max_k, **scores.kwargs())
        if scores.alibi_lse_shift:
            lse = _varlen_alibi_lse(lse, scores.alibi_slopes, cu_seqlens_q,
                                    cu_seqlens_k.cpu().long().diff())
        return out, lse, _no_dropout_mask(q)
    return varlen_attention(*args, scale=softmax_scale, dropout_p=dropout_p, **scores.kwargs())


def _paged_varlen_call(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, return_attn_probs, block_table):
    """``flash_attn_varlen_func`` over a paged cache, as flash-attn serves it: ``k``/``v``
    ``(num_blocks, page_block_size, nheads_k, headdim[_v])``, ``block_table (batch,
    max_num_blocks_per_seq)`` int32, sequence b's keys the first ``cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]`` rows of its pages; read in place by paged_attention (inference only)."""
    _check_rank(fn, "q", q, 3, "(total_q, nheads, headdim)")
    layout = "(num_blocks, page_block_size, nheads_k, headdim) with block_table"
    _check_rank(fn, "k", k_cache, 4, layout)
    _check_rank(fn, "v", v_cache, 4, layout)
    _check_head_dim(fn, q)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise NotImplementedError(
            f"{fn}: with block_table (a paged cache) the call is inference only here, as "
            "serving is; got inputs that require grad (call it under torch.no_grad())"
        )
    max_q = _as_int(fn, "max_seqlen_q", max_seqlen_q)
    max_k = _as_int(fn, "max_seqlen_k", max_seqlen_k)
    _check_rank(fn, "cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    _check_rank(fn, "cu_seqlens_k", cu_seqlens_k, 1, "(batch + 1,)")
    batch = cu_seqlens_q.numel() - 1
    table = _check_row_indices(fn, "block_table", block_table, batch, 2)
    if cu_seqlens_k.numel() != batch + 1 or cu_seqlens_k.dtype != torch.int32:
        raise ValueError(
            f"{fn}: cu_seqlens_k must be int32 (batch + 1,) like cu_seqlens_q, got a "
            f"{_describe(cu_seqlens_k)}"
        )
    scores = _Scores.of(fn, causal, window_size, softcap, alibi_slopes, max_q, max_k, batch,
                        q.size(1))
    dropout_p = _check_dropout(fn, dropout_p, return_attn_probs)
    if dropout_p > 0.0:
        raise NotImplementedError(
            f"{fn}: dropout_p={dropout_p} with block_table (a paged cache) is not supported: "
            "the paged call serves inference, which draws no dropout"
        )
    softmax_scale = _check_scale(fn, softmax_scale)
    lengths_k = cu_seqlens_k.cpu().diff()
    out, lse = paged_attention(q, k_cache, v_cache, table, lengths_k, cu_seqlens_q=cu_seqlens_q,
                               max_seqlen_q=max_q, scale=_resolve_scale(softmax_scale, q),
                               return_lse=True, **scores.kwargs())
    if not return_attn_probs:
        return out
    if scores.alibi_lse_shift:
        lse = _varlen_alibi_lse(lse, scores.alibi_slopes, cu_seqlens_q, lengths_k.long())
    return out, lse, _no_dropout_mask(q)


def _varlen_alibi_lse(lse: Tensor, slopes: Tensor, cu_seqlens_q: Tensor,
                      lengths_k: Tensor) -> Tensor:
    """flash-attn's softmax_lse ``(nheads, total_q)`` of packed rows under its causal ALiBi
    kernel: the op's plus ``slope * position``, the row's position counted from its sequence's
    first key (_Scores)."""
    lengths_q = cu_seqlens_q.cpu().long().diff()
    sequence = torch.repeat_interleave(torch.arange(lengths_q.numel()), lengths_q)
    start = cu_seqlens_q.cpu().long()[sequence]
    positions = torch.arange(sequence.numel()) - start + (lengths_k - lengths_q)[sequence]
    slopes = slopes.unsqueeze(-1) if slopes.dim() == 1 else slopes[sequence].T
    return lse + slopes * positions


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


class _KVCacheCall:
    """The validated geometry of one ``flash_attn_with_kvcache`` call: for every batch row its
    cache row (or pages), the start and end of its keys, and where its new keys go."""

    def __init__(self, fn, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table):
        self.fn = fn
        _check_rank(fn, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
        _check_head_dim(fn, q)
        self.paged = block_table is not None
        layout = "(num_blocks, page_block_size, nheads_k, headdim)" if self.paged else \
            "(batch_cache, seqlen_cache, nheads_k, headdim)"
        _check_rank(fn, "k_cache", k_cache, 4, layout)
        _check_rank(fn, "v_cache", v_cache, 4, layout)
        batch, _, heads, dim = q.shape
        if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.size(3) != dim:
            raise ValueError(
                f"{fn}: k_cache and v_cache must be {layout} with q's headdim {dim} for k_cache, "
                f"got q.shape={tuple(q.shape)}, k_cache.shape={tuple(k_cache.shape)}, "
                f"v_cache.shape={tuple(v_cache.shape)}"
            )
        heads_k = k_cache.size(2)
        if heads_k == 0 or heads % heads_k != 0:
            raise ValueError(
                f"{fn}: q's nheads must be a multiple of the cache's nheads_k, got "
                f"q.shape={tuple(q.shape)}, k_cache.shape={tuple(k_cache.shape)}"
            )
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype:
                raise TypeError(f"{fn}: {name} must have q's dtype {q.dtype}, got {t.dtype}")
        self.q_shape = tuple(q.shape)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.new = self._check_new_keys(k, v)
        if self.paged:
            for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
                if t is not None:
                    raise NotImplementedError(
                        f"{fn}: {name} with block_table (a paged cache) is not supported "
                        f"(flash-attn does not support the pair either), got a {_describe(t)}"
                    )
            self.page = k_cache.size(1)
            self.block_table = _check_row_indices(fn, "block_table", block_table, batch, 2)
            self.capacity = self.block_table.size(1) * self.page
        else:
            self.capacity = k_cache.size(1)
            if cache_batch_idx is None:
                if k_cache.size(0) < batch:
                    raise ValueError(
                        f"{fn}: k_cache has {k_cache.size(0)} rows for q's batch of {batch}; "
                        "pass cache_batch_idx to pick rows of a cache, or a cache as large as "
                        f"the batch (k_cache.shape={tuple(k_cache.shape)})"
                    )
                self.rows = list(range(batch))
            else:
                idx = _check_row_indices(fn, "cache_batch_idx", cache_batch_idx, batch, 1)
                self.rows = idx.tolist()
                bad = [r for r in self.rows if not 0 <= r < k_cache.size(0)]
                if bad:
                    raise ValueError(
                        f"{fn}: cache_batch_idx entries must lie in [0, {k_cache.size(0)}) "
                        f"(k_cache.shape[0]), got {bad}"
                    )
        if cache_seqlens is None:
            if self.new:
                raise ValueError(
                    f"{fn}: cache_seqlens must be given with k and v, to say where the new keys "
                    "go; got cache_seqlens=None"
                )
            self.seqlens = [self.capacity] * batch
        elif isinstance(cache_seqlens, Tensor):
            self.seqlens = _check_row_indices(fn, "cache_seqlens", cache_seqlens, batch, 1).tolist()
        elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
            self.seqlens = [cache_seqlens] * batch
        else:
            raise TypeError(
                f"{fn}: cache_seqlens must be an int or an int32 (batch,) tensor, got "
                f"{_describe(cache_seqlens)}"
            )
        if cache_leftpad is None:
            self.starts = [0] * batch
        else:
            self.starts = _check_row_indices(fn, "cache_leftpad", cache_leftpad, batch, 1).tolist()
        self.ends = [length + self.new for length in self.seqlens]
        for b, (start, length, end) in enumerate(zip(self.starts, self.seqlens, self.ends)):
            if length < 0:
                raise ValueError(f"{fn}: cache_seqlens must be >= 0, got {length} for row {b}")
            if not 0 <= start <= length:
                raise ValueError(
                    f"{fn}: row {b} needs 0 <= cache_leftpad[b] <= cache_seqlens[b], got "
                    f"cache_leftpad[b]={start}, cache_seqlens[b]={length}"
                )
            if end > self.capacity:
                raise ValueError(
                    f"{fn}: row {b} does not fit the cache: cache_seqlens[b] + k.shape[1] = "
                    f"{length} + {self.new} = {end} > {self.capacity}, the cache's "
                    + ("block_table.shape[1] * page_block_size" if self.paged else "seqlen_cache")
                )
        if self.paged:
            self._check_pages()

    def _check_new_keys(self, k, v) -> int:
        """Validates the new keys and values; returns how many each row has (0 without)."""
        fn = self.fn
        if (k is None) != (v is None):
            raise ValueError(
                f"{fn}: k and v go together, got k={_describe(k)} and v={_describe(v)}"
            )
        if k is None:
            return 0
        _check_rank(fn, "k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
        _check_rank(fn, "v", v, 4, "(batch, seqlen_new, nheads_k, headdim_v)")
        batch = self.q_shape[0]
        heads_k, dim, dim_v = self.k_cache.size(2), self.k_cache.size(3), self.v_cache.size(3)
        new = k.size(1)
        if tuple(k.shape) != (batch, new, heads_k, dim) or \
                tuple(v.shape) != (batch, new, heads_k, dim_v):
            raise ValueError(
                f"{fn}: k and v must be (batch, seqlen_new, nheads_k, headdim[_v]) = "
                f"({batch}, seqlen_new, {heads_k}, {dim} / {dim_v}), got "
                f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
            )
        for name, t, c in (("k", k, self.k_cache), ("v", v, self.v_cache)):
            if t.dtype != c.dtype:
                raise TypeError(
                    f"{fn}: {name} must have the cache's dtype {c.dtype}, got {t.dtype}"
                )
        return new

    def _check_pages(self) -> None:
        """Every page a row reads or writes must exist; the columns past them are never read."""
        num_blocks = self.k_cache.size(0)
        for b, end in enumerate(self.ends):
            used = self.block_table[b, : _ceil_div(end, self.page)]
            bad = used[(used < 0) | (used >= num_blocks)]
            if bad.numel():
                raise ValueError(
                    f"{self.fn}: block_table row {b} names pages {bad.tolist()} outside "
                    f"[0, {num_blocks}) (k_cache.shape[0]) among the "
                    f"{used.numel()} pages its {end} keys use"
                )

    def append(self, k: Optional[Tensor], v: Optional[Tensor]) -> None:
        """Writes row b's new keys at positions cache_seqlens[b] onwards, a row at a time, so that
        with repeated cache rows the last row's keys are the ones left."""
        if not self.new:
            return
        for b, start in enumerate(self.seqlens):
            if self.paged:
                positions = torch.arange(start, start + self.new)
                pages = self.block_table[b, positions // self.page].long()
                where = (pages, positions % self.page)
            else:
                where = (self.rows[b], slice(start, start + self.new))
            self.k_cache[where] = k[b]
            self.v_cache[where] = v[b]

    def groups(self, scores: "_Scores") -> List[List[int]]:
        """Batch rows that one op call serves exactly. The op aligns each row's mask (and ALiBi
        distances) to the end of the keys it is given, so rows go together when their keys end
        at the same place; a single query row without ALiBi sees a range of its keys that a key
        mask can say, so then any rows go together, each cut to its own range."""
        batch, lq = self.q_shape[:2]
        if batch == 0:
            return []
        if lq <= 1 and scores.alibi_slopes is None:
            return [list(range(batch))]
        by_end: Dict[int, List[int]] = {}
        for b, end in enumerate(self.ends):
            by_end.setdefault(end, []).append(b)
        return list(by_end.values())

    def keys(self, rows: List[int], length: int) -> Tuple[Tensor, Tensor]:
        """K and V of ``rows`` up to ``length``, ``(len(rows), length, nheads_k, headdim)``: a view
        of the cache when the rows are consecutive, else a copy."""
        cache_rows = [self.rows[b] for b in rows]
        if _consecutive(cache_rows):
            picked = slice(cache_rows[0], cache_rows[0] + len(cache_rows))
        else:
            picked = torch.tensor(cache_rows)
        return self.k_cache[picked, :length], self.v_cache[picked, :length]

    def attend(self, q: Tensor, scale: float, scores: "_Scores", with_lse: bool):
        """One op call per group, on a view of the cache where its rows are consecutive; a key
        mask only where some row's keys start past 0 or end before the group's."""
        if self.paged:
            return self._attend_pages(q, scale, scores, with_lse)
        batch, lq, heads, _ = self.q_shape
        groups = self.groups(scores)
        if len(groups) != 1:
            out = q.new_empty(batch, lq, heads, self.v_cache.size(3))
            lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            lse = q.new_empty(batch, heads, lq, dtype=lse_dtype)
        for rows in groups:
            length = max(self.ends[b] for b in rows)
            k, v = self.keys(rows, length)
            picked = slice(rows[0], rows[-1] + 1) if _consecutive(rows) else torch.tensor(rows)
            kwargs = scores.kwargs(picked)
            starts = torch.tensor([self.starts[b] for b in rows])
            ends = torch.tensor([self.ends[b] for b in rows])
            first = starts
            left = scores.window[0]
            if lq == 1 and scores.alibi_slopes is None and left >= 0:
                # Rows of one query, whatever their ends (groups): each row's window goes into
                # the key mask, as the op's would be aligned to the group's end.
                first = torch.maximum(starts, ends - 1 - left)
                kwargs["window"] = (-1, -1)
            key_mask = None
            if bool((first > 0).any()) or bool((ends < length).any()):
                j = torch.arange(length)
                key_mask = (j >= first.unsqueeze(1)) & (j < ends.unsqueeze(1))
            qh, kh, vh = (t.transpose(1, 2) for t in (q[picked], k, v))
            if with_lse:
                o, l = attention_forward(qh, kh, vh, scale, key_mask, **kwargs)
                if scores.alibi_lse_shift:
                    # flash-attn's ALiBi distances count from the row's first key, after leftpad.
                    offsets = ends - starts - lq
                    positions = torch.arange(lq) + offsets.view(-1, 1, 1)
                    l = l + kwargs["alibi_slopes"].unsqueeze(-1) * positions
            else:
                o, l = attention(qh, kh, vh, scale=scale, key_mask=key_mask, **kwargs), None
            if len(groups) == 1:
                out, lse = o.transpose(1, 2).contiguous(), l
            else:
                out[picked] = o.transpose(1, 2)
                if with_lse:
                    lse[picked] = l
        return (out, lse) if with_lse else out

    def _attend_pages(self, q: Tensor, scale: float, scores: "_Scores", with_lse: bool):
        """A paged cache, read in place by paged_attention in one call: row b's keys are the
        first ``ends[b]`` rows of its pages (no left padding with pages), its queries aligned to
        their end, as flash-attn's."""
        ends = torch.tensor(self.ends, dtype=torch.int32)
        kwargs = scores.kwargs()
        out, lse = paged_attention(q, self.k_cache, self.v_cache, self.block_table, ends,
                                   scale=scale, return_lse=True, **kwargs)
        if with_lse and scores.alibi_lse_shift:
            # flash-attn's causal ALiBi counts distances from the row's first key (attend).
            lq = self.q_shape[1]
            positions = torch.arange(lq) + (ends - lq).view(-1, 1, 1)
            lse = lse + kwargs["alibi_slopes"].unsqueeze(-1) * positions
        return (out, lse) if with_lse else out


class _Rotary:
    """Rotary embeddings as flash_attn_with_kvcache applies them: the first ``rotary_dim``
    features of ``q`` and of the new keys of row b, token i, turned by the angle whose cosine and
    sine are row ``cache_seqlens[b] + i`` of ``rotary_cos`` / ``rotary_sin``; pairs are
    ``(2j, 2j + 1)`` when interleaved, else ``(j, j + rotary_dim / 2)`` (GPT-NeoX).

    Where flash-attn's mask is neither causal nor local (the op's window ``(-1, -1)`` after its
    rewriting), every query row of row b is turned at ``cache_seqlens[b]``, as flash-attn's
    kernel does (``queries_share_position``): its rows then have no order to encode."""

    def __init__(self, cos: Tensor, sin: Tensor, interleaved: bool,
                 queries_share_position: bool):
        self.cos, self.sin, self.interleaved = cos, sin, interleaved
        self.queries_share_position = queries_share_position

    @classmethod
    def of(cls, fn, cos, sin, interleaved, q, cache: _KVCacheCall,
           queries_share_position: bool) -> Optional["_Rotary"]:
        if cos is None and sin is None:
            return None
        if cos is None or sin is None:
            raise ValueError(
                f"{fn}: rotary_cos and rotary_sin go together, got rotary_cos={_describe(cos)} "
                f"and rotary_sin={_describe(sin)}"
            )
        if not cache.new:
            raise ValueError(
                f"{fn}: rotary_cos/rotary_sin need new keys k and v to rotate (as in flash-attn), "
                "got k=None"
            )
        for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
            _check_rank(fn, name, t, 2, "(seqlen_ro, rotary_dim / 2)")
            if not t.is_floating_point():
                raise TypeError(f"{fn}: {name} must be a floating tensor, got {t.dtype}")
        if cos.shape != sin.shape or 2 * cos.size(1) > q.size(3):
            raise ValueError(
                f"{fn}: rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with "
                f"rotary_dim <= headdim {q.size(3)}, got rotary_cos.shape={tuple(cos.shape)}, "
                f"rotary_sin.shape={tuple(sin.shape)}"
            )
        query_tokens = 1 if queries_share_position else q.size(1)
        tokens = max(query_tokens, cache.new)
        needed = max((length + tokens for length in cache.seqlens), default=0)
        if cos.size(0) < needed:
            rows = "1 (every query row at cache_seqlens[b])" if queries_share_position \
                else "seqlen_q"
            raise ValueError(
                f"{fn}: rotary_cos/rotary_sin have {cos.size(0)} positions; the rotated tokens "
                f"reach position {needed - 1} (cache_seqlens[b] + max(query rows, seqlen_new) - 1"
                f", query rows = {rows})"
            )
        return cls(cos, sin, bool(interleaved), queries_share_position)

    def apply(self, x: Tensor, seqlens: Sequence[int], share_position: bool = False) -> Tensor:
        """``x (batch, tokens, heads, headdim)`` rotated, in float32 (float64 for float64) and
        rounded once to its dtype; every token of row b at ``seqlens[b]`` with
        ``share_position``, else token i at ``seqlens[b] + i``."""
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        half = self.cos.size(1)
        steps = torch.zeros(x.size(1), dtype=torch.long) if share_position \
            else torch.arange(x.size(1))
        positions = torch.tensor(seqlens).unsqueeze(1) + steps
        cos = self.cos.to(acc)[positions].unsqueeze(2)
        sin = self.sin.to(acc)[positions].unsqueeze(2)
        part = x[..., : 2 * half].to(acc)
        if self.interleaved:
            a, b = part[..., 0::2], part[..., 1::2]
            turned = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            a, b = part[..., :half], part[..., half:]
            turned = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return torch.cat((turned.to(x.dtype), x[..., 2 * half :]), dim=-1)


@dataclass(frozen=True)
class _Scores:
    """What flash-attn does to one call's scores, in the op's terms: the window the op takes
    (flash-attn's, rewritten as flash-attn rewrites it), softcap (``None``: off) and ALiBi
    slopes; and whether flash-attn's causal kernel runs with ALiBi. That kernel adds
    ``slope * j`` to row i's scores instead of ``-slope * |i + seqlen_k - seqlen_q - j|``: on the
    keys causality shows the two differ by ``slope * (i + seqlen_k - seqlen_q)``, a constant of
    the row, so the probabilities and the output are the same but flash-attn's softmax_lse is the
    op's plus that constant."""

    window: Tuple[int, int]
    softcap: Optional[float]
    alibi_slopes: Optional[Tensor]
    alibi_lse_shift: bool

    @classmethod
    def of(cls, fn, causal, window_size, softcap, alibi_slopes, seqlen_q: int, seqlen_k: int,
           batch: int, heads: int) -> "_Scores":
        """``seqlen_q``/``seqlen_k`` are the lengths flash-attn rewrites the window by: the
        call's (``max_seqlen_q``/``max_seqlen_k`` for varlen, the cache's capacity for
        ``flash_attn_with_kvcache``)."""
        alibi_slopes = _check_alibi(fn, alibi_slopes, batch, heads)
        window, causal_kernel = _window(fn, causal, window_size, seqlen_q, seqlen_k,
                                        alibi_slopes is not None)
        softcap = _as_float(fn, "softcap", softcap)
        return cls(window, softcap if softcap > 0.0 else None, alibi_slopes,
                   causal_kernel and alibi_slopes is not None)

    def kwargs(self, rows=None) -> Dict[str, object]:
        """The op's keyword arguments; ``rows`` picks the batch rows of ``(batch, nheads)``
        slopes for a call on those rows."""
        alibi = self.alibi_slopes
        if alibi is not None and alibi.dim() == 2 and rows is not None:
            alibi = alibi[rows]
        return dict(window=self.window, softcap=self.softcap, alibi_slopes=alibi)


def _window(fn: str, causal, window_size, seqlen_q: int, seqlen_k: int,
            alibi: bool) -> Tuple[Tuple[int, int], bool]:
    """flash-attn's mask as an op window, and whether flash-attn runs its causal kernel.

    flash-attn (flash_api.cpp): a bound at least ``seqlen_k`` is unbounded (-1, as is any
    negative one); with one query row and no ALiBi, causal is dropped (the row sees every key
    either way); causal sets ``right = 0``; ``(left < 0, right == 0)`` is the causal kernel;
    otherwise a window with one bound negative gets ``seqlen_k`` for it. Row i then sees keys
    ``i + off - left <= j <= i + off + right`` (off = seqlen_k - seqlen_q of the row's own
    sequence), as the op's window does. The last rule is not the same as an unbounded side
    where a row sits more than ``seqlen_k`` before the last key (seqlen_q > seqlen_k + 1), so
    it is kept."""
    left, right = _window_bounds(fn, window_size)
    left = -1 if left < 0 or left >= seqlen_k else left
    right = -1 if right < 0 or right >= seqlen_k else right
    if causal and (seqlen_q != 1 or alibi):
        right = 0
    if left < 0 and right == 0:
        return (-1, 0), True
    if left < 0 and right < 0:
        return (-1, -1), False
    return (seqlen_k if left < 0 else left, seqlen_k if right < 0 else right), False


def _window_bounds(fn: str, window_size) -> Tuple[int, int]:
    """``window_size`` as two ints: a tuple or list of two ints (Python or numpy ints, not
    bools), or a CPU int tensor of shape ``(2,)`` of any integer dtype, as flash-attn's own tests
    pass it; anything else is a TypeError naming it."""
    expected = f"{fn}: window_size must be a pair (left, right): a tuple or list of two ints " \
        "or a CPU int tensor of shape (2,), got"
    if isinstance(window_size, Tensor):
        dtype = window_size.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or \
                window_size.shape != (2,) or window_size.device.type != "cpu":
            raise TypeError(f"{expected} a {_describe(window_size)} on {window_size.device}")
        left, right = window_size.tolist()
        return left, right
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"{expected} {_describe(window_size)}")
    bounds = []
    for i, bound in enumerate(window_size):
        if isinstance(bound, bool):
            raise TypeError(f"{fn}: window_size[{i}] must be an int, got {bound!r}")
        bounds.append(_as_int(fn, f"window_size[{i}]", bound))
    return bounds[0], bounds[1]


def _check_alibi(fn: str, alibi_slopes, batch: int, heads: int) -> Optional[Tensor]:
    """flash-attn's ALiBi slopes: None, or float32 ``(nheads,)`` or ``(batch, nheads)``."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError(f"{fn}: alibi_slopes must be a tensor, got {_describe(alibi_slopes)}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"{fn}: alibi_slopes must have dtype torch.float32, got "
                        f"{alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"{fn}: alibi_slopes must be (nheads,) = ({heads},) or (batch, nheads) = ({batch}, "
            f"{heads}), got alibi_slopes.shape={tuple(alibi_slopes.shape)}"
        )
    return alibi_slopes


def _check_dropout(fn: str, dropout_p, return_attn_probs) -> float:
    dropout_p = _as_float(fn, "dropout_p", dropout_p)
    if dropout_p > 0.0 and return_attn_probs:
        raise NotImplementedError(
            f"{fn}: return_attn_probs=True with dropout_p={dropout_p} is not supported: "
            "S_dmask, flash-attn's testing-only encoding of the dropout pattern, is not "
            "computed; pass return_attn_probs=False, or dropout_p=0.0 for softmax_lse"
        )
    return dropout_p


def _check_batched(fn: str, q, k, v) -> None:
    """The shapes of flash_attn_func, checked in its own layout so that errors read in it."""
    _check_rank(fn, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _check_rank(fn, "k", k, 4, "(batch, seqlen_k, nheads_k, headdim)")
    _check_rank(fn, "v", v, 4, "(batch, seqlen_k, nheads_k, headdim_v)")
    _check_head_dim(fn, q)
    batch, _, heads, dim = q.shape
    if k.size(0) != batch or k.size(3) != dim or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{fn}: expected q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, "
            f"headdim), v (batch, seqlen_k, nheads_k, headdim_v), got q.shape={tuple(q.shape)}, "
            f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if k.size(2) == 0 or heads % k.size(2) != 0:
        raise ValueError(
            f"{fn}: q's nheads must be a multiple of k's nheads_k, got q.shape={tuple(q.shape)}, "
            f"k.shape={tuple(k.shape)}"
        )


def _unpack(fn: str, name: str, packed, dims: int, count: int,
            layout: str) -> Tuple[Tensor, ...]:
    """The ``count`` tensors stacked along dim -3 of ``packed`` (``layout``, of ``dims`` dims) as
    views of it: what the packed functions hand to the unpacked ones, so that autograd sends
    their gradients back into ``packed``."""
    _check_rank(fn, name, packed, dims, layout)
    if packed.size(-3) != count:
        raise ValueError(
            f"{fn}: {name} must be {layout}, its dim {dims - 3} of size {count}, got "
            f"{name}.shape={tuple(packed.shape)}"
        )
    if packed.size(-1) <= 0:
        raise ValueError(f"{fn}: headdim must be positive, got {name}.shape={tuple(packed.shape)}")
    return packed.unbind(-3)


def _check_packed_kv(fn: str, q: Tensor, kv: Tensor, layout: str) -> None:
    """``kv`` (``layout``, its batch if any, nheads_k and headdim last) against ``q``: the
    checks the unpacked function would make of k and v, in kv's terms."""
    batched = q.dim() == 4
    if (batched and kv.size(0) != q.size(0)) or kv.size(-1) != q.size(-1):
        what = "q's batch and headdim" if batched else "q's headdim"
        raise ValueError(
            f"{fn}: kv must be {layout} with {what}, got q.shape={tuple(q.shape)}, "
            f"kv.shape={tuple(kv.shape)}"
        )
    if kv.size(-2) == 0 or q.size(-2) % kv.size(-2) != 0:
        raise ValueError(
            f"{fn}: q's nheads must be a multiple of kv's nheads_k, got q.shape={tuple(q.shape)}, "
            f"kv.shape={tuple(kv.shape)}"
        )
    if kv.dtype != q.dtype:
        raise TypeError(f"{fn}: kv must have q's dtype {q.dtype}, got {kv.dtype}")


def _check_rank(fn: str, name: str, t, dims: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor {layout}, got {_describe(t)}")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must be {layout}, got {name}.shape={tuple(t.shape)}")


def _check_head_dim(fn: str, q: Tensor) -> None:
    if q.size(-1) <= 0:
        raise ValueError(f"{fn}: headdim must be positive, got q.shape={tuple(q.shape)}")


def _check_row_indices(fn: str, name: str, t, batch: int, dims: int) -> Tensor:
    """An int32 tensor with one row (or entry) per batch row, as flash-attn requires."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be an int32 tensor, got {_describe(t)}")
    if t.dtype != torch.int32:
        raise TypeError(f"{fn}: {name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != dims or t.size(0) != batch:
        shape = "(batch,)" if dims == 1 else "(batch, max_num_blocks_per_seq)"
        raise ValueError(
            f"{fn}: {name} must be {shape} with q's batch {batch}, got "
            f"{name}.shape={tuple(t.shape)}"
        )
    return t.cpu()


def _as_int(fn: str, name: str, value) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int, got {_describe(value)}") from None


def _as_float(fn: str, name: str, value) -> float:
    """A float argument as flash-attn's op takes it: a real number (an int, a float, a numpy or
    symbolic number; not a bool), or a tensor holding one real number that does not require
    grad. One that requires grad is refused: the op would take the number it holds, and its
    gradient would be dropped."""
    refuse_tensor_requiring_grad(fn, name, value)
    if isinstance(value, Tensor):
        if value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
            return float(value)
    elif not isinstance(value, bool) and \
            isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt)):
        return float(value)
    raise TypeError(f"{fn}: {name} must be a float, got {_describe(value)}")


def _check_scale(fn: str, softmax_scale) -> Optional[float]:
    """``softmax_scale`` as a float, or ``None`` for flash-attn's default ``1 / sqrt(headdim)``."""
    return None if softmax_scale is None else _as_float(fn, "softmax_scale", softmax_scale)


def _resolve_scale(softmax_scale: Optional[float], q: Tensor) -> float:
    return 1.0 / math.sqrt(q.size(-1)) if softmax_scale is None else softmax_scale


def _no_dropout_mask(q: Tensor) -> Tensor:
    """What flash-attn returns as S_dmask without dropout: an empty tensor of q's dtype."""
    return q.new_empty(0)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _consecutive(values: List[int]) -> bool:
    return all(b == a + 1 for a, b in zip(values, values[1:]))


def _describe(value) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return repr(value) if value is None or isinstance(value, (int, float, bool, str)) \
        else f"{type(value).__name__} {value!r}"
