"""One ``flash_attn_with_kvcache`` call's cache (``_KVCacheCall``): its arguments validated
into each batch row's cache row or pages and key range, the new keys written in place, and the
op called on the cache (a view of it where it can, paged_attention for pages)."""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...ops import attention, attention_forward, paged_attention
from ._checks import _check_head_dim, _check_rank, _check_row_indices, _describe
from ._scores import _Scores


class _KVCacheCall:
    """The validated geometry of one ``flash_attn_with_kvcache`` call: for every batch row its
    cache row (or pages), the start and end of its keys, and where its new keys go."""

    def __init__(self, fn, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table):
        self.fn = fn
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
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype:
                raise TypeError(f"{fn}: {name} must have q's dtype {q.dtype}, got {t.dtype}")
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
            self._check_pages()

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
        for name, t, c in (("k", k, self.k_cache), ("v", v, self.v_cache)):
            if t.dtype != c.dtype:
                raise TypeError(
                    f"{fn}: {name} must have the cache's dtype {c.dtype}, got {t.dtype}"
                )
        return new

    def _check_pages(self) -> None:
        """Every page a row reads or writes must exist; the columns past them are never read."""
        num_blocks = self.k_cache.size(0)
        for b, end in enumerate(self.ends):
            used = self.block_table[b, : _ceil_div(end, self.page)]
            bad = used[(used < 0) | (used >= num_blocks)]
            if bad.numel():
                raise ValueError(
                    f"{self.fn}: block_table row {b} names pages {bad.tolist()} outside "
                    f"[0, {num_blocks}) (k_cache.shape[0]) among the "
                    f"{used.numel()} pages its {end} keys use"
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
            self.k_cache[where] = k[b]
            self.v_cache[where] = v[b]

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

    def _attend_pages(self, q: Tensor, scale: float, scores: "_Scores", with_lse: bool):
        """A paged cache, read in place by paged_attention in one call: row b's keys are the
        first ``ends[b]`` rows of its pages (no left padding with pages), its queries aligned to
        their end, as flash-attn's."""
        ends = torch.tensor(self.ends, dtype=torch.int32)
        kwargs = scores.kwargs()
        out, lse = paged_attention(q, self.k_cache, self.v_cache, self.block_table, ends,
                                   scale=scale, return_lse=True, **kwargs)
        if with_lse and scores.alibi_lse_shift:
            # flash-attn's causal ALiBi counts distances from the row's first key (attend).
            lq = self.q_shape[1]
            positions = torch.arange(lq) + (ends - lq).view(-1, 1, 1)
            lse = lse + kwargs["alibi_slopes"].unsqueeze(-1) * positions
        return (out, lse) if with_lse else out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _consecutive(values: List[int]) -> bool:
    return all(b == a + 1 for a, b in zip(values, values[1:]))
