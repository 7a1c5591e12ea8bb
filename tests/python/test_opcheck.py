"""torch.library.opcheck (schema, autograd registration, FakeTensor/Meta, AOT dispatch with
dynamic shapes) of the three operators."""

import pytest
import torch

import causal_attention  # noqa: F401  (loads the ops)
from attention_testing import Case

OPS = torch.ops.causal_attention

# (case, dtype, scale) samples for the public op.
ATTENTION_SAMPLES = [
    pytest.param(Case(8, 8, 4, hq=2, hkv=2), torch.float32, None, id="4d-f32"),
    pytest.param(Case(8, 8, 4, hq=4, hkv=2), torch.float32, None, id="gqa2"),
    pytest.param(Case(8, 8, 4, hq=4, hkv=1), torch.float64, 0.3, id="gqa4-f64-scale"),
    pytest.param(Case(3, 9, 4, hq=2, hkv=2), torch.float32, None, id="Lq3-Lk9"),
    pytest.param(Case(9, 3, 4, hq=2, hkv=1), torch.float32, None, id="Lq9-Lk3-gqa2"),
    pytest.param(Case(6, 6, 4, heads=False), torch.float32, None, id="2d"),
    pytest.param(Case(6, 6, 4, hq=3, hkv=3, batch=()), torch.float32, None, id="3d"),
    pytest.param(Case(5, 5, 4, dv=3, hq=2, hkv=1, batch=(2, 2)), torch.float32, None, id="5d-Dv3"),
    pytest.param(
        Case(7, 7, 4, hq=2, hkv=2, batch=(2,), layout="transposed"),
        torch.float32,
        None,
        id="transposed",
    ),
    pytest.param(Case(7, 5, 4, hq=2, hkv=2, layout="strided"), torch.float32, None, id="strided"),
    pytest.param(Case(8, 8, 4, hq=2, hkv=2), torch.bfloat16, None, id="bf16"),
    pytest.param(Case(8, 8, 4, hq=2, hkv=1), torch.float16, 0.5, id="f16-gqa2-scale"),
]

FEW_SAMPLES = [
    pytest.param(Case(8, 8, 4, hq=4, hkv=2), torch.float32, 0.5, id="gqa2"),
    pytest.param(Case(9, 3, 4, hq=2, hkv=2, layout="transposed"), torch.float32, 0.5, id="Lq9-Lk3"),
    pytest.param(Case(6, 6, 4, heads=False), torch.bfloat16, 0.5, id="2d-bf16"),
]


def _assert_all_pass(report):
    assert report, "opcheck ran no test"
    assert all(result == "SUCCESS" for result in report.values()), report


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case,dtype,scale", ATTENTION_SAMPLES)
def test_opcheck_attention(case, dtype, scale, requires_grad):
    q, k, v = case.inputs(dtype, requires_grad=requires_grad)
    kwargs = {} if scale is None else {"scale": scale}
    _assert_all_pass(torch.library.opcheck(OPS.attention.default, (q, k, v), kwargs))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case,dtype,scale", FEW_SAMPLES)
def test_opcheck_attention_forward(case, dtype, scale, requires_grad):
    q, k, v = case.inputs(dtype, requires_grad=requires_grad)
    _assert_all_pass(torch.library.opcheck(OPS.attention_forward.default, (q, k, v, scale)))


@pytest.mark.parametrize("case,dtype,scale", FEW_SAMPLES)
def test_opcheck_attention_backward(case, dtype, scale):
    q, k, v = case.inputs(dtype)
    out, lse = OPS.attention_forward(q, k, v, scale)
    grad_out = torch.randn_like(out)
    args = (grad_out, q, k, v, out, lse, scale)
    _assert_all_pass(torch.library.opcheck(OPS.attention_backward.default, args))
