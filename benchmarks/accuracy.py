"""The bfloat16 errors of ours and of SDPA against float64."""

import torch

from .cases import IMPL_FN, sdpa


def bf16_gradient_error(shape, value_mean=0.0):
    """Max |error| against float64 of out, dq, dk, dv for ours and SDPA in bfloat16 (the float64
    reference is SDPA on the same bfloat16-rounded inputs). value_mean shifts v and grad_out: a
    shared mean makes dP - delta cancel, which exposes how delta is formed."""
    batch, heads, length, dim = shape
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(batch, heads, length, dim, generator=generator)
                         for _ in range(4))
    v, grad_out = v + value_mean, grad_out + value_mean
    q, k, v, grad_out = (t.to(torch.bfloat16) for t in (q, k, v, grad_out))

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, grad_out.to(dtype)))

    reference = run(sdpa, torch.float64)
    errors = {}
    for impl in ("ours", "sdpa"):
        results = run(IMPL_FN[impl], torch.bfloat16)
        errors[impl] = {name: (r.double() - ref).abs().max().item()
                        for name, r, ref in zip(("out", "dq", "dk", "dv"), results, reference)}
    return {"shape": {"B": batch, "H": heads, "L": length, "D": dim}, "value_mean": value_mean,
            "max_abs_error": errors}
