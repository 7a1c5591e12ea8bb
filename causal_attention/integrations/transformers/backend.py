"""The attention function of the transformers backend (:func:`attention_forward`) and its
registration (:func:`register`): each call's mask read into the layout the op serves fast
(mask_reading.py), then the op called dense, packed (:func:`packed_attention`) or with the mask
as its ``attn_mask`` (:func:`masked_attention`)."""

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from ...ops import attention, varlen_attention
from .mask_reading import (
    NAME,
    MaskLayout,
    as_boolean_mask,
    check_mask_shape,
    check_same_sequences,
    is_whole_rows,
    read_mask,
    sequences_from_kwargs,
    sequences_from_position_ids,
)


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
