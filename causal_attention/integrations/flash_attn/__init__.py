"""flash-attn 2's Python functions on causal_attention's CPU op.

Code written for flash-attn runs on the CPU by changing one import::

    from causal_attention.integrations.flash_attn import (
        flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
    )

and likewise for the packed forms ``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``,
``flash_attn_varlen_qkvpacked_func`` and ``flash_attn_varlen_kvpacked_func``. The functions keep
flash-attn 2's signatures (names, order, defaults) and layouts: ``q (batch, seqlen, nheads,
headdim)``, packed ``(total, nheads, headdim)`` for varlen, K/V with fewer heads for GQA/MQA;
``qkv (batch, seqlen, 3, nheads, headdim)`` and ``kv (batch, seqlen_k, 2, nheads_k, headdim)``
(varlen: ``(total, 3, nheads, headdim)`` and ``(total_k, 2, nheads_k, headdim)``) for the packed
forms, which are ``flash_attn_func`` / ``flash_attn_varlen_func`` on views of the packed tensor
(nothing copied; the qkv-packed varlen call uses ``cu_seqlens`` and ``max_seqlen`` for queries
and keys alike): the same options and results, gradients into the packed tensor, and errors
naming the packed function and its own arguments. They compute what flash-attn computes, and
raise ``NotImplementedError`` naming the argument for the little they do not serve, so a program
is never silently computed differently than with flash-attn. Served, with flash-attn's semantics:

- the mask: row i of a sequence with ``seqlen_q`` queries and ``seqlen_k`` keys sees keys
  ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` for
  ``window_size=(left, right)`` (a tuple or list of two ints, or a CPU int tensor of shape
  ``(2,)`` as flash-attn's tests pass it), a negative bound unbounded; ``causal=True`` sets
  ``right = 0`` (bottom-right causal), and ``causal=False`` with ``(-1, -1)`` is full attention.
  flash-attn's rewriting of the window is reproduced exactly (flash_api.cpp): a bound at least
  ``seqlen_k`` (``max_seqlen_k`` for varlen, the cache's capacity for the KV cache) is
  unbounded, causal is dropped for one query row without ALiBi, and then a window with one
  negative bound gets ``seqlen_k`` for it, which only differs from unbounded for rows more than
  ``seqlen_k`` keys before the last one. Rows that see no key return zeros.
- ``softcap > 0``: scores ``softcap * tanh(scores / softcap)`` (``<= 0``: off);
  ``alibi_slopes``, float32 ``(nheads,)`` or ``(batch, nheads)``: a bias of
  ``-slope * |i + seqlen_k - seqlen_q - j|`` after softcapping; ``dropout_p`` in ``[0, 1)``:
  dropout on the probabilities, its seed drawn from torch's default (CPU) generator, so the same
  generator state gives the same result bit for bit (flash-attn draws from the CUDA generator;
  flash-attn refuses softcap with dropout, which is served here). ``softmax_scale`` defaults to
  ``1 / sqrt(headdim)``; ``deterministic`` and ``num_splits`` are accepted and change nothing
  (the op is always deterministic and picks its own key splits).
- ``return_attn_probs=True`` (without dropout): ``(out, softmax_lse, S_dmask)``, ``softmax_lse``
  ``(batch, nheads, seqlen_q)`` (varlen: ``(nheads, total_q)``), float32 (float64 for float64
  inputs), and ``S_dmask`` the empty tensor flash-attn itself returns when ``dropout_p=0``. With
  ALiBi and flash-attn's causal kernel (``window_size`` left unbounded, ``right = 0``),
  ``softmax_lse`` is flash-attn's: that kernel adds ``slope * j`` rather than the bias above,
  the same probabilities, but a log-sum-exp larger by ``slope * (i + seqlen_k - seqlen_q)``.
  The one difference: a row that sees no key has ``lse = -inf`` (the log of an empty sum),
  where flash-attn's unsplit kernel writes ``+inf``.
- gradients through ``flash_attn_func``, ``flash_attn_varlen_func`` and their packed forms
  (none for the slopes, as in flash-attn).
- ``flash_attn_with_kvcache``: ``k``/``v`` written into ``k_cache``/``v_cache`` in place at
  ``cache_seqlens`` (an int or an int32 ``(batch,)`` tensor), then every batch row attends to its
  own keys ``cache_leftpad[b] <= j < cache_seqlens[b] + seqlen_new``, the mask and ALiBi aligned
  to its own length (flash-attn counts the ALiBi lse shift from ``cache_leftpad[b]``);
  ``cache_batch_idx`` (rows of the cache), ``cache_leftpad``, ``block_table`` (a paged cache,
  its pages read in place by ``causal_attention.paged_attention``, in one call for the batch)
  and rotary embeddings (``rotary_cos``/``rotary_sin``, interleaved or not, applied to ``q`` and
  the new keys at positions ``cache_seqlens[b] + i`` as flash-attn does, every query row at
  ``cache_seqlens[b]`` where the mask is neither causal nor local) are served;
  ``return_softmax_lse`` returns ``(out, softmax_lse)``. As in flash-attn it is not
  differentiable (it runs under ``torch.no_grad()``). With repeated
  ``cache_batch_idx`` entries the last row's new keys are the ones left in the cache, and every
  row attends to the cache as left after all the writes.
- ``flash_attn_with_kvcache`` on 8-bit caches (``torch.float8_e4m3fn``, ``torch.float8_e5m2``,
  ``torch.int8``) with flash-attn 3's keyword arguments ``k_descale``/``v_descale`` (keyword-only
  here, after flash-attn 2's signature): one scale per tensor, flash-attn 3's float32
  ``(batch, nheads_k)`` (where rows sharing a cache row or page agree), or one per token and KV
  head beside the cache; read in place by ``paged_attention`` (a dense cache as pages of one
  cache row), the new ``k``/``v`` quantized as they are written (see its docstring).
- ``flash_attn_varlen_func(..., block_table=...)``: ``k``/``v`` a paged cache
  ``(num_blocks, page_block_size, nheads_k, headdim)``, sequence b's keys the first
  ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` rows of its pages, read in place by
  ``paged_attention``; inference only (inputs that require grad, or dropout, are refused).

Refused (``NotImplementedError``): ``return_attn_probs=True`` with ``dropout_p > 0`` (flash-attn's
testing-only S_dmask encoding of the dropout pattern), ``block_table`` in
``flash_attn_varlen_func`` with gradients or dropout, and ``block_table`` with
``cache_batch_idx`` or ``cache_leftpad``
(flash-attn refuses those pairs too), and ``q_descale`` (flash-attn 3's fp8 ``q``). flash-attn's
CUDA-only limits (fp16/bf16, head dimension at most 256, a multiple of 8, page sizes a multiple
of 256) do not apply: float32 and float64 work, and ``v`` may have a head dimension of its own.
Bad types raise ``TypeError``, bad shapes and values ``ValueError``, each naming the argument;
a ``block_table`` naming a page outside the pool raises an error that is both a ``ValueError``
and the ``RuntimeError`` flash-attn raises for it.
``softmax_scale``, ``softcap`` and ``dropout_p`` are real numbers (int, float, numpy; not bool)
or tensors holding one; a tensor that requires grad is refused (``TypeError``), as the number it
holds would get no gradient.
"""

from ._dense import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from ._kvcache import flash_attn_with_kvcache
from ._varlen import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]
