"""Shared helpers for the causal_attention Python tests: input construction in several memory
layouts, the SDPA reference, a materialized float64 reference with the magnitudes that scale its
rounding errors, the causal masks, and a fresh-interpreter runner."""

import math
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

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
    def gqa(self) -> bool:
        return self.heads and self.hq != self.hkv

    def inputs(self, dtype: torch.dtype, requires_grad: bool = False):
        """(q, k, v) in this case's layout."""
        return tuple(
            make_tensor(shape, dtype, self.layout, requires_grad)
            for shape in (self.q_shape, self.k_shape, self.v_shape)
        )


def empty_rows(lq: int, lk: int) -> torch.Tensor:
    """Bool (lq,): True for query rows that see no key (row i sees key j iff j <= i + lk - lq)."""
    return torch.arange(lq) + (lk - lq) < 0


def sdpa_reference(q, k, v, grad_out=None, scale=None):
    """F.scaled_dot_product_attention with our semantics: bottom-right causal, GQA via
    enable_gqa. Returns ``(out, (dq, dk, dv))`` (grads None without ``grad_out``); rows that
    see no key are set to exactly zero in ``out`` and ``dq`` (SDPA may give NaN there)."""
    lq, lk = q.shape[-2], k.shape[-2]
    kwargs = {"scale": scale}
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        kwargs["enable_gqa"] = True
    if lq == lk:
        kwargs["is_causal"] = True
    else:
        with warnings.catch_warnings():
            # "Lower right causal bias will produce NaNs ... when seq_len_q > seq_len_kv": handled.
            warnings.simplefilter("ignore", UserWarning)
            kwargs["attn_mask"] = causal_lower_right(lq, lk)
    leaves = [t.detach().requires_grad_(grad_out is not None) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, **kwargs)
    grads = (None, None, None)
    if grad_out is not None:
        grads = torch.autograd.grad(out, leaves, grad_out)
    rows = empty_rows(lq, lk).unsqueeze(-1)
    out = torch.where(rows, torch.zeros((), dtype=out.dtype), out.detach())
    if grads[0] is not None:
        grads = (torch.where(rows, torch.zeros((), dtype=q.dtype), grads[0]),) + tuple(grads[1:])
    return out, grads


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


def float64_reference(q, k, v, scale: float, grad_out=None) -> Reference:
    """Attention with the op's semantics, materialized in float64 from the given (already
    dtype-rounded) inputs: scores, bottom-right causal mask, softmax, weighted sum; autograd for
    the gradients. Independent of SDPA and of the op's blocked online softmax."""
    lq, lk = q.shape[-2], k.shape[-2]
    leaves = [to64(t).requires_grad_(grad_out is not None) for t in (q, k, v)]
    q64, k64, v64 = leaves
    heads_q = q.shape[-3] if q.dim() >= 3 else 1
    scores = q64 @ expand_kv_heads(k64, heads_q).transpose(-2, -1) * scale
    visible = visible_keys(lq, lk)
    no_key = empty_rows(lq, lk).unsqueeze(-1)
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
