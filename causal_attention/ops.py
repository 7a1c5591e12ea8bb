"""Typed Python wrappers around the ``torch.ops.causal_attention`` operators."""

from typing import Optional, Tuple

import torch
from torch import Tensor


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """Exact causal scaled-dot-product attention, differentiable, without an L x L matrix.

    Args:
        q: queries ``(..., Hq, Lq, D)``, or ``(Lq, D)`` for one head.
        k: keys ``(..., Hkv, Lk, D)``; ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA: query
            head ``h`` reads key/value head ``h // (Hq // Hkv)``; K/V are not copied).
        v: values ``(..., Hkv, Lk, Dv)``; ``Dv`` may differ from ``D``.
        scale: multiplies ``q @ k^T`` before the softmax; defaults to ``1 / sqrt(D)``.
        key_mask: optional bool ``(..., Lk)`` with ``q``'s leading (batch) dims (``(Lk,)`` for a
            call without them), True where a key may be attended (SDPA's boolean-mask and
            transformers' ``attention_mask`` convention). It is broadcast over heads and query
            rows and combined with causality; key blocks it hides entirely are skipped. A row
            left with no visible key returns zeros; hidden keys get zero gradient.

    Returns:
        ``(..., Hq, Lq, Dv)`` in the inputs' dtype (float64, float32, bfloat16 or float16;
        accumulation is float32, float64 for float64).

    Causal alignment is bottom-right: query row ``i`` attends key ``j`` iff
    ``j <= i + (Lk - Lq)``. With ``Lq == Lk`` that is the lower triangle with the diagonal; with
    a KV cache (``Lk > Lq``) the new queries see the whole cache. A query row that sees no key
    (possible when ``Lq > Lk``) returns zeros and gets zero gradient, never NaN. Any strides
    are accepted, e.g. ``x.view(B, L, H, D).transpose(1, 2)`` without ``.contiguous()``.
    Bad shapes or devices raise ``ValueError``, as does a ``scale`` that is not finite in the
    accumulation dtype (``1e39`` is inf in float32), bad dtypes ``TypeError``, nested or sparse
    tensors ``NotImplementedError``.
    """
    return torch.ops.causal_attention.attention(q, k, v, scale=scale, key_mask=key_mask)


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, key_mask: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """The forward kernel: ``(out, lse)``, where ``lse`` ``(..., Hq, Lq)`` is the natural-log
    sum of the exponentiated scaled scores of each row (``-inf`` for a row with no visible key),
    float32 (float64 for float64 inputs). Differentiable in ``out``; ``lse`` is not."""
    return torch.ops.causal_attention.attention_forward(q, k, v, scale, key_mask)


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    key_mask: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The backward kernel: ``(dq, dk, dv)`` from the forward's ``out`` and ``lse``.
    Not differentiable itself (double backward raises)."""
    return torch.ops.causal_attention.attention_backward(
        grad_out, q, k, v, out, lse, scale, key_mask
    )


def attention_weights(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """The attention probabilities that :func:`attention` applies to ``v``, materialized.

    Returns ``(..., Hq, Lq, Lk)`` in the inputs' dtype: row ``i`` is the softmax of
    ``scale * q_i k^T`` over the keys ``j <= i + (Lk - Lq)`` (bottom-right causal alignment, as
    :func:`attention`) that ``key_mask`` keeps, zero elsewhere, and all zeros for a row with no
    visible key.
    Arguments and errors are those of :func:`attention`; ``v`` is only validated.

    This is for inspection: it takes O(Lq * Lk) memory, which :func:`attention` never does.
    Differentiable in ``q`` and ``k``.
    """
    return torch.ops.causal_attention.attention_weights(q, k, v, scale=scale, key_mask=key_mask)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: Optional[float] = None,
) -> Tensor:
    """Causal attention over packed sequences (FlashAttention's varlen layout), differentiable.

    Args:
        q: ``(total_q, Hq, D)``: the query rows of every sequence, one after the other.
        k: ``(total_k, Hkv, D)``; ``Hq`` a multiple of ``Hkv`` (GQA/MQA, as :func:`attention`).
        v: ``(total_k, Hkv, Dv)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(N + 1,)`` cumulative lengths from 0: sequence
            ``i`` is rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of ``q`` and
            ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]`` of ``k`` and ``v``.
        max_seqlen_q, max_seqlen_k: upper bounds of the sequences' lengths.
        scale: defaults to ``1 / sqrt(D)``.

    Returns:
        ``(total_q, Hq, Dv)``. Each sequence attends only to itself, causal and bottom-right
        aligned as :func:`attention` (so a sequence with fewer queries than keys is a chunk
        against its own cache, and one with more has rows that see nothing and return zeros).
        The work is proportional to the sum of the sequences' squared lengths, never to
        ``N * max_seqlen ** 2``. Bad cumulative lengths raise ``ValueError`` (``TypeError`` if
        not int32).
    """
    return torch.ops.causal_attention.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale
    )


def varlen_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> Tuple[Tensor, Tensor]:
    """The packed forward kernel: ``(out, lse)``, ``lse`` ``(Hq, total_q)`` (FlashAttention's
    varlen layout) in float32 (float64 for float64 inputs)."""
    return torch.ops.causal_attention.varlen_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale
    )


def varlen_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The packed backward kernel: ``(dq, dk, dv)`` from the forward's ``out`` and ``lse``."""
    return torch.ops.causal_attention.varlen_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale
    )
