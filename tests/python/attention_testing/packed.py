"""Packed sequences, the inputs of varlen_attention: their shapes (``Packed``), the cumulative
lengths, and the conversion to and from a padded batch with its visibility mask, for references
that take a batch."""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from causal_attention._masks import visible_keys

from .inputs import make_tensor


def cumulative_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """int32 (N + 1,): 0, then the running sums of ``lengths``."""
    sums = [0]
    for length in lengths:
        sums.append(sums[-1] + length)
    return torch.tensor(sums, dtype=torch.int32)


@dataclass(frozen=True)
class Packed:
    """Shapes of one varlen_attention call: sequence i has ``lengths_q[i]`` query rows and
    ``lengths_k[i]`` keys; q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv)."""

    lengths_q: Tuple[int, ...]
    lengths_k: Tuple[int, ...]
    d: int
    dv: Optional[int] = None
    hq: int = 1
    hkv: int = 1

    def __post_init__(self):
        assert len(self.lengths_q) == len(self.lengths_k)

    @property
    def value_dim(self) -> int:
        return self.d if self.dv is None else self.dv

    @property
    def total_q(self) -> int:
        return sum(self.lengths_q)

    @property
    def total_k(self) -> int:
        return sum(self.lengths_k)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.lengths_q, default=0)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.lengths_k, default=0)

    @property
    def q_shape(self) -> Tuple[int, ...]:
        return (self.total_q, self.hq, self.d)

    @property
    def k_shape(self) -> Tuple[int, ...]:
        return (self.total_k, self.hkv, self.d)

    @property
    def v_shape(self) -> Tuple[int, ...]:
        return (self.total_k, self.hkv, self.value_dim)

    @property
    def out_shape(self) -> Tuple[int, ...]:
        return (self.total_q, self.hq, self.value_dim)

    def lengths_args(self) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
        """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), the longest lengths."""
        return (
            cumulative_lengths(self.lengths_q),
            cumulative_lengths(self.lengths_k),
            self.max_seqlen_q,
            self.max_seqlen_k,
        )

    def inputs(self, dtype: torch.dtype, requires_grad: bool = False):
        """(q, k, v), contiguous, values drawn as ``make_tensor`` draws them."""
        return tuple(
            make_tensor(shape, dtype, requires_grad=requires_grad)
            for shape in (self.q_shape, self.k_shape, self.v_shape)
        )

    def split(self, t: torch.Tensor, keys: bool) -> List[torch.Tensor]:
        """The sequences of a packed (total, H, dim) tensor as (H, L_i, dim) views: by the key
        lengths (``keys``) or the query lengths."""
        lengths = self.lengths_k if keys else self.lengths_q
        return [part.transpose(0, 1) for part in torch.split(t, list(lengths))]

    def pad(self, t: torch.Tensor, keys: bool) -> torch.Tensor:
        """A packed (total, H, dim) tensor as a zero-padded batch (N, H, max_len, dim), each
        sequence at the start of its row (right padding)."""
        parts = self.split(t, keys)
        longest = self.max_seqlen_k if keys else self.max_seqlen_q
        padded = t.new_zeros((len(parts), t.shape[1], longest, t.shape[2]))
        for i, part in enumerate(parts):
            padded[i, :, : part.shape[1]] = part
        return padded

    def unpad(self, padded: torch.Tensor, keys: bool) -> torch.Tensor:
        """The inverse of ``pad``: (N, H, max_len, dim) back to packed (total, H, dim)."""
        lengths = self.lengths_k if keys else self.lengths_q
        parts = [padded[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)]
        if not parts:
            return padded.new_zeros((0, padded.shape[1], padded.shape[3]))
        return torch.cat(parts)

    def padded_visibility(self) -> torch.Tensor:
        """Bool (N, 1, max_seqlen_q, max_seqlen_k) for the ``pad``-ded batch: row i of sequence n
        sees key j iff both are in the sequence and j <= i + lengths_k[n] - lengths_q[n]."""
        masks = [
            F.pad(visible_keys(lq, lk), (0, self.max_seqlen_k - lk, 0, self.max_seqlen_q - lq))
            for lq, lk in zip(self.lengths_q, self.lengths_k)
        ]
        if not masks:
            return torch.zeros((0, 1, self.max_seqlen_q, self.max_seqlen_k), dtype=torch.bool)
        return torch.stack(masks).unsqueeze(1)
