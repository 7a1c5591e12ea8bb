"""flash-attn's dense functions: ``flash_attn_func`` and its packed forms
``flash_attn_qkvpacked_func`` and ``flash_attn_kvpacked_func``, views of the packed tensor handed
to the one dense call (``_dense_call``), which runs the op in flash-attn's (batch, seqlen, nheads,
headdim) layout."""

import torch

from ...ops import attention, attention_forward
from ._checks import (
    _PREFIX,
    _check_batched,
    _check_dropout,
    _check_packed_kv,
    _check_rank,
    _check_scale,
    _no_dropout_mask,
    _resolve_scale,
    _unpack,
)
from ._scores import _Scores


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
