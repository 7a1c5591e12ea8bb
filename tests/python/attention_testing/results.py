"""The results of one call, (out, dq, dk, dv) and dsinks with sinks that require grad: running a
function for them, comparing two sets bitwise, and checking a set against the float64 reference
within the round-off bound."""

from typing import Dict, Optional, Tuple

import torch

import causal_attention

from .inputs import Case
from .references import Reference, float64_reference, to64
from .tolerances import (
    abs_magnitudes,
    accumulation_roundoff,
    assert_close_to_reference,
    logit_and_sum_error,
    option_tolerances,
)


RESULT_NAMES = ("out", "dq", "dk", "dv")
# With sinks that require grad, forward_and_grads returns their gradient too.
SINK_RESULT_NAMES = RESULT_NAMES + ("dsinks",)


def forward_and_grads(function, inputs, grad_out, *args, **kwargs) -> Tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)``: ``function(q, k, v, *args, **kwargs)`` on ``inputs`` (q, k, v) and
    their gradients under ``grad_out``, ``out`` detached; and ``dsinks`` after them when
    ``kwargs["sinks"]`` requires grad. The call gets leaves that require grad (detached views of
    ``inputs`` and of the sinks, same values and strides), so any tensors will do."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    sinks = kwargs.get("sinks")
    if isinstance(sinks, torch.Tensor) and sinks.requires_grad:
        kwargs = {**kwargs, "sinks": sinks.detach().requires_grad_(True)}
        leaves.append(kwargs["sinks"])
    out = function(*leaves[:3], *args, **kwargs)
    return (out.detach(),) + torch.autograd.grad(out, leaves, grad_out)


def assert_bitwise_equal(got, want, label: str = "") -> None:
    """Each of ``got``'s (out, dq, dk, dv[, dsinks]) is bitwise (``torch.equal``) ``want``'s."""
    assert len(got) == len(want), f"{label}{len(got)} results, {len(want)} expected"
    for name, a, b in zip(SINK_RESULT_NAMES, got, want):
        assert torch.equal(a, b), f"{label}{name} differs"


def assert_matches_float64_reference(
    case: Case,
    dtype: torch.dtype,
    inputs,
    grad_out,
    results,
    scale: float,
    options: Dict[str, object],
    dropout_p: float = 0.0,
    keep: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Reference:
    """A call of ``case`` with the score options ``options`` (the op's keyword arguments, e.g.
    ``ScoreOptions.for_case``), dropout from the keep mask ``keep``: each of its ``results`` (out,
    dq, dk, dv and, with sinks, dsinks, as ``forward_and_grads`` returns them; (out, dq, dk, dv)
    alone where the caller checks dsinks, e.g. summed over packed sequences) has its shape and
    dtype (dsinks the sinks') and is within the round-off bound of the float64 reference; so is
    attention_forward's lse (of the undropped probabilities: called without dropout). Returns
    the reference."""
    ref = float64_reference(*inputs, scale, grad_out, dropout_p=dropout_p, keep=keep, **options)
    peaks = abs_magnitudes(
        *inputs, scale, ref.probs, grad_out, undropped=ref.undropped, sink_probs=ref.sink_probs
    )
    sinks = options.get("sinks")
    tolerance, sinks_tolerance, l1 = option_tolerances(case, dtype, inputs, ref, scale, sinks)
    names = SINK_RESULT_NAMES if sinks is not None else RESULT_NAMES
    expected = (ref.out,) + ref.grads + ((ref.dsinks,) if sinks is not None else ())
    likes = (ref.out,) + tuple(inputs) + ((sinks,) if sinks is not None else ())
    assert len(results) in (len(RESULT_NAMES), len(names)), f"{len(results)} results for {names}"
    for name, actual, exact, like in zip(names, results, expected, likes):
        want_dtype = sinks.dtype if name == "dsinks" else dtype
        assert actual.shape == like.shape, f"{name}: shape {tuple(actual.shape)}"
        assert actual.dtype == want_dtype, f"{name}: dtype {actual.dtype}"
        bound = sinks_tolerance if name == "dsinks" else tolerance
        assert_close_to_reference(name, actual, exact, peaks[name], bound)

    _, lse = causal_attention.attention_forward(*(t.detach() for t in inputs), scale, **options)
    finite = torch.isfinite(ref.lse)
    assert torch.equal(lse[~finite], ref.lse[~finite].to(lse.dtype)), "lse where no key"
    if finite.any():
        # lse is kept in the accumulation dtype: the logits' and the sum's error, and its own
        # rounding (as ops/test_fuzz.py bounds it).
        error = (to64(lse[finite]) - ref.lse[finite]).abs().max().item()
        rounding = accumulation_roundoff(dtype) * ref.lse[finite].abs().max().item()
        bound = logit_and_sum_error(dtype, case.d, case.lq + case.lk, l1) + 8 * rounding
        assert error <= bound, f"lse: max error {error:.3e} > bound {bound:.3e}"
    return ref
