"""The checks of what :class:`causal_attention.CausalSelfAttention` is called with: the input
``x`` and its ``key_mask``. Scripted modules compile them too (each takes tensors only)."""

import torch
from torch import Tensor


def check_input(x: Tensor, embed_dim: int, dtype: torch.dtype) -> None:
    """Raises unless ``x`` is a ``(B, L, embed_dim)`` tensor of the parameters' ``dtype``."""
    # Eager only: TorchScript checks x's type at the call and compiles this branch away.
    if not isinstance(x, Tensor):
        raise TypeError(
            f"CausalSelfAttention: x must be a tensor (B, L, E), got {type(x).__name__}"
        )
    if x.dim() != 3 or x.size(2) != embed_dim:
        raise ValueError(
            f"CausalSelfAttention: x must be (B, L, E) with E=embed_dim={embed_dim}, "
            f"got x.shape={list(x.shape)}"
        )
    if x.dtype != dtype:
        raise TypeError(
            f"CausalSelfAttention: x must have the parameters' dtype {dtype}, got "
            f"x.dtype={x.dtype}"
        )


def check_key_mask(key_mask: Tensor, x: Tensor) -> None:
    """Raises unless ``key_mask`` is a bool ``(B, L)`` tensor on ``x``'s device."""
    if not isinstance(key_mask, Tensor):
        raise TypeError(
            "CausalSelfAttention: key_mask must be a bool tensor (B, L) or None, got "
            f"{type(key_mask).__name__}"
        )
    if key_mask.dtype != torch.bool:
        raise TypeError(
            "CausalSelfAttention: key_mask must be a bool tensor (True for real tokens; "
            f"convert an attention_mask with .bool()), got key_mask.dtype={key_mask.dtype}"
        )
    if not (
        key_mask.dim() == 2 and key_mask.size(0) == x.size(0) and key_mask.size(1) == x.size(1)
    ):
        raise ValueError(
            f"CausalSelfAttention: key_mask must be (B, L)={[x.size(0), x.size(1)]} of x, got "
            f"key_mask.shape={list(key_mask.shape)} for x.shape={list(x.shape)}"
        )
    if key_mask.device != x.device:
        raise ValueError(
            f"CausalSelfAttention: key_mask must be on x's device {x.device}, got "
            f"key_mask.device={key_mask.device}"
        )
