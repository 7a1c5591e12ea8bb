"""Paged KV caches for the tests: sequences' keys and values laid into the shuffled pages of a
pool, as a serving cache hands them out."""

import random

import torch


def paged(keys, values, page_size, spare=2, seed=0):
    """Sequences' keys (Lk_b, Hkv, D) and values laid into shuffled pages of a pool with
    ``spare`` NaN pages no sequence reads, and the block table (unused entries name a page out
    of range: they are never read)."""
    rng = random.Random(seed)
    counts = [-(-k.shape[0] // page_size) for k in keys]
    total = sum(counts) + spare
    order = list(range(total))
    rng.shuffle(order)
    hkv, d, dv = keys[0].shape[1], keys[0].shape[2], values[0].shape[2]
    dtype = keys[0].dtype
    k_cache = torch.full((total, page_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((total, page_size, hkv, dv), float("nan"), dtype=dtype)
    width = max(counts) + 1
    table = torch.full((len(keys), width), 10**6, dtype=torch.int32)
    used = 0
    for b, (k, v) in enumerate(zip(keys, values)):
        for j in range(counts[b]):
            page = order[used]
            used += 1
            table[b, j] = page
            rows = slice(j * page_size, min((j + 1) * page_size, k.shape[0]))
            n = rows.stop - rows.start
            k_cache[page, :n], v_cache[page, :n] = k[rows], v[rows]
    return k_cache, v_cache, table
