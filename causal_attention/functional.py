"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

It serves exactly the calls whose result our op reproduces (with dropout, the same computation
with its own random stream), and refuses every other call with ``NotImplementedError`` naming
the argument, so that swapping it in can never silently change a model's results. An argument
of a type SDPA refuses is refused with SDPA's exception type.
"""

import sys
from typing import Optional

import torch
from torch import Tensor

from ._arguments import refuse_tensor_requiring_grad
from .ops import attention

_OP = "causal_attention.scaled_dot_product_attention"


def _parses_as_float(value: object) -> bool:
    """Whether torch's argument parser takes ``value`` for a float argument of SDPA (dropout_p,
    scale): a Python or numpy number (bool included), a SymInt or SymFloat, or a 0-d tensor that
    does not require grad (one that does is refused: the float it becomes gets no gradient)."""
    if isinstance(value, (float, int, torch.SymFloat, torch.SymInt)):
        return True
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.requires_grad
    # Not imported for this: an object cannot be a numpy number unless numpy is loaded.
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, (numpy.number, numpy.bool_))


def _check_argument_types(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
) -> None:
    """Refuses what torch's parser refuses for SDPA, with its exception types (TypeError; an int
    too large for a float is an OverflowError), before any call is judged served or not."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{_OP}: {name} must be a Tensor, got {type(tensor).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(
            f"{_OP}: attn_mask must be a Tensor or None, got {type(attn_mask).__name__}"
        )
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_OP}: {name} must be a bool, got {type(flag).__name__}")
    for name, number in (("dropout_p", dropout_p), ("scale", scale)):
        if name == "scale" and number is None:
            continue
        refuse_tensor_requiring_grad(_OP, name, number)
        if not _parses_as_float(number):
            seen = type(number).__name__
            if isinstance(number, Tensor):
                seen = f"a Tensor of shape {tuple(number.shape)} (SDPA takes only a 0-d one)"
            raise TypeError(f"{_OP}: {name} must be a float, got {seen}")
        if isinstance(number, int):
            float(number)  # OverflowError for an int beyond float's range, as SDPA raises


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
    the calls it serves: ``attn_mask=None``; ``is_causal=False`` (full attention, any query and
    key lengths) or ``is_causal=True`` with equal query and key lengths; ``0 <= dropout_p < 1``;
    and key/value heads fewer than query heads only with ``enable_gqa=True``.

    Shapes are SDPA's: ``query (..., Hq, Lq, E)``, ``key (..., Hkv, Lk, E)``,
    ``value (..., Hkv, Lk, Ev)`` -> ``(..., Hq, Lq, Ev)``. As in SDPA, ``dropout_p > 0`` drops
    attention probabilities whatever the module's training mode (pass ``dropout_p=0.0`` in
    evaluation), drawing the dropout mask's seed from torch's default generator: the same
    generator state gives the same result, bit for bit (SDPA's own random stream differs, so
    the two agree in distribution, not draw for draw). Any other call raises
    ``NotImplementedError``: masks are not implemented, ``dropout_p=1`` (SDPA's all-zero
    output) neither, and with ``Lq != Lk`` SDPA's ``is_causal`` aligns top-left while this op
    aligns bottom-right (call :func:`causal_attention.attention` for the KV-cache alignment).
    Arguments of a type SDPA refuses raise SDPA's ``TypeError``, a ``scale`` tensor that
    requires grad included; a ``dropout_p`` outside ``[0, 1]`` raises ``ValueError``.
    """
    _check_argument_types(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None:
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: attn_mask is not supported; "
            "only is_causal=True or False without a mask is served"
        )
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(
            "causal_attention.scaled_dot_product_attention: dropout_p must be in [0, 1], got "
            f"dropout_p={dropout_p}"
        )
    if dropout_p == 1.0:
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: dropout_p=1.0 (every probability "
            "dropped, an all-zero output in SDPA) is not supported; dropout_p must be below 1"
        )
    if is_causal and query.dim() >= 2 and key.dim() >= 2 and query.size(-2) != key.size(-2):
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: is_causal=True with query and key "
            f"lengths that differ (query.shape={tuple(query.shape)}, key.shape="
            f"{tuple(key.shape)}); SDPA's is_causal aligns top-left there, this op "
            "bottom-right: call causal_attention.attention for KV-cache attention"
        )
    if not enable_gqa and query.dim() >= 3 and key.dim() >= 3 and query.size(-3) != key.size(-3):
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: query and key have different head "
            f"counts (query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}); pass "
            "enable_gqa=True for grouped-query attention"
        )
    # is_causal=False is full attention: no bound on either side of the diagonal.
    window = (-1, 0) if is_causal else (-1, -1)
    return attention(query, key, value, scale=scale, window=window, dropout_p=dropout_p)
