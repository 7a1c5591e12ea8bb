"""Benchmark of ragged batches on the CPU: key masks and packed sequences, against torch's
scaled_dot_product_attention (SDPA) with the equivalent boolean mask and against our own unmasked
and per-sequence calls, all timed in the same run.

Sections (--only):
  mask      key_mask of all True against the same call without a mask (the mask's overhead)
  leftpad   a left-padded batch (real lengths L, 3L/4, L/2, L/4) with its key mask, against the
            same sequences called one by one without padding (what the real tokens cost)
  packed    N sequences with lengths drawn from --packed-lengths, packed for varlen_attention,
            against SDPA on the right-padded batch with the equivalent boolean mask, and against
            the sum of separate per-sequence calls of ours

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

SECTIONS = ("mask", "leftpad", "packed")


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


CASES = {"mask": mask_cases, "leftpad": leftpad_cases, "packed": packed_cases}


def main(argv=None):
    run_sections(parse_args(argv), CASES)


if __name__ == "__main__":
    main()
