"""A small GPT on :class:`causal_attention.CausalSelfAttention`: token and position embeddings,
pre-norm transformer blocks (nanoGPT's layout), a final norm and a vocabulary
head. ``attention="sdpa"`` builds the same model with torch's SDPA in the attention call only, so
that training runs of the two differ in nothing else. The model scripts (TorchScript), compiles
with ``fullgraph=True`` and exports; ``generate`` decodes with the modules' KV caches.
"""

from typing import List, Optional

import torch
from torch import Tensor, nn

from ..kv_cache import KVCache
from ..nn import CausalSelfAttention
from .sdpa_attention import SDPASelfAttention

ATTENTION_MODULES = {"causal_attention": CausalSelfAttention, "sdpa": SDPASelfAttention}


class Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: Optional[int],
        value_head_dim: Optional[int],
        attention: str,
    ):
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed_dim)
        self.attn = ATTENTION_MODULES[attention](
            embed_dim, num_heads, num_kv_heads=num_kv_heads, value_head_dim=value_head_dim
        )
        self.ln_2 = nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(), nn.Linear(4 * embed_dim, embed_dim)
        )

    def forward(self, x: Tensor, cache: Optional[KVCache] = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))

    @torch.jit.unused
    def forward_packed(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: Optional[int]) -> Tensor:
        """``forward`` on a packed batch of documents ``(tokens, E)``: ``attn.forward_packed``."""
        x = x + self.attn.forward_packed(self.ln_1(x), cu_seqlens, max_seqlen)
        return x + self.mlp(self.ln_2(x))

    @torch.jit.unused
    def forward_paged(self, x: Tensor, step, layer: int) -> Tensor:
        """``forward`` on a paged step's new tokens ``(total, E)``: ``attn.forward_paged``."""
        x = x + self.attn.forward_paged(self.ln_1(x), step, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``tokens (B, L) int64 -> logits (B, L, vocab_size)``, with ``L <= max_len``.

    Args:
        vocab_size, max_len: the token and position embeddings' sizes.
        embed_dim, num_heads, num_kv_heads, value_head_dim: each block's attention module's
            options (see :class:`causal_attention.CausalSelfAttention`).
        num_layers: how many blocks.
        attention: ``"causal_attention"`` (our op) or ``"sdpa"`` (torch's, same parameters).
    """

    # Whether forward takes a shard of sequences sharded over a process group (eager only).
    context_parallel_on: bool

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        embed_dim: int,
        num_heads: int,
        num_layers: int,
        *,
        num_kv_heads: Optional[int] = None,
        value_head_dim: Optional[int] = None,
        attention: str = "causal_attention",
    ):
        super().__init__()
        if attention not in ATTENTION_MODULES:
            raise ValueError(
                f"GPT: attention must be one of {sorted(ATTENTION_MODULES)}, got "
                f"attention={attention!r}"
            )
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab_size, embed_dim)
        self.pos_emb = nn.Embedding(max_len, embed_dim)
        self.blocks = nn.ModuleList(
            [
                Block(embed_dim, num_heads, num_kv_heads, value_head_dim, attention)
                for _ in range(num_layers)
            ]
        )
        self.ln_f = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, vocab_size)
        self.context_parallel_on = False

    @torch.jit.unused
    def set_context_parallel(self, group, *, method: str = "ring", layout: str = "zigzag"):
        """From now on ``forward`` takes this rank's shard ``(B, L/N)`` of token sequences
        sharded over ``group`` in ``layout`` (:mod:`causal_attention.distributed`), with its
        global positions, and returns its logits (``forward_packed`` this rank's tokens of a
        packed batch); every block attends the whole sequence by ``method``. ``None`` turns it
        off. Our attention only (not ``attention="sdpa"``)."""
        for block in self.blocks:
            if type(block.attn) is not CausalSelfAttention:
                raise ValueError("GPT.set_context_parallel: context parallelism needs "
                                 "attention='causal_attention'")
            block.attn.set_context_parallel(group, method=method, layout=layout)
        self.context_parallel_on = group is not None
        return self

    @torch.jit.unused
    def _shard_positions(self, tokens: Tensor) -> Tensor:
        return self.blocks[0].attn._context_parallel.positions(tokens.size(1), tokens.device)

    def forward(self, tokens: Tensor, caches: Optional[List[KVCache]] = None) -> Tensor:
        """Logits for ``tokens``. With ``caches`` (from :meth:`make_caches`), ``tokens`` are the
        positions after the cached ones, and their keys and values are appended to the caches."""
        start = 0 if caches is None else caches[0].length
        if self.context_parallel_on:
            positions = self._shard_positions(tokens)
        else:
            positions = torch.arange(start, start + tokens.size(1), device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.ln_f(x))

    @torch.jit.unused
    def forward_packed(self, tokens: Tensor, cu_seqlens: Tensor,
                       max_seqlen: Optional[int] = None) -> Tensor:
        """Logits ``(tokens, vocab_size)`` of a packed batch of documents ``(tokens,)`` int64
        with int32 boundaries ``cu_seqlens`` (varlen_attention's): each document's positions
        start at 0 and it attends only to itself. Under context parallelism
        (:meth:`set_context_parallel`), ``tokens`` are this rank's of the batch as
        ``distributed.shard_sequence(..., cu_seqlens=cu_seqlens)`` cuts them, ``cu_seqlens``
        the whole batch's, and the logits are theirs."""
        if self.context_parallel_on:
            positions = self.blocks[0].attn._context_parallel.positions(
                tokens.size(0), tokens.device, cu_seqlens)
        else:
            lengths = cu_seqlens.diff().long()
            starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
            positions = torch.arange(tokens.size(0), device=tokens.device) - starts
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(f"GPT.forward_packed: a document is longer than max_len="
                             f"{self.max_len}, cu_seqlens={cu_seqlens.tolist()}")
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block.forward_packed(x, cu_seqlens, max_seqlen)
        return self.head(self.ln_f(x))

    @torch.jit.unused
    def forward_paged(self, tokens: Tensor, step) -> Tensor:
        """Logits ``(total, vocab_size)`` of a serving step's new tokens ``(total,)`` int64, the
        requests' one after the other (:meth:`causal_attention.PagedKVCache.step` on a cache from
        :meth:`make_paged_cache`): each at its position in its request, attending every earlier
        token of it through the pages, which take the new keys and values."""
        x = self.tok_emb(tokens) + self.pos_emb(step.positions)
        for i, block in enumerate(self.blocks):
            x = block.forward_paged(x, step, i)
        return self.head(self.ln_f(x))

    @torch.jit.unused
    def make_paged_cache(self, num_pages: int, page_size: int,
                         dtype: Optional[torch.dtype] = None, scales: Optional[str] = None,
                         k_scale=None, v_scale=None):
        """A :class:`causal_attention.PagedKVCache` with a pool of ``num_pages`` pages of
        ``page_size`` tokens for every block, in ``dtype`` (the parameters' by default; 8-bit
        pages with ``scales``, ``k_scale`` and ``v_scale`` as the cache takes them)."""
        return self.blocks[0].attn.make_paged_cache(num_pages, page_size, len(self.blocks),
                                                    dtype=dtype, scales=scales,
                                                    k_scale=k_scale, v_scale=v_scale)

    def make_caches(
        self,
        batch_size: int,
        max_len: int,
        dtype: Optional[torch.dtype] = None,
        scales: Optional[str] = None,
        k_scale=None,
        v_scale=None,
    ) -> List[KVCache]:
        """One empty KV cache per block, for ``batch_size`` sequences of ``max_len`` positions,
        in ``dtype`` (the parameters' by default; 8-bit with ``scales``, ``k_scale`` and
        ``v_scale`` as :class:`causal_attention.KVCache` takes them, each scale a float for
        every block or a list of one per block)."""
        k_scales = _per_block("k_scale", k_scale, len(self.blocks))
        v_scales = _per_block("v_scale", v_scale, len(self.blocks))
        return [
            block.attn.make_cache(batch_size, max_len, dtype, scales, k_scales[i], v_scales[i])
            for i, block in enumerate(self.blocks)
        ]

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        caches: Optional[List[KVCache]] = None,
    ) -> Tensor:
        """``prompt (B, P)`` followed by ``max_new_tokens`` sampled tokens, ``(B, P + new)``.

        The prompt runs once, then each new token alone: keys and values of earlier positions
        come from the KV caches. ``temperature=0`` picks the most likely token; ``top_k`` keeps
        the ``k`` most likely. ``P + max_new_tokens`` may not exceed ``max_len``.

        ``caches``: empty caches from :meth:`make_caches` to decode with (8-bit ones, say), for
        ``B`` sequences of at least ``P + max_new_tokens`` positions; they hold the sequences
        afterwards. By default, caches in the parameters' dtype, made for the call.
        """
        total = prompt.size(1) + max_new_tokens
        if prompt.size(1) == 0 or total > self.max_len:
            raise ValueError(
                f"GPT.generate: need 0 < prompt length and prompt length + max_new_tokens <= "
                f"max_len={self.max_len}, got prompt.shape={list(prompt.shape)}, "
                f"max_new_tokens={max_new_tokens}"
            )
        if caches is None:
            caches = self.make_caches(prompt.size(0), total)
        else:
            _check_caches(caches, len(self.blocks), prompt.size(0), total)
        tokens = [prompt]
        logits = self(prompt, caches)[:, -1]
        for step in range(max_new_tokens):
            tokens.append(_pick(logits, temperature, top_k, generator))
            if step + 1 < max_new_tokens:
                logits = self(tokens[-1], caches)[:, -1]
        return torch.cat(tokens, dim=1)


def _per_block(name: str, scale, layers: int) -> List[Optional[float]]:
    """A per-tensor scale given for every block (None or a float) or one per block, as a list
    of one per block."""
    if not isinstance(scale, (list, tuple)):
        return [scale] * layers
    if len(scale) != layers:
        raise ValueError(
            f"GPT.make_caches: {name} must be a float or one per block ({layers}), got "
            f"{len(scale)}"
        )
    return list(scale)


def _check_caches(caches: List[KVCache], layers: int, batch_size: int, total: int) -> None:
    """Raises unless ``caches`` are one empty cache per block with room for ``batch_size``
    sequences of ``total`` positions."""
    if not isinstance(caches, (list, tuple)) or len(caches) != layers:
        raise ValueError(
            f"GPT.generate: caches must be a list of one KVCache per block ({layers}), got "
            f"{len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__}"
        )
    for i, cache in enumerate(caches):
        if not isinstance(cache, KVCache):
            raise TypeError(f"GPT.generate: caches[{i}] must be a KVCache, got "
                            f"{type(cache).__name__}")
        if cache.length != 0 or cache.batch_size != batch_size or cache.max_len < total:
            raise ValueError(
                f"GPT.generate: caches[{i}] must be empty, for batch_size={batch_size} "
                f"sequences of at least {total} positions, got one holding {cache.length} of "
                f"max_len={cache.max_len} for batch_size={cache.batch_size}"
            )


def _pick(
    logits: Tensor, temperature: float, top_k: Optional[int], generator: Optional[torch.Generator]
) -> Tensor:
    """The next token ``(B, 1)`` from the last position's ``logits (B, vocab)``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
