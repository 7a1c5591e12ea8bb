"""A paged KV cache for serving many requests at once: fixed-size pages of keys and values per
layer in one pool, its free pages, and per request the pages it holds (its block table), in the
layout flash-attn and vLLM's flash backend read:
``k_cache (num_pages, page_size, Hkv, D)``, ``v_cache (num_pages, page_size, Hkv, Dv)``,
``block_table (B, max_pages) int32`` and ``cache_seqlens (B,) int32``.

Requests share pages: :meth:`PagedKVCache.fork` gives a new request every page of an existing one
(a common prompt), counted by reference; a page is written only while one request holds it, so
the first write into a shared, partly filled last page copies it first (copy on write). Full
pages are never written again, and stay shared until every holder frees them.

The pages may be 8-bit (``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.int8``: half a
bfloat16 pool's bytes a token), each layer's keys and values stored with a scale per tensor or
per token and KV head (:mod:`causal_attention.quantization`); per-token scales lie beside the
pages and go where their pages go (shared by a fork, copied with a page on write; a freed page's
next holder writes its own with its rows).

A cache of MLA's latent (``values_in_keys``) stores each token once: its values are its keys'
first ``value_dim`` features, ``value_pages`` views of ``key_pages``, which paged_attention reads
once for both.

This module holds the pool (:class:`PagedKVCache`); a step's writes into its slots and its
attention through the pages are paged_step.py's (:func:`paged_cache_append`, :class:`PagedStep`).
"""

from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor

from .paged_step import PagedStep, paged_cache_append
from .quantization import FORMAT_MAX, is_eight_bit, positive_finite_in_float32

_NAME = "causal_attention.PagedKVCache"
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_SCALES = ("tensor", "token")


class PagedKVCache:
    """Keys and values of many requests, in pages of ``page_size`` tokens drawn from one pool of
    ``num_pages`` per layer (``key_pages[layer]``, ``value_pages[layer]``).

    A serving step: :meth:`allocate` each new request, :meth:`reserve` the slots of the tokens
    each request adds this step (one call for every layer: it returns their ``slot_mapping``),
    :meth:`append` each layer's keys and values into those slots, then attend through
    :meth:`block_table` and :meth:`seqlens` (:func:`causal_attention.paged_attention` reads the
    pages in place); :meth:`free` a finished request's pages.

    A request's pages follow one another in the pool where they can: its next page is the one
    after its last when that one is free, and otherwise (a new request, or a neighbour's pages in
    the way) the middle of the longest stretch of free pages (its start, at the pool's start),
    which leaves the first half to the request before it. So requests that decode together each
    grow into a stretch of their own, and a decode reads a request's pages as one stream: 16-row
    pages strewn over a pool of 32 MiB or more decode 1.1-1.35x slower on Zen 4 than the same
    pages in order (docs/benchmarks, "Paged KV cache"). The same calls give the same tables.

    ``dtype`` is the pages': a float dtype (keys and values stored as given, in that dtype) or
    an 8-bit one, ``torch.float8_e4m3fn``, ``torch.float8_e5m2`` or ``torch.int8`` (quantized
    as :meth:`append` writes them, read in place by :func:`causal_attention.paged_attention`),
    with ``scales``:

    - ``"token"`` (the default): a scale per token and KV head for keys and for values,
      ``key_scales[layer]`` and ``value_scales[layer]``, float32 ``(num_pages, page_size,
      Hkv)`` (1 until written), each token's computed as it is written: no calibration, and
      int8 keeps each token's own range; 4 bytes a token and KV head more for each of K and V.
    - ``"tensor"``: one scale per layer for keys and one for values, ``k_scale`` and
      ``v_scale`` (a float for every layer or one per layer; 1.0 by default; vLLM's per-layer
      scales, calibrated beforehand): ``key_scales[layer]`` and ``value_scales[layer]`` are
      floats. Values beyond ``scale x`` the format's largest value saturate.

    :attr:`bytes_per_token` counts what a token takes in the pool: with 8-bit pages and
    ``"tensor"`` scales half a bfloat16 pool's (a pool of the same bytes holds twice the
    tokens), with ``"token"`` scales ``2 x 4 x Hkv`` bytes a layer more.

    ``values_in_keys=True`` holds MLA's latent (DeepSeek-V2/V3's absorbed attention: one KV
    head of ``head_dim`` = 576 features whose first ``value_dim`` = 512 are also the values):
    ``value_pages[layer]`` is ``key_pages[layer][..., :value_dim]``, a view, so a token takes
    ``head_dim`` features, not ``head_dim + value_dim``; pass the views as ``v_cache`` to
    :func:`causal_attention.paged_attention`, which then reads each page once. :meth:`append`
    takes the latent as ``k`` and ``v=None``; the values' scales are the keys' (``value_scales``
    is ``key_scales``, so ``v_scale`` is not given).
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 value_dim: Optional[int] = None, num_layers: int = 1,
                 dtype: torch.dtype = torch.float32, device=None, *,
                 scales: Optional[str] = None,
                 k_scale: Union[float, Sequence[float], None] = None,
                 v_scale: Union[float, Sequence[float], None] = None,
                 values_in_keys: bool = False) -> None:
        sizes = {"num_pages": num_pages, "page_size": page_size, "num_kv_heads": num_kv_heads,
                 "head_dim": head_dim, "num_layers": num_layers}
        if value_dim is not None:
            sizes["value_dim"] = value_dim
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"{_NAME}: {name} must be an int, got {size!r}")
            if size < 1:
                raise ValueError(f"{_NAME}: {name} must be >= 1, got {size}")
        scales = _check_quantization(dtype, scales, k_scale, v_scale)
        value_dim = head_dim if value_dim is None else value_dim
        _check_values_in_keys(values_in_keys, head_dim, value_dim, v_scale)
        self.page_size = page_size
        self.dtype = dtype
        self.scales = scales
        self.values_in_keys = values_in_keys
        self.key_pages = [torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype,
                                      device=device) for _ in range(num_layers)]
        self.value_pages = (
            [pages[..., :value_dim] for pages in self.key_pages] if values_in_keys
            else [torch.zeros(num_pages, page_size, num_kv_heads, value_dim, dtype=dtype,
                              device=device) for _ in range(num_layers)])
        # Each layer's dequantization scales as paged_attention and paged_cache_append take
        # them: None (float pages), a float per layer ("tensor"), or per token and KV head
        # tensors beside the pages ("token", written by append).
        self.key_scales: List[Union[float, Tensor, None]]
        self.value_scales: List[Union[float, Tensor, None]]
        if scales == "token":
            self.key_scales, self.value_scales = (
                [torch.ones(num_pages, page_size, num_kv_heads, device=device)
                 for _ in range(num_layers)] for _ in range(2))
        elif scales == "tensor":
            self.key_scales = _per_layer("k_scale", k_scale, num_layers)
            self.value_scales = _per_layer("v_scale", v_scale, num_layers)
        else:
            self.key_scales, self.value_scales = [None] * num_layers, [None] * num_layers
        if values_in_keys:  # a value is stored as its key's first features, with their scale
            self.value_scales = self.key_scales
        self._holders = [0] * num_pages  # requests holding each page (0: free)
        self._free_count = num_pages
        self._is_free = bytearray(b"\x01") * num_pages  # 1: free (for the stretches' search)
        self._pages: Dict[object, List[int]] = {}
        self._lengths: Dict[object, int] = {}

    # --- the pool ---------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return len(self._holders)

    @property
    def free_pages(self) -> int:
        return self._free_count

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - self._free_count

    @property
    def nbytes(self) -> int:
        """The pool's bytes: every layer's key and value pages and per-token scales."""
        return sum(t.numel() * t.element_size() for t in self._stored())

    @property
    def bytes_per_token(self) -> int:
        """The bytes one token's slot takes in the pool, every layer's keys and values (and
        per-token scales): :attr:`nbytes` over the pool's slots."""
        return self.nbytes // (self.num_pages * self.page_size)

    @property
    def requests(self) -> List[object]:
        return list(self._pages)

    def pages_of(self, request) -> List[int]:
        """The pages of ``request``, in sequence order (a copy)."""
        return list(self._pages[self._known(request)])

    def length(self, request) -> int:
        """The tokens ``request`` holds."""
        return self._lengths[self._known(request)]

    def holders(self, page: int) -> int:
        """How many requests hold ``page`` (0: free)."""
        return self._holders[page]

    # --- requests ---------------------------------------------------------------------------

    def allocate(self, request) -> None:
        """A new request, holding no token yet; ``request`` is any hashable id."""
        if request in self._pages:
            raise ValueError(f"{_NAME}.allocate: request {request!r} is already allocated")
        self._pages[request], self._lengths[request] = [], 0

    def fork(self, parent, child) -> None:
        """``child``, a new request, holds every token of ``parent`` by sharing its pages (a
        common prompt); each then writes its own tokens (copy on write of a shared partial
        page, in :meth:`reserve`)."""
        pages = self._pages[self._known(parent)]
        if child in self._pages:
            raise ValueError(f"{_NAME}.fork: request {child!r} is already allocated")
        for page in pages:
            self._holders[page] += 1
        self._pages[child], self._lengths[child] = list(pages), self._lengths[parent]

    def free(self, request) -> None:
        """Ends ``request``: its pages that no other request holds are free again."""
        for page in self._pages.pop(self._known(request)):
            self._release(page)
        del self._lengths[request]

    def truncate(self, request, length: int) -> None:
        """Drops the tokens of ``request`` at positions ``>= length`` (rejected draft tokens):
        its pages past the first ``ceil(length / page_size)`` are released (freed unless a fork
        still holds them). A kept partly filled page that a fork shares is never written here:
        the request's next tokens copy it first (:meth:`reserve`), as for any shared page."""
        current = self._lengths[self._known(request)]
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"{_NAME}.truncate: length must be an int, got {length!r}")
        if not 0 <= length <= current:
            raise ValueError(f"{_NAME}.truncate: length must be in [0, {current}] (the tokens "
                             f"request {request!r} holds), got {length}")
        pages = self._pages[request]
        kept = -(-length // self.page_size)
        for page in pages[kept:]:
            self._release(page)
        del pages[kept:]
        self._lengths[request] = length

    def reserve(self, request, tokens: int) -> Tensor:
        """Room for ``tokens`` more tokens of ``request``: pages drawn as needed, and a shared
        partly filled last page copied first (every layer), so that the new tokens go to pages
        this request alone holds. Returns their slots, ``(tokens,)`` int64, for
        :meth:`append` (or :func:`paged_cache_append`). Raises RuntimeError, changing nothing,
        when too few pages are free."""
        needed = self._pages_needed("reserve", [request], [tokens])
        if needed > self._free_count:
            raise RuntimeError(
                f"{_NAME}.reserve: {tokens} more tokens of request {request!r} need {needed} "
                f"free pages, {self._free_count} of {self.num_pages} are free"
            )
        length = self._draw(request, tokens)
        positions = torch.arange(length, length + tokens)
        table = torch.tensor(self._pages[request], dtype=torch.long)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def step(self, requests: Sequence, tokens: Sequence[int],
             spec_mask: Optional[Tensor] = None) -> PagedStep:
        """One serving step: ``tokens[i]`` more tokens of ``requests[i]`` (distinct requests),
        reserved (:meth:`reserve`) and described for every layer's attention, new tokens in
        request order (a prefill chunk's, a decode's one). ``spec_mask``, bool ``(total new
        tokens, max(tokens))``, says which of its request's new tokens each one sees (a step
        that verifies trees of draft tokens: :func:`causal_attention.paged_attention`). Raises
        RuntimeError, changing nothing, when too few pages are free for them all."""
        if len(requests) != len(tokens) or len(set(requests)) != len(requests):
            raise ValueError(f"{_NAME}.step: one token count per request, each request once, "
                             f"got {len(requests)} requests and {len(tokens)} counts")
        if spec_mask is not None:
            shape = (sum(tokens), max(tokens, default=0))
            if not isinstance(spec_mask, Tensor) or spec_mask.dtype != torch.bool:
                raise TypeError(f"{_NAME}.step: spec_mask must be a bool tensor, got "
                                f"{getattr(spec_mask, 'dtype', type(spec_mask).__name__)}")
            if tuple(spec_mask.shape) != shape:
                raise ValueError(f"{_NAME}.step: spec_mask must be (total new tokens, "
                                 f"max(tokens))={shape}, got {tuple(spec_mask.shape)}")
        needed = self._pages_needed("step", requests, tokens)
        if needed > self._free_count:
            raise RuntimeError(f"{_NAME}.step: the step needs {needed} free pages, "
                               f"{self._free_count} of {self.num_pages} are free")
        before = [self._draw(r, n) for r, n in zip(requests, tokens)]
        # Every request's slots at once (a serving step calls this once per step, so its cost
        # is a few tensor ops, not a few per request): token t of request i, at position p in
        # it, lies in row p % page_size of page block_table[i, p // page_size].
        table = self._table(requests, None)
        counts = torch.tensor([0] + list(tokens), dtype=torch.int32)
        cu_seqlens_q = counts.cumsum(0, dtype=torch.int32)
        total = int(cu_seqlens_q[-1])
        request_of = torch.repeat_interleave(torch.arange(len(requests)), counts[1:].long(),
                                             output_size=total)
        offsets = torch.tensor(before, dtype=torch.long) - cu_seqlens_q[:-1].long()
        positions = torch.arange(total) + offsets[request_of]
        page_size = self.page_size
        slots = table[request_of, positions // page_size].long() * page_size + positions % page_size
        device = self.key_pages[0].device
        return PagedStep(
            cache=self,
            slot_mapping=slots,
            block_table=table.to(device),
            seqlens=self.seqlens(requests),
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max(tokens, default=0),
            positions=positions.to(device),
            spec_mask=spec_mask,
        )

    def append(self, layer: int, k: Tensor, v: Optional[Tensor], slot_mapping: Tensor) -> None:
        """Writes one layer's keys ``(tokens, Hkv, D)`` and values ``(tokens, Hkv, Dv)`` into
        the slots :meth:`reserve` gave (8-bit pages: quantized with the layer's scales, per-token
        ones computed and kept). With ``values_in_keys``, ``v`` is None: the values are ``k``'s
        first ``Dv`` features, stored with it."""
        layer = self._layer(layer)
        if self.values_in_keys:
            if v is not None:
                raise ValueError(f"{_NAME}.append: this cache's values are its keys' first "
                                 f"{self.value_pages[layer].shape[-1]} features "
                                 "(values_in_keys): pass v=None, got a tensor of shape "
                                 f"{tuple(v.shape)}")
            # paged_cache_append writes a key and a value a token: here both are the whole
            # latent row into the key pages, the same bytes twice, so that the scale of every
            # stored feature is the key's (one of the values' own features would differ).
            pages, slots = self.key_pages[layer], slot_mapping.to(self.key_pages[layer].device)
            scale = self.key_scales[layer]
            paged_cache_append(k, k, pages, pages, slots, k_scale=scale, v_scale=scale)
            return
        paged_cache_append(k, v, self.key_pages[layer], self.value_pages[layer],
                           slot_mapping.to(self.key_pages[layer].device),
                           k_scale=self.key_scales[layer], v_scale=self.value_scales[layer])

    def block_table(self, requests: Sequence, width: Optional[int] = None) -> Tensor:
        """``(len(requests), width) int32``: row i lists request i's pages in sequence order,
        padded with 0 (read by no key: :meth:`seqlens` ends each row); ``width`` defaults to
        the longest row."""
        return self._table(requests, width).to(self.key_pages[0].device)

    def seqlens(self, requests: Sequence) -> Tensor:
        """``(len(requests),) int32``: the tokens each request holds."""
        lengths = [self._lengths[self._known(r)] for r in requests]
        return torch.tensor(lengths, dtype=torch.int32, device=self.key_pages[0].device)

    # --- internals --------------------------------------------------------------------------

    def _stored(self) -> List[Tensor]:
        """Every tensor holding the pool's bytes, each once: every layer's key pages, value pages
        (unless views of the key pages) and per-token scales."""
        values = [] if self.values_in_keys else self.value_pages
        scales = self.key_scales + ([] if self.values_in_keys else self.value_scales)
        return self.key_pages + values + [s for s in scales if isinstance(s, Tensor)]

    def _known(self, request):
        if request not in self._pages:
            raise KeyError(f"{_NAME}: request {request!r} is not allocated (allocated: "
                           f"{len(self._pages)} requests)")
        return request

    def _layer(self, layer) -> int:
        """:meth:`append`'s ``layer`` checked: Python's indexing would take -1 as the last."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"{_NAME}.append: layer must be an int, got {layer!r}")
        if not 0 <= layer < len(self.key_pages):
            raise ValueError(f"{_NAME}.append: layer must be in [0, {len(self.key_pages)}) "
                             f"(num_layers), got {layer}")
        return layer

    def _table(self, requests: Sequence, width: Optional[int]) -> Tensor:
        """:meth:`block_table` on the CPU, built from one padded list."""
        rows = [self._pages[self._known(r)] for r in requests]
        longest = max((len(p) for p in rows), default=0)
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"{_NAME}.block_table: width {width} is less than the {longest} "
                             "pages of the longest request")
        if not rows:
            return torch.zeros(0, width, dtype=torch.int32)
        return torch.tensor([p + [0] * (width - len(p)) for p in rows], dtype=torch.int32)

    def _draw(self, request, tokens: int) -> int:
        """The pages ``tokens`` more tokens of ``request`` need, drawn (a shared partly filled
        last page copied first, every layer), its length counted; returns its length before.
        The caller has checked that enough pages are free."""
        pages, length = self._pages[request], self._lengths[request]
        if self._copies_last_page(request, tokens):
            shared = pages[-1]
            pages[-1] = self._take(pages[-2] if len(pages) > 1 else None)
            # The page's per-token scales go with its rows.
            for layer in self._stored():
                layer[pages[-1]].copy_(layer[shared])
            self._release(shared)
        while len(pages) * self.page_size < length + tokens:
            pages.append(self._take(pages[-1] if pages else None))
        self._lengths[request] = length + tokens
        return length

    def _copies_last_page(self, request, tokens: int) -> bool:
        """Whether ``tokens`` more tokens of ``request`` first copy its shared partial page."""
        pages, length = self._pages[request], self._lengths[request]
        return tokens > 0 and length % self.page_size != 0 and self._holders[pages[-1]] > 1

    def _pages_needed(self, caller: str, requests: Sequence, tokens: Sequence[int]) -> int:
        """The free pages ``tokens[i]`` more tokens of each ``requests[i]`` draw, in turn: the
        new pages, and the copies on write of shared partly filled pages. Each holder writing
        into such a page copies it, but for the last one left on it, who then holds it alone
        and writes in place: ``min(writers, holders - 1)`` copies, not one per writer."""
        needed = 0
        writers: Dict[int, int] = {}  # shared partial page -> its holders writing into it
        for request, count in zip(requests, tokens):
            pages, length = self._pages[self._known(request)], self._lengths[request]
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{_NAME}.{caller}: tokens must be an int >= 0, got {count!r}")
            needed += -(-(length + count) // self.page_size) - len(pages)
            if self._copies_last_page(request, count):
                writers[pages[-1]] = writers.get(pages[-1], 0) + 1
        return needed + sum(min(n, self._holders[page] - 1) for page, n in writers.items())

    def _take(self, after: Optional[int]) -> int:
        """A free page for a request whose last page is ``after`` (None: it has none): the
        next one when free, else :meth:`_roomiest`. The caller has checked that one is free."""
        page = after + 1 if after is not None else -1
        if not 0 <= page < self.num_pages or self._holders[page] != 0:
            page = self._roomiest()
        self._holders[page] = 1
        self._free_count -= 1
        self._is_free[page] = 0
        return page

    def _roomiest(self) -> int:
        """The middle of the longest stretch of free pages (the first of them, if several), or
        its start when it starts the pool: room on both sides for this request and the one
        whose pages end before the stretch to grow in order."""
        free = torch.frombuffer(self._is_free, dtype=torch.int8)  # a view, not a copy
        edges = torch.diff(free, prepend=free.new_zeros(1), append=free.new_zeros(1))
        # Where a stretch starts (+1) and ends (-1): they alternate, start first.
        stretches = edges.nonzero()[:, 0].view(-1, 2)
        longest = int((stretches[:, 1] - stretches[:, 0]).argmax())
        start, end = stretches[longest].tolist()
        return start if start == 0 else (start + end) // 2

    def _release(self, page: int) -> None:
        self._holders[page] -= 1
        if self._holders[page] == 0:
            self._free_count += 1
            self._is_free[page] = 1


def _check_quantization(dtype, scales, k_scale, v_scale) -> Optional[str]:
    """The pages' ``dtype`` and ``scales`` checked; returns the scales' layout ("token" or
    "tensor"; None for float pages)."""
    if not isinstance(dtype, torch.dtype) or not (dtype in _FLOATS or is_eight_bit(dtype)):
        names = ", ".join(str(d).removeprefix("torch.") for d in _FLOATS + tuple(FORMAT_MAX))
        raise TypeError(f"{_NAME}: dtype must be one of {names}, got {dtype!r}")
    if scales is not None and not isinstance(scales, str):
        raise TypeError(f"{_NAME}: scales must be 'tensor' or 'token', got {scales!r}")
    if not is_eight_bit(dtype):
        if scales is not None or k_scale is not None or v_scale is not None:
            raise ValueError(f"{_NAME}: scales, k_scale and v_scale are for 8-bit pages "
                             f"(float8_e4m3fn, float8_e5m2, int8); dtype is {dtype}")
        return None
    scales = "token" if scales is None else scales
    if scales not in _SCALES:
        raise ValueError(f"{_NAME}: scales must be 'tensor' (one per layer for K and V) or "
                         f"'token' (one per token and KV head), got {scales!r}")
    if scales == "token" and (k_scale is not None or v_scale is not None):
        raise ValueError(f"{_NAME}: k_scale and v_scale are the per-layer scales of "
                         "scales='tensor'; scales='token' computes its own")
    return scales


def _check_values_in_keys(values_in_keys, head_dim: int, value_dim: int, v_scale) -> None:
    """``values_in_keys`` checked against the sizes and scales it needs."""
    if not isinstance(values_in_keys, bool):
        raise TypeError(f"{_NAME}: values_in_keys must be a bool, got {values_in_keys!r}")
    if not values_in_keys:
        return
    if value_dim > head_dim:
        raise ValueError(f"{_NAME}: values_in_keys stores the values as the keys' first "
                         f"value_dim features, so value_dim must be <= head_dim, got value_dim "
                         f"{value_dim} and head_dim {head_dim}")
    if v_scale is not None:
        raise ValueError(f"{_NAME}: values_in_keys stores the values with the keys' scales "
                         f"(k_scale), so v_scale must not be given, got {v_scale!r}")


def _per_layer(name: str, scale, layers: int) -> List[float]:
    """``scale`` (None: 1.0, a float, or one per layer) as ``layers`` floats, each positive and
    finite in float32 (what the reader takes)."""
    if isinstance(scale, (list, tuple)):
        values = list(scale)
    else:
        values = [1.0 if scale is None else scale] * layers
    if len(values) != layers:
        raise ValueError(f"{_NAME}: {name} must be a float or one per layer ({layers}), got "
                         f"{len(values)}")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{_NAME}: {name} must be a float or a list of floats, got "
                            f"{value!r}")
        if not positive_finite_in_float32(float(value)):
            raise ValueError(f"{_NAME}: {name} must be positive and finite (in float32), got "
                             f"{value} (layer {i})")
    return [float(v) for v in values]
