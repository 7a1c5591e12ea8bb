"""bfloat16 and float16: one algorithm on every CPU, and its accuracy.

The block products of bfloat16/float16 are native (oneDNN's bf16/f16 dot products) where this
process has them and widened to float32 elsewhere (csrc/ops/cpu/block_gemm.h); what is rounded
is the same either way. ``CAUSAL_ATTENTION_REDUCED_PRODUCTS=widened`` forces the widened
products, so a chip with native ones runs both here, and on such a chip CI runs the
reduced-precision suite again on the widened products (scripts/test.sh, under an
``ONEDNN_MAX_CPU_ISA`` cap).
"""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import causal_attention
from attention_testing.inputs import make_tensor
from attention_testing.references import to64
from attention_testing.results import forward_and_grads

REDUCED = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="f16")]
PACKAGE_PARENT = Path(causal_attention.__file__).resolve().parents[1]
RESULT_NAMES = ("out", "dq", "dk", "dv")


def _products(dtype) -> str:
    return torch.ops.causal_attention.block_products(dtype)


def _sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _errors_against_float64(q, k, v, grad_out):
    """Largest error of ours and of SDPA in the inputs' dtype against SDPA in float64, and half a
    unit in the last place of the result's largest magnitude, for out, dq, dk and dv."""
    inputs = (q, k, v)
    ref = forward_and_grads(_sdpa_causal, tuple(map(to64, inputs)), to64(grad_out))
    sdpa = forward_and_grads(_sdpa_causal, inputs, grad_out)
    ours = forward_and_grads(causal_attention.attention, inputs, grad_out)
    half_ulp = torch.finfo(q.dtype).eps / 2
    return {
        name: (
            (o.double() - r).abs().max().item(),
            (s.double() - r).abs().max().item(),
            half_ulp * r.abs().max().item(),
        )
        for name, o, s, r in zip(RESULT_NAMES, ours, sdpa, ref)
    }


@pytest.mark.parametrize("dtype", REDUCED)
@pytest.mark.parametrize(
    "window, one_key_rows",
    [
        pytest.param((0, 0), slice(None), id="every-row-one-key"),
        pytest.param((-1, 0), slice(0, 1), id="causal-row-0"),
    ],
)
def test_a_row_that_sees_one_key_gets_zero_dq(dtype, window, one_key_rows):
    """Its softmax is 1 whatever its score, so dq is exactly 0: delta is summed from the very P and
    dP that dS = P (dP - delta) reads (rowsum(dO o O) over the rounded O leaves its error)."""
    torch.manual_seed(0)
    q, k, v = (make_tensor((2, 3, 100, 64), dtype) for _ in range(3))
    grad_out = make_tensor((2, 3, 100, 64), dtype)
    _, dq, dk, dv = forward_and_grads(
        lambda a, b, c: causal_attention.attention(a, b, c, window=window), (q, k, v), grad_out
    )
    rows = dq[..., one_key_rows, :]
    assert torch.count_nonzero(rows) == 0, f"{_products(dtype)} products: dq = {rows.abs().max()}"
    assert torch.count_nonzero(dv) > 0
    if window == (0, 0):
        # No key gets a gradient through the softmax either: dS = 0 everywhere.
        assert torch.count_nonzero(dk) == 0, f"dk = {dk.abs().max()}"
    else:
        assert torch.count_nonzero(dq) > 0 and torch.count_nonzero(dk) > 0


@pytest.mark.parametrize("dtype", REDUCED)
@pytest.mark.parametrize(
    "shape, mean",
    [
        pytest.param((1, 4, 256, 64), 3.0, id="values-and-grad-out-of-mean-3"),
        pytest.param((1, 8, 1024, 64), 0.0, id="grid-L1024-D64"),
    ],
)
def test_at_most_sdpa_error(dtype, shape, mean):
    """Out, dq, dk, dv no farther from float64 than SDPA's own kernel in the same dtype, but for
    half a unit in the last place: both round each result once, and where the errors tie (out,
    whose error is mostly that rounding) the last rounding of a value a float32 sum-order away
    can tip either way. With values of mean 3, dP - delta cancels: SDPA's delta over the rounded
    O then errs by 2^-9 |dO||O| in bfloat16, ours by float32's rounding."""
    torch.manual_seed(1)
    q, k = make_tensor(shape, dtype), make_tensor(shape, dtype)
    v = (torch.randn(shape) + mean).to(dtype)
    grad_out = (torch.randn(shape) + mean).to(dtype)
    errors = _errors_against_float64(q, k, v, grad_out)
    worse = {n: e for n, e in errors.items() if e[0] > e[1] + e[2]}
    assert not worse, f"{_products(dtype)} products, (ours, sdpa, half ulp): {errors}"


@pytest.mark.parametrize("onednn", [True, False], ids=["default-products", "widened"])
def test_bfloat16_probabilities_keep_float32_grade(onednn):
    """bfloat16's O += P V takes P as (hi, lo) bfloat16 pairs (csrc/ops/cpu/kernels/operands.h:
    16 of P's 24 bits; natively one bfloat16 product, widened hi + lo in float32). Values of mean
    3 make the output's last rounding tip wherever P errs by bfloat16's 2^-9: SDPA's kernel, which
    rounds P to bfloat16, misses the correctly rounded float64 result in about 2 % of the elements;
    ours, with P at float32 grade, in almost none."""
    torch.manual_seed(0)
    shape = (1, 4, 1024, 64)
    q, k = (torch.randn(shape).bfloat16() for _ in range(2))
    v = (torch.randn(shape) + 3).bfloat16()
    rounded_exact = _sdpa_causal(*map(to64, (q, k, v))).bfloat16()
    enabled = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = onednn
        products = _products(torch.bfloat16)
        ours = causal_attention.attention(q, k, v)
    finally:
        torch.backends.mkldnn.enabled = enabled
    missed = (ours != rounded_exact).double().mean().item()
    missed_by_rounded_p = (_sdpa_causal(q, k, v) != rounded_exact).double().mean().item()
    assert missed_by_rounded_p > 0.01, "the measure no longer tells bfloat16 P apart"
    assert missed < 0.001, f"{products} products: {missed:.2%} missed"


def _gradients_from_rounded_factors(q, k, v, grad_out):
    """dq, dk, dv of causal attention in float64 but for P and dS, rounded to q's dtype before
    the products that take them (what a kernel that rounds them, and errs in nothing else,
    computes), then rounded to q's dtype."""
    q64, k64, v64, g64 = map(to64, (q, k, v, grad_out))
    scale, length = q.shape[-1] ** -0.5, q.shape[-2]
    hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
    p = (q64 @ k64.transpose(-1, -2) * scale).masked_fill(hidden, float("-inf")).softmax(-1)
    dp = g64 @ v64.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    p, ds = (x.to(q.dtype).double() for x in (p, ds))
    grads = (ds @ k64 * scale, ds.transpose(-1, -2) @ q64 * scale, p.transpose(-1, -2) @ g64)
    return [g.to(q.dtype) for g in grads]


@pytest.mark.parametrize("onednn", [True, False], ids=["default-products", "widened"])
def test_bfloat16_gradients_keep_float32_grade(onednn):
    """The backward's dV += P^T dO, dK += dS^T Q and dQ += dS K take P and dS as (hi, lo) bfloat16
    pairs (as the forward's P V). With values and output gradients of mean 3, rounding P and dS
    to bfloat16 alone makes about 42 % of dq, 32 % of dk and 2.5 % of dv miss the correctly
    rounded float64 gradients (checked here on a float64 emulation of it); ours, with
    float32-grade P and dS, well under 1 %."""
    torch.manual_seed(0)
    shape = (1, 4, 1024, 64)
    q, k = (torch.randn(shape).bfloat16() for _ in range(2))
    v, grad_out = ((torch.randn(shape) + 3).bfloat16() for _ in range(2))
    inputs = (q, k, v)
    rounded_exact = [
        g.bfloat16()
        for g in forward_and_grads(_sdpa_causal, tuple(map(to64, inputs)), to64(grad_out))[1:]
    ]
    enabled = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = onednn
        products = _products(torch.bfloat16)
        ours = forward_and_grads(causal_attention.attention, inputs, grad_out)[1:]
    finally:
        torch.backends.mkldnn.enabled = enabled
    rounded_factors = _gradients_from_rounded_factors(q, k, v, grad_out)
    for name, got, rounded, want, most in zip(
        RESULT_NAMES[1:], ours, rounded_factors, rounded_exact, (0.01, 0.01, 0.001)
    ):
        missed = (got != want).double().mean().item()
        missed_if_rounded = (rounded != want).double().mean().item()
        assert missed_if_rounded > 10 * most, f"{name}: the measure no longer tells rounding apart"
        assert missed < most, f"{products} products, {name}: {missed:.3%} missed"


SCRIPT = """
import sys
import torch
import causal_attention

torch.manual_seed(0)
results = {"products": {}}
for dtype in (torch.bfloat16, torch.float16):
    results["products"][str(dtype)] = torch.ops.causal_attention.block_products(dtype)
    for name, (lq, lk, d, dv, hq, hkv, kwargs) in {
        "causal": (200, 200, 64, 64, 4, 2, {}),
        "cache-window-softcap": (150, 300, 48, 32, 2, 1, {"window": (64, 0), "softcap": 30.0}),
        "decode": (3, 700, 64, 64, 4, 4, {}),
    }.items():
        q = torch.randn(2, hq, lq, d).to(dtype).requires_grad_()
        k = torch.randn(2, hkv, lk, d).to(dtype).requires_grad_()
        v = torch.randn(2, hkv, lk, dv).to(dtype).requires_grad_()
        out = causal_attention.attention(q, k, v, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        results[f"{dtype}-{name}"] = (out.detach(),) + grads
# bfloat16 decode rows against 8-bit pages (GQA 4:1), whose scores the AVX-512 BF16 chips take
# as bfloat16 dot products where the products are native
for cache_dtype in (torch.int8, torch.float8_e4m3fn):
    stored = torch.randint(-100, 101, (2, 48, 16, 2, 64), dtype=torch.int8).to(cache_dtype)
    table = torch.arange(48, dtype=torch.int32).view(2, 24)
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    out = causal_attention.paged_attention(
        q, stored[0], stored[1], table, torch.tensor([380, 301], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1,
        k_scale=0.01, v_scale=0.02)
    results[f"torch.bfloat16-paged-{cache_dtype}"] = (out,)
torch.save(results, sys.argv[1])
"""


def _run_in_fresh_process(tmp_path, name, env_overrides):
    out_file = tmp_path / f"{name}.pt"
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), **env_overrides)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out_file)],
        env=env,
        cwd=PACKAGE_PARENT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_file)


def test_widened_products_compute_what_native_ones_do(tmp_path):
    """The same inputs under the default products and under the widened ones: equal up to the
    order of float32 sums, i.e. within a unit or two of the output dtype's last place. Where the
    default is widened too (a chip without bf16/fp16 units) they must be bitwise equal."""
    default = _run_in_fresh_process(tmp_path, "default", {})
    widened = _run_in_fresh_process(
        tmp_path, "widened", {"CAUSAL_ATTENTION_REDUCED_PRODUCTS": "widened"}
    )
    assert set(widened["products"].values()) == {"widened"}, widened["products"]
    for key, results in default.items():
        if key == "products":
            continue
        dtype = results[0].dtype
        native = default["products"][str(dtype)] == "native"
        for name, got, want in zip(RESULT_NAMES, results, widened[key]):
            if not native:
                assert torch.equal(got, want), f"{key} {name}: widened twice, yet not bitwise equal"
                continue
            ulp = torch.finfo(dtype).eps * want.abs().max().item()
            diff = (got.double() - want.double()).abs().max().item()
            assert diff <= 4 * ulp, f"{key} {name}: native and widened differ by {diff}"


def test_the_switch_rejects_an_unknown_value():
    script = (
        "import torch, causal_attention\n"
        "q = torch.randn(1, 1, 40, 8, dtype=torch.bfloat16)\n"
        "try:\n"
        "    causal_attention.attention(q, q, q)\n"
        "except ValueError as e:\n"
        "    print('VALUE_ERROR', e)\n"
    )
    env = dict(
        os.environ, PYTHONPATH=str(PACKAGE_PARENT), CAUSAL_ATTENTION_REDUCED_PRODUCTS="fast"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VALUE_ERROR" in proc.stdout and "CAUSAL_ATTENTION_REDUCED_PRODUCTS" in proc.stdout
    assert '"fast"' in proc.stdout


def test_products_follow_the_onednn_flag():
    enabled = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = False
        assert _products(torch.bfloat16) == "widened"
        assert _products(torch.float16) == "widened"
    finally:
        torch.backends.mkldnn.enabled = enabled


@pytest.mark.parametrize("dtype", REDUCED)
def test_flipping_onednn_in_another_thread_changes_no_result(dtype):
    """A call reads torch.backends.mkldnn once; a product whose native call libtorch then refuses
    (the flag flipped meanwhile) is widened. Every call gives the results of an undisturbed one,
    up to the order of float32 sums."""
    torch.manual_seed(0)
    q, k, v = (make_tensor((2, 4, 300, 64), dtype) for _ in range(3))
    grad_out = make_tensor((2, 4, 300, 64), dtype)
    want = forward_and_grads(causal_attention.attention, (q, k, v), grad_out)
    stop = threading.Event()
    enabled = torch.backends.mkldnn.enabled

    def flip():
        while not stop.is_set():
            torch.backends.mkldnn.enabled = not torch.backends.mkldnn.enabled

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for _ in range(10):
            got = forward_and_grads(causal_attention.attention, (q, k, v), grad_out)
            for name, g, w in zip(RESULT_NAMES, got, want):
                ulp = torch.finfo(dtype).eps * w.abs().max().item()
                diff = (g.double() - w.double()).abs().max().item()
                assert diff <= 4 * ulp, f"{name}: {diff} from the undisturbed call"
    finally:
        stop.set()
        flipper.join()
        torch.backends.mkldnn.enabled = enabled
