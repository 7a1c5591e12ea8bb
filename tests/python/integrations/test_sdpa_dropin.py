"""causal_attention.scaled_dot_product_attention as a drop-in for F.scaled_dot_product_attention:
same result for every call (causal, and non-causal full attention within twice SDPA's error in
every dtype; causal with any lengths, top-left as is_causal or as a CausalBias says; any bool or
additive attn_mask, with is_causal too, a learned one's gradient included; SDPA's broadcasting
of the leading dims and heads; E = 0), with dropout the probabilities attention_weights gives
for the same generator state, dropped at the rate asked; and for every bad call the exception
type SDPA itself raises for it."""

import itertools
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import causal_attention
from attention_testing.inputs import Case, make_tensor
from attention_testing.parameters import dtype_params
from attention_testing.references import to64
from attention_testing.results import RESULT_NAMES, forward_and_grads
from attention_testing.tolerances import twice_sdpa_error_failures

SERVED = [
    pytest.param(Case(17, 17, 8, hq=2, hkv=2), {}, id="4d"),
    pytest.param(Case(17, 17, 8, hq=4, hkv=2), {"enable_gqa": True}, id="gqa2"),
    pytest.param(Case(17, 17, 8, hq=4, hkv=1), {"enable_gqa": True, "scale": 0.2}, id="gqa4-scale"),
    pytest.param(Case(17, 17, 8, hq=2, hkv=2), {"enable_gqa": True}, id="enable_gqa-equal-heads"),
    pytest.param(Case(65, 65, 16, dv=4, hq=2, hkv=2), {"scale": 1.5}, id="Dv4-scale"),
    pytest.param(Case(9, 9, 8, heads=False), {}, id="2d"),
    pytest.param(Case(9, 9, 8, hq=2, hkv=2, batch=(2, 3)), {"dropout_p": 0.0}, id="5d-dropout0"),
    pytest.param(
        Case(33, 33, 8, hq=2, hkv=2, batch=(2,), layout="transposed"), {}, id="transposed"
    ),
]


@pytest.mark.parametrize("dtype", dtype_params((torch.float64, torch.float32)))
@pytest.mark.parametrize("case,kwargs", SERVED)
def test_served_calls_match_sdpa(case, kwargs, dtype):
    q, k, v = case.inputs(dtype, requires_grad=True)
    ours = causal_attention.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    torch.testing.assert_close(ours, ref)
    # It is our op, not a fallback to SDPA.
    assert torch.equal(ours, causal_attention.attention(q, k, v, scale=kwargs.get("scale")))
    grad_out = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad(ours, (q, k, v), grad_out),
        torch.autograd.grad(ref, (q, k, v), grad_out),
    ):
        torch.testing.assert_close(a, b)


# Non-causal attention without a mask: every query sees every key, whatever the lengths.
NON_CAUSAL = [
    pytest.param(Case(17, 17, 8, hq=2, hkv=2), {}, id="L17"),
    pytest.param(Case(5, 70, 16, dv=8, hq=4, hkv=2), {"enable_gqa": True}, id="Lq<Lk-gqa-Dv8"),
    pytest.param(Case(70, 9, 8, hq=2, hkv=1), {"enable_gqa": True, "scale": 0.3},
                 id="Lq>Lk-mqa-scale"),
    pytest.param(Case(130, 130, 32, hq=2, hkv=2, batch=(2,), layout="transposed"), {},
                 id="L130-transposed"),
    pytest.param(Case(9, 20, 8, heads=False), {}, id="2d-Lq<Lk"),
]


# Causal attention with query and key lengths that differ: SDPA's is_causal aligns top-left, and
# CausalBias says which alignment (upper-left, or lower-right: the KV-cache one).
ALIGNED_CASES = {
    "Lq<Lk-gqa-Dv8": (Case(5, 70, 16, dv=8, hq=4, hkv=2), {"enable_gqa": True}),
    "Lq>Lk-mqa-scale": (Case(70, 9, 8, hq=2, hkv=1), {"enable_gqa": True, "scale": 0.3}),
    "Lq<Lk-transposed": (Case(33, 130, 32, hq=2, hkv=2, batch=(2,), layout="transposed"), {}),
    "2d-Lq<Lk": (Case(9, 20, 8, heads=False), {}),
    "equal": (Case(20, 20, 8, hq=2, hkv=2), {}),
}
ALIGNED = [
    pytest.param(case, {**kwargs, **alignment(case)}, id=f"{name}-{kind}")
    for name, (case, kwargs) in ALIGNED_CASES.items()
    for kind, alignment in (
        ("is_causal", lambda c: {"is_causal": True}),
        ("upper-left", lambda c: {"attn_mask": causal_upper_left(c.lq, c.lk)}),
        ("lower-right", lambda c: {"attn_mask": causal_lower_right(c.lq, c.lk)}),
    )
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case,kwargs", NON_CAUSAL + ALIGNED)
def test_calls_match_sdpa_within_twice_its_error(case, kwargs, dtype):
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    ours = forward_and_grads(causal_attention.scaled_dot_product_attention, inputs, grad_out,
                             **kwargs)
    same = forward_and_grads(F.scaled_dot_product_attention, inputs, grad_out, **kwargs)
    ref = forward_and_grads(F.scaled_dot_product_attention, [to64(t) for t in inputs],
                            to64(grad_out), **kwargs)
    failures = twice_sdpa_error_failures(RESULT_NAMES, ours, same, ref)
    assert not failures, "; ".join(failures)


def test_lower_right_rows_that_see_no_key_are_zeros():
    q, k, v = Case(9, 4, 8, hq=2, hkv=2).inputs(torch.float64, requires_grad=True)
    out = causal_attention.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(9, 4))
    # Rows 0..4 see no key (row i sees keys up to i + 4 - 9); the rest are the op's KV alignment.
    assert torch.equal(out[..., :5, :], torch.zeros_like(out[..., :5, :]))
    torch.testing.assert_close(out, causal_attention.attention(q, k, v))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.isfinite().all() for g in grads)


def test_top_left_causal_is_the_op_on_the_keys_rows_can_see():
    """With Lq < Lk no row sees the keys past Lq: the call is the op on the first Lq keys, and
    the keys past them get zero gradient; nothing of size Lq x Lk is built."""
    q, k, v = Case(6, 11, 8, hq=2, hkv=2).inputs(torch.float64, requires_grad=True)
    out = causal_attention.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, causal_attention.attention(q, k[..., :6, :], v[..., :6, :]))
    dk, dv = torch.autograd.grad(out.sum(), (k, v))
    assert torch.equal(dk[..., 6:, :], torch.zeros_like(dk[..., 6:, :]))
    assert torch.equal(dv[..., 6:, :], torch.zeros_like(dv[..., 6:, :]))


@pytest.mark.parametrize(
    "bias",
    [causal_lower_right(5, 5), causal_lower_right(1, 7), causal_lower_right(5, 1),
     causal_upper_left(3, 9)],
    ids=["square-lower-right", "lower-right-1x7", "lower-right-5x1", "upper-left-3x9"],
)
def test_a_causal_bias_of_other_sizes_than_the_call_is_what_sdpa_makes_of_it(bias):
    """SDPA reads a CausalBias by its own sizes, not the call's: a square one, or any upper-left
    one, is is_causal=True; a lower-right one is its (seq_len_q, seq_len_kv) mask, broadcast to
    the scores (on a 5 x 7 call, a 1 x 7 one lets every row see every key)."""
    q, k, v = Case(5, 7, 8, hq=2, hkv=2).inputs(torch.float64)
    ours = causal_attention.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
def test_a_floating_mask_under_autocast_is_cast_as_sdpa_s(autocast_dtype, mask_dtype, is_causal):
    """Autocast casts SDPA's floating mask to the region's dtype, as it casts query, key and value
    (a float16 mask in a bfloat16 region included): the drop-in serves it so, within twice
    SDPA's error of SDPA in float64 on the cast inputs and mask."""
    inputs = Case(9, 9, 8, hq=2, hkv=2).inputs(torch.float32)
    mask = (torch.randn(9, 9) * 3).to(mask_dtype)
    with torch.autocast("cpu", dtype=autocast_dtype):
        ours = causal_attention.scaled_dot_product_attention(*inputs, attn_mask=mask,
                                                             is_causal=is_causal)
        theirs = F.scaled_dot_product_attention(*inputs, attn_mask=mask, is_causal=is_causal)
    assert ours.dtype == theirs.dtype == autocast_dtype
    cast = [to64(t.to(autocast_dtype)) for t in (*inputs, mask)]
    ref = F.scaled_dot_product_attention(*cast[:3], attn_mask=cast[3], is_causal=is_causal)
    failures = twice_sdpa_error_failures(("out",), (ours,), (theirs,), (ref,))
    assert not failures, "; ".join(failures)


def test_a_causal_bias_with_is_causal_is_a_value_error_as_in_sdpa():
    q, k, v = Case(4, 6, 8, hq=2, hkv=2).inputs(torch.float32)
    with pytest.raises(ValueError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(4, 6), is_causal=True)
    with pytest.raises(ValueError, match="causal_attention.scaled_dot_product_attention: a Causal"):
        causal_attention.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_upper_left(4, 6), is_causal=True
        )


def dropped_attention(q, k, v, dropout_p, is_causal, **kwargs):
    """The op's attention_weights (dropped as attention drops them for the same generator state)
    times v: what the drop-in computes, materialized; differentiable."""
    window = (-1, 0) if is_causal else (-1, -1)
    weights = causal_attention.attention_weights(q, k, v, window=window, dropout_p=dropout_p,
                                                 **kwargs)
    return weights @ v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "non-causal"])
def test_dropout_is_attention_weights_dropout_for_the_same_generator_state(is_causal):
    q, k, v = Case(33, 33, 16, hq=4, hkv=2, batch=(2,)).inputs(torch.float64)
    grad_out = torch.randn(2, 4, 33, 16, dtype=torch.float64)
    kwargs = dict(dropout_p=0.25, is_causal=is_causal, enable_gqa=True)
    torch.manual_seed(11)
    ours = forward_and_grads(causal_attention.scaled_dot_product_attention, (q, k, v), grad_out,
                             **kwargs)
    torch.manual_seed(11)
    ref = forward_and_grads(dropped_attention, (q, k, v), grad_out, 0.25, is_causal)
    for name, a, b in zip(RESULT_NAMES, ours, ref):
        torch.testing.assert_close(a, b, msg=name)
    torch.manual_seed(11)
    again = causal_attention.scaled_dot_product_attention(q, k, v, **kwargs)
    assert torch.equal(again, ours[0])  # bit for bit
    assert not torch.allclose(causal_attention.scaled_dot_product_attention(q, k, v, **kwargs),
                              ours[0])  # the generator moved on: another mask


@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "non-causal"])
def test_dropout_drops_at_the_rate_asked_and_rescales_the_rest(is_causal, dropout_p):
    # With v the identity the output rows are the (dropped) probabilities themselves.
    heads, length = 4, 64
    q, k = (torch.randn(1, heads, length, 16) for _ in range(2))
    v = torch.eye(length).expand(1, heads, length, length)
    probs = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    dropped = causal_attention.scaled_dot_product_attention(q, k, v, None, dropout_p, is_causal)
    visible = probs > 0
    kept = dropped != 0
    assert not (kept & ~visible).any()
    torch.testing.assert_close(dropped[kept], probs[kept] / (1 - dropout_p))
    # The dropped fraction of the visible probabilities, each dropped independently with
    # probability p: within 5 standard deviations of p.
    n = int(visible.sum())
    rate = 1 - int(kept.sum()) / n
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / n)
    assert abs(rate - dropout_p) < 5 * sigma, (rate, dropout_p, n)


def test_positional_arguments_follow_sdpa_signature():
    q, k, v = Case(9, 9, 8, hq=4, hkv=2).inputs(torch.float64)
    args = (q, k, v, None, 0.0, True)
    kwargs = {"scale": 0.4, "enable_gqa": True}
    torch.testing.assert_close(
        causal_attention.scaled_dot_product_attention(*args, **kwargs),
        F.scaled_dot_product_attention(*args, **kwargs),
    )


# Any attn_mask SDPA takes, bool or additive (a learned one requiring grad), broadcast, with
# is_causal (SDPA's top-left causal and the mask both) or without.
def _mask(shape, kind, dtype):
    generator = torch.Generator().manual_seed(1)
    if kind == "bool":
        mask = torch.rand(shape, generator=generator) < 0.7
        return mask | (torch.arange(shape[-1]) == 0)  # every row sees key 0, as SDPA needs
    bias = torch.randn(shape, generator=generator).to(dtype)
    return bias.requires_grad_() if kind == "learned" else bias


MASKED = [
    pytest.param(Case(17, 17, 8, hq=2, hkv=2), (17, 17), "bool", {}, id="bool-2d-mask"),
    pytest.param(Case(17, 17, 8, hq=2, hkv=2, batch=(2,)), (2, 1, 17, 17), "bool",
                 {"is_causal": True}, id="bool-batch-is_causal"),
    pytest.param(Case(9, 40, 8, hq=4, hkv=2), (1, 4, 9, 40), "learned", {"enable_gqa": True},
                 id="learned-heads-gqa-Lq<Lk"),
    pytest.param(Case(40, 9, 8, hq=2, hkv=2, batch=(2,)), (40, 9), "float", {"is_causal": True},
                 id="float-is_causal-Lq>Lk"),
    pytest.param(Case(9, 40, 8, hq=2, hkv=2, batch=(2,)), (2, 1, 1, 40), "float",
                 {"is_causal": True}, id="float-keys-is_causal-Lq<Lk"),
    pytest.param(Case(9, 40, 8, hq=2, hkv=2, batch=(2,)), (2, 1, 1, 40), "learned", {},
                 id="learned-keys-Lq<Lk"),
    pytest.param(Case(130, 130, 16, hq=2, hkv=1, batch=(2,), layout="transposed"),
                 (130, 130), "learned", {"enable_gqa": True}, id="learned-L130-transposed"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case,shape,kind,kwargs", MASKED)
def test_masked_calls_match_sdpa_within_twice_its_error(case, shape, kind, kwargs, dtype):
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    mask = _mask(shape, kind, dtype)
    results = []
    for function, tensors, m in (
        (causal_attention.scaled_dot_product_attention, inputs, mask),
        (F.scaled_dot_product_attention, inputs, mask),
        (F.scaled_dot_product_attention, [to64(t) for t in inputs],
         to64(mask).requires_grad_(mask.requires_grad) if mask.is_floating_point() else mask),
    ):
        leaves = [t.detach().requires_grad_() for t in tensors]
        m = m.detach().requires_grad_() if m.requires_grad else m
        out = function(*leaves, attn_mask=m, **kwargs)
        wanted = leaves + ([m] if m.requires_grad else [])
        results.append((out,) + torch.autograd.grad(out, wanted, grad_out.to(out.dtype)))
    names = RESULT_NAMES + ("dmask",)
    failures = twice_sdpa_error_failures(names, *results)
    assert not failures, "; ".join(failures)


# Calls torch 2.13's CPU SDPA refuses and the drop-in serves (docs/reference.md lists them): a
# mask with is_causal=True unless the inputs are 4-D and the mask 2-D or 4-D (RuntimeError), and a
# 0-D or 1-D mask on 4-D inputs (IndexError). id -> (query shape, key shape, mask shape, is_causal)
BEYOND_SDPA = {
    "2d-inputs-mask-is_causal": ((6, 8), (6, 8), (6, 6), True),
    "3d-inputs-mask-is_causal": ((2, 6, 8), (2, 6, 8), (6, 6), True),
    "3d-inputs-3d-mask-is_causal": ((2, 6, 8), (2, 6, 8), (2, 6, 6), True),
    "3d-mask-is_causal": ((2, 2, 6, 8), (2, 2, 6, 8), (2, 6, 6), True),
    "3d-mask-is_causal-Lq<Lk": ((2, 2, 6, 8), (2, 2, 9, 8), (2, 6, 9), True),
    "5d-inputs-mask-is_causal": ((2, 2, 2, 6, 8), (2, 2, 2, 6, 8), (6, 6), True),
    "1d-mask": ((2, 2, 6, 8), (2, 2, 6, 8), (6,), False),
    "0d-mask": ((2, 2, 6, 8), (2, 2, 6, 8), (), False),
    "1d-mask-is_causal": ((2, 2, 6, 8), (2, 2, 6, 8), (6,), True),
}


@pytest.mark.parametrize("case", BEYOND_SDPA.values(), ids=BEYOND_SDPA.keys())
def test_masks_sdpa_refuses_are_served_as_the_mask_and_causality_both(case):
    """Each call is what SDPA computes for the mask with the causal part folded into it (-inf
    above the top-left diagonal), broadcast to (Lq, Lk): the intersection SDPA itself computes
    for 4-D inputs with a 2-D or 4-D mask. SDPA refusing the call is checked too, so that this
    list (and the docs) follow torch when it starts serving one."""
    q_shape, k_shape, mask_shape, is_causal = case
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator, dtype=torch.float64)
               for shape in (q_shape, k_shape, k_shape))
    mask = torch.randn(mask_shape, generator=generator, dtype=torch.float64)
    with pytest.raises((RuntimeError, IndexError)):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    ours = causal_attention.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                         is_causal=is_causal)
    lq, lk = q.size(-2), k.size(-2)
    folded = mask.expand(*mask.shape[:-2], lq, lk) if mask.dim() >= 2 else mask.expand(lq, lk)
    if is_causal:
        folded = folded.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=folded))


# SDPA's broadcasting: leading dims of 1, a 3-D query against 4-D keys, heads of 1, value heads
# of 1 against key heads of 2 (with and without enable_gqa), and E = 0.
BROADCAST = [
    pytest.param((1, 2, 9, 8), (2, 2, 12, 8), (2, 2, 12, 8), {}, id="batch-1-vs-2"),
    pytest.param((2, 9, 8), (3, 2, 12, 8), (3, 2, 12, 8), {}, id="3d-query-4d-keys"),
    pytest.param((2, 1, 9, 8), (2, 3, 12, 8), (2, 3, 12, 8), {}, id="query-heads-1"),
    pytest.param((2, 4, 9, 8), (2, 1, 12, 8), (2, 1, 12, 6), {}, id="kv-heads-1"),
    pytest.param((2, 2, 9, 8), (2, 2, 12, 8), (2, 1, 12, 6), {}, id="value-heads-1"),
    pytest.param((2, 4, 9, 8), (2, 2, 12, 8), (2, 1, 12, 6), {"enable_gqa": True},
                 id="gqa-value-heads-1"),
    pytest.param((2, 8, 9, 8), (2, 2, 12, 8), (2, 4, 12, 6), {"enable_gqa": True},
                 id="gqa-key-heads-2-value-heads-4"),
    pytest.param((2, 2, 9, 0), (2, 2, 12, 0), (2, 2, 12, 6), {}, id="E0"),
    pytest.param((2, 2, 9, 0), (2, 2, 12, 0), (2, 2, 12, 6), {"is_causal": True},
                 id="E0-causal"),
]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_shape,k_shape,v_shape,kwargs", BROADCAST)
def test_broadcast_calls_match_sdpa(q_shape, k_shape, v_shape, kwargs, is_causal):
    kwargs = {"is_causal": is_causal, **kwargs}
    inputs = [make_tensor(shape, torch.float64) for shape in (q_shape, k_shape, v_shape)]
    want = F.scaled_dot_product_attention(*inputs, **kwargs)
    grad_out = make_tensor(want.shape, torch.float64)
    ours = forward_and_grads(causal_attention.scaled_dot_product_attention, inputs, grad_out,
                             **kwargs)
    ref = forward_and_grads(F.scaled_dot_product_attention, inputs, grad_out, **kwargs)
    for name, a, b in zip(RESULT_NAMES, ours, ref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_dropout_1_is_zeros_as_in_sdpa():
    q, k, v = Case(8, 8, 4, hq=2, hkv=2).inputs(torch.float32, requires_grad=True)
    out = causal_attention.scaled_dot_product_attention(q, k, v, dropout_p=1.0, is_causal=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, dropout_p=1.0), torch.zeros_like(out))
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(dq, torch.zeros_like(dq))


def _meta(t):
    return t.to("meta")


# Bad calls past SDPA's argument parser, each raising what SDPA raises (checked against SDPA
# itself): id -> (q, k, v shapes and dtypes, what changes, keyword arguments).
def _bad_call(name):
    f32 = torch.float32
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    kwargs = {}
    if name == "mixed-dtypes":
        k = k.double()
    elif name == "int-dtype":
        q, k, v = (t.to(torch.int64) for t in (q, k, v))
    elif name == "1d":
        q, k, v = (torch.randn(16) for _ in range(3))
    elif name == "0d":
        q, k, v = (torch.randn(()) for _ in range(3))
    elif name == "head-dims-differ":
        k = torch.randn(2, 4, 8, 12)
    elif name == "meta-key":
        k = _meta(k)
    elif name == "heads-no-gqa":
        k, v = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    elif name == "gqa-not-a-multiple":
        k, v = torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16)
        kwargs["enable_gqa"] = True
    elif name == "batch-mismatch":
        k, v = torch.randn(3, 4, 8, 16), torch.randn(3, 4, 8, 16)
    elif name == "key-value-lengths-differ":
        v = torch.randn(2, 4, 9, 16)
    elif name == "mask-int":
        kwargs["attn_mask"] = torch.zeros(8, 8, dtype=torch.int64)
    elif name == "mask-float64-for-float32":
        kwargs["attn_mask"] = torch.zeros(8, 8, dtype=torch.float64)
    elif name == "mask-not-broadcastable":
        kwargs["attn_mask"] = torch.zeros(8, 9, dtype=f32)
    elif name == "mask-meta":
        kwargs["attn_mask"] = torch.zeros(8, 8, dtype=torch.bool, device="meta")
    elif name.startswith("dropout"):
        kwargs["dropout_p"] = {"dropout-negative": -0.1, "dropout-1.5": 1.5,
                               "dropout-nan": math.nan}[name]
    elif name == "causal-bias-with-is_causal":
        kwargs.update(attn_mask=causal_upper_left(8, 8), is_causal=True)
    elif name == "lower-right-bias-of-other-sizes":
        kwargs["attn_mask"] = causal_lower_right(7, 8)  # SDPA reads it as its (7, 8) mask
    elif name == "learned-mask-is_causal":
        kwargs.update(attn_mask=torch.zeros(8, 8, requires_grad=True), is_causal=True)
    return (q, k, v), kwargs


BAD_CALLS = ["mixed-dtypes", "int-dtype", "1d", "0d", "head-dims-differ", "meta-key",
             "heads-no-gqa", "gqa-not-a-multiple", "batch-mismatch", "mask-int",
             "mask-float64-for-float32", "mask-not-broadcastable", "dropout-negative",
             "dropout-1.5", "dropout-nan", "causal-bias-with-is_causal", "learned-mask-is_causal",
             "lower-right-bias-of-other-sizes"]


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_calls_raise_the_exception_type_sdpa_raises(name):
    inputs, kwargs = _bad_call(name)
    with pytest.raises(Exception) as sdpa:
        F.scaled_dot_product_attention(*inputs, **kwargs)
    with pytest.raises(Exception) as ours:
        causal_attention.scaled_dot_product_attention(*inputs, **kwargs)
    assert type(ours.value) is type(sdpa.value), (ours.value, sdpa.value)


@pytest.mark.parametrize("dropout_p", [-0.1, 1.5, math.nan])
def test_dropout_outside_0_1_is_sdpa_s_runtime_error_naming_it(dropout_p):
    q, k, v = Case(8, 8, 4, hq=2, hkv=2).inputs(torch.float32)
    with pytest.raises(RuntimeError, match="scaled_dot_product_attention: dropout_p must be in"):
        causal_attention.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


@pytest.mark.parametrize("name", ["key-value-lengths-differ", "mask-meta"])
def test_calls_sdpa_answers_wrongly_are_refused_with_its_error_type(name):
    """SDPA's CPU kernel runs these without a word (value rows past key's count unread, a mask on
    another device ignored): a wrong answer, which the drop-in refuses with SDPA's error type."""
    inputs, kwargs = _bad_call(name)
    with pytest.raises(RuntimeError, match="causal_attention.attention: (k and v|attn_mask)"):
        causal_attention.scaled_dot_product_attention(*inputs, **kwargs)


# Arguments of a type SDPA's argument parser refuses. The drop-in refuses each with SDPA's
# exception type, before judging whether the call is served; a tensor scale that requires grad
# most of all, whose gradient would otherwise be dropped without a word. id -> (arguments
# replaced in a served call, the argument the message names; None: Python's own message)
REFUSED_TYPES = {
    "scale-tensor-requiring-grad": ({"scale": torch.tensor(0.5, requires_grad=True)}, "scale"),
    "scale-1-element-tensor": ({"scale": torch.tensor([0.5])}, "scale"),
    "scale-str": ({"scale": "0.5"}, "scale"),
    "scale-complex": ({"scale": 0.5j}, "scale"),
    "scale-Fraction": ({"scale": Fraction(1, 2)}, "scale"),
    "scale-Decimal": ({"scale": Decimal("0.5")}, "scale"),
    "scale-numpy-0d-array": ({"scale": np.array(0.5)}, "scale"),
    "scale-list": ({"scale": [0.5]}, "scale"),
    "scale-int-beyond-float": ({"scale": 10**400}, None),
    "dropout_p-None": ({"dropout_p": None}, "dropout_p"),
    "dropout_p-tensor-requiring-grad": (
        {"dropout_p": torch.tensor(0.0, requires_grad=True)},
        "dropout_p",
    ),
    "dropout_p-str": ({"dropout_p": "0"}, "dropout_p"),
    "is_causal-int": ({"is_causal": 1}, "is_causal"),
    "is_causal-None": ({"is_causal": None}, "is_causal"),
    "is_causal-numpy-bool": ({"is_causal": np.bool_(True)}, "is_causal"),
    "is_causal-tensor": ({"is_causal": torch.tensor(True)}, "is_causal"),
    "enable_gqa-str": ({"enable_gqa": "yes"}, "enable_gqa"),
    "enable_gqa-int": ({"enable_gqa": 0}, "enable_gqa"),
    "attn_mask-list": ({"attn_mask": [[True]]}, "attn_mask"),
    "attn_mask-float": ({"attn_mask": 0.0}, "attn_mask"),
    "query-None": ({"query": None}, "query"),
    "key-list": ({"key": [[1.0]]}, "key"),
    "value-numpy": ({"value": np.zeros((1, 2, 8, 4), dtype=np.float32)}, "value"),
}


def _served_arguments():
    q, k, v = Case(8, 8, 4, hq=2, hkv=2).inputs(torch.float32)
    return {"query": q, "key": k, "value": v, "is_causal": True}


@pytest.mark.parametrize("case", REFUSED_TYPES.values(), ids=REFUSED_TYPES.keys())
def test_arguments_of_a_type_sdpa_refuses_raise_its_exception_type(case):
    replaced, named = case
    args = {**_served_arguments(), **replaced}
    with pytest.raises(Exception) as theirs:
        F.scaled_dot_product_attention(**args)
    assert type(theirs.value) in (TypeError, OverflowError), theirs.value  # the premise
    with pytest.raises(Exception) as ours:
        causal_attention.scaled_dot_product_attention(**args)
    assert type(ours.value) is type(theirs.value), f"{type(ours.value).__name__}: {ours.value}"
    if named is not None:
        message = str(ours.value)
        assert message.startswith(f"causal_attention.scaled_dot_product_attention: {named} must")


@pytest.mark.parametrize("name", ["dropout_p", "scale"])
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0d", "1-element"])
def test_float_arguments_given_as_tensors_requiring_grad_say_so(name, shape):
    # The flash-attn functions refuse these with the same words (one check serves both).
    args = {**_served_arguments(), name: torch.zeros(shape, requires_grad=True)}
    with pytest.raises(TypeError, match=f"^causal_attention.scaled_dot_product_attention: {name} "
                                        "must be a float, got a tensor that requires grad"):
        causal_attention.scaled_dot_product_attention(**args)


# What SDPA's parser converts to a float (a 0-d tensor that does not require grad, a bool, an
# int, numpy scalars), the drop-in takes too, with the same result.
ACCEPTED_NUMBERS = {
    "scale-0d-tensor": {"scale": torch.tensor(0.25)},
    "scale-0d-float64-tensor": {"scale": torch.tensor(0.25, dtype=torch.float64)},
    "scale-bool": {"scale": True},
    "scale-int": {"scale": 2},
    "scale-numpy-float32": {"scale": np.float32(0.25)},
    "scale-numpy-int64": {"scale": np.int64(1)},
    "dropout_p-0d-tensor": {"dropout_p": torch.tensor(0.0)},
    "dropout_p-False": {"dropout_p": False},
    "dropout_p-int": {"dropout_p": 0},
}


@pytest.mark.parametrize("kwargs", ACCEPTED_NUMBERS.values(), ids=ACCEPTED_NUMBERS.keys())
def test_numbers_sdpa_converts_to_float_are_accepted(kwargs):
    args = {**_served_arguments(), **kwargs}
    torch.testing.assert_close(
        causal_attention.scaled_dot_product_attention(**args),
        F.scaled_dot_product_attention(**args),
    )


# torch.nested jagged tensors: (B, H, j, D), ragged in the sequence dim, served through
# varlen_attention on the packed rows (causal bottom-right in each sequence, beyond torch's CPU
# SDPA); ragged in the batch-like dim 1, the dense call on the rows, as torch serves it.
def _offsets(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)])


def _on_offsets(rows, offsets):
    """(B, H, j, D) jagged, built as attention layers build one: every sequence's rows in one
    (total, H, D) buffer, viewed (B, j, H, D) on its offsets and transposed."""
    return torch.nested.nested_tensor_from_jagged(rows, offsets).transpose(1, 2)


def _jagged(lengths, heads, dim, dtype=torch.float64):
    """A (B, H, j, D) jagged leaf of random rows."""
    rows = make_tensor((sum(lengths), heads, dim), dtype)
    return _on_offsets(rows, _offsets(lengths)).detach().requires_grad_(True)


def _rows(nested):
    """The (total, H, D) rows of a (B, H, j, D) jagged tensor: a view, differentiable."""
    return nested.transpose(1, 2).values()


def _nested_results(function, inputs, grad_rows, **kwargs):
    """forward_and_grads of ``function`` on jagged inputs: out and dq, dk, dv as their rows,
    the gradient of a loss over the nested output (``grad_rows`` its gradient by row)."""
    results = forward_and_grads(lambda *qkv, **kw: _rows(function(*qkv, **kw)), inputs, grad_rows,
                                **kwargs)
    return tuple(_rows(r) if r.is_nested else r for r in results)


def _per_sequence_sdpa(q, k, v, is_causal=False, **kwargs):
    """SDPA on each sequence alone, causal bottom-right (the library's alignment, which torch's
    CUDA flash kernel gives nested calls too), the sequences' rows packed: what a nested call
    computes, spelled out."""
    outs = []
    for rows_q, rows_k, rows_v in zip(*(_rows(t).split(t.offsets().diff().tolist())
                                        for t in (q, k, v))):
        q_i, k_i, v_i = (r.transpose(0, 1) for r in (rows_q, rows_k, rows_v))
        mask = causal_lower_right(q_i.size(-2), k_i.size(-2)) if is_causal else None
        outs.append(F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask, **kwargs))
    return _on_offsets(torch.cat([o.transpose(0, 1) for o in outs]), q.offsets())


def _packed_attention(q, k, v, is_causal=False, enable_gqa=False, **options):
    """varlen_attention on the jagged inputs' rows (the op reads fewer K/V heads as grouped
    query attention), causal bottom-right or full: the call the drop-in must make."""
    cu_seqlens_q, cu_seqlens_k = (t.offsets().to(torch.int32) for t in (q, k))
    out = causal_attention.varlen_attention(
        *(_rows(t) for t in (q, k, v)), cu_seqlens_q, cu_seqlens_k,
        *(int(cu.diff().max()) for cu in (cu_seqlens_q, cu_seqlens_k)),
        window=(-1, 0) if is_causal else (-1, -1), **options)
    return _on_offsets(out, q.offsets())


# id -> (query lengths, key/value lengths, (Hq, Hkv, D, Dv), keyword arguments)
NESTED = {
    "equal-lengths": ([3, 5, 2], [3, 5, 2], (2, 2, 8, 8), {}),
    "scale-Dv": ([7, 1, 4], [7, 1, 4], (2, 2, 8, 4), {"scale": 0.3}),
    "one-sequence": ([9], [9], (3, 3, 16, 16), {}),
    "cross-lengths": ([3, 5, 2], [4, 7, 6], (2, 2, 8, 8), {}),
}
NESTED_GQA = {
    "gqa": ([3, 5, 2], [3, 5, 2], (4, 2, 8, 8), {"enable_gqa": True}),
    "mqa-cross-lengths": ([3, 5, 2], [4, 7, 6], (4, 1, 8, 8), {"enable_gqa": True}),
}


def _nested_inputs(case, dtype=torch.float64):
    lengths_q, lengths_kv, (heads_q, heads_kv, dim, dim_v), _ = case
    return (_jagged(lengths_q, heads_q, dim, dtype), _jagged(lengths_kv, heads_kv, dim, dtype),
            _jagged(lengths_kv, heads_kv, dim_v, dtype))


def _grad_rows(case, dtype=torch.float64):
    lengths_q, _, (heads_q, _, _, dim_v), _ = case
    return make_tensor((sum(lengths_q), heads_q, dim_v), dtype)


@pytest.mark.parametrize("dtype", dtype_params((torch.float64, torch.float32)))
@pytest.mark.parametrize("case", NESTED.values(), ids=NESTED.keys())
def test_nested_calls_match_sdpa_on_the_same_nested_inputs(case, dtype):
    inputs, grad_rows, kwargs = _nested_inputs(case, dtype), _grad_rows(case, dtype), case[3]
    ours = _nested_results(causal_attention.scaled_dot_product_attention, inputs, grad_rows,
                           **kwargs)
    sdpa = _nested_results(F.scaled_dot_product_attention, inputs, grad_rows, **kwargs)
    for name, a, b in zip(RESULT_NAMES, ours, sdpa):
        torch.testing.assert_close(a, b, msg=name)
    # It is our op on the packed rows, not a fallback to SDPA.
    assert torch.equal(ours[0], _rows(_packed_attention(*inputs, **kwargs)))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", {**NESTED, **NESTED_GQA}.values(),
                         ids={**NESTED, **NESTED_GQA}.keys())
def test_nested_calls_are_sdpa_on_each_sequence_alone(case, is_causal):
    """Causal included, which torch's CPU SDPA has no backend for (bottom-right in a sequence
    with more keys than queries), and grouped-query attention, which its nested path refuses."""
    inputs, grad_rows, kwargs = _nested_inputs(case), _grad_rows(case), case[3]
    ours = _nested_results(causal_attention.scaled_dot_product_attention, inputs, grad_rows,
                           is_causal=is_causal, **kwargs)
    ref = _nested_results(_per_sequence_sdpa, inputs, grad_rows, is_causal=is_causal, **kwargs)
    for name, a, b in zip(RESULT_NAMES, ours, ref):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("dtype", dtype_params((torch.bfloat16, torch.float16)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", [NESTED["cross-lengths"], NESTED_GQA["gqa"]],
                         ids=["cross-lengths", "gqa"])
def test_nested_calls_in_reduced_precision_within_twice_sdpa_s_error(case, is_causal, dtype):
    inputs, grad_rows, kwargs = _nested_inputs(case, dtype), _grad_rows(case, dtype), case[3]
    kwargs = {**kwargs, "is_causal": is_causal}
    ours = _nested_results(causal_attention.scaled_dot_product_attention, inputs, grad_rows,
                           **kwargs)
    same = _nested_results(_per_sequence_sdpa, inputs, grad_rows, **kwargs)
    ref = _nested_results(_per_sequence_sdpa, [t.to(torch.float64) for t in inputs],
                          to64(grad_rows), **kwargs)
    failures = twice_sdpa_error_failures(RESULT_NAMES, ours, same, ref)
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_nested_views_of_one_packed_qkv_projection_are_served_in_place(is_causal):
    """PyTorch's packed test (test_scaled_dot_product_attention_fused_kernels_packed) in the
    jagged layout: q, k and v are column chunks of one (total, 3 H D) projection, rows 3 H D
    apart, which torch's CPU SDPA has no backend for."""
    heads, dim, lengths = 2, 8, [3, 5, 2]
    qkv = torch.nested.nested_tensor_from_jagged(
        make_tensor((sum(lengths), 3 * heads * dim), torch.float64), _offsets(lengths))
    inputs = [t.view(len(lengths), -1, heads, dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1)]
    grad_rows = make_tensor((sum(lengths), heads, dim), torch.float64)
    ours = _nested_results(causal_attention.scaled_dot_product_attention, inputs, grad_rows,
                           is_causal=is_causal)
    ref = _nested_results(_per_sequence_sdpa, inputs, grad_rows, is_causal=is_causal)
    for name, a, b in zip(RESULT_NAMES, ours, ref):
        torch.testing.assert_close(a, b, msg=name)


def test_nested_calls_read_the_nested_buffers_in_place(monkeypatch):
    """varlen_attention gets the inputs' own (total, H, D) buffers, never a padded or packed
    copy, and the result is a view of its output on query's offsets: its ragged size is
    query's, so the two add."""
    calls = []

    def recorded(*args, **kwargs):
        calls.append(args)
        return causal_attention.varlen_attention(*args, **kwargs)

    monkeypatch.setattr(causal_attention.functional, "varlen_attention", recorded)
    q, k, v = _nested_inputs(NESTED["cross-lengths"])
    out = causal_attention.scaled_dot_product_attention(q, k, v, is_causal=True)
    (args,) = calls
    for packed, nested in zip(args[:3], (q, k, v)):
        assert packed.data_ptr() == _rows(nested).data_ptr()
        assert packed.stride() == _rows(nested).stride()
    assert out.offsets() is q.offsets()
    assert (out + q).shape == q.shape


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_nested_gradients_pass_gradcheck(is_causal):
    offsets_q, offsets_kv = _offsets([2, 3]), _offsets([3, 3])

    def attend(rows_q, rows_k, rows_v):
        q, k, v = (_on_offsets(rows, offsets) for rows, offsets in
                   ((rows_q, offsets_q), (rows_k, offsets_kv), (rows_v, offsets_kv)))
        out = causal_attention.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                            enable_gqa=True)
        return _rows(out)

    rows = (torch.randn(5, 2, 4, dtype=torch.float64, requires_grad=True),
            *(torch.randn(6, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)))
    assert torch.autograd.gradcheck(attend, rows)


def test_nested_calls_under_no_grad_give_the_same_result_without_a_graph():
    q, k, v = _nested_inputs(NESTED_GQA["gqa"])
    with_grad = causal_attention.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              enable_gqa=True)
    with torch.no_grad():
        out = causal_attention.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True)
    assert not out.requires_grad
    assert torch.equal(_rows(out), _rows(with_grad).detach())


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_nested_dropout_is_the_packed_op_s_for_the_same_generator_state(is_causal):
    """Dropout as for dense inputs: its seed drawn from torch's default generator, so the same
    state gives the same result, bit for bit; dropout_p=1 gives zeros."""
    case = NESTED_GQA["mqa-cross-lengths"]
    inputs, grad_rows = _nested_inputs(case), _grad_rows(case)
    kwargs = dict(dropout_p=0.25, is_causal=is_causal, enable_gqa=True)
    torch.manual_seed(11)
    ours = _nested_results(causal_attention.scaled_dot_product_attention, inputs, grad_rows,
                           **kwargs)
    torch.manual_seed(11)
    ref = _nested_results(_packed_attention, inputs, grad_rows, **kwargs)
    for name, a, b in zip(RESULT_NAMES, ours, ref):
        assert torch.equal(a, b), name
    dropped = _nested_results(causal_attention.scaled_dot_product_attention, inputs, grad_rows,
                              **kwargs)
    assert not torch.equal(dropped[0], ours[0])  # the generator moved on: another mask
    everything = _nested_results(causal_attention.scaled_dot_product_attention, inputs,
                                 grad_rows, **{**kwargs, "dropout_p": 1.0})
    for name, result in zip(RESULT_NAMES, everything):
        assert torch.equal(result, torch.zeros_like(result)), name


def test_nested_ragged_in_the_batch_like_dim_is_sdpa_s_dense_call_on_the_rows():
    """(B, j, L, D), ragged in dim 1: torch's SDPA runs the rows (total, L, D) as a dense call."""
    offsets = torch.tensor([0, 2, 5])
    inputs = [torch.nested.nested_tensor_from_jagged(make_tensor((5, 6, 8), torch.float64),
                                                     offsets).requires_grad_(True)
              for _ in range(3)]
    grad_values = make_tensor((5, 6, 8), torch.float64)

    def results(function):
        out = function(*inputs, is_causal=True)
        grads = torch.autograd.grad(out.values(), inputs, grad_values)
        return (out.values(),) + tuple(g.values() for g in grads)

    ours = results(causal_attention.scaled_dot_product_attention)
    assert ours[0].shape == (5, 6, 8)
    for name, a, b in zip(RESULT_NAMES, ours, results(F.scaled_dot_product_attention)):
        torch.testing.assert_close(a, b, msg=name)


def _strided_nested(lengths, heads, dim):
    """A strided-layout nested (B, H, j, D) leaf, (B, j, H, D) transposed: what
    torch.nested.nested_tensor builds by default, as PyTorch's SDPA tests build theirs."""
    rows = [torch.randn(n, heads, dim, dtype=torch.float64) for n in lengths]
    return torch.nested.nested_tensor(rows).requires_grad_(True)


def test_strided_nested_calls_match_sdpa_on_their_contiguous_copies():
    """Strided-layout nested query, key and value (issue 41, item 1: PyTorch's
    test_scaled_dot_product_attention_fused_kernels_packed[nested-*] builds these) are served
    through the jagged path: the result is strided nested as SDPA's, and the values and
    gradients are SDPA's on the same tensors made contiguous (which torch's CPU SDPA needs)."""
    leaves = [_strided_nested([3, 5, 2], 2, 8) for _ in range(3)]
    ours = causal_attention.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves))
    sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2).contiguous() for t in leaves))
    assert ours.is_nested and ours.layout == torch.strided
    grads_out = [torch.randn_like(t) for t in sdpa.unbind()]
    results = []
    for out in (ours, sdpa):
        loss = sum((o * g).sum() for o, g in zip(out.unbind(), grads_out))
        results.append((out,) + torch.autograd.grad(loss, leaves))
    for name, a, b in zip(RESULT_NAMES, *results):
        for x, y in zip(a.unbind(), b.unbind()):
            torch.testing.assert_close(x, y, msg=name)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_strided_nested_views_of_one_packed_qkv_are_the_jagged_call(is_causal):
    """PyTorch's packed test: q, k and v as chunks of one strided nested (B, j, 3 H D)
    projection, viewed as (B, j, H, D) and transposed; the same values as the jagged call on
    copies of them (causal bottom-right in each sequence, which torch's CPU SDPA cannot do)."""
    qkv = torch.nested.nested_tensor(
        [torch.randn(n, 3 * 2 * 8, dtype=torch.float64) for n in (3, 5, 2)])
    q, k, v = (t.view(3, -1, 2, 8).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    ours = causal_attention.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    jagged = [torch.nested.as_nested_tensor(list(t.transpose(1, 2).unbind()),
                                            layout=torch.jagged).transpose(1, 2)
              for t in (q, k, v)]
    want = causal_attention.scaled_dot_product_attention(*jagged, is_causal=is_causal)
    for x, y in zip(ours.unbind(), want.unbind()):
        torch.testing.assert_close(x, y)
    if not is_causal:
        sdpa = F.scaled_dot_product_attention(*(t.contiguous() for t in (q, k, v)))
        for x, y in zip(ours.unbind(), sdpa.unbind()):
            torch.testing.assert_close(x, y)


def _refused_nested_call(name):
    """A nested call that cannot be served: (query, key, value, keyword arguments)."""
    q, k, v = _nested_inputs(NESTED["equal-lengths"])
    kwargs = {}
    if name == "dense-key":
        k = torch.randn(3, 2, 5, 8, dtype=torch.float64)
    elif name == "dense-query":
        q = torch.randn(3, 2, 5, 8, dtype=torch.float64)
    elif name == "strided-ragged-heads":
        q = torch.nested.nested_tensor([torch.randn(h, 5, 8) for h in (2, 3, 2)])
    elif name == "attn_mask":
        kwargs["attn_mask"] = torch.ones(5, 5, dtype=torch.bool)
    elif name == "causal-bias":
        kwargs["attn_mask"] = causal_lower_right(5, 5)
    elif name == "holes":
        holes = torch.nested.nested_tensor_from_jagged(
            torch.randn(12, 2, 8, dtype=torch.float64), torch.tensor([0, 4, 9, 12]),
            lengths=torch.tensor([3, 5, 2]))
        q = holes.transpose(1, 2)
    elif name == "ragged-head-dim":
        q, k, v = (t.transpose(2, 3) for t in (q, k, v))
    elif name == "3d-ragged-sequence":
        q, k, v = (torch.nested.nested_tensor([torch.randn(n, 8) for n in (3, 5, 2)],
                                              layout=torch.jagged) for _ in range(3))
    elif name == "ragged-dims-differ":
        k = k.transpose(1, 2)
    elif name == "heads-without-gqa":
        k, v = _nested_inputs(NESTED_GQA["gqa"])[1:]
        q = _jagged([3, 5, 2], 4, 8)
    elif name == "key-value-lengths-differ":
        v = _jagged([3, 4, 3], 2, 8)
    return q, k, v, kwargs


# id -> (exception type, what the message says)
REFUSED_NESTED = {
    "dense-key": (ValueError, "all nested or all dense, got query nested, key dense, value nested"),
    "dense-query": (ValueError, "all nested or all dense, got query dense, key nested"),
    "strided-ragged-heads": (ValueError, r"a nested query of strided layout must be "
                                        r"\(B, H, j, D\), ragged in its sequence dim only"),
    "attn_mask": (ValueError, "attn_mask must be None with nested query, key and value"),
    "causal-bias": (ValueError, "attn_mask must be None with nested .* got CausalBias"),
    "holes": (ValueError, r"a nested query must hold its sequences back to back, got one with "
                          r"holes \(lengths \[3, 5, 2\]\)"),
    "ragged-head-dim": (ValueError, r"a nested query must be \(B, H, j, D\), ragged in its "
                                    r"sequence dim, .* ragged in dim 3"),
    "3d-ragged-sequence": (ValueError, r"got shape \(3, j\d+, 8\), ragged in dim 1$"),
    "ragged-dims-differ": (ValueError, "query, key and value must be ragged in the same dim, got "
                                       "key"),
    "heads-without-gqa": (ValueError, r"key must have query's 4 heads \(or 1\), got 2; "
                                      r"grouped-query attention takes enable_gqa=True"),
    "key-value-lengths-differ": (ValueError, r"key and value must have the same sequence "
                                             r"lengths, got \[3, 5, 2\] and \[3, 4, 3\]"),
}


@pytest.mark.parametrize("name", REFUSED_NESTED.keys())
def test_nested_calls_that_cannot_be_served_raise_a_typed_error_naming_the_argument(name):
    q, k, v, kwargs = _refused_nested_call(name)
    error, message = REFUSED_NESTED[name]
    with pytest.raises(error, match=message) as raised:
        causal_attention.scaled_dot_product_attention(q, k, v, **kwargs)
    assert str(raised.value).startswith("causal_attention.scaled_dot_product_attention: ")
