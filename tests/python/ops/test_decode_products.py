"""The decode's products for bfloat16 query rows against bfloat16 and float8 cache rows
(csrc/ops/cpu/decode_products.h): AVX-512 BF16's dot products of pairs where the CPU has them
and they pay (AMD's cores), float32 multiply-adds on widened rows elsewhere (Intel's cores run a
vdpbf16ps at a quarter of a multiply-add's rate), and CAUSAL_ATTENTION_PAIR_DOTS ("auto", "on",
"off") to make a chip take either: scripts/test.sh runs the decode's suites once more under the
setting its chip does not choose, so that each chip with the instructions tests both paths. Each
setting is read once per process, so each case here runs in a fresh interpreter."""

import textwrap
from pathlib import Path

import torch

import causal_attention
from attention_testing.kernel_builds import cpu_vendor_and_flags
from attention_testing.subprocesses import saved_results

PACKAGE_PARENT = Path(causal_attention.__file__).resolve().parents[1]
TESTS_PYTHON = Path(__file__).resolve().parents[1]

VENDOR, FLAGS = cpu_vendor_and_flags()
HAS_PAIR_DOTS = {"avx512_bf16", "avx512vbmi"} <= FLAGS
# Where a bfloat16 decode may take them at all: the AVX-512 kernel build, native bfloat16
# products (what ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA or CAUSAL_ATTENTION_REDUCED_PRODUCTS
# leave this process).
PAIRS_POSSIBLE = (HAS_PAIR_DOTS and torch.backends.cpu.get_cpu_capability() == "AVX512"
                  and torch.ops.causal_attention.block_products(torch.bfloat16) == "native")

# An e4m3 decode of bfloat16 rows (4 query heads a KV head, value width 128: the pair values'
# case, and the pair scores' at D 128), saved with the choice decode_products reports, or the
# ValueError's text.
DECODE = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, TESTS_PYTHON)
    from attention_testing.quantized import decode_one_page_each
    try:
        choice = torch.ops.causal_attention.decode_products()
        g = torch.Generator().manual_seed(0)
        lengths = [300, 77]
        q = torch.randn(2, 8, 128, generator=g).to(torch.bfloat16)
        keys = (torch.randn(2, 300, 2, 128, generator=g) * 8).to(torch.float8_e4m3fn)
        values = (torch.randn(2, 300, 2, 128, generator=g) * 8).to(torch.float8_e4m3fn)
        k_scale = torch.rand(2, 300, 2, generator=g) * 0.01 + 0.001
        v_scale = torch.rand(2, 300, 2, generator=g) * 0.01 + 0.001
        out = decode_one_page_each(q, keys, values, k_scale, v_scale, lengths)
        torch.save({"choice": choice, "out": out}, RESULTS_PATH)
    except ValueError as error:
        torch.save({"choice": str(error), "out": None}, RESULTS_PATH)
    """).replace("TESTS_PYTHON", repr(str(TESTS_PYTHON)))


def decode_under(setting, tmp_path, monkeypatch):
    """(the choice decode_products reports or the ValueError's text, the decode's output or
    None) in a fresh interpreter under CAUSAL_ATTENTION_PAIR_DOTS=``setting``."""
    monkeypatch.setenv("CAUSAL_ATTENTION_PAIR_DOTS", setting)
    results = saved_results(DECODE, tmp_path / f"{setting}.pt", PACKAGE_PARENT)
    return results["choice"], results["out"]


def test_auto_takes_the_pair_dots_on_amd_cores_only(tmp_path, monkeypatch):
    """The default: pairs where the chip has the instructions and is AMD's (a Zen 4 or 5), float32
    on Intel's cores (a Xeon with AMX) and on chips without them."""
    choice, _ = decode_under("auto", tmp_path, monkeypatch)
    want = "pairs" if PAIRS_POSSIBLE and VENDOR == "AuthenticAMD" else "float32"
    assert choice == want, (VENDOR, choice)


def test_off_and_on_choose_and_agree(tmp_path, monkeypatch):
    """"off" takes float32 everywhere; "on" the pair dots wherever they can run (a ValueError
    naming the variable on a CPU without them). Each decode is within 2^-7 of the largest output
    of the float64 one (the pair values' bfloat16 weights, 2^-8 of each, and the bfloat16
    output's rounding: test_float8_pair_values.py), so the two within 2^-6 of it; where "on"
    cannot take the pairs, it computes what "off" does, bit for bit."""
    off_choice, off = decode_under("off", tmp_path, monkeypatch)
    assert off_choice == "float32"
    on_choice, on = decode_under("on", tmp_path, monkeypatch)
    if not HAS_PAIR_DOTS:
        assert "CAUSAL_ATTENTION_PAIR_DOTS=on" in on_choice and on is None, on_choice
        return
    assert on_choice == ("pairs" if PAIRS_POSSIBLE else "float32")
    peak = off.double().abs().max().item()
    assert (on.double() - off.double()).abs().max().item() <= 2.0**-6 * peak
    if on_choice == "float32":
        assert torch.equal(on, off)


def test_an_unknown_setting_is_refused(tmp_path, monkeypatch):
    message, out = decode_under("fast", tmp_path, monkeypatch)
    assert out is None
    assert "CAUSAL_ATTENTION_PAIR_DOTS" in message and '"fast"' in message, message
