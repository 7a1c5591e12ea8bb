"""flash_attn_with_kvcache on 8-bit caches (float8_e4m3fn, float8_e5m2, int8) with flash-attn
3's k_descale/v_descale: per tensor, flash-attn 3's (batch, nheads_k) and one per token and KV
head, with and without block_table, for every q dtype: the output is as close to the float64
reference on the dequantized cache (as left after the call) as the usual rule for q's dtype
asks, with GQA, cache_batch_idx, left padding, windows, ALiBi and softcapping; the new k/v are
quantized as they are written exactly as torch's reference quantization (rounding, saturation,
per-token scales written beside them), or written as they are when already 8-bit; a paged cache
is the dense cache laid into pages; bad descales and what is not served get typed errors naming
the argument."""

import math

import pytest
import torch

from attention_testing.quantized import (
    EIGHT_BIT,
    EIGHT_BIT_IDS,
    LARGEST,
    Q_DTYPE_IDS,
    Q_DTYPES,
    assert_matches_dequantized,
    quantize_reference,
    random_eight_bit,
    token_scale_reference,
)
from causal_attention.integrations.flash_attn import flash_attn_with_kvcache

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

FN = "causal_attention.integrations.flash_attn.flash_attn_with_kvcache"
LAYOUTS = ["tensor", "batch", "token"]


class Cache:
    """A dense 8-bit cache ``(rows, capacity, Hkv, D)`` (and V with Dv) with descales in
    ``layout``: a float, flash-attn 3's float32 ``(batch, Hkv)`` (batch row b reads cache row
    b), or float32 ``(rows, capacity, Hkv)``; ``paged(page)`` lays it into shuffled pages."""

    def __init__(self, dtype, layout, rows=3, capacity=64, hkv=2, d=32, dv=16):
        self.dtype, self.layout, self.hkv = dtype, layout, hkv
        self.block_table = None
        self.k, self.k_descale = self._make((rows, capacity, hkv, d))
        self.v, self.v_descale = self._make((rows, capacity, hkv, dv))

    def _make(self, shape):
        if self.layout == "token":
            stored, scale, _ = random_eight_bit(shape, self.dtype, "token")
            return stored, scale
        if self.layout == "tensor":
            stored, scale, _ = random_eight_bit(shape, self.dtype, "tensor")
            return stored, scale
        # One scale a batch row (its cache row) and KV head.
        x = torch.randn(shape) * (0.5 + torch.rand(shape[0], 1, shape[2], 1))
        scale = token_scale_reference(x.transpose(1, 2).flatten(2), self.dtype)
        return quantize_reference(x, self.dtype, scale[:, None, :, None]), scale

    def paged(self, page):
        """The same cache as shuffled pages of ``page`` rows (two spare pages), descales with
        it; block_table (rows, capacity / page)."""
        rows, capacity = self.k.shape[:2]
        per_row = capacity // page
        order = torch.randperm(rows * per_row + 2)
        table = order[: rows * per_row].view(rows, per_row).to(torch.int32)
        pool = order.numel()

        def lay(t):
            pages = torch.zeros((pool, page) + tuple(t.shape[2:]), dtype=t.dtype)
            pages[table.flatten().long()] = t.reshape((rows * per_row, page) + tuple(t.shape[2:]))
            return pages

        self.block_table = table
        self.k, self.v = lay(self.k), lay(self.v)
        if self.layout == "token":
            self.k_descale, self.v_descale = lay(self.k_descale), lay(self.v_descale)
        return self

    def kwargs(self):
        return dict(k_descale=self.k_descale, v_descale=self.v_descale,
                    block_table=self.block_table)

    def dequantized(self, b, cache_row, start, end):
        """float64 K and V of batch row ``b`` (reading ``cache_row``, or its pages), positions
        start..end-1, as (Hkv, n, D)."""
        result = []
        for stored, scale in ((self.k, self.k_descale), (self.v, self.v_descale)):
            if self.block_table is not None:
                pages = self.block_table[cache_row].long()
                keys = stored[pages].flatten(0, 1)[start:end].double()
                scales = scale[pages].flatten(0, 1)[start:end] if self.layout == "token" \
                    else scale
            else:
                keys = stored[cache_row, start:end].double()
                scales = scale[cache_row, start:end] if self.layout == "token" else scale
            if self.layout == "token":
                keys = keys * scales.double().unsqueeze(-1)
            elif self.layout == "batch":
                keys = keys * scales[b].double()[:, None]
            else:
                keys = keys * scales
            result.append(keys.transpose(0, 1))
        return result


def assert_rows_match(out, q, cache, rows, starts, ends, scale=None, window=(-1, 0),
                      softcap=None, alibi_slopes=None):
    """Each batch row's output against the float64 reference on its dequantized keys."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    for b in range(q.size(0)):
        k64, v64 = cache.dequantized(b, rows[b], starts[b], ends[b])
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 \
            else alibi_slopes
        assert_matches_dequantized(out[b].transpose(0, 1), q[b].transpose(0, 1), k64, v64,
                                   scale, f"row {b}", window=window, softcap=softcap,
                                   alibi_slopes=slopes)


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=Q_DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=EIGHT_BIT_IDS)
@pytest.mark.parametrize("page", [None, 16], ids=["dense", "paged16"])
def test_decode_appends_and_matches_float64_on_the_dequantized_cache(page, dtype, layout,
                                                                       q_dtype):
    """A decode step: one new key per row quantized into the cache, then 4 query heads on 2 KV
    heads against each row's keys."""
    cache = Cache(dtype, layout)
    if page:
        cache.paged(page)
    seqlens = [9, 0, 40]
    q = torch.randn(3, 1, 4, 32).to(q_dtype)
    k, v = torch.randn(3, 1, 2, 32).to(q_dtype), torch.randn(3, 1, 2, 16).to(q_dtype)
    out = flash_attn_with_kvcache(q, cache.k, cache.v, k, v,
                                  cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                                  causal=True, **cache.kwargs())
    assert out.shape == (3, 1, 4, 16) and out.dtype == q_dtype
    assert_rows_match(out, q, cache, [0, 1, 2], [0] * 3, [s + 1 for s in seqlens])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=EIGHT_BIT_IDS)
@pytest.mark.parametrize("page", [None, 16], ids=["dense", "paged16"])
def test_a_prefill_chunk_appended_then_attended(page, dtype, layout):
    """8 new keys a row (crossing a page), bf16 q, causal within the chunk."""
    cache = Cache(dtype, layout)
    if page:
        cache.paged(page)
    seqlens = [12, 3, 30]
    q = torch.randn(3, 8, 4, 32, dtype=torch.bfloat16)
    k = torch.randn(3, 8, 2, 32, dtype=torch.bfloat16)
    v = torch.randn(3, 8, 2, 16, dtype=torch.bfloat16)
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, k, v,
                                       cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                                       causal=True, return_softmax_lse=True, **cache.kwargs())
    assert lse.shape == (3, 4, 8) and lse.dtype == torch.float32
    assert_rows_match(out, q, cache, [0, 1, 2], [0] * 3, [s + 8 for s in seqlens])


def test_cache_batch_idx_left_padding_and_score_options_without_block_table():
    """Rows of the cache picked by cache_batch_idx, rows with their own left padding (one
    paged_attention call per padding), a sliding window, softcapping and per-row ALiBi."""
    cache = Cache(torch.float8_e4m3fn, "token", rows=5)
    rows, seqlens, leftpad = [4, 0, 2], [20, 33, 10], [3, 0, 3]
    q = torch.randn(3, 2, 4, 32)
    k, v = torch.randn(3, 2, 2, 32), torch.randn(3, 2, 2, 16)
    slopes = torch.rand(3, 4) * 0.1
    out = flash_attn_with_kvcache(
        q, cache.k, cache.v, k, v, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
        cache_batch_idx=torch.tensor(rows, dtype=torch.int32),
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32), causal=True,
        window_size=(12, 0), softcap=4.0, alibi_slopes=slopes, **cache.kwargs())
    assert_rows_match(out, q, cache, rows, leftpad, [s + 2 for s in seqlens], window=(12, 0),
                      softcap=4.0, alibi_slopes=slopes)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_score_options_with_block_table(layout):
    cache = Cache(torch.int8, layout).paged(8)
    seqlens = [25, 50, 7]
    q = torch.randn(3, 3, 4, 32, dtype=torch.float16)
    slopes = torch.tensor([0.05, 0.02, 0.01, 0.0])
    out = flash_attn_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
        causal=True, window_size=(9, 0), softcap=3.0, alibi_slopes=slopes, softmax_scale=0.3,
        **cache.kwargs())
    assert_rows_match(out, q, cache, [0, 1, 2], [0] * 3, seqlens, scale=0.3, window=(9, 0),
                      softcap=3.0, alibi_slopes=slopes)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_table_is_the_dense_cache_in_pages(layout):
    """The same 8-bit cache and the same new keys, dense and in shuffled pages: the same
    output and lse (float32 summation order aside), and the same stored keys and scales."""
    torch.manual_seed(1)
    dense = Cache(torch.float8_e5m2, layout)
    torch.manual_seed(1)
    paged = Cache(torch.float8_e5m2, layout).paged(16)
    q = torch.randn(3, 4, 4, 32)
    k, v = torch.randn(3, 4, 2, 32), torch.randn(3, 4, 2, 16)
    kwargs = dict(cache_seqlens=torch.tensor([5, 17, 44], dtype=torch.int32), causal=True,
                  return_softmax_lse=True, alibi_slopes=torch.rand(4) * 0.1)
    out_dense, lse_dense = flash_attn_with_kvcache(q, dense.k, dense.v, k, v, **kwargs,
                                                   **dense.kwargs())
    out_paged, lse_paged = flash_attn_with_kvcache(q, paged.k, paged.v, k, v, **kwargs,
                                                   **paged.kwargs())
    torch.testing.assert_close(out_paged, out_dense, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse_paged, lse_dense, rtol=0, atol=1e-5)
    pages = paged.block_table.flatten().long()
    assert torch.equal(paged.k[pages].view(dense.k.shape).view(torch.uint8),
                       dense.k.view(torch.uint8))
    if layout == "token":
        assert torch.equal(paged.k_descale[pages].view(dense.k_descale.shape), dense.k_descale)


SCORES = {
    "causal": dict(causal=True),
    "alibi-causal-kernel": dict(causal=True, alibi_slopes=torch.rand(3, 4) * 0.1),
    "sliding-softcap": dict(causal=True, window_size=(6, 0), softcap=2.5),
    "local-alibi": dict(causal=False, window_size=(5, 2), alibi_slopes=torch.rand(4) * 0.1),
}


@pytest.mark.parametrize("scores", list(SCORES))
@pytest.mark.parametrize("where", ["dense", "dense-leftpad", "dense-batch-idx", "paged8"])
def test_an_eight_bit_cache_is_the_float_cache_of_its_dequantized_values(where, scores):
    """The same call on a float32 cache holding the 8-bit cache's dequantized values (what the
    kernels widen it to: stored x scale in float32), its new keys the 8-bit cache's as written:
    the same output and softmax_lse, flash-attn's (its ALiBi lse shift, left padding) as the
    float path computes them."""
    cache = Cache(torch.int8, "token", rows=4, capacity=48)
    if where == "paged8":
        cache.paged(8)
        cache.block_table = cache.block_table[:3]
    q = torch.randn(3, 3, 4, 32)
    k, v = torch.randn(3, 3, 2, 32), torch.randn(3, 3, 2, 16)
    kwargs = dict(cache_seqlens=torch.tensor([7, 30, 2], dtype=torch.int32),
                  return_softmax_lse=True, **SCORES[scores])
    if where == "dense-leftpad":
        kwargs["cache_leftpad"] = torch.tensor([3, 0, 2], dtype=torch.int32)
    if where == "dense-batch-idx":
        kwargs["cache_batch_idx"] = torch.tensor([3, 0, 2], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, k, v, **kwargs, **cache.kwargs())
    # The cache as written, dequantized, and the call again without new keys.
    float_k = cache.k.float() * cache.k_descale.unsqueeze(-1)
    float_v = cache.v.float() * cache.v_descale.unsqueeze(-1)
    kwargs["cache_seqlens"] = kwargs["cache_seqlens"] + 3
    expected, expected_lse = flash_attn_with_kvcache(q, float_k, float_v,
                                                     block_table=cache.block_table, **kwargs)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=2e-5)


# --- writing the new keys --------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["tensor", "batch", "token"])
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=EIGHT_BIT_IDS)
def test_new_keys_are_quantized_as_torch_quantizes_them(dtype, layout):
    """Rounded to nearest, values beyond the format saturated (not inf, not wrapped), a row of
    zeros stored as zeros; per token, their scales written beside them."""
    cache = Cache(dtype, layout, capacity=16)
    before_k = cache.k.clone()
    k = torch.randn(3, 2, 2, 32) * 4
    k[0, 0, 0, :4] = torch.tensor([1e30, -1e30, 3e5, -7e4])  # beyond every format's range
    k[1, 1, 1] = 0.0
    v = torch.randn(3, 2, 2, 16, dtype=torch.float32)
    seqlens = [0, 5, 14]
    flash_attn_with_kvcache(torch.randn(3, 1, 4, 32), cache.k, cache.v, k, v,
                            cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                            **cache.kwargs())
    for b, start in enumerate(seqlens):
        written = cache.k[b, start : start + 2]
        if layout == "token":
            scales = token_scale_reference(k[b], dtype)
            assert torch.equal(cache.k_descale[b, start : start + 2], scales)
            expected = quantize_reference(k[b], dtype, scales.unsqueeze(-1))
        elif layout == "batch":
            expected = quantize_reference(k[b], dtype, cache.k_descale[b][:, None])
        else:
            expected = quantize_reference(k[b], dtype, cache.k_descale)
        assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8)), b
        # Nothing else of the row is touched.
        untouched = torch.ones(16, dtype=torch.bool)
        untouched[start : start + 2] = False
        assert torch.equal(cache.k[b, untouched].view(torch.uint8),
                           before_k[b, untouched].view(torch.uint8))
    saturated = cache.k[0, 0, 0, :4].float()
    assert torch.isfinite(saturated).all()
    if layout != "token":  # with its own scale the largest value is the format's largest
        assert saturated[0] == LARGEST[dtype] and saturated[1] == -LARGEST[dtype]
    assert torch.count_nonzero(cache.k[1, 6, 1].float()) == 0


def test_keys_already_in_the_cache_dtype_are_written_as_they_are():
    cache = Cache(torch.float8_e4m3fn, "batch", capacity=16)
    k = (torch.randn(3, 2, 2, 32) * 50).to(torch.float8_e4m3fn)
    v = (torch.randn(3, 2, 2, 16) * 50).to(torch.float8_e4m3fn)
    q = torch.randn(3, 2, 4, 32)
    out = flash_attn_with_kvcache(q, cache.k, cache.v, k, v, cache_seqlens=4, causal=True,
                                  **cache.kwargs())
    assert torch.equal(cache.k[:, 4:6].view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(cache.v[:, 4:6].view(torch.uint8), v.view(torch.uint8))
    assert_rows_match(out, q, cache, [0, 1, 2], [0] * 3, [6] * 3)


def test_batch_descales_that_are_all_equal_are_one_scale():
    torch.manual_seed(2)
    cache = Cache(torch.int8, "tensor").paged(16)
    q = torch.randn(3, 1, 4, 32)
    kwargs = dict(cache_seqlens=torch.tensor([10, 20, 30], dtype=torch.int32),
                  block_table=cache.block_table)
    one = flash_attn_with_kvcache(q, cache.k, cache.v, k_descale=cache.k_descale,
                                  v_descale=cache.v_descale, **kwargs)
    expanded = flash_attn_with_kvcache(
        q, cache.k, cache.v, k_descale=torch.tensor(cache.k_descale).expand(3, 2),
        v_descale=torch.full((3, 2), cache.v_descale), **kwargs)
    assert torch.equal(one, expanded)


def test_batch_descales_of_rows_sharing_a_page_must_agree():
    cache = Cache(torch.int8, "batch").paged(16)
    table = cache.block_table.clone()
    table[2, 0] = table[0, 0]  # rows 0 and 2 read one page
    q = torch.randn(3, 1, 4, 32)
    seqlens = torch.tensor([10, 20, 30], dtype=torch.int32)
    page = int(table[0, 0])
    with pytest.raises(ValueError, match=rf"k_descale \(batch, nheads_k\) gives batch rows 0 and 2 "
                       rf"different scales, but both read page {page}"):
        flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, block_table=table,
                                k_descale=cache.k_descale, v_descale=cache.v_descale)
    # With the same scales for the rows that share it, it is served.
    agreeing = cache.k_descale.clone()
    agreeing[2] = agreeing[0]
    flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, block_table=table,
                            k_descale=agreeing, v_descale=cache.v_descale.clone().fill_(0.01))
    # Without block_table, rows picking one cache row.
    dense = Cache(torch.int8, "batch")
    with pytest.raises(ValueError, match="gives batch rows 0 and 1 different scales, but both "
                       "read cache row 2"):
        flash_attn_with_kvcache(q, dense.k, dense.v, cache_seqlens=seqlens,
                                cache_batch_idx=torch.tensor([2, 2, 0], dtype=torch.int32),
                                **dense.kwargs())


def test_rotary_new_keys_are_rotated_then_quantized():
    """The same call on a float32 cache, then quantized, leaves the same 8-bit keys."""
    cache = Cache(torch.int8, "token", capacity=16)
    float_k = torch.zeros(3, 16, 2, 32)
    q, k, v = torch.randn(3, 2, 4, 32), torch.randn(3, 2, 2, 32), torch.randn(3, 2, 2, 16)
    angles = torch.rand(16, 8) * 3
    rotary = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), cache_seqlens=3, causal=True)
    flash_attn_with_kvcache(q, float_k, torch.zeros(3, 16, 2, 16), k, v, **rotary)
    flash_attn_with_kvcache(q, cache.k, cache.v, k, v, **rotary, **cache.kwargs())
    rotated = float_k[:, 3:5]
    scales = token_scale_reference(rotated, torch.int8)
    assert torch.equal(cache.k_descale[:, 3:5], scales)
    assert torch.equal(cache.k[:, 3:5], quantize_reference(rotated, torch.int8,
                                                           scales.unsqueeze(-1)))


# --- refused ---------------------------------------------------------------------------------


def kv8(**changes):
    """flash_attn_with_kvcache on an int8 dense cache (2, 16, 2, 8) with per-token descales
    and two new keys, ``changes`` applied."""
    args = dict(q=torch.randn(2, 2, 4, 8), k_cache=torch.zeros(2, 16, 2, 8, dtype=torch.int8),
                v_cache=torch.zeros(2, 16, 2, 8, dtype=torch.int8), k=torch.randn(2, 2, 2, 8),
                v=torch.randn(2, 2, 2, 8), cache_seqlens=torch.tensor([4, 9], dtype=torch.int32),
                causal=True, k_descale=torch.full((2, 16, 2), 0.02), v_descale=0.05)
    args.update(changes)
    return args


def descales_with(value, at=(1, 3, 0), shape=(2, 16, 2)):
    scales = torch.full(shape, 0.02)
    scales[at] = value
    return scales


F8 = torch.float8_e4m3fn
BAD = [
    pytest.param(kv8(k_descale=torch.ones(2, 2, 16)), ValueError,
                 r"k_descale must be one scale per tensor .* \(batch, nheads_k\) = \(2, 2\) or "
                 r"one per token and KV head, \(batch_cache, seqlen_cache, nheads_k\) = "
                 r"\(2, 16, 2\), got k_descale.shape=\(2, 2, 16\)", id="k_descale-shape"),
    pytest.param(kv8(v_descale=torch.ones(3, 2)), ValueError, r"v_descale.shape=\(3, 2\)",
                 id="v_descale-batch-shape"),
    pytest.param(kv8(v_descale=torch.ones(5)), ValueError, r"v_descale.shape=\(5,\)",
                 id="v_descale-1d"),
    pytest.param(kv8(k_descale=torch.ones(2, 16, 2, dtype=torch.bfloat16)), TypeError,
                 "k_descale must be float32, got k_descale.dtype=torch.bfloat16",
                 id="k_descale-bf16"),
    pytest.param(kv8(v_descale=torch.ones(2, 2, dtype=torch.float64)), TypeError,
                 "v_descale must be float32", id="v_descale-batch-float64"),
    pytest.param(kv8(v_descale=torch.tensor(1)), TypeError, "v_descale .* must be floating",
                 id="v_descale-int-tensor"),
    pytest.param(kv8(k_descale=[0.5]), TypeError, "k_descale must be a float",
                 id="k_descale-list"),
    pytest.param(kv8(v_descale=0.0), ValueError, "v_descale must be positive and finite",
                 id="v_descale-zero"),
    pytest.param(kv8(v_descale=-2.0), ValueError, "v_descale must be positive and finite",
                 id="v_descale-negative"),
    pytest.param(kv8(v_descale=torch.tensor([math.nan])), ValueError,
                 "v_descale must be positive and finite", id="v_descale-nan"),
    pytest.param(kv8(k_descale=descales_with(0.0)), ValueError,
                 r"k_descale must be positive and finite where the rows read it, got "
                 r"k_descale\[1\]\[3\]\[0\]=0.0", id="k_descale-token-zero"),
    pytest.param(kv8(k_descale=descales_with(math.inf, (0, 2, 1))), ValueError,
                 r"k_descale\[0\]\[2\]\[1\]=inf", id="k_descale-token-inf"),
    pytest.param(kv8(k_descale=descales_with(-1.0, (1, 0), (2, 2))), ValueError,
                 r"k_descale must be positive and finite, got k_descale\[1\]\[0\]=-1.0",
                 id="k_descale-batch-negative"),
    pytest.param(kv8(q_descale=torch.ones(2, 2)), NotImplementedError,
                 "q_descale .* is not supported", id="q_descale"),
    pytest.param(kv8(k_cache=torch.zeros(2, 16, 2, 8), v_cache=torch.zeros(2, 16, 2, 8),
                     v_descale=None), ValueError,
                 "k_descale dequantizes an 8-bit cache .* the caches are torch.float32",
                 id="descale-float-cache"),
    pytest.param(kv8(v_cache=torch.zeros(2, 16, 2, 8, dtype=F8)), TypeError,
                 "must share one dtype", id="mixed-cache-dtypes"),
    pytest.param(kv8(q=torch.randn(2, 2, 4, 8, dtype=torch.float64)), TypeError,
                 "q must be float32, bfloat16 or float16 beside torch.int8 caches",
                 id="q-float64"),
    pytest.param(kv8(k=torch.randn(2, 2, 2, 8, dtype=torch.float64),
                     v=torch.randn(2, 2, 2, 8, dtype=torch.float64)), TypeError,
                 "k and v for a torch.int8 cache must both have q's dtype", id="k-float64"),
    pytest.param(kv8(k=descales_with(math.nan, (0, 1, 1, 3), (2, 2, 2, 8))), ValueError,
                 "k must be finite to be quantized", id="k-nan"),
    pytest.param(kv8(v=descales_with(math.inf, (0, 1, 1, 3), (2, 2, 2, 8))), ValueError,
                 "v must be finite to be quantized", id="v-inf"),
    pytest.param(kv8(k=torch.zeros(2, 2, 2, 8, dtype=torch.int8),
                     v=torch.zeros(2, 2, 2, 8, dtype=torch.int8)), ValueError,
                 "leaves their scales in a per-token k_descale/v_descale unset",
                 id="8-bit-k-per-token"),
    pytest.param(kv8(k=torch.zeros(2, 2, 2, 8, dtype=torch.int8),
                     v=torch.zeros(2, 2, 2, 8, dtype=torch.int8), k_descale=0.1,
                     rotary_cos=torch.ones(16, 4), rotary_sin=torch.zeros(16, 4)),
                 NotImplementedError, "rotary_cos/rotary_sin with k already in the cache's dtype",
                 id="8-bit-k-rotary"),
]


@pytest.mark.parametrize("args,error,match", BAD)
def test_bad_calls_raise_typed_errors_naming_the_argument_before_writing(args, error, match):
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    scales = args["k_descale"] if isinstance(args["k_descale"], torch.Tensor) else None
    before = [t.clone() for t in (k_cache, v_cache, scales) if t is not None]
    with pytest.raises(error, match=match) as raised:
        flash_attn_with_kvcache(**args)
    assert str(raised.value).startswith(f"{FN}: ")
    after = [t for t in (k_cache, v_cache, scales) if t is not None]
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
               for a, b in zip(before, after)), "the cache was written"


def test_bad_per_token_descales_of_pages_are_named_by_page():
    cache = Cache(torch.int8, "token").paged(16)
    page, slot = int(cache.block_table[1, 2]), 5  # row 1's key 37
    cache.v_descale[page, slot, 1] = math.nan
    kwargs = dict(cache_seqlens=torch.tensor([3, 40, 7], dtype=torch.int32), **cache.kwargs())
    with pytest.raises(ValueError, match=rf"v_descale\[{page}\]\[{slot}\]\[1\]=nan"):
        flash_attn_with_kvcache(torch.randn(3, 1, 4, 32), cache.k, cache.v, **kwargs)
    # Past what the rows read, a bad scale is never looked at (a cache made with torch.empty).
    kwargs["cache_seqlens"] = torch.tensor([3, 37, 7], dtype=torch.int32)
    assert torch.isfinite(flash_attn_with_kvcache(torch.randn(3, 1, 4, 32), cache.k, cache.v,
                                                  **kwargs)).all()
    # In a page a row reads whole.
    whole = int(cache.block_table[1, 1])
    cache.k_descale[whole, 15, 0] = -3.0
    with pytest.raises(ValueError, match=rf"k_descale\[{whole}\]\[15\]\[0\]=-3.0"):
        flash_attn_with_kvcache(torch.randn(3, 1, 4, 32), cache.k, cache.v, **kwargs)


def test_rows_without_keys_get_zeros_and_minus_inf():
    """A dense cache of no slots, and a row left-padded to its end (no page of no slots is
    handed to paged_attention)."""
    q = torch.randn(2, 1, 2, 8)
    empty = torch.zeros(2, 0, 1, 8, dtype=torch.int8)
    out, lse = flash_attn_with_kvcache(q, empty, empty, cache_seqlens=0, return_softmax_lse=True)
    assert torch.count_nonzero(out) == 0 and bool((lse == -math.inf).all())
    ones = torch.ones(2, 5, 1, 8, dtype=torch.int8)
    out, lse = flash_attn_with_kvcache(
        q, ones, ones, cache_seqlens=torch.tensor([5, 5], dtype=torch.int32),
        cache_leftpad=torch.tensor([5, 1], dtype=torch.int32), return_softmax_lse=True,
        k_descale=0.1, v_descale=0.5)
    assert torch.count_nonzero(out[0]) == 0 and bool((lse[0] == -math.inf).all())
    torch.testing.assert_close(out[1], torch.full((1, 2, 8), 0.5))


def test_reference_example_runs():
    from nn_testing import run_reference_example

    names = run_reference_example("## 8-bit KV caches in `attention`", "\n## ")
    assert names["out"].shape == (2, 9, 8, 64) and names["decoded"].shape == (2, 8, 1, 64)
    # Row 1 had 4 keys cached: the 9 new ones went in after them, quantized with their scales.
    written = names["k_cache"][1, 4:13].float() * names["k_descale"][1, 4:13].unsqueeze(-1)
    assert (written - names["k"][1]).abs().max() <= names["k_descale"][1, 4:13].max() / 2 + 1e-6
    assert not names["k_cache"][1, 13:].any()
