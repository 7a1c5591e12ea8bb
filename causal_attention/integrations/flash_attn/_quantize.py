"""``flash_attn_with_kvcache`` on 8-bit caches: flash-attn 3's ``k_descale``/``v_descale``
resolved to what ``paged_attention`` takes (``_Descale``), and the new keys and values written
into the cache quantized as ``paged_cache_append`` quantizes them
(:mod:`causal_attention.quantization`)."""

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..._quantized_kv import describe, one_scale, refuse_bad_scales
from ...quantization import quantize, token_scales

@dataclass
class _Descale:
    """One of flash-attn 3's ``k_descale``/``v_descale`` for a call on an 8-bit cache, in the
    layout it was given: ``"tensor"`` (one scale, ``value`` a float), ``"batch"`` (flash-attn 3's
    float32 ``(batch, nheads_k)``: ``value`` it, and ``units`` one scale per cache row or page
    and KV head, what the rows read), or ``"token"`` (``value`` the float32 tensor beside the
    cache, one scale per cache slot and KV head)."""

    name: str
    kind: str
    value: Union[float, Tensor]
    units: Optional[Tensor] = None

    @classmethod
    def of(cls, fn: str, name: str, given, call) -> "_Descale":
        """``given`` checked for ``call`` (a ``_KVCacheCall`` with its rows' geometry)."""
        if given is None:
            return cls(name, "tensor", 1.0)
        single = one_scale(fn, name, given)
        if single is not None:
            return cls(name, "tensor", single)
        cache = call.k_cache
        batch, heads_k = call.q_shape[0], cache.size(2)
        layouts = {2: (batch, heads_k), 3: tuple(cache.shape[:3])}
        if layouts.get(given.dim()) != tuple(given.shape):
            raise ValueError(
                f"{fn}: {name} must be one scale per tensor (a float or a one-element tensor), "
                f"flash-attn 3's (batch, nheads_k) = {layouts[2]} or one per token and KV head, "
                f"{call.token_scale_layout} = {layouts[3]}, got {name}.shape="
                f"{tuple(given.shape)}"
            )
        if given.dtype != torch.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {name}.dtype={given.dtype}")
        if given.device.type != "cpu":
            raise ValueError(f"{fn}: {name} must be a CPU tensor, got {name}.device="
                             f"{given.device}")
        if given.dim() == 2:
            refuse_bad_scales(fn, name, given)
            first = given.reshape(-1)[0]
            if bool((given == first).all()):
                return cls(name, "tensor", float(first))
            return cls(name, "batch", given, cls._units(fn, name, given, call))
        call.refuse_bad_token_scales(name, given)
        return cls(name, "token", given)

    @staticmethod
    def _units(fn: str, name: str, given: Tensor, call) -> Tensor:
        """flash-attn 3's per-(batch row, KV head) scales as one per cache row (no block_table)
        or page and KV head: each batch row's scales go to what it reads and writes. Where two
        rows share a cache row or page and their scales differ, no scale of its keys is right
        for both: ``ValueError``."""
        units = torch.ones(call.k_cache.size(0), given.size(1), dtype=torch.float32)
        owners: List[Tuple[int, int]] = []
        for b, used in enumerate(call.units_used()):
            owners.extend((int(u), b) for u in used)
        if not owners:
            return units
        unit_ids = torch.tensor([u for u, _ in owners])
        rows = torch.tensor([b for _, b in owners])
        units[unit_ids] = given[rows]
        clash = (units[unit_ids] != given[rows]).any(-1).nonzero()
        if clash.numel():
            unit, b = owners[int(clash[0])]
            other = next(r for u, r in owners if u == unit and not torch.equal(given[r],
                                                                                given[b]))
            what = "page" if call.paged else "cache row"
            first, second = sorted((other, b))
            raise ValueError(
                f"{fn}: {name} (batch, nheads_k) gives batch rows {first} and {second} different "
                f"scales, but both read {what} {unit}, whose keys have one scale a KV head: "
                f"{name}[{first}]={given[first].tolist()}, {name}[{second}]="
                f"{given[second].tolist()}; "
                "give rows that share a cache row or page the same scales, or one scale per "
                "token"
            )
        return units

    def for_pages(self, page_size: int) -> Union[float, Tensor]:
        """The scale for ``paged_attention`` on the whole paged cache (pages of ``page_size``):
        flash-attn 3's per-row scales as one per page and KV head, expanded (not copied) along
        the page's slots."""
        if self.kind == "batch":
            pages = self.units
            return pages.unsqueeze(1).expand(pages.size(0), page_size, pages.size(1))
        return self.value

    def for_rows_from(self, start: int, length: int) -> Union[float, Tensor]:
        """The scale for ``paged_attention`` on the dense cache's rows from position ``start``
        on, ``length`` of them (pages of one cache row each)."""
        if self.kind == "token":
            return self.value[:, start : start + length]
        if self.kind == "batch":
            rows = self.units
            return rows.unsqueeze(1).expand(rows.size(0), length, rows.size(1))
        return self.value

    def store(self, cache: Tensor, where, x: Tensor, b: int) -> None:
        """Writes batch row ``b``'s new keys (or values) ``x`` ``(seqlen_new, nheads_k, dim)``
        into ``cache[where]``: as they are when already in the cache's dtype, else quantized
        with this scale (``"token"``: scales computed for them, written at ``where`` too)."""
        if x.dtype == cache.dtype:
            cache[where] = x
            return
        if self.kind == "token":
            scales = token_scales(x, cache.dtype)
            cache[where] = quantize(x, scales.unsqueeze(-1), cache.dtype)
            self.value[where] = scales
        elif self.kind == "batch":
            cache[where] = quantize(x, self.value[b].unsqueeze(-1), cache.dtype)
        else:
            cache[where] = quantize(x, self.value, cache.dtype)


def check_descales(fn: str, q_descale, k_descale, v_descale, eight_bit: bool,
                   cache_dtype: torch.dtype) -> None:
    """flash-attn 3's descales: ``q_descale`` is for an fp8 ``q``, which is not served; the
    others dequantize an 8-bit cache only."""
    if q_descale is not None:
        raise NotImplementedError(
            f"{fn}: q_descale (flash-attn 3's scale of an fp8 q) is not supported: pass q in "
            f"float32, bfloat16 or float16, dequantized; got {describe(q_descale)}"
        )
    if eight_bit:
        return
    for name, given in (("k_descale", k_descale), ("v_descale", v_descale)):
        if given is not None:
            raise ValueError(
                f"{fn}: {name} dequantizes an 8-bit cache (float8_e4m3fn, float8_e5m2, int8); "
                f"the caches are {cache_dtype}, got {name}={describe(given)}"
            )
