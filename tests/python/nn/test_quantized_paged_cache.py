"""8-bit paged KV caches (float8_e4m3fn, float8_e5m2, int8): paged_cache_append quantizes as a
reference written here from the formats' tables does (nearest value, ties to even, saturating),
with scales given per tensor or computed per token and KV head; it skips the padding slot -1,
refuses non-finite values and bad scales with typed errors naming them, leaving the cache as it
was, and writes strided page views. PagedKVCache keeps 8-bit pages and their scales through 10k
random operations (fork, copy on write, free), paged_attention through them equals a float64
reference on the dequantized keys and values, and the module and the GPT decode from them
within the quantization's error of a float cache."""

import math
import random

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
