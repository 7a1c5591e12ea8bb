"""Typed Python wrappers around the ``torch.ops.causal_attention`` operators."""

from typing import Optional, Tuple

import torch
from torch import Tensor


def attention(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None) -> Tensor:
    """Exact causal scaled-dot-product attention, differentiable, without an L x L matrix.

    Args:
        q: queries ``(..., Hq, Lq, D)``, or ``(Lq, D)`` for one head.
        k: keys ``(..., Hkv, Lk, D)``; ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA: query
            head ``h`` reads key/value head ``h // (Hq // Hkv)``; K/V are not copied).
        v: values ``(..., Hkv, Lk, Dv)``; ``Dv`` may differ from ``D``.
        scale: multiplies ``q @ k^T`` before the softmax; defaults to ``1 / sqrt(D)``.

    Returns:
        ``(..., Hq, Lq, Dv)`` in the inputs' dtype (float64, float32, bfloat16 or float16;
        accumulation is float32, float64 for float64).

    Causal alignment is bottom-right: query row ``i`` attends key ``j`` iff
    ``j <= i + (Lk - Lq)``. With ``Lq == Lk`` that is the lower triangle with the diagonal; with
    a KV cache (``Lk > Lq``) the new queries see the whole cache. A query row that sees no key
    (possible when ``Lq > Lk``) returns zeros and gets zero gradient, never NaN. Any strides
    are accepted, e.g. ``x.view(B, L, H, D).transpose(1, 2)`` without ``.contiguous()``.
    Bad shapes or devices raise ``ValueError``, bad dtypes ``TypeError``.
    """
    return torch.ops.causal_attention.attention(q, k, v, scale=scale)


def attention_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """The forward kernel: ``(out, lse)``, where ``lse`` ``(..., Hq, Lq)`` is the natural-log
    sum of the exponentiated scaled scores of each row (``-inf`` for a row with no visible key),
    float32 (float64 for float64 inputs). Differentiable in ``out``; ``lse`` is not."""
    return torch.ops.causal_attention.attention_forward(q, k, v, scale)


def attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    """The backward kernel: ``(dq, dk, dv)`` from the forward's ``out`` and ``lse``.
    Not differentiable itself (double backward raises)."""
    return torch.ops.causal_attention.attention_backward(grad_out, q, k, v, out, lse, scale)


def attention_weights(
    q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None
) -> Tensor:
    """The attention probabilities that :func:`attention` applies to ``v``, materialized.

    Returns ``(..., Hq, Lq, Lk)`` in the inputs' dtype: row ``i`` is the softmax of
    ``scale * q_i k^T`` over the keys ``j <= i + (Lk - Lq)`` (bottom-right causal alignment, as
    :func:`attention`), zero above that boundary, and all zeros for a row with no visible key.
    Arguments and errors are those of :func:`attention`; ``v`` is only validated.

    This is for inspection: it takes O(Lq * Lk) memory, which :func:`attention` never does.
    Differentiable in ``q`` and ``k``.
    """
    return torch.ops.causal_attention.attention_weights(q, k, v, scale=scale)
