"""The decoding paths of :class:`causal_attention.CausalSelfAttention` besides ``forward``'s own
cache argument: making its KV cache (scripted too), and serving from a paged KV cache (eager)."""

from typing import Optional

import torch
from torch import Tensor

from ..kv_cache import KVCache


class Decoding:
    """:meth:`make_cache`, :meth:`forward_paged` and :meth:`make_paged_cache` of
    :class:`causal_attention.CausalSelfAttention`, which provides the sizes and layers they
    read."""

    @torch.jit.export
    def make_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch_size`` sequences of up to ``max_len`` positions,
        in the dtype and on the device of the parameters."""
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(
                "CausalSelfAttention.make_cache: batch_size and max_len must be positive, got "
                f"batch_size={batch_size}, max_len={max_len}"
            )
        weight = self.c_attn.weight
        shape = [batch_size, self.num_kv_heads, max_len]
        return KVCache(
            torch.zeros(shape + [self.head_dim], dtype=weight.dtype, device=weight.device),
            torch.zeros(shape + [self.value_head_dim], dtype=weight.dtype, device=weight.device),
        )

    @torch.jit.unused
    def forward_paged(self, x: Tensor, step, layer: int = 0) -> Tensor:
        """Serving from a paged KV cache: ``x (total, E)``, the new tokens of a step's requests
        one after the other (:meth:`causal_attention.PagedKVCache.step`: a prefill chunk's,
        a decode's one), their keys and values written into the pages of layer ``layer`` in
        place, each query attending every key of its request (windowed, softcapped, with ALiBi
        and sinks as ``forward``); returns ``(total, E)``. Inference only (no gradient through
        the cache); eager (the op itself compiles and exports), not TorchScript."""
        if not isinstance(x, Tensor) or x.dim() != 2 or x.size(1) != self.embed_dim:
            raise ValueError(
                f"CausalSelfAttention.forward_paged: x must be (total, E) with "
                f"E=embed_dim={self.embed_dim}, got "
                f"{list(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
            )
        if x.size(0) != step.slot_mapping.numel():
            raise ValueError(
                f"CausalSelfAttention.forward_paged: x has {x.size(0)} tokens, the step "
                f"reserved {step.slot_mapping.numel()}"
            )
        total = x.size(0)
        q, k, v = self.c_attn(x).split(
            [
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
                self.num_kv_heads * self.value_head_dim,
            ],
            dim=-1,
        )
        attended = step.attend(
            layer, q.view(total, self.num_heads, self.head_dim),
            k.view(total, self.num_kv_heads, self.head_dim),
            v.view(total, self.num_kv_heads, self.value_head_dim), window=self.window,
            softcap=self.softcap, alibi_slopes=self.alibi_slopes, sinks=self.sinks,
        )
        return self.resid_dropout(self.c_proj(attended.flatten(1)))

    @torch.jit.unused
    def make_paged_cache(self, num_pages: int, page_size: int, num_layers: int = 1,
                         dtype: Optional[torch.dtype] = None, scales: Optional[str] = None,
                         k_scale=None, v_scale=None):
        """A :class:`causal_attention.PagedKVCache` of ``num_pages`` pages of ``page_size``
        tokens for ``num_layers`` modules like this one (heads, head dims, device), its pages
        in ``dtype`` (the parameters' by default; an 8-bit dtype with ``scales``, ``k_scale``
        and ``v_scale`` as :class:`causal_attention.PagedKVCache` takes them): forward_paged
        reads any of them."""
        from ..paged_kv_cache import PagedKVCache

        weight = self.c_attn.weight
        return PagedKVCache(num_pages, page_size, self.num_kv_heads, self.head_dim,
                            self.value_head_dim, num_layers,
                            dtype=weight.dtype if dtype is None else dtype,
                            device=weight.device, scales=scales, k_scale=k_scale,
                            v_scale=v_scale)
