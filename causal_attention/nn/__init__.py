"""``CausalSelfAttention``: a multi-head causal self-attention module on the causal_attention op,
with nanoGPT's parameter names, so it swaps into nanoGPT-style models and loads their checkpoints,
and the op's score options: sliding windows, softcapping, ALiBi, learned sinks and attention
dropout.

The module is one class whose parts live in this package's modules, one concept each: the module
itself (:mod:`.self_attention`: projections, attention, its state), its options and ALiBi's
slopes (:mod:`.options`), the checks of its inputs (:mod:`.inputs`), its attention weights
(:mod:`.weights`), its decoding paths, KV cache and paged KV cache (:mod:`.decoding`),
context parallelism (:mod:`.context_parallel`) and packed documents (:mod:`.packed`).
"""

from .options import alibi_slopes
from .self_attention import CausalSelfAttention

__all__ = ["CausalSelfAttention", "alibi_slopes"]

# The class keeps the name it had before this package split it up, for what records where it
# lives: pickles of whole modules and the type names in saved TorchScript programs.
CausalSelfAttention.__module__ = __name__
