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
from torch.nn.attention.bias import CausalBias, CausalVariant

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
    the calls it serves: ``is_causal=False`` (full attention) or ``is_causal=True`` (causal,
    top-left aligned as SDPA's: query row ``i`` sees keys ``0..i``) with any query and key
    lengths; ``attn_mask`` None or a ``torch.nn.attention.bias.CausalBias``
    (``causal_upper_left``, as ``is_causal``, or ``causal_lower_right``: row ``i`` sees keys
    up to ``i + Lk - Lq``, the KV-cache alignment); ``0 <= dropout_p < 1``; and key/value heads
    fewer than query heads only with ``enable_gqa=True``. Both alignments are the op's window
    geometry, no mask built; a row that sees no key (lower-right with ``Lq > Lk``) gives zeros,
    as in SDPA.

    Shapes are SDPA's: ``query (..., Hq, Lq, E)``, ``key (..., Hkv, Lk, E)``,
    ``value (..., Hkv, Lk, Ev)`` -> ``(..., Hq, Lq, Ev)``. As in SDPA, ``dropout_p > 0`` drops
    attention probabilities whatever the module's training mode (pass ``dropout_p=0.0`` in
    evaluation), drawing the dropout mask's seed from torch's default generator: the same
    generator state gives the same result, bit for bit (SDPA's own random stream differs, so
    the two agree in distribution, not draw for draw). Any other call raises
    ``NotImplementedError``: other masks are not implemented, ``dropout_p=1`` (SDPA's all-zero
    output) neither. Arguments of a type SDPA refuses raise SDPA's ``TypeError``, a ``scale``
    tensor that requires grad included; a ``dropout_p`` outside ``[0, 1]`` raises
    ``ValueError``, as a CausalBias with ``is_causal=True`` does in SDPA.
    """
    _check_argument_types(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    top_left = True
    if isinstance(attn_mask, CausalBias):
        if is_causal:
            raise ValueError(
                f"{_OP}: a CausalBias attn_mask should not be used with is_causal=True"
            )
        is_causal, top_left = True, attn_mask.variant == CausalVariant.UPPER_LEFT
    elif attn_mask is not None:
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: attn_mask is not supported but as a "
            "torch.nn.attention.bias.CausalBias; is_causal=True or False without a mask is served"
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
    if not enable_gqa and query.dim() >= 3 and key.dim() >= 3 and query.size(-3) != key.size(-3):
        raise NotImplementedError(
            "causal_attention.scaled_dot_product_attention: query and key have different head "
            f"counts (query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}); pass "
            "enable_gqa=True for grouped-query attention"
        )
    key, value, window = _aligned(query, key, value, is_causal, top_left)
    return attention(query, key, value, scale=scale, window=window, dropout_p=dropout_p)


def _aligned(query: Tensor, key: Tensor, value: Tensor, is_causal: bool, top_left: bool):
    """Keys, values and the op's window (bottom-right aligned) for SDPA's visibility.
    is_causal=False is full attention: no bound on either side. Top-left causal with
    ``Lq < Lk`` leaves the keys past ``Lq`` unseen by every row: they are dropped (a view, and
    their gradient is zero), and what is left is causal with equal lengths; with ``Lq > Lk``,
    row ``i`` sees keys up to ``i = i + (Lk - Lq) + (Lq - Lk)``: a window reaching ``Lq - Lk``
    past the bottom-right diagonal."""
    if not is_causal:
        return key, value, (-1, -1)
    if not top_left or query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        return key, value, (-1, 0)
    len_q, len_k = query.size(-2), key.size(-2)
    if len_q < len_k:
        return key.narrow(-2, 0, len_q), value.narrow(-2, 0, len_q), (-1, 0)
    return key, value, (-1, len_q - len_k)
