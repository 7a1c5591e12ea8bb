"""The shape of the benchmarks made of sections of cases (ragged, options): each case yields its
name, the callables to time (by label) and its ratios (name: (numerator label, denominator
label)); run_sections times every case's callables in interleaved rounds, prints a line a case
and writes the rows with the machine they ran on."""

import itertools
import json

import torch

from .cases import DTYPES
from .limits import cpu_environment
from .timing import interleaved_median, timer


def step(attend, tensors, pass_name):
    """A callable running one forward (and backward) of attend(*tensors), which returns a
    tensor or a list of them."""
    if pass_name == "fwd":
        return lambda: attend(*tensors)
    leaves = [t for t in tensors if t.requires_grad]

    def forward_backward():
        outs = attend(*tensors)
        outs = outs if isinstance(outs, list) else [outs]
        torch.autograd.grad(outs, leaves, [torch.ones_like(out) for out in outs])

    return forward_backward


def leaf(*shape, dtype):
    return torch.randn(*shape, dtype=dtype).requires_grad_()



def parse_section_args(parser, argv):
    """Parses a sections benchmark's command line; rounds and run time default to one short
    round with --quick, else three of 0.5 s."""
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rounds, min_run_time = (1, 0.05) if args.quick else (3, 0.5)
    args.rounds = args.rounds or rounds
    args.min_run_time = args.min_run_time or min_run_time
    return args


def run_sections(args, cases):
    """Runs cases[section](args, dtype, pass_name) for every section in args.only, dtype in
    args.dtypes and pass in args.passes, and writes the rows to args.out (JSON)."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    rows = []
    for section, dtype_name, pass_name in itertools.product(args.only, args.dtypes, args.passes):
        for case, fns, ratios in cases[section](args, DTYPES[dtype_name], pass_name):
            seconds = interleaved_median({label: timer(fn, args.threads)
                                          for label, fn in fns.items()},
                                         args.rounds, args.min_run_time)
            row = {"section": section, "dtype": dtype_name, "pass": pass_name, "case": case,
                   **{f"{label}_s": value for label, value in seconds.items()},
                   **{name: seconds[num] / seconds[den] for name, (num, den) in ratios.items()}}
            rows.append(row)
            shown = {name: round(row[name], 3) for name in ratios}
            print(f"{section:8} {dtype_name:9} {pass_name:4} {case:44} {shown}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = cpu_environment()
    machine = {"cpu": env["cpu_model"], "threads": args.threads, "torch": env["torch"],
               "capability": env["torch_cpu_capability"]}
    args.out.write_text(json.dumps({"machine": machine, "args": vars(args) | {"out": str(args.out)},
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return rows
