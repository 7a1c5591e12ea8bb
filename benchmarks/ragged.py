"""Benchmark of ragged batches and attention masks on the CPU: key masks, packed sequences and
attn_mask, against torch's scaled_dot_product_attention (SDPA) with the equivalent mask and
against our own unmasked, key-masked, packed and per-sequence calls, all timed in the same run.

Sections (--only):
  mask      key_mask of all True against the same call without a mask (the mask's overhead)
  leftpad   a left-padded batch (real lengths L, 3L/4, L/2, L/4) with its key mask, against the
            same sequences called one by one without padding (what the real tokens cost)
  packed    N sequences with lengths drawn from --packed-lengths, packed for varlen_attention,
            against SDPA on the right-padded batch with the equivalent boolean mask, and against
            the sum of separate per-sequence calls of ours
  attn_mask "causal & key padding" as a full bool (B, 1, L, L) attn_mask, against the same call
            with key_mask and against SDPA given that mask
  documents a block-diagonal mask of --packed-count documents (lengths from --packed-lengths,
            scaled to L) as attn_mask over one row of L tokens, against varlen_attention on the
            same documents
  bias      a float (1, H, L, L) attn_mask that requires grad (a learned relative-position bias),
            against SDPA with that bias

Every time is the median over --rounds interleaved rounds of torch.utils.benchmark's
blocked_autorange medians, at --threads threads;
"fwd" is the forward, "f+b" forward and backward. Writes --out (JSON) and prints a table.

    python -m benchmarks.ragged                          # the full sizes (minutes)
    python -m benchmarks.ragged --quick --out /tmp/r.json   # seconds: every path, tiny sizes
"""

import itertools
import random

import torch
import torch.nn.functional as F

import causal_attention
from causal_attention._masks import visible_keys

from .cases import MODES
from .cli import common_parser
from .sections import leaf, parse_section_args, run_sections, step

SECTIONS = ("mask", "leftpad", "packed", "attn_mask", "documents", "bias")


def parse_args(argv=None):
    parser = common_parser(__doc__, "bench_out/ragged.json")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--passes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048],
                        help="L of the mask and leftpad sections")
    parser.add_argument("--batch", type=int, default=4, help="B of the mask section")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--packed-count", type=int, default=8, help="sequences of a packed batch")
    parser.add_argument("--packed-lengths", nargs=2, type=int, default=[64, 2048],
                        metavar=("MIN", "MAX"), help="range of the packed sequences' lengths")
    args = parse_section_args(parser, argv)
    if args.quick:
        args.lengths, args.batch, args.heads = [128], 2, 2
        args.packed_count, args.packed_lengths = 3, [16, 200]
    return args


def mask_cases(args, dtype, pass_name):
    """key_mask of all True against no mask."""
    for length in args.lengths:
        q, k, v = (leaf(args.batch, args.heads, length, args.head_dim, dtype=dtype) for _ in "qkv")
        mask = torch.ones(args.batch, length, dtype=torch.bool)
        yield f"B{args.batch} L{length}", {
            "ours_unmasked": step(causal_attention.attention, (q, k, v), pass_name),
            "ours_masked": step(lambda q, k, v: causal_attention.attention(q, k, v, key_mask=mask),
                                (q, k, v), pass_name),
        }, {"ratio": ("ours_masked", "ours_unmasked")}


def leftpad_cases(args, dtype, pass_name):
    """A left-padded batch against its real tokens called one sequence at a time."""
    for length in args.lengths:
        real = [length, 3 * length // 4, length // 2, length // 4]
        q, k, v = (leaf(len(real), args.heads, length, args.head_dim, dtype=dtype) for _ in "qkv")
        mask = torch.arange(length) >= (length - torch.tensor(real))[:, None]
        alone = [[leaf(1, args.heads, n, args.head_dim, dtype=dtype) for _ in "qkv"] for n in real]
        yield f"L{length} real {real}", {
            "ours_padded": step(lambda q, k, v: causal_attention.attention(q, k, v, key_mask=mask),
                                (q, k, v), pass_name),
            "ours_separate": step(lambda *flat: [causal_attention.attention(*flat[i:i + 3])
                                                 for i in range(0, len(flat), 3)],
                                  [t for qkv in alone for t in qkv], pass_name),
        }, {"ratio": ("ours_padded", "ours_separate")}


def packed_lengths(args):
    rng = random.Random(args.seed)
    return [rng.randint(*args.packed_lengths) for _ in range(args.packed_count)]


def packed_cases(args, dtype, pass_name):
    """varlen_attention against SDPA on the padded batch with a mask, and per-sequence calls."""
    lengths = packed_lengths(args)
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    q, k, v = (leaf(total, args.heads, args.head_dim, dtype=dtype) for _ in "qkv")
    # SDPA on the right-padded batch: row i of sequence b sees keys j <= i with j < length_b.
    padded = [leaf(len(lengths), args.heads, longest, args.head_dim, dtype=dtype) for _ in "qkv"]
    real_keys = torch.arange(longest) < torch.tensor(lengths)[:, None]
    attn_mask = visible_keys(longest, longest, key_mask=real_keys)

    # The same packed rows, one call per sequence (each a (H, L_i, D) view): what packing saves
    # or costs, with the memory layout held equal.
    def sequence(i):
        return [t[cu[i]:cu[i + 1]].transpose(0, 1) for t in (q, k, v)]

    yield f"N{len(lengths)} lengths {lengths}", {
        "ours_packed": step(lambda q, k, v: causal_attention.varlen_attention(
            q, k, v, cu, cu, longest, longest), (q, k, v), pass_name),
        "sdpa_padded_masked": step(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask),
            padded, pass_name),
        "ours_separate": step(lambda q, k, v: [causal_attention.attention(*sequence(i))
                                               for i in range(len(lengths))], (q, k, v), pass_name),
    }, {"vs_sdpa": ("sdpa_padded_masked", "ours_packed"),
        "vs_separate": ("ours_packed", "ours_separate")}


def padding(batch, length):
    """Right padding of a batch: real lengths L, 7L/8, ..., one of them per batch item."""
    real = torch.tensor([length - i * length // 8 for i in range(batch)])
    return torch.arange(length) < real[:, None]


def attn_mask_cases(args, dtype, pass_name):
    """causal & key padding as a full (B, 1, L, L) bool attn_mask."""
    for length in args.lengths:
        q, k, v = (leaf(args.batch, args.heads, length, args.head_dim, dtype=dtype) for _ in "qkv")
        key_mask = padding(args.batch, length)
        full = visible_keys(length, length, key_mask=key_mask)  # (B, 1, L, L), causal included
        # Rows past a short sequence's end see their padding only in SDPA's semantics; ours sees
        # nothing there: both are the same work on real rows.
        yield f"B{args.batch} L{length}", {
            "ours_attn_mask": step(lambda q, k, v: causal_attention.attention(
                q, k, v, attn_mask=full), (q, k, v), pass_name),
            "ours_key_mask": step(lambda q, k, v: causal_attention.attention(
                q, k, v, key_mask=key_mask), (q, k, v), pass_name),
            "sdpa_attn_mask": step(lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=full | ~full.any(-1, keepdim=True)), (q, k, v), pass_name),
        }, {"vs_key_mask": ("ours_attn_mask", "ours_key_mask"),
            "vs_sdpa": ("sdpa_attn_mask", "ours_attn_mask")}


def document_lengths(args, length):
    """--packed-count lengths drawn from --packed-lengths, scaled to sum to `length`."""
    drawn = packed_lengths(args)
    lengths = [max(1, n * length // sum(drawn)) for n in drawn]
    lengths[-1] += length - sum(lengths)
    return lengths


def documents_cases(args, dtype, pass_name):
    """A block-diagonal document mask as attn_mask against varlen_attention on the documents."""
    for length in args.lengths:
        lengths = document_lengths(args, length)
        document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        mask = document[:, None] == document[None, :]
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        q, k, v = (leaf(1, args.heads, length, args.head_dim, dtype=dtype) for _ in "qkv")

        def packed(q, k, v):
            rows = [t[0].transpose(0, 1) for t in (q, k, v)]  # (L, H, D) views
            return causal_attention.varlen_attention(*rows, cu, cu, max(lengths), max(lengths))

        yield f"L{length} documents {lengths}", {
            "ours_attn_mask": step(lambda q, k, v: causal_attention.attention(
                q, k, v, attn_mask=mask), (q, k, v), pass_name),
            "ours_varlen": step(packed, (q, k, v), pass_name),
        }, {"vs_varlen": ("ours_attn_mask", "ours_varlen")}


def bias_cases(args, dtype, pass_name):
    """A learned (1, H, L, L) float bias, causal, against SDPA with it."""
    for length in args.lengths:
        q, k, v = (leaf(args.batch, args.heads, length, args.head_dim, dtype=dtype) for _ in "qkv")
        bias = leaf(1, args.heads, length, length, dtype=dtype)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        yield f"B{args.batch} L{length}", {
            "ours_bias": step(lambda q, k, v, bias: causal_attention.attention(
                q, k, v, attn_mask=bias), (q, k, v, bias), pass_name),
            "sdpa_bias": step(lambda q, k, v, bias: F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf"))), (q, k, v, bias),
                pass_name),
        }, {"vs_sdpa": ("sdpa_bias", "ours_bias")}


CASES = {"mask": mask_cases, "leftpad": leftpad_cases, "packed": packed_cases,
         "attn_mask": attn_mask_cases, "documents": documents_cases, "bias": bias_cases}


def main(argv=None):
    run_sections(parse_args(argv), CASES)


if __name__ == "__main__":
    main()
