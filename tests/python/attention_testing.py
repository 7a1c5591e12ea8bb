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
from hypothesis import HealthCheck
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

# hypothesis settings of every property test: the same examples on every run and machine (no
# database, derandomized), no deadline (the machines' speed varies), the failing example printed.
REPRODUCIBLE_EXAMPLES = dict(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

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


def sdpa_reference(q, k, v, grad_out=None, scale=None, visible=None, bias=None):
    """F.scaled_dot_product_attention with our semantics: bottom-right causal, or the boolean
    mask ``visible`` (broadcastable to (..., Hq, Lq, Lk), e.g. from ``visibility``) where given;
    with ``bias`` (float, broadcastable likewise, e.g. a Reference's logit_shift: ALiBi's), the
    float attn_mask that adds it to the visible scores (causal without ``visible``). GQA via
    enable_gqa. Returns ``(out, (dq, dk, dv))`` (grads None without ``grad_out``); rows that see
    no key are set to exactly zero in ``out`` and ``dq`` (SDPA may give NaN there).

    With ``visible``, SDPA is kept finite whatever its version does with a row of False: such
    rows see every key and get a zero ``grad_out``, which adds exactly nothing to dk and dv (their
    dS and P^T dO terms are products with zero)."""
    lq, lk = q.shape[-2], k.shape[-2]
    kwargs = {"scale": scale}
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        kwargs["enable_gqa"] = True
    if bias is not None and visible is None:
        visible = visible_keys(lq, lk)
    if visible is not None:
        no_key = ~visible.any(-1, keepdim=True)
        kwargs["attn_mask"] = visible | no_key
        if bias is not None:
            kwargs["attn_mask"] = torch.where(kwargs["attn_mask"], bias.to(q.dtype), -math.inf)
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
# With sinks that require grad, forward_and_grads returns their gradient too.
SINK_RESULT_NAMES = RESULT_NAMES + ("dsinks",)


def forward_and_grads(function, inputs, grad_out, *args, **kwargs) -> Tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)``: ``function(q, k, v, *args, **kwargs)`` on ``inputs`` (q, k, v) and
    their gradients under ``grad_out``, ``out`` detached; and ``dsinks`` after them when
    ``kwargs["sinks"]`` requires grad. The call gets leaves that require grad (detached views of
    ``inputs`` and of the sinks, same values and strides), so any tensors will do."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    sinks = kwargs.get("sinks")
    if isinstance(sinks, torch.Tensor) and sinks.requires_grad:
        kwargs = {**kwargs, "sinks": sinks.detach().requires_grad_(True)}
        leaves.append(kwargs["sinks"])
    out = function(*leaves[:3], *args, **kwargs)
    return (out.detach(),) + torch.autograd.grad(out, leaves, grad_out)


def assert_bitwise_equal(got, want, label: str = "") -> None:
    """Each of ``got``'s (out, dq, dk, dv[, dsinks]) is bitwise (``torch.equal``) ``want``'s."""
    assert len(got) == len(want), f"{label}{len(got)} results, {len(want)} expected"
    for name, a, b in zip(SINK_RESULT_NAMES, got, want):
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


def visible_keys(lq: int, lk: int, window: Tuple[int, int] = (-1, 0)) -> torch.Tensor:
    """Bool (lq, lk): True where query row i may attend key j, i + off - left <= j <= i + off +
    right with off = lk - lq (bottom-right alignment) and ``window = (left, right)``, -1 leaving
    that side unbounded. The default (-1, 0) is causal, j <= i + lk - lq."""
    left, right = window
    offsets = relative_positions(lq, lk)
    visible = torch.ones((lq, lk), dtype=torch.bool)
    if left >= 0:
        visible &= offsets >= -left
    if right >= 0:
        visible &= offsets <= right
    return visible


def relative_positions(lq: int, lk: int) -> torch.Tensor:
    """int64 (lq, lk): j - (i + lk - lq), key j's position relative to query row i's own."""
    return torch.arange(lk) - (torch.arange(lq).unsqueeze(-1) + (lk - lq))


def visibility(
    lq: int,
    lk: int,
    key_mask: Optional[torch.Tensor] = None,
    window: Tuple[int, int] = (-1, 0),
) -> torch.Tensor:
    """Bool: True where query row i may attend key j: in the window (``visible_keys``; causal by
    default) and, with a ``key_mask`` (*batch, lk), ``key_mask[..., j]``. Shape (lq, lk) without
    a mask or with a (lk,) one, else (*batch, 1, lq, lk): broadcast over heads, as the op does."""
    in_window = visible_keys(lq, lk, window)
    if key_mask is None or key_mask.dim() == 1:
        return in_window if key_mask is None else in_window & key_mask
    return in_window & key_mask[..., None, None, :]


def alibi_bias(alibi_slopes: torch.Tensor, lq: int, lk: int, q_dim: int) -> torch.Tensor:
    """float64: ALiBi's -slope[..., h] * |i + lk - lq - j| for slopes (Hq,) or (*batch, Hq), of
    shape (..., Hq, lq, lk) to add to the scores of a ``q_dim``-D q ((lq, lk) for 2-D q, whose
    one head has slopes (1,))."""
    distance = relative_positions(lq, lk).abs().to(torch.float64)
    bias = -to64(alibi_slopes)[..., None, None] * distance
    return bias.reshape(lq, lk) if q_dim < 3 else bias


def alibi_slopes_for(shape: Sequence[int]) -> torch.Tensor:
    """float32 ALiBi slopes of ``shape`` (..., Hq): the paper's 2^(-8 (h + 1) / Hq) for head h,
    divided by 1, 2, ... along the leading dims so that every batch element has its own."""
    shape = tuple(shape)
    heads = shape[-1]
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads)
    per_batch = torch.arange(1, math.prod(shape[:-1]) + 1, dtype=torch.float64).reshape(
        shape[:-1] + (1,)
    )
    return (slopes / per_batch).to(torch.float32)


def make_sinks(heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Sink logits (heads,) in ``dtype``, uniform in [-2, 6): from negligible next to the scores
    of N(0, 1) inputs to most of a row's probability."""
    return (torch.rand(heads) * 8 - 2).to(dtype)


@dataclass(frozen=True)
class ScoreOptions:
    """The score options of one call (issue 14), drawn by ``kwargs``: ``window`` and
    ``softcap`` as the op takes them; ``alibi`` None, "heads" (slopes (Hq,)) or "batch" ((*batch,
    Hq)); ``sinks`` None, "q" (in q's dtype) or "float32"; ``key_mask`` None or a
    ``make_key_mask`` kind."""

    window: Tuple[int, int] = (-1, 0)
    softcap: Optional[float] = None
    alibi: Optional[str] = None
    sinks: Optional[str] = None
    key_mask: Optional[str] = None

    def kwargs(
        self,
        dtype: torch.dtype,
        heads: int,
        batch: Tuple[int, ...] = (),
        key_mask_shape: Optional[Tuple[int, ...]] = None,
    ) -> Dict[str, object]:
        """The keyword arguments of attention and float64_reference (the same names) for q of
        ``dtype`` with ``heads`` query heads and leading dims ``batch``; sinks require grad."""
        kwargs: Dict[str, object] = {"window": self.window, "softcap": self.softcap}
        if self.alibi is not None:
            kwargs["alibi_slopes"] = alibi_slopes_for(
                (tuple(batch) if self.alibi == "batch" else ()) + (heads,)
            )
        if self.sinks is not None:
            sinks_dtype = dtype if self.sinks == "q" else torch.float32
            kwargs["sinks"] = make_sinks(heads, sinks_dtype).requires_grad_(True)
        if self.key_mask is not None:
            assert key_mask_shape is not None, "a key mask needs its shape"
            kwargs["key_mask"] = make_key_mask(key_mask_shape, self.key_mask)
        return kwargs

    def for_case(self, case: "Case", dtype: torch.dtype) -> Dict[str, object]:
        """``kwargs`` for a dense call of ``case``."""
        heads = case.hq if case.heads else 1
        batch = tuple(case.batch) if case.heads else ()
        return self.kwargs(dtype, heads, batch, case.key_mask_shape)


@dataclass
class Reference:
    """The float64 reference of one call.

    ``probs`` (..., Hq, Lq, Lk) are the attention weights applied to v, what attention_weights
    returns: zero where masked and in rows without keys, dropped and rescaled by 1 / (1 - p) with
    dropout; ``undropped`` the softmax probabilities themselves (``probs`` without dropout).
    ``grads`` (dq, dk, dv) or None, ``dsinks`` (Hq,) with sinks and grad_out, else None.
    ``sink_probs`` (..., Hq, Lq): each row's probability of its sink, exp(sink - lse) (None
    without sinks). ``visible``: which keys each row sees (broadcastable to the scores).
    ``logit_shift``: what softcap and ALiBi add to scale * q k^T where visible (0 elsewhere), i.e.
    the float attn_mask with which SDPA computes the same forward (not the same gradients with a
    softcap: the shift depends on q and k)."""

    out: torch.Tensor
    lse: torch.Tensor
    probs: torch.Tensor
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    undropped: Optional[torch.Tensor] = None
    dsinks: Optional[torch.Tensor] = None
    sink_probs: Optional[torch.Tensor] = None
    visible: Optional[torch.Tensor] = None
    logit_shift: Optional[torch.Tensor] = None


def expand_kv_heads(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """K or V with its heads repeated so that query head h reads kv head h // (Hq // Hkv)."""
    if t.dim() < 3 or t.shape[-3] in (0, heads_q):
        return t
    return t.repeat_interleave(heads_q // t.shape[-3], dim=-3)


def scaled_scores(q, k, scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """scale * q k^T in ``dtype``, K's heads expanded to q's; differentiable (leaves of that
    dtype stay in the graph)."""
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    q64, k64 = q.to(dtype), k.to(dtype)
    return q64 @ expand_kv_heads(k64, heads_q).transpose(-2, -1) * scale


def float64_reference(
    q,
    k,
    v,
    scale: float,
    grad_out=None,
    visible=None,
    *,
    key_mask: Optional[torch.Tensor] = None,
    window: Tuple[int, int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    keep: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Reference:
    """Attention with the op's semantics, materialized in float64 from the given (already
    dtype-rounded) inputs, in FlashAttention's order: scores scale * q k^T -> softcap (softcap *
    tanh(S / softcap)) -> ALiBi (-slope * |i + off - j|) -> visibility (the window and key_mask
    of ``visibility``, bottom-right aligned, or the boolean mask ``visible`` given instead,
    broadcastable to the scores) -> softmax whose denominators get exp(sink[h]) -> dropout, which
    keeps the probabilities where ``keep`` (broadcastable to them; the op's mask, which the
    reference cannot draw) and divides them by 1 - ``dropout_p``. Autograd for the gradients,
    the sinks' included. Independent of SDPA and of the op's blocked online softmax.
    ``compute_dtype=torch.float32`` gives the same materialized computation in float32: the error
    a plain float32 implementation makes, for rules that hold the op to it."""
    lq, lk = q.shape[-2], k.shape[-2]
    if visible is None:
        visible = visibility(lq, lk, key_mask, window)
    elif key_mask is not None or tuple(window) != (-1, 0):
        raise ValueError("float64_reference: give visible or key_mask and window, not both")
    if dropout_p > 0 and keep is None:
        raise ValueError(f"float64_reference: dropout_p={dropout_p} needs the keep mask")
    differentiable = grad_out is not None
    leaves = [t.detach().to(compute_dtype).requires_grad_(differentiable) for t in (q, k, v)]
    q64, k64, v64 = leaves
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    raw = scaled_scores(q64, k64, scale, compute_dtype)
    scores = raw
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, lq, lk, q.dim()).to(compute_dtype)
    logit_shift = (scores - raw).detach().masked_fill(~visible, 0.0)
    no_key = ~visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, -math.inf)
    sinks64 = None
    if sinks is None:
        # Rows without keys get finite dummy scores (their weights are zeroed below), so that
        # neither the softmax nor its gradient sees a row of -inf.
        scores = scores.masked_fill(no_key, 0.0)
        lse = torch.logsumexp(scores, -1).masked_fill(no_key.squeeze(-1), -math.inf)
        undropped = torch.softmax(scores, -1).masked_fill(no_key, 0.0)
        sink_probs = None
    else:
        # The sink is one more column of every row's softmax, which keeps rows without keys
        # finite: their keys get probability 0 and the sink 1.
        sinks64 = sinks.detach().to(compute_dtype).requires_grad_(differentiable)
        sink_column = sinks64.reshape((-1, 1, 1) if q.dim() >= 3 else (1, 1))
        with_sink = torch.cat([scores, sink_column.expand(scores.shape[:-1] + (1,))], -1)
        lse = torch.logsumexp(with_sink, -1)
        probs_with_sink = torch.softmax(with_sink, -1)
        undropped = probs_with_sink[..., :-1]
        sink_probs = probs_with_sink[..., -1].detach()
    probs = undropped
    if keep is not None:
        probs = undropped * keep / (1 - dropout_p)
    out = probs @ expand_kv_heads(v64, heads_q)
    grads = dsinks = None
    if differentiable:
        wrt = leaves + ([sinks64] if sinks64 is not None else [])
        all_grads = torch.autograd.grad(out, wrt, grad_out.to(compute_dtype))
        grads = tuple(all_grads[:3])
        if sinks64 is not None:
            dsinks = all_grads[3]
    return Reference(
        out=out.detach(),
        lse=lse.detach(),
        probs=probs.detach(),
        grads=grads,
        undropped=undropped.detach(),
        dsinks=dsinks,
        sink_probs=sink_probs,
        visible=visible,
        logit_shift=logit_shift,
    )


def abs_magnitudes(
    q, k, v, scale: float, probs, grad_out=None, *, undropped=None, sink_probs=None
) -> Dict[str, float]:
    """{"out": m, and with grad_out "dq", "dk", "dv" (and "dsinks" with ``sink_probs``)}: the
    largest element of each result's formula with every factor replaced by its absolute value
    (probs from float64_reference; with dropout ``probs`` are the dropped weights and
    ``undropped`` the softmax probabilities, with sinks ``sink_probs`` its sink_probs).

    This is the natural scale of a result's rounding error: a sum of products is as accurate as
    the sum of their magnitudes allows, however much the true result cancels. A softcap only
    scales dS by 1 - tanh^2 <= 1, so these bound its results too."""
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    q, k, v = (to64(t).abs() for t in (q, k, v))
    k_all, v_all = expand_kv_heads(k, heads_q), expand_kv_heads(v, heads_q)
    scale = abs(scale)
    if undropped is None:
        undropped = probs
    out_abs = probs @ v_all
    magnitudes = {"out": out_abs}
    if grad_out is not None:
        g = to64(grad_out).abs()
        # dS = P o (Z o dP - rowsum(dO o O)), Z the dropout's keep / (1 - p): P o Z is probs.
        row_terms = (g * out_abs).sum(-1, keepdim=True)
        ds_abs = probs * (g @ v_all.transpose(-2, -1)) + undropped * row_terms
        magnitudes["dq"] = ds_abs @ k_all * scale
        magnitudes["dk"] = ds_abs.transpose(-2, -1) @ q * scale
        magnitudes["dv"] = probs.transpose(-2, -1) @ g
        if sink_probs is not None:
            # dsinks[h] = -(the sum over head h's rows, in every batch element, of P_sink *
            # rowsum(dO o O)): the sink takes its share of every probability of the row.
            per_row = sink_probs * row_terms.squeeze(-1)
            magnitudes["dsinks"] = per_row.sum(-1).reshape(-1, heads_q).sum(0)
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


def logit_l1(q, k, scale: float, shift: Optional[torch.Tensor] = None) -> float:
    """The largest sum of |scale * q_d * k_d| over (query, key) pairs (0 without any), plus, with
    a ``shift`` (a Reference's logit_shift: ALiBi's bias and the softcap's change, zero where
    hidden), that pair's |shift|: adding it rounds relatively to both, and the softcap's tanh
    rounds relatively to its result, which is at most the raw score."""
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    products = to64(q).abs() @ expand_kv_heads(to64(k).abs(), heads_q).transpose(-2, -1)
    products = products * abs(scale)
    if shift is not None:
        products = products + shift.abs()
    return products.amax().item() if products.numel() else 0.0


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


def dsinks_tolerance(
    dtype: torch.dtype, sinks_dtype: torch.dtype, d: int, sum_length: int, l1: float
) -> float:
    """The relative tolerance of dsinks of a call in ``dtype`` with sinks in ``sinks_dtype``
    (float32 sinks with float64 q round dsinks to float32): ``sum_length`` counts the rows it
    sums over too."""
    rounding = 8 * max(UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[sinks_dtype])
    return rounding + logit_and_sum_error(dtype, d, sum_length, l1)


def option_tolerances(case: Case, dtype: torch.dtype, inputs, ref: Reference, scale: float, sinks):
    """(result tolerance, dsinks tolerance or None, logit L1) of a call of ``case`` with score
    options: the round-off bound with the options' logit shift in L1; dsinks also sums over
    every row of its head, in every batch element."""
    sum_length = case.lq + case.lk + case.d + case.value_dim
    l1 = logit_l1(*inputs[:2], scale, ref.logit_shift)
    rows = math.prod(case.batch) * case.lq if case.heads else case.lq
    sinks_tolerance = None
    if sinks is not None:
        sinks_tolerance = dsinks_tolerance(dtype, sinks.dtype, case.d, sum_length + rows, l1)
    return roundoff_tolerance(dtype, case.d, sum_length, l1), sinks_tolerance, l1


def assert_matches_float64_reference(
    case: Case,
    dtype: torch.dtype,
    inputs,
    grad_out,
    results,
    scale: float,
    options: Dict[str, object],
    dropout_p: float = 0.0,
    keep: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Reference:
    """A call of ``case`` with the score options ``options`` (the op's keyword arguments, e.g.
    ``ScoreOptions.for_case``), dropout from the keep mask ``keep``: each of its ``results`` (out,
    dq, dk, dv and, with sinks, dsinks, as ``forward_and_grads`` returns them; (out, dq, dk, dv)
    alone where the caller checks dsinks, e.g. summed over packed sequences) has its shape and
    dtype (dsinks the sinks') and is within the round-off bound of the float64 reference; so is
    attention_forward's lse (of the undropped probabilities: called without dropout). Returns
    the reference."""
    ref = float64_reference(*inputs, scale, grad_out, dropout_p=dropout_p, keep=keep, **options)
    peaks = abs_magnitudes(
        *inputs, scale, ref.probs, grad_out, undropped=ref.undropped, sink_probs=ref.sink_probs
    )
    sinks = options.get("sinks")
    tolerance, sinks_tolerance, l1 = option_tolerances(case, dtype, inputs, ref, scale, sinks)
    names = SINK_RESULT_NAMES if sinks is not None else RESULT_NAMES
    expected = (ref.out,) + ref.grads + ((ref.dsinks,) if sinks is not None else ())
    likes = (ref.out,) + tuple(inputs) + ((sinks,) if sinks is not None else ())
    assert len(results) in (len(RESULT_NAMES), len(names)), f"{len(results)} results for {names}"
    for name, actual, exact, like in zip(names, results, expected, likes):
        want_dtype = sinks.dtype if name == "dsinks" else dtype
        assert actual.shape == like.shape, f"{name}: shape {tuple(actual.shape)}"
        assert actual.dtype == want_dtype, f"{name}: dtype {actual.dtype}"
        bound = sinks_tolerance if name == "dsinks" else tolerance
        assert_close_to_reference(name, actual, exact, peaks[name], bound)

    _, lse = causal_attention.attention_forward(*(t.detach() for t in inputs), scale, **options)
    finite = torch.isfinite(ref.lse)
    assert torch.equal(lse[~finite], ref.lse[~finite].to(lse.dtype)), "lse where no key"
    if finite.any():
        # lse is kept in the accumulation dtype: the logits' and the sum's error, and its own
        # rounding (as ops/test_fuzz.py bounds it).
        error = (to64(lse[finite]) - ref.lse[finite]).abs().max().item()
        rounding = accumulation_roundoff(dtype) * ref.lse[finite].abs().max().item()
        bound = logit_and_sum_error(dtype, case.d, case.lq + case.lk, l1) + 8 * rounding
        assert error <= bound, f"lse: max error {error:.3e} > bound {bound:.3e}"
    return ref


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
