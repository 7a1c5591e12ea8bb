"""causal_attention: exact causal scaled-dot-product attention for PyTorch, as custom operators
(``torch.ops.causal_attention.*``) with C++ autograd and Meta kernels."""

from . import _library

_library.load()

from .functional import scaled_dot_product_attention  # noqa: E402
from .ops import attention, attention_backward, attention_forward  # noqa: E402

__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "scaled_dot_product_attention",
]
