"""Shared by the tests of training.train: the module, and the flags of a run small enough to
train in a second or two."""

from training import train

# GQA (4 query heads, 2 K/V heads) like the script's defaults, at a tiny size.
TINY_RUN = "--batch-size 4 --seq-len 32 --embed-dim 32 --num-heads 4 --num-kv-heads 2".split()
TINY_RUN += "--num-layers 2 --checkpoint-every 0".split()


def tiny_args(*flags: str):
    """Parsed flags of a tiny run; later flags override TINY_RUN's."""
    return train.parse_args([*TINY_RUN, *flags])
