"""The kernels' block shapes (csrc/ops/cpu/block_shapes.h): the rule the op block_shape reports,
the kernels taking the shape it reports, and the kernels right at the shapes other chips choose.

A chip picks its block shape from its caches and from where its block products run (longer
blocks where bfloat16 multiplies on AMX tiles), so a shape one chip never picks would go untested
there. ``CAUSAL_ATTENTION_BLOCK_SHAPE=QxK`` makes every call of a process take one shape (it is
read once, at a process's first call): each test here runs fresh interpreters under it, and the
last one runs the suites that cover the block path once more under shapes this chip may not
choose, the AMX Xeon's among them, on every chip."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import causal_attention
from attention_testing.kernel_builds import cpu_vendor_and_flags
from attention_testing.shards import SHARD_VARIABLE
from attention_testing.subprocesses import assert_first_call_refuses, saved_results

PACKAGE_PARENT = Path(causal_attention.__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parents[1]
SHAPE_VARIABLE = "CAUSAL_ATTENTION_BLOCK_SHAPE"
_, CPU_FLAGS = cpu_vendor_and_flags()


def _cache_bytes(name, fallback):
    """The cache size glibc's sysconf reports, as the library reads it (Python's os.sysconf does
    not know the cache names; getconf asks the same sysconf)."""
    reported = subprocess.run(["getconf", name], capture_output=True, text=True).stdout.strip()
    return int(reported) if reported.isdigit() and int(reported) > 0 else fallback


def _expected_shape(dtype, head_dim, value_dim, len_k, windowed):
    """The rule of block_shapes.cpp, written out, for rows that see len_k keys (with `windowed`,
    a sliding window's span): 128 x 256 where bfloat16 products are native on AMX tiles, such a
    key block's K (bfloat16) and V (float32) rows fit in a quarter of L2 and the keys are at least
    1024 (or, at head dims up to 64, more than half a block's; a window's span four blocks');
    else, where bfloat16 products are native on vector units (no AMX), 64 query rows by
    256 keys, else 128, where the keys are more than half a block's (a window's span: four
    blocks') and such a block's K (bfloat16) and V (4 bytes a value) rows fit in a quarter of
    L2; else 64 by 128 keys where 128 float32 K and V rows fit in twice L1d, or 64."""
    native = torch.ops.causal_attention.block_products(dtype) == "native"
    l1d = _cache_bytes("LEVEL1_DCACHE_SIZE", 32 * 1024)
    l2 = _cache_bytes("LEVEL2_CACHE_SIZE", 512 * 1024)
    def block_bytes(keys, key_bytes):
        return keys * (head_dim * key_bytes + value_dim * 4)

    def fit_l2(keys):
        return block_bytes(keys, 2) <= l2 // 4

    def longer_blocks_pay(keys):
        return len_k >= 4 * keys if windowed else 2 * len_k > keys

    if (dtype == torch.bfloat16 and native and "amx_bf16" in CPU_FLAGS and fit_l2(256)
            and (len_k >= 1024 or (head_dim <= 64 and longer_blocks_pay(256)))):
        return [128, 256]
    if dtype == torch.bfloat16 and native and "amx_bf16" not in CPU_FLAGS:
        for keys in (256, 128):
            if fit_l2(keys) and longer_blocks_pay(keys):
                return [64, keys]
    return [64, 128 if block_bytes(128, 4) <= 2 * l1d else 64]


@pytest.mark.skipif(os.environ.get(SHAPE_VARIABLE, "auto") not in ("", "auto"),
                    reason=f"{SHAPE_VARIABLE} forces one shape in this process")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_block_shape_follows_the_chip(dtype):
    for head_dim, value_dim in ((64, 64), (128, 128), (128, 64), (256, 256), (512, 512)):
        for len_k in (64, 65, 100, 128, 129, 511, 512, 1023, 1024, 8192):
            for windowed in (False, True):
                got = torch.ops.causal_attention.block_shape(dtype, head_dim, value_dim, len_k,
                                                             windowed)
                want = _expected_shape(dtype, head_dim, value_dim, len_k, windowed)
                assert got == want, (dtype, head_dim, value_dim, len_k, windowed)


# Computes out, dq, dk, dv of float32 and bfloat16 calls with softcap and GQA: causal of L 1100
# (several blocks of any shape), whose rows see up to 1100 >= 1024 keys (the longest blocks'
# rules), the same under a window whose rows see 701 (bfloat16's longer blocks ask a window four
# blocks' keys), and causal of L 200 (where the longer blocks ask a row more than half a block's
# keys, not four blocks'); saves them with the shape each call took, at RESULTS_PATH.
RESULTS_SCRIPT = textwrap.dedent(
    """
    import torch
    import causal_attention

    torch.manual_seed(0)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 4, 1100, 64).to(dtype).requires_grad_()
        k, v = (torch.randn(1, 2, 1100, 64).to(dtype).requires_grad_() for _ in range(2))
        grad_out = torch.randn(1, 4, 1100, 64).to(dtype)
        for length, window, keys_seen in ((1100, (-1, 0), 1100), (1100, (700, 0), 701),
                                          (200, (-1, 0), 200)):
            inputs = [t[:, :, :length] for t in (q, k, v)]
            out = causal_attention.attention(*inputs, window=window, softcap=20.0)
            grads = torch.autograd.grad(out, inputs, grad_out[:, :, :length])
            shape = torch.ops.causal_attention.block_shape(dtype, 64, 64, keys_seen,
                                                           window != (-1, 0))
            results[f"{dtype}/{length}/{window}"] = {"shape": "x".join(map(str, shape)),
                                                     "tensors": [out.detach(), *grads]}
    torch.save(results, RESULTS_PATH)
    """
)


def _results_under(shape, path, monkeypatch):
    monkeypatch.setenv(SHAPE_VARIABLE, shape)
    return saved_results(RESULTS_SCRIPT, path, PACKAGE_PARENT)


def _all_equal(a, b):
    """Whether every tensor of a is b's, element for element (none holds NaN)."""
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_kernels_take_the_shape_the_op_reports(tmp_path, monkeypatch):
    """The results of a call under the chip's own choice are bitwise those of the same call
    forced to the shape block_shape reports for the keys its rows see, and not those of another
    shape (a different key blocking sums the online softmax in another order: this is what makes
    the check bite; on a chip whose bfloat16 takes longer blocks, a kernel that chose them by the
    keys alone, not the window's span, or that asked a causal row of 200 keys four blocks' keys,
    would fail it)."""
    chosen = _results_under("auto", tmp_path / "auto.pt", monkeypatch)
    for shape in sorted({entry["shape"] for entry in chosen.values()}):
        forced = _results_under(shape, tmp_path / f"{shape}.pt", monkeypatch)
        for call, entry in chosen.items():
            if entry["shape"] == shape:
                assert forced[call]["shape"] == shape
                assert _all_equal(entry["tensors"], forced[call]["tensors"]), (call, shape)
    other = _results_under("16x48", tmp_path / "other.pt", monkeypatch)
    for call, entry in chosen.items():
        assert other[call]["shape"] == "16x48"
        assert not _all_equal(entry["tensors"], other[call]["tensors"]), call


@pytest.mark.parametrize("value", ["33x48", "64x2048"])
def test_a_bad_shape_is_a_value_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(SHAPE_VARIABLE, value)
    assert_first_call_refuses(SHAPE_VARIABLE, value, PACKAGE_PARENT)


# Suites run again under a forced shape, with the tests of each that reach the block kernels (a
# -k expression, or all): the AMX Xeon's shape (128 x 256) under those with long sequences
# (against SDPA up to 1600 keys; bfloat16/float16 within SDPA's error on the grid's L 1024, and a
# lone key's dq = 0), and one far smaller than any chip's (16 x 48: many blocks, rows and keys
# unequal, at the small sizes the option suites use) under those that reach every path of the
# block kernels: score options, packed sequences, dropout, both backward schedules, float64
# gradcheck. About 45 s in all on 2 cores.
SUITES_UNDER_SHAPE = {
    "128x256": (("test_against_sdpa.py", "test_reduced_precision.py"),
                "sdpa or one_key or sdpa_error"),
    "16x48": (("test_score_options.py", "test_varlen.py", "test_dropout.py",
               "test_backward_schedules.py", "test_gradcheck.py"), ""),
}


@pytest.mark.skipif(os.environ.get(SHAPE_VARIABLE, "auto") not in ("", "auto"),
                    reason=f"{SHAPE_VARIABLE} forces one shape in this process already")
@pytest.mark.parametrize("shape", list(SUITES_UNDER_SHAPE))
def test_block_path_suites_pass_under_other_shapes(shape, monkeypatch):
    monkeypatch.setenv(SHAPE_VARIABLE, shape)
    # The whole selection runs in the subprocess, whichever shard of a run this test is in
    # (tests/python/conftest.py).
    monkeypatch.delenv(SHARD_VARIABLE, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")])))
    suites, selection = SUITES_UNDER_SHAPE[shape]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         *(["-k", selection] if selection else []),
         *(str(TESTS / "ops" / suite) for suite in suites)],
        cwd=TESTS, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary
