"""Checks of arguments shared by the op wrappers (:mod:`causal_attention.ops`), the drop-ins
(:func:`causal_attention.scaled_dot_product_attention`, the flash-attn functions of
:mod:`causal_attention.integrations.flash_attn`) and the modules that take the ops' options
(:class:`causal_attention.CausalSelfAttention`, :mod:`causal_attention.distributed`)."""

from typing import Sequence, Tuple

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


def check_window(caller: str, window: Sequence[int]) -> Tuple[int, int]:
    """``window`` as the ops' ``int[2]``, refusing anything but two ints with a TypeError naming
    ``caller`` (the schema would broadcast a single int to both sides)."""
    if type(window) is tuple and len(window) == 2 and type(window[0]) is type(window[1]) is int:
        return window  # the common case, without the slower Sequence check below
    if (
        isinstance(window, (str, bytes))
        or not isinstance(window, Sequence)
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)
    ):
        raise TypeError(f"{caller}: window must be two ints (left, right), got window={window!r}")
    return (window[0], window[1])
