"""causal_attention.scaled_dot_product_attention as a drop-in for F.scaled_dot_product_attention:
same result for the calls it serves (causal, and non-causal full attention within twice SDPA's
error in every dtype; causal with any lengths, top-left as is_causal or as a CausalBias says),
with dropout the probabilities attention_weights gives for the same generator state, dropped at
the rate asked; NotImplementedError naming the argument otherwise."""

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


REFUSED = [
    pytest.param(
        Case(8, 8, 4, hq=2, hkv=2),
        {"attn_mask": torch.ones(8, 8, dtype=torch.bool), "is_causal": True},
        "attn_mask",
        id="attn_mask",
    ),
    pytest.param(
        Case(8, 8, 4, hq=2, hkv=2),
        {"attn_mask": torch.ones(8, 8, dtype=torch.bool)},
        "attn_mask",
        id="attn_mask-not-causal",
    ),
    pytest.param(
        Case(8, 8, 4, hq=2, hkv=2), {"dropout_p": 1.0, "is_causal": True}, "dropout_p=1.0",
        id="dropout-1",
    ),
    pytest.param(Case(8, 8, 4, hq=4, hkv=2), {"is_causal": True}, "enable_gqa", id="gqa-no-flag"),
]


@pytest.mark.parametrize("case,kwargs,named", REFUSED)
def test_unserved_calls_raise_not_implemented(case, kwargs, named):
    q, k, v = case.inputs(torch.float32)
    with pytest.raises(NotImplementedError, match=named) as info:
        causal_attention.scaled_dot_product_attention(q, k, v, **kwargs)
    assert "causal_attention.scaled_dot_product_attention" in str(info.value)


@pytest.mark.parametrize("dropout_p", [-0.1, 1.5, math.nan])
def test_dropout_outside_0_1_is_a_value_error(dropout_p):
    # SDPA raises RuntimeError for these (or computes with NaN); ours names the argument.
    q, k, v = Case(8, 8, 4, hq=2, hkv=2).inputs(torch.float32)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        causal_attention.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


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
