"""Reading the masks and kwargs transformers gives an attention function back into what they ask
of the op (:class:`MaskLayout`): causality or a sliding window (:func:`look_back`), with a
per-key mask (:func:`read_key_mask`) or over packed sequences (:func:`read_packed_sequences`,
:class:`Sequences`, from a block-diagonal mask, ``position_ids`` or FlashAttention's kwargs),
each verified against the mask before it is used."""

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..._masks import visible_keys

# The backend's name, attn_implementation's, which its errors start with.
NAME = "causal_attention"


@dataclass(frozen=True)
class Sequences:
    """Packed sequences in FlashAttention's varlen layout over the flattened ``(B * L)`` rows:
    int32 cumulative lengths ``(N + 1,)`` from 0, and the longest lengths."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class MaskLayout:
    """What a mask asks of the op: keys ``[0, key_length)`` (the rest are hidden from every
    query), seen through the op's ``window`` (``(-1, 0)``: causal; ``(W - 1, 0)``: a sliding
    window of W keys), hidden among them where ``key_mask (B, key_length)`` is False (``None``:
    none hidden); or, instead of the keys, ``sequences``, packed in the flattened batch, each
    seen through ``window``."""

    key_length: int
    key_mask: Optional[Tensor] = None
    sequences: Optional[Sequences] = None
    window: Tuple[int, int] = (-1, 0)


def check_mask_shape(mask: Tensor, batch: int, lq: int, lk: int) -> None:
    if mask.dim() != 4 or mask.shape[-2:] != (lq, lk) or mask.size(0) not in (1, batch):
        raise ValueError(
            f"{NAME}: attention_mask must be (B, 1 or H, Lq, Lk) = ({batch}, *, {lq}, {lk}), "
            f"got attention_mask.shape={list(mask.shape)}"
        )


def as_boolean_mask(mask: Tensor, batch: int, lq: int, lk: int) -> Optional[Tensor]:
    """``mask (B or 1, 1 or H, Lq, Lk)`` as a boolean ``(B, 1 or H, Lq, Lk)``, True where a key
    is attended; ``None`` for a float mask that adds a bias (values other than 0 and a very
    negative number), which only the op's attn_mask takes."""
    check_mask_shape(mask, batch, lq, lk)
    if mask.dtype != torch.bool:
        attended = mask == 0
        if not bool((attended | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return None
        mask = attended
    return mask.expand(batch, -1, -1, -1)


def look_back(mask: Tensor, lk: int) -> int:
    """The window's ``left`` that ``mask (..., Lq, Lk)`` shows: the farthest any query sees
    back from its diagonal ``i + Lk - Lq``; -1 (causal) when that is the whole length or no query
    sees a key. It is the model's window whenever that hides a key padding does not (the query
    whose window starts at that key sees it first); shorter, the mask is causality with padding,
    which is read before any window."""
    lq = mask.size(-2)
    sees = mask.any(dim=-1)
    if not bool(sees.any()):
        return -1
    first = mask.to(torch.uint8).argmax(dim=-1)
    diagonal = torch.arange(lq, device=mask.device) + (lk - lq)
    left = int((diagonal - first)[sees].max())
    return left if left < lk - 1 else -1


def read_mask(mask: Tensor, lq: int, lk: int) -> Optional[MaskLayout]:
    """The layout of a boolean ``mask (B, 1 or H, Lq, Lk)``: causal or a sliding window, with a
    per-key mask (padding, a static cache's unused slots), or block-diagonal, causal or a
    sliding window within each block (packed sequences); ``None`` for any other mask."""
    if lq == 0:
        return MaskLayout(lk)
    layout = read_key_mask(mask, lq, lk)
    return layout if layout is not None else read_packed_sequences(mask, lq, lk)


def read_key_mask(mask: Tensor, lq: int, lk: int) -> Optional[MaskLayout]:
    """``mask`` is the op's visibility (``visible_keys``) with ``window=(left, 0)`` and a key
    mask ``key_ok (B, key_length)`` over the first ``key_length`` keys, False after them; or
    ``None``. Two key lengths are tried: the keys up to the last one any query sees (a static
    cache's unused slots sit past it; cut off, they cost nothing, and causality aligns
    bottom-right on the keys that are left), then all the keys; and two windows for each:
    causal, then the one the mask shows (``look_back``)."""
    visible = mask.any(dim=(0, 1, 2)).nonzero()
    last_seen = int(visible[-1]) + 1 if visible.numel() else 0
    for key_length in dict.fromkeys((last_seen, lk)):
        used = mask[..., :key_length]
        keys = torch.arange(key_length, device=mask.device)
        # Every window shows a key to the query on its diagonal (the first query, for keys
        # before it), so that query's row is the key mask; keys no query sees are kept.
        diagonal_row = (keys - (key_length - lq)).clamp(0, lq - 1)
        for left in dict.fromkeys((-1, look_back(used, key_length))):
            window = (left, 0)
            seen = visible_keys(lq, key_length, window, device=mask.device)
            key_ok = used[:, 0, diagonal_row, keys] | ~seen.any(dim=0)
            expected = seen & key_ok[:, None, None, :]
            if torch.equal(used, expected.expand_as(used)):
                key_mask = None if bool(key_ok.all()) else key_ok
                return MaskLayout(key_length, key_mask, window=window)
    return None


def read_packed_sequences(mask: Tensor, lq: int, lk: int) -> Optional[MaskLayout]:
    """``mask[b, :, i, j] == visible_keys(L, L, (left, 0))[i, j] & (i and j are in the same
    sequence of row b)``, or ``None``: what transformers builds from ``position_ids`` that
    restart, with a sliding window or without."""
    if lq != lk:
        return None
    # In such a mask a query sees the key before it unless it is its sequence's first token.
    rows = torch.arange(1, lq, device=mask.device)
    starts = torch.ones(mask.size(0), lq, dtype=torch.bool, device=mask.device)
    starts[:, 1:] = ~mask[:, 0, rows, rows - 1]
    for left in dict.fromkeys((-1, look_back(mask, lk))):
        if torch.equal(mask, block_causal(starts, left).expand_as(mask)):
            return MaskLayout(lk, sequences=sequences_from_starts(starts), window=(left, 0))
    return None


def block_causal(starts: Tensor, left: int = -1) -> Tensor:
    """``(B, 1, L, L)`` block-diagonal causal mask of the sequences starting where ``starts (B,
    L)`` is True, within a sliding window where ``left >= 0``."""
    sequence = starts.cumsum(dim=-1)
    same = sequence[:, :, None] == sequence[:, None, :]
    length = starts.size(-1)
    return (same & visible_keys(length, length, (left, 0), device=starts.device)).unsqueeze(1)


def sequences_from_starts(starts: Tensor) -> Sequences:
    """The sequences of ``starts (B, L)`` (True at each sequence's first token, always at 0),
    over the flattened ``B * L`` rows (query and key sequences alike)."""
    first_rows = starts.reshape(-1).nonzero().squeeze(1)
    end = torch.tensor([starts.numel()], device=starts.device)
    cu_seqlens = torch.cat([first_rows, end]).to(torch.int32)
    longest = int(cu_seqlens.diff().max())
    return Sequences(cu_seqlens, cu_seqlens, longest, longest)


def sequences_from_position_ids(
    position_ids: Optional[Tensor], batch: int, lq: int, lk: int
) -> Optional[Sequences]:
    """The packed sequences that ``position_ids (B or 1, L)`` mark by restarting (a step other
    than +1, as transformers' ``find_packed_sequence_indices`` reads them), or ``None`` when no
    row restarts."""
    # Position ids of another shape (multimodal rotary sections, prefix tokens) are not the
    # query rows' own; SDPA ignores them, and so does this.
    if position_ids is None or position_ids.dim() != 2 or lq < 2:
        return None
    if position_ids.size(-1) != lq or position_ids.size(0) not in (1, batch):
        return None
    restarts = position_ids.expand(batch, -1).diff(dim=-1) != 1
    if not bool(restarts.any()):
        return None
    if lk != lq:
        raise ValueError(
            f"{NAME}: position_ids restart (packed sequences) in queries that follow {lk - lq} "
            "cached keys; packed sequences are served without a cache only (use_cache=False), "
            "or with the cache holding exactly these rows"
        )
    first = torch.ones(batch, 1, dtype=torch.bool, device=restarts.device)
    return sequences_from_starts(torch.cat([first, restarts], dim=-1))


def sequences_from_kwargs(
    kwargs: Dict[str, Any], batch: int, lq: int, lk: int, device: torch.device
) -> Optional[Sequences]:
    """The packed sequences of FlashAttention's kwargs (``DataCollatorWithFlattening(
    return_flash_attn_kwargs=True)``), over the flattened ``B * L`` rows, or ``None``."""
    given = {name: kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k")}
    if all(cu is None for cu in given.values()):
        return None
    cumulative = []
    for (name, cu), rows in zip(given.items(), (batch * lq, batch * lk)):
        if cu is None:
            raise ValueError(
                f"{NAME}: packed sequences need both cu_seq_lens_q and cu_seq_lens_k, got "
                f"{name}=None"
            )
        cu = torch.as_tensor(cu, device=device)
        if cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point() or int(cu[-1]) != rows:
            raise ValueError(
                f"{NAME}: {name} must be integer cumulative lengths (N + 1,) ending at the "
                f"{rows} rows of the flattened batch (batch * length), got {name}={cu.tolist()}"
            )
        cumulative.append(cu.to(torch.int32))
    # Lengths the kwargs leave out are read from the cumulative lengths; the op checks given ones.
    longest = [
        int(cu.diff().max()) if kwargs.get(name) is None else int(kwargs[name])
        for name, cu in zip(("max_length_q", "max_length_k"), cumulative)
    ]
    return Sequences(*cumulative, *longest)


def is_whole_rows(layout: MaskLayout, lq: int, lk: int) -> bool:
    """Whether ``layout`` is causality or a sliding window over every key of whole batch rows,
    nothing hidden, queries and keys alike: a mask that shows no packing (one sequence per row),
    without contradicting any."""
    return layout.sequences is None and layout.key_mask is None and layout.key_length == lk == lq


def check_same_sequences(layout: MaskLayout, given: Sequences) -> None:
    """Raises ``ValueError`` unless the mask's layout (packed, or with hidden keys) is the packed
    sequences of the kwargs."""
    found = layout.sequences
    same = found is not None and all(
        torch.equal(a.to(b.device), b)
        for a, b in (
            (found.cu_seqlens_q, given.cu_seqlens_q),
            (found.cu_seqlens_k, given.cu_seqlens_k),
        )
    )
    if not same:
        raise ValueError(
            f"{NAME}: attention_mask and cu_seq_lens_q/cu_seq_lens_k describe different "
            f"sequences (cu_seq_lens_q={given.cu_seqlens_q.tolist()}); pass one of them, or "
            "both for the same packing"
        )
