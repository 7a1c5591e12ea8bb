"""The per-step CSV log of training.train, and loss-curve plots of one or more logs."""

import csv
import itertools
from pathlib import Path
from typing import Dict, List

FIELDS = ["step", "loss", "lr", "tokens_per_s", "elapsed_s"]


class CsvLog:
    """Appends one row per step to ``path``. Opened for a run resumed at ``start_step``, it first
    drops the rows after that step (written after the checkpoint by the interrupted run), so the
    log reads as one uninterrupted run."""

    def __init__(self, path: Path, start_step: int):
        kept = [row for row in read_log(path) if row["step"] <= start_step] if start_step else []
        self.elapsed_s = kept[-1]["elapsed_s"] if kept else 0.0  # training time so far
        self._file = open(path, "w", newline="")
        self._writer = csv.DictWriter(self._file, FIELDS)
        self._writer.writeheader()
        for row in kept:
            self.write(**row)

    def write(self, **row) -> None:
        # repr() writes the shortest string that reads back as the same float: losses compare
        # exactly across runs.
        self._writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_log(path: Path) -> List[Dict[str, float]]:
    """The rows of a log, numbers parsed (``step`` as int)."""
    if not Path(path).exists():
        return []
    with open(path, newline="") as f:
        return [
            {k: int(v) if k == "step" else float(v) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def plot_losses(curves: Dict[str, List[Dict[str, float]]], path: Path, title: str) -> None:
    """One loss-vs-step line per labelled log, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    # Curves that agree lie on top of each other: distinct dashes keep each one visible.
    for (label, rows), style in zip(curves.items(), itertools.cycle(["-", "--", ":", "-."])):
        steps, losses = [r["step"] for r in rows], [r["loss"] for r in rows]
        ax.plot(steps, losses, style, label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
