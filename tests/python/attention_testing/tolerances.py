"""How close a result must be to its reference: the dtypes' unit roundoff, the magnitudes that
scale a result's rounding error, the round-off bound built on them, and FlashAttention's rule of
at most twice SDPA's error; with the assertions and failure lists that apply them."""

import math
from typing import Dict, List, Optional

import torch

from .inputs import Case
from .references import Reference, expand_kv_heads, to64


# Unit roundoff of each dtype.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def accumulation_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of the op's accumulators for inputs of ``dtype`` (float32, or float64)."""
    return UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (to64(a) - to64(b)).abs().max().item()


def abs_magnitudes(
    q, k, v, scale: float, probs, grad_out=None, *, undropped=None, sink_probs=None
) -> Dict[str, float]:
    """{"out": m, and with grad_out "dq", "dk", "dv" (and "dsinks" with ``sink_probs``)}: the
    largest element of each result's formula with every factor replaced by its absolute value
    (probs from float64_reference; with dropout ``probs`` are the dropped weights and
    ``undropped`` the softmax probabilities, with sinks ``sink_probs`` its sink_probs).

    This is the natural scale of a result's rounding error: a sum of products is as accurate as
    the sum of their magnitudes allows, however much the true result cancels. A softcap only
    scales dS by 1 - tanh^2 <= 1, so these bound its results too."""
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    q, k, v = (to64(t).abs() for t in (q, k, v))
    k_all, v_all = expand_kv_heads(k, heads_q), expand_kv_heads(v, heads_q)
    scale = abs(scale)
    if undropped is None:
        undropped = probs
    out_abs = probs @ v_all
    magnitudes = {"out": out_abs}
    if grad_out is not None:
        g = to64(grad_out).abs()
        # dS = P o (Z o dP - rowsum(dO o O)), Z the dropout's keep / (1 - p): P o Z is probs.
        row_terms = (g * out_abs).sum(-1, keepdim=True)
        ds_abs = probs * (g @ v_all.transpose(-2, -1)) + undropped * row_terms
        magnitudes["dq"] = ds_abs @ k_all * scale
        magnitudes["dk"] = ds_abs.transpose(-2, -1) @ q * scale
        magnitudes["dv"] = probs.transpose(-2, -1) @ g
        if sink_probs is not None:
            # dsinks[h] = -(the sum over head h's rows, in every batch element, of P_sink *
            # rowsum(dO o O)): the sink takes its share of every probability of the row.
            per_row = sink_probs * row_terms.squeeze(-1)
            magnitudes["dsinks"] = per_row.sum(-1).reshape(-1, heads_q).sum(0)
    return {name: (m.amax().item() if m.numel() else 0.0) for name, m in magnitudes.items()}


# --- round-off bound -----------------------------------------------------------------------
#
# For each result X, |X - X_ref| <= tolerance * max(X|abs), where X|abs is X's reference formula
# with every factor replaced by its absolute value (abs_magnitudes), and tolerance is a sum of
# three relative errors: rounding to the dtype (8 u_io); the logits' error (8 u_acc sqrt(D) L1,
# L1 the largest sum of |scale * q_d * k_d|), which perturbs the softmax weights relatively by as
# much; and float32 (float64) accumulation over the sums' lengths (2 u_acc n: linear, as sums of
# equal terms, e.g. from stride-0 inputs, round alike). ops/test_fuzz.py holds it to thousands of
# random calls, where the largest error is below 1/4 of the bound.


def logit_l1(q, k, scale: float, shift: Optional[torch.Tensor] = None) -> float:
    """The largest sum of |scale * q_d * k_d| over (query, key) pairs (0 without any), plus, with
    a ``shift`` (a Reference's logit_shift: ALiBi's bias and the softcap's change, zero where
    hidden), that pair's |shift|: adding it rounds relatively to both, and the softcap's tanh
    rounds relatively to its result, which is at most the raw score."""
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    products = to64(q).abs() @ expand_kv_heads(to64(k).abs(), heads_q).transpose(-2, -1)
    products = products * abs(scale)
    if shift is not None:
        products = products + shift.abs()
    return products.amax().item() if products.numel() else 0.0


def logit_and_sum_error(dtype: torch.dtype, d: int, sum_length: int, l1: float) -> float:
    """The logits' and the accumulation's share of the tolerance; ``sum_length`` is
    Lq + Lk + D + Dv."""
    return accumulation_roundoff(dtype) * (8 * math.sqrt(d) * l1 + 2 * sum_length)


def roundoff_tolerance(dtype: torch.dtype, d: int, sum_length: int, l1: float) -> float:
    """The relative tolerance of a result of a call in ``dtype`` (see above)."""
    return 8 * UNIT_ROUNDOFF[dtype] + logit_and_sum_error(dtype, d, sum_length, l1)


def assert_close_to_reference(name, actual, expected, peak: float, tolerance: float):
    """``actual`` is finite and within ``tolerance * peak`` of the float64 ``expected``."""
    assert torch.isfinite(actual).all(), f"{name} has non-finite values"
    if actual.numel() == 0:
        return
    error = (to64(actual) - to64(expected)).abs().max().item()
    bound = tolerance * peak + 1e-300
    assert error <= bound, f"{name}: max error {error:.3e} > bound {bound:.3e} (peak {peak:.3e})"


def dsinks_tolerance(
    dtype: torch.dtype, sinks_dtype: torch.dtype, d: int, sum_length: int, l1: float
) -> float:
    """The relative tolerance of dsinks of a call in ``dtype`` with sinks in ``sinks_dtype``
    (float32 sinks with float64 q round dsinks to float32): ``sum_length`` counts the rows it
    sums over too."""
    rounding = 8 * max(UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[sinks_dtype])
    return rounding + logit_and_sum_error(dtype, d, sum_length, l1)


def option_tolerances(case: Case, dtype: torch.dtype, inputs, ref: Reference, scale: float, sinks):
    """(result tolerance, dsinks tolerance or None, logit L1) of a call of ``case`` with score
    options: the round-off bound with the options' logit shift in L1; dsinks also sums over
    every row of its head, in every batch element."""
    sum_length = case.lq + case.lk + case.d + case.value_dim
    l1 = logit_l1(*inputs[:2], scale, ref.logit_shift)
    rows = math.prod(case.batch) * case.lq if case.heads else case.lq
    sinks_tolerance = None
    if sinks is not None:
        sinks_tolerance = dsinks_tolerance(dtype, sinks.dtype, case.d, sum_length + rows, l1)
    return roundoff_tolerance(dtype, case.d, sum_length, l1), sinks_tolerance, l1


# FlashAttention's accuracy rule: in every dtype, each result is at most twice as far from the
# float64 answer as PyTorch's own kernel in that dtype, plus this much (absolute) for round-off
# where SDPA happens to be exact.
SDPA_RULE_SLACK = 1e-6


def twice_sdpa_error_failures(names, ours, same, ref) -> List[str]:
    """The results among ``names`` that break the rule ``max|ours - ref| <= 2 * max|same - ref|
    + SDPA_RULE_SLACK``, described; ``same`` is SDPA in the inputs' dtype and ``ref`` SDPA in
    float64 on the same (dtype-rounded) inputs (``sdpa_reference``)."""
    failures = []
    for name, a, s, r in zip(names, ours, same, ref):
        assert torch.isfinite(r).all(), f"reference {name} is not finite"
        err = max_abs_diff(a, r)
        sdpa_err = max_abs_diff(s, r)
        bound = 2 * sdpa_err + SDPA_RULE_SLACK
        if not err <= bound:
            failures.append(f"{name}: ours {err:.3g} > bound {bound:.3g} (sdpa {sdpa_err:.3g})")
    return failures


# --- context parallelism ----------------------------------------------------------------------
#
# A sharded call against the single-process op, both against float64: float64 within 1e-12 (the
# packed calls; the dense ones' rule predates them at 1e-10); other dtypes within FlashAttention's
# rule of twice the op's own error, and the ring's and the all-gather's gradients within 1.2x
# (issue 40: their delta comes from a float32 merged output summed in float64, as accurate as
# the op's own), each plus eight float32 unit roundoffs of the result's largest magnitude, for
# results the op computes exactly.
SHARDED_FACTOR = 2.0
SHARDED_GRADIENT_FACTOR = 1.2


def assert_sharded_result_close(name: str, got: torch.Tensor, exact: torch.Tensor,
                                single: Optional[torch.Tensor], float64_bound: float,
                                factor: float) -> None:
    """``got`` (a sharded call's result, whole) against ``exact`` (float64) within
    ``float64_bound`` for float64 inputs (``single`` None), else within ``factor`` times the
    single-process op's own error ``single - exact`` plus the float32 floor."""
    error = max_abs_diff(got, exact)
    assert exact.abs().max() > 0, f"{name}: all zero"
    if single is None:
        assert error <= float64_bound, f"{name}: {error}"
        return
    own = max_abs_diff(single, exact)
    floor = 8 * UNIT_ROUNDOFF[torch.float32] * exact.abs().max().item()
    assert error <= factor * own + floor, f"{name}: {error} vs the op's {own} (x{factor})"
