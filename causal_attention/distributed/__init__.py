"""Context parallelism: exact attention over a sequence sharded across the ranks of a
``torch.distributed`` process group, forward and backward, on torch.distributed's own backends
(gloo on the CPU; NCCL or any other unchanged where the tensors live elsewhere).

- :func:`ring_attention`: each rank keeps its queries; the K/V shards travel the ring with
  ``batch_isend_irecv``, the next shard in flight while the current one is computed, and each
  step's partial output is merged with the running one by their log-sum-exp. The backward passes
  dK/dV around the ring with the shards (ring-flash-attention's scheme), recomputing every block
  from the merged lse. A rank holds at most two K/V shards (and two dK/dV) at once.
- :func:`ulysses_attention` (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head
  shards, the op runs on whole sequences (varlen_attention on a whole packed batch) for
  ``H / N`` heads, and an all-to-all turns the output back.
- :func:`allgather_attention` (llama3's context parallelism): each rank gathers every rank's K/V
  part by part (bounded memory, the next part in flight), attends its own rows to them, and
  sends each part's dK/dV shares to the part's owner, which sums them in rank order. No chain of
  N dependent steps (when to pick it: docs/benchmarks/README.md).

Layouts. ``"contiguous"``: rank ``r`` holds tokens ``[r L/N, (r + 1) L/N)``. ``"zigzag"`` (the
default, for causal load balance): the sequence is cut into ``2N`` chunks and rank ``r`` holds
chunks ``r`` and ``2N - 1 - r``, so every rank sees the same number of (query, key) pairs.
:func:`shard_sequence`, :func:`unshard_sequence` and :func:`shard_positions` (the global
positions of a shard, for rotary embeddings) convert.

Packed documents. With ``cu_seqlens`` (varlen_attention's document boundaries of the whole
batch, int32, the same on every rank) the calls take each rank's tokens of a packed batch,
``(tokens, H, D)``, and each document attends only to itself, its window and ALiBi on its own
positions. ``"zigzag"`` then cuts *each document* into ``2N`` near-equal chunks (any lengths)
and gives rank ``r`` chunks ``r`` and ``2N - 1 - r`` of every one, so the ranks' causal work is
equal whatever the documents' lengths; ``"contiguous"`` gives rank ``r`` tokens
``[r T/N, (r + 1) T/N)`` of the batch. The shards may differ in length by a few tokens; every
rank derives every rank's chunks from cu_seqlens (:class:`Sharding`). The ring's and the
all-gather's pairs keep to one document, and ring steps whose shard holds no document a local
row sees are skipped; Ulysses attends the whole batch by varlen_attention.
:func:`shard_positions` gives each token's position within its document and
:func:`shard_cu_seqlens` the shard's own document boundaries.

Every step calls the kernel ops with ``query_offset``, the key position of its first query row,
so the caller's window and ALiBi apply to global positions unchanged; the backward gives the
kernel the rows' delta, which is over all the keys a row sees, not the step's. Steps whose key
shard lies outside every local row's window are skipped, and steps dead for every rank are not
run, so their shards are never sent. Sinks join each row once, after the merge.

Each call (the attention calls and :func:`unshard_sequence`) first exchanges one fixed-size
message among the ranks, with a timeout and before any other collective: it names the call and
describes its arguments (dtypes, shapes, the option tensors' values, cu_seqlens' included,
scale, window, softcap, dropout_p, layout, dim, max_seqlen), and every rank raises the same error
when they disagree (or a packed shard's length is not the one cu_seqlens gives), so no rank is
left waiting in (or aborted by) a collective its peers never reach, nor computes with options
its peers do not share.

The package holds one concept a module, each importing only those listed before it:
``collectives`` (the differentiable all-to-all and all-gather), ``layout`` (the group, the
layouts and sharding, dense and packed), ``call_checks`` (the handshake), ``ring_schedule`` (the
pairs and parts), ``attend_pairs`` (a pair's forward and gradients, the calls' entry),
``ring_streams`` and ``ring`` (ring attention), ``ulysses``, ``allgather``, ``unshard`` (the
whole sequence back), and ``context_parallel`` (what a module uses).
"""

from .call_checks import HANDSHAKE_TIMEOUT, handshake
from .context_parallel import METHODS, ContextParallel
from .layout import (LAYOUTS, Chunk, Sharding, resolve_group, shard_chunks, shard_cu_seqlens,
                     shard_positions, shard_sequence)
from .allgather import allgather_attention
from .ring import ring_attention
from .ring_schedule import MAX_PARTS, MIN_PART_KEYS, MIN_PART_ROWS
from .ulysses import rank_generator, ulysses_attention
from .unshard import unshard_sequence

__all__ = [
    "ring_attention",
    "allgather_attention",
    "ulysses_attention",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "shard_cu_seqlens",
    "Sharding",
    "shard_chunks",
    "Chunk",
    "resolve_group",
    "handshake",
    "rank_generator",
    "ContextParallel",
    "LAYOUTS",
    "METHODS",
    "HANDSHAKE_TIMEOUT",
    "MIN_PART_KEYS",
    "MAX_PARTS",
    "MIN_PART_ROWS",
]
