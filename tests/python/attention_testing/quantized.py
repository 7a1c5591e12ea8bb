"""8-bit K/V for the tests: quantization written out in torch (the reference the code's own is
held to), the dequantized float64 K/V, and the accuracy rule a call on an 8-bit cache meets
against the float64 reference on the dequantized K/V: the round-off bound for a float32 q, and
for bfloat16/float16 FlashAttention's rule, at most twice the error of torch's SDPA run in q's
dtype on the dequantized K/V cast to it (plus the rule's slack)."""

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .references import float64_reference, to64
from .tolerances import (
    abs_magnitudes,
    assert_close_to_reference,
    logit_l1,
    roundoff_tolerance,
    twice_sdpa_error_failures,
)

EIGHT_BIT = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
EIGHT_BIT_IDS = ["e4m3fn", "e5m2", "int8"]
Q_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
Q_DTYPE_IDS = ["f32", "bf16", "f16"]

# The largest finite magnitude of each format (int8 symmetric).
LARGEST = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}


def quantize_reference(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """``x / scale`` (the quotient in float32, the kernels' dtype) in ``dtype``: rounded to
    nearest (ties to even), saturated to +-LARGEST (int8: an integer in [-127, 127])."""
    quotient = x.to(torch.float32) / torch.as_tensor(scale, dtype=torch.float32)
    largest = LARGEST[dtype]
    if dtype == torch.int8:
        return quotient.round().clamp(-largest, largest).to(torch.int8)
    # Saturate first: float8_e5m2 rounds what lies beyond its range to inf.
    return quotient.clamp(-largest, largest).to(dtype)


def token_scale_reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 per row of the last dim: its largest magnitude over the format's (1 for zeros)."""
    scales = x.to(torch.float32).abs().amax(-1) / LARGEST[dtype]
    return torch.where(scales > 0, scales, torch.ones(()))


def random_eight_bit(shape, dtype: torch.dtype, layout: str, scale_shape=None,
                     magnitude: float = 1.0) -> Tuple[torch.Tensor, object, torch.Tensor]:
    """(stored, scale, dequantized float64) for K or V of ``shape`` with values of about
    ``magnitude``: one scale (``layout="tensor"``, a float) or one per row of the last dim
    (``"token"``, float32 ``scale_shape``, by default ``shape[:-1]``, spread over a factor of
    4 so that rows differ)."""
    x = torch.randn(shape) * magnitude
    if layout == "tensor":
        scale = float(x.abs().amax()) / LARGEST[dtype]
        stored = quantize_reference(x, dtype, scale)
        return stored, scale, to64(stored) * scale
    rows = token_scale_reference(x, dtype) * (0.25 + 0.75 * torch.rand(shape[:-1]))
    stored = quantize_reference(x, dtype, rows.unsqueeze(-1))
    scale = rows if scale_shape is None else rows.reshape(scale_shape)
    return stored, scale, to64(stored) * to64(rows).unsqueeze(-1)


def _sdpa_in_dtype(q, k64, v64, scale: float, reference, sinks: Optional[torch.Tensor]):
    """SDPA in q's dtype on the dequantized K/V cast to it, with the reference's visibility and
    logit shift (softcap's and ALiBi's change of the scores) as its float mask, and a sink as one
    more key of zeros whose mask entry is the sink's logit."""
    k, v = k64.to(q.dtype), v64.to(q.dtype)
    heads_q = q.shape[-3]
    lq, lk = q.shape[-2], k.shape[-2]
    shift = reference.logit_shift.expand(*q.shape[:-2], lq, lk)
    mask = torch.where(reference.visible, shift, -math.inf)
    if sinks is not None:
        sink = to64(sinks).view(heads_q, 1, 1).expand(*q.shape[:-2], lq, 1)
        mask = torch.cat([mask, sink], -1)
        k = torch.cat([k, k.new_zeros(*k.shape[:-2], 1, k.shape[-1])], -2)
        v = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], -2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=scale,
                                          enable_gqa=heads_q != k.shape[-3])


def assert_matches_dequantized(out, q, k64, v64, scale: float, what: str = "out",
                               **options) -> None:
    """``out`` (``(..., Hq, Lq, Dv)``) of a call on 8-bit K/V whose dequantized values are the
    float64 ``k64``/``v64`` (``(..., Hkv, Lk, D)``), bottom-right aligned, with the score
    ``options`` (window, softcap, alibi_slopes, sinks): within the round-off bound of the float64
    reference for a float32 q, and at most twice SDPA's error in q's dtype (plus slack) for
    bfloat16/float16. Every row is expected to see a key."""
    reference = float64_reference(q, k64, v64, scale, **options)
    if q.dtype == torch.float32:
        l1 = logit_l1(q, k64, scale, reference.logit_shift)
        lq, lk, d, dv = q.shape[-2], k64.shape[-2], q.shape[-1], v64.shape[-1]
        tolerance = roundoff_tolerance(torch.float32, d, lq + lk + d + dv, l1)
        peak = abs_magnitudes(q, k64, v64, scale, reference.probs)["out"]
        assert_close_to_reference(what, out, reference.out, peak, tolerance)
        return
    assert torch.isfinite(out).all(), f"{what} has non-finite values"
    sdpa = _sdpa_in_dtype(q, k64, v64, scale, reference, options.get("sinks"))
    failures = twice_sdpa_error_failures([what], [out], [sdpa], [reference.out])
    assert not failures, failures


def decode_one_page_each(q, keys, values, k_scale, v_scale, lengths, **options):
    """paged_attention of one query row a sequence, q (B, Hq, D), against the first ``lengths``
    of its 8-bit keys and values (B, L, Hkv, D or Dv) with per-token scales (B, L, Hkv), laid as
    a cache of one 512-row page a sequence (its unused rows zero, their scales 1); ``options``
    are paged_attention's (``return_lse=True`` too)."""
    from causal_attention import paged_attention

    batch, length, hkv = keys.shape[:3]
    page = 512
    k_cache = torch.zeros(batch, page, hkv, keys.shape[-1], dtype=keys.dtype)
    v_cache = torch.zeros(batch, page, hkv, values.shape[-1], dtype=values.dtype)
    k_scales, v_scales = torch.ones(batch, page, hkv), torch.ones(batch, page, hkv)
    k_cache[:, :length], v_cache[:, :length] = keys, values
    k_scales[:, :length], v_scales[:, :length] = k_scale, v_scale
    return paged_attention(q, k_cache, v_cache, torch.arange(batch, dtype=torch.int32)[:, None],
                           torch.tensor(lengths, dtype=torch.int32),
                           cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
                           max_seqlen_q=1, k_scale=k_scales, v_scale=v_scales, **options)


def one_page_each_reference(q, keys, values, k_scale, v_scale, lengths, window=(-1, 0)):
    """For each sequence b of decode_one_page_each's call: its float64 out (Hq, Dv) on the
    dequantized keys and values, and the largest of sum_j P_j |v_j| over its rows and columns
    (the scale of the rounding of the weights and of the output)."""
    group = q.shape[1] // keys.shape[2]
    k = (keys.double() * k_scale.double()[..., None]).repeat_interleave(group, dim=2)
    v = (values.double() * v_scale.double()[..., None]).repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.double(), k) / q.shape[-1] ** 0.5
    results = []
    for b, n in enumerate(lengths):
        first = 0 if window[0] < 0 else max(0, n - 1 - window[0])
        p = torch.softmax(scores[b, :, first:n], dim=-1)
        want = torch.einsum("hl,lhd->hd", p, v[b, first:n])
        peak = torch.einsum("hl,lhd->hd", p, v[b, first:n].abs()).max().item()
        results.append((want, peak))
    return results
