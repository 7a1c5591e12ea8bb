"""How a module attends a sharded sequence: :class:`ContextParallel` holds the group, the method
(ring or Ulysses) and the layout, and dispatches a module's attention to the method."""

from typing import NamedTuple, Optional

from torch import Tensor

from .layout import _check_divisible, _check_layout, _positions, resolve_group, shard_chunks
from .ring import ring_attention
from .ulysses import ulysses_attention

METHODS = ("ring", "ulysses")


class ContextParallel(NamedTuple):
    """How a module attends a sharded sequence: the group, ``"ring"`` or ``"ulysses"``, and the
    shards' layout (see :meth:`causal_attention.CausalSelfAttention.set_context_parallel`)."""

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
        if key_mask is not None or dropout_p > 0:
            raise ValueError("causal_attention.distributed: a key_mask or attention dropout under "
                             "context parallelism is served by method='ulysses' (each rank sees "
                             "whole sequences); ring attention takes neither")
        return ring_attention(q, k, v, self.group, layout=self.layout, **options)

    def positions(self, shard_length: int, device=None) -> Tensor:
        """The global positions of this rank's shard of ``shard_length`` tokens."""
        caller = "causal_attention.distributed"
        _, rank, world = resolve_group(caller, self.group)
        _check_divisible(caller, "the sequence's length (N shards)", shard_length * world, world,
                         self.layout)
        return _positions(shard_chunks(shard_length, rank, world, self.layout), device)
