"""Shared by the tests of training.train: the module, the flags of a run small enough to
train in a second or two, and the run under torchrun."""

import os
import subprocess
import sys

from attention_testing.ranks import free_port
from nn_testing import ROOT
from training import train

# GQA (4 query heads, 2 K/V heads) like the script's defaults, at a tiny size.
TINY_RUN = "--batch-size 4 --seq-len 32 --embed-dim 32 --num-heads 4 --num-kv-heads 2".split()
TINY_RUN += "--num-layers 2 --checkpoint-every 0".split()


def tiny_args(*flags: str):
    """Parsed flags of a tiny run; later flags override TINY_RUN's."""
    return train.parse_args([*TINY_RUN, *flags])


def torchrun(processes: int, flags, out_dir):
    """`torchrun --nproc-per-node processes -m training.train --out out_dir *flags` on loopback,
    bounded at 300 s; the per-step losses it logged."""
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(processes), "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    done = subprocess.run(
        launcher + ["-m", "training.train", "--out", str(out_dir), *flags],
        env=dict(os.environ, PYTHONPATH=pythonpath), cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [row["loss"] for row in train.read_log(out_dir / "log.csv")]
