"""causal_attention as a Hugging Face transformers attention backend.

    import causal_attention.integrations.transformers as ca_transformers
    ca_transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="causal_attention")

It serves what the op computes exactly: causal self-attention (GQA included, K/V heads read in
place), with or without transformers' KV cache (dynamic or static, sliding-window layers'
included), and

- padded batches, left or right padding (``generate`` on a left-padded batch included): the 4-D
  mask transformers builds is read back into causality and a per-key mask, which the op takes as
  ``key_mask`` (a static cache's unused slots, hidden from every query, are cut off); query
  rows that are padding themselves see no key and return zeros;
- sliding windows (Mistral, Qwen2, Gemma 2's and gpt-oss's local layers): the band the mask
  shows, a query seeing itself and the ``W - 1`` keys before it, is read back into the op's
  ``window=(W - 1, 0)`` (with the per-key mask, for padding); without a mask, the
  ``sliding_window`` kwarg says it;
- packed sequences (padding-free training, ``DataCollatorWithFlattening``): from the
  ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs, from the block-diagonal mask transformers builds
  out of restarting ``position_ids``, or, when it builds no mask or one that shows no packing
  (it does not see the packing while a cache is in use, and gpt-oss never gives its masks the
  ``position_ids``), from the restarting ``position_ids`` themselves, as ``flash_attention_2``
  does; so every layer of a forward runs packed alike, the full layers that get no mask and the
  sliding ones that get a band over the whole row. These go to
  :func:`causal_attention.varlen_attention`, a sliding window applying within each sequence;
- the scores' options the models pass as kwargs: ``softcap`` (Gemma 2's
  ``attn_logit_softcapping``), ``s_aux`` (gpt-oss's learned attention sinks, which get their
  gradient), and ``dropout`` (``attn_pdrop``, ``attention_dropout``: models pass it in training
  only; as with SDPA it is applied whenever it is not 0, its seed drawn from torch's default
  generator, so the same generator state gives the same result).

- non-causal layers (encoders, cross-attention): full attention, with the per-key mask a
  bidirectional padding mask shows.

Every mask is verified to be exactly one of these before it is used. Any other mask — a custom
4-D one, bidirectional with more than padding, prefix-LM, chunked, a bias in a float mask — and
the ``position_bias`` a model adds go to the op as ``attn_mask`` (a learned one gets its
gradient), the blocks they hide skipped: the results are those of ``"sdpa"`` and ``"eager"``
but for query rows that see no key, zeros here.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .._masks import visible_keys
from ..ops import attention, varlen_attention

NAME = "causal_attention"


def register() -> None:
    """Registers :func:`attention_forward` as ``attn_implementation="causal_attention"``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    # Without a mask function of its own, transformers builds no mask at all for a backend, and
    # padding would silently go unmasked. SDPA's returns None whenever causality alone suffices
    # and a 4-D boolean mask otherwise (padding, or packed sequences found in position_ids),
    # which read_mask then takes apart.
    AttentionMaskInterface.register(NAME, sdpa_mask)


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


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers' attention-function contract: ``query (B, Hq, Lq, D)``, ``key (B, Hkv, Lk,
    D)``, ``value (B, Hkv, Lk, Dv)`` -> ``(output (B, Lq, Hq, Dv), None)``; no weights, as SDPA."""
    options = score_options(dropout, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    bias = kwargs.get("position_bias")
    layout = None
    if bias is None:
        read = causal_layout if causal else bidirectional_layout
        layout = read(query, key, attention_mask, kwargs)
    if layout is None:
        out = masked_attention(query, key, value, attention_mask, bias, causal, scaling, options)
        return out, None
    if layout.sequences is not None:
        return packed_attention(query, key, value, layout, scaling, options), None
    key, value = key[:, :, : layout.key_length], value[:, :, : layout.key_length]
    out = attention(
        query, key, value, scale=scaling, key_mask=layout.key_mask, window=layout.window,
        **options,
    )
    return out.transpose(1, 2).contiguous(), None


def causal_layout(
    query: Tensor, key: Tensor, attention_mask: Optional[Tensor], kwargs: Dict[str, Any]
) -> Optional[MaskLayout]:
    """The fast layout of a causal layer's call (a per-key mask, a sliding window, packed
    sequences), or ``None`` for any other mask, which the op then takes as ``attn_mask``."""
    batch, lq, lk = query.size(0), query.size(2), key.size(2)
    explicit = sequences_from_kwargs(kwargs, batch, lq, lk, query.device)
    if attention_mask is None:
        # A mask would show a sliding window; without one only the kwarg says it.
        window = window_of(kwargs.get("sliding_window"))
        position_ids = kwargs.get("position_ids")
        sequences = explicit or sequences_from_position_ids(position_ids, batch, lq, lk)
        if sequences is not None:
            return MaskLayout(lk, sequences=sequences, window=window)
        if 1 < lq < lk:
            # No mask means SDPA's is_causal, top-left aligned: transformers passes this only for
            # the prefill of an empty static cache, whose keys past Lq are unused slots. Our op
            # aligns bottom-right, so the slots are cut off, as transformers' SDPA backend does.
            return MaskLayout(lq, window=window)
        return MaskLayout(lk, window=window)
    boolean = as_boolean_mask(attention_mask, batch, lq, lk)
    layout = None if boolean is None else read_mask(boolean, lq, lk)
    if layout is None:
        if explicit is not None:
            raise ValueError(
                f"{NAME}: attention_mask and cu_seq_lens_q/cu_seq_lens_k describe different "
                f"sequences (cu_seq_lens_q={explicit.cu_seqlens_q.tolist()}); pass one of them, "
                "or both for the same packing"
            )
        return None
    if is_whole_rows(layout, lq, lk):
        # Causality (or a sliding window) over whole rows, nothing hidden: what transformers
        # builds when it does not see the packing (while a cache is in use; gpt-oss always,
        # giving its masks no position_ids). Packing is the same for every layer of a forward:
        # the layers given no mask run packed, so this one does too, its window applying within
        # each sequence.
        sequences = explicit or sequences_from_position_ids(
            kwargs.get("position_ids"), batch, lq, lk
        )
        if sequences is not None:
            layout = MaskLayout(lk, sequences=sequences, window=layout.window)
    elif explicit is not None:
        check_same_sequences(layout, explicit)
    return layout


def bidirectional_layout(
    query: Tensor, key: Tensor, attention_mask: Optional[Tensor], kwargs: Dict[str, Any]
) -> Optional[MaskLayout]:
    """The fast layout of a non-causal layer's call (an encoder's, cross-attention): every key,
    or those a per-key mask keeps (padding), as the bidirectional masks transformers builds
    are; ``None`` for any other mask."""
    batch, lq, lk = query.size(0), query.size(2), key.size(2)
    if sequences_from_kwargs(kwargs, batch, lq, lk, query.device) is not None:
        raise NotImplementedError(
            f"{NAME}: packed sequences (cu_seq_lens_q/cu_seq_lens_k) in a non-causal layer are "
            "not supported; pass the block-diagonal attention_mask instead"
        )
    if attention_mask is None:
        return MaskLayout(lk, window=(-1, -1))
    boolean = as_boolean_mask(attention_mask, batch, lq, lk)
    if boolean is None or boolean.size(1) != 1 or lq == 0:
        return None
    keep = boolean[:, 0, 0]
    if not torch.equal(boolean[:, 0], keep[:, None, :].expand(-1, lq, -1)):
        return None
    return MaskLayout(lk, None if bool(keep.all()) else keep, window=(-1, -1))


def masked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    bias: Optional[Tensor],
    causal: bool,
    scale: Optional[float],
    options: Dict[str, Any],
) -> Tensor:
    """Any other mask (custom 4-D, bidirectional, prefix-LM, a bias in a float mask) and the
    ``position_bias`` a model adds: the op's ``attn_mask``, which says by itself which keys a
    query sees (transformers' masks include causality), over every key; without a mask, causal
    or full attention as the layer is. Transformers hides a key with its dtype's lowest value,
    the op with ``-inf``: the same probabilities (the exponential underflows to 0 either way),
    and the op then skips the blocks a mask hides. A learned mask or bias gets its gradient."""
    batch, lq, lk = query.size(0), query.size(2), key.size(2)
    mask = attention_mask
    if mask is not None:
        check_mask_shape(mask, batch, lq, lk)
        if mask.dtype != torch.bool:
            mask = mask.masked_fill(mask <= torch.finfo(mask.dtype).min / 2, -math.inf)
    if bias is not None:
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, -math.inf)
        else:
            mask = bias + mask
    window = (-1, -1) if attention_mask is not None or not causal else (-1, 0)
    out = attention(query, key, value, scale=scale, attn_mask=mask, window=window, **options)
    return out.transpose(1, 2).contiguous()


def score_options(dropout: float, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The op's ``softcap``, ``sinks`` and ``dropout_p`` from what the model passes (the op
    checks their values)."""
    softcap = kwargs.get("softcap")
    return dict(
        softcap=None if softcap is None else float(softcap),
        sinks=kwargs.get("s_aux"),
        dropout_p=float(dropout),
    )


def window_of(sliding_window: Optional[int]) -> Tuple[int, int]:
    """The op's window for transformers' ``sliding_window`` (a query sees itself and the
    ``sliding_window - 1`` keys before it; ``None``: causal)."""
    return (-1, 0) if sliding_window is None else (int(sliding_window) - 1, 0)


def packed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: MaskLayout,
    scale: Optional[float],
    options: Dict[str, Any],
) -> Tensor:
    """``(B, H, L, D)`` tensors whose flattened ``B * L`` rows hold ``layout``'s packed
    sequences -> transformers' ``(B, L, Hq, Dv)``."""
    batch, lq = query.size(0), query.size(2)
    sequences = layout.sequences

    def rows(t: Tensor) -> Tensor:
        return t.transpose(1, 2).reshape(-1, t.size(1), t.size(3))

    out = varlen_attention(
        rows(query),
        rows(key),
        rows(value),
        sequences.cu_seqlens_q,
        sequences.cu_seqlens_k,
        sequences.max_seqlen_q,
        sequences.max_seqlen_k,
        scale=scale,
        window=layout.window,
        **options,
    )
    return out.view(batch, lq, out.size(1), out.size(2))


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
