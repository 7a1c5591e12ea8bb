"""Typed Python wrappers around the ``torch.ops.causal_attention`` operators."""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

# The score options every op takes (issue 14), applied in FlashAttention's order:
# ``S = scale * q k^T`` -> softcap -> ALiBi -> visibility (window, key_mask) -> softmax (sinks join
# the denominator) -> dropout.
_SCORE_OPTIONS_DOC = """
        window: ``(left, right)``: query row ``i`` sees key ``j`` iff
            ``i + off - left <= j <= i + off + right``, ``off = Lk - Lq`` (bottom-right
            alignment), ``-1`` unbounded on that side. The default ``(-1, 0)`` is causal
            attention, ``(-1, -1)`` full attention, ``(W - 1, 0)`` a sliding window of ``W`` keys;
            key blocks outside every row's window are never touched.
        softcap: ``S -> softcap * tanh(S / softcap)`` (Gemma 2's logit soft-capping), ``> 0``.
        alibi_slopes: float32 ``(Hq,)`` or ``(*batch, Hq)``: adds ``-slope * |i + off - j|``.
            Not differentiable.
        sinks: ``(Hq,)`` logits (q's dtype or float32) that join each row's softmax denominator
            and nothing else (gpt-oss); differentiable. ``lse`` includes them.
        dropout_p: drops each probability with probability ``p`` in ``[0, 1)`` and scales the
            kept ones by ``1 / (1 - p)``, with a counter-based mask regenerated in the backward
            (nothing of size ``L^2`` is stored; bitwise the same at any thread count).
        generator: the ``torch.Generator`` dropout's seed is drawn from (the default CPU generator
            when None), as ``torch.empty(2, dtype=torch.int64).random_(generator=generator)``,
            only when ``dropout_p > 0``: the same generator state gives the same mask."""


def _window(caller: str, window: Sequence[int]) -> Tuple[int, int]:
    """``window`` as the ops' ``int[2]``, refusing anything but two ints with a TypeError naming
    ``caller`` (the schema would broadcast a single int to both sides)."""
    if (
        isinstance(window, (str, bytes))
        or not isinstance(window, Sequence)
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)
    ):
        raise TypeError(
            f"{caller}: window must be two ints (left, right), got window={window!r}"
        )
    return (window[0], window[1])


def _score_options(
    op: str,
    window: Sequence[int],
    softcap: Optional[float],
    alibi_slopes: Optional[Tensor],
    sinks: Optional[Tensor],
    dropout_p: float,
) -> dict:
    """The score options as keyword arguments of ``causal_attention.<op>`` (their names in every
    schema)."""
    return dict(
        window=_window(f"causal_attention.{op}", window),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        dropout_p=dropout_p,
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
    window: Sequence[int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
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
            rows and combined with the window; key blocks it hides entirely are skipped. A row
            left with no visible key returns zeros; hidden keys get zero gradient.{options}

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
    return torch.ops.causal_attention.attention(
        q,
        k,
        v,
        scale=scale,
        key_mask=key_mask,
        **_score_options(
            "attention", window, softcap, alibi_slopes, sinks, dropout_p
        ),
        generator=generator,
    )


attention.__doc__ = attention.__doc__.replace("{options}", _SCORE_OPTIONS_DOC)


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    key_mask: Optional[Tensor] = None,
    window: Sequence[int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The forward kernel: ``(out, lse)``, where ``lse`` ``(..., Hq, Lq)`` is the natural-log
    sum of the exponentiated modified scores of each row and its sink (``-inf`` for a row with no
    visible key and no sink), float32 (float64 for float64 inputs). Differentiable in ``out`` and
    ``sinks``; ``lse`` is not. The options are :func:`attention`'s; ``dropout_seed`` is the int64
    ``(2,)`` tensor ``(seed, offset)`` of the dropout mask, required when ``dropout_p > 0``."""
    return torch.ops.causal_attention.attention_forward(
        q,
        k,
        v,
        scale,
        key_mask,
        **_score_options(
            "attention_forward", window, softcap, alibi_slopes, sinks, dropout_p
        ),
        dropout_seed=dropout_seed,
    )


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    key_mask: Optional[Tensor] = None,
    window: Sequence[int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward kernel: ``(dq, dk, dv, dsinks)`` from the forward's ``out`` and ``lse``,
    called with the forward's options; ``dsinks`` ``(Hq,)`` in the sinks' dtype (empty ``(0,)``
    without sinks). Not differentiable itself (double backward raises)."""
    return torch.ops.causal_attention.attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        scale,
        key_mask,
        **_score_options(
            "attention_backward", window, softcap, alibi_slopes, sinks, dropout_p
        ),
        dropout_seed=dropout_seed,
    )


def attention_weights(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
    window: Sequence[int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """The attention probabilities that :func:`attention` applies to ``v``, materialized.

    Returns ``(..., Hq, Lq, Lk)`` in the inputs' dtype: row ``i`` is the softmax (with the sink
    in its denominator) of the modified scores over the keys of its window that ``key_mask``
    keeps, zero elsewhere, and all zeros for a row with no visible key. With ``dropout_p > 0``,
    the dropped probabilities are zero and the kept ones scaled by ``1 / (1 - p)``: with the same
    generator state, ``attention(...) == attention_weights(...) @ v`` up to rounding, with exactly
    the mask :func:`attention` uses.
    Arguments and errors are those of :func:`attention`; ``v`` is only validated.

    This is for inspection: it takes O(Lq * Lk) memory, which :func:`attention` never does.
    Differentiable in ``q``, ``k`` and ``sinks``.
    """
    return torch.ops.causal_attention.attention_weights(
        q,
        k,
        v,
        scale=scale,
        key_mask=key_mask,
        **_score_options(
            "attention_weights", window, softcap, alibi_slopes, sinks, dropout_p
        ),
        generator=generator,
    )


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
    window: Sequence[int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
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
        window, softcap, alibi_slopes, sinks, dropout_p, generator: as :func:`attention`, per
            sequence (``alibi_slopes`` ``(Hq,)`` or ``(N, Hq)``; dropout's batch index is the
            sequence's).

    Returns:
        ``(total_q, Hq, Dv)``. Each sequence attends only to itself, windowed and bottom-right
        aligned as :func:`attention` (so a sequence with fewer queries than keys is a chunk
        against its own cache, and one with more has rows that see nothing and return zeros).
        The work is proportional to the sum of the sequences' squared lengths, never to
        ``N * max_seqlen ** 2``. Bad cumulative lengths raise ``ValueError`` (``TypeError`` if
        not int32).
    """
    return torch.ops.causal_attention.varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale=scale,
        **_score_options(
            "varlen_attention", window, softcap, alibi_slopes, sinks, dropout_p
        ),
        generator=generator,
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
    window: Sequence[int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The packed forward kernel: ``(out, lse)``, ``lse`` ``(Hq, total_q)`` (FlashAttention's
    varlen layout) in float32 (float64 for float64 inputs); options as
    :func:`attention_forward`'s."""
    return torch.ops.causal_attention.varlen_attention_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        **_score_options(
            "varlen_attention_forward", window, softcap, alibi_slopes, sinks, dropout_p
        ),
        dropout_seed=dropout_seed,
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
    window: Sequence[int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The packed backward kernel: ``(dq, dk, dv, dsinks)`` from the forward's ``out`` and
    ``lse``, called with the forward's options."""
    return torch.ops.causal_attention.varlen_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        **_score_options(
            "varlen_attention_backward", window, softcap, alibi_slopes, sinks, dropout_p
        ),
        dropout_seed=dropout_seed,
    )
