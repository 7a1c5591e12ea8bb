"""Serving a queue of requests with a GPT on the CPU: continuous batching from a paged KV cache
(causal_attention.PagedKVCache, one paged attention call per layer a step) against padded static
batching with torch's scaled_dot_product_attention (SDPA), as transformers' generate serves a
batch, on the same weights and the same queue; greedy tokens, the model in --dtype (float32 or
bfloat16), --threads threads.

The model is a GPT with seeded random weights; the queue holds --requests requests whose prompt
and output lengths are each drawn uniformly from --min-len..--max-len (seeded), prompts of random
tokens. What a server wins by batching continuously is in the requests' differing lengths, so
that is what the queue has.

  ours     a scheduler loop: each step admits waiting requests in queue order while fewer than
           --max-batch run, feeds each new request's whole prompt (its prefill) beside the
           running requests' one-token decodes, runs one GPT.forward_paged call for all of them,
           takes each request's next token greedily and frees the pages of the finished ones.
           Pages are drawn as tokens come, and a request is admitted only if the free pages hold
           the whole remaining length of every running request plus its own (prompt + output),
           so no request is ever preempted; the pool holds --max-batch requests of the longest
           total length, so in this queue the batch size is what limits admission. It also
           counts how many of the pairs of consecutive pages the steps read lie in order in
           the pool (page p, then p + 1), which a decode reads as one stream.
  padded   the queue in batches of --max-batch in queue order: each batch left-pads its prompts
           to its longest, runs the prompt once, then decodes every row until the batch's
           longest output is done (finished rows keep being computed), with contiguous
           (B, Hkv, P + N, D) K/V caches per layer; SDPA with a bool mask (causal, no padding
           key) in the model's own modules.
  checks   for the first --check requests, ours' tokens equal GPT.generate's for the request
           alone (torch.equal); the requests whose padded tokens equal ours are counted (float32:
           the two sum in different orders, so a near-tie in an argmax may in principle differ).
  8-bit    for each of --cache-dtypes (float8_e4m3fn, float8_e5m2: one scale per layer, 1 as
           vLLM's default; int8: a scale per token and KV head, which integers need), ours again from a pool of the same bytes as the
           model-dtype pool, which holds more tokens: as many more requests run at once
           (--max-batch times the pools' ratio of tokens); tokens/s, and the share of output
           tokens equal to the model-dtype cache's (greedy: after a first differing token a
           request's continuation differs as a whole, so the first difference is counted too).

Each whole run is timed once (time.perf_counter) after a small warm-up run of each.

    python -m benchmarks.serving                           # the full queue (minutes)
    python -m benchmarks.serving --quick --out /tmp/s.json  # seconds: a tiny model and queue
"""

import argparse
import json
import time
from collections import deque
from pathlib import Path

import torch
import torch.nn.functional as F

from causal_attention.models import GPT

from .proc import cpu_name, write_report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seconds-long run of every path")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--embed-dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model-max-len", type=int, default=2048, help="the model's positions")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt and output")
    parser.add_argument("--max-batch", type=int, default=16, help="requests running at once")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--check", type=int, default=8,
                        help="requests checked against GPT.generate alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the model's parameters and its own cache")
    parser.add_argument("--cache-dtypes", nargs="*", default=[],
                        choices=["float8_e4m3fn", "float8_e5m2", "int8"],
                        help="8-bit caches to serve the queue from as well, in the same bytes")
    parser.add_argument("--out", type=Path, default=Path("bench_out/serving.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.min_len, args.max_len, args.model_max_len = 6, 4, 24, 64
        args.embed_dim, args.layers, args.heads, args.kv_heads = 32, 2, 4, 2
        args.max_batch, args.page_size, args.check = 3, 8, 6
        args.cache_dtypes = args.cache_dtypes or ["float8_e4m3fn", "int8"]
    if 2 * args.max_len > args.model_max_len:
        parser.error(f"a request's prompt and output ({2 * args.max_len} tokens at most) must "
                     f"fit --model-max-len={args.model_max_len}")
    return args


def make_queue(count: int, low: int, high: int, vocab: int, seed: int) -> list:
    """``count`` requests ``(prompt (P,) int64, output length N)``, P and N uniform in
    ``low..high``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count, 2), generator=generator).tolist()
    return [(torch.randint(0, vocab, (p,), generator=generator), n) for p, n in lengths]


def pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def held_tokens(prompt_len: int, new: int) -> int:
    """The tokens a request leaves in its cache: its prompt and every output but the last,
    which is never fed back."""
    return prompt_len + new - 1


def pages_in_order(step) -> tuple:
    """Of the pairs of consecutive pages a step's requests read (their block table up to each
    one's length), how many, and how many of them lie in order in the pool (page p, then p + 1:
    what a decode reads as one stream)."""
    page = step.cache.page_size
    used = (step.seqlens.long() + page - 1) // page
    table = step.block_table.long()
    counted = torch.arange(table.shape[1] - 1)[None, :] < used[:, None] - 1
    in_order = table[:, 1:] == table[:, :-1] + 1
    return int(counted.sum()), int((counted & in_order).sum())


def pool_pages(args) -> int:
    """The pages of the model-dtype pool: --max-batch requests of the longest total length."""
    return args.max_batch * pages(held_tokens(args.max_len, args.max_len), args.page_size)


def cache_scales(cache_dtype):
    """The scales of an 8-bit cache (module docstring); None for the model's dtype."""
    if cache_dtype is None:
        return None
    return "token" if cache_dtype == torch.int8 else "tensor"


def serve_continuous(model: GPT, queue: list, args, cache_dtype=None, max_batch=None,
                     num_pages=None) -> dict:
    """Continuous batching (module docstring): each request's output tokens, the steps, the
    pages in use after each step and after the run, and the pairs of consecutive pages the
    steps read that lie in order (pages_in_order), out of all. The cache's pages are in the
    model's dtype, or 8-bit (``cache_dtype``, a scale per token and KV head) with ``max_batch``
    requests at once from ``num_pages`` pages."""
    page = args.page_size
    max_batch = args.max_batch if max_batch is None else max_batch
    num_pages = pool_pages(args) if num_pages is None else num_pages
    cache = model.make_paged_cache(num_pages, page, dtype=cache_dtype,
                                   scales=cache_scales(cache_dtype))
    waiting = deque(range(len(queue)))
    running = {}  # request -> tokens it holds once done
    outputs = {r: [] for r in range(len(queue))}
    in_use, pairs, pairs_in_order = [], 0, 0
    with torch.no_grad():
        while waiting or running:
            # Pages the running requests still draw before they finish: kept free for them.
            owed = sum(pages(final, page) - pages(cache.length(r), page)
                       for r, final in running.items())
            requests = list(running)
            feed = [torch.tensor([outputs[r][-1] for r in requests], dtype=torch.long)]
            counts = [1] * len(requests)
            while waiting and len(running) < max_batch:
                prompt, new = queue[waiting[0]]
                final = held_tokens(prompt.numel(), new)
                if owed + pages(final, page) > cache.free_pages:
                    break
                r = waiting.popleft()
                owed += pages(final, page)
                cache.allocate(r)
                running[r] = final
                requests.append(r)
                counts.append(prompt.numel())
                feed.append(prompt)
            if not requests:
                prompt, new = queue[waiting[0]]
                raise RuntimeError(f"request {waiting[0]} ({prompt.numel()} + {new} tokens) "
                                   f"does not fit a pool of {num_pages} pages of {page}")
            step = cache.step(requests, counts)
            logits = model.forward_paged(torch.cat(feed), step)
            picked = logits[step.cu_seqlens_q[1:].long() - 1].argmax(-1).tolist()
            in_use.append(cache.pages_in_use)
            counted, in_order = pages_in_order(step)
            pairs, pairs_in_order = pairs + counted, pairs_in_order + in_order
            for r, token in zip(requests, picked):
                outputs[r].append(token)
                if len(outputs[r]) == queue[r][1]:
                    del running[r]
                    cache.free(r)
    return {"outputs": [outputs[r] for r in range(len(queue))], "steps": len(in_use),
            "pages_in_use": in_use, "pages_in_use_after": cache.pages_in_use,
            "page_pairs_in_order": pairs_in_order / max(pairs, 1), "pool_bytes": cache.nbytes,
            "num_pages": num_pages, "max_batch": max_batch, "computed_tokens": sum(held_tokens(p.numel(), n)
                                                           for p, n in queue)}


def padded_forward(model: GPT, tokens, positions, caches, start: int, mask):
    """The model on ``tokens (B, L)`` at cache index ``start``, every row padded alike: the
    model's own modules (Block.forward's order) with SDPA reading the contiguous caches, which
    take the new keys and values; the logits of the last position, ``(B, vocab)``."""
    batch, length = tokens.shape
    end = start + length
    x = model.tok_emb(tokens) + model.pos_emb(positions)
    for block, (k_cache, v_cache) in zip(model.blocks, caches):
        attn = block.attn
        q, k, v = attn.c_attn(block.ln_1(x)).split(
            [attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim,
             attn.num_kv_heads * attn.value_head_dim], dim=-1)
        q = q.view(batch, length, attn.num_heads, attn.head_dim).transpose(1, 2)
        k_cache[:, :, start:end] = k.view(batch, length, -1, attn.head_dim).transpose(1, 2)
        v_cache[:, :, start:end] = v.view(batch, length, -1, attn.value_head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end],
                                                  attn_mask=mask, enable_gqa=True)
        x = x + attn._project_output(attended)
        x = x + block.mlp(block.ln_2(x))
    return model.head(model.ln_f(x[:, -1]))


def serve_padded(model: GPT, queue: list, args) -> dict:
    """Padded static batching (module docstring): each request's output tokens, the steps
    (forward calls), each batch's cache size and the tokens computed."""
    outputs, steps, cache_bytes, computed = [], 0, [], 0
    with torch.no_grad():
        for first in range(0, len(queue), args.max_batch):
            batch = queue[first:first + args.max_batch]
            rows, longest = len(batch), max(p.numel() for p, _ in batch)
            new = max(n for _, n in batch)
            pad = torch.tensor([longest - p.numel() for p, _ in batch])
            tokens = torch.stack([F.pad(p, (longest - p.numel(), 0)) for p, _ in batch])
            index = torch.arange(longest + new)
            # A row's position within its request (pads at 0); keys that are not padding.
            positions = (index - pad[:, None]).clamp(min=0)
            real_key = index >= pad[:, None]
            caches = []
            for block in model.blocks:
                attn, dims = block.attn, (block.attn.head_dim, block.attn.value_head_dim)
                caches.append([torch.empty(rows, attn.num_kv_heads, longest + new, d,
                                           dtype=attn.c_attn.weight.dtype) for d in dims])
            cache_bytes.append(sum(t.numel() * t.element_size() for c in caches for t in c))
            # Query i sees keys 0..i that are not padding, and always its own (a pad row fully
            # masked would be NaN, which its 0-weight products would spread).
            query, key = index[:longest, None], index[None, :longest]
            prefill_mask = ((key <= query) & real_key[:, None, :longest]) | (key == query)
            logits = padded_forward(model, tokens, positions[:, :longest], caches, 0,
                                    prefill_mask[:, None])
            generated = [logits.argmax(-1)]
            for t in range(longest, longest + new - 1):
                logits = padded_forward(model, generated[-1][:, None], positions[:, t:t + 1],
                                        caches, t, real_key[:, None, None, :t + 1])
                generated.append(logits.argmax(-1))
            steps += new
            computed += rows * (longest + new - 1)
            table = torch.stack(generated, dim=1).tolist()
            outputs += [row[:n] for row, (_, n) in zip(table, batch)]
    return {"outputs": outputs, "steps": steps, "cache_bytes": cache_bytes,
            "computed_tokens": computed}


def serve_eight_bit(model: GPT, queue: list, args, name: str, ours: dict) -> dict:
    """The queue from an 8-bit cache of the model-dtype pool's bytes (module docstring), against
    the model-dtype cache's run ``ours``."""
    dtype = getattr(torch, name)
    probe = model.make_paged_cache(1, args.page_size, dtype=dtype, scales=cache_scales(dtype))
    num_pages = ours["pool_bytes"] // (probe.nbytes)
    max_batch = args.max_batch * num_pages // ours["num_pages"]
    serve_continuous(model, make_queue(max_batch, args.min_len, args.min_len + 8, args.vocab,
                                       args.seed + 1), args, dtype, max_batch, num_pages)
    result, seconds = timed(serve_continuous, model, queue, args, dtype, max_batch, num_pages)
    wanted = sum(n for _, n in queue)
    same = first = 0
    for mine, theirs in zip(result["outputs"], ours["outputs"]):
        same += sum(a == b for a, b in zip(mine, theirs))
        first += next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine))
    row = {"seconds": seconds, "tokens_per_s": wanted / seconds, "steps": result["steps"],
           "max_batch": max_batch, "pool_pages": num_pages, "pool_mib": result["pool_bytes"] / 2**20,
           "tokens_held_over_model_dtype": num_pages / ours["num_pages"],
           "equal_tokens_share": same / wanted, "tokens_before_first_difference_share": first / wanted,
           "pages_in_use_after": result["pages_in_use_after"]}
    print(json.dumps({name: row}))
    return row


def timed(serve, model, queue, args, *extra):
    start = time.perf_counter()
    result = serve(model, queue, args, *extra)
    return result, time.perf_counter() - start


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.model_max_len, args.embed_dim, args.heads, args.layers,
                num_kv_heads=args.kv_heads).to(getattr(torch, args.dtype)).eval()
    queue = make_queue(args.requests, args.min_len, args.max_len, args.vocab, args.seed)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "cpu": cpu_name(), "torch": torch.__version__}
    wanted = sum(n for _, n in queue)
    report["queue"] = {"requests": len(queue), "prompt_tokens": sum(p.numel() for p, _ in queue),
                       "output_tokens": wanted,
                       "parameters": sum(p.numel() for p in model.parameters())}
    print(json.dumps(report["queue"]))

    warm_up = make_queue(args.max_batch, args.min_len, args.min_len + 8, args.vocab,
                         args.seed + 1)
    serve_continuous(model, warm_up, args)
    serve_padded(model, warm_up, args)

    ours, ours_s = timed(serve_continuous, model, queue, args)
    in_use = ours["pages_in_use"]
    page_bytes = ours["pool_bytes"] / ours["num_pages"]
    report["ours"] = {"seconds": ours_s, "tokens_per_s": wanted / ours_s, "steps": ours["steps"],
                      "max_batch": ours["max_batch"],
                      "page_size": args.page_size, "pool_pages": ours["num_pages"],
                      "pool_mib": ours["pool_bytes"] / 2**20,
                      "peak_pages_in_use": max(in_use),
                      "mean_pages_in_use": sum(in_use) / len(in_use),
                      "peak_in_use_mib": max(in_use) * page_bytes / 2**20,
                      "pages_in_use_after": ours["pages_in_use_after"],
                      "page_pairs_in_order": ours["page_pairs_in_order"],
                      "computed_tokens": ours["computed_tokens"]}
    print(json.dumps(report["ours"]))

    report["eight_bit"] = {name: serve_eight_bit(model, queue, args, name, ours)
                           for name in args.cache_dtypes}

    padded, padded_s = timed(serve_padded, model, queue, args)
    report["padded"] = {"seconds": padded_s, "tokens_per_s": wanted / padded_s,
                        "steps": padded["steps"],
                        "cache_mib_per_batch": [b / 2**20 for b in padded["cache_bytes"]],
                        "peak_cache_mib": max(padded["cache_bytes"]) / 2**20,
                        "computed_tokens": padded["computed_tokens"],
                        "needed_tokens": ours["computed_tokens"],
                        "computed_over_needed": padded["computed_tokens"]
                        / ours["computed_tokens"]}
    print(json.dumps(report["padded"]))

    alone = [torch.equal(torch.tensor(ours["outputs"][r]),
                         model.generate(prompt[None], new, temperature=0)[0, prompt.numel():])
             for r, (prompt, new) in enumerate(queue[:args.check])]
    same = [a == b for a, b in zip(ours["outputs"], padded["outputs"])]
    report["checks"] = {"checked_against_generate": len(alone),
                        "equal_generate": sum(alone), "equal_generate_each": alone,
                        "padded_equal_ours": sum(same), "requests": len(queue)}
    print(json.dumps(report["checks"]))

    report["ours_over_padded"] = report["ours"]["tokens_per_s"] / report["padded"]["tokens_per_s"]
    print(json.dumps({"ours_tokens_per_s": report["ours"]["tokens_per_s"],
                      "padded_tokens_per_s": report["padded"]["tokens_per_s"],
                      "ours_over_padded": report["ours_over_padded"], "target": 2.0}))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
