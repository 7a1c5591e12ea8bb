"""The flash-attn functions' argument checks, each error naming the public function (``fn``,
its name under ``_PREFIX``) and the argument; and what some arguments resolve to (the default
softmax scale, the S_dmask returned without dropout)."""

import math
import numbers
import operator
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..._arguments import refuse_tensor_requiring_grad

_PREFIX = "causal_attention.integrations.flash_attn"


def _window_bounds(fn: str, window_size) -> Tuple[int, int]:
    """``window_size`` as two ints: a tuple or list of two ints (Python or numpy ints, not
    bools), or a CPU int tensor of shape ``(2,)`` of any integer dtype, as flash-attn's own tests
    pass it; anything else is a TypeError naming it."""
    expected = f"{fn}: window_size must be a pair (left, right): a tuple or list of two ints " \
        "or a CPU int tensor of shape (2,), got"
    if isinstance(window_size, Tensor):
        dtype = window_size.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or \
                window_size.shape != (2,) or window_size.device.type != "cpu":
            raise TypeError(f"{expected} a {_describe(window_size)} on {window_size.device}")
        left, right = window_size.tolist()
        return left, right
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"{expected} {_describe(window_size)}")
    bounds = []
    for i, bound in enumerate(window_size):
        if isinstance(bound, bool):
            raise TypeError(f"{fn}: window_size[{i}] must be an int, got {bound!r}")
        bounds.append(_as_int(fn, f"window_size[{i}]", bound))
    return bounds[0], bounds[1]


def _check_alibi(fn: str, alibi_slopes, batch: int, heads: int) -> Optional[Tensor]:
    """flash-attn's ALiBi slopes: None, or float32 ``(nheads,)`` or ``(batch, nheads)``."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError(f"{fn}: alibi_slopes must be a tensor, got {_describe(alibi_slopes)}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"{fn}: alibi_slopes must have dtype torch.float32, got "
                        f"{alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"{fn}: alibi_slopes must be (nheads,) = ({heads},) or (batch, nheads) = ({batch}, "
            f"{heads}), got alibi_slopes.shape={tuple(alibi_slopes.shape)}"
        )
    return alibi_slopes


def _check_dropout(fn: str, dropout_p, return_attn_probs) -> float:
    dropout_p = _as_float(fn, "dropout_p", dropout_p)
    if dropout_p > 0.0 and return_attn_probs:
        raise NotImplementedError(
            f"{fn}: return_attn_probs=True with dropout_p={dropout_p} is not supported: "
            "S_dmask, flash-attn's testing-only encoding of the dropout pattern, is not "
            "computed; pass return_attn_probs=False, or dropout_p=0.0 for softmax_lse"
        )
    return dropout_p


def _check_batched(fn: str, q, k, v) -> None:
    """The shapes of flash_attn_func, checked in its own layout so that errors read in it."""
    _check_rank(fn, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _check_rank(fn, "k", k, 4, "(batch, seqlen_k, nheads_k, headdim)")
    _check_rank(fn, "v", v, 4, "(batch, seqlen_k, nheads_k, headdim_v)")
    _check_head_dim(fn, q)
    batch, _, heads, dim = q.shape
    if k.size(0) != batch or k.size(3) != dim or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{fn}: expected q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, "
            f"headdim), v (batch, seqlen_k, nheads_k, headdim_v), got q.shape={tuple(q.shape)}, "
            f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if k.size(2) == 0 or heads % k.size(2) != 0:
        raise ValueError(
            f"{fn}: q's nheads must be a multiple of k's nheads_k, got q.shape={tuple(q.shape)}, "
            f"k.shape={tuple(k.shape)}"
        )


def _unpack(fn: str, name: str, packed, dims: int, count: int,
            layout: str) -> Tuple[Tensor, ...]:
    """The ``count`` tensors stacked along dim -3 of ``packed`` (``layout``, of ``dims`` dims) as
    views of it: what the packed functions hand to the unpacked ones, so that autograd sends
    their gradients back into ``packed``."""
    _check_rank(fn, name, packed, dims, layout)
    if packed.size(-3) != count:
        raise ValueError(
            f"{fn}: {name} must be {layout}, its dim {dims - 3} of size {count}, got "
            f"{name}.shape={tuple(packed.shape)}"
        )
    if packed.size(-1) <= 0:
        raise ValueError(f"{fn}: headdim must be positive, got {name}.shape={tuple(packed.shape)}")
    return packed.unbind(-3)


def _check_packed_kv(fn: str, q: Tensor, kv: Tensor, layout: str) -> None:
    """``kv`` (``layout``, its batch if any, nheads_k and headdim last) against ``q``: the
    checks the unpacked function would make of k and v, in kv's terms."""
    batched = q.dim() == 4
    if (batched and kv.size(0) != q.size(0)) or kv.size(-1) != q.size(-1):
        what = "q's batch and headdim" if batched else "q's headdim"
        raise ValueError(
            f"{fn}: kv must be {layout} with {what}, got q.shape={tuple(q.shape)}, "
            f"kv.shape={tuple(kv.shape)}"
        )
    if kv.size(-2) == 0 or q.size(-2) % kv.size(-2) != 0:
        raise ValueError(
            f"{fn}: q's nheads must be a multiple of kv's nheads_k, got q.shape={tuple(q.shape)}, "
            f"kv.shape={tuple(kv.shape)}"
        )
    if kv.dtype != q.dtype:
        raise TypeError(f"{fn}: kv must have q's dtype {q.dtype}, got {kv.dtype}")


def _check_rank(fn: str, name: str, t, dims: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor {layout}, got {_describe(t)}")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must be {layout}, got {name}.shape={tuple(t.shape)}")


def _check_head_dim(fn: str, q: Tensor) -> None:
    if q.size(-1) <= 0:
        raise ValueError(f"{fn}: headdim must be positive, got q.shape={tuple(q.shape)}")


def _check_row_indices(fn: str, name: str, t, batch: int, dims: int) -> Tensor:
    """An int32 tensor with one row (or entry) per batch row, as flash-attn requires."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be an int32 tensor, got {_describe(t)}")
    if t.dtype != torch.int32:
        raise TypeError(f"{fn}: {name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != dims or t.size(0) != batch:
        shape = "(batch,)" if dims == 1 else "(batch, max_num_blocks_per_seq)"
        raise ValueError(
            f"{fn}: {name} must be {shape} with q's batch {batch}, got "
            f"{name}.shape={tuple(t.shape)}"
        )
    return t.cpu()


class PageOutsidePoolError(ValueError, RuntimeError):
    """A block table naming a page outside the pool: a ValueError, as every bad argument here,
    and the RuntimeError flash-attn raises for it (its tests expect one)."""


def _check_pages(fn: str, block_table: Tensor, page_size: int, num_blocks: int,
                 ends: Tensor) -> None:
    """Every page of ``block_table`` (a CPU tensor) that row b's first ``ends[b]`` keys lie on
    must exist; the columns past them are never read."""
    if page_size < 1:  # checked here, before the pages are counted by dividing by it
        raise ValueError(f"{fn}: the pages must hold at least one token (page_size = "
                         f"k_cache.shape[1] >= 1), got page_size={page_size}")
    used = (ends.long() + page_size - 1) // page_size
    read = torch.arange(block_table.size(1)) < used.unsqueeze(1)
    outside = read & ((block_table < 0) | (block_table >= num_blocks))
    if bool(outside.any()):
        b = int(outside.any(1).nonzero()[0])
        raise PageOutsidePoolError(
            f"{fn}: block_table row {b} names pages {block_table[b][outside[b]].tolist()} "
            f"outside [0, {num_blocks}) (k_cache.shape[0]) among the {int(used[b])} pages its "
            f"{int(ends[b])} keys use"
        )


def _as_int(fn: str, name: str, value) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int, got {_describe(value)}") from None


def _as_float(fn: str, name: str, value) -> float:
    """A float argument as flash-attn's op takes it: a real number (an int, a float, a numpy or
    symbolic number; not a bool), or a tensor holding one real number that does not require
    grad. One that requires grad is refused: the op would take the number it holds, and its
    gradient would be dropped."""
    refuse_tensor_requiring_grad(fn, name, value)
    if isinstance(value, Tensor):
        if value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
            return float(value)
    elif not isinstance(value, bool) and \
            isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt)):
        return float(value)
    raise TypeError(f"{fn}: {name} must be a float, got {_describe(value)}")


def _check_scale(fn: str, softmax_scale) -> Optional[float]:
    """``softmax_scale`` as a float, or ``None`` for flash-attn's default ``1 / sqrt(headdim)``."""
    return None if softmax_scale is None else _as_float(fn, "softmax_scale", softmax_scale)


def _resolve_scale(softmax_scale: Optional[float], q: Tensor) -> float:
    return 1.0 / math.sqrt(q.size(-1)) if softmax_scale is None else softmax_scale


def _no_dropout_mask(q: Tensor) -> Tensor:
    """What flash-attn returns as S_dmask without dropout: an empty tensor of q's dtype."""
    return q.new_empty(0)


def _describe(value) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return repr(value) if value is None or isinstance(value, (int, float, bool, str)) \
        else f"{type(value).__name__} {value!r}"
