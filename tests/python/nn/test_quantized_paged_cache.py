"""8-bit paged KV caches (float8_e4m3fn, float8_e5m2, int8): paged_cache_append quantizes as a
reference written here from the formats' tables does (nearest value, ties to even, saturating),
with scales given per tensor or computed per token and KV head; it skips the padding slot -1,
refuses non-finite values and bad scales with typed errors naming them, leaving the cache as it
was, and writes strided page views. PagedKVCache keeps 8-bit pages and their scales through 10k
random operations (fork, copy on write, free), paged_attention through them equals a float64
reference on the dequantized keys and values, and the module and the GPT decode from them
within the quantization's error of a float cache."""

import math

import pytest
import torch

import causal_attention as ca
from causal_attention import CausalSelfAttention, PagedKVCache, paged_cache_append
from causal_attention.quantization import FORMAT_MAX

EIGHT_BIT = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.int8: "int8"}


# --- a reference quantizer: the nearest entry of the format's table ---------------------------


def table(dtype):
    """The format's finite values (float64) and their codes (the byte, for float8: its lowest
    bit is the mantissa's; the integer, for int8), int8 symmetric in [-127, 127]."""
    if dtype == torch.int8:
        codes = torch.arange(-127, 128)
        return codes.double(), codes
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).double()
    finite = torch.isfinite(values)
    return values[finite], codes[finite].long()


def reference_quantize(x, dtype):
    """The value of ``dtype`` nearest each entry of float32 ``x`` (ties: the even code), as
    float64: saturating, since the table's ends are the nearest to anything beyond them. (``x``
    is clamped to twice the range first: that changes no entry's nearest value, and keeps
    float64's distances exact.)"""
    values, codes = table(dtype)
    limit = 2 * values.max().item()
    flat = x.double().clamp(-limit, limit).reshape(-1, 1)
    distance = (flat - values).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values
    pick = (nearest.long() * 2 + (codes % 2 == 0).long()).argmax(dim=1)
    return values[pick].reshape(x.shape)


def reference_token_scales(x, dtype):
    """A token's scale per KV head: its largest |x| over D / the format's largest (float32, as
    float64 division rounded once), 1 for a row of zeros."""
    amax = x.double().abs().amax(dim=-1)
    scale = (amax / FORMAT_MAX[dtype]).float()
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def stored(cache):
    """An 8-bit cache's stored values as float64 (no scale)."""
    return cache.double()


def assert_quantized(got, x, scale, dtype):
    """``got`` (the stored values) is the reference quantization of ``x / scale`` (float32)."""
    expected = reference_quantize(x.float() / scale, dtype)
    mismatch = (stored(got) != expected).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.shape[0]} values differ, first at {mismatch[0].tolist()}: x="
        f"{x[tuple(mismatch[0])].item()!r}, stored {stored(got)[tuple(mismatch[0])].item()}, "
        f"expected {expected[tuple(mismatch[0])].item()}")


def awkward_values(dtype, shape, generator):
    """Values across the format's range at scale 1: normal draws at magnitudes from its
    smallest subnormals to past its largest value (which saturate), exact ties between
    neighbouring values of the table, zeros and signs."""
    values, _ = table(dtype)
    finite = values[values > 0].float()
    count = math.prod(shape)
    magnitude = torch.exp2(torch.empty(count).uniform_(
        math.log2(finite.min()) - 1, math.log2(FORMAT_MAX[dtype]) + 3, generator=generator))
    x = torch.randn(count, generator=generator) * magnitude
    ties = (finite[1:] + finite[:-1]) / 2  # exact in float32
    pick = torch.randint(0, ties.numel(), (count // 4,), generator=generator)
    x[: count // 4] = ties[pick] * torch.where(torch.rand(count // 4, generator=generator) < .5,
                                               -1.0, 1.0)
    x[count // 4: count // 4 + 4] = torch.tensor([0.0, -0.0, 1e30, -1e30])
    return x[torch.randperm(count, generator=generator)].view(shape)


# --- paged_cache_append into 8-bit caches -----------------------------------------------------


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=NAMES.get)
@pytest.mark.parametrize("scale", [1.0, 0.25, torch.tensor([2.0], dtype=torch.float64)],
                         ids=["scale-1", "scale-0.25", "one-element-tensor"])
def test_append_with_a_given_scale_rounds_to_nearest_even_and_saturates(dtype, scale):
    """Given per-tensor scales (powers of two: the division is exact, so the ties stay ties)
    store each value / scale as its nearest value in the format, ties to even, and values past
    the range as its largest; the scale stays as it was given."""
    g = torch.Generator().manual_seed(1)
    pages, page_size, heads, dim = 6, 4, 2, 16
    k_cache = torch.zeros(pages, page_size, heads, dim, dtype=dtype)
    v_cache = torch.zeros(pages, page_size, heads, dim, dtype=dtype)
    factor = float(scale)
    k = awkward_values(dtype, (pages * page_size, heads, dim), g) * factor
    v = awkward_values(dtype, (pages * page_size, heads, dim), g) * factor
    slots = torch.randperm(pages * page_size, generator=g)
    paged_cache_append(k, v, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
    order = slots.argsort()  # slot s holds token order[s]
    assert_quantized(k_cache.flatten(0, 1), k[order], factor, dtype)
    assert_quantized(v_cache.flatten(0, 1), v[order], factor, dtype)
    limit = FORMAT_MAX[dtype]
    assert stored(k_cache).abs().max() == limit  # the 1e30s saturated, not NaN or inf
    assert torch.isfinite(stored(k_cache)).all() and torch.isfinite(stored(v_cache)).all()


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=NAMES.get)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_append_with_per_token_scales_computes_and_writes_them(dtype, x_dtype):
    """Scale tensors of the pool's shape take each written token's scale per KV head (its
    largest |value| over D / the format's largest, 1 for a row of zeros) at its slot, the other
    slots' scales untouched, and the values stored with them; dequantized, each value is within
    the format's half step of the token's largest."""
    g = torch.Generator().manual_seed(2)
    pages, page_size, heads, dim = 5, 3, 2, 8
    k_cache = torch.zeros(pages, page_size, heads, dim, dtype=dtype)
    v_cache = torch.zeros(pages, page_size, heads, dim + 2, dtype=dtype)
    k_scale = torch.full((pages, page_size, heads), 7.0)
    v_scale = torch.full((pages, page_size, heads), 7.0)
    tokens = 9
    # Tokens of very different magnitudes, one head of one token all zeros.
    magnitude = torch.exp2(torch.randint(-12, 12, (tokens, heads, 1), generator=g).float())
    k = (torch.randn(tokens, heads, dim, generator=g) * magnitude).to(x_dtype)
    v = (torch.randn(tokens, heads, dim + 2, generator=g) * magnitude).to(x_dtype)
    k[3, 1] = 0
    slots = torch.randperm(pages * page_size, generator=g)[:tokens]
    paged_cache_append(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    page, row = slots // page_size, slots % page_size
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        expected = reference_token_scales(x, dtype)
        assert torch.equal(scales[page, row], expected)
        untouched = torch.ones(pages * page_size, dtype=torch.bool)
        untouched[slots] = False
        assert (scales.flatten(0, 1)[untouched] == 7).all()
        assert_quantized(cache[page, row], x, expected.unsqueeze(-1), dtype)
        # The largest of each row stores as the format's largest (but the zero row's).
        top = stored(cache[page, row]).abs().amax(-1)
        assert torch.equal(top == FORMAT_MAX[dtype], x.abs().amax(-1) > 0)
    assert torch.equal(k_scale[page[3], row[3], 1], torch.tensor(1.0))  # the zero row
    assert (stored(k_cache[page[3], row[3], 1]) == 0).all()


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=NAMES.get)
def test_per_token_quantization_error_is_the_formats_half_step(dtype):
    """Dequantized (stored x scale), a token's values lie within half the format's step below
    its largest value, relative to the row's largest |value|: 16/448 for e4m3, 4096/57344 for
    e5m2, 0.5/127 for int8; the error measured on normal draws comes near those bounds."""
    x = torch.randn(4096, 2, 64)
    k_cache = torch.zeros(1024, 4, 2, 64, dtype=dtype)
    k_scale, v_scale = torch.ones(1024, 4, 2), torch.ones(1024, 4, 2)
    paged_cache_append(x, x, k_cache, k_cache.clone(), torch.arange(4096), k_scale=k_scale,
                       v_scale=v_scale)
    error = (k_cache.flatten(0, 1).float() * k_scale.flatten(0, 1)[..., None] - x).abs()
    relative = (error / x.abs().amax(-1, keepdim=True)).max().item()
    top = table(dtype)[0].sort().values
    bound = (top[-1] - top[-2]).item() / 2 / FORMAT_MAX[dtype]
    assert bound / 2 < relative <= bound * (1 + 1e-5)


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=NAMES.get)
def test_append_skips_the_padding_slot_of_an_eight_bit_cache(dtype):
    """Slot -1 is vLLM's padding: its token is neither quantized nor written, nor its scale,
    and may hold anything (NaN included)."""
    k_cache, v_cache = torch.zeros(2, 4, 1, 4, dtype=dtype), torch.zeros(2, 4, 1, 4, dtype=dtype)
    k_scale, v_scale = torch.ones(2, 4, 1), torch.ones(2, 4, 1)
    k, v = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    k[1] = float("nan")
    paged_cache_append(k, v, k_cache, v_cache, torch.tensor([6, -1, 1]), k_scale=k_scale,
                       v_scale=v_scale)
    written = torch.zeros(8, dtype=torch.bool)
    written[[6, 1]] = True
    assert (stored(k_cache).flatten(0, 1)[~written] == 0).all()
    assert (k_scale.flatten(0, 1)[~written] == 1).all()
    assert_quantized(k_cache[1, 2], k[0], k_scale[1, 2, :, None], dtype)
    assert_quantized(v_cache[0, 1], v[2], v_scale[0, 1, :, None], dtype)


def eight_bit_arguments(dtype=torch.float8_e4m3fn):
    return dict(k=torch.randn(3, 2, 4), v=torch.randn(3, 2, 5),
                k_cache=torch.zeros(4, 2, 2, 4, dtype=dtype),
                v_cache=torch.zeros(4, 2, 2, 5, dtype=dtype), slots=torch.tensor([0, 5, 2]),
                k_scale=torch.ones(4, 2, 2), v_scale=0.5)


def nan_at(shape, index, value=float("nan")):
    x = torch.randn(shape)
    x[index] = value
    return x


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(k=nan_at((3, 2, 4), (1, 0, 3))), ValueError,
         r"k must be finite .* got nan at k\[1\]\[0\]\[3\]"),
        (dict(v=nan_at((3, 2, 5), (2, 1, 0), float("inf"))), ValueError,
         r"v must be finite .* got inf at v\[2\]\[1\]\[0\]"),
        (dict(k=nan_at((3, 2, 4), (0, 0, 0), -float("inf"))), ValueError, "k must be finite"),
        (dict(k_scale=torch.ones(4, 2)), ValueError,
         r"k_scale must be one scale per tensor .*=\(4, 2, 2\), got k_scale.shape=\(4, 2\)"),
        (dict(v_scale=torch.ones(2)), ValueError, r"v_scale .* got v_scale.shape=\(2,\)"),
        (dict(k_scale=torch.ones(4, 2, 2, dtype=torch.float64)), TypeError,
         "k_scale .*must be float32, got k_scale.dtype=torch.float64"),
        (dict(v_scale=torch.tensor(2)), TypeError, "v_scale .*must be floating"),
        (dict(v_scale="0.5"), TypeError, "v_scale must be a float or a tensor"),
        (dict(v_scale=True), TypeError, "v_scale must be a float or a tensor"),
        (dict(v_scale=-0.5), ValueError, "v_scale must be positive and finite"),
        (dict(v_scale=0.0), ValueError, "v_scale must be positive and finite"),
        (dict(k_scale=torch.tensor(0.0)), ValueError, "k_scale must be positive and finite"),
        (dict(v_scale=float("inf")), ValueError, "v_scale must be positive and finite"),
        (dict(v_scale=float("nan")), ValueError, "v_scale must be positive and finite"),
        (dict(v_scale=1e-50), ValueError, r"v_scale must be positive and finite \(in float32"),
        (dict(v_scale=1e39), ValueError, r"v_scale must be positive and finite \(in float32"),
        (dict(k_scale=torch.ones(1, 2, 2).expand(4, 2, 2)), ValueError,
         "k_scale is written one scale per slot"),
        (dict(k=torch.randint(0, 3, (3, 2, 4))), TypeError, "k must be floating"),
        (dict(slots=torch.tensor([0, 5, 5])), ValueError, "distinct"),
        (dict(slots=torch.tensor([0, -2, 1])), ValueError, r"\[0, 8\)"),
    ],
    ids=["k-nan", "v-inf", "k-minus-inf", "k-scale-shape", "v-scale-shape", "k-scale-dtype",
         "v-scale-int", "v-scale-str", "v-scale-bool", "v-scale-negative", "v-scale-zero",
         "k-scale-zero-tensor", "v-scale-inf", "v-scale-nan", "v-scale-underflows",
         "v-scale-overflows", "k-scale-expanded", "k-int", "repeated-slot", "negative-slot"],
)
def test_eight_bit_append_refuses_bad_arguments_and_leaves_the_cache(change, error, match):
    args = eight_bit_arguments()
    args.update(change)
    before = [t.clone() for t in (args["k_cache"], args["v_cache"])]
    scales = [s.clone() for s in (args["k_scale"], args["v_scale"]) if isinstance(s, torch.Tensor)]
    with pytest.raises(error, match=match):
        paged_cache_append(args["k"], args["v"], args["k_cache"], args["v_cache"], args["slots"],
                           k_scale=args["k_scale"], v_scale=args["v_scale"])
    after = [args["k_cache"], args["v_cache"]]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(after, before))
    after = [s for s in (args["k_scale"], args["v_scale"]) if isinstance(s, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, scales))


def test_the_bad_argument_cases_are_accepted_when_right():
    """The refusals above are of their one change: the base arguments are written."""
    args = eight_bit_arguments()
    paged_cache_append(args["k"], args["v"], args["k_cache"], args["v_cache"], args["slots"],
                       k_scale=args["k_scale"], v_scale=args["v_scale"])
    assert_quantized(args["v_cache"].flatten(0, 1)[[0, 5, 2]], args["v"], 0.5,
                     torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=NAMES.get)
def test_append_writes_vllms_interleaved_eight_bit_pages(dtype):
    """vLLM's kv_cache (num_pages, 2, page_size, Hkv, D): kv_cache[:, 0] and kv_cache[:, 1],
    strided views, take the same bytes a contiguous cache does, with per-token scales in
    strided views too, and paged_attention reads them in place as it reads the contiguous
    ones."""
    pages, page_size, heads, dim = 6, 4, 2, 8
    kv_cache = torch.zeros(pages, 2, page_size, heads, dim, dtype=dtype)
    scales = torch.ones(pages, 2, page_size, heads)
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    k_scale, v_scale = scales[:, 0], scales[:, 1]
    assert not k_cache.is_contiguous() and not k_scale.is_contiguous()
    dense = [torch.zeros(pages, page_size, heads, dim, dtype=dtype) for _ in range(2)]
    dense_scales = [torch.ones(pages, page_size, heads) for _ in range(2)]
    for step in range(3):
        k, v = torch.randn(5, heads, dim), torch.randn(5, heads, dim)
        slots = torch.arange(5) * 4 + step  # rows 0..2 of pages 0..4
        paged_cache_append(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
        paged_cache_append(k, v, *dense, slots, k_scale=dense_scales[0],
                           v_scale=dense_scales[1])
    assert torch.equal(k_cache.view(torch.uint8), dense[0].view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), dense[1].view(torch.uint8))
    assert torch.equal(k_scale, dense_scales[0]) and torch.equal(v_scale, dense_scales[1])
    q = torch.randn(5, 1, 4, dim)
    table = torch.arange(5, dtype=torch.int32).view(5, 1)
    lengths = torch.full((5,), 3, dtype=torch.int32)
    strided = ca.paged_attention(q, k_cache, v_cache, table, lengths, k_scale=k_scale,
                                 v_scale=v_scale)
    contiguous = ca.paged_attention(q, *dense, table, lengths, k_scale=dense_scales[0],
                                    v_scale=dense_scales[1])
    assert torch.equal(strided, contiguous)


# --- the pool ---------------------------------------------------------------------------------


def test_the_pool_keeps_eight_bit_pages_and_their_scales():
    per_token = PagedKVCache(4, 2, 3, 5, value_dim=6, num_layers=2, dtype=torch.int8)
    assert per_token.scales == "token" and per_token.dtype == torch.int8
    for scales in per_token.key_scales + per_token.value_scales:
        assert scales.dtype == torch.float32 and scales.shape == (4, 2, 3)
        assert (scales == 1).all()
    assert per_token.key_scales[0].data_ptr() != per_token.key_scales[1].data_ptr()
    per_layer = PagedKVCache(4, 2, 3, 5, num_layers=2, dtype=torch.float8_e5m2,
                             scales="tensor", k_scale=[0.5, 0.25], v_scale=2)
    assert per_layer.key_scales == [0.5, 0.25] and per_layer.value_scales == [2.0, 2.0]
    assert per_layer.key_pages[1].dtype == torch.float8_e5m2
    plain = PagedKVCache(4, 2, 3, 5, dtype=torch.bfloat16)
    assert plain.scales is None and plain.key_scales == [None]


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(dtype=torch.int32), TypeError,
         "dtype must be one of float32, .*int8, got torch.int32"),
        (dict(dtype="int8"), TypeError, "dtype must be one of"),
        (dict(dtype=torch.int8, scales="channel"), ValueError,
         "scales must be 'tensor' .* or 'token' .*, got 'channel'"),
        (dict(dtype=torch.int8, scales=1), TypeError, "scales must be 'tensor' or 'token'"),
        (dict(scales="token"), ValueError, "for 8-bit pages .* dtype is torch.float32"),
        (dict(dtype=torch.bfloat16, k_scale=0.5), ValueError, "for 8-bit pages"),
        (dict(dtype=torch.int8, k_scale=0.5), ValueError, "scales='token' computes its own"),
        (dict(dtype=torch.int8, scales="tensor", k_scale=-1.0), ValueError,
         r"k_scale must be positive and finite \(in float32\), got -1.0 \(layer 0\)"),
        (dict(dtype=torch.int8, scales="tensor", v_scale=[1.0, float("inf")]), ValueError,
         r"v_scale must be positive and finite .*\(layer 1\)"),
        (dict(dtype=torch.int8, scales="tensor", v_scale=[1.0, 1.0, 1.0]), ValueError,
         r"v_scale must be a float or one per layer \(2\), got 3"),
        (dict(dtype=torch.int8, scales="tensor", k_scale="1"), TypeError,
         "k_scale must be a float or a list of floats"),
    ],
    ids=["int32", "string-dtype", "scales-name", "scales-type", "scales-of-float-pages",
         "k-scale-of-float-pages", "k-scale-with-token-scales", "negative-k-scale",
         "infinite-v-scale", "v-scale-per-layer-count", "k-scale-type"],
)
def test_the_pool_refuses_bad_dtypes_and_scales(options, error, match):
    with pytest.raises(error, match=match):
        PagedKVCache(4, 2, 1, 2, num_layers=2, **options)


def test_an_eight_bit_pool_holds_twice_a_bfloat16_pools_tokens_in_its_bytes():
    """bytes_per_token counts the pool's real tensors: 8-bit pages with per-tensor scales take
    half a bfloat16 pool's bytes a token (a quarter of float32's); per-token scales add 4 bytes
    a token and KV head for K and for V (at D = 128, 1.94x bfloat16's tokens)."""
    geometry = dict(num_pages=32, page_size=16, num_kv_heads=8, head_dim=128, num_layers=2)
    pools = {"float32": PagedKVCache(**geometry), "bfloat16": PagedKVCache(**geometry,
                                                                           dtype=torch.bfloat16)}
    for dtype in EIGHT_BIT:
        for scales in ("tensor", "token"):
            pools[NAMES[dtype], scales] = PagedKVCache(**geometry, dtype=dtype, scales=scales)
    for name, pool in pools.items():
        tensors = pool.key_pages + pool.value_pages + [
            s for s in pool.key_scales + pool.value_scales if isinstance(s, torch.Tensor)]
        assert pool.nbytes == sum(t.untyped_storage().nbytes() for t in tensors), name
        assert pool.bytes_per_token * 32 * 16 == pool.nbytes, name
    bf16 = pools["bfloat16"].bytes_per_token
    assert pools["float32"].bytes_per_token == 2 * bf16
    for dtype in EIGHT_BIT:
        assert pools[NAMES[dtype], "tensor"].bytes_per_token * 2 == bf16
        per_token = pools[NAMES[dtype], "token"].bytes_per_token
        assert per_token == bf16 // 2 + 2 * 4 * 8 * 2  # K and V, 8 heads, 2 layers
        assert 1.9 < bf16 / per_token < 2


def read_back(cache, request, layer=0):
    """The request's keys, dequantized (stored x per-token scale), through its pages."""
    pages, length = cache.pages_of(request), cache.length(request)
    stored = cache.key_pages[layer][pages].flatten(0, 1)[:length].float()
    return stored * cache.key_scales[layer][pages].flatten(0, 1)[:length, :, None]


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=NAMES.get)
def test_per_token_scales_go_with_their_pages_through_fork_copy_on_write_and_free(dtype):
    """A fork shares the pages and their scales; the first write into the shared partial page
    copies its rows and their scales to the writer's new page; the other holder writes in place
    with its own scales; a freed page's next owner writes its own; every request reads back
    what it wrote."""
    cache = PagedKVCache(num_pages=3, page_size=4, num_kv_heads=1, head_dim=2, dtype=dtype)
    cache.allocate("prompt")
    # Tokens of distinct magnitudes: each has its own scale.
    prompt = torch.randn(6, 1, 2) * torch.arange(1, 7).view(6, 1, 1) ** 3
    cache.append(0, prompt, prompt, cache.reserve("prompt", 6))
    written = read_back(cache, "prompt")
    cache.fork("prompt", "child")
    full, partial = cache.pages_of("prompt")
    shared_scales = cache.key_scales[0][partial, :2].clone()
    mine = torch.randn(1, 1, 2) * 1000
    cache.append(0, mine, mine, cache.reserve("child", 1))
    copied = cache.pages_of("child")[1]
    assert copied != partial
    assert torch.equal(cache.key_scales[0][copied, :2], shared_scales)
    assert torch.equal(cache.value_scales[0][copied, :2], shared_scales)
    assert torch.equal(cache.key_pages[0][copied, :2].view(torch.uint8),
                       cache.key_pages[0][partial, :2].view(torch.uint8))
    assert torch.equal(cache.key_scales[0][copied, 2], reference_token_scales(mine[0], dtype))
    theirs = torch.randn(1, 1, 2) / 1000
    cache.append(0, theirs, theirs, cache.reserve("prompt", 1))
    assert cache.pages_of("prompt") == [full, partial]
    assert torch.equal(cache.key_scales[0][partial, 2], reference_token_scales(theirs[0], dtype))
    child = read_back(cache, "child")
    assert torch.equal(child[:6], written) and torch.equal(read_back(cache, "prompt")[:6], written)
    assert not torch.equal(child[6], read_back(cache, "prompt")[6])
    cache.free("prompt")  # the partial page is free (the only one); the full one the child's
    assert cache.free_pages == 1 and cache.key_scales[0][partial, 0] != 1
    cache.allocate("next")
    cache.append(0, mine * 0, mine * 0, cache.reserve("next", 1))
    assert cache.pages_of("next") == [partial]
    assert cache.key_scales[0][partial, 0] == 1  # its own: a row of zeros gets 1
    assert torch.equal(read_back(cache, "child"), child)


# --- serving through the module ---------------------------------------------------------------


def serve(module, cache, prompts, new_tokens, inputs):
    """Prefills ``prompts`` (request -> length) in one step, then decodes ``new_tokens`` steps
    of one token each: forward_paged's outputs per request, concatenated, and the slots of
    every token written, in order."""
    outputs = {r: [] for r in prompts}
    slots = {r: [] for r in prompts}
    for r in prompts:
        cache.allocate(r)
    counts = list(prompts.values())
    for i in range(new_tokens + 1):
        step = cache.step(list(prompts), counts)
        x = torch.cat([inputs[r][i] for r in prompts])
        out = module.forward_paged(x, step)
        for b, r in enumerate(prompts):
            rows = slice(step.cu_seqlens_q[b], step.cu_seqlens_q[b + 1])
            outputs[r].append(out[rows])
            slots[r].append(step.slot_mapping[rows])
        counts = [1] * len(prompts)
    return ({r: torch.cat(o) for r, o in outputs.items()},
            torch.cat([torch.cat(s) for s in slots.values()]))


@pytest.mark.parametrize(
    "pool",
    [dict(dtype=torch.float8_e4m3fn), dict(dtype=torch.int8),
     dict(dtype=torch.float8_e5m2, scales="tensor", k_scale=2 ** -6, v_scale=2 ** -6)],
    ids=["e4m3-token-scales", "int8-token-scales", "e5m2-tensor-scales"],
)
def test_the_module_decodes_from_eight_bit_pages_within_their_quantization_error(pool):
    """CausalSelfAttention.forward_paged, unchanged, serves from an 8-bit cache: its outputs
    differ from the same steps' on a float32 cache by something (the pages are 8-bit), but no
    more than the quantization error measured in the pages allows: dK shifts query i's scores
    by at most d_i = scale * max_j |q_i . dK_j| (softcap only shrinks a shift), which moves its
    probabilities by at most e^(2 d_i) - 1 in sum, so its head's output by at most that times
    max |V| plus max |dV| (per value dim); c_proj passes that on through |W|."""
    torch.manual_seed(0)
    heads, kv_heads = 4, 2
    module = CausalSelfAttention(64, heads, num_kv_heads=kv_heads, softcap=30.0,
                                 sinks=True).eval()
    prompts = {"a": 13, "b": 1, "c": 29}
    decode = 6
    inputs = {r: [torch.randn(n, 64)] + [torch.randn(1, 64) for _ in range(decode)]
              for r, n in prompts.items()}
    with torch.no_grad():
        exact = module.make_paged_cache(num_pages=24, page_size=4)
        quantized = module.make_paged_cache(num_pages=24, page_size=4, **pool)
        want, slots = serve(module, exact, prompts, decode, inputs)
        got, same_slots = serve(module, quantized, prompts, decode, inputs)
        assert torch.equal(slots, same_slots)
        page, row = slots // 4, slots % 4
        written, errors = [], []
        for pages, scales, exact_pages in (
                (quantized.key_pages[0], quantized.key_scales[0], exact.key_pages[0]),
                (quantized.value_pages[0], quantized.value_scales[0], exact.value_pages[0])):
            scale = scales[page, row, :, None] if isinstance(scales, torch.Tensor) else scales
            written.append(exact_pages[page, row].double())  # (tokens, Hkv, D)
            errors.append(pages[page, row].double() * scale - written[-1])
        x = torch.cat([torch.cat(inputs[r]) for r in prompts])
        q = module.c_attn(x)[:, :heads * module.head_dim].view(-1, heads, module.head_dim)
    group = heads // kv_heads
    dk = errors[0].repeat_interleave(group, dim=1)  # (keys, Hq, D)
    shift = module.head_dim ** -0.5 * torch.einsum("ihd,jhd->ihj", q.double(), dk).abs()
    moved = torch.expm1(2 * shift.amax(-1))  # (queries, Hq): the probabilities' move, in sum
    largest_v = written[1].abs().amax(0).repeat_interleave(group, dim=0)  # (Hq, Dv)
    error_v = errors[1].abs().amax(0).repeat_interleave(group, dim=0)
    attended = error_v + moved[..., None] * largest_v  # (queries, Hq, Dv)
    bound = (attended.flatten(1) @ module.c_proj.weight.double().abs().T).max().item() + 1e-5
    difference = max((got[r] - want[r]).abs().max().item() for r in prompts)
    assert 0 < difference <= bound, (difference, bound)
    print(f"{pool}: |dK| {errors[0].abs().max():.3g}, |dV| {errors[1].abs().max():.3g} (of "
          f"{written[0].abs().max():.3g}, {written[1].abs().max():.3g}), output "
          f"{difference:.3g}, bound {bound:.3g}")


def greedy_steps(model, cache, prompts, new, forced=None):
    """Every prompt prefilled in one step, then ``new - 1`` decode steps of one token each
    (GPT.forward_paged): each step's last logits per request ``(new, vocab)``, and the tokens
    picked greedily, or fed from ``forced`` (teacher forcing: both runs see the same
    sequences)."""
    requests = list(range(len(prompts)))
    for r in requests:
        cache.allocate(r)
    feed, counts = list(prompts), [p.numel() for p in prompts]
    logits = {r: [] for r in requests}
    for i in range(new):
        step = cache.step(requests, counts)
        last = model.forward_paged(torch.cat(feed), step)[step.cu_seqlens_q[1:].long() - 1]
        for r in requests:
            logits[r].append(last[r])
        picked = last.argmax(-1) if forced is None else forced[:, i]
        feed, counts = list(picked.view(-1, 1)), [1] * len(requests)
    stacked = torch.stack([torch.stack(logits[r]) for r in requests])
    return stacked, stacked.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8], ids=NAMES.get)
def test_gpt_greedy_tokens_from_eight_bit_pages_are_mostly_the_float_caches(dtype):
    """The small GPT (random weights), serving six prompts for 24 tokens from an 8-bit cache
    with per-token scales, fed the float32 cache's greedy tokens: its logits differ from the
    float32 cache's by something, but under 5 % of their spread, and its greedy pick at 95 % of
    the positions or more is the float cache's (measured: e4m3 99-100 %, logits within 0.011;
    int8 100 %, within 0.003; logits' std 0.58)."""
    from causal_attention.models import GPT

    torch.manual_seed(0)
    model = GPT(96, 96, 64, 4, 2, num_kv_heads=2).eval()
    prompts = [torch.randint(0, 96, (n,)) for n in (5, 17, 9, 30, 2, 12)]
    with torch.no_grad():
        want, tokens = greedy_steps(model, model.make_paged_cache(64, 8), prompts, 24)
        got, picked = greedy_steps(model, model.make_paged_cache(64, 8, dtype=dtype), prompts,
                                   24, forced=tokens)
    difference = (got - want).abs().max().item()
    assert 0 < difference < 0.05 * want.std().item()
    assert (picked == tokens).double().mean().item() >= 0.95
