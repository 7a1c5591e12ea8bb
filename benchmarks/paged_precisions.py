"""The paged decode and prefill in the precisions people serve in (benchmarks.paged's
`precisions` section): caches of float32, bfloat16 and the 8-bit dtypes (float8_e4m3fn,
float8_e5m2, int8, with a scale per token and KV head, e4m3 also with one per tensor), each timed
against a bare read of its own pages' bytes (read_pages on the same memory viewed as float32:
what the memory system alone charges), and against each other; and each decode beside its
arithmetic floor (its float32 multiply-adds at the block-product probe's float32 rate), which
bounds how close to its bare read an exact float32 decode can come on the chip
(best_read_over_decode); and beside the same decode with its reads taken away (in_cache: the same
call, every block-table entry on a few pages that stay in L2), the time this kernel's arithmetic
takes on the chip, which bounds read ÷ decode however well the read hides behind it
(read_over_in_cache). The bare read is timed twice: reading each page as it comes (the hardware's
prefetchers stream it), and with each next page requested in software (prefetched_read), as the
decode requests its next key block while it computes. bare_read is the faster of the two (the
memory system's charge); prefetched_read is what these bytes cost when software requests them
(prefetched_read_over_decode: a decode near 1 there runs at the speed of its requests, its
arithmetic hidden behind them).

Each dtype is timed in the same rounds as the bfloat16 cache, so that their ratio holds on a
shared machine. Sizes are the serving issue's: --precision-batches sequences of --precision-length cached tokens,
Hq 32, Hkv 8, D 128, pages of 16 laid in order (as PagedKVCache lays the pages of requests that
decode together), one query row each; and a prefill chunk of --precision-chunk queries against
--precision-prefill-length cached tokens of one sequence. Only the pools of two dtypes live at a
time (float32 at B 32 x 32768 tokens is 8.6 GB, bfloat16 4.3 GB)."""

import gc
import json

import torch

import causal_attention as ca

from .limits import block_product_gflops, page_reads

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
# label: (cache dtype, q dtype, scale layout)
CACHES = {
    "float32": (torch.float32, torch.float32, None),
    "bfloat16": (torch.bfloat16, torch.bfloat16, None),
    "e4m3_token": (torch.float8_e4m3fn, torch.bfloat16, "token"),
    "e4m3_tensor": (torch.float8_e4m3fn, torch.bfloat16, "tensor"),
    "e5m2_token": (torch.float8_e5m2, torch.bfloat16, "token"),
    "int8_token": (torch.int8, torch.bfloat16, "token"),
}
EIGHT_BIT = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
# The in-cache decode's K and V pages together: within L2 on every chip seen (Zen 3 has 512 KiB).
IN_CACHE_BYTES = 256 * 1024


def add_arguments(parser):
    parser.add_argument("--precision-batches", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--precision-length", type=int, default=32768)
    parser.add_argument("--precision-chunk", type=int, default=512)
    parser.add_argument("--precision-prefill-length", type=int, default=4096)
    parser.add_argument("--precision-caches", nargs="+", choices=list(CACHES),
                        default=list(CACHES))


def quick(args):
    args.precision_batches, args.precision_length = [2], 256
    args.precision_chunk, args.precision_prefill_length = 16, 128


def pages(num_pages, dtype, generator):
    """A (num_pages, PAGE, KV_HEADS, HEAD_DIM) pool of dtype with values of attention's usual
    magnitude: normal for float dtypes; stored values of |x| <= 100 (finite in every 8-bit
    format) for the 8-bit ones, read with scales of about 1/100."""
    shape = (num_pages, PAGE, KV_HEADS, HEAD_DIM)
    if dtype not in EIGHT_BIT:
        return torch.randn(shape, generator=generator, dtype=dtype)
    stored = torch.randint(-100, 101, shape, generator=generator, dtype=torch.int8)
    return stored if dtype == torch.int8 else stored.to(dtype)


def scales(layout, num_pages, generator):
    if layout is None:
        return {}
    if layout == "tensor":
        return {"k_scale": 0.01, "v_scale": 0.012}
    return {name: 0.005 + 0.01 * torch.rand(num_pages, PAGE, KV_HEADS, generator=generator)
            for name in ("k_scale", "v_scale")}


def in_cache_pages(page_bytes):
    """How many K pages of page_bytes, with as many V pages, fill IN_CACHE_BYTES (at least one):
    a table whose entries all lie on them reads pages that stay in cache."""
    return max(1, IN_CACHE_BYTES // (2 * page_bytes))


def calls_for(label, batch, length, lengths_q, generator, in_cache=False):
    """{name: fn} of one cache dtype: its paged call and the bare reads of its pages (names
    prefixed by the label), with `in_cache` the same call on a pool of IN_CACHE_BYTES that every
    table entry repeats; and the bytes of its pages and scales."""
    cache_dtype, q_dtype, layout = CACHES[label]
    per_sequence = -(-length // PAGE)
    num_pages = batch * per_sequence
    table = torch.arange(num_pages, dtype=torch.int32).view(batch, per_sequence)
    seqlens = torch.full((batch,), length, dtype=torch.int32)
    q = torch.randn(sum(lengths_q), HEADS, HEAD_DIM, generator=generator).to(q_dtype)
    cu = torch.tensor([0] + lengths_q).cumsum(0).int()

    def paged_call(pool_pages, pool_table):
        k_cache, v_cache = (pages(pool_pages, cache_dtype, generator) for _ in range(2))
        options = scales(layout, pool_pages, generator)

        def call():
            return ca.paged_attention(q, k_cache, v_cache, pool_table, seqlens, cu_seqlens_q=cu,
                                      max_seqlen_q=max(lengths_q), **options)

        return call, k_cache, v_cache, options

    paged, k_cache, v_cache, options = paged_call(num_pages, table)
    calls = {f"{label}/paged": paged}
    for prefetch, read in page_reads((k_cache, v_cache), table).items():
        calls[f"{label}/read_{prefetch}"] = read
    if in_cache:
        few = in_cache_pages(k_cache[0].numel() * k_cache.element_size())
        calls[f"{label}/in_cache"] = paged_call(few, table.remainder(few))[0]
    cache_bytes = 2 * k_cache.numel() * k_cache.element_size()
    scale_bytes = sum(s.numel() * 4 for s in options.values() if isinstance(s, torch.Tensor))
    return calls, cache_bytes + scale_bytes


def paired(args, seconds, batch, length, lengths_q, generator, in_cache=False):
    """{label: {"paged", "read", "prefetched_read", "bytes", "bfloat16", and with in_cache
    "in_cache"}} (seconds, bytes): each cache dtype timed in rounds that interleave it with the
    bfloat16 cache (kept alive throughout), so that its ratio to bfloat16 comes from one stretch
    of the machine's time however a shared machine drifts; bfloat16's own times are the medians
    over its pairings. Only the pools of two dtypes live at once."""
    anchor, anchor_bytes = calls_for("bfloat16", batch, length, lengths_q, generator, in_cache)

    def times(label, timed, nbytes):
        out = {"paged": timed[f"{label}/paged"], "bytes": nbytes,
               "read": min(timed[f"{label}/read_False"], timed[f"{label}/read_True"]),
               "prefetched_read": timed[f"{label}/read_True"],
               "bfloat16": timed["bfloat16/paged"]}
        if in_cache:
            out["in_cache"] = timed[f"{label}/in_cache"]
        return out

    results, anchor_times = {}, []
    for label in args.precision_caches:
        if label == "bfloat16":
            continue
        calls, nbytes = calls_for(label, batch, length, lengths_q, generator, in_cache)
        timed = seconds({**anchor, **calls}, args)
        results[label] = times(label, timed, nbytes)
        anchor_times.append(times("bfloat16", timed, anchor_bytes))
        del calls
        gc.collect()
    if not anchor_times:
        anchor_times.append(times("bfloat16", seconds(anchor, args), anchor_bytes))
    results["bfloat16"] = {key: sorted(t[key] for t in anchor_times)[len(anchor_times) // 2]
                           for key in anchor_times[0]}
    return results


def section_precisions(args, seconds) -> dict:
    generator = torch.Generator().manual_seed(0)
    gflops = block_product_gflops(args.quick)["float32"]
    print(json.dumps({"float32_block_product_gflops": gflops}))
    decode = []
    for batch in args.precision_batches:
        timed = paired(args, seconds, batch, args.precision_length, [1] * batch, generator,
                       in_cache=True)
        # Scores and values: 2 multiply-adds a (query head, key, dim) pair each.
        flops = 4 * batch * HEADS * args.precision_length * HEAD_DIM
        floor = flops / (gflops * 1e9)
        for label, t in timed.items():
            paged, read = t["paged"], t["read"]
            row = {"batch": batch, "length": args.precision_length, "cache": label,
                   "cache_mib": t["bytes"] / 2**20, "decode_ms": paged * 1e3,
                   "bare_read_ms": read * 1e3, "read_over_decode": read / paged,
                   "prefetched_read_ms": t["prefetched_read"] * 1e3,
                   "prefetched_read_over_decode": t["prefetched_read"] / paged,
                   "in_cache_ms": t["in_cache"] * 1e3,
                   "read_over_in_cache": min(1.0, read / t["in_cache"]),
                   "arithmetic_floor_ms": floor * 1e3,
                   "best_read_over_decode": min(1.0, read / floor),
                   "gb_per_s": t["bytes"] / paged / 1e9,
                   "bfloat16_over_this": t["bfloat16"] / paged}
            print(json.dumps(row))
            decode.append(row)
    prefill = []
    timed = paired(args, seconds, 1, args.precision_prefill_length, [args.precision_chunk],
                   generator)
    for label, t in timed.items():
        row = {"chunk": args.precision_chunk, "length": args.precision_prefill_length,
               "cache": label, "prefill_ms": t["paged"] * 1e3,
               "bfloat16_over_this": t["bfloat16"] / t["paged"]}
        print(json.dumps(row))
        prefill.append(row)
    return {"float32_block_product_gflops": gflops, "decode": decode, "prefill": prefill}
