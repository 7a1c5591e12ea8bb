"""Whether the chip's memory system streams pages while the core computes on them
(benchmarks.paged's `overlap` section): the bfloat16 decode's pages (--precision-batches' first
batch of --precision-length tokens, Hkv 8, D 128, pages of 16 in order, K and V) read as float32
words with 0, 4, 8, 16 and 32 multiply-adds on each vector as it is loaded
(read_pages_computing in the probe library, page_read_probe.cpp), against the same arithmetic
on a few pages that stay in cache. Were reads and arithmetic never overlapped, a read with
arithmetic would take the bare read plus the arithmetic in cache; overlapped, the longer of the
two. `hidden` is the share of the shorter one that disappears:
(read + in cache - with arithmetic) / min(read, in cache), 1 when one hides the other whole.
The decode's own figures (paged_precisions.py: decode ≈ in cache + bare read, hidden ≈ 0) are
then the kernel's doing or the chip's.
"""

import json

import torch

from .limits import probe
from .paged_precisions import IN_CACHE_BYTES, pages

MULTIPLY_ADDS = (0, 4, 8, 16, 32)


def section_overlap(args, seconds) -> list:
    generator = torch.Generator().manual_seed(0)
    batch, length = args.precision_batches[0], args.precision_length
    num_pages = batch * -(-length // 16)
    caches = [pages(num_pages, torch.bfloat16, generator).view(torch.uint8).view(torch.float32)
              for _ in range(2)]
    table = torch.arange(num_pages, dtype=torch.int32)
    page_bytes = caches[0][0].numel() * 4
    few = torch.arange(num_pages, dtype=torch.int32).remainder(
        max(1, IN_CACHE_BYTES // (2 * page_bytes)))
    compute = probe("read_pages_computing")

    def call(pool_table, multiply_adds):
        return lambda: sum(compute(cache, pool_table, multiply_adds) for cache in caches)

    calls = {}
    for m in MULTIPLY_ADDS:
        calls[f"read/{m}"] = call(table, m)
        calls[f"in_cache/{m}"] = call(few, m)
    timed = seconds(calls, args)
    read = timed["read/0"]
    rows = []
    for m in MULTIPLY_ADDS:
        streamed, in_cache = timed[f"read/{m}"], timed[f"in_cache/{m}"]
        row = {"multiply_adds_per_vector": m, "cache_mib": 2 * num_pages * page_bytes / 2**20,
               "bare_read_ms": read * 1e3, "in_cache_ms": in_cache * 1e3,
               "read_computing_ms": streamed * 1e3,
               "hidden": (read + in_cache - streamed) / min(read, in_cache)}
        print(json.dumps(row))
        rows.append(row)
    return rows
