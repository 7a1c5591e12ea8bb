"""Compares causal_attention.attention with torch's scaled_dot_product_attention on a few shapes:
max error against a float64 reference (ours and SDPA's), and median times of forward and
forward+backward. Run by scripts/run.sh."""

import argparse

import torch

import causal_attention
from bench_common import forward_backward, median_seconds, sdpa

CASES = [
    # (label, B, Hq, Hkv, Lq, Lk, D, dtype)
    ("fp32 L=1024", 1, 8, 8, 1024, 1024, 64, torch.float32),
    ("fp32 L=4096", 1, 8, 8, 4096, 4096, 64, torch.float32),
    ("fp32 GQA 8/2, L=1024", 2, 8, 2, 1024, 1024, 64, torch.float32),
    ("fp32 decode 16 of 4096", 4, 8, 8, 16, 4096, 64, torch.float32),
    ("bf16 L=2048", 1, 8, 8, 2048, 2048, 64, torch.bfloat16),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    header = (
        f"{'case':<24} {'err ours':>9} {'err sdpa':>9} | {'fwd ms':>8} {'sdpa':>8} {'x':>5}"
        f" | {'f+b ms':>8} {'sdpa':>8} {'x':>5}"
    )
    print(header)
    print("-" * len(header))
    for label, B, Hq, Hkv, Lq, Lk, D, dtype in CASES:
        q = torch.randn(B, Hq, Lq, D, dtype=dtype, requires_grad=True)
        k = torch.randn(B, Hkv, Lk, D, dtype=dtype, requires_grad=True)
        v = torch.randn(B, Hkv, Lk, D, dtype=dtype, requires_grad=True)
        grad = torch.randn(B, Hq, Lq, D, dtype=dtype)
        with torch.no_grad():
            reference = sdpa(q.double(), k.double(), v.double())
            err_ours = (causal_attention.attention(q, k, v).double() - reference).abs().max()
            err_sdpa = (sdpa(q, k, v).double() - reference).abs().max()
        with torch.no_grad():
            fwd_ours = median_seconds(lambda: causal_attention.attention(q, k, v), args.repeats)
            fwd_sdpa = median_seconds(lambda: sdpa(q, k, v), args.repeats)
        fb_ours = median_seconds(
            lambda: forward_backward(causal_attention.attention, q, k, v, grad), args.repeats
        )
        fb_sdpa = median_seconds(lambda: forward_backward(sdpa, q, k, v, grad), args.repeats)
        print(
            f"{label:<24} {err_ours:9.2e} {err_sdpa:9.2e} | {fwd_ours * 1e3:8.2f} "
            f"{fwd_sdpa * 1e3:8.2f} {fwd_sdpa / fwd_ours:5.2f} | {fb_ours * 1e3:8.2f} "
            f"{fb_sdpa * 1e3:8.2f} {fb_sdpa / fb_ours:5.2f}"
        )
    print("x = SDPA time / our time (above 1: ours is faster)")


if __name__ == "__main__":
    main()
