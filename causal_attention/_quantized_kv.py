"""8-bit K/V outside the paged cache: the dtypes ``paged_attention`` reads (float8_e4m3fn,
float8_e5m2, int8), the checks of dequantization scales that the wrappers routing to it share,
and :func:`attention`'s 8-bit path: the dense ``(B, Hkv, Lk, D)`` K/V as a paged cache of one
page per batch item, read in place by ``paged_attention``."""

import math
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ._arguments import check_window
from ._op_arguments import call_op
from .quantization import FORMAT_MAX, positive_finite_in_float32

EIGHT_BIT_DTYPES = tuple(FORMAT_MAX)
# The query dtypes beside 8-bit K/V.
EIGHT_BIT_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_eight_bit(t: object) -> bool:
    return isinstance(t, Tensor) and t.dtype in EIGHT_BIT_DTYPES


def describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"


def check_positive_finite(fn: str, name: str, value: float) -> float:
    """A scale must be positive and finite as float32 holds it (the kernels' dtype)."""
    if not positive_finite_in_float32(value):
        raise ValueError(
            f"{fn}: {name} must be positive and finite (in float32), got {name}={value!r}"
        )
    return value


def one_scale(fn: str, name: str, value: object) -> Optional[float]:
    """A scale per tensor as a float: a real number (not a bool) or a floating one-element tensor
    of at most one dim; ``None`` for a tensor of another shape (the caller's other layouts).
    Checked positive and finite (``ValueError``); another type is a ``TypeError``."""
    if isinstance(value, Tensor):
        if value.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(
                f"{fn}: {name} dequantizes 8-bit K/V, which are not differentiable; got a "
                "tensor that requires grad (pass it detached, or call under torch.no_grad())"
            )
        if value.numel() != 1 or value.dim() > 1:
            return None
        if not value.dtype.is_floating_point:
            raise TypeError(
                f"{fn}: {name} (one scale per tensor) must be floating, got {name}.dtype="
                f"{value.dtype}"
            )
        return check_positive_finite(fn, name, float(value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return check_positive_finite(fn, name, float(value))
    raise TypeError(
        f"{fn}: {name} must be a float, a one-element tensor or a float32 tensor of one scale per "
        f"token and KV head, got {describe(value)}"
    )


def check_token_scales(fn: str, name: str, scales: Tensor, shape: Tuple[int, ...],
                       layout: str) -> Tensor:
    """A float32 CPU tensor of ``shape`` (``layout`` says its dims), one scale per token and KV
    head."""
    if tuple(scales.shape) != tuple(shape):
        raise ValueError(
            f"{fn}: {name} must be one scale per tensor (a float or a one-element tensor) or one "
            f"per token and KV head, {layout} = {tuple(shape)}, got {name}.shape="
            f"{tuple(scales.shape)}"
        )
    if scales.dtype != torch.float32:
        raise TypeError(
            f"{fn}: {name} (one scale per token and KV head) must be float32, got {name}.dtype="
            f"{scales.dtype}"
        )
    if scales.device.type != "cpu":
        raise ValueError(f"{fn}: {name} must be a CPU tensor, got {name}.device={scales.device}")
    return scales


def first_bad_scale(scales: Tensor) -> Optional[Tuple[Tuple[int, ...], float]]:
    """``None`` when every scale is positive and finite, else the index and value of the first
    that is not (one pass over the scales, no copy of them unless one is bad)."""
    if scales.numel() == 0:
        return None
    low, high = torch.aminmax(scales)
    if bool(low > 0) and bool(high < math.inf):  # NaN fails both
        return None
    bad = ~((scales > 0) & torch.isfinite(scales))
    index = tuple(int(i) for i in bad.nonzero()[0])
    return index, scales[index].item()


def refuse_bad_scales(fn: str, name: str, scales: Tensor, fixed: Sequence[int] = (),
                      shift: Sequence[int] = (), where: str = "") -> None:
    """``ValueError`` naming the first scale of ``scales`` that is not positive and finite, by
    its index in ``name``: ``scales`` is ``name`` indexed at ``fixed`` in its leading dims, then
    cut to start at ``shift`` in the others (``name[row, start:]``: ``fixed=(row,)``,
    ``shift=(start,)``)."""
    found = first_bad_scale(scales)
    if found is None:
        return
    index, value = found
    shift = list(shift) + [0] * (len(index) - len(shift))
    at = "".join(f"[{i}]" for i in list(fixed) + [i + s for i, s in zip(index, shift)])
    raise ValueError(f"{fn}: {name} must be positive and finite{where}, got {name}{at}={value}")


# --- attention(q, k, v) with 8-bit k and v -------------------------------------------------

_ATTENTION = "causal_attention.attention"


def wants_eight_bit_path(k: object, v: object, k_scale: object, v_scale: object) -> bool:
    """Whether :func:`attention` goes the 8-bit way: both K/V 8-bit, or scales given (which
    only 8-bit K/V take; the path says so). Mixed K/V without scales are the op's to refuse."""
    return (is_eight_bit(k) and is_eight_bit(v)) or k_scale is not None or v_scale is not None


def eight_bit_attention(q: Tensor, k: Tensor, v: Tensor, options: Dict[str, Any],
                        k_scale: Union[float, Tensor, None],
                        v_scale: Union[float, Tensor, None]) -> Tensor:
    """:func:`causal_attention.attention` on 8-bit ``k``/``v`` ``(B, Hkv, Lk, D)``: a paged cache
    of one page per batch item (``k.transpose(1, 2)`` is ``(num_pages=B, page_size=Lk, Hkv,
    D)``), read in place by ``paged_attention``, queries the last Lq of the Lk keys (the op's
    bottom-right alignment). Inference only. ``options`` are attention's keyword arguments but
    the scales, as given."""
    fn = _ATTENTION
    sinks = options.get("sinks")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor, got {describe(t)}")
    if not (is_eight_bit(k) and is_eight_bit(v)):
        if is_eight_bit(k) or is_eight_bit(v):
            raise TypeError(
                f"{fn}: 8-bit k and v must share one dtype (float8_e4m3fn, float8_e5m2, int8), "
                f"got k.dtype={k.dtype}, v.dtype={v.dtype}"
            )
        given = "k_scale" if k_scale is not None else "v_scale"
        raise ValueError(
            f"{fn}: {given} dequantizes 8-bit k and v (float8_e4m3fn, float8_e5m2, int8), got "
            f"k.dtype={k.dtype}, v.dtype={v.dtype}"
        )
    if k.dtype != v.dtype:
        raise TypeError(
            f"{fn}: 8-bit k and v must share one dtype, got k.dtype={k.dtype}, v.dtype={v.dtype}"
        )
    if q.dtype not in EIGHT_BIT_QUERY_DTYPES:
        raise TypeError(
            f"{fn}: q must be float32, bfloat16 or float16 beside {k.dtype} k and v, got "
            f"q.dtype={q.dtype}"
        )
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("sinks", sinks)):
            if isinstance(t, Tensor) and t.requires_grad:
                raise NotImplementedError(
                    f"{fn}: with 8-bit k and v ({k.dtype}) the call is inference only: 8-bit "
                    f"K/V are not differentiable, and {name} requires grad (detach it, or call "
                    "under torch.no_grad())"
                )
    if any(t.dim() != 4 for t in (q, k, v)):
        raise ValueError(
            f"{fn}: with 8-bit k and v, q, k and v must be (B, Hq, Lq, D), (B, Hkv, Lk, D) and "
            f"(B, Hkv, Lk, Dv), got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, "
            f"v.shape={tuple(v.shape)}"
        )
    batch, heads_q, lq, dim = q.shape
    _, heads_kv, lk, _ = k.shape
    if k.size(0) != batch or k.size(3) != dim or v.shape[:3] != k.shape[:3] or dim == 0:
        raise ValueError(
            f"{fn}: with 8-bit k and v, q, k and v must be (B, Hq, Lq, D), (B, Hkv, Lk, D) and "
            f"(B, Hkv, Lk, Dv), D > 0, got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, "
            f"v.shape={tuple(v.shape)}"
        )
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"{fn}: q's heads must be a multiple of k's, got q.shape={tuple(q.shape)}, "
            f"k.shape={tuple(k.shape)}"
        )
    for name in ("key_mask", "attn_mask"):
        given = options.get(name)
        if given is not None:
            raise NotImplementedError(
                f"{fn}: {name} with 8-bit k and v is not supported (they are read as a paged "
                "cache, which takes window, softcap, alibi_slopes and sinks); got "
                f"{describe(given)}"
            )
    dropout_p = options.get("dropout_p", 0.0)
    if isinstance(dropout_p, Tensor) or dropout_p != 0:
        raise NotImplementedError(
            f"{fn}: dropout_p with 8-bit k and v is not supported (inference only), got "
            f"dropout_p={dropout_p!r}"
        )
    # The generator only draws dropout's seed: without dropout it changes nothing, as in the op.
    served = {name: options[name] for name in ("scale", "softcap", "alibi_slopes")
              if name in options}
    served["window"] = check_window(fn, options.get("window", (-1, 0)))
    scales = []
    for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
        if given is None:
            scales.append(None)
            continue
        single = one_scale(fn, name, given)
        if single is not None:
            scales.append(single)
            continue
        check_token_scales(fn, name, given, (batch, heads_kv, lk), "(B, Hkv, Lk)")
        refuse_bad_scales(fn, name, given)
        scales.append(given.transpose(1, 2))  # (B, Lk, Hkv), the pages' layout
    if lk == 0:
        # No key: every row gets zeros (a page of no rows is not a paged cache).
        return q.new_zeros(batch, heads_q, lq, v.size(3))
    k_scale, v_scale = (torch.tensor(s) if isinstance(s, float) else s for s in scales)
    table = torch.arange(batch, dtype=torch.int32).unsqueeze(1)
    lengths = torch.full((batch,), lk, dtype=torch.int32)
    out, _ = call_op("paged_attention", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                     table, lengths, sinks=sinks, k_scale=k_scale, v_scale=v_scale, **served)
    return out.transpose(1, 2).contiguous()
