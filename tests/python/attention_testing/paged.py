"""Paged KV caches for the tests: sequences' keys and values laid into the shuffled pages of a
pool, as a serving cache hands them out, and a reference model of a paged cache's accounting."""

import random

import torch


def paged(keys, values, page_size, spare=2, seed=0, stretch=1, gap_rows=0):
    """Sequences' keys (Lk_b, Hkv, D) and values laid into shuffled pages of a pool with
    ``spare`` NaN pages no sequence reads, and the block table (unused entries name a page out
    of range: they are never read). With ``stretch`` > 1 the pool is shuffled in stretches of 1
    to ``stretch`` pages that keep their order, so that a sequence's next page is often the one
    after in the pool (as PagedKVCache lays them); with ``gap_rows`` each page is followed by
    that many NaN rows (the cache a view of a pool of longer pages, which no read may cross)."""
    rng = random.Random(seed)
    counts = [-(-k.shape[0] // page_size) for k in keys]
    total = sum(counts) + spare
    stretches, start = [], 0
    while start < total:
        # (stretch 1 draws nothing here, so that the shuffle lays the pages as it always has)
        length = 1 if stretch == 1 else min(rng.randint(1, stretch), total - start)
        stretches.append(list(range(start, start + length)))
        start += length
    rng.shuffle(stretches)
    order = [page for pages in stretches for page in pages]
    hkv, d, dv = keys[0].shape[1], keys[0].shape[2], values[0].shape[2]
    dtype = keys[0].dtype
    pool_rows = page_size + gap_rows
    k_cache = torch.full((total, pool_rows, hkv, d), float("nan"), dtype=dtype)[:, :page_size]
    v_cache = torch.full((total, pool_rows, hkv, dv), float("nan"), dtype=dtype)[:, :page_size]
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
