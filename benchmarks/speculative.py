"""Speculative (draft-and-verify) greedy decoding of a continuous-batching queue on the CPU,
against the target GPT's plain greedy decoding of the same queue (benchmarks/serving.py's
scheduler: one forward_paged call a step, one token per running request).

A draft GPT proposes --depth tokens per request and step, as a chain, or as a tree of two
branches (its top-2 tokens first, its greedy chain below each); the target verifies every
running request's drafts in one forward_paged call per step (a tree mask, spec_mask, through
PagedKVCache.step, positions by depth), outputs the longest draft prefix equal to its own greedy
choices and then its own next token, and both caches truncate the rejected tokens' slots
(benchmarks/speculative_decoding.py). Requests of different prompt and output lengths (uniform
in --min-len..--max-len, random tokens) join as others finish, --max-batch at a time.

It prints, for each draft and shape: the acceptance rate (accepted draft tokens over those
proposed along one branch), the target's forward calls per output token (prefills included;
plain decoding's beside), output tokens/s of both (each whole queue timed once, after a warm-up
run), and whether every request's tokens equal plain decoding's. The drafts: the target itself
(every draft accepted: the upper bound on what speculation saves in target calls), with
--draft-layers N the target's first N blocks (its embeddings and head), and with
--draft-checkpoint a model `python -m training.train --out PATH` saved (then the target is
--target-checkpoint's, or random weights of its vocabulary).

    python -m benchmarks.speculative --quick    # seconds: tiny random models and queue
    python -m benchmarks.speculative            # a fuller queue (a minute or so)
"""

import argparse
import copy
import time
from pathlib import Path

import torch

from causal_attention.models import GPT

from .proc import cpu_name
from .serving import make_queue, pages, serve_continuous
from .speculative_decoding import Speculator, accept_greedy


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seconds: tiny models and queue")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--embed-dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model-max-len", type=int, default=512)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=8, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=96, help="longest prompt and output")
    parser.add_argument("--max-batch", type=int, default=4, help="requests running at once")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--depth", type=int, default=4, help="draft tokens per request a step")
    parser.add_argument("--shapes", nargs="+", default=["chain", "tree"],
                        choices=["chain", "tree"])
    parser.add_argument("--dtype", choices=["float32", "float64"], default=None,
                        help="the models' (float32; --quick: float64, so that no near-tie of "
                             "an argmax can differ between the two decodings)")
    parser.add_argument("--draft-layers", type=int,
                        help="also a draft of the target's first N blocks (its embeddings and "
                             "head; --quick: 1)")
    parser.add_argument("--draft-checkpoint", type=Path, help="a training.train checkpoint")
    parser.add_argument("--target-checkpoint", type=Path, help="a training.train checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.min_len, args.max_len, args.model_max_len = 5, 2, 12, 64
        args.embed_dim, args.layers, args.heads, args.kv_heads = 32, 2, 4, 2
        args.max_batch, args.page_size, args.depth = 3, 4, 3
        args.dtype = args.dtype or "float64"
        args.draft_layers = args.draft_layers or 1
    args.dtype = getattr(torch, args.dtype or "float32")
    if not 1 <= args.depth <= 21:
        parser.error(f"--depth must be in [1, 21] (a tree step's 64 new tokens), got "
                     f"{args.depth}")
    if args.draft_layers is not None and not 1 <= args.draft_layers <= args.layers:
        parser.error(f"--draft-layers must be in [1, --layers={args.layers}], got "
                     f"{args.draft_layers}")
    return args


def random_gpt(args, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(args.vocab, args.model_max_len, args.embed_dim, args.heads, args.layers,
               num_kv_heads=args.kv_heads).to(args.dtype).eval()


def checkpoint_gpt(path: Path, dtype: torch.dtype) -> GPT:
    """The model of a training.train checkpoint, built from the run flags it saved."""
    from training.train import build_model  # the training package only when asked for

    state = torch.load(path, map_location="cpu", weights_only=False)
    model = build_model(argparse.Namespace(**state["run"], attention="causal_attention"))
    model.load_state_dict(state["model"])
    return model.to(dtype).eval()


def first_blocks(target: GPT, layers: int) -> GPT:
    """A draft sharing the target's embeddings, first ``layers`` blocks and head (its own
    copy: the target keeps every block)."""
    draft = copy.deepcopy(target)
    draft.blocks = draft.blocks[:layers]
    return draft


def pool_pages(args) -> int:
    """Pages for --max-batch requests of the longest length, their drafts, and a fork's copy."""
    return args.max_batch * (pages(2 * args.max_len + 4 * args.depth + 4, args.page_size) + 4)


def timed(run):
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def speculate(target: GPT, draft: GPT, queue: list, args, shape: str,
              accept=accept_greedy) -> dict:
    """The queue decoded by draft and verify (one Speculator run)."""
    speculator = Speculator(target, draft, args.depth, 1 if shape == "chain" else 2,
                            args.max_batch, args.page_size, pool_pages(args), accept=accept)
    return speculator.run(queue)


def compare(name: str, target: GPT, draft: GPT, queue: list, args, plain: dict,
            plain_s: float) -> dict:
    """Every shape's speculative run against plain decoding; prints a line each."""
    tokens = sum(len(o) for o in plain["outputs"])
    rows = {}
    for shape in args.shapes:
        speculate(target, draft, queue[:2], args, shape)  # warm-up
        result, seconds = timed(lambda: speculate(target, draft, queue, args, shape))
        equal = result["outputs"] == plain["outputs"]
        rows[shape] = dict(result, seconds=seconds, equal=equal)
        print(f"{name:>14} {shape:>5} k={args.depth}: acceptance "
              f"{result['accepted'] / max(result['proposed'], 1):6.1%}, target calls/token "
              f"{result['target_calls'] / tokens:.3f} (plain {plain['steps'] / tokens:.3f}), "
              f"tokens/s {tokens / seconds:7.1f} (plain {tokens / plain_s:7.1f}, "
              f"{plain_s / seconds:.2f}x), draft calls {result['draft_calls']}, tokens equal "
              f"plain decoding's: {equal}")
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target = (checkpoint_gpt(args.target_checkpoint, args.dtype) if args.target_checkpoint
              else random_gpt(args, args.seed))
    args.vocab = target.tok_emb.num_embeddings
    queue = make_queue(args.requests, args.min_len, args.max_len, args.vocab, args.seed)
    queue = [(prompt, min(new, target.max_len - prompt.numel())) for prompt, new in queue]
    serving = argparse.Namespace(page_size=args.page_size, max_batch=args.max_batch)
    with torch.no_grad():
        serve_continuous(target, queue[:2], serving, num_pages=pool_pages(args))  # warm-up
        plain, plain_s = timed(lambda: serve_continuous(target, queue, serving,
                                                        num_pages=pool_pages(args)))
    tokens = sum(len(o) for o in plain["outputs"])
    print(f"{cpu_name()}, {args.threads} threads, {args.dtype}: {len(queue)} requests, "
          f"{tokens} output tokens, at most {args.max_batch} at once; plain greedy decoding "
          f"{plain['steps']} target calls, {tokens / plain_s:.1f} tokens/s")
    report = {"draft=target": compare("draft=target", target, target, queue, args, plain,
                                      plain_s)}
    if args.draft_layers and not args.target_checkpoint:
        name = f"draft={args.draft_layers}/{args.layers} blocks"
        report[name] = compare(name, target, first_blocks(target, args.draft_layers), queue,
                               args, plain, plain_s)
    if args.draft_checkpoint:
        draft = checkpoint_gpt(args.draft_checkpoint, args.dtype)
        report["draft"] = compare("draft", target, draft, queue, args, plain, plain_s)
    return report


if __name__ == "__main__":
    main()
