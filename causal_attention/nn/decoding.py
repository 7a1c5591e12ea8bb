"""The decoding paths of :class:`causal_attention.CausalSelfAttention` besides ``forward``'s own
cache argument: making its KV cache (scripted too), attending from an 8-bit one (scripted too),
and serving from a paged KV cache (eager)."""

from typing import Optional

import torch
from torch import Tensor

from ..kv_cache import KVCache

# The op itself, as for the module's attention (self_attention.py): TorchScript must compile it.
_paged_attention = torch.ops.causal_attention.paged_attention


class Decoding:
    """:meth:`make_cache`, :meth:`forward_paged` and :meth:`make_paged_cache` of
    :class:`causal_attention.CausalSelfAttention`, and its attention from an 8-bit
    :class:`KVCache`; the module provides the sizes, layers and options they read."""

    @torch.jit.export
    def make_cache(
        self,
        batch_size: int,
        max_len: int,
        dtype: Optional[torch.dtype] = None,
        scales: Optional[str] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
    ) -> KVCache:
        """An empty :class:`KVCache` for ``batch_size`` sequences of up to ``max_len`` positions,
        on the device of the parameters, in ``dtype`` (the parameters' by default; an 8-bit
        dtype with ``scales``, ``k_scale`` and ``v_scale`` as :class:`KVCache` takes them):
        ``forward`` decodes from any of them, an 8-bit one in inference only (no gradient, no
        ``key_mask``, ``attn_mask``, attention dropout or weights)."""
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(
                "CausalSelfAttention.make_cache: batch_size and max_len must be positive, got "
                f"batch_size={batch_size}, max_len={max_len}"
            )
        weight = self.c_attn.weight
        storage_dtype = weight.dtype if dtype is None else dtype
        shape = [batch_size, self.num_kv_heads, max_len]
        return KVCache(
            torch.zeros(shape + [self.head_dim], dtype=storage_dtype, device=weight.device),
            torch.zeros(shape + [self.value_head_dim], dtype=storage_dtype, device=weight.device),
            scales,
            k_scale,
            v_scale,
        )

    def _decode_quantized(
        self,
        x: Tensor,
        cache: KVCache,
        key_mask: Optional[Tensor],
        attn_mask: Optional[Tensor],
    ) -> Tensor:
        """``forward``'s attention ``(B, Hq, L, Dv)`` with an 8-bit :class:`KVCache`: the new
        keys and values appended (quantized), the queries attending the whole cache
        (:meth:`_attend_quantized`), inference only, with the module's window, softcap, ALiBi
        and sinks. What that does not serve raises before anything enters the cache."""
        for name, mask in (("key_mask", key_mask), ("attn_mask", attn_mask)):
            if mask is not None:
                raise NotImplementedError(
                    f"CausalSelfAttention: {name} with an 8-bit KVCache is not supported (the "
                    "attention on 8-bit keys and values takes no mask); use a float cache"
                )
        if self.training and self.attn_dropout > 0.0:
            raise NotImplementedError(
                "CausalSelfAttention: attn_dropout in training with an 8-bit KVCache is not "
                "supported (8-bit caches are for inference); call eval()"
            )
        if self.context_parallel_on:
            raise ValueError(
                "CausalSelfAttention: under context parallelism (set_context_parallel) forward "
                "takes no cache or attn_mask"
            )
        q, k, v, _ = self._project_heads_and_mask(x, None, None)
        records = q.requires_grad
        sinks = self.sinks
        # An if, not an and: TorchScript types a module without sinks' None as NoneType, whose
        # attributes it compiles only in a branch it can drop.
        if sinks is not None:
            records = records or sinks.requires_grad
        if records and torch.is_grad_enabled():
            raise NotImplementedError(
                "CausalSelfAttention: decoding from an 8-bit KVCache is inference only (8-bit "
                "keys and values are not differentiable); call under torch.no_grad() or "
                "torch.inference_mode()"
            )
        k, v, _ = cache.append(k, v, None)
        return self._attend_quantized(q, k, v, cache)

    def _attend_quantized(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache) -> Tensor:
        """Queries ``(B, Hq, L, D)`` attending an 8-bit cache's keys ``k`` and values ``v``
        (its views after the append) with its :attr:`KVCache.key_scales` and
        :attr:`KVCache.value_scales`: what ``causal_attention.attention(q, k, v, k_scale=...,
        v_scale=...)`` computes, by the op it calls, the paged attention reading each sequence's
        cache as one page in place. The op itself rather than that wrapper, which TorchScript
        cannot compile: so a scripted module decodes from 8-bit caches too."""
        k_scale, v_scale = cache.key_scales, cache.value_scales
        assert k_scale is not None and v_scale is not None  # for TorchScript: the cache is 8-bit
        if k_scale.dim() == 3:
            # Per token, (B, Hkv, L) -> (B, L, Hkv): the pages' (num_pages, page_size, Hkv).
            k_scale, v_scale = k_scale.transpose(1, 2), v_scale.transpose(1, 2)
        batch, length = k.size(0), k.size(2)
        if length == 0:
            # Nothing cached, nothing appended: no row. (The paged op divides by the page size:
            # a page of 0 rows stops the process with SIGFPE.)
            return q.new_zeros([batch, q.size(1), 0, v.size(3)])
        table = torch.arange(batch, dtype=torch.int32, device=k.device).unsqueeze(1)
        lengths = torch.full([batch], length, dtype=torch.int32, device=k.device)
        # (B, H, L, D) -> (B, L, H, D) as views: sequence b's keys are page b, rows 0..L-1.
        out, _ = _paged_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            table,
            lengths,
            window=self.window,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return out.transpose(1, 2)  # (B, Hq, L, Dv)

    @torch.jit.unused
    def forward_paged(self, x: Tensor, step, layer: int = 0) -> Tensor:
        """Serving from a paged KV cache: ``x (total, E)``, the new tokens of a step's requests
        one after the other (:meth:`causal_attention.PagedKVCache.step`: a prefill chunk's,
        a decode's one), their keys and values written into the pages of layer ``layer`` in
        place, each query attending every key of its request (windowed, softcapped, with ALiBi
        and sinks as ``forward``); returns ``(total, E)``. Inference only: in grad mode it runs,
        but the pages take the keys and values detached and the attention through them carries
        no gradient (call it under ``torch.no_grad()``); eager (the op itself compiles and
        exports), not TorchScript."""
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
        q, k, v = self._project_token_heads(x)
        attended = step.attend(
            layer, q, k, v, window=self.window, softcap=self.softcap,
            alibi_slopes=self.alibi_slopes, sinks=self.sinks,
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
