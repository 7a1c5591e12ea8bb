"""Benchmark of the score options on the CPU (windows, softcap, sinks, ALiBi, dropout), each
against the plain causal op and, for windows, against torch's scaled_dot_product_attention
(SDPA) given the equivalent boolean mask, all timed in the same run.

Sections (--only):
  window     a sliding window of --window keys ((W - 1, 0)) at length --window-length, against
             the full causal call and against SDPA with the band as a boolean mask
  modifiers  softcap, sinks, ALiBi and dropout (each alone) at length --length, against the
             plain causal call

Every time is the median over --rounds interleaved rounds of torch.utils.benchmark's
blocked_autorange medians, at --threads threads; "fwd" is the forward, "f+b" forward and
backward. Writes --out (JSON) and prints a table.

    python -m benchmarks.options                            # the full sizes (minutes)
    python -m benchmarks.options --quick --out /tmp/o.json  # seconds: every path, tiny sizes
"""

import torch
import torch.nn.functional as F

import causal_attention
from causal_attention._masks import visible_keys

from .cases import MODES
from .cli import common_parser
from .sections import leaf, parse_section_args, run_sections, step

SECTIONS = ("window", "modifiers")


def parse_args(argv=None):
    parser = common_parser(__doc__, "bench_out/options.json")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--passes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--window-length", type=int, default=8192, help="L of the window section")
    parser.add_argument("--window", type=int, default=1024, help="keys a row of the window sees")
    parser.add_argument("--length", type=int, default=2048, help="L of the modifiers section")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parse_section_args(parser, argv)
    if args.quick:
        args.window_length, args.window, args.length, args.heads = 256, 64, 128, 2
    return args


def qkv(args, length, dtype):
    return [leaf(args.batch, args.heads, length, args.head_dim, dtype=dtype) for _ in "qkv"]


def window_cases(args, dtype, pass_name):
    """A sliding window against full causal attention and against SDPA with the band mask."""
    length, width = args.window_length, args.window
    tensors = qkv(args, length, dtype)
    band = visible_keys(length, length, (width - 1, 0))

    def sliding(q, k, v):
        return causal_attention.attention(q, k, v, window=(width - 1, 0))

    def masked_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band)

    yield f"B{args.batch} L{length} window {width}", {
        "ours_window": step(sliding, tensors, pass_name),
        "ours_causal": step(causal_attention.attention, tensors, pass_name),
        "sdpa_band_mask": step(masked_sdpa, tensors, pass_name),
    }, {"vs_causal": ("ours_window", "ours_causal"), "vs_sdpa": ("sdpa_band_mask", "ours_window")}


def modifier_cases(args, dtype, pass_name):
    """Each score modifier alone against the plain causal call."""
    tensors = qkv(args, args.length, dtype)
    heads = args.heads
    options = {
        "softcap": {"softcap": 30.0},
        "sinks": {"sinks": torch.zeros(heads, dtype=dtype).requires_grad_()},
        "alibi": {"alibi_slopes": 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)},
        "dropout": {"dropout_p": 0.1},
    }
    plain = step(causal_attention.attention, tensors, pass_name)
    for name, kwargs in options.items():
        # The sinks join the leaves, so that f+b computes their gradient too.
        leaves = [*tensors, *[t for t in kwargs.values() if torch.is_tensor(t) and t.requires_grad]]

        def modified(q, k, v, *_, kwargs=kwargs):
            return causal_attention.attention(q, k, v, **kwargs)

        yield f"B{args.batch} L{args.length} {name}", {
            "ours_modified": step(modified, leaves, pass_name),
            "ours_plain": plain,
        }, {"ratio": ("ours_modified", "ours_plain")}


CASES = {"window": window_cases, "modifiers": modifier_cases}


def main(argv=None):
    run_sections(parse_args(argv), CASES)


if __name__ == "__main__":
    main()
