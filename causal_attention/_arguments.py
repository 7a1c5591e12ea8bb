"""Checks of arguments shared by the op wrappers (:mod:`causal_attention.ops`) and the drop-ins
(:func:`causal_attention.scaled_dot_product_attention`, the flash-attn functions of
:mod:`causal_attention.integrations.flash_attn`)."""

from torch import Tensor


def refuse_tensor_requiring_grad(fn: str, name: str, value: object) -> None:
    """Raises ``TypeError`` when ``value``, given for ``fn``'s float argument ``name`` (a scale,
    a softcap, a dropout probability), is a tensor that requires grad: the op's schema takes it
    as the Python float it holds, so its gradient would be dropped without a word."""
    if isinstance(value, Tensor) and value.requires_grad:
        raise TypeError(
            f"{fn}: {name} must be a float, got a tensor that requires grad (shape "
            f"{tuple(value.shape)}, dtype {value.dtype}): {name} is taken as a number and gets "
            f"no gradient; pass a float, or {name}.detach() if no gradient is meant"
        )
