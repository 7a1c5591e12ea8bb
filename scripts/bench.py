"""Benchmark of causal_attention.attention against torch's scaled_dot_product_attention (SDPA) on
the CPU.

First the block-product limit (torch.ops.causal_attention._block_gemm_gflops: the kernels'
micro-kernel on cache-resident blocks, every thread at once; the max over a few block shapes) and
the bandwidth of a large Tensor.copy_. Then, for ours, SDPA's default backend, SDPA forced to MATH
and a naive materialized attention (those two only where their L x L scores fit --mem-budget-gib):
forward and forward+backward on the grid, short sequences, decode against a KV cache; then the
1-vs-2 thread scaling of ours, the peak memory of a long forward+backward (in a subprocess) and
the bfloat16 gradient errors against float64. Times are medians of --repeats runs after a warm-up,
at --threads threads. Prints a table and a summary against the targets of the performance issue;
writes results.csv, results.json and gflops.png into --out.

    python scripts/bench.py                      # the full grid (long: hours with slow SDPA cases)
    python scripts/bench.py --quick              # seconds: every code path, tiny sizes
    python scripts/bench.py --lengths 1024 --dtypes float32 --repeats 1 --only grid,decode

FLOP convention (FlashAttention's): causal forward 2*B*H*L^2*D, forward+backward 3.5x that;
decode 4*B*H*Lq*Lk*D (every query sees the whole cache).
"""

import argparse
import csv
import ctypes
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import causal_attention
from bench_common import forward_backward, sample_seconds, sdpa

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IMPLS = ("sdpa", "ours", "sdpa_math", "naive")  # sdpa first: every other row's ratio needs it
MATERIALIZING = ("sdpa_math", "naive")  # these hold L x L scores
SECTIONS = ("grid", "short", "decode", "scaling", "memory", "accuracy")
SKIPPED = "skipped (memory)"
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclasses.dataclass
class Config:
    """Every size the run uses; FULL is the issue's grid, QUICK a seconds-long smoke run."""

    grid_lengths: tuple
    grid_dims: tuple
    grid_bh: tuple
    short_lengths: tuple
    short_bh: tuple
    short_dim: int
    decode_batches: tuple
    decode_heads: int
    decode_lq: tuple
    decode_lk: int
    decode_dim: int
    scaling_length: int
    memory_length: int
    memory_impls: tuple
    accuracy_shape: tuple  # B, H, L, D
    limit_shapes: tuple  # (m, n, k)
    limit_flops_per_thread: float
    limit_rounds: int
    copy_mib: int
    repeats: int
    min_sample_seconds: float


FULL = Config(
    grid_lengths=(1024, 2048, 4096, 8192),
    grid_dims=(64, 128),
    grid_bh=((1, 8), (4, 8)),
    short_lengths=(64, 128, 256, 512),
    short_bh=((1, 8),),
    short_dim=64,
    decode_batches=(1, 8),
    decode_heads=8,
    decode_lq=(1, 4, 16),
    decode_lk=4096,
    decode_dim=64,
    scaling_length=8192,
    memory_length=16384,
    memory_impls=("ours", "sdpa"),
    accuracy_shape=(1, 8, 1024, 64),
    limit_shapes=((64, 64, 64), (64, 64, 128), (128, 64, 128), (128, 64, 256), (256, 64, 256),
                  (256, 64, 512)),
    limit_flops_per_thread=4e9,
    limit_rounds=3,
    copy_mib=256,
    repeats=5,
    min_sample_seconds=0.05,
)

QUICK = Config(
    grid_lengths=(),
    grid_dims=(64,),
    grid_bh=((1, 8),),
    short_lengths=(64, 256),
    short_bh=((1, 8),),
    short_dim=64,
    decode_batches=(1,),
    decode_heads=8,
    decode_lq=(4,),
    decode_lk=4096,
    decode_dim=64,
    scaling_length=512,
    memory_length=1024,
    memory_impls=("ours",),
    accuracy_shape=(1, 2, 128, 64),
    limit_shapes=((64, 64, 64),),
    limit_flops_per_thread=2e8,
    limit_rounds=1,
    copy_mib=64,
    repeats=1,
    min_sample_seconds=0.0,
)

# The targets, checked in the summary (ratio = SDPA time / ours): never slower than SDPA in any
# grid cell, and float32's median ratio at least GRID_MEDIAN_RATIO_TARGET.
GRID_RATIO_TARGET = {("fwd", "float32"): 1.0, ("fwd", "bfloat16"): 1.0,
                     ("f+b", "float32"): 1.0, ("f+b", "bfloat16"): 1.0}
GRID_MEDIAN_RATIO_TARGET = {("fwd", "float32"): 1.2, ("f+b", "float32"): 1.2}
SHARE_TARGET_PCT = {("fwd", "float32"): 60.0, ("fwd", "bfloat16"): 45.0,
                    ("f+b", "float32"): 50.0, ("f+b", "bfloat16"): 40.0}
SHORT_RATIO_TARGET = {512: 1.3, 256: 1.0, 128: 1.0, 64: 1.0}
DECODE_RATIO_TARGET = {1: 1.0, 4: 1.5, 16: 1.5}
DECODE_COPY_SHARE = 0.8
SCALING_TARGET = 1.8
MEMORY_RATIO_TARGET = 1.05


# ---------------------------------------------------------------- implementations


def ours(q, k, v):
    return causal_attention.attention(q, k, v)


def sdpa_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v)


def naive(q, k, v):
    """Materialized attention as one writes it by hand: scores, mask, softmax, product."""
    lq, lk = q.size(-2), k.size(-2)
    visible = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)  # bottom-right causal
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


IMPL_FN = {"ours": ours, "sdpa": sdpa, "sdpa_math": sdpa_math, "naive": naive}


# ---------------------------------------------------------------- environment and limits


def cpu_environment():
    """lscpu's model line, the ISA flags that matter, torch's view of the CPU."""
    model = None
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((" ".join(line.split()) for line in lscpu.splitlines()
                      if line.startswith("Model name:")), None)
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if model is None and line.startswith("model name"):
                    model = "Model name: " + line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {
        "cpu_model": model or platform.processor() or "unknown",
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cores_available": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
    }


def measure_limit(config):
    """Aggregate GFLOP/s of the kernels' block product on cache-resident blocks, every thread at
    once: per dtype, the max over config.limit_shapes (best of config.limit_rounds)."""
    limit, per_shape = {}, {}
    for name in DTYPES:
        per_shape[name] = {}
        for m, n, k in config.limit_shapes:
            iterations = max(4, int(config.limit_flops_per_thread / (2 * m * n * k)))
            best = max(torch.ops.causal_attention._block_gemm_gflops(DTYPES[name], m, n, k,
                                                                     iterations)
                       for _ in range(config.limit_rounds))
            per_shape[name][f"{m}x{n}x{k}"] = best
        limit[name] = max(per_shape[name].values())
    return limit, per_shape


def measure_copy_bandwidth(config, repeats):
    """Bytes read + written per second by a large float32 Tensor.copy_ (at the run's threads)."""
    numel = config.copy_mib * 2**20 // 4
    src = torch.ones(numel)
    dst = torch.zeros(numel)
    seconds = statistics.median(sample_seconds(lambda: dst.copy_(src), max(repeats, 3)))
    return 2 * src.nbytes / seconds / 1e9


# ---------------------------------------------------------------- timed cases


@dataclasses.dataclass(frozen=True)
class Case:
    section: str  # grid, short or decode
    mode: str  # fwd, f+b
    batch: int
    heads: int
    lq: int
    lk: int
    dim: int
    dtype: str

    @property
    def label(self):
        if self.section == "decode":
            return f"decode B{self.batch} H{self.heads} Lq{self.lq} Lk{self.lk} D{self.dim}"
        return f"{self.mode} B{self.batch} H{self.heads} L{self.lq} D{self.dim}"

    @property
    def flops(self):
        if self.section == "decode":
            return 4 * self.batch * self.heads * self.lq * self.lk * self.dim
        forward = 2 * self.batch * self.heads * self.lq * self.lk * self.dim
        return forward if self.mode == "fwd" else 3.5 * forward

    @property
    def kv_bytes(self):
        itemsize = DTYPES[self.dtype].itemsize
        return 2 * self.batch * self.heads * self.lk * self.dim * itemsize

    def scores_bytes(self):
        """What a materializing implementation holds: L x L x B x H scores (float32 at least:
        MATH upcasts reduced precision on the CPU), twice forward, four times with backward."""
        copies = 2 if self.mode == "fwd" else 4
        return self.batch * self.heads * self.lq * self.lk * 4 * copies


def plan_cases(config, args):
    """The timed cases in run order; fwd and f+b of one shape are adjacent (shared inputs)."""
    dtypes = args.dtypes
    lengths = set(args.lengths) if args.lengths else None
    keep = (lambda length: lengths is None or length in lengths)
    cases = []
    if "grid" in args.only:
        for dtype in dtypes:
            for dim in config.grid_dims:
                for batch, heads in config.grid_bh:
                    for length in filter(keep, config.grid_lengths):
                        for mode in ("fwd", "f+b"):
                            cases.append(Case("grid", mode, batch, heads, length, length, dim,
                                              dtype))
    if "short" in args.only:
        for dtype in dtypes:
            for batch, heads in config.short_bh:
                for length in filter(keep, config.short_lengths):
                    for mode in ("fwd", "f+b"):
                        cases.append(Case("short", mode, batch, heads, length, length,
                                          config.short_dim, dtype))
    if "decode" in args.only:
        for dtype in dtypes:
            for batch in config.decode_batches:
                for lq in config.decode_lq:
                    cases.append(Case("decode", "fwd", batch, config.decode_heads, lq,
                                      config.decode_lk, config.decode_dim, dtype))
    return cases


def make_inputs(case):
    generator = torch.Generator().manual_seed(0)
    dtype = DTYPES[case.dtype]

    def randn(length):
        return torch.randn(case.batch, case.heads, length, case.dim, generator=generator,
                           dtype=dtype)

    return randn(case.lq), randn(case.lk), randn(case.lk), randn(case.lq)  # q, k, v, grad_out


def time_case(case, impl, inputs, repeats, min_sample_seconds):
    """Per-call seconds of one implementation on one case (forward under no_grad)."""
    q, k, v, grad_out = inputs
    fn = IMPL_FN[impl]
    if case.mode == "fwd":
        def run():
            with torch.no_grad():
                fn(q, k, v)
    else:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def run():
            forward_backward(fn, qg, kg, vg, grad_out)
    return sample_seconds(run, repeats, min_sample_seconds=min_sample_seconds)


def result_row(case, impl, samples, limit, sdpa_seconds, threads):
    row = {
        "section": case.section, "mode": case.mode, "case": case.label, "B": case.batch,
        "H": case.heads, "Lq": case.lq, "Lk": case.lk, "D": case.dim, "dtype": case.dtype,
        "impl": impl, "threads": threads, "status": "ok", "time_ms": None, "samples_ms": None,
        "ratio_vs_sdpa": None, "gflops": None, "pct_limit": None, "kv_gbps": None,
    }
    if samples is None:
        row["status"] = SKIPPED
        return row
    seconds = statistics.median(samples)
    row["time_ms"] = seconds * 1e3
    row["samples_ms"] = [s * 1e3 for s in samples]
    row["gflops"] = case.flops / seconds / 1e9
    row["pct_limit"] = 100 * row["gflops"] / limit[case.dtype]
    if sdpa_seconds is not None:
        row["ratio_vs_sdpa"] = sdpa_seconds / seconds
    if case.section == "decode":
        row["kv_gbps"] = case.kv_bytes / seconds / 1e9
    return row


TABLE_COLUMNS = (("case", 30), ("dtype", 9), ("impl", 10), ("time ms", 16), ("x sdpa", 7),
                 ("GFLOP/s", 8), ("% limit", 7), ("note", 0))


def table_header():
    cells = [f"{name:<{w}}" if i < 3 else f"{name:>{w}}" for i, (name, w) in
             enumerate(TABLE_COLUMNS[:-1])]
    line = " ".join(cells) + "  note"
    return line + "\n" + "-" * len(line)


def table_line(row, copy_gbps=None):
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    note = ""
    if row["kv_gbps"] is not None:
        note = f"K/V {row['kv_gbps']:.1f} GB/s"
        if copy_gbps:
            note += f" ({100 * row['kv_gbps'] / copy_gbps:.0f}% of copy)"
    time_cell = row["status"] if row["status"] != "ok" else num(row["time_ms"], ".2f")
    return (f"{row['case']:<30} {row['dtype']:<9} {row['impl']:<10} {time_cell:>16} "
            f"{num(row['ratio_vs_sdpa'], '.2f'):>7} {num(row['gflops'], '.1f'):>8} "
            f"{num(row['pct_limit'], '.1f'):>7}  {note}").rstrip()


def grid_table(rows):
    """The grid as the README shows it: one line per case, ours against SDPA side by side."""
    by_case = {}
    for r in rows:
        if r["section"] == "grid" and r["status"] == "ok":
            key = (r["dtype"], r["mode"], r["B"], r["H"], r["D"], r["Lq"])
            by_case.setdefault(key, {})[r["impl"]] = r
    lines = ["dtype    pass  B  H     L    D |   ours ms   sdpa ms x sdpa | ours GF/s % limit "
             "| sdpa %"]
    order = sorted(by_case, key=lambda k: (k[0] != "float32",) + k[1:])
    for (dtype, mode, batch, heads, dim, length) in order:
        impls = by_case[(dtype, mode, batch, heads, dim, length)]
        if "ours" not in impls or "sdpa" not in impls:
            continue
        o, s = impls["ours"], impls["sdpa"]
        lines.append(f"{dtype:<8} {mode:<4} {batch:>2} {heads:>2} {length:>5} {dim:>4} | "
                     f"{o['time_ms']:>9.2f} {s['time_ms']:>9.2f} {o['ratio_vs_sdpa']:>6.2f} | "
                     f"{o['gflops']:>9.1f} {o['pct_limit']:>7.1f} | {s['pct_limit']:>6.1f}")
    return lines


# ---------------------------------------------------------------- scaling, memory, accuracy


def measure_scaling(config, repeats, impls, progress):
    """Forward and backward (autograd.grad alone, after an untimed forward) at B=H=1, D=64,
    float32, on 1 and 2 threads; calls progress() after each thread count."""
    saved = torch.get_num_threads()
    shape = (1, 1, config.scaling_length, 64)
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(shape, generator=generator) for _ in range(4))
    results = {}
    try:
        for impl in impls:
            fn = IMPL_FN[impl]
            results[impl] = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)

                def forward():
                    with torch.no_grad():
                        fn(q, k, v)

                def setup():
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    return fn(qg, kg, vg), (qg, kg, vg)

                def backward(state):
                    out, leaves = state
                    torch.autograd.grad(out, leaves, grad_out)

                results[impl][threads] = {
                    "fwd_ms": 1e3 * statistics.median(sample_seconds(forward, repeats)),
                    "bwd_ms": 1e3 * statistics.median(sample_seconds(backward, repeats,
                                                                     setup=setup)),
                }
                progress()
            results[impl]["L"] = config.scaling_length
            for mode in ("fwd", "bwd"):
                results[impl][f"{mode}_speedup"] = (results[impl][1][f"{mode}_ms"]
                                                    / results[impl][2][f"{mode}_ms"])
    finally:
        torch.set_num_threads(saved)
    return results


def _vm_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(impl, length, threads):
    """Runs in a fresh interpreter (bench.py --memory-child): the peak RSS growth of one float32
    forward+backward at B=H=1, D=64, from before the inputs exist to the end of the backward."""
    torch.set_num_threads(threads)
    fn = IMPL_FN[impl]
    shape = (1, 1, length, 64)
    small = [torch.randn(1, 1, 256, 64, requires_grad=True) for _ in range(3)]
    forward_backward(fn, *small, torch.randn(1, 1, 256, 64))  # loads code paths, thread pool
    del small
    try:  # hands freed heap pages back, so that reusing them cannot hide growth
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:  # resets VmHWM to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        baseline_kib, peak = _vm_kib("VmRSS"), (lambda: _vm_kib("VmHWM"))
        method = "VmHWM after clear_refs"
    except OSError:
        baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        method = "ru_maxrss"
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape)
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    growth = (peak() - baseline_kib) * 1024
    needed = sum(t.nbytes for t in (q, k, v, grad_out, out, *grads))
    print("MEMORY_RESULT " + json.dumps({
        "impl": impl, "L": length, "threads": threads, "peak_growth_bytes": growth,
        "inputs_outputs_gradients_bytes": needed, "ratio": growth / needed, "method": method,
    }))


def measure_memory(impl, length, threads):
    """memory_child in a subprocess; returns its result (or the error) as a dict."""
    command = [sys.executable, str(Path(__file__).resolve()), "--memory-child", impl,
               "--memory-length", str(length), "--threads", str(threads)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("MEMORY_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    return {"impl": impl, "L": length, "error": (proc.stderr or proc.stdout).strip()[-2000:]}


def measure_bf16_gradient_error(shape):
    """Max |error| against float64 of out, dq, dk, dv for ours and SDPA in bfloat16 (the float64
    reference is SDPA on the same bfloat16-rounded inputs)."""
    batch, heads, length, dim = shape
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(batch, heads, length, dim, generator=generator,
                                     dtype=torch.bfloat16) for _ in range(4))

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
    return {"shape": {"B": batch, "H": heads, "L": length, "D": dim}, "max_abs_error": errors}


# ---------------------------------------------------------------- summary, files


def check(what, value, target, met, where=""):
    return {"what": what, "value": value, "target": target, "met": met, "where": where}


def summarize(rows, copy_gbps, scaling, memory, accuracy):
    """The issue's targets against this run's numbers: a list of checks."""
    checks = []
    ok = [r for r in rows if r["impl"] == "ours" and r["status"] == "ok"
          and r["ratio_vs_sdpa"] is not None]
    grid = [r for r in ok if r["section"] == "grid"]
    if grid:
        worst = min(grid, key=lambda r: r["ratio_vs_sdpa"])
        checks.append(check("lowest ratio vs SDPA on the grid", worst["ratio_vs_sdpa"], None,
                            None, f"{worst['case']} {worst['dtype']}"))
    for (mode, dtype), target in GRID_RATIO_TARGET.items():
        group = [r for r in grid if r["mode"] == mode and r["dtype"] == dtype]
        if group:
            worst = min(group, key=lambda r: r["ratio_vs_sdpa"])
            checks.append(check(f"grid {mode} {dtype}: lowest ratio vs SDPA",
                                worst["ratio_vs_sdpa"], target,
                                worst["ratio_vs_sdpa"] >= target, worst["case"]))
            median_target = GRID_MEDIAN_RATIO_TARGET.get((mode, dtype))
            median = statistics.median(r["ratio_vs_sdpa"] for r in group)
            checks.append(check(f"grid {mode} {dtype}: median ratio vs SDPA", median,
                                median_target,
                                None if median_target is None else median >= median_target))
    for (mode, dtype), target in SHARE_TARGET_PCT.items():
        group = [r for r in grid if r["mode"] == mode and r["dtype"] == dtype and r["Lq"] >= 2048]
        if group:
            worst = min(group, key=lambda r: r["pct_limit"])
            median = statistics.median(r["pct_limit"] for r in group)
            checks.append(check(f"% of limit at L>=2048, {mode} {dtype}: lowest (median "
                                f"{median:.1f})", worst["pct_limit"], target,
                                worst["pct_limit"] >= target, worst["case"]))
    for length, target in SHORT_RATIO_TARGET.items():
        group = [r for r in ok if r["section"] == "short" and r["Lq"] == length]
        if group:
            worst = min(group, key=lambda r: r["ratio_vs_sdpa"])
            checks.append(check(f"L={length}: lowest ratio vs SDPA", worst["ratio_vs_sdpa"],
                                target, worst["ratio_vs_sdpa"] >= target,
                                f"{worst['case']} {worst['dtype']}"))
    for r in (r for r in ok if r["section"] == "decode"):
        where = f"{r['case']} {r['dtype']}"
        sdpa_row = next((s for s in rows if s["impl"] == "sdpa" and s["case"] == r["case"]
                         and s["dtype"] == r["dtype"]), None)
        rates = f"K/V GB/s ours {r['kv_gbps']:.1f}, SDPA {sdpa_row['kv_gbps']:.1f}"
        target = DECODE_RATIO_TARGET.get(r["Lq"])
        checks.append(check(f"decode ratio vs SDPA ({rates})", r["ratio_vs_sdpa"], target,
                            None if target is None else r["ratio_vs_sdpa"] >= target, where))
        if r["Lq"] == 1:
            checks.append(check(f"decode K/V GB/s vs {DECODE_COPY_SHARE:.0%} of copy_ "
                                f"{copy_gbps:.1f} GB/s", r["kv_gbps"],
                                DECODE_COPY_SHARE * copy_gbps,
                                r["kv_gbps"] >= DECODE_COPY_SHARE * copy_gbps, where))
    for impl, result in (scaling or {}).items():
        for mode in ("fwd", "bwd"):
            key = f"{mode}_speedup"
            if key in result:
                target = SCALING_TARGET if impl == "ours" else None
                checks.append(check(f"{impl} {mode}: 2 threads vs 1", result[key], target,
                                    None if target is None else result[key] >= target,
                                    f"B=H=1 L={result.get('L')} D=64 float32"))
    for result in memory or []:
        if "ratio" in result:
            target = MEMORY_RATIO_TARGET if result["impl"] == "ours" else None
            checks.append(check(f"{result['impl']} peak RSS growth / (inputs+outputs+gradients)",
                                result["ratio"], target,
                                None if target is None else result["ratio"] <= target,
                                f"f+b B=H=1 L={result['L']} D=64 float32, "
                                f"{result['peak_growth_bytes'] / 2**20:.1f} MiB vs "
                                f"{result['inputs_outputs_gradients_bytes'] / 2**20:.1f} MiB"))
        else:
            checks.append(check(f"{result['impl']} peak RSS growth: FAILED", None, None, False,
                                result.get("error", "")[-300:]))
    if accuracy:
        errors = accuracy["max_abs_error"]
        shape = accuracy["shape"]
        for name in ("out", "dq", "dk", "dv"):
            checks.append(check(f"bf16 max|{name} - float64|: ours (SDPA "
                                f"{errors['sdpa'][name]:.3g})", errors["ours"][name],
                                None if name == "out" else errors["sdpa"][name],
                                None if name == "out" else errors["ours"][name]
                                < errors["sdpa"][name],
                                "B={B} H={H} L={L} D={D}".format(**shape)))
    return checks


def format_check(c):
    def num(value):
        return "-" if value is None else f"{value:.3g}"

    verdict = {True: "met", False: "MISSED", None: ""}[c["met"]]
    target = "" if c["target"] is None else f" (target {num(c['target'])})"
    where = f"  [{c['where']}]" if c["where"] else ""
    return f"  {c['what']}: {num(c['value'])}{target} {verdict}{where}".rstrip()


CSV_FIELDS = ("section", "mode", "case", "B", "H", "Lq", "Lk", "D", "dtype", "impl", "threads",
              "status", "time_ms", "ratio_vs_sdpa", "gflops", "pct_limit", "kv_gbps")


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_plot(path, rows, limit, dim=64, bh=(1, 8)):
    """GFLOP/s against L, one line per implementation and dtype; forward and forward+backward
    side by side; D=dim, (B, H)=bh; the block-product limit as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(IMPLS, ("tab:blue", "tab:red", "tab:green", "tab:gray")))
    styles = {"float32": "-", "bfloat16": "--"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (mode, title) in zip(axes, (("fwd", "forward"), ("f+b", "forward+backward"))):
        lengths = set()
        for impl in IMPLS:
            for dtype in DTYPES:
                points = sorted((r["Lq"], r["gflops"]) for r in rows
                                if r["section"] in ("grid", "short") and r["mode"] == mode
                                and r["impl"] == impl and r["dtype"] == dtype
                                and r["status"] == "ok" and r["D"] == dim
                                and (r["B"], r["H"]) == bh)
                if points:
                    xs, ys = zip(*points)
                    lengths.update(xs)
                    ax.plot(xs, ys, styles[dtype], color=colors[impl], marker="o",
                            label=f"{impl} {dtype}")
        for dtype, value in limit.items():
            ax.axhline(value, color="black", linestyle=styles[dtype], linewidth=0.8,
                       label=f"limit {dtype}")
        ax.set_xscale("log", base=2)
        if lengths:
            ax.set_xticks(sorted(lengths), [str(x) for x in sorted(lengths)])
        ax.set_title(f"{title}, B={bh[0]} H={bh[1]} D={dim}")
        ax.set_xlabel("L")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GFLOP/s (causal FLOPs)")
    axes[1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="seconds-long smoke run of every code path (tiny sizes, 1 repeat)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch intra-op threads (default: all available cores)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per measurement, median reported (default 5; 1 quick)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=None, help="only these L in grid/short, e.g. 1024,2048")
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES),
                        help="comma list of float32,bfloat16")
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(SECTIONS),
                        help=f"comma list of sections: {','.join(SECTIONS)}")
    parser.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS),
                        help=f"comma list of {','.join(IMPLS)} (sdpa always runs: the ratios)")
    parser.add_argument("--mem-budget-gib", type=float, default=4.0,
                        help="skip sdpa_math/naive when their L x L scores exceed this")
    parser.add_argument("--table-from", type=Path, default=None,
                        help="print the grid table of a saved results.json and exit")
    parser.add_argument("--memory-child", choices=list(IMPL_FN), help=argparse.SUPPRESS)
    parser.add_argument("--memory-length", type=int, default=FULL.memory_length,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, values, allowed in (("--dtypes", args.dtypes, DTYPES), ("--only", args.only,
                                  SECTIONS), ("--impls", args.impls, IMPLS)):
        unknown = [x for x in values if x not in allowed]
        if unknown:
            parser.error(f"{name}: unknown {unknown}; choose from {','.join(allowed)}")
    if "sdpa" not in args.impls:
        args.impls.insert(0, "sdpa")
    args.impls = [impl for impl in IMPLS if impl in args.impls]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.table_from:
        with open(args.table_from) as f:
            print("\n".join(grid_table(json.load(f)["results"])))
        return
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, args.memory_length, args.threads)
        return
    config = QUICK if args.quick else FULL
    repeats = args.repeats or config.repeats
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    env = cpu_environment()
    flags = " ".join(f"{f}={'yes' if v else 'no'}" for f, v in env["cpu_flags"].items())
    print(f"{env['cpu_model']}")
    print(f"CPU flags: {flags}; torch CPU capability {env['torch_cpu_capability']}")
    print(f"torch {env['torch']}, python {env['python']}, {env['threads']} threads "
          f"({env['cores_available']} cores available), median of {repeats} after a warm-up"
          f"{' (quick)' if args.quick else ''}")
    print("command: " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))

    cases = plan_cases(config, args)
    budget = args.mem_budget_gib * 2**30
    scaling_impls = [i for i in ("ours", "sdpa") if i in args.impls]
    memory_impls = [i for i in config.memory_impls if i in args.impls]
    total = (2 + sum(len(args.impls) for _ in cases)
             + (2 * len(scaling_impls) if "scaling" in args.only else 0)
             + (len(memory_impls) if "memory" in args.only else 0)
             + (1 if "accuracy" in args.only else 0))
    bar = tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True)

    bar.set_description("block-product limit")
    limit, limit_per_shape = measure_limit(config)
    bar.update()
    bar.set_description("copy bandwidth")
    copy_gbps = measure_copy_bandwidth(config, repeats)
    bar.update()
    tqdm.write(f"block-product limit at {args.threads} threads: "
               + ", ".join(f"{d} {v:.1f} GFLOP/s" for d, v in limit.items())
               + " (max over m x n x k = "
               + ", ".join("x".join(map(str, shape)) for shape in config.limit_shapes) + ")")
    tqdm.write(f"Tensor.copy_ of {config.copy_mib} MiB float32: {copy_gbps:.1f} GB/s "
               "(read + written)")
    tqdm.write("")

    rows = []
    if cases:
        tqdm.write(table_header())
    inputs_key, inputs = None, None
    for case in cases:
        key = (case.batch, case.heads, case.lq, case.lk, case.dim, case.dtype)
        if key != inputs_key:
            inputs_key, inputs = key, None
            inputs = make_inputs(case)
        sdpa_seconds = None
        for impl in args.impls:
            bar.set_description(f"{case.label} {case.dtype} {impl}")
            samples = None
            if impl not in MATERIALIZING or case.scores_bytes() <= budget:
                samples = time_case(case, impl, inputs, repeats, config.min_sample_seconds)
                if impl == "sdpa":
                    sdpa_seconds = statistics.median(samples)
            row = result_row(case, impl, samples, limit, sdpa_seconds, args.threads)
            rows.append(row)
            tqdm.write(table_line(row, copy_gbps))
            bar.update()
    inputs = None

    scaling = None
    if "scaling" in args.only and scaling_impls:
        bar.set_description(f"scaling L={config.scaling_length}")
        scaling = measure_scaling(config, repeats, scaling_impls, bar.update)
        tqdm.write("")
        tqdm.write(f"thread scaling, B=H=1 L={config.scaling_length} D=64 float32 "
                   "(bwd = autograd.grad after an untimed forward):")
        for impl, r in scaling.items():
            tqdm.write(f"  {impl:<5} fwd {r[1]['fwd_ms']:9.2f} ms @1 {r[2]['fwd_ms']:9.2f} ms @2"
                       f"  x{r['fwd_speedup']:.2f} | bwd {r[1]['bwd_ms']:9.2f} ms @1 "
                       f"{r[2]['bwd_ms']:9.2f} ms @2  x{r['bwd_speedup']:.2f}")

    memory = None
    if "memory" in args.only and memory_impls:
        memory = []
        tqdm.write("")
        tqdm.write(f"peak RSS growth, forward+backward B=H=1 L={config.memory_length} D=64 "
                   f"float32 (subprocess, {args.threads} threads):")
        for impl in memory_impls:
            bar.set_description(f"memory {impl} L={config.memory_length}")
            result = measure_memory(impl, config.memory_length, args.threads)
            memory.append(result)
            if "ratio" in result:
                tqdm.write(f"  {impl:<5} {result['peak_growth_bytes'] / 2**20:9.1f} MiB vs "
                           f"{result['inputs_outputs_gradients_bytes'] / 2**20:.1f} MiB of "
                           f"inputs+outputs+gradients: x{result['ratio']:.3f}")
            else:
                tqdm.write(f"  {impl:<5} FAILED: {result['error'][-500:]}")
            bar.update()

    accuracy = None
    if "accuracy" in args.only:
        bar.set_description("bf16 gradient error")
        accuracy = measure_bf16_gradient_error(config.accuracy_shape)
        bar.update()
        tqdm.write("")
        tqdm.write("bfloat16 max |error| vs float64, B={B} H={H} L={L} D={D}:".format(
            **accuracy["shape"]))
        for impl, errors in accuracy["max_abs_error"].items():
            tqdm.write(f"  {impl:<5} " + "  ".join(f"{n} {e:.3e}" for n, e in errors.items()))
    bar.close()

    if any(r["section"] == "grid" for r in rows):
        table = grid_table(rows)
        print("\n" + "\n".join(table))
        (args.out / "grid_table.txt").write_text("\n".join(table) + "\n")

    summary = summarize(rows, copy_gbps, scaling, memory, accuracy)
    print("\nsummary (ratio = SDPA time / ours; targets from the performance issue):")
    for c in summary:
        print(format_check(c))

    write_csv(args.out / "results.csv", rows)
    write_plot(args.out / "gflops.png", rows, limit)
    elapsed = time.time() - started
    report = {
        "environment": env,
        "command": sys.argv,
        "settings": {"quick": args.quick, "threads": args.threads, "repeats": repeats,
                     "min_sample_seconds": config.min_sample_seconds,
                     "mem_budget_gib": args.mem_budget_gib, "dtypes": args.dtypes,
                     "lengths": args.lengths, "sections": args.only},
        "implementations": args.impls,
        "limit_gflops": limit,
        "limit_gflops_per_shape": limit_per_shape,
        "copy_gbps": copy_gbps,
        "results": rows,
        "scaling": scaling,
        "memory": memory,
        "accuracy": accuracy,
        "summary": summary,
        "elapsed_seconds": elapsed,
    }
    with open(args.out / "results.json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\nwrote {args.out / 'results.csv'}, {args.out / 'results.json'}, "
          f"{args.out / 'gflops.png'} in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
