"""attention(..., key_mask=): forward and gradients against SDPA given the equivalent boolean mask
(causal & key_mask, broadcast over heads and rows) by FlashAttention's twice-SDPA's-error rule,
and against the materialized float64 reference; rows left without a visible key are exact zeros
with zero gradient; hidden keys get exactly zero dk, dv and cannot poison anything with inf or
NaN; an all-True mask is the unmasked call; padding is the unpadded sequence."""

import math

import pytest
import torch

import causal_attention
from attention_testing.inputs import Case, default_scale, make_key_mask, make_tensor
from attention_testing.parameters import dtype_params
from attention_testing.references import float64_reference, sdpa_reference, to64
from attention_testing.results import assert_bitwise_equal, forward_and_grads
from attention_testing.tolerances import (
    abs_magnitudes,
    assert_close_to_reference,
    logit_l1,
    roundoff_tolerance,
    twice_sdpa_error_failures,
)
from causal_attention._masks import visible_keys

# Many small calls: on one thread, as test_fuzz.py does.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# (case, mask kind). Together: decoding (Lq <= 32, with key splits past 1024 keys), Lq >= 1024
# (the tiled forward, with key splits), a KV cache (Lq < Lk), Lq > Lk, GQA and MQA, Dv != D,
# batch * Hkv >= 8 (the one-pass backward in float32/float64) and < 8 (two passes), 2-D to 5-D
# inputs, transposed and strided layouts; masks with holes (and a whole hidden block), left and
# right padding, all True, and a batch element that hides every key.
CASES = [
    pytest.param(Case(1, 300, 64, hq=4, hkv=1, batch=(3,)), "left-pad", id="decode-Lq1-mqa4-left"),
    pytest.param(Case(16, 2100, 64, hq=4, hkv=2), "holes", id="decode-Lq16-Lk2100-split-holes"),
    pytest.param(
        Case(9, 300, 17, dv=24, hq=2, hkv=1, batch=(2,), layout="strided"),
        "right-pad",
        id="decode-Lq9-D17-Dv24-strided-right",
    ),
    pytest.param(Case(32, 32, 8, hq=3, hkv=1, batch=(2,)), "one-all-false", id="decode-L32-none"),
    pytest.param(Case(1100, 1100, 16, hq=2, hkv=1), "left-pad", id="L1100-tiles-gqa2-left"),
    pytest.param(
        Case(1030, 1600, 32, hq=2, hkv=2, layout="transposed"),
        "holes",
        id="Lq1030-Lk1600-tiles-split-holes",
    ),
    pytest.param(
        Case(17, 200, 32, hq=2, hkv=2, batch=(2,)), "left-pad", id="kvcache-Lq17-Lk200-left"
    ),
    pytest.param(Case(129, 64, 8, hq=2, hkv=1, batch=(2,)), "holes", id="Lq129-Lk64-gqa2-holes"),
    pytest.param(Case(100, 40, 8, batch=(2,)), "right-pad", id="Lq100-Lk40-right"),
    pytest.param(
        Case(65, 65, 80, dv=32, hq=4, hkv=2, batch=(2,), layout="transposed"),
        "right-pad",
        id="L65-D80-Dv32-gqa2-transposed-right",
    ),
    pytest.param(Case(130, 130, 64, hq=4, hkv=4, batch=(2,)), "holes", id="one-pass-B2-H4-holes"),
    pytest.param(
        Case(100, 160, 32, dv=48, hq=16, hkv=8), "left-pad", id="one-pass-gqa2-H16-Dv48-left"
    ),
    pytest.param(
        Case(150, 150, 16, hq=8, hkv=4, batch=(2,)),
        "one-all-false",
        id="one-pass-B2-gqa2-none",
    ),
    pytest.param(Case(200, 200, 16, hq=2, hkv=1), "all-true", id="two-pass-gqa2-all-true"),
    pytest.param(Case(129, 129, 8, heads=False), "holes", id="2d-L129-holes"),
    pytest.param(Case(40, 40, 8, hq=3, hkv=3, batch=()), "left-pad", id="3d-H3-left"),
    pytest.param(
        Case(33, 50, 8, dv=16, hq=2, hkv=1, batch=(2, 3)), "left-pad", id="5d-Lq33-Lk50-left"
    ),
]


def _mask(case: Case, kind: str) -> torch.Tensor:
    return make_key_mask(case.key_mask_shape, kind)


def _ours(case: Case, dtype, key_mask, inputs=None, grad_out=None):
    """Our op forward and backward: (inputs, grad_out, out, (dq, dk, dv))."""
    if inputs is None:
        inputs = case.inputs(dtype, requires_grad=True)
    if grad_out is None:
        grad_out = make_tensor(case.out_shape, dtype)
    out, *grads = forward_and_grads(causal_attention.attention, inputs, grad_out, key_mask=key_mask)
    return inputs, grad_out, out, tuple(grads)


def _no_key_rows(case: Case, key_mask) -> torch.Tensor:
    """Bool (*batch, 1, Lq) or (Lq,): the rows that see no key, broadcast over heads."""
    return ~visible_keys(case.lq, case.lk, key_mask=key_mask).any(-1)


def _key_rows(t: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The rows of a K-shaped tensor (*batch, Hkv, Lk, dim) or (Lk, dim) of the keys selected
    by the (*batch, Lk) bool ``keys``, as (n, Hkv, dim) (or (n, dim))."""
    return t.transpose(-3, -2)[keys] if t.dim() >= 3 else t[keys]


def _query_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows of a q-shaped tensor selected by a ``_no_key_rows``-shaped mask, all heads."""
    return t[rows.expand(t.shape[:-1])]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case,kind", CASES)
def test_matches_sdpa_within_twice_its_error(case, kind, dtype):
    key_mask = _mask(case, kind)
    inputs, grad_out, out, grads = _ours(case, dtype, key_mask)
    visible = visible_keys(case.lq, case.lk, key_mask=key_mask)
    ref_out, ref_grads = sdpa_reference(
        *(to64(t) for t in inputs), to64(grad_out), visible=visible
    )
    same_out, same_grads = sdpa_reference(*inputs, grad_out, visible=visible)
    names = ("out", "dq", "dk", "dv")
    for name, ours, like in zip(names, (out,) + grads, (ref_out,) + tuple(inputs)):
        assert ours.shape == like.shape and ours.dtype == dtype, name
    failures = twice_sdpa_error_failures(
        names, (out,) + grads, (same_out,) + same_grads, (ref_out,) + ref_grads
    )
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("dtype", dtype_params([torch.float64, torch.float32]))
@pytest.mark.parametrize("case,kind", CASES)
def test_forward_lse_and_gradients_match_float64_reference(case, kind, dtype):
    """The same calls against the materialized reference, which shares nothing with SDPA or our
    kernels; lse too (-inf exactly where a row sees no key)."""
    key_mask = _mask(case, kind)
    inputs, grad_out, out, grads = _ours(case, dtype, key_mask)
    scale = default_scale(case.d)
    visible = visible_keys(case.lq, case.lk, key_mask=key_mask)
    ref = float64_reference(*inputs, scale, grad_out, visible=visible)
    peaks = abs_magnitudes(*inputs, scale, ref.probs, grad_out)
    sum_length = case.lq + case.lk + case.d + case.value_dim
    tolerance = roundoff_tolerance(dtype, case.d, sum_length, logit_l1(*inputs[:2], scale))
    names = ("out", "dq", "dk", "dv")
    for name, actual, expected in zip(names, (out,) + grads, (ref.out,) + ref.grads):
        assert_close_to_reference(name, actual, expected, peaks[name], tolerance)

    _, lse = causal_attention.attention_forward(*inputs, scale, key_mask)
    finite = torch.isfinite(ref.lse)
    assert torch.equal(lse[~finite], ref.lse[~finite].to(lse.dtype))
    assert torch.isfinite(lse[finite]).all()
    if finite.any():
        error = (to64(lse[finite]) - ref.lse[finite]).abs().max().item()
        assert error <= tolerance * (1 + ref.lse[finite].abs().max().item())


ROWS_WITHOUT_KEYS = [
    pytest.param(Case(20, 20, 8, hq=2, hkv=1, batch=(3,)), "left-pad", id="left-pad-first-rows"),
    pytest.param(Case(70, 70, 8, hq=2, hkv=2, batch=(2,)), "one-all-false", id="all-false"),
    pytest.param(Case(4, 500, 16, hq=4, hkv=2, batch=(2,)), "one-all-false", id="decode-all-false"),
    pytest.param(Case(1030, 1030, 8, batch=(2,)), "one-all-false", id="tiles-all-false"),
    pytest.param(Case(90, 60, 8, hq=4, hkv=4, batch=(2,)), "right-pad", id="Lq90-Lk60-right"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case,kind", ROWS_WITHOUT_KEYS)
def test_rows_without_visible_keys_are_exact_zeros(case, kind, dtype):
    key_mask = _mask(case, kind)
    inputs, _, out, (dq, dk, dv) = _ours(case, dtype, key_mask)
    rows = _no_key_rows(case, key_mask)
    assert rows.any() and not rows.all()
    for name, t in (("out", out), ("dq", dq)):
        selected = _query_rows(t, rows)
        assert torch.equal(selected, torch.zeros_like(selected)), name
    # The other rows are not zero (the empty rows are the mask's, not shifted).
    assert _query_rows(out, ~rows).abs().amax(-1).gt(0).all()
    _, lse = causal_attention.attention_forward(*inputs, default_scale(case.d), key_mask)
    assert (lse[rows.expand(lse.shape)] == -math.inf).all()
    assert torch.isfinite(lse[~rows.expand(lse.shape)]).all()
    # A batch element that hides every key gets zero gradient everywhere.
    if kind == "one-all-false":
        for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
            first = t.reshape((-1,) + t.shape[-3:])[0]
            assert torch.equal(first, torch.zeros_like(first)), name


HIDDEN_KEY_CASES = [
    pytest.param(Case(40, 40, 16, hq=4, hkv=2, batch=(2,)), "holes", id="L40-gqa2-holes"),
    pytest.param(Case(200, 200, 32, hq=2, hkv=1, batch=(2,)), "left-pad", id="L200-left-blocks"),
    pytest.param(Case(8, 1500, 32, hq=4, hkv=1, batch=(2,)), "holes", id="decode-Lk1500-holes"),
    pytest.param(Case(1100, 1100, 8, hq=1, hkv=1), "holes", id="L1100-tiles-holes"),
    pytest.param(Case(130, 130, 16, hq=8, hkv=8), "right-pad", id="one-pass-H8-right"),
    pytest.param(Case(30, 60, 8, heads=False), "holes", id="2d-Lq30-Lk60-holes"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case,kind", HIDDEN_KEY_CASES)
def test_hidden_keys_get_exactly_zero_gradient(case, kind, dtype):
    key_mask = _mask(case, kind)
    _, _, _, (_, dk, dv) = _ours(case, dtype, key_mask)
    hidden = ~key_mask.expand(case.key_mask_shape)
    assert hidden.any()
    for name, t in (("dk", dk), ("dv", dv)):
        rows = _key_rows(t, hidden)
        assert torch.equal(rows, torch.zeros_like(rows)), name
        # Visible keys do get gradient (the zeros are the mask's).
        assert _key_rows(t, ~hidden).abs().amax(-1).gt(0).any(), name


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case,kind", HIDDEN_KEY_CASES)
def test_non_finite_hidden_keys_change_nothing(case, kind, dtype):
    """K and V rows of hidden keys full of NaN, inf and -inf: every result is bitwise that of
    the call with finite values there, and the hidden keys' dk, dv are still exactly zero."""
    key_mask = _mask(case, kind)
    inputs, grad_out, out, grads = _ours(case, dtype, key_mask)
    hidden = ~key_mask
    poisoned = [t.detach().clone() for t in inputs]
    for t, values in zip(poisoned[1:], ((math.nan, math.inf), (-math.inf, math.nan))):
        rows = t.transpose(-3, -2) if t.dim() >= 3 else t
        selected = rows[hidden]
        selected[..., 0::2] = values[0]
        selected[..., 1::2] = values[1]
        rows[hidden] = selected
    poisoned = [t.requires_grad_(True) for t in poisoned]
    _, _, out2, grads2 = _ours(case, dtype, key_mask, inputs=poisoned, grad_out=grad_out)
    assert_bitwise_equal((out,) + grads, (out2,) + grads2)


ALL_TRUE_CASES = [
    pytest.param(Case(16, 2100, 64, hq=4, hkv=2), id="decode-split"),
    pytest.param(Case(1100, 1100, 16, hq=2, hkv=1), id="tiles"),
    pytest.param(Case(130, 130, 64, hq=4, hkv=4, batch=(2,)), id="one-pass"),
    pytest.param(Case(129, 64, 8, hq=2, hkv=1, batch=(2,), layout="strided"), id="Lq129-Lk64"),
    pytest.param(Case(17, 17, 8, heads=False), id="2d"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case", ALL_TRUE_CASES)
def test_all_true_mask_is_bitwise_the_unmasked_call(case, dtype):
    inputs = case.inputs(dtype, requires_grad=True)
    grad_out = make_tensor(case.out_shape, dtype)
    _, _, out, grads = _ours(case, dtype, None, inputs, grad_out)
    all_true = torch.ones(case.key_mask_shape, dtype=torch.bool)
    _, _, masked_out, masked_grads = _ours(case, dtype, all_true, inputs, grad_out)
    assert_bitwise_equal((out,) + grads, (masked_out,) + masked_grads)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_is_the_unpadded_sequence(side, dtype):
    """A transformers-style padded batch (Lq == Lk, padding hidden by key_mask) gives, on the
    real rows, the result of each sequence alone, within round-off (the blocks fall elsewhere, so
    the sums are split differently)."""
    lengths, padded_length = (70, 9, 130), 130
    case = Case(padded_length, padded_length, 16, hq=4, hkv=2, batch=(len(lengths),))
    inputs = case.inputs(dtype, requires_grad=True)
    keys = torch.arange(padded_length)
    starts = [padded_length - n if side == "left" else 0 for n in lengths]
    key_mask = torch.stack([(keys >= s) & (keys < s + n) for s, n in zip(starts, lengths)])
    # The padding rows' outputs are discarded, as a loss over real tokens would: with right
    # padding they do see the real keys.
    grad_out = make_tensor(case.out_shape, dtype) * key_mask[:, None, :, None]
    _, _, out, grads = _ours(case, dtype, key_mask, inputs, grad_out)
    scale = default_scale(case.d)
    for b, (start, n) in enumerate(zip(starts, lengths)):
        part = [t[b, :, start : start + n].detach().requires_grad_(True) for t in inputs]
        part_grad = grad_out[b, :, start : start + n]
        alone = causal_attention.attention(*part)
        alone_grads = torch.autograd.grad(alone, part, part_grad)
        ref = float64_reference(*part, scale, part_grad)
        peaks = abs_magnitudes(*part, scale, ref.probs, part_grad)
        # Each result is within the bound of the exact one (the padded call sums over more).
        sum_length = 2 * padded_length + 2 * case.d
        tolerance = 2 * roundoff_tolerance(dtype, case.d, sum_length, logit_l1(*part[:2], scale))
        for name, padded, single in zip(
            ("out", "dq", "dk", "dv"), (out,) + grads, (alone.detach(),) + alone_grads
        ):
            rows = padded[b, :, start : start + n]
            assert_close_to_reference(f"{name}[{b}]", rows, single, peaks[name], tolerance)


@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16]))
def test_mask_strides_do_not_matter(dtype):
    """A mask sliced out of a wider one, and one expanded over the batch (stride 0), give
    bitwise what their contiguous copies give."""
    case = Case(50, 80, 16, hq=2, hkv=1, batch=(2, 3))
    inputs = case.inputs(dtype)
    wide = make_key_mask((2, 3, 2 * case.lk), "holes")
    sliced = wide[..., 1::2]
    expanded = make_key_mask((1, 1, case.lk), "holes").expand(case.key_mask_shape)
    for mask in (sliced, expanded):
        assert not mask.is_contiguous()
        assert torch.equal(
            causal_attention.attention(*inputs, key_mask=mask),
            causal_attention.attention(*inputs, key_mask=mask.contiguous()),
        )


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize(
    "case,kind",
    [
        pytest.param(Case(20, 20, 8, hq=4, hkv=2, batch=(2,)), "left-pad", id="gqa2-left"),
        pytest.param(Case(9, 30, 8, batch=(2,)), "holes", id="kvcache-holes"),
        pytest.param(Case(30, 12, 8, dv=4, hq=2, hkv=2, batch=(2,)), "one-all-false", id="none"),
    ],
)
def test_attention_weights_are_the_masked_probabilities(case, kind, dtype):
    key_mask = _mask(case, kind)
    q, k, v = case.inputs(dtype)
    weights = causal_attention.attention_weights(q, k, v, key_mask=key_mask)
    visible = visible_keys(case.lq, case.lk, key_mask=key_mask)
    ref = float64_reference(q, k, v, default_scale(case.d), visible=visible)
    assert weights.shape == ref.probs.shape and weights.dtype == dtype
    hidden = ~visible.expand(weights.shape)
    assert torch.equal(weights[hidden], torch.zeros_like(weights[hidden]))
    l1 = logit_l1(q, k, default_scale(case.d))
    tolerance = roundoff_tolerance(dtype, case.d, case.lk + case.d, l1)
    assert_close_to_reference("weights", weights, ref.probs, 1.0, tolerance)
