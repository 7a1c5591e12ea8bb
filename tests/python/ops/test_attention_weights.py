"""causal_attention.attention_weights: the materialized probabilities equal a naive float64
softmax with the bottom-right causal mask, are exactly zero above the boundary and in rows with no
visible key, agree with attention(), differentiate without NaN, and trace under torch.export."""

import math

import pytest
import torch

import causal_attention
from attention_testing.inputs import Case
from attention_testing.parameters import dtype_params
from causal_attention._masks import visible_keys

CASES = [
    pytest.param(Case(17, 17, 8, hq=4, hkv=2), id="L17-gqa2"),
    pytest.param(Case(5, 9, 16, hq=2, hkv=2, batch=()), id="kvcache-Lq5-Lk9"),
    pytest.param(Case(9, 5, 8, hq=2, hkv=1), id="empty-rows-Lq9-Lk5-mqa"),
    pytest.param(Case(6, 6, 4, heads=False), id="2d-L6"),
    pytest.param(Case(7, 7, 8, dv=3, hq=2, hkv=2, batch=(2, 3), layout="transposed"), id="5d-Dv3"),
    pytest.param(Case(3, 0, 8, hq=2, hkv=2), id="Lk0"),
]

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}


def naive_weights(q, k, scale):
    q64, k64 = q.double(), k.double()
    if q.dim() >= 3 and q.size(-3) != k.size(-3):
        k64 = k64.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    scores = (q64 @ k64.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~visible_keys(q.size(-2), k.size(-2)), -math.inf)
    return scores.softmax(-1).nan_to_num(0.0)  # a row with no visible key: all -inf -> NaN -> 0


@pytest.mark.parametrize("dtype", dtype_params((torch.float64, torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("scale", [None, 0.3], ids=["default-scale", "scale0.3"])
@pytest.mark.parametrize("case", CASES)
def test_matches_naive_softmax(case, scale, dtype):
    q, k, v = case.inputs(dtype)
    weights = causal_attention.attention_weights(q, k, v, scale=scale)
    expected_scale = 1 / math.sqrt(case.d) if scale is None else scale
    expected = naive_weights(q, k, expected_scale)
    assert weights.dtype == dtype
    assert weights.shape == q.shape[:-1] + (k.size(-2),)
    torch.testing.assert_close(weights.double(), expected, atol=TOLERANCE[dtype], rtol=0)
    hidden = ~visible_keys(case.lq, case.lk)
    assert torch.all(weights[..., hidden] == 0), "nonzero weight above the causal boundary"


def test_rows_without_a_visible_key_are_zero_and_get_zero_gradient():
    q = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 4, dtype=torch.float64)
    weights = causal_attention.attention_weights(q, k, v)
    assert torch.all(weights[:, :3] == 0)
    torch.testing.assert_close(weights[:, 3:].sum(-1), torch.ones(2, 3, dtype=torch.float64))
    (weights * torch.randn(weights.shape, dtype=torch.float64)).sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert torch.all(q.grad[:, :3] == 0)


def test_a_row_a_float_mask_hides_whole_gets_attentions_finite_gradients():
    """A float attn_mask whose -inf hides a row's every key (full attention, window (-1, -1)):
    the row's weights are zeros, and the gradients of q, k and the mask are attention's, finite
    (issue 41, D16: they were NaN)."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 5, 3, dtype=torch.float64)
    mask = torch.randn(4, 5, dtype=torch.float64)
    mask[1] = -math.inf
    mask[2, :2] = -math.inf
    mask.requires_grad_()
    weights = causal_attention.attention_weights(q, k, v, attn_mask=mask, window=(-1, -1))
    assert torch.all(weights[..., 1, :] == 0)
    grad_out = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    got = torch.autograd.grad(weights @ v, (q, k, mask), grad_out)
    out = causal_attention.attention(q, k, v, attn_mask=mask, window=(-1, -1))
    want = torch.autograd.grad(out, (q, k, mask), grad_out)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w)


def test_gradients_match_finite_differences():
    q = torch.randn(2, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, 4, 3, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k: causal_attention.attention_weights(q, k, v, scale=0.7), (q, k)
    )


def test_weights_times_values_is_attention():
    q, k, v = Case(9, 13, 8, dv=5, hq=4, hkv=2).inputs(torch.float64)
    weights = causal_attention.attention_weights(q, k, v)
    expanded_v = v.repeat_interleave(2, dim=-3)
    torch.testing.assert_close(weights @ expanded_v, causal_attention.attention(q, k, v))


def test_bad_input_raises_typed_errors_naming_the_op():
    q, k, v = (torch.randn(2, 5, 8) for _ in range(3))
    with pytest.raises(TypeError, match=r"attention_weights: q, k and v must have the same dtype"):
        causal_attention.attention_weights(q, k.double(), v)
    with pytest.raises(ValueError, match=r"attention_weights: .*k\.shape=\[2, 5, 7\]"):
        causal_attention.attention_weights(q, torch.randn(2, 5, 7), v)
    with pytest.raises(ValueError, match="attention_weights: scale must be finite"):
        causal_attention.attention_weights(q, k, v, scale=math.inf)


def test_opcheck():
    q, k, v = Case(7, 9, 8, hq=4, hkv=2).inputs(torch.float32, requires_grad=True)
    # aot_dispatch is left out: it retraces the ATen decomposition, which torch.export covers below.
    torch.library.opcheck(
        torch.ops.causal_attention.attention_weights.default,
        (q, k, v),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


class Weights(torch.nn.Module):
    def forward(self, q, k, v):
        return causal_attention.attention_weights(q, k, v)


def test_exports_with_dynamic_lengths():
    q, k, v = Case(6, 8, 8, hq=4, hkv=2).inputs(torch.float32)
    len_q, len_k = torch.export.Dim("len_q", max=64), torch.export.Dim("len_k", max=64)
    exported = torch.export.export(
        Weights(),
        (q, k, v),
        dynamic_shapes=({2: len_q}, {2: len_k}, {2: len_k}),
    )
    for case in (Case(6, 8, 8, hq=4, hkv=2), Case(11, 5, 8, hq=4, hkv=2)):
        q, k, v = case.inputs(torch.float32)
        torch.testing.assert_close(
            exported.module()(q, k, v), causal_attention.attention_weights(q, k, v)
        )
