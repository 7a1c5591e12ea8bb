"""Helpers shared by scripts/demo.py and scripts/bench.py: the SDPA reference call, a forward +
backward step, and the median timer."""

import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def sdpa(q, k, v):
    """torch's scaled_dot_product_attention with our semantics: causal, bottom-right aligned
    (is_causal=True when Lq == Lk, else a causal_lower_right(Lq, Lk) mask), GQA when Hq != Hkv."""
    gqa = q.size(-3) != k.size(-3)
    if q.size(-2) == k.size(-2):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = causal_lower_right(q.size(-2), k.size(-2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def forward_backward(attn, q, k, v, grad):
    """One forward and backward through `attn`; returns (dq, dk, dv) without touching .grad."""
    out = attn(q, k, v)
    return torch.autograd.grad(out, (q, k, v), grad)


def sample_seconds(fn, repeats, *, warmup=1, setup=None, min_sample_seconds=0.0):
    """Seconds per call of `fn`, `repeats` samples after `warmup` (at least one) untimed calls.

    With `setup`, every call is `fn(setup())` and only `fn` is timed. Otherwise, when one call is
    shorter than `min_sample_seconds`, a sample times enough back-to-back calls to last about
    that long and reports their mean, so that sub-millisecond calls are not lost in timer noise.
    """

    def call():
        return fn(setup()) if setup is not None else fn()

    start = time.perf_counter()
    for _ in range(max(1, warmup)):
        call()
    first = (time.perf_counter() - start) / max(1, warmup)
    inner = 1
    if setup is None and 0.0 < first < min_sample_seconds:
        inner = math.ceil(min_sample_seconds / first)
    samples = []
    for _ in range(repeats):
        if setup is not None:
            argument = setup()
            start = time.perf_counter()
            fn(argument)
        else:
            start = time.perf_counter()
            for _ in range(inner):
                fn()
        samples.append((time.perf_counter() - start) / inner)
    return samples


def median_seconds(fn, repeats, **kwargs):
    """The median of sample_seconds(fn, repeats, **kwargs)."""
    return statistics.median(sample_seconds(fn, repeats, **kwargs))
