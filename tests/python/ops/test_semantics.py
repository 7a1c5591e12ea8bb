"""Semantics beyond numerical agreement: empty sizes, rows without keys, scale, grad modes, Meta
tensors, double backward, stride independence and TorchScript."""

import math

import pytest
import torch
import torch.nn.functional as F

import causal_attention
from attention_testing.inputs import Case, default_scale, make_tensor
from attention_testing.parameters import dtype_params
from attention_testing.references import empty_rows
from attention_testing.results import assert_bitwise_equal, forward_and_grads

OPS = torch.ops.causal_attention


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- empty sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case(5, 5, 8, hq=2, hkv=2, batch=(0,)), id="batch0"),
        pytest.param(Case(5, 5, 8, hq=4, hkv=2, batch=(3, 0)), id="batch3x0-gqa"),
        pytest.param(Case(0, 0, 8, hq=2, hkv=2), id="Lq0-Lk0"),
        pytest.param(Case(0, 4, 8, dv=3, hq=2, hkv=1), id="Lq0-Lk4-gqa-Dv3"),
        pytest.param(Case(0, 0, 8, heads=False), id="2d-L0"),
        pytest.param(Case(5, 5, 8, hq=0, hkv=0), id="H0"),
    ],
)
def test_empty_inputs_give_empty_results_shaped_like_sdpa(case):
    q, k, v = case.inputs(torch.float32, requires_grad=True)
    out = causal_attention.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=case.gqa)
    assert out.shape == ref.shape == case.out_shape
    assert out.numel() == 0
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert all(g.eq(0).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("dtype", dtype_params())
def test_no_keys_gives_zeros_and_minus_inf_lse(dtype):
    case = Case(5, 0, 8, dv=3, hq=2, hkv=1)
    q, k, v = case.inputs(dtype, requires_grad=True)
    out, lse = causal_attention.attention_forward(q, k, v, 0.5)
    assert out.shape == case.out_shape and out.dtype == dtype
    assert torch.equal(out, torch.zeros_like(out))
    assert lse.shape == case.out_shape[:-1] and lse.dtype == _lse_dtype(dtype)
    assert torch.equal(lse, torch.full_like(lse, -math.inf))
    out = causal_attention.attention(q, k, v)
    assert torch.equal(out, torch.zeros_like(out))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq, torch.zeros_like(q))
    assert dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("dtype", dtype_params())
def test_rows_without_visible_key(dtype):
    # Lq > Lk: the first Lq - Lk query rows see no key (bottom-right alignment).
    case = Case(70, 3, 8, hq=2, hkv=1)
    q, k, v = case.inputs(dtype, requires_grad=True)
    rows = empty_rows(case.lq, case.lk)
    assert rows.sum() == case.lq - case.lk
    out, lse = causal_attention.attention_forward(q, k, v, default_scale(case.d))
    assert torch.equal(out[..., rows, :], torch.zeros_like(out[..., rows, :]))
    assert torch.equal(lse[..., rows], torch.full_like(lse[..., rows], -math.inf))
    assert torch.isfinite(lse[..., ~rows]).all()
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    assert torch.equal(dq[..., rows, :], torch.zeros_like(dq[..., rows, :]))
    for t in (out, dq, dk, dv):
        assert not t.isnan().any()
    # Only the visible rows contribute to dk/dv: zeroing the grad of the empty rows changes nothing.
    masked_grad_out = grad_out.masked_fill(rows.unsqueeze(-1), 0)
    _, dk2, dv2 = torch.autograd.grad(out, (q, k, v), masked_grad_out)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


# --- scale ---------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 8, 80])
def test_default_scale_is_inverse_sqrt_head_dim(d):
    q, k, v = Case(17, 17, d, dv=5, hq=2, hkv=2).inputs(torch.float32)
    default = causal_attention.attention(q, k, v)
    explicit = causal_attention.attention(q, k, v, scale=1.0 / math.sqrt(d))
    assert torch.equal(default, explicit)
    assert not torch.equal(default, causal_attention.attention(q, k, v, scale=2.0 / math.sqrt(d)))


def test_scale_zero_averages_visible_values():
    case = Case(6, 6, 4, dv=3, hq=2, hkv=2, batch=())
    q, k, v = case.inputs(torch.float64, requires_grad=True)
    out = causal_attention.attention(q, k, v, scale=0.0)
    # Uniform weights over the visible keys: a causal running mean of v.
    counts = torch.arange(1, case.lk + 1, dtype=torch.float64).unsqueeze(-1)
    torch.testing.assert_close(out, v.detach().cumsum(-2) / counts)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))
    assert dv.abs().sum() > 0


# --- grad modes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"]
)
def test_runs_without_autograd(mode):
    q, k, v = Case(9, 9, 8, hq=2, hkv=1).inputs(torch.float32, requires_grad=True)
    expected = causal_attention.attention(q, k, v).detach()
    with mode():
        out = causal_attention.attention(q, k, v)
        out_fwd, lse = causal_attention.attention_forward(q, k, v, default_scale(8))
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, expected) and torch.equal(out_fwd, expected)
    assert lse.shape == (1, 2, 9)


def test_a_call_no_gradient_can_reach_skips_autograd_and_a_tangent_is_still_refused():
    """With grad enabled but no input requiring it, the forward runs below autograd at once (no
    Function, no saved call), which must change nothing a caller sees: the same output, bitwise,
    as a call that builds a graph, and no graph of its own. A forward-mode tangent must still
    reach the Function, which refuses it: a forward run below autograd would drop it silently."""
    q, k, v = Case(9, 9, 8, hq=2, hkv=1).inputs(torch.float32)
    expected = causal_attention.attention(*(t.clone().requires_grad_() for t in (q, k, v)))
    out = causal_attention.attention(q, k, v)
    assert not out.requires_grad and out.grad_fn is None
    assert expected.grad_fn is not None and torch.equal(out, expected.detach())
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.randn_like(q))
        with pytest.raises(RuntimeError, match="jvp"):
            causal_attention.attention(dual, k, v)


# --- Meta tensors --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtype_params())
def test_meta_tensors_give_shapes_and_dtypes(dtype):
    case = Case(7, 11, 16, dv=5, hq=6, hkv=3, batch=(2, 3))
    q, k, v = (
        torch.empty(shape, dtype=dtype, device="meta")
        for shape in (case.q_shape, case.k_shape, case.v_shape)
    )
    out = OPS.attention(q, k, v)
    assert (out.device.type, out.shape, out.dtype) == ("meta", case.out_shape, dtype)
    out, lse = OPS.attention_forward(q, k, v, 0.25)
    assert (out.device.type, out.shape, out.dtype) == ("meta", case.out_shape, dtype)
    lse_expected = ("meta", case.out_shape[:-1], _lse_dtype(dtype))
    assert (lse.device.type, lse.shape, lse.dtype) == lse_expected
    grads = OPS.attention_backward(torch.empty_like(out), q, k, v, out, lse, 0.25)
    for g, x in zip(grads, (q, k, v)):
        assert (g.device.type, g.shape, g.dtype) == ("meta", x.shape, dtype)


# --- double backward -----------------------------------------------------------------------


def test_double_backward_raises():
    q, k, v = Case(6, 6, 4, hq=2, hkv=2).inputs(torch.float64, requires_grad=True)
    out = causal_attention.attention(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out), create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((dq * dq).sum() + dk.sum() + dv.sum(), (q, k, v))


# --- stride independence -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtype_params((torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_result_does_not_depend_on_strides(layout, dtype):
    case = Case(130, 130, 64, dv=32, hq=4, hkv=2, batch=(2,), layout=layout)
    strided = case.inputs(dtype, requires_grad=True)
    contiguous = tuple(t.detach().contiguous().requires_grad_(True) for t in strided)
    assert not any(t.is_contiguous() for t in strided)
    grad_out = make_tensor(case.out_shape, dtype)
    results = [
        forward_and_grads(causal_attention.attention, inputs, grad_out)
        for inputs in (strided, contiguous)
    ]
    assert_bitwise_equal(*results)


# --- TorchScript ---------------------------------------------------------------------------


def _scripted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.ops.causal_attention.attention(q, k, v, scale=0.3) * 2.0


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_matches_eager():
    scripted = torch.jit.script(_scripted_attention)
    assert "causal_attention::attention" in str(scripted.graph)
    q, k, v = Case(9, 12, 8, hq=4, hkv=2).inputs(torch.float32, requires_grad=True)
    eager = _scripted_attention(q, k, v)
    out = scripted(q, k, v)
    assert torch.equal(out, eager)
    grad_out = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v), grad_out),
        torch.autograd.grad(eager, (q, k, v), grad_out),
    ):
        assert torch.equal(a, b)
