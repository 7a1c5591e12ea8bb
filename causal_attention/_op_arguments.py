"""The ops' arguments on the Python side, as csrc/ops/op_arguments.h holds them on the C++ side:
:class:`ScoreOptions`, the score options every op takes, and :func:`call_op`, each op called
after the checks its schema parser cannot make (a window of two ints, float arguments that are
not tensors requiring grad), the parser's own refusals raised as TypeError."""

from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ._arguments import check_window, refuse_tensor_requiring_grad


class ScoreOptions(NamedTuple):
    """The score options every op takes, under their schema names and with their defaults,
    applied in FlashAttention's order: ``S = scale * q k^T`` -> softcap -> ALiBi -> visibility
    (window, key mask) -> softmax (sinks join the denominator) -> dropout.

    window: ``(left, right)``: query row ``i`` sees key ``j`` iff
        ``i + off - left <= j <= i + off + right``, ``off = Lk - Lq`` (bottom-right alignment),
        ``-1`` unbounded on that side. The default ``(-1, 0)`` is causal attention, ``(-1, -1)``
        full attention, ``(W - 1, 0)`` a sliding window of ``W`` keys; key blocks outside every
        row's window are never touched.
    softcap: ``S -> softcap * tanh(S / softcap)`` (Gemma 2's logit soft-capping), ``> 0``.
    alibi_slopes: float32 ``(Hq,)`` or ``(*batch, Hq)``: adds ``-slope * |i + off - j|``. Not
        differentiable.
    sinks: ``(Hq,)`` logits (q's dtype or float32) that join each row's softmax denominator and
        nothing else (gpt-oss); differentiable. ``lse`` includes them.
    dropout_p: drops each probability with probability ``p`` in ``[0, 1)`` and scales the kept
        ones by ``1 / (1 - p)``, with a counter-based mask regenerated in the backward (nothing
        of size ``L^2`` is stored; bitwise the same at any thread count). The differentiable ops
        draw its ``(seed, offset)`` from ``generator`` (the default CPU generator when None) as
        ``torch.empty(2, dtype=torch.int64).random_(generator=generator)``, only when
        ``dropout_p > 0``: the same generator state gives the same mask.
    """

    window: Tuple[int, int] = (-1, 0)
    softcap: Optional[float] = None
    alibi_slopes: Optional[Tensor] = None
    sinks: Optional[Tensor] = None
    dropout_p: float = 0.0


# The float arguments that the schema parser would also take as a tensor, dropping its gradient.
_FLOAT_ARGUMENTS = ("scale", "softcap", "dropout_p")

# Each op, and where the arguments the schema parser cannot check sit among its positional
# arguments, read once from its schema (torch.compile traces the wrappers, not a schema).
_OPS = {
    name: getattr(torch.ops.causal_attention, name)
    for name in ("attention", "attention_weights", "varlen_attention", "attention_forward",
                 "attention_backward", "attention_gradients", "varlen_attention_forward",
                 "varlen_attention_backward", "paged_attention")
}
_CHECKED_POSITIONS = {
    name: tuple((a.name, i) for i, a in enumerate(op.default._schema.arguments)
                if a.name in ("window",) + _FLOAT_ARGUMENTS)
    for name, op in _OPS.items()
}


def call_op(name: str, *args: Any, **kwargs: Any) -> Any:
    """``torch.ops.causal_attention.<name>`` after the checks the schema parser cannot make;
    what the parser refuses raises TypeError."""
    caller = "causal_attention." + name
    for argument, position in _CHECKED_POSITIONS[name]:
        value = args[position] if position < len(args) else kwargs.get(argument)
        if argument == "window":
            if value is not None:
                check_window(caller, value)
        else:
            refuse_tensor_requiring_grad(caller, argument, value)
    op = _OPS[name]
    try:
        return op(*args, **kwargs)
    except RuntimeError as error:
        # The schema parser refuses a value of the wrong type, an unknown or a missing argument
        # with a RuntimeError naming it and what it found: a TypeError, as the wrappers' own
        # checks raise. Parsing again tells it from the op's errors, only once one is raised.
        if _parses(op, args, kwargs):
            raise
        raise TypeError(str(error)) from None


def _parses(op: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether the schema parser takes ``args`` and ``kwargs`` for ``op``."""
    try:
        return torch._C._check_schema_allow_fake_script_object(op.default._schema, *args,
                                                                **kwargs)
    except RuntimeError:
        return False
