"""What an 8-bit KV cache costs in accuracy (the serving issue's point 3), in two parts:

  op       paged_attention on an 8-bit cache written by paged_cache_append (each dtype, a scale
           per tensor (calibrated: the cache's largest magnitude over the format's) and per
           token and KV head), against float64 on the unquantized keys and values: the error the
           quantization adds; and against float64 on the dequantized cache (and q as the call
           has it): the error the kernel adds (the output's rounding to q's dtype, bfloat16's
           about 4e-3 of its magnitude). Keys and values normal, with --outliers key
           channels 8x larger, as trained models' keys have.
  model    the small GPT of benchmarks.serving (seeded random weights, in bfloat16) fed each
           request of its queue, prompt and the bfloat16 cache's greedy continuation, through
           forward_paged from an fp8 and an int8 cache and from the bfloat16 cache (teacher
           forcing: every cache sees the same tokens): the logits' largest difference from the
           bfloat16 cache's, and the share of positions whose greedy token is the same.

    python -m benchmarks.quantized_accuracy                        # the serving queue (a minute)
    python -m benchmarks.quantized_accuracy --quick --out /tmp/a.json
"""

import argparse
import json
from pathlib import Path

import torch

import causal_attention as ca
from causal_attention.models import GPT
from causal_attention.quantization import FORMAT_MAX, dequantize

from .proc import cpu_name, write_report
from .serving import make_queue

LAYOUTS = ("tensor", "token")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--outliers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("bench_out/quantized_accuracy.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.length, args.requests, args.max_len = 2, 64, 3, 12
    return args


def section_op(args) -> list:
    generator = torch.Generator().manual_seed(0)
    batch, length, hkv, hq, dim, page = args.sequences, args.length, 8, 32, 128, 16
    keys = torch.randn(batch * length, hkv, dim, generator=generator)
    keys[..., :args.outliers] *= 8
    values = torch.randn(batch * length, hkv, dim, generator=generator)
    q = torch.randn(batch, 1, hq, dim, generator=generator)
    num_pages = batch * length // page
    table = torch.arange(num_pages, dtype=torch.int32).view(batch, -1)
    seqlens = torch.full((batch,), length, dtype=torch.int32)
    slots = torch.arange(batch * length)

    def attend(k_cache, v_cache, query, **scales):
        return ca.paged_attention(query, k_cache, v_cache, table, seqlens, **scales).double()

    pages = [t.view(num_pages, page, hkv, -1) for t in (keys, values)]
    exact = attend(*(p.double() for p in pages), q.double())
    rows = []
    for dtype in FORMAT_MAX:
        for layout in LAYOUTS:
            caches = [torch.empty(num_pages, page, hkv, dim, dtype=dtype) for _ in range(2)]
            if layout == "tensor":
                scales = [t.abs().amax().item() / FORMAT_MAX[dtype] for t in (keys, values)]
            else:
                scales = [torch.empty(num_pages, page, hkv) for _ in range(2)]
            ca.paged_cache_append(keys, values, *caches, slots, k_scale=scales[0],
                                  v_scale=scales[1])
            real = [dequantize(c, s if layout == "tensor" else s.unsqueeze(-1))
                    for c, s in zip(caches, scales)]
            dequantized = attend(*(r.double() for r in real), q.double())
            row = {"cache": str(dtype).removeprefix("torch."), "scales": layout}
            for q_dtype in (torch.float32, torch.bfloat16):
                got = attend(*caches, q.to(q_dtype), k_scale=scales[0], v_scale=scales[1])
                # against q as the call has it (bfloat16: rounded), the output's own rounding
                # being the rest
                own_q = attend(*(r.double() for r in real), q.to(q_dtype).double())
                name = str(q_dtype).removeprefix("torch.")
                row[f"kernel_error_{name}"] = (got - own_q).abs().max().item()
            row["quantization_error_max"] = (dequantized - exact).abs().max().item()
            row["quantization_error_rms"] = (dequantized - exact).pow(2).mean().sqrt().item()
            row["key_error_rms_over_rms"] = ((real[0].view_as(keys) - keys).pow(2).mean().sqrt()
                                             / keys.pow(2).mean().sqrt()).item()
            row["output_rms"] = exact.pow(2).mean().sqrt().item()
            print(json.dumps(row))
            rows.append(row)
    return rows


def logits_from(model, cache, tokens):
    """Each position's logits of ``tokens`` fed as one prefill per request through
    ``cache``: float32 ``(sum of lengths, vocab)``."""
    requests = list(range(len(tokens)))
    for r in requests:
        cache.allocate(r)
    step = cache.step(requests, [t.numel() for t in tokens])
    with torch.no_grad():
        return model.forward_paged(torch.cat(tokens), step).float()


def section_model(args) -> dict:
    torch.manual_seed(0)
    model = GPT(512, 2 * args.max_len + 8, 256, 8, 4, num_kv_heads=2).bfloat16().eval()
    queue = make_queue(args.requests, 4, args.max_len, 512, 0)
    tokens = []
    with torch.no_grad():
        for prompt, new in queue:
            tokens.append(model.generate(prompt[None], new, temperature=0)[0, :-1])
    pages = sum(-(-t.numel() // 16) for t in tokens)
    reference = logits_from(model, model.make_paged_cache(pages, 16), tokens)
    result = {"requests": len(queue), "positions": int(reference.shape[0])}
    for dtype, scales in ((torch.float8_e4m3fn, "tensor"), (torch.float8_e4m3fn, "token"),
                          (torch.float8_e5m2, "tensor"), (torch.int8, "token")):
        cache = model.make_paged_cache(pages, 16, dtype=dtype, scales=scales)
        logits = logits_from(model, cache, tokens)
        name = f"{str(dtype).removeprefix('torch.')}_{scales}"
        result[name] = {
            "logits_max_difference": (logits - reference).abs().max().item(),
            "logits_range": (reference.max() - reference.min()).item(),
            "same_greedy_token_share": (logits.argmax(-1) == reference.argmax(-1))
            .double().mean().item()}
        print(json.dumps({name: result[name]}))
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(2)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "cpu": cpu_name(), "torch": torch.__version__,
              "op": section_op(args), "model": section_model(args)}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
