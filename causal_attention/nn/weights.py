"""The attention weights of :class:`causal_attention.CausalSelfAttention`: its forward that also
returns the probabilities it attended with (``forward(x, need_weights=True)``), scripted too."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..kv_cache import KVCache

# The op itself, as for the module's attention (self_attention.py): TorchScript must compile it.
_attention_weights = torch.ops.causal_attention.attention_weights


class AttentionWeights:
    """:meth:`forward_with_weights` of :class:`causal_attention.CausalSelfAttention`, which
    provides the projections, the attention and the options it reads."""

    @torch.jit.export
    def forward_with_weights(
        self,
        x: Tensor,
        cache: Optional[KVCache] = None,
        key_mask: Optional[Tensor] = None,
        attn_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        """``forward(x, cache, need_weights=True, key_mask=key_mask, attn_mask=attn_mask)``: the
        output and the attention probabilities ``(B, Hq, L, cached + L)``; also on a scripted
        module. Not from an 8-bit cache (NotImplementedError): its attention returns no
        weights."""
        if cache is not None and cache.quantized:
            raise NotImplementedError(
                "CausalSelfAttention: attention weights from an 8-bit KVCache are not supported "
                "(the attention on 8-bit keys and values returns the output only)"
            )
        q, k, v, mask = self._project_heads_and_mask(x, cache, key_mask)
        dropout_p = self._attention_dropout_p()
        weights = _attention_weights(
            q,
            k,
            v,
            key_mask=mask,
            attn_mask=attn_mask,
            window=self.window,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
            dropout_p=dropout_p,
        )
        if dropout_p == 0.0:
            return self._project_output(self._attend(q, k, v, mask, attn_mask)), weights
        # Every call draws a new dropout mask: the output is made from these weights, so that it
        # is the one they describe. Query head h reads key/value head h // (Hq // Hkv).
        batch, length, cached = q.size(0), q.size(2), k.size(2)
        grouped = weights.reshape(batch, self.num_kv_heads, -1, length, cached)
        attended = torch.matmul(grouped, v.unsqueeze(2)).flatten(1, 2)
        return self._project_output(attended), weights
