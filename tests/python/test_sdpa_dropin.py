"""causal_attention.scaled_dot_product_attention as a drop-in for F.scaled_dot_product_attention:
same result for the calls it serves, NotImplementedError naming the argument otherwise."""

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
