"""Two builds of the library timed at once, one process a core, then with the cores swapped: an
A/B that a drifting shared machine cannot tilt (both builds see the same stretch of its time and
each core in turn). Each side is a single-threaded process importing causal_attention from its
own folder (a built package, e.g. a copy of another checkout's causal_attention/ beside nothing
else); each line printed is one such pair of runs, and the last three lines the medians of
each column over them and B's over A's. With --threads N > 1 each side takes N threads and every
core, and the sides run one after the other instead, alternated.

    python -m benchmarks.paired <folder A> <folder B> short           # bf16 forward, L 64-512
    python -m benchmarks.paired <folder A> <folder B> short --dim 128 # the same at D 128
    python -m benchmarks.paired <folder A> <folder B> fb               # bf16 forward+backward
    python -m benchmarks.paired <folder A> <folder B> decode e4m3_token  # 8-bit decode, B 8
    python -m benchmarks.paired <folder A> <folder B> contiguous      # bf16 decode, KV cache
    python -m benchmarks.paired <folder A> <folder B> batch --threads 2  # bf16, B 4

short: B 1, H 8, D 64 (or --dim), L 64/128/256/512, the minimum over 21 rounds of one call, in
us.
fb: B 1, H 8, (L, D) = (512, 64), (1024, 128), (256, 64), the minimum of 9 calls, in ms.
decode: a benchmarks.paged_precisions cache (float32, bfloat16, e4m3_token, ...), B 8, 32768
tokens, one query row each: in cache and from memory, the median of 15 calls, in ms.
contiguous: the bfloat16 decode from a contiguous (8, 8, 32768, 128) KV cache, 32 query heads of
one row each, from memory, the median of 15 calls, in ms.
batch: bfloat16 at B 4, H 8, whose inputs outgrow a 32 MiB L3: the forward at (L, D) = (2048,
128), (4096, 64), the median of 7 calls, then forward+backward at (2048, 128), (1024, 64), the
median of 5, in ms.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def seconds_of(call, rounds, warmup=3):
    """The seconds of `rounds` calls of `call`, each timed alone, after `warmup` untimed."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def short(dim):
    import causal_attention as ca
    import torch
    times = []
    for length in (64, 128, 256, 512):
        q, k, v = (torch.randn(1, 8, length, dim, dtype=torch.bfloat16) for _ in range(3))
        calls = max(20, 100000 // length)
        with torch.no_grad():
            for _ in range(20):
                ca.attention(q, k, v)
            rounds = []
            for _ in range(21):
                start = time.perf_counter()
                for _ in range(calls):
                    ca.attention(q, k, v)
                rounds.append((time.perf_counter() - start) / calls * 1e6)
        times.append(min(rounds))
    return times


def forward_backward_call(batch, length, dim):
    """A bfloat16 forward+backward of (batch, 8, length, dim), as a call."""
    import causal_attention as ca
    import torch
    q, k, v, grad = (torch.randn(batch, 8, length, dim, dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    return lambda: torch.autograd.grad(ca.attention(q, k, v), (q, k, v), grad)


def forward_backward():
    return [min(seconds_of(forward_backward_call(1, length, dim), rounds=9)) * 1e3
            for length, dim in ((512, 64), (1024, 128), (256, 64))]


def decode(cache):
    import torch
    from benchmarks.paged_precisions import calls_for
    calls, _ = calls_for(cache, 8, 32768, [1] * 8, torch.Generator().manual_seed(0), in_cache=True)
    times = []
    for kind in ("in_cache", "paged"):
        times.append(statistics.median(seconds_of(calls[f"{cache}/{kind}"], rounds=15)) * 1e3)
    return times


def contiguous():
    import torch

    import causal_attention as ca
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(8, 32, 1, 128, generator=generator).bfloat16()
    k, v = (torch.randn(8, 8, 32768, 128, generator=generator).bfloat16() for _ in range(2))
    return [statistics.median(seconds_of(lambda: ca.attention(q, k, v), rounds=15)) * 1e3]


def batch():
    import causal_attention as ca
    import torch
    times = []
    for length, dim in ((2048, 128), (4096, 64)):
        q, k, v = (torch.randn(4, 8, length, dim, dtype=torch.bfloat16) for _ in range(3))
        with torch.no_grad():
            times.append(statistics.median(seconds_of(lambda: ca.attention(q, k, v), rounds=7))
                         * 1e3)
    for length, dim in ((2048, 128), (1024, 64)):
        call = forward_backward_call(4, length, dim)
        times.append(statistics.median(seconds_of(call, rounds=5)) * 1e3)
    return times


def child(case, cache, threads, dim):
    import torch
    torch.set_num_threads(threads)
    cases = {"short": lambda: short(dim), "fb": forward_backward, "contiguous": contiguous,
             "batch": batch}
    times = cases.get(case, lambda: decode(cache))()
    print(" ".join(f"{t:9.2f}" for t in times))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="folder holding build A's causal_attention package")
    parser.add_argument("b", type=Path, help="folder holding build B's causal_attention package")
    parser.add_argument("case", choices=("short", "fb", "decode", "contiguous", "batch"))
    parser.add_argument("cache", nargs="?", default="e4m3_token", help="decode's cache")
    parser.add_argument("--pairs", type=int, default=2, help="pairs of runs (each swapped once)")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads a side; above 1 the sides run in turn, not at once")
    parser.add_argument("--dim", type=int, default=64, help="short's head dim")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.case, args.cache, args.threads, args.dim)
        return
    for folder in (args.a, args.b):
        # A folder without the package would import the checkout's own from PYTHONPATH's tail,
        # and time one build against itself.
        if not (folder / "causal_attention" / "__init__.py").is_file():
            raise SystemExit(f"{folder} holds no causal_attention package: give the folder that "
                             "holds one (a copy's parent), not the package itself")
    command = [sys.executable, "-m", "benchmarks.paired", str(args.a), str(args.b), args.case,
               args.cache, "--child", "--threads", str(args.threads), "--dim", str(args.dim)]
    times = {"A": [], "B": []}

    def start(folder, core):
        env = dict(os.environ, PYTHONPATH=f"{folder.resolve()}{os.pathsep}{CHECKOUT}")
        # From another folder, so that the checkout's own package is not the one imported.
        return subprocess.Popen(["taskset", "-c", str(core)] + command, env=env, cwd="/",
                                stdout=subprocess.PIPE, text=True)

    if args.threads > 1:  # every core to each side, A then B, alternated
        for _ in range(2 * args.pairs):
            a = start(args.a, f"0-{os.cpu_count() - 1}").communicate()[0].strip()
            b = start(args.b, f"0-{os.cpu_count() - 1}").communicate()[0].strip()
            print(f"A {a}   |   B {b}", flush=True)
            times["A"].append(a.split())
            times["B"].append(b.split())
    else:
        for _ in range(args.pairs):
            for core_a, core_b in ((0, 1), (1, 0)):
                a, b = start(args.a, core_a), start(args.b, core_b)
                a_out, b_out = a.communicate()[0].strip(), b.communicate()[0].strip()
                print(f"A (core {core_a}) {a_out}   |   B (core {core_b}) {b_out}", flush=True)
                times["A"].append(a_out.split())
                times["B"].append(b_out.split())
    medians = {side: [statistics.median(float(line[c]) for line in lines)
                      for c in range(len(lines[0]))] for side, lines in times.items()}
    print("median A " + " ".join(f"{t:9.2f}" for t in medians["A"]))
    print("median B " + " ".join(f"{t:9.2f}" for t in medians["B"]))
    print("B / A    " + " ".join(f"{b / a:9.3f}" for a, b in zip(medians["A"], medians["B"])))


if __name__ == "__main__":
    main()
