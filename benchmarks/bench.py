"""Benchmark of causal_attention.attention against torch's scaled_dot_product_attention (SDPA) on
the CPU.

First the block-product limit (the kernels' micro-kernel on cache-resident blocks, every thread at
once, from the probe library; the max over a few block shapes) and the bandwidth of a large
Tensor.copy_. Then, for ours, SDPA's default backend, SDPA forced to MATH and a naive materialized
attention (those two only where their L x L scores fit --mem-budget-gib): forward and
forward+backward on the grid, short sequences, decode against a KV cache; then the 1-vs-2 thread
scaling of ours, the peak memory of a long forward+backward (in a fresh interpreter) and the
bfloat16 gradient errors against float64. Each time is the median over --rounds rounds, each
round one torch.utils.benchmark blocked_autorange of every implementation of the case in turn, at
--threads threads. Prints a table and a summary against benchmarks/targets.json; writes
results.csv, results.json and gflops.png into --out.

    python -m benchmarks.bench                   # the full grid (long: hours with slow SDPA cases)
    python -m benchmarks.bench --quick           # seconds: every code path, tiny sizes
    python -m benchmarks.bench --lengths 1024 --dtypes float32 --rounds 1 --only grid decode
    python -m benchmarks.bench --table-from docs/benchmarks/full_grid.json

FLOP convention (FlashAttention's): causal forward 2*B*H*L^2*D, forward+backward 3.5x that;
decode 4*B*H*Lq*Lk*D (every query sees the whole cache).
"""

import json
import statistics
import sys
import time

import torch
from tqdm import tqdm

from . import report
from .accuracy import bf16_gradient_error
from .cases import IMPL_FN, MATERIALIZING, make_inputs, plan_cases, step
from .cli import parse_bench_args
from .limits import cpu_environment, measure_copy_bandwidth, measure_limit
from .memory import peak_growth
from .timing import interleaved_median, interleaved_medians, timer


def run_cases(cases, args, limit, copy_gbps, bar):
    """Times every implementation on every case, in interleaved rounds; returns the rows."""
    budget = args.mem_budget_gib * 2**30
    rows, inputs_key = [], None
    for case in cases:
        key = (case.batch, case.heads, case.lq, case.lk, case.dim, case.dtype)
        if key != inputs_key:
            inputs_key, inputs = key, make_inputs(case)
        bar.set_description(f"{case.label} {case.dtype}")
        timed = [impl for impl in args.impls
                 if impl not in MATERIALIZING or case.scores_bytes <= budget]
        timers = {impl: timer(step(case, impl, inputs), args.threads) for impl in timed}
        samples = interleaved_medians(timers, args.rounds, args.min_run_time)
        sdpa_seconds = statistics.median(samples["sdpa"])
        for impl in args.impls:
            row = report.result_row(case, impl, samples.get(impl), limit,
                                    sdpa_seconds, args.threads)
            rows.append(row)
            tqdm.write(report.table_line(row, copy_gbps))
        bar.update()
    return rows


def thread_scaling(args, impls, bar):
    """Forward and backward alone (autograd.grad on a graph built once, kept with retain_graph)
    at B=H=1, D=64, float32, on 1 and 2 threads, all four timings of an implementation
    interleaved."""
    length = args.preset.scaling_length
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 1, length, 64, generator=generator) for _ in range(4))
    results = {}
    for impl in impls:
        bar.set_description(f"scaling {impl} L={length}")
        fn = IMPL_FN[impl]
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)

        def forward():
            with torch.no_grad():
                fn(q, k, v)

        def backward():
            torch.autograd.grad(out, leaves, grad_out, retain_graph=True)

        seconds = interleaved_median(
            {(mode, threads): timer(call, threads)
             for threads in (1, 2) for mode, call in (("fwd", forward), ("bwd", backward))},
            args.rounds, args.min_run_time)
        results[impl] = {threads: {f"{mode}_ms": 1e3 * seconds[(mode, threads)]
                                   for mode in ("fwd", "bwd")} for threads in (1, 2)}
        results[impl]["L"] = length
        for mode in ("fwd", "bwd"):
            results[impl][f"{mode}_speedup"] = seconds[(mode, 1)] / seconds[(mode, 2)]
        bar.update()
    return results


def memory(args, impls, bar):
    """Peak RSS growth of one float32 forward+backward at B=H=1, D=64 per implementation."""
    length = args.preset.memory_length
    results = []
    for impl in impls:
        bar.set_description(f"memory {impl} L={length}")
        case = dict(impl=impl, hq=1, hkv=1, lq=length, lk=length, d=64, backward=True,
                    warmup=(256, 256), threads=args.threads)
        try:
            measured = peak_growth(case)
            results.append({"impl": impl, "L": length, "threads": measured["threads"],
                            "peak_growth_bytes": measured["growth"],
                            "inputs_outputs_gradients_bytes": measured["tensor_bytes"],
                            "ratio": measured["growth"] / measured["tensor_bytes"],
                            "hwm_reset": measured["hwm_reset"]})
        except (RuntimeError, OSError) as error:
            results.append({"impl": impl, "L": length, "error": str(error)[-2000:]})
        bar.update()
    return results


def print_header(env, args):
    flags = " ".join(f"{f}={'yes' if v else 'no'}" for f, v in env["cpu_flags"].items())
    print(env["cpu_model"])
    print(f"CPU flags: {flags}; torch CPU capability {env['torch_cpu_capability']}")
    products = ", ".join(f"{dtype} {kind}" for dtype, kind in env["block_products"].items())
    caps = [f"{name}={env[key]}" for name, key in (
        ("ONEDNN_MAX_CPU_ISA", "onednn_max_cpu_isa"),
        ("CAUSAL_ATTENTION_REDUCED_PRODUCTS", "reduced_products_switch")) if env[key]]
    print(f"block products of two inputs: {products}{' (' + ', '.join(caps) + ')' if caps else ''}")
    print(f"torch {env['torch']}, python {env['python']}, {args.threads} threads "
          f"({env['cores_available']} cores available), median of {args.rounds} rounds of "
          f"blocked_autorange (min_run_time {args.min_run_time} s)"
          f"{' (quick)' if args.quick else ''}")
    print("command: python -m benchmarks.bench " + " ".join(sys.argv[1:]))


def main(argv=None):
    args = parse_bench_args(__doc__, argv)
    if args.table_from:
        rows = json.loads(args.table_from.read_text())["results"]
        if args.compare_with:
            base = json.loads(args.compare_with.read_text())["results"]
            print("\n".join(report.grid_comparison(rows, base)))
        else:
            print("\n".join(report.grid_table(rows)))
        return
    preset = args.preset
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    env = cpu_environment()
    print_header(env, args)

    cases = plan_cases(preset, args.only, args.dtypes, args.lengths)
    scaling_impls = [i for i in ("ours", "sdpa") if "scaling" in args.only and i in args.impls]
    memory_impls = [i for i in preset.memory_impls if "memory" in args.only and i in args.impls]
    bar = tqdm(total=2 + len(cases) + len(scaling_impls) + len(memory_impls)
               + ("accuracy" in args.only), file=sys.stderr, unit="step", dynamic_ncols=True)

    bar.set_description("block-product limit")
    limit, limit_per_shape = measure_limit(preset)
    bar.update()
    bar.set_description("copy bandwidth")
    copy_gbps = measure_copy_bandwidth(preset, args.threads, args.rounds, args.min_run_time)
    bar.update()
    tqdm.write(f"block-product limit at {args.threads} threads: "
               + ", ".join(f"{d} {v:.1f} GFLOP/s" for d, v in limit.items())
               + " (max over m x n x k = "
               + ", ".join("x".join(map(str, shape)) for shape in preset.limit_shapes) + ")")
    tqdm.write(f"Tensor.copy_ of {preset.copy_mib} MiB float32: {copy_gbps:.1f} GB/s "
               "(read + written)\n")

    if cases:
        tqdm.write(report.table_header())
    rows = run_cases(cases, args, limit, copy_gbps, bar)

    scaling = None
    if scaling_impls:
        scaling = thread_scaling(args, scaling_impls, bar)
        tqdm.write(f"\nthread scaling, B=H=1 L={preset.scaling_length} D=64 float32 "
                   "(bwd = autograd.grad on a graph built once):")
        for impl, r in scaling.items():
            tqdm.write(f"  {impl:<5} fwd {r[1]['fwd_ms']:9.2f} ms @1 {r[2]['fwd_ms']:9.2f} ms @2"
                       f"  x{r['fwd_speedup']:.2f} | bwd {r[1]['bwd_ms']:9.2f} ms @1 "
                       f"{r[2]['bwd_ms']:9.2f} ms @2  x{r['bwd_speedup']:.2f}")

    peak = None
    if memory_impls:
        peak = memory(args, memory_impls, bar)
        tqdm.write(f"\npeak RSS growth, forward+backward B=H=1 L={preset.memory_length} D=64 "
                   f"float32 (fresh interpreter, {args.threads} threads):")
        for result in peak:
            if "ratio" in result:
                tqdm.write(f"  {result['impl']:<5} {result['peak_growth_bytes'] / 2**20:9.1f} MiB"
                           f" vs {result['inputs_outputs_gradients_bytes'] / 2**20:.1f} MiB of "
                           f"inputs+outputs+gradients: x{result['ratio']:.3f}")
            else:
                tqdm.write(f"  {result['impl']:<5} FAILED: {result['error'][-500:]}")

    accuracy = None
    if "accuracy" in args.only:
        bar.set_description("bf16 gradient error")
        accuracy = bf16_gradient_error(tuple(args.accuracy_shape or preset.accuracy_shape),
                                       args.accuracy_value_mean)
        bar.update()
        tqdm.write("\nbfloat16 max |error| vs float64, B={B} H={H} L={L} D={D}, values of mean "
                   "{mean}:".format(mean=args.accuracy_value_mean, **accuracy["shape"]))
        for impl, errors in accuracy["max_abs_error"].items():
            tqdm.write(f"  {impl:<5} " + "  ".join(f"{n} {e:.3e}" for n, e in errors.items()))
    bar.close()

    if any(r["section"] == "grid" for r in rows):
        table = report.grid_table(rows)
        print("\n" + "\n".join(table))
        (args.out / "grid_table.txt").write_text("\n".join(table) + "\n")

    summary = report.summarize(rows, copy_gbps, scaling, peak, accuracy)
    print("\nsummary (ratio = SDPA time / ours; targets from benchmarks/targets.json):")
    for c in summary:
        print(report.format_check(c))

    report.write_csv(args.out / "results.csv", rows)
    report.write_plot(args.out / "gflops.png", rows, limit)
    elapsed = time.time() - started
    results = {
        "environment": env,
        "command": ["python", "-m", "benchmarks.bench", *sys.argv[1:]],
        "settings": {"quick": args.quick, "threads": args.threads, "rounds": args.rounds,
                     "min_run_time": args.min_run_time, "mem_budget_gib": args.mem_budget_gib,
                     "dtypes": args.dtypes, "lengths": args.lengths, "sections": args.only},
        "implementations": args.impls,
        "limit_gflops": limit,
        "limit_gflops_per_shape": limit_per_shape,
        "copy_gbps": copy_gbps,
        "results": rows,
        "scaling": scaling,
        "memory": peak,
        "accuracy": accuracy,
        "summary": summary,
        "elapsed_seconds": elapsed,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {args.out / 'results.csv'}, {args.out / 'results.json'}, "
          f"{args.out / 'gflops.png'} in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
