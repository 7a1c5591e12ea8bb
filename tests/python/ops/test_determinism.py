"""Bitwise reproducibility across thread counts and repeated calls (with and without a key mask,
on packed sequences, with every score option and dropout), and proof that two threads really
share the work."""

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

import causal_attention
from attention_testing.inputs import Case, ScoreOptions, make_key_mask, make_tensor
from attention_testing.packed import Packed
from attention_testing.parameters import DTYPE_IDS
from attention_testing.results import assert_bitwise_equal, forward_and_grads
from attention_testing.subprocesses import run_python

# The subprocesses import the package this process imported (this checkout's, or the sanitized
# copy scripts/sanitize.sh puts first on the path), not whatever an installed copy points to.
PACKAGE_FILE = Path(causal_attention.__file__).resolve()
PACKAGE_ROOT = PACKAGE_FILE.parents[1]

# Many query/key blocks (64 rows each) per head, or many key splits, so the work is split into
# many tasks.
CASES = [
    pytest.param(Case(700, 700, 64, hq=2, hkv=2), id="H2-L700-D64"),
    pytest.param(Case(500, 700, 64, dv=32, hq=4, hkv=1), id="gqa4-Lq500-Lk700-Dv32"),
    # Forward tasks of several query blocks (Lq >= 1024), with the keys split (few tiles).
    pytest.param(Case(1100, 1500, 32, hq=2, hkv=1), id="tiles-split-gqa2-Lq1100-Lk1500"),
    # Decoding: one task per KV head and 1024-key split, merged in split order.
    pytest.param(Case(16, 3000, 64, hq=4, hkv=2), id="decode-gqa2-Lq16-Lk3000"),
]
# The one-pass backward (float32 and float64 with batch * heads_kv >= 8): one task per (batch,
# KV head), which adds every query block's dS K_j into its rows of dq in place.
ONE_PASS_CASES = [
    pytest.param(Case(300, 300, 64, hq=8, hkv=8), id="one-pass-H8-L300-D64"),
    pytest.param(Case(300, 300, 64, hq=16, hkv=8), id="one-pass-gqa2-Hq16-Hkv8-L300-D64"),
    pytest.param(
        Case(300, 300, 64, dv=32, hq=8, hkv=4, batch=(2,)), id="one-pass-B2-gqa2-Hkv4-L300-Dv32"
    ),
    pytest.param(Case(200, 333, 64, hq=8, hkv=8), id="one-pass-kv-cache-H8-Lq200-Lk333"),
]


def _case_dtype_params():
    """(case, dtype) pairs: CASES in float32 and bfloat16 (bfloat16 takes the two-pass
    backward), ONE_PASS_CASES in the dtypes of the one-pass backward."""
    pairs = [(case, dtype) for case in CASES for dtype in (torch.float32, torch.bfloat16)]
    pairs += [(case, dtype) for case in ONE_PASS_CASES for dtype in (torch.float32, torch.float64)]
    return [
        pytest.param(case.values[0], dtype, id=f"{case.id}-{DTYPE_IDS[dtype]}")
        for case, dtype in pairs
    ]


CASE_DTYPE_PARAMS = _case_dtype_params()


def _on_threads(threads, function, inputs, grad_out, *args, **kwargs):
    """(out, dq, dk, dv) of ``function`` on ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    return forward_and_grads(function, inputs, grad_out, *args, **kwargs)


def _inputs(case, dtype):
    return case.inputs(dtype, requires_grad=True), make_tensor(case.out_shape, dtype)


@pytest.mark.parametrize("case,dtype", CASE_DTYPE_PARAMS)
def test_bitwise_equal_for_one_and_two_threads(case, dtype, restore_num_threads):
    inputs, grad_out = _inputs(case, dtype)
    one = _on_threads(1, causal_attention.attention, inputs, grad_out)
    two = _on_threads(2, causal_attention.attention, inputs, grad_out)
    assert_bitwise_equal(one, two)


@pytest.mark.parametrize("case,dtype", CASE_DTYPE_PARAMS)
def test_bitwise_equal_across_repeated_calls(case, dtype, restore_num_threads):
    inputs, grad_out = _inputs(case, dtype)
    first = _on_threads(2, causal_attention.attention, inputs, grad_out)
    for _ in range(2):
        assert_bitwise_equal(first, _on_threads(2, causal_attention.attention, inputs, grad_out))


# --- key masks and packed sequences ---------------------------------------------------------

# (case, mask kind, dtype): holes and hidden blocks over many blocks, the tiled forward with
# padding, decoding with key splits, and the one-pass backward (float32 / float64).
KEY_MASK_CASES = [
    pytest.param(Case(700, 700, 64, hq=2, hkv=2), "holes", torch.float32, id="L700-holes-f32"),
    pytest.param(
        Case(1100, 1500, 32, hq=2, hkv=1, batch=(2,)), "left-pad", torch.bfloat16, id="tiles-bf16"
    ),
    pytest.param(
        Case(16, 3000, 64, hq=4, hkv=2, batch=(2,)), "holes", torch.float32, id="decode-split"
    ),
    pytest.param(
        Case(300, 300, 64, hq=8, hkv=4, batch=(2,)), "one-all-false", torch.float64, id="one-pass"
    ),
]
# (packed, dtype): ragged lengths scheduled by cost, a chunk against a long cache, decoding rows
# of many sequences, and many heads (one-pass in float32 / float64).
VARLEN_CASES = [
    pytest.param(
        Packed((700, 5, 0, 300, 64), (700, 5, 9, 300, 64), 64, hq=2, hkv=1),
        torch.float32,
        id="ragged-f32",
    ),
    pytest.param(
        Packed((1100, 40), (1500, 40), 32, hq=2, hkv=2), torch.bfloat16, id="tiles-cache-bf16"
    ),
    pytest.param(
        Packed((16,) * 4, (2000, 300, 1100, 16), 64, hq=4, hkv=2), torch.float32, id="decode"
    ),
    pytest.param(Packed((300, 200), (300, 260), 64, hq=8, hkv=8), torch.float64, id="H8-f64"),
]


@pytest.mark.parametrize("case,kind,dtype", KEY_MASK_CASES)
def test_key_mask_bitwise_equal_for_one_and_two_threads(case, kind, dtype, restore_num_threads):
    inputs, grad_out = _inputs(case, dtype)
    key_mask = make_key_mask(case.key_mask_shape, kind)
    attention = causal_attention.attention
    one = _on_threads(1, attention, inputs, grad_out, key_mask=key_mask)
    two = _on_threads(2, attention, inputs, grad_out, key_mask=key_mask)
    assert_bitwise_equal(one, two)
    assert_bitwise_equal(two, _on_threads(2, attention, inputs, grad_out, key_mask=key_mask))


@pytest.mark.parametrize("packed,dtype", VARLEN_CASES)
def test_varlen_bitwise_equal_for_one_and_two_threads(packed, dtype, restore_num_threads):
    inputs = packed.inputs(dtype, requires_grad=True)
    grad_out = make_tensor(packed.out_shape, dtype)
    lengths = packed.lengths_args()
    varlen = causal_attention.varlen_attention
    one = _on_threads(1, varlen, inputs, grad_out, *lengths)
    two = _on_threads(2, varlen, inputs, grad_out, *lengths)
    assert_bitwise_equal(one, two)
    assert_bitwise_equal(two, _on_threads(2, varlen, inputs, grad_out, *lengths))


# --- every score option ----------------------------------------------------------------------

# (case, dtype, options): many blocks with a window that skips some and cuts others, the tiled
# forward with key splits, decoding with key splits, the one-pass backward; with softcap, ALiBi,
# sinks (whose gradient sums over every row) and dropout (a generator seeded afresh per call).
EVERY_OPTION = ScoreOptions(window=(200, 30), softcap=4.0, alibi="batch", sinks="q")
OPTION_CASES = [
    pytest.param(Case(700, 700, 64, hq=2, hkv=2), torch.float32, EVERY_OPTION, id="L700-f32"),
    pytest.param(
        Case(1100, 1500, 32, hq=2, hkv=1),
        torch.bfloat16,
        ScoreOptions(window=(-1, 40), softcap=4.0, alibi="heads", sinks="float32"),
        id="tiles-split-bf16",
    ),
    pytest.param(
        Case(16, 3000, 64, hq=4, hkv=2, batch=(2,)),
        torch.float32,
        ScoreOptions(window=(1500, 0), alibi="batch", sinks="q", key_mask="holes"),
        id="decode-split-key-mask",
    ),
    pytest.param(
        Case(300, 300, 64, hq=8, hkv=4, batch=(2,)), torch.float64, EVERY_OPTION, id="one-pass-f64"
    ),
]


def _with_dropout(q, k, v, **kwargs):
    generator = torch.Generator().manual_seed(2024)
    return causal_attention.attention(q, k, v, dropout_p=0.2, generator=generator, **kwargs)


@pytest.mark.parametrize("case,dtype,options", OPTION_CASES)
def test_every_option_bitwise_equal_for_one_and_two_threads(
    case, dtype, options, restore_num_threads
):
    inputs, grad_out = _inputs(case, dtype)
    kwargs = options.for_case(case, dtype)
    one = _on_threads(1, _with_dropout, inputs, grad_out, **kwargs)
    two = _on_threads(2, _with_dropout, inputs, grad_out, **kwargs)
    assert len(one) == 5  # dsinks too
    assert_bitwise_equal(one, two)
    assert_bitwise_equal(two, _on_threads(2, _with_dropout, inputs, grad_out, **kwargs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_varlen_every_option_bitwise_equal_for_one_and_two_threads(dtype, restore_num_threads):
    packed = Packed((700, 5, 0, 300, 16), (700, 5, 9, 300, 1100), 64, hq=8, hkv=4)
    inputs = packed.inputs(dtype, requires_grad=True)
    grad_out = make_tensor(packed.out_shape, dtype)
    lengths = packed.lengths_args()
    kwargs = ScoreOptions(window=(100, 10), softcap=4.0, alibi="heads", sinks="q").kwargs(
        dtype, packed.hq
    )

    def varlen(q, k, v, **kw):
        generator = torch.Generator().manual_seed(7)
        return causal_attention.varlen_attention(
            q, k, v, *lengths, dropout_p=0.2, generator=generator, **kw
        )

    one = _on_threads(1, varlen, inputs, grad_out, **kwargs)
    two = _on_threads(2, varlen, inputs, grad_out, **kwargs)
    assert_bitwise_equal(one, two)


# --- two threads share the work -------------------------------------------------------------

# One shape per backward schedule: batch * heads_kv >= 8 runs the one-pass backward, B = H = 1
# the two passes. Each also runs the (block) forward.
SHARING_CASES = {
    "one-pass-B1-H8-L1024-D64": dict(batch=1, heads=8, length=1024, d=64),
    "two-pass-B1-H1-L2048-D64": dict(batch=1, heads=1, length=2048, d=64),
}
# The busiest thread must accumulate this much CPU time in each phase (forward, backward): the
# workload is sized from a measurement, not from a guess of the machine's speed. MAX_REPS only
# bounds the loop; a call here takes milliseconds even on a fast chip.
TARGET_CPU_S = 0.3
MAX_REPS = 2000
# A thread "shares the work" with at least this fraction of the busiest thread's CPU time.
SHARE = 0.25

# Runs in a fresh interpreter under OMP_WAIT_POLICY=PASSIVE: by default OpenMP's idle workers
# spin after each parallel region (libgomp: ~2 ms a region here, more on chips with a slower
# `pause`), and that spinning would count as CPU time of a thread that did no work. Passive
# workers sleep, so a thread's CPU time is the work it did. Per-thread CPU time comes from
# /proc/self/task/<tid>/schedstat (nanoseconds on the CPU), or, where the kernel lacks
# schedstat, from utime + stime in .../stat (clock ticks).
SHARING_SCRIPT = textwrap.dedent(
    """
    import json
    import os

    import torch
    import causal_attention

    CASES = json.loads(CASES_JSON)  # prepended by the test
    TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")

    def thread_cpu_ns(tid):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                return int(f.read().split()[0]), "schedstat"
        except FileNotFoundError:
            if not os.path.exists(f"/proc/self/task/{tid}"):
                raise  # the thread exited meanwhile
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
        # Fields after "pid (comm)" start at field 3 (state); utime, stime are fields 14, 15.
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) * TICK_NS, "ticks"

    sources = set()

    def cpu_ns_per_thread():
        times = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                times[tid], source = thread_cpu_ns(tid)
            except FileNotFoundError:
                continue
            sources.add(source)
        return times

    def add_gains(total, before, after):
        for tid, t in after.items():
            total[tid] = total.get(tid, 0) + t - before.get(tid, 0)

    torch.manual_seed(0)
    torch.set_num_threads(2)
    results = {}
    for name, c in CASES.items():
        shape = (c["batch"], c["heads"], c["length"], c["d"])
        q, k, v, grad_out = (torch.randn(shape) for _ in range(4))
        scale = c["d"] ** -0.5
        # The two ops autograd runs, each repeated until its busiest thread reaches the target.
        forward = torch.ops.causal_attention.attention_forward
        backward = torch.ops.causal_attention.attention_backward
        out, lse = forward(q, k, v, scale)
        calls = {
            "forward": lambda: forward(q, k, v, scale),
            "backward": lambda: backward(grad_out, q, k, v, out, lse, scale),
        }
        gains, reps = {}, {}
        for phase, call in calls.items():
            call()  # warm-up
            gains[phase], reps[phase] = {}, 0
            while reps[phase] < CASES_MAX_REPS and (
                max(gains[phase].values(), default=0) < CASES_TARGET_NS
            ):
                before = cpu_ns_per_thread()
                call()
                add_gains(gains[phase], before, cpu_ns_per_thread())
                reps[phase] += 1
        results[name] = {
            phase: {"reps": reps[phase], "ns": sorted(g.values(), reverse=True)}
            for phase, g in gains.items()
        }
    print("RESULT=" + json.dumps({
        "cases": results,
        "sources": sorted(sources),
        "library": causal_attention.__file__,
        "threads": torch.get_num_threads(),
    }))
    """
)


def _two_threads_available():
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except AttributeError:  # no sched_getaffinity on this platform
        return (os.cpu_count() or 1) >= 2


@pytest.fixture(scope="module")
def cpu_time_per_thread():
    """{"cases": {name: {phase: {"reps": calls, "ns": [CPU ns per thread, busiest first]}}},
    ...}: one fresh interpreter measures every shape of SHARING_CASES."""
    header = (
        f"CASES_JSON = {json.dumps(SHARING_CASES)!r}\n"
        f"CASES_TARGET_NS = {TARGET_CPU_S * 1e9!r}\n"
        f"CASES_MAX_REPS = {MAX_REPS!r}\n"
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_WAIT_POLICY", "PASSIVE")
        result = run_python(header + SHARING_SCRIPT, PACKAGE_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT=")]
    assert len(lines) == 1, result.stdout
    measured = json.loads(lines[0].split("=", 1)[1])
    assert Path(measured["library"]).resolve() == PACKAGE_FILE, measured["library"]
    assert measured["threads"] == 2
    return measured


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
@pytest.mark.skipif(not _two_threads_available(), reason="needs two cores")
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("case", list(SHARING_CASES))
def test_two_threads_share_the_work(cpu_time_per_thread, case, phase):
    measured = cpu_time_per_thread["cases"][case][phase]
    gains = measured["ns"]
    ms = [round(g / 1e6, 1) for g in gains]
    summary = (
        f"{phase} CPU ms per thread over {measured['reps']} calls: {ms} "
        f"(from {cpu_time_per_thread['sources']})"
    )
    print(f"\n{case}: {summary}")
    assert gains and gains[0] >= TARGET_CPU_S * 1e9, f"did not reach {TARGET_CPU_S} s: {summary}"
    sharing = [g for g in gains if g >= SHARE * gains[0]]
    assert len(sharing) >= 2, f"one thread did the work: {summary}"
