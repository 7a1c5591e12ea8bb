"""Compares training runs of training.train (their --out directories): how closely the loss
curves agree step by step, the final losses, the speed of each, and one plot with every curve.
Run by scripts/run.sh on the causal_attention and sdpa runs.

    python -m training.compare_runs runs/causal_attention runs/sdpa --plot runs/loss_curves.png
"""

import argparse
import statistics
from pathlib import Path

from .training_log import plot_losses, read_log

# Steps left out of the speed figures: the first ones pay for warm-up (allocations, compilation).
WARMUP_STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m training.compare_runs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("runs", type=Path, nargs="+", help="--out directories of training.train")
    parser.add_argument("--plot", type=Path, help="write every loss curve into this PNG")
    args = parser.parse_args()
    logs = {run.name: read_log(run / "log.csv") for run in args.runs}
    for name, rows in logs.items():
        if not rows:
            raise SystemExit(f"compare_runs: {name} has no log.csv rows")

    print(f"{'run':<20} {'steps':>5} {'first loss':>10} {'last loss':>10} {'tokens/s':>9}")
    for name, rows in logs.items():
        timed = [r["tokens_per_s"] for r in rows[WARMUP_STEPS:]] or [rows[-1]["tokens_per_s"]]
        print(
            f"{name:<20} {len(rows):>5} {rows[0]['loss']:>10.4f} {rows[-1]['loss']:>10.4f} "
            f"{statistics.median(timed):>9.0f}"
        )
    print(f"(tokens/s: median over steps after the first {WARMUP_STEPS}; noisy on a busy machine)")

    (base_name, base), *others = logs.items()
    for name, rows in others:
        steps = min(len(base), len(rows))
        rel = [abs(rows[i]["loss"] - base[i]["loss"]) / abs(base[i]["loss"]) for i in range(steps)]
        worst = max(range(steps), key=rel.__getitem__)
        exact = sum(r == 0.0 for r in rel)
        print(
            f"{name} vs {base_name}: loss relative difference max {rel[worst]:.2e} (step "
            f"{base[worst]['step']}), median {statistics.median(rel):.2e}; "
            f"{exact}/{steps} steps bitwise equal"
        )

    if args.plot:
        plot_losses(logs, args.plot, "byte-level GPT on the Python stdlib")
        print(f"loss curves: {args.plot}")


if __name__ == "__main__":
    main()
