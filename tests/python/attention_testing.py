"""Shared helpers for the causal_attention Python tests: input construction in several memory
layouts, key masks and packed (varlen) sequences, the SDPA reference, a materialized float64
reference with the magnitudes that scale its rounding errors, the round-off bound and
FlashAttention's twice-SDPA's-error rule, the causal masks, and a fresh-interpreter runner."""

import math
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import causal_attention  # noqa: F401  (loads the op library)

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
}

# Unit roundoff of each dtype.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def accumulation_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of the op's accumulators for inputs of ``dtype`` (float32, or float64)."""
    return UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]


def dtype_params(dtypes: Sequence[torch.dtype] = DTYPES):
    """``pytest.param`` per dtype, with short readable ids."""
    return [pytest.param(dtype, id=DTYPE_IDS[dtype]) for dtype in dtypes]


def make_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    layout: str = "contiguous",
    requires_grad: bool = False,
) -> torch.Tensor:
    """Random normal values of ``shape`` and ``dtype`` laid out as ``layout``; a leaf tensor.

    Layouts: "contiguous"; "transposed", the usual projection output
    ``x.view(B, L, H, D).transpose(1, 2)``; "strided", rows sliced out of a longer tensor and
    every other column (last-dim stride 2).

    Values are drawn in float32 and rounded to ``dtype``, so every dtype sees the same numbers
    up to rounding.
    """
    shape = tuple(shape)
    if layout == "contiguous":
        base = torch.randn(shape).to(dtype)
        t = base
    elif layout == "transposed":
        if len(shape) < 3:
            raise ValueError(f"layout 'transposed' needs a head dim, got shape {shape}")
        swapped = shape[:-3] + (shape[-2], shape[-3], shape[-1])
        base = torch.randn(swapped).to(dtype)
        t = base.transpose(-3, -2)
    elif layout == "strided":
        padded = shape[:-2] + (shape[-2] + 3, 2 * shape[-1])
        base = torch.randn(padded).to(dtype)
        t = base[..., 1 : shape[-2] + 1, ::2]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    assert t.shape == shape
    if requires_grad:
        # Make the view itself a leaf so that .grad lands on it, keeping its strides.
        t = t.detach().requires_grad_(True)
    return t


@dataclass(frozen=True)
class Case:
    """Shapes of one attention call.

    ``batch`` are the leading dims; ``heads=False`` gives 2-D (L, D) inputs (one head).
    """

    lq: int
    lk: int
    d: int
    dv: Optional[int] = None
    hq: int = 1
    hkv: int = 1
    batch: Tuple[int, ...] = (1,)
    heads: bool = True
    layout: str = "contiguous"

    @property
    def value_dim(self) -> int:
        return self.d if self.dv is None else self.dv

    def _shape(self, heads: int, length: int, dim: int) -> Tuple[int, ...]:
        if not self.heads:
            return (length, dim)
        return tuple(self.batch) + (heads, length, dim)

    @property
    def q_shape(self) -> Tuple[int, ...]:
        return self._shape(self.hq, self.lq, self.d)

    @property
    def k_shape(self) -> Tuple[int, ...]:
        return self._shape(self.hkv, self.lk, self.d)

    @property
    def v_shape(self) -> Tuple[int, ...]:
        return self._shape(self.hkv, self.lk, self.value_dim)

    @property
    def out_shape(self) -> Tuple[int, ...]:
        return self._shape(self.hq, self.lq, self.value_dim)

    @property
    def key_mask_shape(self) -> Tuple[int, ...]:
        """The shape of a key_mask for this call: q's leading dims, then Lk."""
        return (tuple(self.batch) if self.heads else ()) + (self.lk,)

    @property
    def gqa(self) -> bool:
        return self.heads and self.hq != self.hkv

    def inputs(self, dtype: torch.dtype, requires_grad: bool = False):
        """(q, k, v) in this case's layout."""
        return tuple(
            make_tensor(shape, dtype, self.layout, requires_grad)
            for shape in (self.q_shape, self.k_shape, self.v_shape)
        )


# --- key masks ---------------------------------------------------------------------------

def make_key_mask(shape: Sequence[int], kind: str) -> torch.Tensor:
    """A bool key mask of ``shape`` (*batch, Lk), True where a key may be attended, of a kind:

    "holes": about 30% of the keys hidden at random and, with Lk >= 128, the whole second block
    of 64 keys (a block the kernels skip rather than score -inf); "left-pad" / "right-pad": batch
    element b of n hides its first / last p_b = (b + 1) Lk // (n + 2) keys (a batch of prompts of
    several lengths; with Lq == Lk left padding leaves the first rows with no visible key);
    "all-true"; "one-all-false": holes, and the first batch element (the whole mask without a
    batch) hides every key.
    """
    shape = tuple(shape)
    lk = shape[-1]
    if kind == "all-true":
        return torch.ones(shape, dtype=torch.bool)
    if kind in ("holes", "one-all-false"):
        mask = torch.rand(shape) >= 0.3
        if lk >= 128:
            mask[..., 64:128] = False
        if kind == "one-all-false":
            mask.view(-1, lk)[0] = False
        return mask
    if kind in ("left-pad", "right-pad"):
        rows = math.prod(shape[:-1])
        pads = torch.tensor([(b + 1) * lk // (rows + 2) for b in range(rows)]).unsqueeze(-1)
        keys = torch.arange(lk)
        kept = keys >= pads if kind == "left-pad" else keys < lk - pads
        return kept.reshape(shape)
    raise ValueError(f"unknown key mask kind {kind!r}")


# --- packed sequences (varlen_attention) --------------------------------------------------


def cumulative_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """int32 (N + 1,): 0, then the running sums of ``lengths``."""
    sums = [0]
    for length in lengths:
        sums.append(sums[-1] + length)
    return torch.tensor(sums, dtype=torch.int32)


@dataclass(frozen=True)
class Packed:
    """Shapes of one varlen_attention call: sequence i has ``lengths_q[i]`` query rows and
    ``lengths_k[i]`` keys; q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv)."""

    lengths_q: Tuple[int, ...]
    lengths_k: Tuple[int, ...]
    d: int
    dv: Optional[int] = None
    hq: int = 1
    hkv: int = 1

    def __post_init__(self):
        assert len(self.lengths_q) == len(self.lengths_k)

    @property
    def value_dim(self) -> int:
        return self.d if self.dv is None else self.dv

    @property
    def total_q(self) -> int:
        return sum(self.lengths_q)

    @property
    def total_k(self) -> int:
        return sum(self.lengths_k)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.lengths_q, default=0)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.lengths_k, default=0)

    @property
    def q_shape(self) -> Tuple[int, ...]:
        return (self.total_q, self.hq, self.d)

    @property
    def k_shape(self) -> Tuple[int, ...]:
        return (self.total_k, self.hkv, self.d)

    @property
    def v_shape(self) -> Tuple[int, ...]:
        return (self.total_k, self.hkv, self.value_dim)

    @property
    def out_shape(self) -> Tuple[int, ...]:
        return (self.total_q, self.hq, self.value_dim)

    def lengths_args(self) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
        """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), the longest lengths."""
        return (
            cumulative_lengths(self.lengths_q),
            cumulative_lengths(self.lengths_k),
            self.max_seqlen_q,
            self.max_seqlen_k,
        )

    def inputs(self, dtype: torch.dtype, requires_grad: bool = False):
        """(q, k, v), contiguous, values drawn as ``make_tensor`` draws them."""
        return tuple(
            make_tensor(shape, dtype, requires_grad=requires_grad)
            for shape in (self.q_shape, self.k_shape, self.v_shape)
        )

    def split(self, t: torch.Tensor, keys: bool) -> List[torch.Tensor]:
        """The sequences of a packed (total, H, dim) tensor as (H, L_i, dim) views: by the key
        lengths (``keys``) or the query lengths."""
        lengths = self.lengths_k if keys else self.lengths_q
        return [part.transpose(0, 1) for part in torch.split(t, list(lengths))]

    def pad(self, t: torch.Tensor, keys: bool) -> torch.Tensor:
        """A packed (total, H, dim) tensor as a zero-padded batch (N, H, max_len, dim), each
        sequence at the start of its row (right padding)."""
        parts = self.split(t, keys)
        longest = self.max_seqlen_k if keys else self.max_seqlen_q
        padded = t.new_zeros((len(parts), t.shape[1], longest, t.shape[2]))
        for i, part in enumerate(parts):
            padded[i, :, : part.shape[1]] = part
        return padded

    def unpad(self, padded: torch.Tensor, keys: bool) -> torch.Tensor:
        """The inverse of ``pad``: (N, H, max_len, dim) back to packed (total, H, dim)."""
        lengths = self.lengths_k if keys else self.lengths_q
        parts = [padded[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)]
        if not parts:
            return padded.new_zeros((0, padded.shape[1], padded.shape[3]))
        return torch.cat(parts)

    def padded_visibility(self) -> torch.Tensor:
        """Bool (N, 1, max_seqlen_q, max_seqlen_k) for the ``pad``-ded batch: row i of sequence n
        sees key j iff both are in the sequence and j <= i + lengths_k[n] - lengths_q[n]."""
        rows = torch.arange(self.max_seqlen_q).unsqueeze(-1)
        keys = torch.arange(self.max_seqlen_k)
        masks = [
            (rows < lq) & (keys < lk) & (keys <= rows + (lk - lq))
            for lq, lk in zip(self.lengths_q, self.lengths_k)
        ]
        if not masks:
            return torch.zeros((0, 1, self.max_seqlen_q, self.max_seqlen_k), dtype=torch.bool)
        return torch.stack(masks).unsqueeze(1)


def empty_rows(lq: int, lk: int) -> torch.Tensor:
    """Bool (lq,): True for query rows that see no key (row i sees key j iff j <= i + lk - lq)."""
    return torch.arange(lq) + (lk - lq) < 0


def sdpa_reference(q, k, v, grad_out=None, scale=None, visible=None):
    """F.scaled_dot_product_attention with our semantics: bottom-right causal, or the boolean
    mask ``visible`` (broadcastable to (..., Hq, Lq, Lk), e.g. from ``visibility``) where given;
    GQA via enable_gqa. Returns ``(out, (dq, dk, dv))`` (grads None without ``grad_out``); rows
    that see no key are set to exactly zero in ``out`` and ``dq`` (SDPA may give NaN there).

    With ``visible``, SDPA is kept finite whatever its version does with a row of False: such
    rows see every key and get a zero ``grad_out``, which adds exactly nothing to dk and dv (their
    dS and P^T dO terms are products with zero)."""
    lq, lk = q.shape[-2], k.shape[-2]
    kwargs = {"scale": scale}
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        kwargs["enable_gqa"] = True
    if visible is not None:
        no_key = ~visible.any(-1, keepdim=True)
        kwargs["attn_mask"] = visible | no_key
        if grad_out is not None:
            grad_out = grad_out.masked_fill(no_key, 0)
    elif lq == lk:
        no_key = empty_rows(lq, lk).unsqueeze(-1)
        kwargs["is_causal"] = True
    else:
        no_key = empty_rows(lq, lk).unsqueeze(-1)
        with warnings.catch_warnings():
            # "Lower right causal bias will produce NaNs ... when seq_len_q > seq_len_kv": handled.
            warnings.simplefilter("ignore", UserWarning)
            kwargs["attn_mask"] = causal_lower_right(lq, lk)
    leaves = [t.detach().requires_grad_(grad_out is not None) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, **kwargs)
    grads = (None, None, None)
    if grad_out is not None:
        grads = torch.autograd.grad(out, leaves, grad_out)
    out = torch.where(no_key, torch.zeros((), dtype=out.dtype), out.detach())
    if grads[0] is not None:
        grads = (torch.where(no_key, torch.zeros((), dtype=q.dtype), grads[0]),) + tuple(grads[1:])
    return out, grads


# FlashAttention's accuracy rule: in every dtype, each result is at most twice as far from the
# float64 answer as PyTorch's own kernel in that dtype, plus this much (absolute) for round-off
# where SDPA happens to be exact.
SDPA_RULE_SLACK = 1e-6


def twice_sdpa_error_failures(names, ours, same, ref) -> List[str]:
    """The results among ``names`` that break the rule ``max|ours - ref| <= 2 * max|same - ref|
    + SDPA_RULE_SLACK``, described; ``same`` is SDPA in the inputs' dtype and ``ref`` SDPA in
    float64 on the same (dtype-rounded) inputs (``sdpa_reference``)."""
    failures = []
    for name, a, s, r in zip(names, ours, same, ref):
        assert torch.isfinite(r).all(), f"reference {name} is not finite"
        err = max_abs_diff(a, r)
        sdpa_err = max_abs_diff(s, r)
        bound = 2 * sdpa_err + SDPA_RULE_SLACK
        if not err <= bound:
            failures.append(f"{name}: ours {err:.3g} > bound {bound:.3g} (sdpa {sdpa_err:.3g})")
    return failures


RESULT_NAMES = ("out", "dq", "dk", "dv")


def forward_and_grads(function, inputs, grad_out, *args, **kwargs) -> Tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)``: ``function(q, k, v, *args, **kwargs)`` on ``inputs`` (q, k, v) and
    their gradients under ``grad_out``, ``out`` detached. The call gets leaves that require grad
    (detached views of ``inputs``, same values and strides), so any tensors will do."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = function(*leaves, *args, **kwargs)
    return (out.detach(),) + torch.autograd.grad(out, leaves, grad_out)


def assert_bitwise_equal(got, want, label: str = "") -> None:
    """Each of ``got``'s (out, dq, dk, dv) is bitwise (``torch.equal``) ``want``'s."""
    for name, a, b in zip(RESULT_NAMES, got, want):
        assert torch.equal(a, b), f"{label}{name} differs"


def to64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (to64(a) - to64(b)).abs().max().item()


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


def with_layout(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to ``values`` in memory layout ``layout``, so that a test can choose the
    values and the strides independently (``make_tensor`` draws the values itself).

    Layouts: those of ``make_tensor`` ("contiguous", "transposed" (needs a head dim), "strided"),
    and "column-major": the last two dims swapped in memory, so D is not the unit-stride dim.
    """
    if layout == "contiguous":
        return values.clone()
    if layout == "transposed":
        return values.transpose(-3, -2).contiguous().transpose(-3, -2)
    if layout == "column-major":
        return values.transpose(-2, -1).contiguous().transpose(-2, -1)
    if layout == "strided":
        rows, cols = values.shape[-2:]
        padded = values.new_zeros(values.shape[:-2] + (rows + 3, 2 * cols))
        view = padded[..., 1 : rows + 1, ::2]
        view.copy_(values)
        return view
    raise ValueError(f"unknown layout {layout!r}")


def visible_keys(lq: int, lk: int) -> torch.Tensor:
    """Bool (lq, lk): True where query row i may attend key j (j <= i + lk - lq)."""
    return torch.arange(lk) <= torch.arange(lq).unsqueeze(-1) + (lk - lq)


def visibility(lq: int, lk: int, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bool: True where query row i may attend key j: causal (``visible_keys``) and, with a
    ``key_mask`` (*batch, lk), ``key_mask[..., j]``. Shape (lq, lk) without a mask or with a
    (lk,) one, else (*batch, 1, lq, lk): broadcast over heads, as the op does."""
    causal = visible_keys(lq, lk)
    if key_mask is None or key_mask.dim() == 1:
        return causal if key_mask is None else causal & key_mask
    return causal & key_mask[..., None, None, :]


@dataclass
class Reference:
    """The float64 reference of one call: ``probs`` (..., Hq, Lq, Lk) are the attention weights
    (zero where masked and in rows without keys), ``grads`` (dq, dk, dv) or None."""

    out: torch.Tensor
    lse: torch.Tensor
    probs: torch.Tensor
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def expand_kv_heads(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """K or V with its heads repeated so that query head h reads kv head h // (Hq // Hkv)."""
    if t.dim() < 3 or t.shape[-3] in (0, heads_q):
        return t
    return t.repeat_interleave(heads_q // t.shape[-3], dim=-3)


def float64_reference(q, k, v, scale: float, grad_out=None, visible=None) -> Reference:
    """Attention with the op's semantics, materialized in float64 from the given (already
    dtype-rounded) inputs: scores, bottom-right causal mask (or the boolean mask ``visible``,
    broadcastable to the scores, e.g. from ``visibility``), softmax, weighted sum; autograd for
    the gradients. Independent of SDPA and of the op's blocked online softmax."""
    lq, lk = q.shape[-2], k.shape[-2]
    leaves = [to64(t).requires_grad_(grad_out is not None) for t in (q, k, v)]
    q64, k64, v64 = leaves
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    scores = q64 @ expand_kv_heads(k64, heads_q).transpose(-2, -1) * scale
    if visible is None:
        visible = visible_keys(lq, lk)
    no_key = ~visible.any(-1, keepdim=True)
    # Rows without keys get finite dummy scores (their weights are zeroed below), so that neither
    # the softmax nor its gradient sees a row of -inf.
    scores = scores.masked_fill(~visible, -math.inf).masked_fill(no_key, 0.0)
    lse = torch.logsumexp(scores, -1).masked_fill(no_key.squeeze(-1), -math.inf)
    probs = torch.softmax(scores, -1).masked_fill(no_key, 0.0)
    out = probs @ expand_kv_heads(v64, heads_q)
    grads = None
    if grad_out is not None:
        grads = torch.autograd.grad(out, leaves, to64(grad_out))
    return Reference(out.detach(), lse.detach(), probs.detach(), grads)


def abs_magnitudes(q, k, v, scale: float, probs, grad_out=None) -> Dict[str, float]:
    """{"out": m, and with grad_out "dq", "dk", "dv"}: the largest element of each result's
    formula with every factor replaced by its absolute value (probs from float64_reference).

    This is the natural scale of a result's rounding error: a sum of products is as accurate as
    the sum of their magnitudes allows, however much the true result cancels."""
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    q, k, v = (to64(t).abs() for t in (q, k, v))
    k_all, v_all = expand_kv_heads(k, heads_q), expand_kv_heads(v, heads_q)
    scale = abs(scale)
    out_abs = probs @ v_all
    magnitudes = {"out": out_abs}
    if grad_out is not None:
        g = to64(grad_out).abs()
        ds_abs = probs * (g @ v_all.transpose(-2, -1) + (g * out_abs).sum(-1, keepdim=True))
        magnitudes["dq"] = ds_abs @ k_all * scale
        magnitudes["dk"] = ds_abs.transpose(-2, -1) @ q * scale
        magnitudes["dv"] = probs.transpose(-2, -1) @ g
    return {name: (m.amax().item() if m.numel() else 0.0) for name, m in magnitudes.items()}


# --- round-off bound -----------------------------------------------------------------------
#
# For each result X, |X - X_ref| <= tolerance * max(X|abs), where X|abs is X's reference formula
# with every factor replaced by its absolute value (abs_magnitudes), and tolerance is a sum of
# three relative errors: rounding to the dtype (8 u_io); the logits' error (8 u_acc sqrt(D) L1,
# L1 the largest sum of |scale * q_d * k_d|), which perturbs the softmax weights relatively by as
# much; and float32 (float64) accumulation over the sums' lengths (2 u_acc n: linear, as sums of
# equal terms, e.g. from stride-0 inputs, round alike). ops/test_fuzz.py holds it to thousands of
# random calls, where the largest error is below 1/4 of the bound.


def logit_l1(q, k, scale: float) -> float:
    """The largest sum of |scale * q_d * k_d| over (query, key) pairs (0 without any)."""
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    products = to64(q).abs() @ expand_kv_heads(to64(k).abs(), heads_q).transpose(-2, -1)
    return products.amax().item() * abs(scale) if products.numel() else 0.0


def logit_and_sum_error(dtype: torch.dtype, d: int, sum_length: int, l1: float) -> float:
    """The logits' and the accumulation's share of the tolerance; ``sum_length`` is
    Lq + Lk + D + Dv."""
    return accumulation_roundoff(dtype) * (8 * math.sqrt(d) * l1 + 2 * sum_length)


def roundoff_tolerance(dtype: torch.dtype, d: int, sum_length: int, l1: float) -> float:
    """The relative tolerance of a result of a call in ``dtype`` (see above)."""
    return 8 * UNIT_ROUNDOFF[dtype] + logit_and_sum_error(dtype, d, sum_length, l1)


def assert_close_to_reference(name, actual, expected, peak: float, tolerance: float):
    """``actual`` is finite and within ``tolerance * peak`` of the float64 ``expected``."""
    assert torch.isfinite(actual).all(), f"{name} has non-finite values"
    if actual.numel() == 0:
        return
    error = (to64(actual) - to64(expected)).abs().max().item()
    bound = tolerance * peak + 1e-300
    assert error <= bound, f"{name}: max error {error:.3e} > bound {bound:.3e} (peak {peak:.3e})"


def run_python(script: str, path: Path, timeout: float) -> subprocess.CompletedProcess:
    """Runs ``script`` in a fresh interpreter, in directory ``path`` and with ``path`` first on
    its import path (so ``import causal_attention`` finds the package there); text output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
