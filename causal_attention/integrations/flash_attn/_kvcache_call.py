"""One ``flash_attn_with_kvcache`` call's cache (``_KVCacheCall``): its arguments validated
into each batch row's cache row or pages and key range, the new keys written in place, and the
op called on the cache (a view of it where it can, paged_attention for pages and for 8-bit
caches, whose scales ``_Descale`` holds)."""

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..._quantized_kv import EIGHT_BIT_QUERY_DTYPES, is_eight_bit, refuse_bad_scales
from ...ops import attention, attention_forward, paged_attention
from ._checks import _check_head_dim, _check_pages, _check_rank, _check_row_indices, _describe
from ._quantize import _Descale
from ._scores import _Scores


class _KVCacheCall:
    """The validated geometry of one ``flash_attn_with_kvcache`` call: for every batch row its
    cache row (or pages), the start and end of its keys, and where its new keys go."""

    def __init__(self, fn, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table, k_descale=None, v_descale=None):
        self.fn = fn
        # Which new tokens each query sees (flash_attn_with_kvcache's spec_mask), set after.
        self.spec_mask: Optional[Tensor] = None
        _check_rank(fn, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
        _check_head_dim(fn, q)
        self.paged = block_table is not None
        layout = "(num_blocks, page_block_size, nheads_k, headdim)" if self.paged else \
            "(batch_cache, seqlen_cache, nheads_k, headdim)"
        _check_rank(fn, "k_cache", k_cache, 4, layout)
        _check_rank(fn, "v_cache", v_cache, 4, layout)
        batch, _, heads, dim = q.shape
        if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.size(3) != dim:
            raise ValueError(
                f"{fn}: k_cache and v_cache must be {layout} with q's headdim {dim} for k_cache, "
                f"got q.shape={tuple(q.shape)}, k_cache.shape={tuple(k_cache.shape)}, "
                f"v_cache.shape={tuple(v_cache.shape)}"
            )
        heads_k = k_cache.size(2)
        if heads_k == 0 or heads % heads_k != 0:
            raise ValueError(
                f"{fn}: q's nheads must be a multiple of the cache's nheads_k, got "
                f"q.shape={tuple(q.shape)}, k_cache.shape={tuple(k_cache.shape)}"
            )
        self.eight_bit = is_eight_bit(k_cache) or is_eight_bit(v_cache)
        if self.eight_bit:
            _check_eight_bit_dtypes(fn, q, k_cache, v_cache)
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype and not self.eight_bit:
                raise TypeError(f"{fn}: {name} must have q's dtype {q.dtype}, got {t.dtype}")
        self.q_dtype = q.dtype
        self.q_shape = tuple(q.shape)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.new = self._check_new_keys(k, v)
        if self.paged:
            for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
                if t is not None:
                    raise NotImplementedError(
                        f"{fn}: {name} with block_table (a paged cache) is not supported "
                        f"(flash-attn does not support the pair either), got a {_describe(t)}"
                    )
            self.page = k_cache.size(1)
            self.block_table = _check_row_indices(fn, "block_table", block_table, batch, 2)
            self.capacity = self.block_table.size(1) * self.page
        else:
            self.capacity = k_cache.size(1)
            if cache_batch_idx is None:
                if k_cache.size(0) < batch:
                    raise ValueError(
                        f"{fn}: k_cache has {k_cache.size(0)} rows for q's batch of {batch}; "
                        "pass cache_batch_idx to pick rows of a cache, or a cache as large as "
                        f"the batch (k_cache.shape={tuple(k_cache.shape)})"
                    )
                self.rows = list(range(batch))
            else:
                idx = _check_row_indices(fn, "cache_batch_idx", cache_batch_idx, batch, 1)
                self.rows = idx.tolist()
                bad = [r for r in self.rows if not 0 <= r < k_cache.size(0)]
                if bad:
                    raise ValueError(
                        f"{fn}: cache_batch_idx entries must lie in [0, {k_cache.size(0)}) "
                        f"(k_cache.shape[0]), got {bad}"
                    )
        if cache_seqlens is None:
            if self.new:
                raise ValueError(
                    f"{fn}: cache_seqlens must be given with k and v, to say where the new keys "
                    "go; got cache_seqlens=None"
                )
            self.seqlens = [self.capacity] * batch
        elif isinstance(cache_seqlens, Tensor):
            self.seqlens = _check_row_indices(fn, "cache_seqlens", cache_seqlens, batch, 1).tolist()
        elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
            self.seqlens = [cache_seqlens] * batch
        else:
            raise TypeError(
                f"{fn}: cache_seqlens must be an int or an int32 (batch,) tensor, got "
                f"{_describe(cache_seqlens)}"
            )
        if cache_leftpad is None:
            self.starts = [0] * batch
        else:
            self.starts = _check_row_indices(fn, "cache_leftpad", cache_leftpad, batch, 1).tolist()
        self.ends = [length + self.new for length in self.seqlens]
        for b, (start, length, end) in enumerate(zip(self.starts, self.seqlens, self.ends)):
            if length < 0:
                raise ValueError(f"{fn}: cache_seqlens must be >= 0, got {length} for row {b}")
            if not 0 <= start <= length:
                raise ValueError(
                    f"{fn}: row {b} needs 0 <= cache_leftpad[b] <= cache_seqlens[b], got "
                    f"cache_leftpad[b]={start}, cache_seqlens[b]={length}"
                )
            if end > self.capacity:
                raise ValueError(
                    f"{fn}: row {b} does not fit the cache: cache_seqlens[b] + k.shape[1] = "
                    f"{length} + {self.new} = {end} > {self.capacity}, the cache's "
                    + ("block_table.shape[1] * page_block_size" if self.paged else "seqlen_cache")
                )
        if self.paged:
            # Every page a row reads or writes.
            _check_pages(fn, self.block_table, self.page, k_cache.size(0), torch.tensor(self.ends))
        if self.eight_bit:
            self.token_scale_layout = "(num_blocks, page_block_size, nheads_k)" if self.paged \
                else "(batch_cache, seqlen_cache, nheads_k)"
            self.k_scale = _Descale.of(fn, "k_descale", k_descale, self)
            self.v_scale = _Descale.of(fn, "v_descale", v_descale, self)
            if k is not None and k.dtype == k_cache.dtype and "token" in (
                    self.k_scale.kind, self.v_scale.kind):
                raise ValueError(
                    f"{fn}: k and v in the cache's dtype {k_cache.dtype} are written as they "
                    "are, which leaves their scales in a per-token k_descale/v_descale unset; "
                    f"pass them in q's dtype {q.dtype} to be quantized, their scales computed"
                )

    def _check_new_keys(self, k, v) -> int:
        """Validates the new keys and values; returns how many each row has (0 without)."""
        fn = self.fn
        if (k is None) != (v is None):
            raise ValueError(
                f"{fn}: k and v go together, got k={_describe(k)} and v={_describe(v)}"
            )
        if k is None:
            return 0
        _check_rank(fn, "k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
        _check_rank(fn, "v", v, 4, "(batch, seqlen_new, nheads_k, headdim_v)")
        batch = self.q_shape[0]
        heads_k, dim, dim_v = self.k_cache.size(2), self.k_cache.size(3), self.v_cache.size(3)
        new = k.size(1)
        if tuple(k.shape) != (batch, new, heads_k, dim) or \
                tuple(v.shape) != (batch, new, heads_k, dim_v):
            raise ValueError(
                f"{fn}: k and v must be (batch, seqlen_new, nheads_k, headdim[_v]) = "
                f"({batch}, seqlen_new, {heads_k}, {dim} / {dim_v}), got "
                f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
            )
        if self.eight_bit:
            self._check_new_eight_bit_keys(k, v)
            return new
        for name, t, c in (("k", k, self.k_cache), ("v", v, self.v_cache)):
            if t.dtype != c.dtype:
                raise TypeError(
                    f"{fn}: {name} must have the cache's dtype {c.dtype}, got {t.dtype}"
                )
        return new

    def _check_new_eight_bit_keys(self, k: Tensor, v: Tensor) -> None:
        """New keys for an 8-bit cache: both in q's dtype, quantized as they are written (so
        finite), or both already in the cache's dtype, written as they are."""
        fn, cache_dtype = self.fn, self.k_cache.dtype
        if not ((k.dtype == v.dtype == self.q_dtype) or (k.dtype == v.dtype == cache_dtype)):
            raise TypeError(
                f"{fn}: k and v for a {cache_dtype} cache must both have q's dtype "
                f"{self.q_dtype} (quantized as they are written) or the cache's (written as "
                f"they are), got k.dtype={k.dtype}, v.dtype={v.dtype}"
            )
        if k.dtype == self.q_dtype:
            for name, t in (("k", k), ("v", v)):
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(
                        f"{fn}: {name} must be finite to be quantized into the {cache_dtype} "
                        "cache, got non-finite values"
                    )

    def append(self, k: Optional[Tensor], v: Optional[Tensor]) -> None:
        """Writes row b's new keys at positions cache_seqlens[b] onwards, a row at a time, so that
        with repeated cache rows the last row's keys are the ones left."""
        if not self.new:
            return
        for b, start in enumerate(self.seqlens):
            if self.paged:
                positions = torch.arange(start, start + self.new)
                pages = self.block_table[b, positions // self.page].long()
                where = (pages, positions % self.page)
            else:
                where = (self.rows[b], slice(start, start + self.new))
            if self.eight_bit:
                self.k_scale.store(self.k_cache, where, k[b], b)
                self.v_scale.store(self.v_cache, where, v[b], b)
                continue
            self.k_cache[where] = k[b]
            self.v_cache[where] = v[b]

    def units_used(self) -> List[Tensor]:
        """For each batch row, the cache rows (one, or none if it reads and writes no key) or
        pages it reads and writes."""
        if self.paged:
            return [self.block_table[b, : _ceil_div(end, self.page)] for b, end in
                    enumerate(self.ends)]
        return [torch.tensor([self.rows[b]] if self.ends[b] > self.starts[b] else [],
                             dtype=torch.long) for b in range(len(self.ends))]

    def refuse_bad_token_scales(self, name: str, scales: Tensor) -> None:
        """A per-token scale the rows read before the new keys (whose scales are computed) must
        be positive and finite: ``ValueError`` naming it, before anything is written."""
        where = " where the rows read it"
        if not self.paged:
            for b, (start, length) in enumerate(zip(self.starts, self.seqlens)):
                row = self.rows[b]
                refuse_bad_scales(self.fn, name, scales[row, start:length], (row,), (start,),
                                  where)
            return
        full: List[Tensor] = []
        for b, length in enumerate(self.seqlens):
            whole, rest = divmod(length, self.page)
            full.append(self.block_table[b, :whole])
            if rest:
                page = int(self.block_table[b, whole])
                refuse_bad_scales(self.fn, name, scales[page, :rest], (page,), (), where)
        pages = torch.cat(full).long().unique() if full else torch.zeros(0, dtype=torch.long)
        try:
            refuse_bad_scales(self.fn, name, scales.index_select(0, pages), (), (), where)
        except ValueError:
            # Name the scale by its page, not by its place among the pages read.
            for page in pages.tolist():
                refuse_bad_scales(self.fn, name, scales[page], (page,), (), where)
            raise

    def groups(self, scores: "_Scores") -> List[List[int]]:
        """Batch rows that one op call serves exactly. The op aligns each row's mask (and ALiBi
        distances) to the end of the keys it is given, so rows go together when their keys end
        at the same place; a single query row without ALiBi sees a range of its keys that a key
        mask can say, so then any rows go together, each cut to its own range."""
        batch, lq = self.q_shape[:2]
        if batch == 0:
            return []
        if lq <= 1 and scores.alibi_slopes is None:
            return [list(range(batch))]
        by_end: Dict[int, List[int]] = {}
        for b, end in enumerate(self.ends):
            by_end.setdefault(end, []).append(b)
        return list(by_end.values())

    def keys(self, rows: List[int], length: int) -> Tuple[Tensor, Tensor]:
        """K and V of ``rows`` up to ``length``, ``(len(rows), length, nheads_k, headdim)``: a view
        of the cache when the rows are consecutive, else a copy."""
        cache_rows = [self.rows[b] for b in rows]
        if _consecutive(cache_rows):
            picked = slice(cache_rows[0], cache_rows[0] + len(cache_rows))
        else:
            picked = torch.tensor(cache_rows)
        return self.k_cache[picked, :length], self.v_cache[picked, :length]

    def attend(self, q: Tensor, scale: float, scores: "_Scores", with_lse: bool):
        """One op call per group, on a view of the cache where its rows are consecutive; a key
        mask only where some row's keys start past 0 or end before the group's."""
        if self.paged:
            return self._attend_pages(q, scale, scores, with_lse)
        if self.eight_bit:
            return self._attend_eight_bit_rows(q, scale, scores, with_lse)
        batch, lq, heads, _ = self.q_shape
        groups = self.groups(scores)
        if len(groups) != 1:
            out = q.new_empty(batch, lq, heads, self.v_cache.size(3))
            lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            lse = q.new_empty(batch, heads, lq, dtype=lse_dtype)
        for rows in groups:
            length = max(self.ends[b] for b in rows)
            k, v = self.keys(rows, length)
            picked = slice(rows[0], rows[-1] + 1) if _consecutive(rows) else torch.tensor(rows)
            kwargs = scores.kwargs(picked)
            starts = torch.tensor([self.starts[b] for b in rows])
            ends = torch.tensor([self.ends[b] for b in rows])
            first = starts
            left = scores.window[0]
            if lq == 1 and scores.alibi_slopes is None and left >= 0:
                # Rows of one query, whatever their ends (groups): each row's window goes into
                # the key mask, as the op's would be aligned to the group's end.
                first = torch.maximum(starts, ends - 1 - left)
                kwargs["window"] = (-1, -1)
            key_mask = None
            if bool((first > 0).any()) or bool((ends < length).any()):
                j = torch.arange(length)
                key_mask = (j >= first.unsqueeze(1)) & (j < ends.unsqueeze(1))
            if self.spec_mask is not None:
                kwargs["attn_mask"] = self._spec_attn_mask(rows, length)
            qh, kh, vh = (t.transpose(1, 2) for t in (q[picked], k, v))
            if with_lse:
                o, l = attention_forward(qh, kh, vh, scale, key_mask, **kwargs)
                if scores.alibi_lse_shift:
                    # flash-attn's ALiBi distances count from the row's first key, after leftpad.
                    offsets = ends - starts - lq
                    positions = torch.arange(lq) + offsets.view(-1, 1, 1)
                    l = l + kwargs["alibi_slopes"].unsqueeze(-1) * positions
            else:
                o, l = attention(qh, kh, vh, scale=scale, key_mask=key_mask, **kwargs), None
            if len(groups) == 1:
                out, lse = o.transpose(1, 2).contiguous(), l
            else:
                out[picked] = o.transpose(1, 2)
                if with_lse:
                    lse[picked] = l
        return (out, lse) if with_lse else out

    def _spec_attn_mask(self, rows: List[int], length: int) -> Tensor:
        """spec_mask over the group's keys up to ``length``, ``(len(rows), 1, seqlen_q, length)``:
        every key before a row's new tokens visible, its new tokens as spec_mask says."""
        lq = self.q_shape[1]
        mask = torch.ones(len(rows), 1, lq, length, dtype=torch.bool)
        for i, b in enumerate(rows):
            first_new = self.ends[b] - lq
            mask[i, 0, :, max(first_new, 0):self.ends[b]] = self.spec_mask[b][:, max(-first_new, 0):]
        return mask

    def _attend_pages(self, q: Tensor, scale: float, scores: "_Scores", with_lse: bool):
        """A paged cache, read in place by paged_attention in one call: row b's keys are the
        first ``ends[b]`` rows of its pages (no left padding with pages), its queries aligned to
        their end, as flash-attn's."""
        ends = torch.tensor(self.ends, dtype=torch.int32)
        kwargs = scores.kwargs()
        if self.eight_bit:
            kwargs.update(k_scale=self.k_scale.for_pages(self.page),
                          v_scale=self.v_scale.for_pages(self.page))
        out, lse = paged_attention(q, self.k_cache, self.v_cache, self.block_table, ends,
                                   scale=scale, return_lse=True, spec_mask=self.spec_mask,
                                   **kwargs)
        if with_lse and scores.alibi_lse_shift:
            # flash-attn's causal ALiBi counts distances from the row's first key (attend).
            lq = self.q_shape[1]
            positions = torch.arange(lq) + (ends - lq).view(-1, 1, 1)
            lse = lse + kwargs["alibi_slopes"].unsqueeze(-1) * positions
        return (out, lse) if with_lse else out

    def _attend_eight_bit_rows(self, q: Tensor, scale: float, scores: "_Scores",
                               with_lse: bool):
        """An 8-bit dense cache, read in place by paged_attention as pages of one cache row
        each: row b's page is its cache row, its keys the first ``ends[b] - starts[b]`` of the
        cache from ``starts[b]`` on (a view of the cache from there), its queries aligned to
        their end, as flash-attn's. One call for the rows of each left padding (one without)."""
        batch, lq, heads, _ = self.q_shape
        by_start: Dict[int, List[int]] = {}
        for b, start in enumerate(self.starts):
            by_start.setdefault(start, []).append(b)
        groups = list(by_start.items())
        lse_dtype = torch.float32
        if len(groups) != 1:
            out = q.new_empty(batch, lq, heads, self.v_cache.size(3))
            lse = q.new_empty(batch, heads, lq, dtype=lse_dtype)
        for start, rows in groups:
            picked = slice(rows[0], rows[-1] + 1) if _consecutive(rows) else torch.tensor(rows)
            kwargs = scores.kwargs(picked)
            starts = torch.tensor([start] * len(rows))
            ends = torch.tensor([self.ends[b] for b in rows])
            length = self.capacity - start
            if length == 0:
                # No key for any of these rows (a page of no slots is no paged cache).
                o = q.new_zeros(len(rows), lq, heads, self.v_cache.size(3))
                l = torch.full((len(rows), heads, lq), -math.inf, dtype=lse_dtype)
            else:
                table = torch.tensor([[self.rows[b]] for b in rows], dtype=torch.int32)
                o, l = paged_attention(
                    q[picked], self.k_cache[:, start:], self.v_cache[:, start:], table,
                    (ends - start).to(torch.int32), scale=scale, return_lse=True,
                    k_scale=self.k_scale.for_rows_from(start, length),
                    v_scale=self.v_scale.for_rows_from(start, length),
                    spec_mask=None if self.spec_mask is None else self.spec_mask[picked],
                    **kwargs)
                if with_lse and scores.alibi_lse_shift:
                    # flash-attn's ALiBi distances count from the row's first key (attend).
                    positions = torch.arange(lq) + (ends - starts - lq).view(-1, 1, 1)
                    l = l + kwargs["alibi_slopes"].unsqueeze(-1) * positions
            if len(groups) == 1:
                out, lse = o, l
            else:
                out[picked] = o
                lse[picked] = l
        return (out, lse) if with_lse else out


def _check_eight_bit_dtypes(fn: str, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """8-bit caches: one dtype for both, beside a float32, bfloat16 or float16 q."""
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"{fn}: 8-bit k_cache and v_cache must share one dtype (float8_e4m3fn, float8_e5m2, "
            f"int8), got k_cache.dtype={k_cache.dtype}, v_cache.dtype={v_cache.dtype}"
        )
    if q.dtype not in EIGHT_BIT_QUERY_DTYPES:
        raise TypeError(
            f"{fn}: q must be float32, bfloat16 or float16 beside {k_cache.dtype} caches, got "
            f"q.dtype={q.dtype}"
        )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _consecutive(values: List[int]) -> bool:
    return all(b == a + 1 for a, b in zip(values, values[1:]))
