"""What one call costs beyond its arithmetic: tiny and small shapes, where the op layer (the
Python wrapper's checks, the dispatcher, the structs, autograd's saved state) is most of the
time. Ours through the Python wrapper and through torch.ops, against SDPA in the same run;
medians of interleaved rounds of torch.utils.benchmark (benchmarks/timing.py), 1 thread.

    python -m benchmarks.call_overhead
    python -m benchmarks.call_overhead --library-from ../other-checkout   # another build, A/B

--library-from imports causal_attention from another checkout (its built package), so that two
versions of the library are timed by the same script on the same machine.
"""

import argparse
import sys
from pathlib import Path

SHAPES = ((1, 1, 4, 8), (1, 8, 128, 64))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library-from", type=Path, default=None,
                        help="a checkout whose built causal_attention package to time")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    return parser.parse_args(argv)


def calls(torch, ca, shape):
    """{label: a call} for one shape: forward, and forward + backward, ours and SDPA's."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(*shape)
    qg = q.clone().requires_grad_()
    return {
        "fwd ours": lambda: ca.attention(q, q, q),
        "fwd ours torch.ops": lambda: torch.ops.causal_attention.attention(q, q, q),
        "fwd sdpa": lambda: sdpa(q, q, q, is_causal=True),
        "f+b ours": lambda: ca.attention(qg, qg, qg).sum().backward(),
        "f+b sdpa": lambda: sdpa(qg, qg, qg, is_causal=True).sum().backward(),
    }


def main(argv=None):
    args = parse_args(argv)
    if args.library_from is not None:
        sys.path.insert(0, str(args.library_from.resolve()))
    import torch

    import causal_attention as ca

    from .timing import interleaved_median, timer

    print(f"causal_attention from {Path(ca.__file__).parent}, torch {torch.__version__}, 1 thread")
    print("shape            | call               | median us | x sdpa time")
    for shape in SHAPES:
        medians = interleaved_median({label: timer(fn, 1) for label, fn in
                                      calls(torch, ca, shape).items()},
                                     args.rounds, args.min_run_time)
        for label, seconds in medians.items():
            sdpa = medians[label.split()[0] + " sdpa"]
            print(f"{str(shape):<16} | {label:<18} | {seconds * 1e6:>9.1f} | "
                  f"{seconds / sdpa:>11.2f}")


if __name__ == "__main__":
    main()
