"""The packing groups (csrc/ops/cpu/kernels/packed_kv.h): the forward's block path and the
backward's one-pass and row-panel schedules pack K and V for a few (batch, KV head) pairs at a
time and run their tasks while the copies are in cache. Which pairs go together changes when the
packing runs, never a sum, so a call gives bitwise the same results under any budget
(CAUSAL_ATTENTION_PACKING_BYTES, read once per process; by default half of the L3 a core
shares). Most calls of the other suites fit one group: these run calls of every kind that packs
(dense, GQA, packed sequences, a key mask, paged and 8-bit caches' prefill chunks; gradients by
the row panels (bfloat16) and the one pass (float32)) in fresh interpreters under a budget of one
byte, which cuts them into groups of as few pairs as the threads need, and under the chip's
own."""

import textwrap
from pathlib import Path

import pytest
import torch

import causal_attention
from attention_testing.subprocesses import assert_first_call_refuses, run_python, saved_results

PACKAGE_PARENT = Path(causal_attention.__file__).resolve().parents[1]
BUDGET_VARIABLE = "CAUSAL_ATTENTION_PACKING_BYTES"

# The outputs of every call at 1 and 2 threads, saved at RESULTS_PATH.
RESULTS_SCRIPT = textwrap.dedent(
    """
    import torch
    import causal_attention as ca

    def with_gradients(call, *inputs):
        inputs = [x.clone().requires_grad_() for x in inputs]
        out = call(*inputs)
        return [out.detach(), *torch.autograd.grad(out, inputs, torch.ones_like(out))]

    def calls():
        g = torch.Generator().manual_seed(0)
        def randn(*shape, dtype=torch.float32):
            return torch.randn(*shape, generator=g).to(dtype)
        bf16 = torch.bfloat16
        q, k, v = (randn(3, 4, 700, 64, dtype=bf16) for _ in range(3))
        dense = lambda q, k, v: ca.attention(q, k, v, window=(500, 0), softcap=30.0)
        yield "dense", lambda: with_gradients(dense, q, k, v)
        qg, kg, vg = randn(4, 8, 300, 32), randn(4, 2, 300, 32), randn(4, 2, 300, 48)
        slopes = torch.rand(8, generator=g)
        gqa = lambda q, k, v: ca.attention(q, k, v, alibi_slopes=slopes)
        yield "gqa", lambda: with_gradients(gqa, qg, kg, vg)
        mask = torch.rand(4, 300, generator=g) > 0.2
        yield "key_mask", lambda: with_gradients(lambda q, k, v: ca.attention(q, k, v, key_mask=mask), qg, kg, vg)
        lengths = [100, 400, 257]
        cu = torch.tensor([0] + lengths).cumsum(0).int()
        qv, kv, vv = randn(sum(lengths), 4, 64, dtype=bf16), *(randn(sum(lengths), 4, 64, dtype=bf16) for _ in range(2))
        varlen = lambda q, k, v: ca.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths))
        yield "varlen", lambda: with_gradients(varlen, qv, kv, vv)
        # prefill chunks of 100 rows against paged caches of 500 keys, pages of 16 shuffled
        pages = torch.randperm(64, generator=g).int().view(2, 32)
        seqlens = torch.tensor([500, 420], dtype=torch.int32)
        qp = randn(2, 100, 8, 64, dtype=bf16)
        kc, vc = randn(64, 16, 2, 64, dtype=bf16), randn(64, 16, 2, 64, dtype=bf16)
        yield "paged", lambda: [ca.paged_attention(qp, kc, vc, pages, seqlens)]
        k8, v8 = ((randn(64, 16, 2, 64) * 40).round().clamp(-127, 127).to(torch.int8) for _ in range(2))
        ks, vs = (torch.rand(64, 16, 2, generator=g) + 0.01 for _ in range(2))
        yield "paged_int8", lambda: [ca.paged_attention(qp, k8, v8, pages, seqlens, k_scale=ks, v_scale=vs)]

    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, call in calls():
            results[f"{name}/{threads}"] = call()
    torch.save(results, RESULTS_PATH)
    """
)


def _results_under(budget, path, monkeypatch):
    if budget is None:
        monkeypatch.delenv(BUDGET_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(BUDGET_VARIABLE, budget)
    return saved_results(RESULTS_SCRIPT, path, PACKAGE_PARENT)


def test_packing_groups_change_no_result(tmp_path, monkeypatch):
    chip = _results_under(None, tmp_path / "chip.pt", monkeypatch)
    grouped = _results_under("1", tmp_path / "grouped.pt", monkeypatch)
    assert chip.keys() == grouped.keys() and len(chip) == 12
    for name, tensors in chip.items():
        for i, tensor in enumerate(tensors):
            assert torch.equal(tensor, grouped[name][i]), (name, i)
            assert torch.equal(tensor, chip[name.split("/")[0] + "/1"][i]), (name, i)
            assert tensor.isfinite().all() and tensor.abs().sum() > 0, (name, i)


def test_grouped_calls_match_sdpa(monkeypatch):
    """A call cut into groups of one pair (as many heads as the threads need) against torch's own
    attention: a wrong pair's copies would give another head's keys."""
    monkeypatch.setenv(BUDGET_VARIABLE, "1")
    result = run_python(textwrap.dedent(
        """
        import torch
        import causal_attention as ca
        torch.manual_seed(0)
        torch.set_num_threads(2)
        for kv_heads, dtype, tolerance in ((4, torch.float32, 2e-5), (2, torch.bfloat16, 2e-2)):
            q = torch.randn(3, 4, 600, 64).to(dtype)
            k, v = (torch.randn(3, kv_heads, 600, 64).to(dtype) for _ in range(2))
            want = torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
            error = (ca.attention(q, k, v).double() - want).abs().max().item()
            assert error < tolerance, (kv_heads, dtype, error)
        print("MATCHED")
        """), PACKAGE_PARENT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MATCHED" in result.stdout


@pytest.mark.parametrize("value", ["0", "-5", "16M", "abc"])
def test_a_bad_budget_is_a_value_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(BUDGET_VARIABLE, value)
    assert_first_call_refuses(BUDGET_VARIABLE, value, PACKAGE_PARENT)
