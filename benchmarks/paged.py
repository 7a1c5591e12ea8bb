"""Serving from a paged KV cache on the CPU: causal_attention.paged_attention reading pages in
place, against our contiguous decode and against gathering the pages and calling torch's
scaled_dot_product_attention (SDPA), all timed in the same run.

Sections (--only):
  decode   one query row per sequence (B in --batches) against caches of --lengths tokens in
           pages of --pages rows (shuffled, as a pool hands them out): paged_attention, our op
           on the same keys contiguous in the KV cache's (B, Hkv, L, D) layout and in the
           pages' own (B, L, Hkv, D) layout, the pages gathered + SDPA, and paged_attention
           on the same pages laid in order (what shuffling them costs); and a bare read of
           every K and V page, shuffled and in order (read_pages in the probe library,
           page_read_probe.cpp: what the memory system alone charges for the shuffling)
  mixed    8 decodes and 2 prefill chunks of --chunk queries (caches of --mixed-length tokens)
           in one paged call, against one call per request and against one call for the
           decodes plus one per chunk
  memory   the peak resident memory one decode call of B=8 at the longest --lengths adds (its
           VmHWM above its VmRSS before the call), against the cache's size, for a float32
           cache and an 8-bit one
  verify   a step verifying --drafts draft tokens of each of 8 requests (caches of the smallest
           --lengths tokens, pages of the smallest --pages) in one call: with a tree mask
           (spec_mask: each draft sees its ancestors, two branches from the root), with the
           chain's mask, and without a mask (the same call, causal only)
  latent   MLA's decode (B=8, one KV head of D=576, Dv=512, --latent-heads absorbed query
           heads, bfloat16, caches of --lengths tokens): v_cache a view of k_cache's first 512
           features (each page read once), against two caches of the same contents and against
           SDPA on the gathered latent (where its repeated K/V fit in 2 GiB); with the bound
           the chip puts on two caches ÷ one latent (section_latent)
  precisions  decode and a prefill chunk from float32, bfloat16 and 8-bit caches
           (float8_e4m3fn, float8_e5m2, int8 with their scales) at the serving sizes, each
           against a bare read of its own pages (paged_precisions.py)
  overlap  the bfloat16 decode's pages read with 0-32 multiply-adds on each vector, whole in
           address order and in the decode's order (head by head, the next block requested),
           against the same arithmetic in cache: whether the chip streams pages while the core
           computes on them, and what the decode's order costs (read_overlap.py)

Every time is the median over --rounds rounds of torch.utils.benchmark's blocked_autorange at
--threads threads, each round timing every compared call of a section in turn (so that a drift
of a shared machine's speed reaches them alike).

    python -m benchmarks.paged                          # the full sizes (minutes)
    python -m benchmarks.paged --quick --out /tmp/p.json  # seconds: every path, tiny sizes
"""

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import causal_attention as ca

from . import paged_precisions, read_overlap
from .limits import block_product_gflops, page_reads
from .proc import cpu_name, status_kib, write_report
from .timing import interleaved_median, timer

SECTIONS = ("decode", "mixed", "memory", "verify", "latent", "precisions", "overlap")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seconds-long run of every path")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 32768])
    parser.add_argument("--pages", nargs="+", type=int, default=[16, 128])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512, help="queries of a prefill chunk")
    parser.add_argument("--mixed-length", type=int, default=4096)
    parser.add_argument("--drafts", type=int, default=8, help="new tokens a request verifies")
    parser.add_argument("--latent-heads", nargs="+", type=int, default=[16, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-run-time", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_out/paged.json"))
    paged_precisions.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.lengths, args.pages = [2], [256], [16]
        args.chunk, args.mixed_length, args.min_run_time, args.rounds = 16, 128, 0.01, 1
        args.latent_heads = [4]
        paged_precisions.quick(args)
    return args


def seconds(calls, args) -> dict:
    """{label: seconds} of the calls {label: fn}, interleaved over --rounds rounds."""
    timers = {label: timer(fn, args.threads) for label, fn in calls.items()}
    return interleaved_median(timers, args.rounds, args.min_run_time)


def pool(keys: torch.Tensor, values: torch.Tensor, page: int, seed: int = 0,
         shuffled: bool = True):
    """(B, Hkv, L, D) keys and values laid into pages, shuffled (as a pool hands them out after
    a while) or in order; the pool and the table."""
    batch, heads, length, dim = keys.shape
    per_row = -(-length // page)
    order = (torch.randperm(batch * per_row, generator=torch.Generator().manual_seed(seed))
             if shuffled else torch.arange(batch * per_row))
    caches = []
    for t in (keys, values):
        padded = F.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, per_row * page - length))
        cache = torch.empty(batch * per_row, page, heads, t.shape[-1])
        cache[order] = padded.reshape(batch * per_row, page, heads, t.shape[-1])
        caches.append(cache)
    return caches[0], caches[1], order.view(batch, per_row).int()


def gathered_sdpa(q, k_cache, v_cache, table, length):
    """The pages gathered into a contiguous copy, then SDPA (a serving stack without paged
    kernels)."""
    pages = table.long()
    k = k_cache[pages].flatten(1, 2)[:, :length].transpose(1, 2)
    v = v_cache[pages].flatten(1, 2)[:, :length].transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def section_decode(args) -> list:
    rows = []
    for length in args.lengths:
        for batch in args.batches:
            k = torch.randn(batch, args.kv_heads, length, args.head_dim)
            v = torch.randn(batch, args.kv_heads, length, args.head_dim)
            q = torch.randn(batch, args.heads, 1, args.head_dim)
            k_flash, v_flash = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
            q_flash = q.transpose(1, 2).contiguous()
            seqlens = torch.full((batch,), length, dtype=torch.int32)
            calls = {"contiguous": lambda: ca.attention(q, k, v),
                     "flash_layout": lambda: ca.attention(q, k_flash, v_flash)}
            expected = ca.attention(q, k, v).transpose(1, 2)
            errors = {}
            for page in args.pages:
                k_cache, v_cache, table = pool(k, v, page)
                calls[f"paged{page}"] = partial(ca.paged_attention, q_flash, k_cache, v_cache,
                                                table, seqlens)
                calls[f"sdpa{page}"] = partial(gathered_sdpa, q, k_cache, v_cache, table, length)
                in_order = pool(k, v, page, shuffled=False)
                calls[f"in_order{page}"] = partial(ca.paged_attention, q_flash, *in_order,
                                                   seqlens)
                for name, (k_pages, v_pages, order) in (("read", (k_cache, v_cache, table)),
                                                        ("read_in_order", in_order)):
                    for prefetch, read in page_reads((k_pages, v_pages), order).items():
                        calls[f"{name}{page}_{prefetch}"] = read
                errors[page] = max((calls[f"{name}{page}"]() - expected).abs().max().item()
                                   for name in ("paged", "in_order"))
            times = seconds(calls, args)
            contiguous, flash_layout = times["contiguous"], times["flash_layout"]
            for page in args.pages:
                paged, sdpa = times[f"paged{page}"], times[f"sdpa{page}"]
                row = {"length": length, "batch": batch, "page": page,
                       "paged_ms": paged * 1e3, "contiguous_ms": contiguous * 1e3,
                       "flash_layout_ms": flash_layout * 1e3, "gather_sdpa_ms": sdpa * 1e3,
                       "contiguous_over_paged": contiguous / paged,
                       "flash_layout_over_paged": flash_layout / paged,
                       "gather_sdpa_over_paged": sdpa / paged,
                       "pages_in_order_ms": times[f"in_order{page}"] * 1e3,
                       **{f"{name}_pages_ms": 1e3 * min(times[f"{name}{page}_{prefetch}"]
                                                         for prefetch in (False, True))
                          for name in ("read", "read_in_order")},
                       "max_abs_error": errors[page]}
                print(json.dumps(row))
                rows.append(row)
    return rows


def section_mixed(args) -> dict:
    """8 decodes and 2 prefill chunks, each sequence's cache --mixed-length tokens (a chunk's
    queries are the last of them), pages of the smallest --pages."""
    page, length = min(args.pages), args.mixed_length
    lengths_q = [1] * 8 + [args.chunk] * 2
    batch = len(lengths_q)
    k = torch.randn(batch, args.kv_heads, length, args.head_dim)
    v = torch.randn(batch, args.kv_heads, length, args.head_dim)
    k_cache, v_cache, table = pool(k, v, page)
    seqlens = torch.full((batch,), length, dtype=torch.int32)
    queries = [torch.randn(n, args.heads, args.head_dim) for n in lengths_q]
    q = torch.cat(queries)
    cu = torch.tensor([0] + lengths_q).cumsum(0).int()

    def one_call():
        return ca.paged_attention(q, k_cache, v_cache, table, seqlens, cu_seqlens_q=cu,
                                  max_seqlen_q=max(lengths_q))

    def call(rows, picked_queries):
        lengths = [x.shape[0] for x in picked_queries]
        return ca.paged_attention(torch.cat(picked_queries), k_cache, v_cache, table[rows],
                                  seqlens[rows], cu_seqlens_q=torch.tensor([0] + lengths)
                                  .cumsum(0).int(), max_seqlen_q=max(lengths))

    def per_request():
        return [call([b], [queries[b]]) for b in range(batch)]

    def decodes_then_chunks():
        return [call(list(range(8)), queries[:8]), call([8], [queries[8]]),
                call([9], [queries[9]])]

    # The same attention; the key splits (and so the float32 sums' order) follow the call's
    # shape, so a request batched with others may differ from its own call in the last bits.
    torch.testing.assert_close(torch.cat(per_request()), one_call(), rtol=1e-5, atol=1e-6)
    times = seconds({"one_call": one_call, "per_request": per_request,
                     "decodes_then_chunks": decodes_then_chunks}, args)
    result = {f"{name}_ms": t * 1e3 for name, t in times.items()}
    result["per_request_over_one_call"] = times["per_request"] / times["one_call"]
    result["decodes_then_chunks_over_one_call"] = times["decodes_then_chunks"] / times["one_call"]
    print(json.dumps(result))
    return result



def section_memory(args) -> list:
    length, page, batch = max(args.lengths), min(args.pages), 8
    k = torch.randn(batch, args.kv_heads, length, args.head_dim)
    k_cache, v_cache, table = pool(k, k, page)
    del k
    seqlens = torch.full((batch,), length, dtype=torch.int32)
    q = torch.randn(batch, 1, args.heads, args.head_dim)
    results = []
    # float32, and int8 with a scale per token and KV head (the 8-bit read widens key blocks
    # into the tasks' scratch: nothing the size of the cache)
    token_scales = torch.full(k_cache.shape[:3], 0.01)
    for caches, options in (((k_cache, v_cache), {}),
                            (tuple(c.mul(30).round().clamp(-127, 127).to(torch.int8)
                                   for c in (k_cache, v_cache)),
                             {"k_scale": token_scales, "v_scale": token_scales})):
        ca.paged_attention(q, *caches, table, seqlens, **options)  # warm-up: threads, scratch
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = status_kib("VmRSS")
        ca.paged_attention(q, *caches, table, seqlens, **options)
        added = (status_kib("VmHWM") - before) * 1024
        cache = (caches[0].numel() + caches[1].numel()) * caches[0].element_size()
        result = {"cache_dtype": str(caches[0].dtype).removeprefix("torch."), "length": length,
                  "batch": batch, "cache_mib": cache / 2**20, "peak_added_mib": added / 2**20,
                  "added_over_cache": added / cache}
        print(json.dumps(result))
        results.append(result)
    return results


def two_branch_tree(n: int) -> torch.Tensor:
    """(n, n) bool: token 0 the root, the odd tokens one branch below it and the even ones the
    other, each token seeing its ancestors and itself."""
    sees = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = 0 if i <= 2 else i - 2
        sees[i] |= sees[parent]
    return sees


def section_verify(args) -> dict:
    batch, drafts = 8, args.drafts
    length, page = min(args.lengths), min(args.pages)
    k = torch.randn(batch, args.kv_heads, length, args.head_dim)
    v = torch.randn(batch, args.kv_heads, length, args.head_dim)
    k_cache, v_cache, table = pool(k, v, page)
    seqlens = torch.full((batch,), length, dtype=torch.int32)
    q = torch.randn(batch * drafts, args.heads, args.head_dim)
    cu = torch.arange(batch + 1, dtype=torch.int32) * drafts
    masks = {"tree": two_branch_tree(drafts).repeat(batch, 1),
             "chain": torch.ones(drafts, drafts, dtype=torch.bool).tril().repeat(batch, 1)}

    def call(spec_mask):
        return ca.paged_attention(q, k_cache, v_cache, table, seqlens, cu_seqlens_q=cu,
                                  max_seqlen_q=drafts, spec_mask=spec_mask)

    # The chain's mask is the causal rule itself.
    torch.testing.assert_close(call(masks["chain"]), call(None), rtol=0, atol=0)
    times = seconds({"no_mask": partial(call, None), "chain": partial(call, masks["chain"]),
                     "tree": partial(call, masks["tree"])}, args)
    result = {"batch": batch, "drafts": drafts, "length": length, "page": page,
              **{f"{name}_ms": t * 1e3 for name, t in times.items()},
              "tree_over_no_mask": times["tree"] / times["no_mask"],
              "chain_over_no_mask": times["chain"] / times["no_mask"]}
    print(json.dumps(result))
    return result


def section_latent(args) -> list:
    """Each row also bounds what dropping the second read can gain on this chip: a call reading
    the latent once is faster than one reading two caches by at most the time of reading the
    values' copy (values_read), and takes at least the longer of its own read (latent_read) and
    its multiply-adds at the chip's block-product rates (arithmetic_floor), so
      two_caches_over_shared <= 1 + values_read / max(arithmetic_floor, latent_read).
    The floor takes the scores at the bfloat16 rate and P V at the float32 rate (P stays float32,
    the library's accuracy rule); `..._all_bfloat16` takes both products at the bfloat16 rate, the
    most any kernel of this chip could do with P rounded."""
    batch, dim, value_dim, page = 8, 576, 512, min(args.pages)
    gflops = block_product_gflops(args.quick)
    print(json.dumps({"block_product_gflops": gflops}))
    rows = []
    for length in args.lengths:
        latent = torch.randn(batch, 1, length, dim)
        k_cache, _, table = pool(latent, latent[..., :value_dim], page)
        k_cache = k_cache.to(torch.bfloat16)
        v_view = k_cache[..., :value_dim]
        k_two, v_two = k_cache.clone(), v_view.contiguous()
        seqlens = torch.full((batch,), length, dtype=torch.int32)
        reads = {f"{name}_{prefetch}": read
                 for name, cache in (("latent_read", k_cache), ("values_read", v_two))
                 for prefetch, read in page_reads((cache,), table).items()}
        for heads in args.latent_heads:
            q = torch.randn(batch, 1, heads, dim, dtype=torch.bfloat16)
            calls = {"shared": partial(ca.paged_attention, q, k_cache, v_view, table, seqlens),
                     "two_caches": partial(ca.paged_attention, q, k_two, v_two, table, seqlens)}
            assert torch.equal(calls["shared"](), calls["two_caches"]())
            if batch * heads * length * dim * 2 <= 2**31:
                calls["gather_sdpa"] = partial(gathered_sdpa, q.transpose(1, 2), k_cache,
                                               v_view, table, length)
            # The reads are timed in the same rounds as each row's calls, so that the bound and
            # the ratio it bounds see the same stretch of a shared machine's bandwidth.
            times = seconds({**calls, **reads}, args)
            read = {name: min(times[f"{name}_{prefetch}"] for prefetch in (False, True))
                    for name in ("latent_read", "values_read")}
            # Scores over D features and values over Dv: a multiply-add (2 FLOPs) each.
            scores, values = (2 * batch * heads * length * n / 1e9 for n in (dim, value_dim))
            floors = {"": scores / gflops["bfloat16"] + values / gflops["float32"],
                      "_all_bfloat16": (scores + values) / gflops["bfloat16"]}
            row = {"length": length, "heads": heads,
                   **{f"{name}_ms": times[name] * 1e3 for name in calls},
                   **{f"{name}_ms": t * 1e3 for name, t in read.items()},
                   "two_caches_over_shared": times["two_caches"] / times["shared"]}
            for suffix, floor in floors.items():
                row[f"arithmetic_floor{suffix}_ms"] = floor * 1e3
                row[f"two_caches_over_shared_bound{suffix}"] = (
                    1 + read["values_read"] / max(floor, read["latent_read"]))
            if "gather_sdpa" in times:
                row["sdpa_over_shared"] = times["gather_sdpa"] / times["shared"]
            print(json.dumps(row))
            rows.append(row)
    return rows


def section_precisions(args) -> dict:
    return paged_precisions.section_precisions(args, seconds)


def section_overlap(args) -> list:
    return read_overlap.section_overlap(args, seconds)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "cpu": cpu_name(), "torch": torch.__version__}
    for section in args.only:
        report[section] = globals()[f"section_{section}"](args)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
