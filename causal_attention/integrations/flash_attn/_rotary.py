"""Rotary embeddings as ``flash_attn_with_kvcache`` applies them to the queries and the new
keys (``_Rotary``)."""

from typing import Optional, Sequence

import torch
from torch import Tensor

from ._checks import _check_rank, _describe
from ._kvcache_call import _KVCacheCall


class _Rotary:
    """Rotary embeddings as flash_attn_with_kvcache applies them: the first ``rotary_dim``
    features of ``q`` and of the new keys of row b, token i, turned by the angle whose cosine and
    sine are row ``cache_seqlens[b] + i`` of ``rotary_cos`` / ``rotary_sin``; pairs are
    ``(2j, 2j + 1)`` when interleaved, else ``(j, j + rotary_dim / 2)`` (GPT-NeoX).

    Where flash-attn's mask is neither causal nor local (the op's window ``(-1, -1)`` after its
    rewriting), every query row of row b is turned at ``cache_seqlens[b]``, as flash-attn's
    kernel does (``queries_share_position``): its rows then have no order to encode."""

    def __init__(self, cos: Tensor, sin: Tensor, interleaved: bool,
                 queries_share_position: bool):
        self.cos, self.sin, self.interleaved = cos, sin, interleaved
        self.queries_share_position = queries_share_position

    @classmethod
    def of(cls, fn, cos, sin, interleaved, q, cache: _KVCacheCall,
           queries_share_position: bool) -> Optional["_Rotary"]:
        if cos is None and sin is None:
            return None
        if cos is None or sin is None:
            raise ValueError(
                f"{fn}: rotary_cos and rotary_sin go together, got rotary_cos={_describe(cos)} "
                f"and rotary_sin={_describe(sin)}"
            )
        if not cache.new:
            raise ValueError(
                f"{fn}: rotary_cos/rotary_sin need new keys k and v to rotate (as in flash-attn), "
                "got k=None"
            )
        for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
            _check_rank(fn, name, t, 2, "(seqlen_ro, rotary_dim / 2)")
            if not t.is_floating_point():
                raise TypeError(f"{fn}: {name} must be a floating tensor, got {t.dtype}")
        if cos.shape != sin.shape or 2 * cos.size(1) > q.size(3):
            raise ValueError(
                f"{fn}: rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with "
                f"rotary_dim <= headdim {q.size(3)}, got rotary_cos.shape={tuple(cos.shape)}, "
                f"rotary_sin.shape={tuple(sin.shape)}"
            )
        query_tokens = 1 if queries_share_position else q.size(1)
        tokens = max(query_tokens, cache.new)
        needed = max((length + tokens for length in cache.seqlens), default=0)
        if cos.size(0) < needed:
            rows = "1 (every query row at cache_seqlens[b])" if queries_share_position \
                else "seqlen_q"
            raise ValueError(
                f"{fn}: rotary_cos/rotary_sin have {cos.size(0)} positions; the rotated tokens "
                f"reach position {needed - 1} (cache_seqlens[b] + max(query rows, seqlen_new) - 1"
                f", query rows = {rows})"
            )
        return cls(cos, sin, bool(interleaved), queries_share_position)

    def apply(self, x: Tensor, seqlens: Sequence[int], share_position: bool = False) -> Tensor:
        """``x (batch, tokens, heads, headdim)`` rotated, in float32 (float64 for float64) and
        rounded once to its dtype; every token of row b at ``seqlens[b]`` with
        ``share_position``, else token i at ``seqlens[b] + i``."""
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        half = self.cos.size(1)
        steps = torch.zeros(x.size(1), dtype=torch.long) if share_position \
            else torch.arange(x.size(1))
        positions = torch.tensor(seqlens).unsqueeze(1) + steps
        cos = self.cos.to(acc)[positions].unsqueeze(2)
        sin = self.sin.to(acc)[positions].unsqueeze(2)
        part = x[..., : 2 * half].to(acc)
        if self.interleaved:
            a, b = part[..., 0::2], part[..., 1::2]
            turned = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            a, b = part[..., :half], part[..., half:]
            turned = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return torch.cat((turned.to(x.dtype), x[..., 2 * half :]), dim=-1)
