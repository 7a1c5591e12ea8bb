"""The references the op is compared with: SDPA with the op's semantics (``sdpa_reference``),
and the attention materialized in float64 with every score option (``float64_reference``,
returning a ``Reference``), with the pieces they are built from (float64 copies, K/V heads
expanded for GQA, scaled scores, ALiBi's bias, the rows without keys)."""

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from causal_attention._masks import visible_keys


def to64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def expand_kv_heads(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """K or V with its heads repeated so that query head h reads kv head h // (Hq // Hkv)."""
    if t.dim() < 3 or t.shape[-3] in (0, heads_q):
        return t
    return t.repeat_interleave(heads_q // t.shape[-3], dim=-3)


def scaled_scores(q, k, scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """scale * q k^T in ``dtype``, K's heads expanded to q's; differentiable (leaves of that
    dtype stay in the graph)."""
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    q64, k64 = q.to(dtype), k.to(dtype)
    return q64 @ expand_kv_heads(k64, heads_q).transpose(-2, -1) * scale


def relative_positions(lq: int, lk: int) -> torch.Tensor:
    """int64 (lq, lk): j - (i + lk - lq), key j's position relative to query row i's own."""
    return torch.arange(lk) - (torch.arange(lq).unsqueeze(-1) + (lk - lq))


def alibi_bias(alibi_slopes: torch.Tensor, lq: int, lk: int, q_dim: int) -> torch.Tensor:
    """float64: ALiBi's -slope[..., h] * |i + lk - lq - j| for slopes (Hq,) or (*batch, Hq), of
    shape (..., Hq, lq, lk) to add to the scores of a ``q_dim``-D q ((lq, lk) for 2-D q, whose
    one head has slopes (1,))."""
    distance = relative_positions(lq, lk).abs().to(torch.float64)
    bias = -to64(alibi_slopes)[..., None, None] * distance
    return bias.reshape(lq, lk) if q_dim < 3 else bias


def empty_rows(lq: int, lk: int) -> torch.Tensor:
    """Bool (lq,): True for query rows that see no key (row i sees key j iff j <= i + lk - lq)."""
    return ~visible_keys(lq, lk).any(-1)


def sdpa_reference(q, k, v, grad_out=None, scale=None, visible=None, bias=None):
    """F.scaled_dot_product_attention with our semantics: bottom-right causal, or the boolean
    mask ``visible`` (broadcastable to (..., Hq, Lq, Lk), e.g. from ``visible_keys``) where given;
    with ``bias`` (float, broadcastable likewise, e.g. a Reference's logit_shift: ALiBi's), the
    float attn_mask that adds it to the visible scores (causal without ``visible``). GQA via
    enable_gqa. Returns ``(out, (dq, dk, dv))`` (grads None without ``grad_out``); rows that see
    no key are set to exactly zero in ``out`` and ``dq`` (SDPA may give NaN there).

    With ``visible``, SDPA is kept finite whatever its version does with a row of False: such
    rows see every key and get a zero ``grad_out``, which adds exactly nothing to dk and dv (their
    dS and P^T dO terms are products with zero)."""
    lq, lk = q.shape[-2], k.shape[-2]
    kwargs = {"scale": scale}
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        kwargs["enable_gqa"] = True
    if bias is not None and visible is None:
        visible = visible_keys(lq, lk)
    if visible is not None:
        no_key = ~visible.any(-1, keepdim=True)
        kwargs["attn_mask"] = visible | no_key
        if bias is not None:
            kwargs["attn_mask"] = torch.where(kwargs["attn_mask"], bias.to(q.dtype), -math.inf)
        if grad_out is not None:
            grad_out = grad_out.masked_fill(no_key, 0)
    elif lq == lk:
        no_key = empty_rows(lq, lk).unsqueeze(-1)
        kwargs["is_causal"] = True
    else:
        no_key = empty_rows(lq, lk).unsqueeze(-1)
        with warnings.catch_warnings():
            # "Lower right causal bias will produce NaNs ... when seq_len_q > seq_len_kv": handled.
            warnings.simplefilter("ignore", UserWarning)
            kwargs["attn_mask"] = causal_lower_right(lq, lk)
    leaves = [t.detach().requires_grad_(grad_out is not None) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, **kwargs)
    grads = (None, None, None)
    if grad_out is not None:
        grads = torch.autograd.grad(out, leaves, grad_out)
    out = torch.where(no_key, torch.zeros((), dtype=out.dtype), out.detach())
    if grads[0] is not None:
        grads = (torch.where(no_key, torch.zeros((), dtype=q.dtype), grads[0]),) + tuple(grads[1:])
    return out, grads


@dataclass
class Reference:
    """The float64 reference of one call.

    ``probs`` (..., Hq, Lq, Lk) are the attention weights applied to v, what attention_weights
    returns: zero where masked and in rows without keys, dropped and rescaled by 1 / (1 - p) with
    dropout; ``undropped`` the softmax probabilities themselves (``probs`` without dropout).
    ``grads`` (dq, dk, dv) or None, ``dsinks`` (Hq,) with sinks and grad_out, else None.
    ``sink_probs`` (..., Hq, Lq): each row's probability of its sink, exp(sink - lse) (None
    without sinks). ``visible``: which keys each row sees (broadcastable to the scores).
    ``logit_shift``: what softcap and ALiBi add to scale * q k^T where visible (0 elsewhere), i.e.
    the float attn_mask with which SDPA computes the same forward (not the same gradients with a
    softcap: the shift depends on q and k)."""

    out: torch.Tensor
    lse: torch.Tensor
    probs: torch.Tensor
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    undropped: Optional[torch.Tensor] = None
    dsinks: Optional[torch.Tensor] = None
    sink_probs: Optional[torch.Tensor] = None
    visible: Optional[torch.Tensor] = None
    logit_shift: Optional[torch.Tensor] = None


def float64_reference(
    q,
    k,
    v,
    scale: float,
    grad_out=None,
    visible=None,
    *,
    key_mask: Optional[torch.Tensor] = None,
    window: Tuple[int, int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    keep: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Reference:
    """Attention with the op's semantics, materialized in float64 from the given (already
    dtype-rounded) inputs, in FlashAttention's order: scores scale * q k^T -> softcap (softcap *
    tanh(S / softcap)) -> ALiBi (-slope * |i + off - j|) -> visibility (the window and key_mask
    of ``visible_keys``, bottom-right aligned, or the boolean mask ``visible`` given instead,
    broadcastable to the scores) -> softmax whose denominators get exp(sink[h]) -> dropout, which
    keeps the probabilities where ``keep`` (broadcastable to them; the op's mask, which the
    reference cannot draw) and divides them by 1 - ``dropout_p``. Autograd for the gradients,
    the sinks' included. Independent of SDPA and of the op's blocked online softmax.
    ``compute_dtype=torch.float32`` gives the same materialized computation in float32: the error
    a plain float32 implementation makes, for rules that hold the op to it."""
    lq, lk = q.shape[-2], k.shape[-2]
    if visible is None:
        visible = visible_keys(lq, lk, window, key_mask=key_mask)
    elif key_mask is not None or tuple(window) != (-1, 0):
        raise ValueError("float64_reference: give visible or key_mask and window, not both")
    if dropout_p > 0 and keep is None:
        raise ValueError(f"float64_reference: dropout_p={dropout_p} needs the keep mask")
    differentiable = grad_out is not None
    leaves = [t.detach().to(compute_dtype).requires_grad_(differentiable) for t in (q, k, v)]
    q64, k64, v64 = leaves
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    raw = scaled_scores(q64, k64, scale, compute_dtype)
    scores = raw
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, lq, lk, q.dim()).to(compute_dtype)
    logit_shift = (scores - raw).detach().masked_fill(~visible, 0.0)
    no_key = ~visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, -math.inf)
    sinks64 = None
    if sinks is None:
        # Rows without keys get finite dummy scores (their weights are zeroed below), so that
        # neither the softmax nor its gradient sees a row of -inf.
        scores = scores.masked_fill(no_key, 0.0)
        lse = torch.logsumexp(scores, -1).masked_fill(no_key.squeeze(-1), -math.inf)
        undropped = torch.softmax(scores, -1).masked_fill(no_key, 0.0)
        sink_probs = None
    else:
        # The sink is one more column of every row's softmax, which keeps rows without keys
        # finite: their keys get probability 0 and the sink 1.
        sinks64 = sinks.detach().to(compute_dtype).requires_grad_(differentiable)
        sink_column = sinks64.reshape((-1, 1, 1) if q.dim() >= 3 else (1, 1))
        with_sink = torch.cat([scores, sink_column.expand(scores.shape[:-1] + (1,))], -1)
        lse = torch.logsumexp(with_sink, -1)
        probs_with_sink = torch.softmax(with_sink, -1)
        undropped = probs_with_sink[..., :-1]
        sink_probs = probs_with_sink[..., -1].detach()
    probs = undropped
    if keep is not None:
        probs = undropped * keep / (1 - dropout_p)
    out = probs @ expand_kv_heads(v64, heads_q)
    grads = dsinks = None
    if differentiable:
        wrt = leaves + ([sinks64] if sinks64 is not None else [])
        all_grads = torch.autograd.grad(out, wrt, grad_out.to(compute_dtype))
        grads = tuple(all_grads[:3])
        if sinks64 is not None:
            dsinks = all_grads[3]
    return Reference(
        out=out.detach(),
        lse=lse.detach(),
        probs=probs.detach(),
        grads=grads,
        undropped=undropped.detach(),
        dsinks=dsinks,
        sink_probs=sink_probs,
        visible=visible,
        logit_shift=logit_shift,
    )
