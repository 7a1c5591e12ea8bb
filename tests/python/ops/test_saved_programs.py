"""Programs saved with an earlier library keep loading and running: a TorchScript program that
calls the kernel ops positionally, and the packed ones under the names they had before
attention_forward and attention_backward took packed sequences (varlen_attention_forward,
varlen_attention_backward), and a scripted CausalSelfAttention saved before its code became the
package causal_attention/nn/, each saved with that library (tests/fixtures/saved_programs/)."""

from pathlib import Path

import torch

import causal_attention  # noqa: F401  (loads the ops)

SAVED = Path(__file__).parents[2] / "fixtures" / "saved_programs"


def test_a_program_saved_with_the_former_kernel_ops_gives_what_it_gave_then():
    program = torch.jit.load(str(SAVED / "legacy_kernel_ops.pt"))
    expected = torch.load(SAVED / "legacy_kernel_ops_expected.pt")
    got = program(*expected["inputs"])
    assert len(got) == len(expected["outputs"])
    for index, (a, b) in enumerate(zip(got, expected["outputs"])):
        assert torch.equal(a, b), f"result {index} differs"


def test_a_module_scripted_before_the_nn_package_gives_what_it_gave_then():
    module = torch.jit.load(str(SAVED / "scripted_module.pt"))
    expected = torch.load(SAVED / "scripted_module_expected.pt")
    x = expected["x"].clone().requires_grad_()
    out = module(x)
    (grad_x,) = torch.autograd.grad(out.square().sum(), x)
    # Within float32's rounding of the kernels' own changes since (the softmax's exponential
    # replaced at stop 61 moved them by an ulp or two); a program that ran anything else (no
    # window, no softcap, another head layout) misses by far more.
    torch.testing.assert_close(out, expected["out"], rtol=0, atol=5e-7)
    torch.testing.assert_close(grad_x, expected["grad_x"], rtol=0, atol=5e-7)


def test_the_former_packed_names_are_the_merged_kernel_ops():
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 2, 4, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    ops = torch.ops.causal_attention
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    out, lse = ops.attention_forward(q, k, v, 0.5, window=[3, 0], **packed)
    former = ops.varlen_attention_forward(q, k, v, cu, cu, 5, 5, 0.5, [3, 0])
    assert torch.equal(former[0], out) and torch.equal(former[1], lse)
    grad_out = torch.randn_like(out)
    grads = ops.attention_backward(grad_out, q, k, v, out, lse, 0.5, window=[3, 0], **packed)
    former = ops.varlen_attention_backward(grad_out, q, k, v, out, lse, cu, cu, 5, 5, 0.5, [3, 0])
    assert all(torch.equal(a, b) for a, b in zip(former, grads))
