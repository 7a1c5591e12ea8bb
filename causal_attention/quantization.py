"""Keys and values in 8-bit KV caches (``torch.float8_e4m3fn``, ``torch.float8_e5m2``,
``torch.int8``): the formats' ranges, quantizing values with a scale (stored value x scale =
key or value, what :func:`causal_attention.paged_attention` reads), the scales one token and
KV head computes for itself, and the scale arguments of a write, checked and resolved.

A scale is given per tensor (a float or a one-element tensor: vLLM's per-layer ``k_scale``,
calibrated beforehand) or kept per token and KV head in a float32 tensor
``(num_pages, page_size, Hkv)`` beside the pages, which each write fills for the rows it writes
(:func:`token_scales`): no calibration, and int8 keeps each token's own range."""

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor


def format_max(dtype: torch.dtype) -> float:
    """The largest finite value of the 8-bit format ``dtype`` (:data:`FORMAT_MAX`); ValueError
    for another dtype. Spelled out rather than read from the dict: TorchScript compiles the
    functions that call it (KVCache's 8-bit appends) and reads no global dict."""
    if dtype == torch.float8_e4m3fn:
        return 448.0
    if dtype == torch.float8_e5m2:
        return 57344.0
    if dtype == torch.int8:
        return 127.0
    raise ValueError(f"causal_attention.quantization: {dtype} is not an 8-bit cache format")


#: The largest finite value of each 8-bit cache format; quantized values saturate there.
FORMAT_MAX = {d: format_max(d) for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)}


def is_eight_bit(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the 8-bit cache formats (:data:`FORMAT_MAX`)."""
    return dtype in FORMAT_MAX


def quantize(x: Tensor, scale: Union[Tensor, float], dtype: torch.dtype) -> Tensor:
    """``x / scale`` in float32 (``scale`` broadcasts against ``x``), rounded to the nearest
    value of ``dtype`` (float8: nearest, ties to even, torch's conversion; int8: ``round``, ties
    to even, symmetric in [-127, 127]) after saturating to its finite range (:data:`FORMAT_MAX`):
    a value beyond the range stores the range's end, not NaN or inf. ``x`` must be finite."""
    limit = format_max(dtype)
    # TorchScript (KVCache's 8-bit appends compile) divides by a Union only once refined.
    if isinstance(scale, Tensor):
        scaled = x.detach().float() / scale
    else:
        scaled = x.detach().float() / scale
    # Saturate before converting: float8_e5m2 rounds values past its range to inf, and int8
    # would wrap around.
    scaled = scaled.clamp_(-limit, limit)
    if dtype == torch.int8:
        scaled = scaled.round_()
    return scaled.to(dtype)


def positive_finite_in_float32(value: float) -> bool:
    """Whether a scale of one tensor holds as the kernels read it: positive and finite once
    rounded to float32 (``1e39`` is inf there, ``1e-46`` zero). TorchScript compiles it."""
    single = torch.tensor(value, dtype=torch.float32)
    return bool(torch.isfinite(single)) and bool(single > 0)


def dequantize(stored: Tensor, scale: Union[Tensor, float]) -> Tensor:
    """The keys or values ``stored x scale`` in float32, as
    :func:`causal_attention.paged_attention` reads an 8-bit cache (``scale`` broadcasts against
    ``stored``)."""
    return stored.float() * scale


def token_scales(x: Tensor, dtype: torch.dtype) -> Tensor:
    """One scale per row of ``x (..., D)`` for storing it in ``dtype``: the row's largest
    ``|x|`` over D divided by the format's largest value (:data:`FORMAT_MAX`), float32
    ``(...)``, so the row's largest entry stores as the format's largest. A row of zeros gets 1
    (any positive scale stores it exactly, and the reader refuses 0); a scale that would
    underflow float32 is the smallest normal float32 instead, which still holds the row."""
    amax = x.detach().float().abs().amax(dim=-1)
    # The smallest positive normal float32, torch.finfo(torch.float32).tiny, as a literal:
    # TorchScript reads no global float.
    scale = (amax / format_max(dtype)).clamp_(min=1.1754943508222875e-38)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


class Scale(NamedTuple):
    """A write's scale argument, resolved (:func:`write_scale`): ``per_token`` tensors
    ``(num_pages, page_size, Hkv)`` take the computed scales of the rows written; otherwise
    ``value`` is the given scale as a float32 0-d tensor."""

    per_token: bool
    value: Tensor


def write_scale(fn: str, name: str, scale, cache: Tensor) -> Optional[Scale]:
    """Checks the scale argument ``name`` (``k_scale``/``v_scale``) of a write into ``cache``
    and resolves it: None for a cache in a float dtype (which takes no scale), else a
    :class:`Scale`. A tensor of the pool's scale shape ``(num_pages, page_size, Hkv)`` is per
    token (float32, written into); a float or a one-element tensor (floating) is the scale of
    the whole cache, which must be positive and finite in float32 (the reader's precision); None
    is 1. Raises TypeError for a dtype or type, ValueError for a shape or value, naming
    ``name``."""
    eight_bit = is_eight_bit(cache.dtype)
    if scale is None:
        return Scale(False, torch.ones((), dtype=torch.float32)) if eight_bit else None
    if not eight_bit:
        raise ValueError(f"{fn}: {name} scales an 8-bit cache ({_formats()}); the cache is "
                         f"{cache.dtype}, stored as given")
    pool = tuple(cache.shape[:3])
    if isinstance(scale, Tensor) and scale.dim() == 3 and tuple(scale.shape) == pool:
        if scale.dtype != torch.float32:
            raise TypeError(f"{fn}: {name} (one scale per token and KV head) must be float32, "
                            f"got {name}.dtype={scale.dtype}")
        if scale.device != cache.device:
            raise ValueError(f"{fn}: {name} must be on the cache's device {cache.device}, got "
                             f"{scale.device}")
        if any(st == 0 and n > 1 for st, n in zip(scale.stride(), scale.shape)):
            raise ValueError(f"{fn}: {name} is written one scale per slot: its entries must not "
                             f"share memory, got strides {scale.stride()}")
        return Scale(True, scale)
    if isinstance(scale, Tensor):
        if scale.numel() != 1 or scale.dim() > 1:
            raise ValueError(f"{fn}: {name} must be one scale per tensor (a float or a "
                             f"one-element tensor) or one per token and KV head, (num_pages, "
                             f"page_size, Hkv)={pool}, got {name}.shape={tuple(scale.shape)}")
        if not scale.is_floating_point():
            raise TypeError(f"{fn}: {name} (one scale per tensor) must be floating, got "
                            f"{name}.dtype={scale.dtype}")
        value = float(scale.item())
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        value = float(scale)
    else:
        raise TypeError(f"{fn}: {name} must be a float or a tensor, got "
                        f"{type(scale).__name__}")
    if not positive_finite_in_float32(value):
        raise ValueError(f"{fn}: {name} must be positive and finite (in float32), got {value}")
    return Scale(False, torch.tensor(value, dtype=torch.float32, device=cache.device))


def _formats() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in FORMAT_MAX)
