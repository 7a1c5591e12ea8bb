"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

It takes every argument torch's SDPA takes on the CPU and gives its result (with dropout, the
same computation with its own random stream), broadcasting as SDPA broadcasts, and refuses what
SDPA refuses with the exception type SDPA raises (``TypeError`` from its argument parser,
``RuntimeError`` from its checks), so that swapping it in neither changes a model's results nor
the errors its code catches.
"""

import sys
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention.bias import CausalBias, CausalVariant

from ._arguments import refuse_tensor_requiring_grad
from ._jagged import (
    as_jagged,
    as_strided_nested,
    check_nested_call,
    is_nested_call,
    nested_like,
    packed_call,
    ragged_batch,
)
from .ops import attention, varlen_attention

_OP = "causal_attention.scaled_dot_product_attention"


def _parses_as_float(value: object) -> bool:
    """Whether torch's argument parser takes ``value`` for a float argument of SDPA (dropout_p,
    scale): a Python or numpy number (bool included), a SymInt or SymFloat, or a 0-d tensor that
    does not require grad (one that does is refused: the float it becomes gets no gradient)."""
    if isinstance(value, (float, int, torch.SymFloat, torch.SymInt)):
        return True
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.requires_grad
    # Not imported for this: an object cannot be a numpy number unless numpy is loaded.
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, (numpy.number, numpy.bool_))


def _check_argument_types(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
) -> None:
    """Refuses what torch's parser refuses for SDPA, with its exception types (TypeError; an int
    too large for a float is an OverflowError), before any call is judged served or not."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{_OP}: {name} must be a Tensor, got {type(tensor).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(
            f"{_OP}: attn_mask must be a Tensor or None, got {type(attn_mask).__name__}"
        )
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_OP}: {name} must be a bool, got {type(flag).__name__}")
    for name, number in (("dropout_p", dropout_p), ("scale", scale)):
        if name == "scale" and number is None:
            continue
        refuse_tensor_requiring_grad(_OP, name, number)
        if not _parses_as_float(number):
            seen = type(number).__name__
            if isinstance(number, Tensor):
                seen = f"a Tensor of shape {tuple(number.shape)} (SDPA takes only a 0-d one)"
            raise TypeError(f"{_OP}: {name} must be a float, got {seen}")
        if isinstance(number, int):
            float(number)  # OverflowError for an int beyond float's range, as SDPA raises


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Same signature, result and errors as ``torch.nn.functional.scaled_dot_product_attention``
    on the CPU.

    ``attn_mask``: None, a bool mask (True where a query may attend a key) or a floating one
    (float32 or the query's dtype, added to the scores; a learned bias gets its gradient),
    broadcastable to ``(..., Hq, Lq, Lk)`` and never expanded in memory, or a
    ``torch.nn.attention.bias.CausalBias`` (``causal_upper_left`` as ``is_causal``,
    ``causal_lower_right`` the KV-cache alignment: row ``i`` sees keys up to ``i + Lk - Lq``),
    read by its own sizes as SDPA reads it (a square one is ``is_causal``; a lower-right one of
    other sizes than the call's is its mask, broadcast to the scores or refused).
    ``is_causal=True`` is causal top-left aligned as SDPA's (row ``i`` sees keys ``0..i``) with
    any lengths, combined with ``attn_mask`` as SDPA combines them (both must allow a key). Both
    alignments are the op's window geometry, no mask built. A row that sees no key gives zeros,
    as in SDPA. Under ``torch.autocast`` a floating mask (but float64) is cast to the region's
    dtype, as autocast casts SDPA's.

    Shapes are SDPA's: ``query (..., Hq, Lq, E)``, ``key (..., Hk, Lk, E)``,
    ``value (..., Hv, Lk, Ev)`` -> ``(..., Hq, Lq, Ev)``, leading dims broadcast (as views);
    heads broadcast as any dim, or with ``enable_gqa=True`` ``Hk`` and ``Hv`` divide ``Hq``
    (grouped-query attention, K/V read in place). ``E = 0`` gives each row the mean of the
    values it sees, as SDPA. As in SDPA, ``dropout_p > 0`` drops attention probabilities
    whatever the module's training mode (pass ``dropout_p=0.0`` in evaluation), drawing the
    dropout mask's seed from torch's default generator: the same generator state gives the same
    result, bit for bit (SDPA's own random stream differs, so the two agree in distribution, not
    draw for draw); ``dropout_p=1`` gives zeros. Errors: arguments of a type SDPA's parser
    refuses raise its ``TypeError`` (a ``scale`` tensor that requires grad included), a
    CausalBias with ``is_causal=True`` its ``ValueError``, and every call SDPA's checks refuse
    (dtypes, shapes, devices, ``dropout_p`` outside ``[0, 1]``, ``is_causal`` with a mask that
    requires grad) ``RuntimeError``, with our op's message naming the argument. Two calls that
    torch 2.13's CPU SDPA runs without a word and answers wrongly raise ``RuntimeError`` here:
    ``value`` with another key count than ``key``, and a mask on another device.

    Nested jagged (``layout=torch.jagged``) query, key and value ``(B, H, j, D)`` (key and value
    may have other lengths than query) are served on their packed rows by ``varlen_attention``,
    ``is_causal`` bottom-right in each sequence, and give a nested result on query's offsets;
    nested tensors of the strided layout are copied into the jagged one and the result back;
    what cannot be served (a mask, nested mixed with dense, holes, another ragged dim) raises
    ``TypeError``/``ValueError`` naming the argument.
    """
    _check_argument_types(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if is_nested_call(query, key, value):
        return _nested_attention(query, key, value, attn_mask, _checked_dropout(dropout_p),
                                 is_causal, scale, enable_gqa)
    top_left, mask = True, attn_mask
    if isinstance(attn_mask, CausalBias):
        if is_causal:
            raise ValueError(
                f"{_OP}: a CausalBias attn_mask should not be used with is_causal=True"
            )
        is_causal, top_left, mask = _causal_bias(attn_mask, query, key)
    elif is_causal and attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        # SDPA's math kernel, the one that differentiates a mask, refuses both.
        raise RuntimeError(
            f"{_OP}: an attn_mask that requires grad should not be set with is_causal=True, as "
            "in SDPA; add the causal part to the mask (-inf above the diagonal) instead"
        )
    mask = _autocast_mask(mask, query)
    dropout_p = _checked_dropout(dropout_p)
    try:
        query, key, value = _broadcast(query, key, value, enable_gqa)
        key, value, mask, window = _aligned(query, key, value, mask, is_causal, top_left)
        if query.dim() >= 1 and query.size(-1) == 0:
            # Every score is 0: a row's mean of the values it sees. The op needs D > 0, so it
            # gets one column of zeros, still a function of query and key for autograd.
            query, key = (t.sum(-1, keepdim=True) for t in (query, key))
            scale = 1.0 if scale is None else scale
        return _dropped(dropout_p, lambda op_dropout_p: attention(
            query, key, value, scale=scale, attn_mask=mask, window=window,
            dropout_p=op_dropout_p))
    except (TypeError, ValueError) as error:
        # SDPA's checks of dtypes, shapes and devices raise RuntimeError: so does this, with
        # our op's message.
        raise RuntimeError(str(error)) from error


def _checked_dropout(dropout_p) -> float:
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise RuntimeError(f"{_OP}: dropout_p must be in [0, 1], got dropout_p={dropout_p}")
    return dropout_p


def _dropped(dropout_p: float, attend) -> Tensor:
    """``attend(op_dropout_p)``, the op's call, with ``dropout_p`` as SDPA applies it: the op
    drops with probability below 1; with every probability dropped SDPA's output is zeros, and
    so is its gradient."""
    if dropout_p == 1.0:
        return attend(0.0) * 0.0
    return attend(dropout_p)


def _nested_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: object,
                      dropout_p: float, is_causal: bool, scale: Optional[float],
                      enable_gqa: bool) -> Tensor:
    """A call on ``torch.nested`` jagged tensors (see causal_attention/_jagged.py): ragged in
    the sequence dim, ``varlen_attention`` on the packed buffers in place, causal bottom-right in
    each sequence (as torch's CUDA flash kernel aligns nested calls; its CPU SDPA has none);
    ragged in a batch-like dim, the dense call on the rows. The op's ``TypeError`` and
    ``ValueError`` stay what they are, as torch's nested SDPA raises ``ValueError`` for them.
    Strided-layout nested tensors are made jagged (one copy) and the result strided again."""
    strided = query.is_nested and query.layout == torch.strided
    query, key, value = (as_jagged(_OP, name, t)
                         for name, t in (("query", query), ("key", key), ("value", value)))
    out = _jagged_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return as_strided_nested(out) if strided else out


def _jagged_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: object,
                      dropout_p: float, is_causal: bool, scale: Optional[float],
                      enable_gqa: bool) -> Tensor:
    """_nested_attention on jagged tensors (or dense ones mixed in, which the checks refuse)."""
    check_nested_call(_OP, query, key, value, attn_mask)
    if ragged_batch(query):
        out = scaled_dot_product_attention(query.values(), key.values(), value.values(), None,
                                           dropout_p, is_causal, scale=scale,
                                           enable_gqa=enable_gqa)
        return nested_like(out, query)
    packed = packed_call(_OP, query, key, value, enable_gqa)
    window = (-1, 0) if is_causal else (-1, -1)
    out = _dropped(dropout_p, lambda op_dropout_p: varlen_attention(
        *packed, scale=scale, window=window, dropout_p=op_dropout_p))
    return nested_like(out, query)


def _causal_bias(bias: CausalBias, query: Tensor, key: Tensor):
    """``(is_causal, top_left, mask)`` for a CausalBias as SDPA reads it, by its own sizes
    rather than the call's: upper-left, or square, it is ``is_causal=True`` (top-left); lower-right
    otherwise, its ``(seq_len_q, seq_len_kv)`` mask (SDPA's CPU path materializes it), broadcast
    to the scores or refused as SDPA refuses it. One of the call's sizes is the op's bottom-right
    window, no mask built."""
    if bias.variant == CausalVariant.UPPER_LEFT or bias.seq_len_q == bias.seq_len_kv:
        return True, True, None
    sizes = (bias.seq_len_q, bias.seq_len_kv)
    if query.dim() >= 2 and key.dim() >= 2 and sizes == (query.size(-2), key.size(-2)):
        return True, False, None
    mask = torch.ones(sizes, dtype=torch.bool, device=query.device)
    return False, True, mask.tril(bias.seq_len_kv - bias.seq_len_q)


def _autocast_mask(mask: Optional[Tensor], query: Tensor) -> Optional[Tensor]:
    """``mask`` as autocast hands it to SDPA: in an autocast region, a floating mask (but
    float64, which autocast leaves) cast to the region's dtype, as query, key and value are (the
    op's autocast kernel casts those, not the mask)."""
    device = query.device.type
    if (mask is None or not mask.is_floating_point() or mask.dtype == torch.float64
            or not torch.is_autocast_enabled(device)):
        return mask
    return mask.to(torch.get_autocast_dtype(device))


def _broadcast(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool):
    """query, key and value with their leading dims broadcast as SDPA broadcasts them, as views:
    the dims before the heads as any dims, the heads too without ``enable_gqa`` (key and value
    heads of 1 stay 1: the op's GQA reads them for every query head), with it key and value
    heads that divide the query's, made equal for the op (the fewer repeated)."""
    rank = max(query.dim(), key.dim(), value.dim())
    if rank < 3 or query.shape[:-2] == key.shape[:-2] == value.shape[:-2]:
        return query, key, value
    if (enable_gqa and query.dim() == key.dim() == value.dim()
            and query.shape[:-3] == key.shape[:-3] and key.shape[:-2] == value.shape[:-2]):
        return query, key, value  # grouped-query attention as the op takes it: the common call
    query, key, value = (t.reshape((1,) * (rank - t.dim()) + tuple(t.shape))
                         for t in (query, key, value))
    batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    heads_q, heads_k, heads_v = query.size(-3), key.size(-3), value.size(-3)
    if enable_gqa:
        heads_kv = max(heads_k, heads_v)
        if heads_k != heads_v and heads_kv % min(heads_k, heads_v) == 0:
            repeat = heads_kv // min(heads_k, heads_v)
            if heads_k < heads_v:
                key = key.repeat_interleave(repeat, -3)
            else:
                value = value.repeat_interleave(repeat, -3)
    else:
        heads_q = torch.broadcast_shapes((heads_q,), (heads_k,), (heads_v,))[0]
        heads_kv = 1 if heads_k == heads_v == 1 else heads_q
    return (query.expand(*batch, heads_q, *query.shape[-2:]),
            key.expand(*batch, heads_kv, *key.shape[-2:]),
            value.expand(*batch, heads_kv, *value.shape[-2:]))


def _aligned(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], is_causal: bool,
             top_left: bool):
    """Keys, values, the mask and the op's window (bottom-right aligned) for SDPA's
    visibility. is_causal=False is full attention: no bound on either side. Top-left causal with
    ``Lq < Lk`` leaves the keys past ``Lq`` unseen by every row: they are dropped (views, and
    their gradient is zero), with the mask's columns of them, and what is left is causal with
    equal lengths; with ``Lq > Lk``, row ``i`` sees keys up to ``i = i + (Lk - Lq) + (Lq - Lk)``:
    a window reaching ``Lq - Lk`` past the bottom-right diagonal."""
    if not is_causal:
        return key, value, mask, (-1, -1)
    if not top_left or query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        return key, value, mask, (-1, 0)
    len_q, len_k = query.size(-2), key.size(-2)
    if len_q < len_k:
        if mask is not None and mask.dim() >= 1 and mask.size(-1) == len_k:
            mask = mask.narrow(-1, 0, len_q)
        return key.narrow(-2, 0, len_q), value.narrow(-2, 0, len_q), mask, (-1, 0)
    return key, value, mask, (-1, len_q - len_k)
