"""Numerical robustness at the edges: logits of +-1e4, and non-finite values kept where they
belong. A NaN in a query row poisons that row only; an inf or NaN in a key or value reaches only
the rows that can see it; one in a grad_out row reaches only that row's dq and the keys it sees;
rows without keys stay exact zeros with zero gradient whatever K, V and their own grad_out hold.
Each runs in both backward schedules (TWO_PASS and ONE_PASS head layouts below).

"Exact" here means bitwise equal to the same call on clean inputs: the values that must not be
affected are computed from exactly the same numbers either way.
"""

import math
from dataclasses import dataclass

import pytest
import torch

import causal_attention
from attention_testing.parameters import DTYPE_IDS, DTYPES, dtype_params
from attention_testing.references import empty_rows, float64_reference
from attention_testing.results import forward_and_grads
from attention_testing.tolerances import (
    UNIT_ROUNDOFF,
    abs_magnitudes,
    accumulation_roundoff,
    max_abs_diff,
)
from causal_attention._masks import visible_keys


@dataclass(frozen=True)
class Heads:
    """Batch size and head counts of a test's inputs; query head h reads KV head h // group."""

    batch: int
    hq: int
    hkv: int

    @property
    def group(self) -> int:
        return self.hq // self.hkv


# Two 64-row blocks and a straddled diagonal in every shape below; Hq = 2 Hkv (GQA) in both
# head layouts. TWO_PASS has 4 (batch, KV head) items, too few for the one-pass backward, so
# every dtype takes the two passes; ONE_PASS has 8, so float32 and float64 take the one pass
# (attention_backward_kernel.cpp), which adds each pair's dS K_j into dq in place.
TWO_PASS = Heads(batch=2, hq=4, hkv=2)
ONE_PASS = Heads(batch=2, hq=8, hkv=4)


def heads_dtype_params():
    """(heads, dtype): TWO_PASS in every dtype, ONE_PASS in the dtypes that run the one pass."""
    pairs = [(TWO_PASS, "two-pass", d) for d in DTYPES]
    pairs += [(ONE_PASS, "one-pass", d) for d in (torch.float64, torch.float32)]
    return [pytest.param(h, d, id=f"{name}-{DTYPE_IDS[d]}") for h, name, d in pairs]


def _inputs(lq, lk, d, dtype, heads=TWO_PASS, generator_seed=0):
    generator = torch.Generator().manual_seed(generator_seed)
    b, hq, hkv = heads.batch, heads.hq, heads.hkv
    shapes = ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d), (b, hq, lq, d))
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


def _forward_backward(q, k, v, grad_out, scale=None):
    return forward_and_grads(causal_attention.attention, (q, k, v), grad_out, scale=scale)


# --- logits of +-1e4 -----------------------------------------------------------------------


def _peaked_logits(lq, lk, d, dtype, logit, heads):
    """q, k whose logits (scale 1) are exactly +-logit: q and k rows are +-sqrt(logit) * e_0 with
    random signs, so that rows have several tied winners, one winner, or only -logit."""
    generator = torch.Generator().manual_seed(1)
    c = math.sqrt(logit)
    b, hq, hkv = heads.batch, heads.hq, heads.hkv
    q = torch.zeros(b, hq, lq, d)
    k = torch.zeros(b, hkv, lk, d)
    q[..., 0] = c * torch.randint(0, 2, (b, hq, lq), generator=generator).mul(2).sub(1)
    k[..., 0] = c * torch.randint(0, 2, (b, hkv, lk), generator=generator).mul(2).sub(1)
    return q.to(dtype), k.to(dtype)


def _tolerance(dtype, logit):
    """Relative to attention_testing.tolerances.abs_magnitudes: rounding to the dtype, plus the
    error of exp(s - lse) with lse ~ logit held in the accumulation dtype (the reference uses the
    same rounded inputs, so only the op's own rounding counts)."""
    return 8 * (UNIT_ROUNDOFF[dtype] + accumulation_roundoff(dtype) * logit)


@pytest.mark.parametrize("logit", [1e3, 1e4])
@pytest.mark.parametrize("heads,dtype", heads_dtype_params())
def test_logits_of_1e4_give_finite_accurate_results(heads, dtype, logit):
    lq, lk, d = 130, 150, 16
    q, k = _peaked_logits(lq, lk, d, dtype, logit, heads)
    _, _, v, grad_out = _inputs(lq, lk, d, dtype, heads)
    out, dq, dk, dv = _forward_backward(q, k, v, grad_out, scale=1.0)
    ref = float64_reference(q, k, v, 1.0, grad_out)
    # The weights are as extreme as they get: visible keys' exp(-2 logit) underflows to 0, and
    # tied winners share.
    assert (ref.probs[..., visible_keys(lq, lk)] == 0).any() and ref.probs.amax(-1).min() < 1.0
    peaks = abs_magnitudes(q, k, v, 1.0, ref.probs, grad_out)
    results = zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref.out,) + ref.grads)
    for name, ours, expected in results:
        assert torch.isfinite(ours).all(), name
        assert max_abs_diff(ours, expected) <= _tolerance(dtype, logit) * peaks[name], name


# Scales that saturate the softmax into an argmax yet stay finite in the accumulation dtype.
HUGE_SCALES = {torch.float64: 1e20, torch.float32: 1e10, torch.bfloat16: 1e10, torch.float16: 1e10}


@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 7), (1, 150), (130, 150)])
@pytest.mark.parametrize("dtype", dtype_params())
def test_huge_finite_scale_gives_the_argmax_and_finite_gradients(dtype, lq, lk):
    # scale * q.k ~ 1e10 rounds with an error of thousands in float32: the row max and each
    # exp(x - max) must read the same rounded x, or exp(+-4096) turns rows into NaN or zeros.
    q, k, v, grad_out = _inputs(lq, lk, 16, dtype)
    scale = HUGE_SCALES[dtype]
    out, dq, dk, dv = _forward_backward(q, k, v, grad_out, scale=scale)
    ref = float64_reference(q, k, v, scale, grad_out)
    assert ref.probs.amax(-1).min() == 1.0  # every row a one-hot argmax
    # Each output row is its argmax key's value row, exactly.
    assert torch.equal(out, ref.out.to(dtype))
    # The gradients through the saturated softmax are rounding noise times the scale (torch's
    # SDPA returns NaN for some of these shapes); they must at least be finite.
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(grad).all(), name


@pytest.mark.parametrize("dtype", dtype_params())
def test_masked_key_with_huge_logit_does_not_set_the_row_maximum(dtype):
    # Every visible logit is -1e4; key j's is +1e4 but rows i < j cannot see it. Were j counted
    # in those rows' running maximum, exp(-2e4) would underflow their sum to 0 (NaN or inf).
    lq = lk = 100
    j = 37
    q = torch.full((1, 1, lq, 1), 100.0)
    k = torch.full((1, 1, lk, 1), -100.0)
    v = torch.randn(1, 1, lk, 8)
    huge = k.clone()
    huge[..., j, :] = 100.0
    clean = causal_attention.attention(*(t.to(dtype) for t in (q, k, v)), scale=1.0)
    out = causal_attention.attention(*(t.to(dtype) for t in (q, huge, v)), scale=1.0)
    assert torch.isfinite(out).all()
    assert torch.equal(out[..., :j, :], clean[..., :j, :])
    # Uniform weights over the visible keys: a causal running mean of v.
    mean = v.to(dtype).double().cumsum(-2) / torch.arange(1, lk + 1).unsqueeze(-1)
    bound = _tolerance(dtype, 1e4) * v.abs().max().item()
    assert max_abs_diff(out[..., :j, :], mean[..., :j, :]) <= bound


# --- NaN in one query row ------------------------------------------------------------------


@pytest.mark.parametrize("heads,dtype", heads_dtype_params())
@pytest.mark.parametrize("lq,lk", [(130, 130), (90, 150)], ids=["square", "kv-cache"])
def test_nan_in_one_query_row_poisons_only_that_row(heads, dtype, lq, lk):
    q, k, v, grad_out = _inputs(lq, lk, 16, dtype, heads)
    batch, head, row = 1, 3, 70
    clean = _forward_backward(q, k, v, grad_out)
    q_nan = q.clone()
    q_nan[batch, head, row, 5] = math.nan
    out, dq, dk, dv = _forward_backward(q_nan, k, v, grad_out)

    poisoned = torch.zeros(out.shape[:-1], dtype=torch.bool)
    poisoned[batch, head, row] = True
    assert out[poisoned].isnan().all()
    assert torch.equal(out[~poisoned], clean[0][~poisoned])
    # dq of every other row involves only that row's weights.
    assert torch.equal(dq[~poisoned], clean[1][~poisoned])
    # dk, dv of a key are sums over the rows that see it: keys the NaN row cannot see, and the
    # K/V heads and batch entries it does not read, are untouched.
    unseen = torch.ones(heads.batch, heads.hkv, lk, dtype=torch.bool)
    unseen[batch, head // heads.group] = ~visible_keys(lq, lk)[row]
    assert unseen.any() and not unseen.all()
    for name, ours, expected in (("dk", dk, clean[2]), ("dv", dv, clean[3])):
        assert torch.equal(ours[unseen], expected[unseen]), name


# --- inf / NaN in one grad_out row ---------------------------------------------------------


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("heads,dtype", heads_dtype_params())
@pytest.mark.parametrize("lq,lk", [(130, 130), (90, 150)], ids=["square", "kv-cache"])
def test_non_finite_grad_out_row_reaches_only_its_dq_row_and_the_keys_it_sees(
    heads, dtype, lq, lk, value
):
    q, k, v, grad_out = _inputs(lq, lk, 16, dtype, heads)
    batch, head, row = 1, 3, 70  # in a query block that straddles the diagonal
    clean = _forward_backward(q, k, v, grad_out)
    poisoned_grad_out = grad_out.clone()
    poisoned_grad_out[batch, head, row, 5] = value
    out, dq, dk, dv = _forward_backward(q, k, v, poisoned_grad_out)

    assert torch.equal(out, clean[0])
    poisoned = torch.zeros(dq.shape[:-1], dtype=torch.bool)
    poisoned[batch, head, row] = True
    assert not torch.isfinite(dq[poisoned]).all()
    # dq of every other row involves only that row's grad_out.
    assert torch.isfinite(dq[~poisoned]).all()
    assert torch.equal(dq[~poisoned], clean[1][~poisoned])
    # dk, dv of a key sum over the rows that see it: keys the row cannot see (in the same key
    # block too), and the other K/V heads and batch entries, are untouched.
    unseen = torch.ones(heads.batch, heads.hkv, lk, dtype=torch.bool)
    unseen[batch, head // heads.group] = ~visible_keys(lq, lk)[row]
    assert unseen.any() and not unseen.all()
    for name, ours, expected in (("dk", dk, clean[2]), ("dv", dv, clean[3])):
        assert torch.isfinite(ours[unseen]).all(), name
        assert torch.equal(ours[unseen], expected[unseen]), name


# --- inf / NaN in a key or value that a row cannot see --------------------------------------


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize("heads,dtype", heads_dtype_params())
@pytest.mark.parametrize(
    "lq,lk,key",
    [(100, 100, 37), (40, 100, 80), (130, 130, 64), (8, 300, 295), (3, 300, 298)],
    ids=["square", "kv-cache", "block-edge", "decode", "decode-few-rows"],
)
def test_non_finite_key_does_not_leak_into_rows_that_cannot_see_it(
    heads, dtype, tensor, value, lq, lk, key
):
    q, k, v, grad_out = _inputs(lq, lk, 16, dtype, heads)
    clean = _forward_backward(q, k, v, grad_out)
    inputs = {"k": k.clone(), "v": v.clone()}
    inputs[tensor][:, :, key, 3] = value
    out, dq, _, _ = _forward_backward(q, inputs["k"], inputs["v"], grad_out)
    blind = ~visible_keys(lq, lk)[:, key]  # rows that cannot see the key
    assert blind.any() and not blind.all()
    for name, ours, expected in (("out", out, clean[0]), ("dq", dq, clean[1])):
        assert torch.isfinite(ours[..., blind, :]).all(), name
        assert torch.equal(ours[..., blind, :], expected[..., blind, :]), name


# --- an infinite score in the rows that see it ---------------------------------------------


@pytest.mark.parametrize("heads,dtype", heads_dtype_params())
@pytest.mark.parametrize(
    "lq,lk,key", [(130, 130, 64), (3, 300, 200)], ids=["block-path", "decode"]
)
def test_an_infinite_score_gives_nan_rows_exactly_where_the_reference_does(
    heads, dtype, lq, lk, key
):
    """An inf key element makes the score of every row that sees the key +inf, -inf or NaN by
    the sign of the row's query element. A +inf score is inf - inf in the softmax: those rows are
    NaN, as in the float64 reference (and SDPA); a -inf score weighs the key zero, and every other
    row stays finite. (The forward's fold takes its NaN-keeping exponentials only for a row max of
    +inf: online_softmax.h, ExpArguments.)"""
    q, k, v, _ = _inputs(lq, lk, 16, dtype, heads)
    k[:, :, key, 3] = math.inf
    out = causal_attention.attention(q, k, v)
    expected = float64_reference(q, k, v, 1 / math.sqrt(16)).out
    nan_rows = expected.isnan().any(-1)
    sees = visible_keys(lq, lk)[:, key]
    positive = (q[..., 3] > 0) & sees
    assert positive.any() and (~nan_rows).any()
    assert torch.equal(nan_rows, expected.isnan().all(-1))  # whole rows
    assert torch.equal(out.isnan().all(-1), nan_rows)
    assert torch.isfinite(out[~nan_rows]).all()


# --- rows without keys ---------------------------------------------------------------------


@pytest.mark.parametrize("heads,dtype", heads_dtype_params())
def test_rows_without_keys_stay_zero_whatever_k_v_and_their_grad_out_hold(heads, dtype):
    lq, lk = 100, 30  # rows 0..69 see no key
    q, k, v, grad_out = _inputs(lq, lk, 16, dtype, heads)
    rows = empty_rows(lq, lk)
    k = k * 1e3  # logits of ~1e4 in the rows that do see keys
    nan_grad_out = grad_out.clone()
    nan_grad_out[..., rows, :] = math.nan
    clean = _forward_backward(q, k, v, grad_out)
    _, _, dk, dv = _forward_backward(q, k, v, nan_grad_out)
    # Rows without keys contribute nothing to dk, dv: their NaN grad_out changes nothing.
    assert torch.equal(dk, clean[2]) and torch.equal(dv, clean[3])

    k[:, :, 5, 0] = math.inf
    v[:, :, 7, 1] = math.nan
    out, dq, _, _ = _forward_backward(q, k, v, nan_grad_out)
    assert torch.equal(out[..., rows, :], torch.zeros_like(out[..., rows, :]))
    assert torch.equal(dq[..., rows, :], torch.zeros_like(dq[..., rows, :]))
    _, lse = causal_attention.attention_forward(q, k, v, 0.25)
    assert torch.equal(lse[..., rows], torch.full_like(lse[..., rows], -math.inf))
