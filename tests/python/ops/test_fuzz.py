"""Property-based tests: random calls against the float64 reference (a materialized masked
softmax), outputs, lse and gradients, with an error bound derived from each call's magnitudes.

A call draws 0-2 leading dims (sizes 0-2) or a 2-D (L, D) input, Hkv in 0-3 with Hq/Hkv in 1-3,
Lq and Lk in 0-300 (block edges 63/64/65... favoured), D and Dv in 1-160, every dtype, a memory
layout per tensor (contiguous, transposed, column-major, sliced, stride-0 expanded), the scale
(default, zero, negative, explicit) and the largest |logit| (up to 1e4). Shapes are capped to a
work budget so that CI runs FORWARD_EXAMPLES + GRADIENT_EXAMPLES (>= 1000) examples in well under
a minute.

Reproducible: derandomized (the examples are a function of the test alone), no example database,
and a failure prints the drawn call and a @reproduce_failure blob. CAUSAL_ATTENTION_FUZZ_SCALE
scales the example counts (scripts/sanitize.sh runs a quarter of them under ASan).
"""

import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import causal_attention
from attention_testing.inputs import default_scale, with_layout
from attention_testing.parameters import REPRODUCIBLE_EXAMPLES, DTYPES
from attention_testing.references import empty_rows, expand_kv_heads, float64_reference, to64
from attention_testing.tolerances import (
    abs_magnitudes,
    accumulation_roundoff,
    assert_close_to_reference,
    logit_and_sum_error,
    logit_l1,
    roundoff_tolerance,
)

_SCALE = float(os.environ.get("CAUSAL_ATTENTION_FUZZ_SCALE", "1"))
FORWARD_EXAMPLES = max(1, int(1200 * _SCALE))
GRADIENT_EXAMPLES = max(1, int(500 * _SCALE))

# Batch * Hq * Lq * Lk * (D + Dv) of a drawn call stays below this (one 300 x 300 head with
# D = Dv = 160 fits): it bounds the float64 reference's time, not the op's.
WORK_BUDGET = 30_000_000

LAYOUTS = ("contiguous", "transposed", "column-major", "strided", "expanded")
LOGIT_RANGES = (0.1, 1.0, 10.0, 100.0, 1e3, 1e4)


@dataclass(frozen=True)
class Call:
    """One drawn call; its repr is what a failure prints."""

    dtype: torch.dtype
    batch: Tuple[int, ...]
    heads: Optional[Tuple[int, int]]  # (Hq, Hkv); None for 2-D (L, D) inputs
    lq: int
    lk: int
    d: int
    dv: int
    scale: Optional[float]  # None: the default 1/sqrt(D)
    max_logit: float
    value_amplitude: float
    layouts: Tuple[str, str, str, str]  # q, k, v, grad_out
    seed: int

    def shape(self, heads_index: int, length: int, dim: int) -> Tuple[int, ...]:
        if self.heads is None:
            return (length, dim)
        return self.batch + (self.heads[heads_index], length, dim)

    @property
    def resolved_scale(self) -> float:
        return default_scale(self.d) if self.scale is None else self.scale


# Sizes of 0 (empty results) are drawn about 1 time in 10, not 1 in 3.
_batch_sizes = st.sampled_from([1] * 5 + [2] * 4 + [0])
_kv_heads = st.sampled_from([1] * 4 + [2] * 3 + [3] * 2 + [0])
_lengths = st.one_of(
    st.integers(0, 9),
    st.integers(0, 300),
    st.sampled_from([63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 300]),
)
_head_dims = st.one_of(
    st.integers(1, 16),
    st.integers(1, 160),
    st.sampled_from([1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 80, 96, 128, 160]),
)
_scales = st.one_of(
    st.none(),
    st.just(0.0),
    st.floats(1e-3, 4.0).flatmap(lambda s: st.sampled_from([s, -s])),
)


@st.composite
def calls(draw) -> Call:
    dtype = draw(st.sampled_from(DTYPES))
    two_d = draw(st.integers(0, 5)) == 0
    batch: Tuple[int, ...] = ()
    heads = None
    if not two_d:
        batch = tuple(draw(st.lists(_batch_sizes, max_size=2)))
        hkv = draw(_kv_heads)
        heads = (hkv * draw(st.integers(1, 3)), hkv)
    lq, lk = draw(_lengths), draw(_lengths)
    pairs = math.prod(batch) * (heads[0] if heads else 1) * max(lq, 1) * max(lk, 1)
    dim_cap = max(1, min(160, WORK_BUDGET // (2 * max(pairs, 1))))
    d = min(draw(_head_dims), dim_cap)
    dv = min(draw(_head_dims), dim_cap)
    return Call(
        dtype=dtype,
        batch=batch,
        heads=heads,
        lq=lq,
        lk=lk,
        d=d,
        dv=dv,
        scale=draw(_scales),
        max_logit=draw(st.sampled_from(LOGIT_RANGES)),
        value_amplitude=draw(st.sampled_from([1.0, 100.0])),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(4)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _unit_values(shape, layout, generator):
    """float64 normal values broadcastable to ``shape``: of ``shape`` itself, except for the
    "expanded" layout, whose row dim (the first dim when there is a single row) is 1, so that the
    input can be a stride-0 view of them."""
    base = list(shape)
    if layout == "expanded":
        dim = len(shape) - 2 if shape[-2] > 1 else 0
        base[dim] = min(1, base[dim])
    return torch.randn(base, dtype=torch.float64, generator=generator)


def _laid_out(values, shape, dtype, layout):
    if layout == "expanded":
        return values.to(dtype).expand(shape)
    if layout == "transposed" and len(shape) < 3:
        layout = "column-major"
    return with_layout(values.to(dtype), layout)


def make_inputs(call: Call, requires_grad: bool):
    """(q, k, v, grad_out) for ``call``: q and k scaled together so that the largest |logit|
    (over all pairs, masked or not) is about ``call.max_logit``."""
    generator = torch.Generator().manual_seed(call.seed)
    shapes = (
        call.shape(0, call.lq, call.d),
        call.shape(1, call.lk, call.d),
        call.shape(1, call.lk, call.dv),
        call.shape(0, call.lq, call.dv),
    )
    q, k, v, g = (
        _unit_values(shape, layout, generator) for shape, layout in zip(shapes, call.layouts)
    )
    heads_q = call.heads[0] if call.heads else 1
    k_all = expand_kv_heads(k.expand(shapes[1]), heads_q)
    logits = (q.expand(shapes[0]) @ k_all.transpose(-2, -1)) * call.resolved_scale
    largest = logits.abs().max().item() if logits.numel() else 0.0
    factor = math.sqrt(call.max_logit / largest) if largest > 0 else 1.0
    tensors = [
        _laid_out(values * amplitude, shape, call.dtype, layout)
        for values, amplitude, shape, layout in zip(
            (q, k, v, g), (factor, factor, call.value_amplitude, 1.0), shapes, call.layouts
        )
    ]
    return [t.detach().requires_grad_(requires_grad) for t in tensors[:3]] + tensors[3:]


# --- error bound: attention_testing.tolerances.roundoff_tolerance ----------------------------


def _logit_l1(call: Call, q, k) -> float:
    return logit_l1(q, k, call.resolved_scale)


def _sum_length(call: Call) -> int:
    return call.lq + call.lk + call.d + call.dv


def _logit_and_sum_error(call: Call, l1: float) -> float:
    return logit_and_sum_error(call.dtype, call.d, _sum_length(call), l1)


def _tolerance(call: Call, l1: float) -> float:
    return roundoff_tolerance(call.dtype, call.d, _sum_length(call), l1)


def _check_output(call: Call, inputs, out, grad_out=None):
    """Checks out against the float64 reference; returns the reference, the magnitudes, L1 and
    the tolerance for the other results."""
    ref = float64_reference(*inputs, call.resolved_scale, grad_out)
    peaks = abs_magnitudes(*inputs, call.resolved_scale, ref.probs, grad_out)
    # A result beyond the dtype's range (float16 gradients of large values and logits) rounds to
    # inf, as it should: such calls are outside what this test can compare.
    assume(max(peaks.values()) < torch.finfo(call.dtype).max / 2)
    l1 = _logit_l1(call, *inputs[:2])
    tolerance = _tolerance(call, l1)
    assert_close_to_reference("out", out, ref.out, peaks["out"], tolerance)
    return ref, peaks, l1, tolerance


def _check_empty_rows(call: Call, out, dq=None):
    """Rows that see no key are exactly zero, and so is their gradient."""
    no_key = empty_rows(call.lq, call.lk)
    for name, t in (("out", out), ("dq", dq)):
        if t is not None and no_key.any():
            assert torch.equal(t[..., no_key, :], torch.zeros_like(t[..., no_key, :])), name


# Thousands of small calls: one intra-op thread (see conftest.py).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@settings(max_examples=FORWARD_EXAMPLES, **REPRODUCIBLE_EXAMPLES)
@given(call=calls())
def test_forward_and_lse_match_float64(call):
    q, k, v, _ = make_inputs(call, requires_grad=False)
    out, lse = causal_attention.attention_forward(q, k, v, call.resolved_scale)
    assert out.shape == call.shape(0, call.lq, call.dv) and out.dtype == call.dtype
    assert lse.shape == out.shape[:-1]
    ref, peaks, l1, tolerance = _check_output(call, (q, k, v), out)
    _check_empty_rows(call, out)
    # lse is kept in the accumulation dtype: its absolute error is the logits' and the sum's,
    # plus the rounding of lse itself.
    finite = torch.isfinite(ref.lse)
    assert torch.equal(lse[~finite], ref.lse[~finite].to(lse.dtype))
    if finite.any():
        lse_error = (to64(lse[finite]) - ref.lse[finite]).abs().max().item()
        rounding = accumulation_roundoff(call.dtype) * ref.lse[finite].abs().max().item()
        lse_bound = _logit_and_sum_error(call, l1) + 8 * rounding
        assert lse_error <= lse_bound, f"lse: max error {lse_error:.3e} > bound {lse_bound:.3e}"


@settings(max_examples=GRADIENT_EXAMPLES, **REPRODUCIBLE_EXAMPLES)
@given(call=calls())
def test_gradients_match_float64(call):
    q, k, v, grad_out = make_inputs(call, requires_grad=True)
    out = causal_attention.attention(q, k, v, scale=call.scale)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref, peaks, _, tolerance = _check_output(call, (q, k, v), out.detach(), grad_out)
    for name, actual, expected, input_ in zip(("dq", "dk", "dv"), grads, ref.grads, (q, k, v)):
        assert actual.shape == input_.shape and actual.dtype == call.dtype, name
        assert_close_to_reference(name, actual, expected, peaks[name], tolerance)
    _check_empty_rows(call, out.detach(), grads[0])
