"""Inputs of dense attention calls: random tensors in several memory layouts, the shapes of one
call (``Case``), key masks of several kinds, ALiBi slopes, sinks and the score options of one
call (``ScoreOptions``)."""

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch


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


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


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


# --- score options ---------------------------------------------------------------------

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
    """The score options of one call, drawn by ``kwargs``: ``window`` and ``softcap``
    as the op takes them; ``alibi`` None, "heads" (slopes (Hq,)) or "batch" ((*batch,
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
