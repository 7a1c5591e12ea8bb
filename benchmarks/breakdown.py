"""Where one call's time goes, on whatever chip runs it.

    python -m benchmarks.breakdown                                # bfloat16 f+b, B=1 H=8 L=4096 D=128
    python -m benchmarks.breakdown --dtype float32 --pass fwd --length 2048 --dim 64
    python -m benchmarks.breakdown --quick                        # seconds: a tiny call (the tests)

Two views of the same call:

1. **The block-product limit on the kernels' own shapes.** The call's block products, counted
   per block pair from the kernels' schedule (the block shape the kernels choose on this chip,
   which the op block_shape reports: csrc/ops/cpu/block_shapes.h; the scores summed in chains of
   64: csrc/ops/cpu/kernels/schedule.h), each timed alone on cache-resident
   blocks of its shape and operand type by the probe library (benchmarks/block_gemm_probe.cpp):
   the products of two inputs (S, dP) in the input dtype ("native" or "widened" products), those
   with P or dS as the kernels take them: bfloat16 with native products as (hi, lo) pairs, one
   bfloat16 product of twice the reduction (csrc/ops/cpu/kernels/operands.h), else in float32.
   Their sum is the time the call would take if nothing but its block products ran, at their
   cache-resident rate.
2. **A sampling profile** (`perf record -e cpu-clock`, which needs no hardware counters;
   Debian's linux-perf): the samples of the call's own loop, sorted into the block products
   (oneDNN's JIT code), the softmax pass (scores, exp, the row passes of the backward), packing
   and conversion (operand packing, transposes, widening), the rest of our kernels, and the rest
   (torch, Python, the OS). Where perf is missing it says so and shows view 1 only
   (--profile-seconds 0 leaves it out).

Beside them, **what the products allow against SDPA and our float32**: SDPA's time on the same
inputs and, for a reduced dtype, our float32 call on the same values, timed in the same rounds
as the call. A call is never faster than its products at the best rate the probe finds for
their operands (over its shapes and the kernels', so whatever the block shapes): SDPA's time over
that floor bounds the speed-up over SDPA any call of these products can reach on the chip. It is
given three times: with the products' operands as the kernels take them (float32-grade P and dS,
the accuracy rule of the reduced-precision tests), with every product at the input dtype's rate
(P and dS rounded, outside that rule), and with P and dS each split into (hi, lo) pairs of the
input dtype (float32-grade: a product of twice the reduction for each float32 one, which pays
only where the input dtype multiplies more than twice as fast; what bfloat16 takes where its
products are native). Against our float32 call: its products' floor over this call's (the gain
at equal efficiency: the rest of both calls, the softmax pass above all, is the same float32
work), and its measured time over this call's floor (the gain if this call did nothing but its
products at their best rate while float32 stayed as it is).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

import causal_attention  # noqa: F401  (loads the ops, block_products among them)

from .cases import FULL, QUICK, sdpa
from .limits import block_gemm_gflops, cpu_environment
from .timing import interleaved_median, timer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The kernels' schedule (csrc/ops/cpu/kernels/schedule.h), mirrored: scores summed in chains of
# at most 64 k.
SCORE_CHAIN = 64
# (batch, KV head) items from which the backward takes one task per item (schedule.h,
# kMinOnePassItems).
ONE_PASS_ITEMS = 8

CATEGORIES = (
    ("block products (oneDNN JIT)", None),
    ("softmax pass", re.compile(
        r"exp|fold_row|probabilities_row|softmax_gradient_row|score_row|scale_and_max|"
        r"RowScoring|row_shares|softcap|finish_row|sink")),
    ("packing and conversion", re.compile(
        r"transpose|Packing|pack|convert|interleave|PackedKeyValues|widened|cvt|Vectorized<c10")),
    ("rest of our kernels", None),
    ("rest (torch, Python, OS)", None),
)


def block_shape(args, inputs):
    """(query rows, keys) of the blocks of a call with inputs of dtype `inputs` made now, as the
    kernels choose them on this chip (csrc/ops/cpu/block_shapes.h)."""
    return tuple(torch.ops.causal_attention.block_shape(inputs, args.dim, args.dim, args.length))


def kernel_factors(inputs):
    """How the kernels take P and dS in the products with them, for inputs of dtype `inputs`:
    "pairs" (bfloat16 with native products), else "float32"."""
    native = torch.ops.causal_attention.block_products(inputs) == "native"
    return "pairs" if inputs == torch.bfloat16 and native else "float32"


def block_products(args, inputs, factors=None):
    """(name, m, n, k, operand dtype, count per visible block pair, visible block pairs) of the
    products of the call with inputs of dtype `inputs`, P and dS taken as `factors` says:
    "float32", "rounded" (to the input dtype) or "pairs" ((hi, lo) pairs of the input dtype, twice
    the reduction); as the kernels take them where None."""
    d, (rows, keys) = args.dim, block_shape(args, inputs)
    pairs = visible_pairs(args, rows, keys)
    chains = -(-d // SCORE_CHAIN)
    chain = min(d, SCORE_CHAIN)
    factors = factors or kernel_factors(inputs)

    def with_factor(name, m, n, k):  # a product whose A is P or dS
        if factors == "pairs":
            return (f"{name} (pairs)", m, n, 2 * k, inputs, 1, pairs)
        return (name, m, n, k, torch.float32 if factors == "float32" else inputs, 1, pairs)

    forward = [("S = Q K^T", rows, keys, chain, inputs, chains, pairs),
               with_factor("O += P V", rows, d, keys)]
    if args.pass_ == "fwd":
        return forward
    # The backward: S and dP again (bfloat16/float16 sum the row statistics from them: with
    # batch * heads >= ONE_PASS_ITEMS in the same pass, csrc/ops/cpu/kernels/
    # backward_row_panels.h, else in a step of their own that computes them once more), then dV,
    # dK, dQ with P or dS.
    two_steps = inputs != torch.float32 and args.batch * args.heads < ONE_PASS_ITEMS
    recompute = 2 if two_steps else 1
    return forward + [
        ("S = Q K^T (backward)", rows, keys, chain, inputs, recompute * chains, pairs),
        ("dP = dO V^T (backward)", rows, keys, chain, inputs, recompute * chains, pairs),
        with_factor("dV += P^T dO", keys, d, rows),
        with_factor("dK += dS^T Q", keys, d, rows),
        with_factor("dQ += dS K", rows, d, keys),
    ]


def make_call(args, attention=causal_attention.attention, dtype=None):
    """The call the breakdown looks at, of `attention` (ours, or SDPA on the same inputs), with
    inputs of `dtype` (args.dtype's where None); the same values whatever the dtype."""
    dtype = DTYPES[args.dtype] if dtype is None else dtype
    shape = (args.batch, args.heads, args.length, args.dim)
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(shape, generator=generator).to(dtype) for _ in range(4))
    for tensor in (q, k, v):
        tensor.requires_grad_(args.pass_ == "fb")

    def call():
        if args.pass_ == "fwd":
            with torch.no_grad():
                attention(q, k, v)
        else:
            out = attention(q, k, v)
            torch.autograd.grad(out, (q, k, v), grad_out)

    return call


def visible_pairs(args, rows, keys):
    """The (query block, key block) pairs of the causal triangle the call multiplies, with blocks
    of `rows` query rows and `keys` keys."""
    q_blocks = -(-args.length // rows)
    pairs_per_head = sum(-(-min(args.length, (i + 1) * rows) // keys) for i in range(q_blocks))
    return pairs_per_head * args.batch * args.heads


def probe_rate(args):
    """rate(dtype, m, n, k): the probe's GFLOP/s for a product of that shape and operand dtype,
    the best of three, each shape probed once a run."""
    probe, rates = block_gemm_gflops(), {}

    def rate(dtype, m, n, k):
        if (dtype, m, n, k) not in rates:
            iterations = max(4, int(args.probe_flops / (2 * m * n * k)))
            rates[dtype, m, n, k] = max(probe(dtype, m, n, k, iterations) for _ in range(3))
        return rates[dtype, m, n, k]

    return rate


def products_seconds(args, products, gflops):
    """The products' time at gflops(dtype, m, n, k), each with its own operand dtype."""
    return sum(2 * m * n * k * count * pairs / (gflops(dtype, m, n, k) * 1e9)
               for _, m, n, k, dtype, count, pairs in products)


def product_limit(args, call_seconds, rate):
    """View 1: each product's probe rate and the call's products' time at those rates. Returns
    that time, {operand dtype: the best rate the probe found for it} and the block shape with
    each product's rate."""
    products = block_products(args, DTYPES[args.dtype])
    _, rows, keys, *_, pairs = products[0]  # S = Q K^T: query rows x keys of the block shape
    # The best cache-resident rate of each operand type over the benchmark's probe shapes (and
    # the kernels' own): what "% best" holds the kernels' shapes to.
    shapes = (QUICK if args.quick else FULL).limit_shapes
    # float32 too, which the floors of float32 P and dS and of our float32 call price.
    best = {dtype: max(rate(dtype, *shape) for shape in shapes)
            for dtype in {product[4] for product in products} | {torch.float32}}
    table = []
    for product in products:
        name, m, n, k, dtype, count, _ = product
        gflops = rate(dtype, m, n, k)
        best[dtype] = max(best[dtype], gflops)
        table.append((name, f"{m}x{n}x{k}", dtype, count, gflops,
                     products_seconds(args, [product], rate)))
    total = sum(row[-1] for row in table)
    print(f"\nblocks of {rows} query rows by {keys} keys, as the kernels choose them on this chip; "
          f"block products per visible pair ({pairs} pairs), each timed alone at "
          f"{args.threads} threads on cache-resident blocks (% best: of the best rate of its "
          "operands over the shapes " + ", ".join("x".join(map(str, s)) for s in shapes) + "):")
    print(f"  {'product':26s} {'m x n x k':>12s} {'operands':>9s} {'x':>3s} {'GFLOP/s':>8s} "
          f"{'% best':>6s} {'ms':>8s}")
    for name, shape, dtype, count, gflops, seconds in table:
        print(f"  {name:26s} {shape:>12s} {str(dtype).replace('torch.', ''):>9s} {count:3d} "
              f"{gflops:8.1f} {100 * gflops / best[dtype]:6.0f} {seconds * 1e3:8.2f}")
    print(f"  block products at their probe rate: {total * 1e3:.2f} ms of the call's "
          f"{call_seconds * 1e3:.2f} ms ({100 * total / call_seconds:.0f} %)")
    return total, best, {"query_rows": rows, "keys": keys,
                         "products": [{"name": name, "shape": shape, "gflops": gflops,
                                       "percent_of_best": 100 * gflops / best[dtype]}
                                      for name, shape, dtype, _, gflops, _ in table]}


def reach(args, seconds, best):
    """What the call's products allow against SDPA and our float32 (the module's docstring),
    their floors at the `best` rate of each operand dtype: {name: value}, printed."""
    inputs = DTYPES[args.dtype]

    def at_best(operand, *_):
        return best[operand]

    def floor(dtype, factors=None):
        return products_seconds(args, block_products(args, dtype, factors), at_best)

    lowest, rounded = floor(inputs), floor(inputs, "rounded")
    found = {"floor_ms": 1e3 * lowest, "rounded_floor_ms": 1e3 * rounded,
             "sdpa_over_floor": seconds["sdpa"] / lowest,
             "sdpa_over_rounded_floor": seconds["sdpa"] / rounded}
    if inputs != torch.float32:
        # P and dS each split into (hi, lo) pairs of the input dtype: float32-grade operands at
        # the input dtype's rate, with twice the reduction (the kernels' own where bfloat16
        # multiplies natively).
        split = floor(inputs, "pairs")
        found["split_floor_ms"] = 1e3 * split
        found["sdpa_over_split_floor"] = seconds["sdpa"] / split
    print(f"\nagainst SDPA on the same inputs: ours {seconds['call'] * 1e3:.2f} ms, SDPA "
          f"{seconds['sdpa'] * 1e3:.2f} ms (SDPA / ours {seconds['sdpa'] / seconds['call']:.2f}); "
          f"the products at their operands' best rate {1e3 * lowest:.2f} ms, the most any call "
          f"of them reaches: SDPA / that {found['sdpa_over_floor']:.2f}; every product at "
          f"{args.dtype}'s best rate (P and dS rounded) {1e3 * rounded:.2f} ms, SDPA / that "
          f"{found['sdpa_over_rounded_floor']:.2f}")
    if "split_floor_ms" in found:
        print(f"P and dS split into (hi, lo) pairs of {args.dtype}: "
              f"{found['split_floor_ms']:.2f} ms, SDPA / that {found['sdpa_over_split_floor']:.2f}")
    if "float32" in seconds:
        float32_floor = floor(torch.float32)
        found["float32_floor_ms"] = 1e3 * float32_floor
        found["float32_floor_over_floor"] = float32_floor / lowest
        found["float32_over_floor"] = seconds["float32"] / lowest
        print(f"against our float32 on the same values: {seconds['float32'] * 1e3:.2f} ms "
              f"(float32 / this {seconds['float32'] / seconds['call']:.2f}); its products' floor "
              f"/ this call's {found['float32_floor_over_floor']:.2f} (the gain at equal "
              f"efficiency), its time / this call's floor {found['float32_over_floor']:.2f} (the "
              "gain with nothing but products)")
    return found


PROFILED = textwrap.dedent(
    """
    import sys, time
    sys.path[:0] = [{root!r}]
    import torch
    from benchmarks.breakdown import make_call, parse_args
    args = parse_args({argv!r})
    torch.set_num_threads(args.threads)
    call = make_call(args)
    call()
    print("PROFILE_START", flush=True)
    end = time.perf_counter() + args.profile_seconds
    while time.perf_counter() < end:
        call()
    """
)


def categorize(dso, symbol):
    if dso.startswith("[JIT]"):
        return CATEGORIES[0][0]
    if "libcausal_attention" not in dso:
        return CATEGORIES[4][0]
    for name, pattern in CATEGORIES[1:3]:
        if pattern.search(symbol):
            return name
    return CATEGORIES[3][0]


def sampling_profile(args, argv):
    """View 2, or None where perf is missing or refuses, or --profile-seconds is 0."""
    if args.profile_seconds <= 0:
        return None
    perf = shutil.which("perf")
    if perf is None:
        print("\nno sampling profile: perf is not installed (Debian: apt-get install linux-perf)")
        return None
    root = str(Path(__file__).resolve().parents[1])
    script = PROFILED.format(root=root, argv=argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        record = subprocess.run(
            [perf, "record", "-e", "cpu-clock", "-F", "1999", "-o", str(data), "--",
             sys.executable, "-c", script],
            capture_output=True, text=True, timeout=args.profile_seconds + 300)
        if record.returncode != 0:
            print(f"\nno sampling profile: perf record failed: {record.stderr.strip()[-500:]}")
            return None
        report = subprocess.run(
            [perf, "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,symbol",
             "--percent-limit", "0"], capture_output=True, text=True, timeout=300)
    shares = {name: 0.0 for name, _ in CATEGORIES}
    line = re.compile(r"^\s*([\d.]+)%\s+(\S+(?: tid \d+)?)\s+\[[.k]\]\s+(.*)$")
    for text in report.stdout.splitlines():
        match = line.match(text)
        if match:
            percent, dso, symbol = float(match[1]), match[2], match[3]
            shares[categorize(dso, symbol)] += percent
    kernel_total = sum(v for k, v in shares.items() if k != CATEGORIES[4][0])
    print(f"\nsampling profile ({args.profile_seconds:.0f} s of calls, perf -e cpu-clock): "
          "share of the kernels' samples (and of all samples)")
    for name, percent in shares.items():
        of_kernels = f"{100 * percent / kernel_total:5.1f} %" if name != CATEGORIES[4][0] and \
            kernel_total else "      "
        print(f"  {name:30s} {of_kernels}   ({percent:5.1f} % of all)")
    return shares


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "fb"), default="fb",
                        help="forward, or forward and backward")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--profile-seconds", type=float, default=10.0)
    parser.add_argument("--probe-flops", type=float, default=2e9,
                        help="floating-point operations each probe of a product shape times")
    parser.add_argument("--quick", action="store_true",
                        help="seconds-long run on a tiny call (what the tests run)")
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.heads, args.length, args.dim = 2, 256, 64
        args.profile_seconds, args.probe_flops = 1.0, 2e7
    if args.length <= 32:
        # The forward decodes there (schedule.h, kMaxDecodeQueryRows): its products are register
        # tiles, not the block products counted here.
        parser.error(f"--length must be above 32 (the decode path's), got {args.length}")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = cpu_environment()
    print(env["cpu_model"])
    print("CPU flags: " + " ".join(f"{f}={'yes' if v else 'no'}"
                                   for f, v in env["cpu_flags"].items()))
    print(f"torch CPU capability {env['torch_cpu_capability']}; block products of two inputs: "
          + ", ".join(f"{k} {v}" for k, v in env["block_products"].items()))
    print(f"call: {args.dtype} {'forward' if args.pass_ == 'fwd' else 'forward+backward'}, "
          f"B={args.batch} H={args.heads} L={args.length} D={args.dim}, {args.threads} threads")
    calls = {"call": make_call(args), "sdpa": make_call(args, attention=sdpa)}
    if args.dtype != "float32":
        calls["float32"] = make_call(args, dtype=torch.float32)
    rounds = 1 if args.quick else 3
    seconds = interleaved_median({name: timer(call, args.threads) for name, call in calls.items()},
                                 rounds, 0.2 if args.quick else 1.0)
    rate = probe_rate(args)
    products, best, shape = product_limit(args, seconds["call"], rate)
    found = reach(args, seconds, best)
    shares = sampling_profile(args, argv)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "cpu_model": env["cpu_model"], "dtype": args.dtype, "pass": args.pass_,
            "batch": args.batch, "heads": args.heads, "length": args.length, "dim": args.dim,
            "threads": args.threads, "ms": {name: 1e3 * t for name, t in seconds.items()},
            "products_ms": 1e3 * products, "block_shape": shape, **found, "profile_shares": shares}, indent=1) + "\n")


if __name__ == "__main__":
    main()
