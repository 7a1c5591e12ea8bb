"""The KV cache of :class:`causal_attention.CausalSelfAttention`, for incremental decoding."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .quantization import positive_finite_in_float32, quantize, token_scales


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

    **8-bit storage** (``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.int8``: half a
    bfloat16 cache's bytes), inference only: :meth:`append` takes float32, bfloat16 or float16
    keys and values (q's dtype) and stores them quantized
    (:func:`causal_attention.quantization.quantize`: ``value / scale`` rounded to nearest,
    saturated to the format's range), with ``scales``:

    - ``"token"`` (the default): a scale per token and KV head for keys and for values,
      ``key_scale_storage`` and ``value_scale_storage``, float32 ``(B, Hkv, max_len)`` beside
      the storage (1 until written), each token's computed as it is written
      (:func:`causal_attention.quantization.token_scales`): no calibration;
    - ``"tensor"``: one scale for the keys and one for the values, ``k_scale`` and ``v_scale``
      (floats, 1.0 by default, positive and finite in float32; calibrated beforehand), kept as
      0-d float32 tensors in the same attributes; values beyond ``scale x`` the format's largest
      saturate.

    :attr:`key_scales` and :attr:`value_scales` are then what
    ``causal_attention.attention(q, cache.keys, cache.values, k_scale=..., v_scale=...)``
    takes, and what the module's forward attends with. NaN or inf keys or values raise
    ValueError, a ``key_mask`` NotImplementedError (the 8-bit attention takes none), both
    leaving the cache unchanged.

    The class compiles under TorchScript, 8-bit storage included (its quantization is torch ops
    that script), so a scripted module decodes with it too.
    """

    def __init__(
        self,
        key_storage: Tensor,
        value_storage: Tensor,
        scales: Optional[str] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
    ) -> None:
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
        # None for float storage, else "token" or "tensor".
        layout = _check_scales(key_storage.dtype, scales, k_scale, v_scale)
        self.scales: Optional[str] = layout
        # A bool beside it: TorchScript compares an Optional attribute only once refined.
        self._per_token = layout is not None and layout == "token"
        # Per token: (B, Hkv, max_len), 1 until written. Per tensor: the given scales, 0-d. Float
        # storage reads neither; a 0-d 1 keeps the attribute a tensor, as TorchScript types it.
        self.key_scale_storage = _scale_storage(self._per_token, "k_scale", k_scale, key_storage)
        self.value_scale_storage = _scale_storage(self._per_token, "v_scale", v_scale, key_storage)
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
    def quantized(self) -> bool:
        """Whether the storage is 8-bit (keys and values stored with :attr:`scales`)."""
        return self.scales is not None

    @property
    def key_scales(self) -> Optional[Tensor]:
        """The cached keys' dequantization scales (stored value x scale = key): a view
        ``(B, Hkv, length)`` of ``key_scale_storage`` with ``scales="token"``, the 0-d float32
        scale with ``"tensor"``; None for float storage."""
        return self._scales_of(self.key_scale_storage)

    @property
    def value_scales(self) -> Optional[Tensor]:
        """The cached values' dequantization scales, as :attr:`key_scales`."""
        return self._scales_of(self.value_scale_storage)

    def _scales_of(self, storage: Tensor) -> Optional[Tensor]:
        if self.scales is None:
            return None
        if self._per_token:
            return storage[:, :, : self.length]
        return storage

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

        An 8-bit cache stores them quantized (see the class) and returns its 8-bit views, whose
        scales are :attr:`key_scales` and :attr:`value_scales`, and no key mask (it takes none).

        Raises ``ValueError`` (shapes, device, overflowing ``max_len``, non-finite values for an
        8-bit cache), ``TypeError`` (dtype) or ``NotImplementedError`` (a key mask for an 8-bit
        cache), leaving the cache unchanged.
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
        if self.scales is not None:
            self._check_quantizable(keys, values, key_mask)
        elif keys.dtype != self.key_storage.dtype or values.dtype != self.key_storage.dtype:
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
        if self.scales is not None:
            self._write_quantized(keys, values, start, end)
            self._length.fill_(end)
            # No copies for autograd: quantized values carry no gradient (inference only).
            return self.keys, self.values, None
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

    def _check_quantizable(
        self, keys: Tensor, values: Tensor, key_mask: Optional[Tensor]
    ) -> None:
        """Raises unless an 8-bit cache can store ``keys`` and ``values``: float32, bfloat16 or
        float16 (q's dtypes beside 8-bit K/V), one dtype, finite, and no key mask."""
        dtype = keys.dtype
        if values.dtype != dtype or not (
            dtype == torch.float32 or dtype == torch.bfloat16 or dtype == torch.float16
        ):
            raise TypeError(
                f"KVCache: the new keys and values must be float32, bfloat16 or float16, one "
                f"dtype, to be quantized into the cache's {self.key_storage.dtype}, got "
                f"keys.dtype={keys.dtype}, values.dtype={values.dtype}"
            )
        if key_mask is not None:
            raise NotImplementedError(
                f"KVCache: a key_mask with {self.key_storage.dtype} storage is not supported "
                "(the attention on 8-bit keys and values takes no mask); decode unpadded "
                "prompts, or use a float cache"
            )
        for name, t in (("keys", keys), ("values", values)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(
                    f"KVCache: the new {name} must be finite to be quantized into the cache's "
                    f"{self.key_storage.dtype}, got NaN or inf"
                )

    def _write_quantized(self, keys: Tensor, values: Tensor, start: int, end: int) -> None:
        """Writes the checked ``keys`` and ``values`` quantized into positions [start, end),
        per-token scales computed and written beside them."""
        dtype = self.key_storage.dtype
        for added, storage, scales in (
            (keys, self.key_storage, self.key_scale_storage),
            (values, self.value_storage, self.value_scale_storage),
        ):
            if self._per_token:
                computed = token_scales(added, dtype)  # (B, Hkv, L)
                scales[:, :, start:end].copy_(computed)
                stored = quantize(added, computed.unsqueeze(-1), dtype)
            else:
                stored = quantize(added, scales, dtype)
            storage[:, :, start:end].copy_(stored)

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


def _check_scales(
    dtype: torch.dtype, scales: Optional[str], k_scale: Optional[float], v_scale: Optional[float]
) -> Optional[str]:
    """The storage's ``dtype`` and ``scales`` checked; returns the scales' layout ("token" or
    "tensor"; None for float storage)."""
    eight_bit = dtype == torch.float8_e4m3fn or dtype == torch.float8_e5m2 or dtype == torch.int8
    if not eight_bit:
        if scales is not None or k_scale is not None or v_scale is not None:
            raise ValueError(
                "KVCache: scales, k_scale and v_scale are for 8-bit storage (float8_e4m3fn, "
                f"float8_e5m2, int8); the storage is {dtype}"
            )
        return None
    layout = "token" if scales is None else scales
    # Eager only: TorchScript checks the types at the call and compiles these branches away.
    if not isinstance(layout, str):
        raise TypeError(f"KVCache: scales must be 'token' or 'tensor', got {type(layout)}")
    for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, (int, float))):
            raise TypeError(f"KVCache: {name} must be a float, got {type(given)}")
    if layout != "token" and layout != "tensor":
        raise ValueError(
            "KVCache: scales must be 'token' (one per token and KV head) or 'tensor' (one for "
            f"the keys, one for the values), got scales={layout}"
        )
    if layout == "token" and (k_scale is not None or v_scale is not None):
        raise ValueError(
            "KVCache: k_scale and v_scale are the scales of scales='tensor'; scales='token' "
            "computes its own"
        )
    return layout


def _scale_storage(
    per_token: bool, name: str, scale: Optional[float], key_storage: Tensor
) -> Tensor:
    """Per token, float32 ones ``(B, Hkv, max_len)`` beside ``key_storage``; else the per-tensor
    ``scale`` ``name`` (None: 1) as a 0-d float32 tensor, checked positive and finite in float32
    (what the attention reads)."""
    device = key_storage.device
    if per_token:
        shape = [key_storage.size(0), key_storage.size(1), key_storage.size(2)]
        return torch.ones(shape, dtype=torch.float32, device=device)
    value = 1.0 if scale is None else scale
    if not positive_finite_in_float32(value):
        raise ValueError(
            f"KVCache: {name} must be positive and finite (in float32), got {name}={value}"
        )
    return torch.tensor(value, dtype=torch.float32, device=device)
