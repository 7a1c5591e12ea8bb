"""flash-attn's packed-sequence (varlen) functions: ``flash_attn_varlen_func`` and its packed
forms ``flash_attn_varlen_qkvpacked_func`` and ``flash_attn_varlen_kvpacked_func`` over the one
varlen call (``_varlen_call``), and ``flash_attn_varlen_func`` over a paged cache
(``block_table``, ``_paged_varlen_call``); with flash-attn's causal ALiBi kernel, its
softmax_lse of packed rows (``_varlen_alibi_lse``)."""

import torch
from torch import Tensor

from ...ops import attention_forward, paged_attention, varlen_attention
from ._checks import (
    _PREFIX,
    _as_int,
    _check_dropout,
    _check_head_dim,
    _check_packed_kv,
    _check_pages,
    _check_rank,
    _check_row_indices,
    _check_scale,
    _describe,
    _no_dropout_mask,
    _resolve_scale,
    _unpack,
)
from ._scores import _Scores


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
    lengths_k = cu_seqlens_k.cpu().diff()
    # The contiguous call's op checks this: the window is rewritten by max_seqlen_k.
    if lengths_k.numel() and int(lengths_k.max()) > max_k:
        b = int(lengths_k.argmax())
        raise ValueError(
            f"{fn}: sequence {b} has length {int(lengths_k[b])} (cu_seqlens_k[{b + 1}] - "
            f"cu_seqlens_k[{b}]), more than max_seqlen_k={max_k}"
        )
    _check_pages(fn, table, k_cache.size(1), k_cache.size(0), lengths_k)
    scores = _Scores.of(fn, causal, window_size, softcap, alibi_slopes, max_q, max_k, batch,
                        q.size(1))
    dropout_p = _check_dropout(fn, dropout_p, return_attn_probs)
    if dropout_p > 0.0:
        raise NotImplementedError(
            f"{fn}: dropout_p={dropout_p} with block_table (a paged cache) is not supported: "
            "the paged call serves inference, which draws no dropout"
        )
    softmax_scale = _check_scale(fn, softmax_scale)
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
