"""torch.autograd.gradcheck of the ops' C++ backward in float64: attention without and with a
key mask, and varlen_attention."""

import pytest
import torch

import causal_attention
from attention_testing import Case, Packed, make_key_mask

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


# (case, mask kind): holes, left padding (first rows without a visible key), a batch element that
# hides every key, Lq > Lk, and a hidden block of 64 keys among three.
KEY_MASK_CASES = [
    pytest.param(Case(6, 6, 3, hq=4, hkv=2, batch=(2,)), "holes", id="gqa2-holes"),
    pytest.param(Case(5, 5, 3, dv=2, batch=(3,)), "left-pad", id="Dv2-left-pad"),
    pytest.param(Case(3, 7, 2, hq=2, hkv=1, batch=(2,)), "one-all-false", id="Lq3-Lk7-none"),
    pytest.param(Case(7, 4, 2, batch=(2,), layout="transposed"), "right-pad", id="Lq7-Lk4-right"),
    pytest.param(Case(20, 150, 2, heads=False), "holes", id="2d-Lk150-hidden-block"),
]


@pytest.mark.parametrize("fast_mode", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("case,kind", KEY_MASK_CASES)
def test_gradcheck_with_key_mask(case, kind, fast_mode):
    inputs = case.inputs(torch.float64, requires_grad=True)
    key_mask = make_key_mask(case.key_mask_shape, kind)

    def fn(q, k, v):
        return causal_attention.attention(q, k, v, key_mask=key_mask)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode)


# An empty sequence, single tokens, a chunk against its cache, rows without keys, GQA, Dv != D.
VARLEN_CASES = [
    pytest.param(Packed((3, 0, 4, 1), (3, 2, 6, 1), 3, hq=2, hkv=2), None, id="mixed"),
    pytest.param(Packed((5, 2), (2, 0), 2, dv=3, hq=4, hkv=2), 0.7, id="no-keys-gqa2-Dv3"),
    pytest.param(Packed((70,), (70,), 2), None, id="L70-two-blocks"),
]


@pytest.mark.parametrize("fast_mode", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("packed,scale", VARLEN_CASES)
def test_gradcheck_varlen(packed, scale, fast_mode):
    inputs = packed.inputs(torch.float64, requires_grad=True)
    lengths = packed.lengths_args()

    def fn(q, k, v):
        return causal_attention.varlen_attention(q, k, v, *lengths, scale=scale)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode)
