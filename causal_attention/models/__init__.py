"""Models built on :class:`causal_attention.CausalSelfAttention`."""

from .gpt import GPT
from .sdpa_attention import SDPASelfAttention

__all__ = ["GPT", "SDPASelfAttention"]
