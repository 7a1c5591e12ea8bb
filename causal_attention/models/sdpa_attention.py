"""``SDPASelfAttention``: :class:`causal_attention.CausalSelfAttention` with torch's
``scaled_dot_product_attention`` in place of our op — the baseline that training compares against.

Parameters, projections and the KV cache are inherited, so a state_dict moves between the two
unchanged and the only difference between them is the attention call itself.
"""

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from .._masks import visible_keys
from ..kv_cache import KVCache
from ..nn import CausalSelfAttention


class SDPASelfAttention(CausalSelfAttention):
    """Same constructor and parameters as :class:`CausalSelfAttention`; ``forward(x, cache)``
    computes the same function with ``F.scaled_dot_product_attention``. The score options
    (``window``, ``softcap``, ``sinks``, ``alibi``, ``attn_dropout``) raise
    ``NotImplementedError`` rather than being ignored: this is the plain causal baseline; so does
    an 8-bit :class:`KVCache`, which SDPA does not read."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if (
            self.window != (-1, 0)
            or self.softcap is not None
            or self.sinks is not None
            or self.alibi_slopes is not None
            or self.attn_dropout != 0.0
        ):
            raise NotImplementedError(
                "SDPASelfAttention: the score options are not implemented (it is the plain "
                f"causal baseline), got {self.extra_repr()}"
            )

    # No need_weights: the weights are our op's (attention_weights), not SDPA's.
    def forward(self, x: Tensor, cache: Optional[KVCache] = None) -> Tensor:  # type: ignore
        if cache is not None and cache.quantized:
            raise NotImplementedError(
                "SDPASelfAttention: the SDPA baseline reads float KV caches only, got an 8-bit "
                "one; use CausalSelfAttention"
            )
        q, k, v = self._project_heads(x, cache)
        return self._project_output(sdpa_bottom_right_causal(q, k, v))


def sdpa_bottom_right_causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA with our op's causal alignment. SDPA's ``is_causal`` aligns top-left, which equals
    bottom-right only when ``Lq == Lk``; with cached keys (``Lk > Lq``) the mask is spelled out."""
    lq, lk = q.size(-2), k.size(-2)
    enable_gqa = q.size(-3) != k.size(-3)
    if lq == lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    visible = visible_keys(lq, lk, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=enable_gqa)
