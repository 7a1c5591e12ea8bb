"""Shared helpers for the causal_attention Python tests: input construction in several memory
layouts, the SDPA reference, and the empty-row mask."""

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

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
