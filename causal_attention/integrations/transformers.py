"""causal_attention as a Hugging Face transformers attention backend.

    import causal_attention.integrations.transformers as ca_transformers
    ca_transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="causal_attention")

It serves what the op computes exactly: causal self-attention (GQA included, K/V heads read in
place), with or without transformers' KV cache, and masks that hide nothing causality does not
already hide. Anything else — padding, packed sequences, a sliding window that bites, a static
cache's unused slots, attention dropout, non-causal or cross-attention, softcapping, attention
sinks, position biases — raises an error naming it, so a model is never silently computed
differently than with ``attn_implementation="sdpa"``.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..ops import attention

NAME = "causal_attention"


def register() -> None:
    """Registers :func:`attention_forward` as ``attn_implementation="causal_attention"``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    # Without a mask function of its own, transformers builds no mask at all for a backend, and
    # padding would silently go unmasked. SDPA's returns None whenever causality alone suffices
    # and a 4-D boolean mask otherwise, which attention_forward then checks.
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
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not is_causal:
        raise NotImplementedError(
            f"{NAME}: non-causal attention (is_causal=False, e.g. an encoder or cross-attention "
            f"in {type(module).__name__}) is not supported; use attn_implementation='sdpa'"
        )
    if dropout != 0.0:
        raise NotImplementedError(
            f"{NAME}: attention dropout is not supported, got dropout={dropout}; set the "
            "config's attention dropout (attn_pdrop, attention_dropout) to 0 or call model.eval()"
        )
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{NAME}: {name} is not supported")
    lq, lk = query.size(2), key.size(2)
    if attention_mask is None and 1 < lq < lk:
        # No mask means SDPA's is_causal, top-left aligned: transformers passes this only for the
        # prefill of an empty static cache, whose keys past Lq are unused slots. Our op aligns
        # bottom-right, so the slots are cut off, as transformers' SDPA backend does.
        key, value = key[:, :, :lq], value[:, :, :lq]
    elif attention_mask is not None:
        check_mask_is_causal(attention_mask, lq, lk)
    out = attention(query, key, value, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def check_mask_is_causal(mask: Tensor, lq: int, lk: int) -> None:
    """Raises ``ValueError`` unless ``mask (..., Lq, Lk)`` (boolean: True attends; float: 0
    attends, a very negative value masks) allows exactly what bottom-right causality allows."""
    if mask.dim() != 4 or mask.shape[-2:] != (lq, lk):
        raise ValueError(
            f"{NAME}: attention_mask must be (B, 1 or H, Lq, Lk) = (B, *, {lq}, {lk}), got "
            f"attention_mask.shape={list(mask.shape)}"
        )
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=mask.device).tril(lk - lq)
    if mask.dtype == torch.bool:
        matches = mask == allowed
    else:
        matches = torch.where(allowed, mask == 0, mask <= torch.finfo(mask.dtype).min / 2)
    if not bool(matches.all()):
        raise ValueError(
            f"{NAME}: attention_mask masks more than causality does (padding, packed sequences, "
            "a sliding window or a static cache's unused slots); the op computes causal "
            "attention only, so this mask cannot be honoured. Pass unpadded batches (an "
            "attention_mask of ones, or none) or use attn_implementation='sdpa'"
        )
