"""Multi-head latent attention (MLA, DeepSeek-V2) for the tests: one attention layer in its two
forms, the unabsorbed one (per-head keys and values up-projected from the latent, through
causal_attention.attention) and the absorbed decode that serving runs (every query head
against the latent itself, one KV head, through causal_attention.paged_attention with the
values a view of the keys: a PagedKVCache with values_in_keys).

Per token, the latent is ``c_kv = x W_DKV`` (``latent_dim`` features) and the decoupled rotary
key ``k_rope = RoPE(x W_KR)`` (``rope_dim``, shared by every head); head h's query is
``[q_nope_h, RoPE(q_rope_h)]`` from ``x W_Q``, its keys ``[c_kv W_UK_h, k_rope]`` and values
``c_kv W_UV_h``, its scores scaled by ``1/sqrt(nope_dim + rope_dim)``; the heads' outputs go
through ``W_O``. DeepSeek-V2's query compression and the latent's norm are left out: neither
changes how the two forms meet."""

import math
from typing import Sequence

import torch
from torch import Tensor, nn

import causal_attention
from causal_attention import PagedKVCache


def rope(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """``x (..., d)`` turned by rotary embeddings at ``positions`` (broadcast against
    ``x.shape[:-1]``), pairs ``(j, j + d/2)`` (GPT-NeoX), in float32 (float64 for float64) and
    rounded once to x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = x.shape[-1] // 2
    inv_freq = base ** -(torch.arange(half, dtype=acc) / half)
    angles = positions.to(acc).unsqueeze(-1) * inv_freq
    cos, sin = angles.cos(), angles.sin()
    a, b = x.to(acc).split(half, -1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)


class LatentAttention(nn.Module):
    """One MLA layer, ``(..., E) -> (..., E)``: :meth:`forward` is the unabsorbed form over whole
    sequences, :meth:`absorbed_step` the absorbed one over a step's new tokens and a
    :class:`PagedKVCache` of rows ``[c_kv, k_rope]`` (one KV head, ``D = latent_dim + rope_dim``,
    ``Dv = latent_dim``, ``values_in_keys``)."""

    def __init__(self, embed_dim: int, num_heads: int, latent_dim: int, rope_dim: int,
                 nope_dim: int, value_dim: int):
        super().__init__()
        self.num_heads, self.latent_dim, self.rope_dim = num_heads, latent_dim, rope_dim
        self.nope_dim, self.value_dim = nope_dim, value_dim
        self.scale = 1 / math.sqrt(nope_dim + rope_dim)
        self.down_kv = nn.Linear(embed_dim, latent_dim, bias=False)  # W_DKV
        self.key_rope = nn.Linear(embed_dim, rope_dim, bias=False)  # W_KR
        self.query = nn.Linear(embed_dim, num_heads * (nope_dim + rope_dim), bias=False)
        self.up_key = nn.Linear(latent_dim, num_heads * nope_dim, bias=False)  # W_UK
        self.up_value = nn.Linear(latent_dim, num_heads * value_dim, bias=False)  # W_UV
        self.out = nn.Linear(num_heads * value_dim, embed_dim, bias=False)  # W_O
        # Unit gain: features of about unit size and scores spread over O(1), so that a wrong
        # term (a missing rotary part, a wrong scale) moves the outputs far beyond round-off.
        for layer in self.children():
            nn.init.normal_(layer.weight, std=layer.in_features ** -0.5)

    def queries(self, x: Tensor, positions: Tensor):
        """``(q_nope (..., H, nope_dim), q_rope (..., H, rope_dim))``, q_rope turned."""
        q = self.query(x).unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], -1)
        return q_nope, rope(q_rope, positions.unsqueeze(-1))

    def latent(self, x: Tensor, positions: Tensor) -> Tensor:
        """The tokens' cache rows ``[c_kv, k_rope] (..., latent_dim + rope_dim)``."""
        return torch.cat([self.down_kv(x), rope(self.key_rope(x), positions)], -1)

    def forward(self, x: Tensor) -> Tensor:
        """The unabsorbed form over whole sequences ``x (B, L, E)``, causal."""
        return self.unabsorbed(x, self.latent(x, torch.arange(x.shape[-2])))

    def unabsorbed(self, x: Tensor, latent: Tensor) -> Tensor:
        """The unabsorbed form of ``x (B, L, E)`` on the given ``latent (B, L, D)`` (an 8-bit
        cache's, dequantized): every head's keys and values up-projected, causal attention."""
        q_nope, q_rope = self.queries(x, torch.arange(x.shape[-2]))
        c_kv, k_rope = latent.split([self.latent_dim, self.rope_dim], -1)
        k_nope = self.up_key(c_kv).unflatten(-1, (self.num_heads, self.nope_dim))
        k = torch.cat([k_nope, k_rope.unsqueeze(-2).expand_as(q_rope)], -1)
        v = self.up_value(c_kv).unflatten(-1, (self.num_heads, self.value_dim))
        q = torch.cat([q_nope, q_rope], -1)
        heads_first = [t.transpose(-3, -2) for t in (q, k, v)]
        out = causal_attention.attention(*heads_first, scale=self.scale)
        return self.out(out.transpose(-3, -2).flatten(-2))

    def absorbed_step(self, x: Tensor, tokens: Sequence[int], cache: PagedKVCache) -> Tensor:
        """The absorbed form over one step's new tokens ``x (total, E)``, ``tokens[b]`` of
        request b (the cache's requests 0, 1, ...) in order: their latent rows written into
        ``cache``, then every query head attends the latent rows through the pages,
        ``(total, E)``."""
        step = cache.step(range(len(tokens)), tokens)
        q_nope, q_rope = self.queries(x, step.positions)
        cache.append(0, self.latent(x, step.positions).unsqueeze(1), None, step.slot_mapping)
        # q_nope_h . (c_kv W_UK_h) = (q_nope_h W_UK_h^T) . c_kv: W_UK absorbed into the query,
        # each head's query meets the latent row itself.
        up_key = self.up_key.weight.view(self.num_heads, self.nope_dim, self.latent_dim)
        q = torch.cat([torch.einsum("thn,hnc->thc", q_nope, up_key), q_rope], -1)
        out_latent = causal_attention.paged_attention(
            q, cache.key_pages[0], cache.value_pages[0], step.block_table, step.seqlens,
            cu_seqlens_q=step.cu_seqlens_q, max_seqlen_q=step.max_seqlen_q, scale=self.scale,
            k_scale=cache.key_scales[0], v_scale=cache.value_scales[0])
        # softmax . (c_kv W_UV_h) = (softmax . c_kv) W_UV_h: W_UV applied after the attention.
        up_value = self.up_value.weight.view(self.num_heads, self.value_dim, self.latent_dim)
        return self.out(torch.einsum("thc,hvc->thv", out_latent, up_value).flatten(-2))
