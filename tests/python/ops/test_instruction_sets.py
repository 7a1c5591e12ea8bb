"""Each kernel build (baseline, AVX2, AVX-512) on a correctness subset, in every run.

The op picks its kernel build from ATen's CPU capability, as ATen's own kernels do, so a machine
runs its highest build unless ``ATEN_CPU_CAPABILITY`` lowers it, and the lower builds would go
untested. Each test here runs a fresh interpreter under ``ATEN_CPU_CAPABILITY=<cap>`` (the
capability is fixed when torch loads) on forward and backward of a few shapes that reach the
kernels' main paths (several 64-row blocks, GQA, a KV cache, decode, the one-pass backward,
and the paged kernel on the same keys in pages, and on 8-bit pages of every finite bit pattern),
float64, float32 and bfloat16, against SDPA in float64. A build this machine cannot run is
skipped, saying so; it never passes. (ATen also honours a value above what the CPU has: torch's
own kernels and ours then die of SIGILL, so no build above this process's capability is asked
for.)
"""

import textwrap
from pathlib import Path

import pytest

import causal_attention
from attention_testing.kernel_builds import EVERY_BUILD, run_in_build

PACKAGE_PARENT = Path(causal_attention.__file__).resolve().parents[1]
MARKER = "INSTRUCTION_SET_SUBSET_OK"

SCRIPT = textwrap.dedent(
    """
    import os

    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    import causal_attention

    requested = os.environ["ATEN_CPU_CAPABILITY"].upper()
    selected = torch.backends.cpu.get_cpu_capability()
    assert selected == requested, f"asked for {requested}, torch selected {selected}"
    print("PACKAGE", causal_attention.__file__)

    # name, batch, Hq, Hkv, Lq, Lk, D, Dv
    CASES = [
        ("square, 4 row blocks", 1, 2, 2, 200, 200, 64, 64),
        ("GQA 4:2", 1, 4, 2, 130, 130, 64, 64),
        ("KV cache", 1, 2, 2, 40, 300, 64, 64),
        ("decode", 1, 4, 2, 3, 1500, 64, 64),
        ("B*Hkv = 8, Dv != D", 2, 4, 4, 130, 130, 64, 48),
    ]
    # Largest error over the largest reference magnitude: (output, gradients).
    TOLERANCES = {
        torch.float64: (1e-10, 1e-10),
        torch.float32: (2e-5, 5e-5),
        torch.bfloat16: (3e-2, 3e-2),
    }

    def reference(q, k, v, grad_out):
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        mask = causal_lower_right(q.shape[-2], k.shape[-2])
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out.double())]

    def ours(q, k, v, grad_out):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = causal_attention.attention(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]

    torch.manual_seed(0)
    failures = []
    for name, b, hq, hkv, lq, lk, d, dv in CASES:
        base = [torch.randn(shape) for shape in
                ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, dv), (b, hq, lq, dv))]
        for dtype, (tol_out, tol_grad) in TOLERANCES.items():
            q, k, v, grad_out = (t.to(dtype) for t in base)
            got = ours(q, k, v, grad_out)
            want = reference(q, k, v, grad_out)
            for what, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want,
                                       (tol_out, tol_grad, tol_grad, tol_grad)):
                assert g.dtype == dtype and g.shape == w.shape, (name, what, g.dtype, g.shape)
                error = ((g.double() - w).abs().max() / w.abs().max()).item()
                line = f"{requested} {name} {dtype} {what}: relative error {error:.2e}"
                line += f" (tol {tol:.0e})"
                print(line)
                if not error <= tol:
                    failures.append(line)
            # This build's paged kernel (inference): the same keys in shuffled 16-row pages.
            pages = -(-lk // 16)
            order = torch.randperm(b * pages)
            caches = []
            for t in (k, v):
                rows = F.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, pages * 16 - lk))
                cache = torch.empty(b * pages, 16, hkv, t.shape[-1], dtype=dtype)
                cache[order] = rows.reshape(b * pages, 16, hkv, t.shape[-1])
                caches.append(cache)
            paged = causal_attention.paged_attention(
                q.transpose(1, 2).contiguous(), *caches, order.view(b, pages).int(),
                torch.full((b,), lk, dtype=torch.int32)).transpose(1, 2)
            error = ((paged.double() - want[0]).abs().max() / want[0].abs().max()).item()
            line = f"{requested} {name} {dtype} paged out: relative error {error:.2e}"
            print(line + f" (tol {tol_out:.0e})")
            if not error <= tol_out:
                failures.append(line)
            if dtype != torch.float32:
                continue
            # This build's widening of 8-bit pages (every finite bit pattern, e4m3's subnormals
            # included; D = 64 and a 40-wide tail) with a scale per token, against float64 on
            # the cache torch dequantizes.
            for fmt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
                bits = torch.randint(0, 256, (b * pages, 16, hkv, d), dtype=torch.uint8)
                finite = bits.view(fmt).float().isfinite()
                bits = torch.where(finite, bits, torch.zeros_like(bits))
                stored = [bits.view(fmt), bits.flip(0).view(fmt)[..., :dv]]
                # Scaled to at most 1 a row, so that scores stay moderate.
                scales = [1 / c.float().abs().amax(-1).clamp_min(1e-30) for c in stored]
                rows = [(c.float() * s[..., None])[order.view(b, pages).long()].flatten(1, 2)
                        [:, :lk].transpose(1, 2) for c, s in zip(stored, scales)]
                mask = causal_lower_right(lq, lk)
                exact = F.scaled_dot_product_attention(
                    q.double(), rows[0].double(), rows[1].double(), attn_mask=mask,
                    enable_gqa=True)
                for width in (d, 40):
                    got = causal_attention.paged_attention(
                        q[..., :width].transpose(1, 2).contiguous(), stored[0][..., :width],
                        stored[1], order.view(b, pages).int(), torch.full((b,), lk, dtype=torch.int32),
                        k_scale=scales[0], v_scale=scales[1]).transpose(1, 2)
                    want_8bit = exact if width == d else F.scaled_dot_product_attention(
                        q[..., :width].double(), rows[0][..., :width].double(),
                        rows[1].double(), attn_mask=mask, enable_gqa=True,
                        scale=width ** -0.5)
                    error = ((got.double() - want_8bit).abs().max()
                             / want_8bit.abs().max()).item()
                    line = f"{requested} {name} {fmt} D={width} paged out: relative error {error:.2e}"
                    print(line + f" (tol {tol_out:.0e})")
                    if not error <= tol_out:
                        failures.append(line)
                # e4m3's NaN (S.1111.111, of either sign: its float16 image is finite) read
                # as NaN: the rows of sequence 0 that KV head 0 serves all see its first key.
                # One byte of its K row (D = 40: column 31 in the last whole vector the NaN
                # test reads, 39 past it) or of its V row (the last column: Dv = 48 is past a
                # whole vector too) NaN's, all the rest finite.
                if fmt != torch.float8_e4m3fn:
                    continue
                first = order.view(b, pages)[0, 0]
                group = hq // hkv
                for nan_bits, column in ((0x7F, 31), (0xFF, 39), (0x7F, None), (0xFF, None)):
                    keys = stored[0][..., :40].contiguous().view(torch.uint8)
                    values = stored[1].clone().view(torch.uint8)
                    if column is None:
                        values[first, 0, 0, dv - 1] = nan_bits
                    else:
                        keys[first, 0, 0, column] = nan_bits
                    got = causal_attention.paged_attention(
                        q[..., :40].transpose(1, 2).contiguous(), keys.view(fmt),
                        values.view(fmt), order.view(b, pages).int(),
                        torch.full((b,), lk, dtype=torch.int32),
                        k_scale=scales[0], v_scale=scales[1]).transpose(1, 2)
                    expected = torch.zeros_like(got, dtype=torch.bool)
                    if column is None:
                        expected[0, :group, :, dv - 1] = True
                    else:
                        expected[0, :group] = True
                    line = f"{requested} {name} e4m3 NaN {nan_bits:#x} in "
                    line += "V" if column is None else f"K column {column}"
                    print(line)
                    if not torch.equal(got.isnan(), expected):
                        failures.append(line + ": not NaN exactly where the row is read")
    if failures:
        raise SystemExit("FAILED:\\n" + "\\n".join(failures))
    print("INSTRUCTION_SET_SUBSET_OK", requested)
    """
)


@pytest.mark.parametrize("capability", EVERY_BUILD)
def test_kernel_build_matches_float64_sdpa(capability, monkeypatch):
    result = run_in_build(capability, SCRIPT, PACKAGE_PARENT, monkeypatch)
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert f"PACKAGE {causal_attention.__file__}" in result.stdout, report
    assert f"{MARKER} {capability.upper()}" in result.stdout, report
