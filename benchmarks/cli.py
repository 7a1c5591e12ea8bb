"""The command lines of the benchmarks: the flags they share, and the grid benchmark's own."""

import argparse
import os
from pathlib import Path

from .cases import DTYPES, FULL, IMPLS, QUICK, SECTIONS


def common_parser(doc, out):
    """A parser with the flags every benchmark has; `out` is the default of --out."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="seconds-long smoke run of every code path (tiny sizes, short runs)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch intra-op threads (default: all available cores)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--rounds", "--repeats", type=int, default=None,
                        help="interleaved rounds of blocked_autorange per case, median reported")
    parser.add_argument("--min-run-time", type=float, default=None,
                        help="seconds one blocked_autorange spends at least")
    parser.add_argument("--out", type=Path, default=Path(out), help="where the results go")
    return parser


def parse_bench_args(doc, argv=None):
    parser = common_parser(doc, "bench_out")
    parser.add_argument("--lengths", nargs="+", type=int, default=None,
                        help="only these L in the grid and short sections")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="the sections to run")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                        help="implementations (sdpa always runs: the ratios)")
    parser.add_argument("--mem-budget-gib", type=float, default=4.0,
                        help="skip sdpa_math and naive where their L x L scores exceed this")
    parser.add_argument("--accuracy-shape", nargs=4, type=int, metavar=("B", "H", "L", "D"),
                        default=None, help="the accuracy section's shape (default: the preset's)")
    parser.add_argument("--accuracy-value-mean", type=float, default=0.0,
                        help="the mean of v and grad_out in the accuracy section")
    parser.add_argument("--table-from", type=Path, default=None,
                        help="print the grid table of a saved results.json and exit")
    parser.add_argument("--compare-with", type=Path, default=None,
                        help="with --table-from: each grid cell's ratio vs SDPA over this saved "
                        "run's, and their median, lowest and highest")
    args = parser.parse_args(argv)
    args.preset = QUICK if args.quick else FULL
    args.rounds = args.rounds or args.preset.rounds
    args.min_run_time = args.min_run_time or args.preset.min_run_time
    args.impls = [impl for impl in IMPLS if impl in args.impls or impl == "sdpa"]
    return args
