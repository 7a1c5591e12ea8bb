"""What the benchmark runs: the implementations, the sizes of a full and a quick run, and the
timed cases planned from them.

FLOP convention (FlashAttention's): causal forward 2*B*H*L^2*D, forward+backward 3.5x that;
decode 4*B*H*Lq*Lk*D (every query sees the whole cache).
"""

import dataclasses
import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import causal_attention
from causal_attention._masks import visible_keys

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IMPLS = ("sdpa", "ours", "sdpa_math", "naive")  # sdpa first: every other row's ratio needs it
MATERIALIZING = ("sdpa_math", "naive")  # these hold L x L scores
MODES = ("fwd", "f+b")
SECTIONS = ("grid", "short", "decode", "scaling", "memory", "accuracy")


def ours(q, k, v):
    return causal_attention.attention(q, k, v)


def sdpa(q, k, v):
    """torch's scaled_dot_product_attention with our semantics: causal, bottom-right aligned
    (is_causal=True when Lq == Lk, else a causal_lower_right(Lq, Lk) mask), GQA when Hq != Hkv."""
    gqa = q.size(-3) != k.size(-3)
    if q.size(-2) == k.size(-2):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = causal_lower_right(q.size(-2), k.size(-2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def sdpa_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v)


def naive(q, k, v):
    """Materialized attention as one writes it by hand: scores, mask, softmax, product."""
    lq, lk = q.size(-2), k.size(-2)
    visible = visible_keys(lq, lk)  # bottom-right causal
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


IMPL_FN = {"ours": ours, "sdpa": sdpa, "sdpa_math": sdpa_math, "naive": naive}


@dataclasses.dataclass(frozen=True)
class Preset:
    """Every size a run uses; FULL is the full-size run, whose summary is checked against
    targets.json, QUICK a seconds-long smoke run of every code path."""

    grid_lengths: tuple
    grid_dims: tuple
    grid_bh: tuple
    short_lengths: tuple
    short_bh: tuple
    short_dim: int
    decode_batches: tuple
    decode_heads: int
    decode_lq: tuple
    decode_lk: int
    decode_dim: int
    scaling_length: int
    memory_length: int
    memory_impls: tuple
    accuracy_shape: tuple  # B, H, L, D
    limit_shapes: tuple  # (m, n, k)
    limit_flops_per_thread: float
    limit_rounds: int
    copy_mib: int
    rounds: int  # interleaved rounds of blocked_autorange per case
    min_run_time: float  # seconds of one blocked_autorange


FULL = Preset(
    grid_lengths=(1024, 2048, 4096, 8192),
    grid_dims=(64, 128),
    grid_bh=((1, 8), (4, 8)),
    short_lengths=(64, 128, 256, 512),
    short_bh=((1, 8),),
    short_dim=64,
    decode_batches=(1, 8),
    decode_heads=8,
    decode_lq=(1, 4, 16),
    decode_lk=4096,
    decode_dim=64,
    scaling_length=8192,
    memory_length=16384,
    memory_impls=("ours", "sdpa"),
    accuracy_shape=(1, 8, 1024, 64),
    limit_shapes=((64, 64, 64), (64, 64, 128), (128, 64, 128), (128, 64, 256), (256, 64, 256),
                  (256, 64, 512)),
    limit_flops_per_thread=4e9,
    limit_rounds=3,
    copy_mib=256,
    rounds=3,
    min_run_time=0.5,
)

QUICK = Preset(
    grid_lengths=(),
    grid_dims=(64,),
    grid_bh=((1, 8),),
    short_lengths=(64, 256),
    short_bh=((1, 8),),
    short_dim=64,
    decode_batches=(1,),
    decode_heads=8,
    decode_lq=(4,),
    decode_lk=4096,
    decode_dim=64,
    scaling_length=512,
    memory_length=1024,
    memory_impls=("ours",),
    accuracy_shape=(1, 2, 128, 64),
    limit_shapes=((64, 64, 64),),
    limit_flops_per_thread=2e8,
    limit_rounds=1,
    copy_mib=64,
    rounds=1,
    min_run_time=0.01,
)


@dataclasses.dataclass(frozen=True)
class Case:
    section: str  # grid, short or decode
    mode: str  # fwd, f+b
    batch: int
    heads: int
    lq: int
    lk: int
    dim: int
    dtype: str

    @property
    def label(self):
        if self.section == "decode":
            return f"decode B{self.batch} H{self.heads} Lq{self.lq} Lk{self.lk} D{self.dim}"
        return f"{self.mode} B{self.batch} H{self.heads} L{self.lq} D{self.dim}"

    @property
    def flops(self):
        if self.section == "decode":
            return 4 * self.batch * self.heads * self.lq * self.lk * self.dim
        forward = 2 * self.batch * self.heads * self.lq * self.lk * self.dim
        return forward if self.mode == "fwd" else 3.5 * forward

    @property
    def kv_bytes(self):
        return 2 * self.batch * self.heads * self.lk * self.dim * DTYPES[self.dtype].itemsize

    @property
    def scores_bytes(self):
        """What a materializing implementation holds: L x L x B x H scores (float32 at least:
        MATH upcasts reduced precision on the CPU), twice forward, four times with backward."""
        copies = 2 if self.mode == "fwd" else 4
        return self.batch * self.heads * self.lq * self.lk * 4 * copies


def plan_cases(preset, sections, dtypes, lengths=None):
    """The timed cases in run order; fwd and f+b of one shape are adjacent (shared inputs).
    `lengths`, if given, keeps only those L of the grid and short sections."""

    def kept(all_lengths):
        return [length for length in all_lengths if lengths is None or length in lengths]

    cases = []
    if "grid" in sections:
        for dtype, dim, (batch, heads), length, mode in itertools.product(
                dtypes, preset.grid_dims, preset.grid_bh, kept(preset.grid_lengths), MODES):
            cases.append(Case("grid", mode, batch, heads, length, length, dim, dtype))
    if "short" in sections:
        for dtype, (batch, heads), length, mode in itertools.product(
                dtypes, preset.short_bh, kept(preset.short_lengths), MODES):
            cases.append(Case("short", mode, batch, heads, length, length, preset.short_dim,
                              dtype))
    if "decode" in sections:
        for dtype, batch, lq in itertools.product(dtypes, preset.decode_batches, preset.decode_lq):
            cases.append(Case("decode", "fwd", batch, preset.decode_heads, lq, preset.decode_lk,
                              preset.decode_dim, dtype))
    return cases


def make_inputs(case):
    """q, k, v and the output gradient of a case, the same in every run."""
    generator = torch.Generator().manual_seed(0)

    def randn(length):
        return torch.randn(case.batch, case.heads, length, case.dim, generator=generator,
                           dtype=DTYPES[case.dtype])

    return randn(case.lq), randn(case.lk), randn(case.lk), randn(case.lq)


def forward_backward(fn, q, k, v, grad_out):
    """One forward and backward through `fn`; returns (dq, dk, dv) without touching .grad."""
    return torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)


def step(case, impl, inputs):
    """A callable running one call of the case (the forward under no_grad, or forward and
    backward) through `impl`."""
    q, k, v, grad_out = inputs
    fn = IMPL_FN[impl]
    if case.mode == "fwd":
        def forward():
            with torch.no_grad():
                fn(q, k, v)

        return forward
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return lambda: forward_backward(fn, *leaves, grad_out)
