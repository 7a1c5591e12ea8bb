"""The options of :class:`causal_attention.CausalSelfAttention`, checked when it is made: its head
sizes (with their defaults), its dropouts, its flags and its score options, and ALiBi's
slopes."""

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._arguments import check_window as check_ops_window


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's head slopes (Press et al.; BLOOM's ``build_alibi_tensor``), float32 ``(num_heads,)``:
    ``2^(-8 i / n)`` for ``i = 1..n`` when ``n`` is a power of two; otherwise those of the largest
    power of two ``c < n``, then every other slope of ``2 c`` heads (``2^(-4 (2 i - 1) / c)``,
    ``i = 1..n - c``), the paper's interpolation. Each is 2 to an exact exponent, rounded once."""
    if num_heads <= 0:
        raise ValueError(f"alibi_slopes: num_heads must be positive, got num_heads={num_heads}")
    closest = 1 << (num_heads.bit_length() - 1)
    exponents = [8 * i / closest for i in range(1, closest + 1)]
    exponents += [4 * (2 * i - 1) / closest for i in range(1, num_heads - closest + 1)]
    return torch.tensor([2.0**-e for e in exponents], dtype=torch.float32)


def head_sizes(
    embed_dim: int,
    num_heads: int,
    num_kv_heads: Optional[int],
    head_dim: Optional[int],
    value_head_dim: Optional[int],
) -> Tuple[int, int, int]:
    """``(num_kv_heads, head_dim, value_head_dim)``, each given or its default, after checking
    that the sizes make a module."""
    if embed_dim <= 0 or num_heads <= 0:
        raise ValueError(
            "CausalSelfAttention: embed_dim and num_heads must be positive, got "
            f"embed_dim={embed_dim}, num_heads={num_heads}"
        )
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            "CausalSelfAttention: num_kv_heads must be a positive divisor of num_heads, got "
            f"num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    if head_dim is None and embed_dim % num_heads != 0:
        raise ValueError(
            "CausalSelfAttention: embed_dim must be a multiple of num_heads unless head_dim "
            f"is given, got embed_dim={embed_dim}, num_heads={num_heads}"
        )
    head_dim = embed_dim // num_heads if head_dim is None else head_dim
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    if head_dim <= 0 or value_head_dim <= 0:
        raise ValueError(
            "CausalSelfAttention: head_dim and value_head_dim must be positive, got "
            f"head_dim={head_dim}, value_head_dim={value_head_dim}"
        )
    return num_kv_heads, head_dim, value_head_dim


def check_dropouts(dropout: float, attn_dropout: float) -> None:
    """Raises ``ValueError`` unless both dropout probabilities are in their ranges."""
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(
            f"CausalSelfAttention: dropout must be in [0, 1], got dropout={dropout}"
        )
    # Below 1, unlike dropout: the op has no all-dropped case (nn.Dropout(1) is all zeros).
    if not 0.0 <= attn_dropout < 1.0:
        raise ValueError(
            "CausalSelfAttention: attn_dropout must be in [0, 1), got "
            f"attn_dropout={attn_dropout}"
        )


def check_window(window: Sequence[int]) -> Tuple[int, int]:
    """``window`` as the module keeps it, two ints of at least -1."""
    left, right = check_ops_window("CausalSelfAttention", window)
    if left < -1 or right < -1:
        raise ValueError(
            "CausalSelfAttention: window entries must be >= -1 (-1: unbounded), got "
            f"window={(left, right)}"
        )
    return (left, right)


def check_flags(**flags: bool) -> None:
    """Raises ``TypeError`` unless each flag is a bool: a truthy string or number would
    otherwise switch an option on."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(
                f"CausalSelfAttention: {name} must be a bool, got {type(value).__name__} "
                f"{value!r}"
            )


def check_softcap(softcap: Optional[float]) -> Optional[float]:
    """``softcap`` as the module keeps it: a float ``> 0``, or None."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(
            "CausalSelfAttention: softcap must be a float or None, got "
            f"{type(softcap).__name__}"
        )
    if not 0 < softcap < math.inf:
        raise ValueError(
            f"CausalSelfAttention: softcap must be finite and > 0, got softcap={softcap}"
        )
    return float(softcap)
