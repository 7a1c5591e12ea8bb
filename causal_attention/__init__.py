"""causal_attention: exact causal scaled-dot-product attention for PyTorch, as custom operators
(``torch.ops.causal_attention.*``) with C++ autograd and Meta kernels, and a multi-head
``CausalSelfAttention`` module with a KV cache."""

from . import _library

_library.load()

from .functional import scaled_dot_product_attention  # noqa: E402
from .kv_cache import KVCache  # noqa: E402
from .nn import CausalSelfAttention  # noqa: E402
from .paged_kv_cache import PagedKVCache, paged_cache_append  # noqa: E402
from .ops import (  # noqa: E402
    attention,
    attention_backward,
    attention_gradients,
    attention_forward,
    attention_weights,
    paged_attention,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)

__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "attention_gradients",
    "attention_weights",
    "varlen_attention",
    "varlen_attention_forward",
    "varlen_attention_backward",
    "paged_attention",
    "scaled_dot_product_attention",
    "CausalSelfAttention",
    "KVCache",
    "PagedKVCache",
    "paged_cache_append",
]
