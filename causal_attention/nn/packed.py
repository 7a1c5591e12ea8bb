"""Packed documents for :class:`causal_attention.CausalSelfAttention` (eager only): its
``forward_packed`` on a batch of documents packed one after the other, each attending only to
itself, in one process (varlen_attention) or, under context parallelism, on this rank's tokens
of the batch (:mod:`causal_attention.distributed`)."""

from typing import Optional

import torch
from torch import Tensor

from ..ops import varlen_attention


class PackedDocuments:
    """:meth:`forward_packed` of :class:`causal_attention.CausalSelfAttention`."""

    @torch.jit.unused
    def forward_packed(self, x: Tensor, cu_seqlens: Tensor,
                       max_seqlen: Optional[int] = None) -> Tensor:
        """Attends ``x (tokens, E)``, a packed batch of documents with int32 boundaries
        ``cu_seqlens`` (varlen_attention's, from 0), each document by itself as ``forward``
        attends a sequence (window, softcap, ALiBi and sinks on its own positions, attention
        dropout); returns ``(tokens, E)``. Under context parallelism (set_context_parallel)
        ``x`` is this rank's tokens of the batch as ``distributed.shard_sequence(...,
        cu_seqlens=cu_seqlens)`` cuts them, ``cu_seqlens`` the whole batch's, attended by the
        method set (attention dropout with Ulysses only). ``max_seqlen``: at least the
        longest document's length (computed when None). Eager only."""
        if not isinstance(x, Tensor) or x.dim() != 2 or x.size(1) != self.embed_dim:
            raise ValueError(
                f"CausalSelfAttention.forward_packed: x must be (tokens, E) with "
                f"E=embed_dim={self.embed_dim}, got "
                f"{list(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
            )
        q, k, v = self._project_token_heads(x)
        # Dropout apart: the context-parallel methods refuse it by name.
        options = dict(window=self.window, softcap=self.softcap, alibi_slopes=self.alibi_slopes,
                       sinks=self.sinks)
        dropout_p = self._attention_dropout_p()
        if self.context_parallel_on:
            attended = self._context_parallel.attend_packed(q, k, v, cu_seqlens, max_seqlen,
                                                            dropout_p, **options)
        else:
            if max_seqlen is None and isinstance(cu_seqlens, Tensor) and cu_seqlens.numel() > 1:
                max_seqlen = int(cu_seqlens.diff().max())
            attended = varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                        dropout_p=dropout_p, **options)
        return self.resid_dropout(self.c_proj(attended.flatten(1)))
