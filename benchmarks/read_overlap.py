"""Whether the chip's memory system streams pages while the core computes on them, and in which
order (benchmarks.paged's `overlap` section): the bfloat16 decode's pages (--precision-batches'
first batch of --precision-length tokens, Hkv 8, D 128, pages of 16 in order, K and V) read as
float32 words with 0-32 multiply-adds on each vector as it is loaded (read_pages_computing in
the probe library, page_read_probe.cpp), in two orders:

- pages: each page whole, in address order, with the hardware's prefetchers alone;
- decode: the decode's order, a block of 4 pages (64 keys) at a time, head by head, each head's
  rows of the block (256 bytes every 2 KiB), the same rows of the next block requested into L2
  as each is read (as the decode's StreamAhead requests them);

each against the same arithmetic on a few pages that stay in cache. Were reads and arithmetic
never overlapped, a read with arithmetic would take its read plus the arithmetic in cache;
overlapped, the longer of the two. `hidden` is the share of the shorter one that disappears:
(read + in cache - with arithmetic) / min(read, in cache), 1 when one hides the other whole.
`over_bare_read` is the read with arithmetic over the pages' bare read in address order: what
the order costs against what the memory system can do.
"""

import json

import torch

from .limits import probe
from .paged_precisions import KV_HEADS, PAGE, in_cache_pages, pages

MULTIPLY_ADDS = (0, 4, 8, 16, 32)
ORDERS = {"pages": {}, "decode": {"heads": KV_HEADS, "page_rows": PAGE}}


def section_overlap(args, seconds) -> list:
    generator = torch.Generator().manual_seed(0)
    batch, length = args.precision_batches[0], args.precision_length
    num_pages = batch * -(-length // PAGE)
    caches = [pages(num_pages, torch.bfloat16, generator).view(torch.uint8).view(torch.float32)
              for _ in range(2)]
    table = torch.arange(num_pages, dtype=torch.int32)
    page_bytes = caches[0][0].numel() * 4
    few = table.remainder(in_cache_pages(page_bytes))
    compute = probe("read_pages_computing")

    def call(pool_table, multiply_adds, order):
        return lambda: sum(compute(cache, pool_table, multiply_adds, **ORDERS[order])
                           for cache in caches)

    calls = {}
    for order in ORDERS:
        for m in MULTIPLY_ADDS:
            calls[f"read/{order}/{m}"] = call(table, m, order)
            calls[f"in_cache/{order}/{m}"] = call(few, m, order)
    timed = seconds(calls, args)
    bare_read = timed["read/pages/0"]
    rows = []
    for order in ORDERS:
        read = timed[f"read/{order}/0"]
        for m in MULTIPLY_ADDS:
            streamed, in_cache = timed[f"read/{order}/{m}"], timed[f"in_cache/{order}/{m}"]
            row = {"order": order, "multiply_adds_per_vector": m,
                   "cache_mib": 2 * num_pages * page_bytes / 2**20, "read_ms": read * 1e3,
                   "in_cache_ms": in_cache * 1e3, "read_computing_ms": streamed * 1e3,
                   "hidden": (read + in_cache - streamed) / min(read, in_cache),
                   "over_bare_read": streamed / bare_read}
            print(json.dumps(row))
            rows.append(row)
    return rows
