"""AOTInductor against eager, at batch 1 on the small GPT (tests/fixtures/tiny_gpt.py), and the
cost of one call of our op inside a package:

- the GPT's forward over L tokens, eager (no_grad) and from its .pt2 package, per call and per
  token, for each L given;
- an attention-only module on tiny inputs (B=1, H=1, L=1, D=8), where the op's work is nil: the
  package's time minus eager's is what the package adds per call of our op (the proxy executor's
  boxed dispatcher call, plus the package runner's own per-run cost).

Medians of torch.utils.benchmark's blocked_autorange, eager and package timed back to back.

    python -m benchmarks.aoti [--lengths 1 8 32] [--threads N]
"""

import argparse
import tempfile
from pathlib import Path

import torch
import torch.utils.benchmark as benchmark
from torch import nn

import causal_attention
from tests.fixtures.tiny_gpt import TinyGPT


class AttentionOnly(nn.Module):
    def forward(self, q, k, v):
        return causal_attention.attention(q, k, v)


def compile_package(model: nn.Module, inputs, path: Path, dynamic_shapes=None) -> Path:
    program = torch.export.export(model, inputs, dynamic_shapes=dynamic_shapes)
    return Path(torch._inductor.aoti_compile_and_package(program, package_path=str(path)))


def median_us(fn, inputs, threads: int) -> float:
    timer = benchmark.Timer(
        stmt="fn(*inputs)", globals={"fn": fn, "inputs": inputs}, num_threads=threads
    )
    return timer.blocked_autorange(min_run_time=1.0).median * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()

    torch.manual_seed(0)
    gpt = TinyGPT().eval()
    tiny = [torch.randn(1, 1, 1, 8) for _ in range(3)]
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        # Dynamic in the length, as deployed; the batch stays 1.
        length = torch.export.Dim("length", min=1, max=32)
        sample = (torch.randint(0, 64, (1, 16)),)
        gpt_path = compile_package(gpt, sample, Path(tmp) / "gpt.pt2", ({1: length},))
        gpt_package = torch._inductor.aoti_load_package(str(gpt_path))
        op_package = torch._inductor.aoti_load_package(
            str(compile_package(AttentionOnly(), tuple(tiny), Path(tmp) / "attention.pt2"))
        )
        print(f"threads {args.threads}")
        print(f"{'small GPT, batch 1':<24}{'eager us':>10}{'package us':>12}{'ratio':>8}"
              f"{'us/token eager':>16}{'us/token package':>18}")
        for length in args.lengths:
            tokens = (torch.randint(0, 64, (1, length)),)
            eager = median_us(gpt, tokens, args.threads)
            package = median_us(gpt_package, tokens, args.threads)
            print(f"{'L=' + str(length):<24}{eager:>10.1f}{package:>12.1f}"
                  f"{package / eager:>8.2f}{eager / length:>16.1f}{package / length:>18.1f}")
        eager = median_us(AttentionOnly(), tiny, args.threads)
        package = median_us(op_package, tiny, args.threads)
        print(f"one op call, tiny inputs: eager {eager:.1f} us, package {package:.1f} us, "
              f"added by the package {package - eager:.1f} us")


if __name__ == "__main__":
    main()
