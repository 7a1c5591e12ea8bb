"""The KV cache of :class:`causal_attention.CausalSelfAttention`, for incremental decoding."""

from typing import Optional, Tuple

import torch
from torch import Tensor


class KVCache:
    """Preallocated keys ``(B, Hkv, max_len, D)`` and values ``(B, Hkv, max_len, Dv)``, the key
    mask ``(B, max_len)`` of the cached positions, and how many positions they hold. Made by
    :meth:`CausalSelfAttention.make_cache`; pass it as ``forward(x, cache=cache)``. New positions
    are written in place: decoding a position costs no reallocation and no copy of the cached
    ones. ``reset()`` empties it for a new sequence.

    The key mask remembers, per sequence, which cached positions are real tokens (True) and which
    are padding (False), so that a left-padded prompt's padding stays hidden in every later
    decoding step. Until some append passes a ``key_mask``, every position is real and
    :meth:`append` hands out no mask, so the attention runs exactly as without one.

    The class compiles under TorchScript, so a scripted module decodes with it too.
    """

    def __init__(self, key_storage: Tensor, value_storage: Tensor) -> None:
        if key_storage.dim() != 4 or value_storage.dim() != 4:
            raise ValueError(
                "KVCache: key and value storage must be 4-D (B, Hkv, max_len, D), got "
                f"key_storage.shape={list(key_storage.shape)}, "
                f"value_storage.shape={list(value_storage.shape)}"
            )
        if key_storage.shape[:3] != value_storage.shape[:3]:
            raise ValueError(
                "KVCache: key and value storage must agree in (B, Hkv, max_len), got "
                f"key_storage.shape={list(key_storage.shape)}, "
                f"value_storage.shape={list(value_storage.shape)}"
            )
        if key_storage.dtype != value_storage.dtype:
            raise TypeError(
                "KVCache: key and value storage must have the same dtype, got "
                f"key_storage.dtype={key_storage.dtype}, value_storage.dtype={value_storage.dtype}"
            )
        if key_storage.device != value_storage.device:
            raise ValueError(
                "KVCache: key and value storage must be on the same device, got "
                f"key_storage.device={key_storage.device}, "
                f"value_storage.device={value_storage.device}"
            )
        self.key_storage = key_storage
        self.value_storage = value_storage
        self.mask_storage = torch.ones(
            [key_storage.size(0), key_storage.size(2)], dtype=torch.bool, device=key_storage.device
        )
        # A tensor, not an int: when a scripted module is called from Python, TorchScript passes
        # it a copy of this object whose int attributes do not flow back, but whose tensors are
        # shared, so only a tensor length stays right across calls. Made from the storage: a
        # torch.zeros of constant arguments is folded by TorchScript into one constant tensor,
        # which every cache a scripted program makes would then share (and write in place).
        cpu = torch.device("cpu")
        self._length = key_storage.new_zeros((), dtype=torch.long, device=cpu)
        # Whether an append since the last reset passed a key mask; a tensor for the same reason.
        self._has_key_mask = key_storage.new_zeros((), dtype=torch.bool, device=cpu)

    @property
    def length(self) -> int:
        """How many positions the cache holds."""
        return int(self._length)

    @property
    def max_len(self) -> int:
        return self.key_storage.size(2)

    @property
    def batch_size(self) -> int:
        return self.key_storage.size(0)

    @property
    def keys(self) -> Tensor:
        """The cached keys, a view ``(B, Hkv, length, D)`` of the storage."""
        return self.key_storage[:, :, : self.length]

    @property
    def values(self) -> Tensor:
        """The cached values, a view ``(B, Hkv, length, Dv)`` of the storage."""
        return self.value_storage[:, :, : self.length]

    @property
    def key_mask(self) -> Optional[Tensor]:
        """The key mask of the cached positions, a view ``(B, length)`` of the storage (True for
        real tokens), or None while no append has passed one (every position is real)."""
        if not bool(self._has_key_mask):
            return None
        return self.mask_storage[:, : self.length]

    def reset(self) -> None:
        """Forgets the cached positions and their key mask, keeping the storage."""
        self._length.zero_()
        self._has_key_mask.zero_()
        # Drops the autograd history of a sequence decoded under autograd, so that the next one
        # does not keep its graph alive. In place, for the same reason _length is a tensor.
        self.key_storage.detach_()
        self.value_storage.detach_()

    def append(
        self, keys: Tensor, values: Tensor, key_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Writes ``keys (B, Hkv, L, D)``, ``values (B, Hkv, L, Dv)`` and their ``key_mask``
        (bool ``(B, L)``, True for real tokens; None: all real) after the cached positions, and
        returns all cached keys, values and key mask (see :attr:`key_mask`), the new ones
        included: views of the storage, or copies when autograd records (so that backward works
        through a decoded sequence, whose later appends overwrite the storage in place).

        Raises ``ValueError`` (shapes, device, overflowing ``max_len``) or ``TypeError`` (dtype),
        leaving the cache unchanged.
        """
        if not (
            _fits(keys, self.key_storage)
            and _fits(values, self.value_storage)
            and keys.size(2) == values.size(2)
        ):
            raise ValueError(
                "KVCache: the new keys (B, Hkv, L, D) and values (B, Hkv, L, Dv) must match the "
                f"cache's batch size, heads and head dims, got keys.shape={list(keys.shape)}, "
                f"values.shape={list(values.shape)} for a cache of keys (B, Hkv, max_len, D)="
                f"{list(self.key_storage.shape)} and values (B, Hkv, max_len, Dv)="
                f"{list(self.value_storage.shape)}"
            )
        if keys.dtype != self.key_storage.dtype or values.dtype != self.key_storage.dtype:
            raise TypeError(
                f"KVCache: the new keys and values must have the cache's dtype "
                f"{self.key_storage.dtype}, got keys.dtype={keys.dtype}, "
                f"values.dtype={values.dtype}"
            )
        if keys.device != self.key_storage.device or values.device != self.key_storage.device:
            raise ValueError(
                f"KVCache: the new keys and values must be on the cache's device "
                f"{self.key_storage.device}, got keys.device={keys.device}, "
                f"values.device={values.device}"
            )
        if key_mask is not None:
            self._check_key_mask(key_mask, keys)
        start = self.length
        end = start + keys.size(2)
        if end > self.max_len:
            raise ValueError(
                f"KVCache: cannot append {keys.size(2)} positions to a cache holding {start} of "
                f"max_len={self.max_len}; reset() it or make a larger cache"
            )
        self.key_storage[:, :, start:end].copy_(keys)
        self.value_storage[:, :, start:end].copy_(values)
        # Written on every append, a None mask included: a later masked step attends with the
        # mask of every cached position, and storage from before a reset must not leak into it.
        if key_mask is None:
            self.mask_storage[:, start:end].fill_(True)
        else:
            self.mask_storage[:, start:end].copy_(key_mask)
            self._has_key_mask.fill_(True)
        self._length.fill_(end)
        cached_mask = self.key_mask
        if torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad):
            # The mask too: ops that save it for backward must not see a later reset's writes.
            if cached_mask is not None:
                cached_mask = cached_mask.clone()
            return self.keys.clone(), self.values.clone(), cached_mask
        return self.keys, self.values, cached_mask

    def _check_key_mask(self, key_mask: Tensor, keys: Tensor) -> None:
        if key_mask.dtype != torch.bool:
            raise TypeError(
                "KVCache: key_mask must be a bool tensor (True for real tokens), got "
                f"key_mask.dtype={key_mask.dtype}"
            )
        if not (
            key_mask.dim() == 2
            and key_mask.size(0) == keys.size(0)
            and key_mask.size(1) == keys.size(2)
        ):
            raise ValueError(
                f"KVCache: key_mask must be (B, L)={[keys.size(0), keys.size(2)]} of the new "
                f"keys, got key_mask.shape={list(key_mask.shape)}"
            )
        if key_mask.device != self.mask_storage.device:
            raise ValueError(
                f"KVCache: key_mask must be on the cache's device {self.mask_storage.device}, "
                f"got key_mask.device={key_mask.device}"
            )


def _fits(added: Tensor, storage: Tensor) -> bool:
    return (
        added.dim() == 4
        and added.size(0) == storage.size(0)
        and added.size(1) == storage.size(1)
        and added.size(3) == storage.size(3)
    )
