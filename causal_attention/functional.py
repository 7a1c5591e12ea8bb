"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

It serves exactly the calls whose result our op reproduces, and refuses every other call with
``NotImplementedError`` naming the argument, so that swapping it in can never silently change a
model's results.
"""

from typing import Optional

from torch import Tensor

from .ops import attention


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Same signature and result as ``torch.nn.functional.scaled_dot_product_attention`` for
    the calls it serves: ``is_causal=True``, ``attn_mask=None``, ``dropout_p=0``, equal query
    and key lengths, and key/value heads fewer than query heads only with ``enable_gqa=True``.

    Shapes are SDPA's: ``query (..., Hq, L, E)``, ``key (..., Hkv, L, E)``,
    ``value (..., Hkv, L, Ev)`` -> ``(..., Hq, L, Ev)``. Any other call raises
    ``NotImplementedError``: masks, dropout and non-causal attention are not implemented, and
    with ``Lq != Lk`` SDPA's ``is_causal`` aligns top-left while this op aligns bottom-right
    (call :func:`causal_attention.attention` for the KV-cache alignment).
    """
    if attn_mask is not None:
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: attn_mask is not supported; "
            "only is_causal=True without a mask is served"
        )
    if dropout_p != 0.0:
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: dropout_p must be 0.0, got "
            f"dropout_p={dropout_p}"
        )
    if not is_causal:
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: is_causal=False (full, non-causal "
            "attention) is not supported; pass is_causal=True"
        )
    # Shapes are compared only between tensors: anything else (None, a list) is the op's to refuse
    # with a TypeError naming the argument.
    tensors = isinstance(query, Tensor) and isinstance(key, Tensor)
    if tensors and query.dim() >= 2 and key.dim() >= 2 and query.size(-2) != key.size(-2):
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: query and key lengths differ "
            f"(query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}); SDPA's "
            "is_causal aligns top-left there, this op bottom-right: call "
            "causal_attention.attention for KV-cache attention"
        )
    if (
        tensors
        and not enable_gqa
        and query.dim() >= 3
        and key.dim() >= 3
        and query.size(-3) != key.size(-3)
    ):
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: query and key have different head "
            f"counts (query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}); pass "
            "enable_gqa=True for grouped-query attention"
        )
    return attention(query, key, value, scale=scale)
