"""torch.autograd.gradcheck of the op's C++ backward in float64."""

import pytest
import torch

import causal_attention
from attention_testing import Case

CASES = [
    pytest.param(Case(5, 5, 3, hq=2, hkv=2), None, id="L5-D3-H2"),
    pytest.param(Case(6, 6, 3, dv=2, hq=4, hkv=2), None, id="gqa2-Dv2"),
    pytest.param(Case(3, 7, 2, hq=2, hkv=1), None, id="Lq3-Lk7-gqa2"),
    pytest.param(Case(7, 3, 2), None, id="Lq7-Lk3-empty-rows"),
    pytest.param(Case(4, 4, 3, hq=2, hkv=2), 0.7, id="scale0.7"),
    pytest.param(Case(5, 5, 3, heads=False), None, id="2d"),
    pytest.param(Case(70, 70, 2, batch=()), None, id="3d-L70-two-blocks"),
    pytest.param(Case(4, 6, 3, hq=2, hkv=2, layout="transposed"), None, id="transposed"),
]


@pytest.mark.parametrize("fast_mode", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("case,scale", CASES)
def test_gradcheck(case, scale, fast_mode):
    inputs = case.inputs(torch.float64, requires_grad=True)

    def fn(q, k, v):
        return causal_attention.attention(q, k, v, scale=scale)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode)
