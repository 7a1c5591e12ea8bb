"""causal_attention.scaled_dot_product_attention as a drop-in for F.scaled_dot_product_attention:
same result for the calls it serves, NotImplementedError naming the argument otherwise."""

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import causal_attention
from attention_testing import Case, dtype_params

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
        Case(8, 8, 4, hq=2, hkv=2), {"dropout_p": 0.1, "is_causal": True}, "dropout_p", id="dropout"
    ),
    pytest.param(Case(8, 8, 4, hq=2, hkv=2), {}, "is_causal", id="default-not-causal"),
    pytest.param(
        Case(8, 8, 4, hq=2, hkv=2), {"is_causal": False}, "is_causal", id="is_causal-False"
    ),
    pytest.param(Case(4, 8, 4, hq=2, hkv=2), {"is_causal": True}, "length", id="Lq<Lk"),
    pytest.param(Case(8, 4, 4, heads=False), {"is_causal": True}, "length", id="Lq>Lk-2d"),
    pytest.param(Case(8, 8, 4, hq=4, hkv=2), {"is_causal": True}, "enable_gqa", id="gqa-no-flag"),
]


@pytest.mark.parametrize("case,kwargs,named", REFUSED)
def test_unserved_calls_raise_not_implemented(case, kwargs, named):
    q, k, v = case.inputs(torch.float32)
    with pytest.raises(NotImplementedError, match=named) as info:
        causal_attention.scaled_dot_product_attention(q, k, v, **kwargs)
    assert "causal_attention.scaled_dot_product_attention" in str(info.value)


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
