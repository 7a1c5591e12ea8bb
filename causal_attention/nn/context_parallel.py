"""Context parallelism for :class:`causal_attention.CausalSelfAttention` (eager only): its
``forward`` on this rank's shard of a sequence sharded over a process group."""

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:  # for the annotation only: the module imports this one
    from .self_attention import CausalSelfAttention


class ContextParallelism:
    """:meth:`set_context_parallel` of :class:`causal_attention.CausalSelfAttention`, and the
    sharded attention its ``forward`` then runs."""

    @torch.jit.unused
    def set_context_parallel(
        self, group, *, method: str = "ring", layout: str = "zigzag"
    ) -> "CausalSelfAttention":
        """From now on ``forward`` takes this rank's shard ``(B, L/N, E)`` of a sequence sharded
        over the ranks of ``group`` (a ProcessGroup or a 1-D DeviceMesh; ``None`` turns it off)
        in ``layout`` (``"zigzag"`` or ``"contiguous"``, see :mod:`causal_attention.distributed`)
        and returns this rank's rows of the output, attending the whole sequence by ``method``:
        ``"ring"``, ``"allgather"`` or ``"ulysses"`` (which also serves ``key_mask``, this
        rank's shard of it, and ``attn_dropout``); ``forward_packed`` then takes this rank's
        tokens of a packed batch of documents. Windows, softcap, sinks and
        ALiBi apply to global positions. Training and inference without a cache or attn_mask.
        Returns the module. Eager only (a scripted module attends unsharded)."""
        from ..distributed import ContextParallel

        if group is None:
            self._context_parallel, self.context_parallel_on = None, False
        else:
            self._context_parallel = ContextParallel.of(
                "CausalSelfAttention.set_context_parallel", group, method, layout
            )
            self.context_parallel_on = True
        return self

    @torch.jit.unused
    def _attend_sharded(
        self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
        attn_mask: Optional[Tensor],
    ) -> Tensor:
        if attn_mask is not None or k.size(2) != q.size(2):
            raise ValueError(
                "CausalSelfAttention: under context parallelism (set_context_parallel) forward "
                "takes no cache or attn_mask"
            )
        return self._context_parallel.attend(
            q, k, v, key_mask, dropout_p=self._attention_dropout_p(), window=self.window,
            softcap=self.softcap, alibi_slopes=self.alibi_slopes, sinks=self.sinks,
        )
