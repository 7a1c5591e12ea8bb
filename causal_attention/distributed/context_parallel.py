"""How a module attends a sharded sequence: :class:`ContextParallel` holds the group, the method
(ring, Ulysses or all-gather) and the layout, and dispatches a module's attention to the method,
on a dense sequence or a packed batch of documents."""

from typing import NamedTuple, Optional

from torch import Tensor

from .allgather import allgather_attention
from .layout import _check_layout, _positions, _sharding, resolve_group
from .ring import ring_attention
from .ulysses import ulysses_attention

METHODS = ("ring", "ulysses", "allgather")


class ContextParallel(NamedTuple):
    """How a module attends a sharded sequence: the group, ``"ring"``, ``"ulysses"`` or
    ``"allgather"``, and the shards' layout (see
    :meth:`causal_attention.CausalSelfAttention.set_context_parallel`)."""

    group: object
    method: str = "ring"
    layout: str = "zigzag"

    @staticmethod
    def of(caller: str, group, method: str, layout: str) -> "ContextParallel":
        if method not in METHODS:
            raise ValueError(f"{caller}: method must be one of {METHODS}, got method={method!r}")
        _check_layout(caller, layout)
        resolve_group(caller, group)
        return ContextParallel(group, method, layout)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
               dropout_p: float = 0.0, **options):
        """This rank's rows of attention over the whole sequence."""
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, self.group, key_mask=key_mask, layout=self.layout,
                                     dropout_p=dropout_p, **options)
        self._check_served(key_mask is not None, dropout_p)
        return self._attention()(q, k, v, self.group, layout=self.layout, **options)

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                      max_seqlen: Optional[int], dropout_p: float = 0.0, **options):
        """This rank's tokens' attention over the whole packed batch (``(tokens, H, D)``)."""
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, self.group, layout=self.layout,
                                     dropout_p=dropout_p, cu_seqlens=cu_seqlens,
                                     max_seqlen=max_seqlen, **options)
        self._check_served(False, dropout_p)
        return self._attention()(q, k, v, self.group, layout=self.layout,
                                 cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **options)

    def _attention(self):
        return ring_attention if self.method == "ring" else allgather_attention

    def _check_served(self, key_mask: bool, dropout_p: float) -> None:
        if key_mask or dropout_p > 0:
            raise ValueError("causal_attention.distributed: a key_mask or attention dropout under "
                             "context parallelism is served by method='ulysses' (each rank sees "
                             f"whole sequences); method={self.method!r} takes neither")

    def positions(self, shard_length: int, device=None,
                  cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """The global positions of this rank's shard of ``shard_length`` tokens; with
        ``cu_seqlens`` (a packed batch's) each token's position within its document."""
        caller = "causal_attention.distributed"
        _, _, world = resolve_group(caller, self.group)
        if cu_seqlens is None:
            sharding, rank = _sharding(caller, self.group, self.layout,
                                       "the sequence's length (N shards)", shard_length * world,
                                       None)
        else:
            sharding, rank = _sharding(caller, self.group, self.layout, "cu_seqlens[-1]",
                                       int(cu_seqlens[-1]), cu_seqlens)
        return _positions(sharding.chunks(rank), device)
