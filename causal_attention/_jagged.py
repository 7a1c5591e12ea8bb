"""``torch.nested`` jagged tensors (``layout=torch.jagged``) in the SDPA drop-in
(:func:`causal_attention.scaled_dot_product_attention`): the checks of a nested call, its packed
form for ``varlen_attention`` and the nested result. Nested tensors of the strided layout (what
``torch.nested.nested_tensor`` builds by default, and PyTorch's SDPA tests use) hold each
sequence apart: they are copied into the jagged layout once (:func:`as_jagged`) and the result
copied back (:func:`as_strided_nested`), both differentiable.

A jagged ``(B, H, j, D)`` tensor (a ``(B, j, H, D)`` one transposed, as attention layers build
it) keeps its rows in one ``(total, H, D)`` buffer and its sequence starts in ``offsets``:
``varlen_attention``'s packed layout and ``cu_seqlens``, so a call runs on the buffers in place,
never padded.
"""

from typing import NamedTuple

import torch
from torch import Tensor


class PackedCall(NamedTuple):
    """``varlen_attention``'s positional arguments for a nested call."""

    q: Tensor
    k: Tensor
    v: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def is_nested_call(query: Tensor, key: Tensor, value: Tensor) -> bool:
    return query.is_nested or key.is_nested or value.is_nested


def ragged_sequences(query: Tensor) -> bool:
    """Whether ``query`` is ``(B, H, j, D)``: ragged in its sequence dim, a packed call."""
    return query.dim() == 4 and query._ragged_idx == 2


def ragged_batch(query: Tensor) -> bool:
    """Whether ``query``'s ragged dim is dim 1 of 4 or more, before its heads and sequence: a
    batch-like dim, so its rows, ``query.values()``, are a dense call (as torch's SDPA serves
    it)."""
    return query.dim() >= 4 and query._ragged_idx == 1


def as_jagged(fn: str, name: str, tensor: Tensor) -> Tensor:
    """A strided-layout nested ``(B, H, j, D)`` tensor (each sequence ``(H, j, D)``, as a
    ``(B, j, H, D)`` one transposed) as a jagged one of the same values, copied into one buffer;
    any other tensor as it is."""
    if not tensor.is_nested or tensor.layout != torch.strided:
        return tensor
    sequences = tensor.unbind()
    if tensor.dim() != 4 or any(s.shape[0::2] != sequences[0].shape[0::2] for s in sequences):
        raise ValueError(
            f"{fn}: a nested {name} of strided layout must be (B, H, j, D), ragged in its "
            f"sequence dim only, got sequences of shapes {[tuple(s.shape) for s in sequences]}"
        )
    rows = [s.transpose(0, 1) for s in sequences]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged).transpose(1, 2)


def as_strided_nested(out: Tensor) -> Tensor:
    """A jagged ``(B, H, j, D)`` result as a strided-layout nested tensor of the same values,
    laid out as torch's SDPA returns one for strided inputs (``(B, j, H, D)`` transposed)."""
    rows = list(out.transpose(1, 2).unbind())
    return torch.nested.as_nested_tensor(rows, layout=torch.strided).transpose(1, 2)


def check_nested_call(fn: str, query: Tensor, key: Tensor, value: Tensor,
                      attn_mask: object) -> None:
    """Refuses, naming the argument and what it is, a nested call that cannot be served: nested
    and dense tensors mixed (a strided-layout one is made jagged first, :func:`as_jagged`), a
    nested tensor with holes (``lengths``), ragged elsewhere than
    :func:`ragged_sequences` or :func:`ragged_batch` say, and any ``attn_mask`` (torch's SDPA
    refuses one too: a mask for other lengths in every sequence is no tensor it takes)."""
    tensors = {"query": query, "key": key, "value": value}
    if not all(t.is_nested for t in tensors.values()):
        seen = ", ".join(f"{name} {'nested' if t.is_nested else 'dense'}"
                         for name, t in tensors.items())
        raise ValueError(f"{fn}: query, key and value must be all nested or all dense, got {seen}")
    for name, tensor in tensors.items():
        if tensor.lengths() is not None:
            raise ValueError(
                f"{fn}: a nested {name} must hold its sequences back to back, got one with "
                f"holes (lengths {tensor.lengths().tolist()}); {name}.contiguous() packs it"
            )
        if tensor.dim() != query.dim() or tensor._ragged_idx != query._ragged_idx:
            raise ValueError(
                f"{fn}: query, key and value must be ragged in the same dim, got {name} of "
                f"shape {tuple(tensor.shape)} and query of shape {tuple(query.shape)}"
            )
    if not (ragged_sequences(query) or ragged_batch(query)):
        raise ValueError(
            f"{fn}: a nested query must be (B, H, j, D), ragged in its sequence dim, or ragged in "
            f"dim 1 of 4 or more; got shape {tuple(query.shape)}, ragged in dim "
            f"{query._ragged_idx}"
        )
    if attn_mask is not None:
        raise ValueError(
            f"{fn}: attn_mask must be None with nested query, key and value (as in torch's "
            f"SDPA), got {type(attn_mask).__name__}; is_causal=True gives causal attention"
        )


def packed_call(fn: str, query: Tensor, key: Tensor, value: Tensor,
                enable_gqa: bool) -> PackedCall:
    """The ``(total, H, D)`` buffers of ``(B, H, j, D)`` query, key and value (views, no copy)
    and their offsets as ``cu_seqlens``. key and value must share their sequence lengths; query's
    may differ (cross-attention). Heads as the dense drop-in takes them: equal, key and value
    heads of 1 (broadcast), or with ``enable_gqa`` dividing the query's."""
    if not torch.equal(key.offsets(), value.offsets()):
        raise ValueError(
            f"{fn}: key and value must have the same sequence lengths, got "
            f"{key.offsets().diff().tolist()} and {value.offsets().diff().tolist()}"
        )
    heads_q, heads_k = query.size(1), key.size(1)
    if heads_k != heads_q and heads_k != 1 and not enable_gqa:
        raise ValueError(
            f"{fn}: key must have query's {heads_q} heads (or 1), got {heads_k}; grouped-query "
            "attention takes enable_gqa=True"
        )
    cu_seqlens_q, cu_seqlens_k = (t.offsets().to(torch.int32) for t in (query, key))
    return PackedCall(
        *(t.transpose(1, 2).values() for t in (query, key, value)),
        cu_seqlens_q, cu_seqlens_k,
        _longest(cu_seqlens_q), _longest(cu_seqlens_k),
    )


def _longest(cu_seqlens: Tensor) -> int:
    return int(cu_seqlens.diff().max()) if cu_seqlens.numel() > 1 else 0


def nested_like(out: Tensor, query: Tensor) -> Tensor:
    """``out``, the rows of every sequence of ``query`` (ragged in dim 1 as the packed buffers
    are, or as ``query`` is), as a nested tensor laid out as ``query``: on ``query``'s offsets,
    so that its ragged size is ``query``'s and the two add, a view that passes the gradient to
    ``out``."""
    nested = torch.nested.nested_tensor_from_jagged(out, query.offsets())
    return nested.transpose(1, 2) if ragged_sequences(query) else nested
