"""The backward's schedules compute the same sums in the same order.

Where the row statistics come from the probabilities (bfloat16/float16, a forward that decoded,
attn_mask's gradient), a call with batch * heads_kv >= 8 takes the row-panel schedule, which
computes S and dP once a pair and keeps them for the gradients
(csrc/ops/cpu/kernels/backward_row_panels.h); a call with fewer (batch, KV head) items takes the
two steps, the statistics and then the gradients, which compute them twice. Each sums every
statistic and gradient element over the same block pairs in the same order, so running the batch
one element at a time (the two steps) gives bitwise the whole batch's results (the row panels).
"""

import pytest
import torch

import causal_attention
from attention_testing.inputs import make_tensor
from attention_testing.results import assert_bitwise_equal

BATCH = 8  # with one KV head: 8 (batch, KV head) items, the row panels


def _results(q, k, v, grad_out, kwargs, mask=None):
    """out and the gradients of q, k, v (and of the attn_mask, where given)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    call_kwargs = dict(kwargs)
    if mask is not None:
        mask = mask.detach().clone().requires_grad_()
        leaves.append(mask)
        call_kwargs["attn_mask"] = mask
    out = causal_attention.attention(*leaves[:3], **call_kwargs)
    return (out.detach(),) + torch.autograd.grad(out, leaves, grad_out)


OPTIONS = {
    "plain": {},
    "window-softcap": {"window": (40, 0), "softcap": 20.0},
    "alibi": {"alibi_slopes": torch.tensor([0.25, 0.0625])},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("lq, lk", [(150, 150), (90, 200)], ids=["square", "kvcache"])
def test_row_panels_equal_the_two_steps(dtype, options, lq, lk):
    torch.manual_seed(0)
    hq, hkv, d = 2, 1, 48
    q = make_tensor((BATCH, hq, lq, d), dtype)
    k, v = (make_tensor((BATCH, hkv, lk, d), dtype) for _ in range(2))
    grad_out = make_tensor((BATCH, hq, lq, d), dtype)
    kwargs = OPTIONS[options]
    whole = _results(q, k, v, grad_out, kwargs)
    for b in range(BATCH):
        one = _results(q[b : b + 1], k[b : b + 1], v[b : b + 1], grad_out[b : b + 1], kwargs)
        for name, got, want in zip(("out", "dq", "dk", "dv"), whole, one):
            assert_bitwise_equal(got[b : b + 1], want, f"{name} of batch element {b}")
    assert whole[1].abs().sum() > 0 and whole[2].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_row_panels_equal_the_two_steps_with_attn_mask_gradient(dtype):
    """float32 and float64 take the statistics from the probabilities where attn_mask's
    gradient is asked for: that gradient is dS itself, entry by entry."""
    torch.manual_seed(1)
    lq, lk, d = 100, 130, 32
    q = make_tensor((BATCH, 1, lq, d), dtype)
    k, v = (make_tensor((BATCH, 1, lk, d), dtype) for _ in range(2))
    grad_out = make_tensor((BATCH, 1, lq, d), dtype)
    mask = torch.randn(BATCH, 1, lq, lk, dtype=dtype)
    mask[..., :, 7] = float("-inf")  # a key no row sees
    whole = _results(q, k, v, grad_out, {}, mask)
    for b in range(BATCH):
        one = _results(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], grad_out[b : b + 1], {}, mask[b : b + 1]
        )
        for name, got, want in zip(("out", "dq", "dk", "dv", "dattn_mask"), whole, one):
            assert_bitwise_equal(got[b : b + 1], want, f"{name} of batch element {b}")
    assert whole[4].abs().sum() > 0
