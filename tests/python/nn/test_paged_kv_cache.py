"""causal_attention.paged_kv_cache: paged_cache_append writes tokens into their slots in place,
and PagedKVCache's pages (allocate, reserve, append, fork with copy on write, truncate, free) hold
every request's tokens, shared where forked, none leaked, after 10k random operations (reserves and
steps among them) accounted as a reference model does; flash-attn's paged call reads them."""

import random

import pytest
import torch

import causal_attention as ca
from causal_attention import CausalSelfAttention, attention
from causal_attention.integrations.flash_attn import flash_attn_with_kvcache
from causal_attention.paged_kv_cache import PagedKVCache, paged_cache_append

from attention_testing.paged import ReferencePool


def gathered(cache: PagedKVCache, request, layer: int = 0):
    """The request's keys and values, (tokens, Hkv, D), read through its pages."""
    pages = cache.pages_of(request)
    length = cache.length(request)
    keys = cache.key_pages[layer][pages].flatten(0, 1)[:length]
    values = cache.value_pages[layer][pages].flatten(0, 1)[:length]
    return keys, values


# --- paged_cache_append ----------------------------------------------------------------------


def assert_slots_hold(k_cache, v_cache, slots, k, v):
    """Token t's keys and values lie in slot slots[t] of the 4-row pages."""
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // 4, s % 4], k[t])
        assert torch.equal(v_cache[s // 4, s % 4], v[t])


def test_append_writes_each_token_into_its_slot():
    k_cache, v_cache = torch.zeros(5, 4, 2, 3), torch.zeros(5, 4, 2, 6)
    slots = torch.tensor([17, 0, 6, 7, 19])
    k, v = torch.randn(5, 2, 3), torch.randn(5, 2, 6)
    paged_cache_append(k, v, k_cache, v_cache, slots)
    assert_slots_hold(k_cache, v_cache, slots, k, v)
    written = torch.zeros(20, dtype=torch.bool)
    written[slots] = True
    assert k_cache.flatten(0, 1)[~written].abs().sum() == 0  # nothing else


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(slots=torch.tensor([0, 20])), ValueError, r"\[0, 20\)"),
        (dict(slots=torch.tensor([-2, 2])), ValueError, r"\[0, 20\)"),  # -1 is padding
        (dict(slots=torch.tensor([3, 3])), ValueError, "distinct"),
        (dict(slots=torch.tensor([1.0, 2.0])), TypeError, "int32 or int64"),
        (dict(k=torch.randn(3, 2, 3)), ValueError, r"k must be \(tokens, Hkv, D\)"),
        (dict(v=torch.randn(2, 2, 3)), ValueError, r"v must be \(tokens, Hkv, Dv\)"),
        (dict(k=torch.randn(2, 2, 3, dtype=torch.float64)), TypeError, "k_cache's dtype"),
        (dict(k_cache=torch.zeros(5, 4, 3, 3)), ValueError, "must agree"),
        (dict(k_cache=torch.zeros(1, 4, 2, 3).expand(5, 4, 2, 3)), ValueError,
         "must not share memory"),
        (dict(k_scale=0.5), ValueError, "k_scale scales an 8-bit cache"),
    ],
    ids=["past-the-pool", "negative", "repeated", "float-slots", "k-tokens", "v-dim",
         "k-dtype", "heads", "expanded-cache", "scale-of-a-float-cache"],
)
def test_append_refuses_bad_arguments_and_leaves_the_cache(change, error, match):
    args = dict(k=torch.randn(2, 2, 3), v=torch.randn(2, 2, 6), k_cache=torch.zeros(5, 4, 2, 3),
                v_cache=torch.zeros(5, 4, 2, 6), slots=torch.tensor([1, 2]), k_scale=None)
    args.update(change)
    before = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises(error, match=match):
        paged_cache_append(args["k"], args["v"], args["k_cache"], args["v_cache"], args["slots"],
                           k_scale=args["k_scale"])
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


def test_append_skips_the_padding_slot():
    """vLLM pads a batch with slot -1: that token is not written, the others are."""
    k_cache, v_cache = torch.zeros(3, 4, 2, 3), torch.zeros(3, 4, 2, 3)
    slots = torch.tensor([5, -1, 0, -1], dtype=torch.int32)
    k, v = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    paged_cache_append(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(k_cache[0, 0], k[2])
    assert torch.equal(v_cache[1, 1], v[0]) and torch.equal(v_cache[0, 0], v[2])
    assert k_cache.abs().sum() == k[[0, 2]].abs().sum()  # nothing else
    paged_cache_append(k, v, k_cache, v_cache, torch.full((4,), -1))  # all padding: no write
    assert k_cache.abs().sum() == k[[0, 2]].abs().sum()


@pytest.mark.parametrize("layout", ["interleaved", "pages-apart"])
def test_append_writes_strided_page_views_in_place(layout):
    """vLLM's interleaved kv_cache[:, 0] / kv_cache[:, 1] of a (num_pages, 2, page_size, Hkv,
    D) tensor, and a pool whose pages are not contiguous: each token lands in its slot of the
    view, and nothing else of the storage changes."""
    if layout == "interleaved":
        storage = torch.zeros(5, 2, 4, 2, 3)
        k_cache, v_cache = storage[:, 0], storage[:, 1]
    else:
        storage = torch.zeros(4, 2, 5, 2, 3)  # rows outermost: a page's rows lie apart
        k_cache, v_cache = storage[:, 0].transpose(0, 1), storage[:, 1].transpose(0, 1)
    assert not k_cache.is_contiguous()
    slots = torch.tensor([17, 0, 6, 7, 19])
    k, v = torch.randn(5, 2, 3), torch.randn(5, 2, 3)
    paged_cache_append(k, v, k_cache, v_cache, slots)
    assert_slots_hold(k_cache, v_cache, slots, k, v)
    assert storage.abs().sum() == k.abs().sum() + v.abs().sum()


# --- the cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 272])
def test_reserved_and_appended_tokens_read_back_through_the_pages(page_size):
    cache = PagedKVCache(num_pages=60, page_size=page_size, num_kv_heads=2, head_dim=4,
                         value_dim=3, num_layers=2)
    written = {r: [[], []] for r in ("a", "b")}
    for r in ("a", "b"):
        cache.allocate(r)
    for step, tokens in enumerate([5, 1, 17, 1, 0, 2]):
        for r in ("a", "b"):
            slots = cache.reserve(r, tokens)
            for layer in range(2):
                k, v = torch.randn(tokens, 2, 4), torch.randn(tokens, 2, 3)
                cache.append(layer, k, v, slots)
                written[r][layer].append((k, v))
    for r in ("a", "b"):
        assert cache.length(r) == 26
        assert len(cache.pages_of(r)) == -(-26 // page_size)
        for layer in range(2):
            keys, values = gathered(cache, r, layer)
            assert torch.equal(keys, torch.cat([k for k, _ in written[r][layer]]))
            assert torch.equal(values, torch.cat([v for _, v in written[r][layer]]))
    assert not set(cache.pages_of("a")) & set(cache.pages_of("b"))


def test_fork_shares_full_pages_and_copies_the_partial_one_on_first_write():
    cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)
    cache.allocate("prompt")
    prompt = torch.randn(6, 1, 2)
    cache.append(0, prompt, prompt, cache.reserve("prompt", 6))  # a full page and half of one
    cache.fork("prompt", "child")
    full, partial = cache.pages_of("prompt")
    assert cache.pages_of("child") == [full, partial]
    assert cache.holders(full) == cache.holders(partial) == 2
    assert cache.pages_in_use == 2

    mine = torch.randn(1, 1, 2)
    cache.append(0, mine, mine, cache.reserve("child", 1))
    child_pages = cache.pages_of("child")
    assert child_pages[0] == full and child_pages[1] != partial  # copied, then written
    assert cache.holders(full) == 2 and cache.holders(partial) == 1
    theirs = torch.randn(1, 1, 2)
    cache.append(0, theirs, theirs, cache.reserve("prompt", 1))
    assert cache.pages_of("prompt") == [full, partial]  # alone on it now: written in place
    assert torch.equal(gathered(cache, "child")[0], torch.cat([prompt, mine]))
    assert torch.equal(gathered(cache, "prompt")[0], torch.cat([prompt, theirs]))

    cache.free("prompt")
    assert cache.holders(full) == 1 and cache.holders(partial) == 0
    assert torch.equal(gathered(cache, "child")[0], torch.cat([prompt, mine]))
    cache.free("child")
    assert cache.pages_in_use == 0 and cache.free_pages == 8


def written_cache(tokens: int):
    """A 4-row-page cache holding ``tokens`` random tokens of request "a", and those tokens."""
    cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)
    cache.allocate("a")
    x = torch.randn(tokens, 1, 2)
    cache.append(0, x, -x, cache.reserve("a", tokens))
    return cache, x


@pytest.mark.parametrize("pool", [
    pytest.param({}, id="float32"),
    pytest.param(dict(dtype=torch.float8_e4m3fn), id="e4m3-token-scales"),
    pytest.param(dict(dtype=torch.int8, scales="tensor", k_scale=0.05), id="int8-tensor-scale"),
])
def test_values_in_keys_store_each_token_once_and_read_as_a_cache_of_their_own(pool):
    """MLA's latent: value_pages are views of key_pages' first value_dim features (with the
    keys' scales), the pool's bytes count the keys alone, a fork's copy on write carries both,
    and paged_attention through the views equals the same call with the values copied out."""
    layers, heads, dim, value_dim = 2, 1, 12, 8
    cache = PagedKVCache(num_pages=6, page_size=4, num_kv_heads=heads, head_dim=dim,
                         value_dim=value_dim, num_layers=layers, values_in_keys=True, **pool)
    plain = PagedKVCache(num_pages=6, page_size=4, num_kv_heads=heads, head_dim=dim,
                         num_layers=layers, **pool)
    assert cache.nbytes == plain.nbytes // 2
    for layer in range(layers):
        keys, values = cache.key_pages[layer], cache.value_pages[layer]
        assert values.data_ptr() == keys.data_ptr() and values.stride() == keys.stride()
        assert values.shape[-1] == value_dim
        assert cache.value_scales[layer] is cache.key_scales[layer]
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(9, layers, heads, dim, generator=generator)
    cache.allocate("prompt")
    slots = cache.reserve("prompt", 6)
    for layer in range(layers):
        cache.append(layer, latent[:6, layer], None, slots)
    cache.fork("prompt", "child")
    for request, rows in (("child", latent[6:8]), ("prompt", latent[8:])):
        slots = cache.reserve(request, rows.shape[0])
        for layer in range(layers):
            cache.append(layer, rows[:, layer], None, slots)
    assert cache.pages_of("child")[1] != cache.pages_of("prompt")[1]  # copied on write
    requests = ["prompt", "child"]
    written = {"prompt": torch.cat([latent[:6], latent[8:]]), "child": latent[:8]}
    for layer in range(layers):
        for r in requests:
            keys, values = dequantized(cache, slots_of(cache, r), layer)
            assert torch.equal(values, keys[..., :value_dim])
            # Every feature within half a step of what was written (float pages: exactly).
            error = (keys - written[r][:, layer]).abs()
            assert error.max() <= (0 if not pool else 2.0**-4 * written[r].abs().max()), r
        q = torch.randn(2, 1, 4, dim, generator=generator)
        table, seqlens = cache.block_table(requests), cache.seqlens(requests)
        scales = dict(k_scale=cache.key_scales[layer], v_scale=cache.value_scales[layer])
        out = ca.paged_attention(q, cache.key_pages[layer], cache.value_pages[layer], table,
                                 seqlens, **scales)
        copied = cache.value_pages[layer].contiguous()
        if isinstance(scales["v_scale"], torch.Tensor):
            scales["v_scale"] = scales["v_scale"].clone()
        expected = ca.paged_attention(q, cache.key_pages[layer], copied, table, seqlens,
                                      **scales)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("change, error, match", [
    (dict(value_dim=13), ValueError, "value_dim must be <= head_dim, got value_dim 13"),
    (dict(values_in_keys=1), TypeError, "values_in_keys must be a bool, got 1"),
    (dict(dtype=torch.int8, scales="tensor", v_scale=0.5), ValueError,
     "v_scale must not be given"),
])
def test_values_in_keys_refuses_what_it_cannot_store(change, error, match):
    arguments = dict(num_pages=2, page_size=4, num_kv_heads=1, head_dim=12, value_dim=8,
                     values_in_keys=True)
    with pytest.raises(error, match=match):
        PagedKVCache(**{**arguments, **change})
    cache = PagedKVCache(**arguments)
    cache.allocate("a")
    slots = cache.reserve("a", 1)
    with pytest.raises(ValueError, match=r"pass v=None, got a tensor of shape \(1, 1, 8\)"):
        cache.append(0, torch.ones(1, 1, 12), torch.ones(1, 1, 8), slots)


@pytest.mark.parametrize("length, pages", [(0, 0), (10, 3), (9, 3), (6, 2), (4, 1), (3, 1)],
                         ids=["to-0", "to-the-length", "inside-the-last-page",
                              "inside-an-earlier-page", "to-a-page-boundary", "across-pages"])
def test_truncate_keeps_the_first_tokens_and_frees_the_pages_past_them(length, pages):
    cache, x = written_cache(10)
    kept = cache.pages_of("a")[:pages]
    cache.truncate("a", length)
    assert cache.length("a") == length and cache.pages_of("a") == kept
    assert cache.free_pages == 8 - pages
    assert torch.equal(gathered(cache, "a")[0], x[:length])
    more = torch.randn(5, 1, 2)  # the next tokens go where the dropped ones were
    cache.append(0, more, -more, cache.reserve("a", 5))
    assert torch.equal(gathered(cache, "a")[0], torch.cat([x[:length], more]))
    assert torch.equal(gathered(cache, "a")[1], -torch.cat([x[:length], more]))


def test_truncate_of_a_forked_request_releases_shared_pages_and_copies_on_its_next_write():
    """A page the fork shares is only released by the request that truncates, never cleared
    for the other holder; a shared partly filled page it keeps is copied before it writes."""
    cache, x = written_cache(10)  # pages: 4 + 4 + 2 tokens
    cache.fork("a", "b")
    shared = cache.pages_of("a")
    cache.truncate("a", 6)
    assert cache.pages_of("a") == shared[:2] and cache.pages_of("b") == shared
    assert [cache.holders(p) for p in shared] == [2, 2, 1] and cache.free_pages == 5
    mine = torch.randn(3, 1, 2)
    cache.append(0, mine, -mine, cache.reserve("a", 3))
    assert cache.pages_of("a")[0] == shared[0] and cache.pages_of("a")[1] != shared[1]
    assert torch.equal(gathered(cache, "a")[0], torch.cat([x[:6], mine]))
    assert torch.equal(gathered(cache, "b")[0], x)  # untouched
    cache.truncate("b", 0)
    assert cache.pages_of("b") == [] and cache.holders(shared[0]) == 1
    cache.free("a")
    cache.free("b")
    assert cache.free_pages == 8


@pytest.mark.parametrize("length, error, match", [
    (11, ValueError, r"length must be in \[0, 10\].*got 11"),
    (-1, ValueError, r"length must be in \[0, 10\].*got -1"),
    (2.0, TypeError, "length must be an int, got 2.0"),
    (True, TypeError, "length must be an int, got True"),
])
def test_truncate_refuses_a_length_outside_the_request_and_changes_nothing(length, error, match):
    cache, x = written_cache(10)
    with pytest.raises(error, match=match):
        cache.truncate("a", length)
    assert cache.length("a") == 10 and cache.free_pages == 5
    with pytest.raises(KeyError, match="not allocated"):
        cache.truncate("z", 0)


def test_a_reserve_the_pool_cannot_hold_raises_and_changes_nothing():
    cache = PagedKVCache(num_pages=3, page_size=4, num_kv_heads=1, head_dim=2)
    cache.allocate("a")
    cache.reserve("a", 6)
    cache.fork("a", "b")
    with pytest.raises(RuntimeError, match="need 3 free pages, 1 of 3 are free"):
        cache.reserve("b", 7)  # a copy of the shared partial page and two more
    assert cache.length("b") == 6 and cache.pages_of("b") == cache.pages_of("a")
    assert cache.free_pages == 1


def test_a_step_after_a_fork_counts_one_copy_of_the_shared_page_not_one_per_holder():
    """The first writer of a shared partly filled page copies it; the page's last holder then
    holds it alone and writes in place: a step of every holder takes holders - 1 copies, as
    reserving the same tokens one request at a time does."""
    cache = PagedKVCache(num_pages=3, page_size=4, num_kv_heads=1, head_dim=2)
    cache.allocate("p")
    cache.reserve("p", 6)  # a full page and half of one
    cache.fork("p", "c")
    step = cache.step(["p", "c"], [1, 1])  # one free page: the copy
    assert cache.free_pages == 0
    assert step.seqlens.tolist() == [7, 7]
    assert cache.pages_of("p")[1] != cache.pages_of("c")[1]
    cache.free("c")  # p: 7 tokens, one page free
    cache.fork("p", "c")
    cache.fork("p", "d")
    with pytest.raises(RuntimeError, match="needs 2 free pages, 1 of 3 are free"):
        cache.step(["p", "c", "d"], [1, 1, 1])  # three holders: two copies
    assert cache.holders(cache.pages_of("p")[1]) == 3 and cache.free_pages == 1


def test_bad_calls_name_what_is_wrong():
    cache = PagedKVCache(num_pages=2, page_size=4, num_kv_heads=1, head_dim=2)
    cache.allocate("a")
    with pytest.raises(ValueError, match="already allocated"):
        cache.allocate("a")
    with pytest.raises(ValueError, match="already allocated"):
        cache.fork("a", "a")
    with pytest.raises(KeyError, match="'z' is not allocated"):
        cache.reserve("z", 1)
    with pytest.raises(ValueError, match="tokens must be an int >= 0"):
        cache.reserve("a", -1)
    with pytest.raises(ValueError, match="width 0 is less than the 1 pages"):
        cache.reserve("a", 1)
        cache.block_table(["a"], width=0)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        PagedKVCache(num_pages=2, page_size=0, num_kv_heads=1, head_dim=2)
    with pytest.raises(TypeError, match="num_pages must be an int"):
        PagedKVCache(num_pages=2.0, page_size=4, num_kv_heads=1, head_dim=2)


def test_append_refuses_a_layer_outside_the_cache():
    """A layer of -1 would write the last layer's pages (Python's indexing), one past the last
    a bare IndexError: both are a ValueError naming layer, the pages untouched."""
    cache = PagedKVCache(num_pages=2, page_size=4, num_kv_heads=1, head_dim=2, num_layers=2)
    cache.allocate("a")
    slots = cache.reserve("a", 1)
    k = torch.ones(1, 1, 2)
    for layer in (-1, 2):
        with pytest.raises(ValueError, match=rf"layer must be in \[0, 2\).*got {layer}"):
            cache.append(layer, k, k, slots)
    with pytest.raises(TypeError, match="layer must be an int, got 1.0"):
        cache.append(1.0, k, k, slots)
    assert all(p.abs().sum() == 0 for p in cache.key_pages + cache.value_pages)


def runs(pages):
    """The stretches of consecutive pages a request's pages make."""
    return 1 + sum(b != a + 1 for a, b in zip(pages, pages[1:]))


def test_a_request_growing_alone_holds_its_pages_in_order():
    cache = PagedKVCache(num_pages=32, page_size=4, num_kv_heads=1, head_dim=1)
    cache.allocate("a")
    for _ in range(50):
        cache.reserve("a", 1)
    assert cache.pages_of("a") == list(range(13))


def test_requests_decoding_together_each_grow_into_a_stretch_of_their_own():
    """Four requests taking a token each in turn (as decodes do): each takes its next page
    right after its last, in a stretch of the pool of its own; a pool that handed out free pages
    in any fixed order would interleave them."""
    cache = PagedKVCache(num_pages=256, page_size=4, num_kv_heads=1, head_dim=1)
    requests = ["a", "b", "c", "d"]
    for r in requests:
        cache.allocate(r)
    for _ in range(200):
        cache.step(requests, [1] * 4)
    assert [runs(cache.pages_of(r)) for r in requests] == [1, 1, 1, 1]
    assert [cache.pages_of(r)[0] for r in requests] == [0, 128, 64, 192]


def test_a_request_meeting_a_taken_page_goes_on_in_the_middle_of_the_longest_free_stretch():
    cache = PagedKVCache(num_pages=16, page_size=1, num_kv_heads=1, head_dim=1)
    for r in "abc":
        cache.allocate(r)
    cache.reserve("a", 3)
    cache.reserve("b", 1)  # free: 3-15, the middle 9
    cache.reserve("c", 1)  # free: 3-8 and 10-15, the first's middle 6
    cache.reserve("a", 4)  # 3, 4, 5, then 6 is c's: free 7-8 and 10-15
    assert [cache.pages_of(r) for r in "abc"] == [[0, 1, 2, 3, 4, 5, 13], [9], [6]]
    cache.free("a")
    cache.allocate("d")
    cache.reserve("d", 2)  # free: 0-5, 7-8 and 10-15 (13 is back); the first longest: 0-5
    assert cache.pages_of("d") == [0, 1]


def dequantized(cache: PagedKVCache, slots, layer: int = 0):
    """The keys and values in ``slots`` as paged_attention reads them: float32, 8-bit pages
    times their scales (per token or per tensor)."""
    page, row = slots // cache.page_size, slots % cache.page_size
    read = []
    for stored, scale in ((cache.key_pages[layer], cache.key_scales[layer]),
                          (cache.value_pages[layer], cache.value_scales[layer])):
        rows = stored[page, row].float()
        if isinstance(scale, torch.Tensor):
            rows = rows * scale[page, row, :, None]
        elif scale is not None:
            rows = rows * torch.tensor(scale, dtype=torch.float32)
        read.append(rows)
    return read


def slots_of(cache: PagedKVCache, request):
    """The slots of the request's tokens, in order."""
    positions = torch.arange(cache.length(request))
    table = torch.tensor(cache.pages_of(request), dtype=torch.long)
    return table[positions // cache.page_size] * cache.page_size + positions % cache.page_size


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param({}, id="float32"),
        pytest.param(dict(dtype=torch.float8_e4m3fn), id="e4m3-token-scales"),
        pytest.param(dict(dtype=torch.int8, scales="token"), id="int8-token-scales"),
        pytest.param(dict(dtype=torch.float8_e5m2, scales="tensor", k_scale=0.5, v_scale=2.0),
                     id="e5m2-tensor-scales"),
        pytest.param(dict(value_dim=2, values_in_keys=True), id="float32-values-in-keys"),
        pytest.param(dict(dtype=torch.int8, value_dim=2, values_in_keys=True),
                     id="int8-token-scales-values-in-keys"),
    ],
)
def test_ten_thousand_random_operations_leak_no_page_and_share_none_wrongly(pool):
    """Requests come, grow, fork, shrink (truncate) and go at random; after every operation each
    page's holder count is the number of requests listing it, the free pages are exactly the
    pages nobody holds, and (every 50 operations, and at the end) every request reads back its
    own tokens.
    With 8-bit pages a token reads back as it read right after its write (stored x scale): the
    per-token scales go with their pages through forks, copies on write and frees; and (every
    1000 operations, and at the end) paged_attention through the pages equals a float64
    reference on those dequantized keys and values. (The holder counts, which the pages' dtype
    does not enter, are checked after every operation in float32, every 50 with 8-bit pages:
    a few seconds each.) A cache of values in keys (MLA's latent) reads each token's values as
    its keys' first features, through the same forks, copies and frees."""
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    pages, page_size, heads, dim = 64, 5, 2, 3
    cache = PagedKVCache(num_pages=pages, page_size=page_size, num_kv_heads=heads, head_dim=dim,
                         **pool)
    expected = {}  # request -> its tokens' (keys, values) as read back, a pair per append
    next_request = 0

    def check_pages():
        listed = [0] * pages
        for r in cache.requests:
            for p in cache.pages_of(r):
                listed[p] += 1
            assert len(cache.pages_of(r)) == -(-cache.length(r) // page_size)
        assert [cache.holders(p) for p in range(pages)] == listed
        assert cache.free_pages == listed.count(0)
        assert list(cache._is_free) == [int(n == 0) for n in listed]

    def check_tokens():
        for r, appended in expected.items():
            keys, values = dequantized(cache, slots_of(cache, r))
            assert sum(k.shape[0] for k, _ in appended) == keys.shape[0], r
            if appended:
                assert torch.equal(keys, torch.cat([k for k, _ in appended])), r
                assert torch.equal(values, torch.cat([v for _, v in appended])), r

    def check_attention():
        requests = [r for r, tokens in expected.items() if tokens]
        if not requests:
            return
        q = torch.randn(len(requests), 1, 2 * heads, dim, generator=generator)
        out = ca.paged_attention(q, cache.key_pages[0], cache.value_pages[0],
                                 cache.block_table(requests), cache.seqlens(requests),
                                 k_scale=cache.key_scales[0], v_scale=cache.value_scales[0])
        for i, r in enumerate(requests):
            keys, values = (torch.cat(t).double().transpose(0, 1)[None]
                            for t in zip(*expected[r]))
            ref = attention(q[i].double().transpose(0, 1)[None], keys, values)[0].transpose(0, 1)
            torch.testing.assert_close(out[i].double(), ref, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"request {r}: {m}")

    for step in range(10_000):
        roll = rng.random()
        if roll < 0.15 or not expected:
            cache.allocate(next_request)
            expected[next_request] = []
            next_request += 1
        elif roll < 0.25:
            parent = rng.choice(list(expected))
            cache.fork(parent, next_request)
            expected[next_request] = list(expected[parent])
            next_request += 1
        elif roll < 0.45:
            r = rng.choice(list(expected))
            cache.free(r)
            del expected[r]
        elif roll < 0.55:
            r = rng.choice(list(expected))
            length = rng.randint(0, cache.length(r))
            cache.truncate(r, length)
            if expected[r]:
                keys, values = (torch.cat(t)[:length] for t in zip(*expected[r]))
                expected[r] = [(keys, values)]
        else:
            r = rng.choice(list(expected))
            tokens = rng.choice([1, 1, 1, 2, 4, 7])
            try:
                slots = cache.reserve(r, tokens)
            except RuntimeError:
                assert cache.length(r) == sum(k.shape[0] for k, _ in expected[r])
                check_pages()
                continue
            # Tokens of different magnitudes: a scale read with another token's rows shows.
            magnitude = torch.exp2(torch.randint(-3, 4, (tokens, 1, 1), generator=generator))
            k = torch.randn(tokens, heads, dim, generator=generator) * magnitude
            v = torch.randn(tokens, heads, dim, generator=generator) * magnitude
            if pool.get("values_in_keys"):
                v = None
            cache.append(0, k, v, slots)
            keys, values = dequantized(cache, slots)
            if v is None:  # the keys' first features, stored once
                assert torch.equal(values, keys[..., :values.shape[-1]])
            written = ((keys, k),) if v is None else ((keys, k), (values, v))
            if "dtype" not in pool:
                assert all(torch.equal(read, x) for read, x in written)
            else:  # within half the format's step (e5m2's 2 mantissa bits: 1/8) of each row
                for read, x in written:
                    assert ((read - x).abs() <= x.abs().amax(-1, keepdim=True) / 8).all()
            expected[r] += [(keys, values)]
        if "dtype" not in pool or step % 50 == 0:
            check_pages()
        if step % 50 == 0:
            check_tokens()
        if step % 1000 == 0:
            check_attention()
    check_tokens()
    check_attention()
    for r in list(expected):
        cache.free(r)
    assert cache.pages_in_use == 0 and cache.free_pages == pages


def assert_accounts_as(cache: PagedKVCache, model: ReferencePool):
    """The cache's requests, lengths, free pages and holder counts are the model's, its pages
    map one to one onto the model's, and every request reads its own tokens through its pages
    (every layer's keys and values) and through block_table and seqlens."""
    assert sorted(cache.requests) == sorted(model.tokens)
    assert cache.free_pages == model.free_pages
    ids = {}  # the cache's page -> the model's
    for r, pages in model.pages.items():
        assert cache.length(r) == len(model.tokens[r]), r
        assert len(cache.pages_of(r)) == len(pages), r
        for page, page_id in zip(cache.pages_of(r), pages):
            assert ids.setdefault(page, page_id) == page_id, (r, page)
    assert len(set(ids.values())) == len(ids)
    assert [cache.holders(p) for p in range(cache.num_pages)] == [
        model.holders[ids[p]] if p in ids else 0 for p in range(cache.num_pages)]
    pools = [(k.view(-1).tolist(), v.view(-1).tolist())
             for k, v in zip(cache.key_pages, cache.value_pages)]
    size = cache.page_size
    for r, tokens in model.tokens.items():
        pages = cache.pages_of(r)
        slots = [pages[i // size] * size + i % size for i in range(len(tokens))]
        for layer, (keys, values) in enumerate(pools):
            assert [keys[s] for s in slots] == [t + layer for t in tokens], (r, layer)
            assert [values[s] for s in slots] == [-t - layer for t in tokens], (r, layer)
    requests = list(model.tokens)
    table = cache.block_table(requests).tolist()
    assert [row[:len(model.pages[r])] for r, row in zip(requests, table)] == [
        cache.pages_of(r) for r in requests]
    assert cache.seqlens(requests).tolist() == [len(model.tokens[r]) for r in requests]


def test_ten_thousand_random_operations_account_as_a_reference_model():
    """allocate, fork, free, truncate, reserve and step (several requests at once, forks among
    them) at random on a small pool, each reserved token appended to every layer: after every
    operation the cache accounts as ReferencePool (free pages, lengths, holder counts, each
    request's tokens read back), and it refuses a reserve or step exactly when the model says
    the pool cannot hold it, changing nothing."""
    rng = random.Random(0)
    cache = PagedKVCache(num_pages=24, page_size=3, num_kv_heads=1, head_dim=1, num_layers=2,
                         dtype=torch.float64)
    model = ReferencePool(num_pages=24, page_size=3)
    next_request, next_token = 0, 0
    for _ in range(10_000):
        roll = rng.random()
        if roll < 0.08 or not model.tokens:
            cache.allocate(next_request)
            model.allocate(next_request)
            next_request += 1
        elif roll < 0.2:
            parent = rng.choice(list(model.tokens))
            cache.fork(parent, next_request)
            model.fork(parent, next_request)
            next_request += 1
        elif roll < 0.4:
            r = rng.choice(list(model.tokens))
            cache.free(r)
            model.free(r)
        elif roll < 0.5:
            r = rng.choice(list(model.tokens))
            length = rng.randint(0, len(model.tokens[r]))
            cache.truncate(r, length)
            model.truncate(r, length)
        else:
            alone = roll < 0.65
            chosen = rng.sample(list(model.tokens), 1 if alone else min(len(model.tokens), 4))
            writes = {}
            for r in chosen:
                count = rng.choice([0, 1, 1, 1, 2, 5])
                writes[r] = [float(t) for t in range(next_token, next_token + count)]
                next_token += count
            needed = model.pages_needed(writes)
            try:
                if alone:
                    [(r, values)] = writes.items()
                    slots = cache.reserve(r, len(values))
                else:
                    step = cache.step(list(writes), [len(t) for t in writes.values()])
                    slots = step.slot_mapping
            except RuntimeError:
                assert needed > model.free_pages, (writes, needed, model.free_pages)
            else:
                assert needed <= model.free_pages, (writes, needed, model.free_pages)
                for r, values in writes.items():
                    model.write(r, values)
                new = torch.tensor([t for values in writes.values() for t in values],
                                   dtype=torch.float64).view(-1, 1, 1)
                for layer in range(2):
                    cache.append(layer, new + layer, -new - layer, slots)
        assert_accounts_as(cache, model)
    for r in list(model.tokens):
        cache.free(r)
    assert cache.free_pages == cache.num_pages


def test_flash_attn_with_kvcache_reads_the_pages_as_the_contiguous_keys():
    """A batch decoding one token each from the cache's pages (block_table, cache_seqlens)
    attends as the op does on each request's keys laid out contiguously."""
    hq, hkv, d = 4, 2, 8
    cache = PagedKVCache(num_pages=30, page_size=16, num_kv_heads=hkv, head_dim=d)
    lengths = {"a": 37, "b": 5, "c": 64}
    for r, n in lengths.items():
        cache.allocate(r)
        cache.append(0, torch.randn(n, hkv, d), torch.randn(n, hkv, d), cache.reserve(r, n))
    cache.fork("a", "a2")
    requests = list(lengths) + ["a2"]
    q = torch.randn(len(requests), 1, hq, d)
    q[3] = q[0]  # the fork asks what its parent asks
    out = flash_attn_with_kvcache(q, cache.key_pages[0], cache.value_pages[0],
                                  cache_seqlens=cache.seqlens(requests),
                                  block_table=cache.block_table(requests), causal=True)
    for i, r in enumerate(requests):
        keys, values = gathered(cache, r)
        ref = attention(q[i].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                        values.transpose(0, 1)[None])
        torch.testing.assert_close(out[i], ref[0].transpose(0, 1))
    assert torch.equal(out[0], out[3])  # the fork reads the same pages


# --- serving through the module ---------------------------------------------------------------


def test_the_module_decodes_from_pages_as_from_the_whole_sequence():
    """Three requests prefill prompts of different lengths in one step, one forks, then all
    decode token by token, every step one forward_paged call: each request's outputs are the
    module's on its whole sequence (GQA, window, softcap, sinks, ALiBi)."""
    torch.manual_seed(0)
    module = CausalSelfAttention(32, 4, num_kv_heads=2, window=(6, 0), softcap=20.0, sinks=True,
                                 alibi=True, dtype=torch.float64).eval()
    cache = module.make_paged_cache(num_pages=40, page_size=4)
    prompts = {"a": 9, "b": 1, "c": 14}
    inputs = {r: torch.randn(n, 32, dtype=torch.float64) for r, n in prompts.items()}
    outputs = {r: [] for r in prompts}
    for r in prompts:
        cache.allocate(r)
    step = cache.step(list(prompts), list(prompts.values()))
    out = module.forward_paged(torch.cat([inputs[r] for r in prompts]), step)
    for i, r in enumerate(prompts):
        outputs[r].append(out[step.cu_seqlens_q[i]:step.cu_seqlens_q[i + 1]])
    cache.fork("a", "a2")
    inputs["a2"], outputs["a2"] = inputs["a"].clone(), [outputs["a"][0]]
    for _ in range(5):
        requests = list(inputs)
        new = {r: torch.randn(1, 32, dtype=torch.float64) for r in requests}
        step = cache.step(requests, [1] * len(requests))
        out = module.forward_paged(torch.cat([new[r] for r in requests]), step)
        for i, r in enumerate(requests):
            inputs[r] = torch.cat([inputs[r], new[r]])
            outputs[r].append(out[i:i + 1])
    with torch.no_grad():
        for r, x in inputs.items():
            whole = module(x[None])[0]
            torch.testing.assert_close(torch.cat(outputs[r]), whole, rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"request {r}: {m}")
    assert cache.length("a2") == cache.length("a") == 14
    assert cache.pages_of("a")[:2] == cache.pages_of("a2")[:2]  # the prompt's full pages shared


def test_a_step_the_pool_cannot_hold_changes_nothing():
    module = CausalSelfAttention(16, 2)
    cache = module.make_paged_cache(num_pages=3, page_size=4)
    cache.allocate("a")
    cache.allocate("b")
    with pytest.raises(RuntimeError, match="needs 4 free pages, 3 of 3"):
        cache.step(["a", "b"], [8, 5])
    assert cache.length("a") == cache.length("b") == 0 and cache.free_pages == 3
    with pytest.raises(ValueError, match="each request once"):
        cache.step(["a", "a"], [1, 1])
    step = cache.step(["a", "b"], [1, 2])
    with pytest.raises(ValueError, match="x has 2 tokens, the step reserved 3"):
        module.forward_paged(torch.randn(2, 16), step)


def test_gpt_greedy_tokens_from_pages_equal_each_request_generated_alone():
    """Continuous batching: requests join (prefill in the same step as others' decodes) and
    leave, one GPT.forward_paged call a step; each request's greedy tokens are
    GPT.generate's for it alone."""
    from causal_attention.models import GPT

    torch.manual_seed(0)
    model = GPT(50, 64, 32, 4, 2, num_kv_heads=2).double().eval()
    cache = model.make_paged_cache(num_pages=64, page_size=8)
    queue = [(torch.randint(0, 50, (n,)), new) for n, new in [(5, 6), (11, 3), (1, 8), (7, 4)]]
    generated = {}
    running = {}  # request -> (tokens so far, tokens still to generate)
    pending = list(enumerate(queue))
    with torch.no_grad():
        while pending or running:
            requests, counts, feed = [], [], []
            if pending and len(running) < 3:  # admit one request a step
                r, (prompt, new) = pending.pop(0)
                cache.allocate(r)
                running[r] = (prompt, new)
                requests.append(r)
                counts.append(prompt.numel())
                feed.append(prompt)
            for r, (tokens, left) in running.items():
                if r not in requests:
                    requests.append(r)
                    counts.append(1)
                    feed.append(tokens[-1:])
            step = cache.step(requests, counts)
            logits = model.forward_paged(torch.cat(feed), step)
            for i, r in enumerate(requests):
                tokens, left = running[r]
                token = logits[step.cu_seqlens_q[i + 1] - 1].argmax().view(1)
                running[r] = (torch.cat([tokens, token]), left - 1)
                if left == 1:
                    generated[r] = running.pop(r)[0]
                    cache.free(r)
        for r, (prompt, new) in enumerate(queue):
            alone = model.generate(prompt[None], new, temperature=0)[0]
            assert torch.equal(generated[r], alone), r
    assert cache.pages_in_use == 0


def graph_size(t: torch.Tensor) -> int:
    """The autograd nodes ``t`` reaches (0 without a graph)."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [next_node for next_node, _ in node.next_functions]
    return len(seen)


def test_serving_in_grad_mode_records_nothing_into_the_pages():
    """A serving loop written without torch.no_grad(): the pages take the keys and values, not
    their autograd history, so a step's graph is the same size at step 200 as at step 1 (were the
    pages part of it, each step's graph would hold every earlier one's) and the pages hold none."""
    from causal_attention.models import GPT

    torch.manual_seed(0)
    model = GPT(50, 256, 32, 4, 2, num_kv_heads=2)
    cache = model.make_paged_cache(num_pages=64, page_size=4)
    cache.allocate("a")
    token = torch.tensor([1])
    sizes = []
    for _ in range(200):
        logits = model.forward_paged(token, cache.step(["a"], [1]))
        sizes.append(graph_size(logits))
        token = logits.argmax(-1)
    assert logits.requires_grad  # grad mode, as the loop runs it
    assert sizes[-1] == sizes[0], (sizes[0], sizes[-1])
    for pages in cache.key_pages + cache.value_pages:
        assert not pages.requires_grad and pages.grad_fn is None
