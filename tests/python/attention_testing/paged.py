"""Paged KV caches for the tests: sequences' keys and values laid into the shuffled pages of a
pool, as a serving cache hands them out; MLA's latent cache, written step by step into such
pages; and a reference model of a paged cache's accounting."""

import random
from typing import List, NamedTuple, Sequence

import torch

from causal_attention import paged_cache_append
from causal_attention.quantization import dequantize, is_eight_bit


def paged(keys, values, page_size, spare=2, seed=0):
    """Sequences' keys (Lk_b, Hkv, D) and values laid into shuffled pages of a pool with
    ``spare`` NaN pages no sequence reads, and the block table (unused entries name a page out
    of range: they are never read)."""
    rng = random.Random(seed)
    counts = [-(-k.shape[0] // page_size) for k in keys]
    total = sum(counts) + spare
    order = list(range(total))
    rng.shuffle(order)
    hkv, d, dv = keys[0].shape[1], keys[0].shape[2], values[0].shape[2]
    dtype = keys[0].dtype
    k_cache = torch.full((total, page_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((total, page_size, hkv, dv), float("nan"), dtype=dtype)
    width = max(counts) + 1
    table = torch.full((len(keys), width), 10**6, dtype=torch.int32)
    used = 0
    for b, (k, v) in enumerate(zip(keys, values)):
        for j in range(counts[b]):
            page = order[used]
            used += 1
            table[b, j] = page
            rows = slice(j * page_size, min((j + 1) * page_size, k.shape[0]))
            n = rows.stop - rows.start
            k_cache[page, :n], v_cache[page, :n] = k[rows], v[rows]
    return k_cache, v_cache, table


class LatentStep(NamedTuple):
    """The new tokens of one step on a :class:`LatentCache`, in sequence order: their slots and
    positions ``(total,)`` int64, ``cu_seqlens_q (B + 1,)`` int32 and the most a sequence adds."""

    slots: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int


class LatentCache:
    """MLA's latent cache: per token one row ``[c_kv, k_rope]`` (one KV head, ``latent_dim``
    features) in pages of a pool, whose first ``value_dim`` features are also the values:
    :attr:`values` is a view of :attr:`pages`, not a second cache. Sequence b's pages (room for
    ``capacities[b]`` tokens) are drawn up front from the shuffled pool, so that they do not
    follow one another. ``dtype`` is the pages': a float dtype, or an 8-bit one with a float32
    scale per token (:attr:`scales`, computed as each token is written).

    :class:`causal_attention.PagedKVCache` keeps values in pages of their own, so it cannot hold
    a latent whose values are a view of its keys."""

    def __init__(self, capacities: Sequence[int], page_size: int, latent_dim: int,
                 value_dim: int, dtype: torch.dtype, seed: int = 0):
        counts = [-(-n // page_size) for n in capacities]
        order = list(range(sum(counts)))
        random.Random(seed).shuffle(order)
        self.page_size = page_size
        self.pages = torch.zeros(len(order), page_size, 1, latent_dim, dtype=dtype)
        self.values = self.pages[..., :value_dim]
        self.scales = torch.ones(self.pages.shape[:3]) if is_eight_bit(dtype) else None
        # Unused entries name a page out of range: paged_attention never reads them.
        self.block_table = torch.full((len(counts), max(counts)), 10**6, dtype=torch.int32)
        for b, count in enumerate(counts):
            self.block_table[b, :count] = torch.tensor(order[:count], dtype=torch.int32)
            del order[:count]
        self.capacities = list(capacities)
        self.lengths = [0] * len(counts)

    @property
    def seqlens(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.int32)

    def step(self, tokens: Sequence[int]) -> LatentStep:
        """Room for ``tokens[b]`` more tokens of each sequence b (a prefill chunk, a decode's
        one): their slots and positions, counted into :attr:`lengths`."""
        slots: List[torch.Tensor] = []
        positions: List[torch.Tensor] = []
        for b, count in enumerate(tokens):
            start = self.lengths[b]
            assert start + count <= self.capacities[b], f"sequence {b} is past its capacity"
            seq_positions = torch.arange(start, start + count)
            pages = self.block_table[b, seq_positions // self.page_size].long()
            slots.append(pages * self.page_size + seq_positions % self.page_size)
            positions.append(seq_positions)
            self.lengths[b] += count
        counts = torch.tensor([0] + list(tokens))
        return LatentStep(torch.cat(slots), torch.cat(positions),
                          counts.cumsum(0, dtype=torch.int32), max(tokens))

    def append(self, latent: torch.Tensor, slots: torch.Tensor) -> None:
        """Writes the new tokens' latent rows ``(total, latent_dim)`` into their ``slots``."""
        # paged_cache_append writes a key and a value per token; the latent's value is its key's
        # first features, so the latent goes in as both, written twice alike. A value of its own
        # would be quantized with a per-token scale of its own features, unlike the key's.
        rows = latent.unsqueeze(1)
        paged_cache_append(rows, rows, self.pages, self.pages, slots, k_scale=self.scales,
                           v_scale=self.scales)

    def latent(self, b: int) -> torch.Tensor:
        """Sequence b's latent rows ``(length, latent_dim)`` as paged_attention reads them (8-bit
        ones dequantized, in float32)."""
        positions = torch.arange(self.lengths[b])
        pages = self.block_table[b, positions // self.page_size].long()
        rows = positions % self.page_size
        stored = self.pages[pages, rows, 0]
        if self.scales is None:
            return stored
        return dequantize(stored, self.scales[pages, rows])


class ReferencePool:
    """What a :class:`causal_attention.PagedKVCache` must account, without its placement: per
    request its tokens (their values, in order) and its pages as ids of this model's own, each
    page's holders, copy on write as written down (a request writing into a shared partly
    filled last page first gets a page of its own). A page taken has a new id, never reused, so
    the cache's pages map onto these ids one to one at any moment, and not across a free."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.tokens = {}  # request -> its tokens' values
        self.pages = {}  # request -> its pages' ids, in sequence order
        self.holders = {}  # page id -> requests holding it (> 0: a freed page's id is dropped)
        self._next_id = 0

    @property
    def free_pages(self) -> int:
        return self.num_pages - len(self.holders)

    def allocate(self, request) -> None:
        self.tokens[request], self.pages[request] = [], []

    def fork(self, parent, child) -> None:
        self.tokens[child], self.pages[child] = list(self.tokens[parent]), list(self.pages[parent])
        for page in self.pages[child]:
            self.holders[page] += 1

    def free(self, request) -> None:
        del self.tokens[request]
        for page in self.pages.pop(request):
            self._release(page)

    def truncate(self, request, length: int) -> None:
        """``request``'s tokens past the first ``length`` dropped, and the pages they alone
        took released."""
        del self.tokens[request][length:]
        kept = -(-length // self.page_size)
        for page in self.pages[request][kept:]:
            self._release(page)
        del self.pages[request][kept:]

    def pages_needed(self, writes) -> int:
        """The pages ``writes`` (request -> its new tokens' values, written in turn) take: found
        by writing them into a copy of this model."""
        trial = ReferencePool(self.num_pages, self.page_size)
        trial.tokens = {r: list(t) for r, t in self.tokens.items()}
        trial.pages = {r: list(p) for r, p in self.pages.items()}
        trial.holders, trial._next_id = dict(self.holders), self._next_id
        for request, values in writes.items():
            trial.write(request, values)
        return trial._next_id - self._next_id

    def write(self, request, values) -> None:
        """``values`` appended to ``request``'s tokens, its pages drawn as they need."""
        tokens, pages = self.tokens[request], self.pages[request]
        if values and len(tokens) % self.page_size and self.holders[pages[-1]] > 1:
            self._release(pages[-1])
            pages[-1] = self._take()
        tokens += values
        while len(pages) * self.page_size < len(tokens):
            pages.append(self._take())

    def _take(self) -> int:
        self._next_id += 1
        self.holders[self._next_id] = 1
        return self._next_id

    def _release(self, page: int) -> None:
        self.holders[page] -= 1
        if self.holders[page] == 0:
            del self.holders[page]
