"""paged_attention on 8-bit caches (float8_e4m3fn, float8_e5m2, int8) with a dequantization
scale per tensor or per token and KV head: against a float64 reference on the dequantized cache
(stored value x scale), within the error of the op in q's dtype on that cache, for decode rows,
prefill chunks and mixed packed batches, every score option, GQA and MQA, pages of 1 to 272
rows; bitwise the same at one and two threads; bad dtypes and scales refused with typed errors
naming the argument. The quantization is written here in torch, apart from the library's."""

import math

import pytest
import torch

import causal_attention as ca
from attention_testing.paged import paged
from attention_testing.quantized import LARGEST
from causal_attention import paged_attention

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

FORMATS = LARGEST
Q_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def quantize(cache, dtype, layout):
    """A float cache (num_pages, page_size, Hkv, D) stored in `dtype` with its scales: one per
    tensor (a float) or per token and KV head ((num_pages, page_size, Hkv) float32). Pages no
    sequence reads hold NaN (paged()): their scales are NaN too, and must not be read."""
    fmax = FORMATS[dtype]
    if layout == "tensor":
        scale = cache.nan_to_num(0).abs().amax().item() / fmax
        scaled = cache / scale
    else:
        scale = (cache.abs().amax(-1) / fmax).float()
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        scaled = cache / scale[..., None]
    if dtype == torch.int8:
        stored = scaled.nan_to_num(0).round().clamp(-fmax, fmax).to(dtype)
    else:
        stored = scaled.clamp(-fmax, fmax).to(dtype)
    return stored, scale


def dequantized(stored, scale):
    scale = torch.as_tensor(scale, dtype=torch.float32)
    return stored.float() * (scale[..., None] if scale.dim() else scale)


def sequences(lengths_q, lengths_k, hq=4, hkv=2, d=32, dv=16, q_dtype=torch.float32):
    queries = [torch.randn(lq, hq, d).to(q_dtype) for lq in lengths_q]
    keys = [torch.randn(lk, hkv, d) * 2 for lk in lengths_k]
    values = [torch.randn(lk, hkv, dv) for lk in lengths_k]
    return queries, keys, values


def call(queries, k_cache, v_cache, table, lengths_k, **options):
    cu = torch.tensor([0] + [q.shape[0] for q in queries], dtype=torch.int32).cumsum(0).int()
    out = paged_attention(torch.cat(queries), k_cache, v_cache, table,
                          torch.tensor(lengths_k, dtype=torch.int32), cu_seqlens_q=cu,
                          max_seqlen_q=max(q.shape[0] for q in queries), **options)
    return [out[cu[b]:cu[b + 1]] for b in range(len(queries))]


def pages_of(lengths, keys_cache, table, page_size):
    """Sequence b's rows of a (num_pages, page_size, Hkv, D) cache, as (Lk_b, Hkv, D)."""
    return [keys_cache[table[b, :-(-n // page_size)].long()].flatten(0, 1)[:n]
            for b, n in enumerate(lengths)]


def check(queries, keys, values, fmt, layout, page_size=16, **options):
    """The 8-bit call against float64 on its dequantized cache, as close as the contiguous op
    in q's dtype on that cache is (twice, for the summation order), and a fifth of q's dtype's
    tolerance: a decode row's error is the largest of few values (its heads' Dv each), whose ratio
    to the contiguous op's varies with rounding alone (float32 rows against e4m3 pages of one
    token: 2.6 times with torch's exp_u20 in the softmax, 2.9 with ours, the more accurate)."""
    lengths_k = [k.shape[0] for k in keys]
    k_cache, v_cache, table = paged(keys, values, page_size)
    k8, k_scale = quantize(k_cache, fmt, layout)
    v8, v_scale = quantize(v_cache, fmt, layout)
    check_stored(queries, lengths_k, k8, v8, table, k_scale, v_scale, page_size, **options)


def check_stored(queries, lengths_k, k8, v8, table, k_scale, v_scale, page_size, **options):
    """check's comparison, on 8-bit pages given as they are stored, with their scales."""
    q_dtype = queries[0].dtype
    got = call(queries, k8, v8, table, lengths_k, k_scale=k_scale, v_scale=v_scale, **options)
    k_real = pages_of(lengths_k, dequantized(k8, k_scale), table, page_size)
    v_real = pages_of(lengths_k, dequantized(v8, v_scale), table, page_size)
    for b, (g, q, k, v) in enumerate(zip(got, queries, k_real, v_real)):
        assert g.dtype == q_dtype and g.shape == (q.shape[0], q.shape[1], v.shape[-1])
        if g.numel() == 0:
            continue

        def contiguous(dtype):
            out = ca.attention(*(t.to(dtype).transpose(0, 1) for t in (q, k, v)), **options)
            return out.transpose(0, 1).double()

        exact, own_dtype = contiguous(torch.float64), contiguous(q_dtype)
        bound = 2 * (own_dtype - exact).abs().max().item() + TOLERANCE[q_dtype] / 5
        error = (g.double() - exact).abs().max().item()
        assert error <= bound, f"sequence {b}: {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["tensor", "token"])
@pytest.mark.parametrize("fmt", list(FORMATS), ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64, 272])
def test_decode_rows_chunks_and_mixed_batches(page_size, fmt, layout, q_dtype):
    """One packed call holding decode rows (the decode path: each key block widened into the
    task's scratch) and chunks of 40 and 120 rows (the block path: blocks widened as they are
    packed), a sequence without keys and one with more queries than keys."""
    torch.manual_seed(page_size)
    lengths_q, lengths_k = [1, 40, 1, 120, 0, 9, 3], [300, 40, 5, 700, 0, 70, 2]
    queries, keys, values = sequences(lengths_q, lengths_k, q_dtype=q_dtype)
    check(queries, keys, values, fmt, layout, page_size)


def pages_apart(t):
    """``t`` (num_pages, page_size, ...) as a view of a pool whose pages have a row between them,
    holding what no read may reach: NaN, or int8's largest value."""
    fill = 127 if t.dtype == torch.int8 else float("nan")
    pool = torch.full((t.shape[0], t.shape[1] + 1, *t.shape[2:]), fill, dtype=t.dtype)
    pool[:, :t.shape[1]] = t
    return pool[:, :t.shape[1]]


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("apart", ["none", "cache", "scales"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("fmt", list(FORMATS), ids=str)
def test_pages_in_order_are_read_across_their_ends(fmt, page_size, apart, q_dtype):
    """Pages that follow one another in the pool (PagedKVCache lays a request's pages so) are read
    as one run of rows and per-token scales, up to the first page that does not follow; never
    across a page's end where the cache's pages, or the scales' pages, have a row between them."""
    torch.manual_seed(page_size)
    lengths_q, lengths_k = [1, 3, 40], [300, 129, 90]
    queries, keys, values = sequences(lengths_q, lengths_k, hq=8, hkv=2, d=64, dv=32,
                                      q_dtype=q_dtype)
    k_cache, v_cache, table = paged(keys, values, page_size, stretch=6)
    (k8, k_scale), (v8, v_scale) = (quantize(c, fmt, "token") for c in (k_cache, v_cache))
    if apart == "cache":
        k8, v8 = pages_apart(k8), pages_apart(v8)
    elif apart == "scales":
        k_scale, v_scale = pages_apart(k_scale), pages_apart(v_scale)
    check_stored(queries, lengths_k, k8, v8, table, k_scale, v_scale, page_size)


OPTIONS = {
    "window": {"window": (20, 0)},
    "softcap": {"softcap": 3.0},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
    "sinks": {"sinks": torch.tensor([0.3, -1.0, 2.0, 0.0])},
    "full": {"window": (-1, -1)},
}


# bfloat16 query rows also at a head dim of 64: on AVX-512 BF16 chips they score float8 keys (e4m3,
# e5m2: byte tables) by bfloat16 dot products only at whole steps of 64 (row_products.h), int8
# at 32 too (widened and converted; at whole 64s by byte tables too).
@pytest.mark.parametrize(
    "q_dtype, d", [(torch.float32, 32), (torch.bfloat16, 32), (torch.bfloat16, 64)],
    ids=["float32-D32", "bfloat16-D32", "bfloat16-D64"])
@pytest.mark.parametrize("fmt", list(FORMATS), ids=str)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_score_option(option, fmt, q_dtype, d):
    torch.manual_seed(0)
    queries, keys, values = sequences([1, 50, 3], [200, 90, 33], d=d, q_dtype=q_dtype)
    check(queries, keys, values, fmt, "token", **OPTIONS[option])


@pytest.mark.parametrize(
    "q_dtype, d", [(torch.float32, 64), (torch.bfloat16, 32), (torch.bfloat16, 64)],
    ids=["float32-D64", "bfloat16-D32", "bfloat16-D64"])
@pytest.mark.parametrize("len_q", [1, 3])
def test_every_int8_value_reads_as_itself(len_q, q_dtype, d):
    """int8 keys and values of every value, -128 in every column of both: on AVX-512 BF16 chips
    bfloat16 rows score int8 keys at head dims of whole 64s by bfloat16 dot products on keys
    widened by byte tables of absolute values (row_products.h), in which -128's, 0x80, is no
    index and is set apart; at D 32 the keys are converted instead, and float32 rows take float32
    products. Against float64 on the dequantized cache (check)."""
    torch.manual_seed(2)
    lengths_k = [300, 77]
    keys, values = ([torch.randint(-128, 128, (n, 2, d)).float() for n in lengths_k]
                    for _ in range(2))
    for rows in (keys[0], values[0]):
        rows[torch.arange(d), 0, torch.arange(d)] = -128  # column c of key c, KV head 0
        rows[torch.arange(d) + 100, 1, torch.arange(d)] = -128
    queries = [torch.randn(len_q, 8, d).to(q_dtype) for _ in lengths_k]
    k_cache, v_cache, table = paged(keys, values, 16)
    k8, v8 = (cache.nan_to_num(0).to(torch.int8) for cache in (k_cache, v_cache))
    check_stored(queries, lengths_k, k8, v8, table, 0.01, 0.02, 16)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1), (32, 1)],
                         ids=["MHA", "GQA", "MQA", "MQA32"])
@pytest.mark.parametrize("fmt", list(FORMATS), ids=str)
def test_grouped_heads(fmt, heads, q_dtype):
    torch.manual_seed(1)
    hq, hkv = heads
    queries, keys, values = sequences([1, 9, 1], [50, 60, 300], hq=hq, hkv=hkv, d=64, dv=64,
                                      q_dtype=q_dtype)
    check(queries, keys, values, fmt, "tensor", page_size=16, window=(100, 0), softcap=5.0)


def test_the_lse_is_the_dequantized_caches():
    torch.manual_seed(2)
    queries, keys, values = sequences([1, 4], [20, 45])
    k_cache, v_cache, table = paged(keys, values, 16)
    k8, k_scale = quantize(k_cache, torch.float8_e4m3fn, "token")
    v8, v_scale = quantize(v_cache, torch.float8_e4m3fn, "token")
    cu = torch.tensor([0, 1, 5], dtype=torch.int32)
    lengths = torch.tensor([20, 45], dtype=torch.int32)
    _, lse = paged_attention(torch.cat(queries), k8, v8, table, lengths, cu_seqlens_q=cu,
                             max_seqlen_q=4, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    k_real = pages_of([20, 45], dequantized(k8, k_scale), table, 16)
    v_real = pages_of([20, 45], dequantized(v8, v_scale), table, 16)
    for b in range(2):
        q, k, v = (t.transpose(0, 1) for t in (queries[b], k_real[b], v_real[b]))
        torch.testing.assert_close(lse[:, cu[b]:cu[b + 1]], ca.attention_forward(q, k, v, 32**-0.5)[1])


def test_scales_given_as_floats_tensors_or_not_at_all():
    """A per-tensor scale as a float, a 0-d or a one-element tensor gives the same result;
    without scales the stored values are the keys and values (scale 1)."""
    torch.manual_seed(3)
    queries, keys, values = sequences([1, 2], [40, 17])
    k_cache, v_cache, table = paged(keys, values, 16)
    k8, v8 = (t.clamp(-8, 8).to(torch.float8_e5m2) for t in (k_cache, v_cache))
    results = [call(queries, k8, v8, table, [40, 17], k_scale=s, v_scale=s)
               for s in (0.5, torch.tensor(0.5), torch.tensor([0.5], dtype=torch.float64))]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    unscaled = call(queries, k8, v8, table, [40, 17])
    widened = call(queries, k8.float(), v8.float(), table, [40, 17])
    for a, b in zip(unscaled, widened):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("stretch", [1, 8], ids=["pages_shuffled", "pages_in_stretches"])
def test_the_same_bits_at_one_and_two_threads(stretch):
    """Long caches are cut into key splits whose number follows the thread count: the results
    are still bitwise the same, with pages read one a run or in stretches of pages in order."""
    torch.manual_seed(4)
    queries, keys, values = sequences([1, 1, 30], [5000, 3000, 4000], hq=8, hkv=2, d=64, dv=64)
    k_cache, v_cache, table = paged(keys, values, 16, stretch=stretch)
    k8, k_scale = quantize(k_cache, torch.int8, "token")
    v8, v_scale = quantize(v_cache, torch.int8, "token")
    results = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        results.append(torch.cat(call(queries, k8, v8, table, [5000, 3000, 4000],
                                      k_scale=k_scale, v_scale=v_scale)))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_the_caches_are_read_in_place():
    """A strided view of an interleaved (num_pages, 2, page_size, Hkv, D) pool (vLLM's
    kv_cache[:, 0] and [:, 1]) reads as its contiguous copy."""
    torch.manual_seed(5)
    pool = torch.randint(-100, 100, (6, 2, 16, 2, 32), dtype=torch.int8)
    table = torch.tensor([[4, 1, 3], [0, 5, 2]], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 32)
    lengths = torch.tensor([40, 33], dtype=torch.int32)
    strided = paged_attention(q, pool[:, 0], pool[:, 1], table, lengths, k_scale=0.01,
                              v_scale=0.02)
    copied = paged_attention(q, pool[:, 0].contiguous(), pool[:, 1].contiguous(), table, lengths,
                             k_scale=0.01, v_scale=0.02)
    assert torch.equal(strided, copied)


def small_call(**changes):
    k = torch.zeros(3, 4, 2, 8, dtype=torch.int8)
    arguments = dict(q=torch.randn(1, 1, 2, 8), k_cache=k, v_cache=k.clone(),
                     block_table=torch.tensor([[0, 1]], dtype=torch.int32),
                     cache_seqlens=torch.tensor([6], dtype=torch.int32))
    arguments.update(changes)
    return paged_attention(**arguments)


BAD = {
    "k_scale of a wrong shape": (dict(k_scale=torch.ones(3, 4)), ValueError, "k_scale"),
    "v_scale of a wrong shape": (dict(v_scale=torch.ones(3, 4, 3)), ValueError, "v_scale"),
    "per-token float64": (dict(k_scale=torch.ones(3, 4, 2, dtype=torch.float64)), TypeError,
                          "k_scale"),
    "integer per tensor": (dict(v_scale=torch.tensor(2)), TypeError, "v_scale"),
    "zero": (dict(k_scale=0.0), ValueError, "k_scale"),
    "negative": (dict(v_scale=-1.0), ValueError, "v_scale"),
    "nan": (dict(k_scale=float("nan")), ValueError, "k_scale"),
    "inf": (dict(v_scale=float("inf")), ValueError, "v_scale"),
    "beyond float32": (dict(k_scale=1e300), ValueError, "k_scale"),
    "a read slot's zero": (dict(k_scale=torch.ones(3, 4, 2).index_put_(
        (torch.tensor([1]), torch.tensor([1]), torch.tensor([1])), torch.tensor(0.0))),
        ValueError, r"k_scale\[1\]\[1\]\[1\]"),
    "a read slot's nan": (dict(v_scale=torch.ones(3, 4, 2).index_put_(
        (torch.tensor([0]), torch.tensor([3]), torch.tensor([0])), torch.tensor(float("nan")))),
        ValueError, r"v_scale\[0\]\[3\]\[0\]"),
    "scale beside a float cache": (dict(k_cache=torch.zeros(3, 4, 2, 8),
                                        v_cache=torch.zeros(3, 4, 2, 8), k_scale=2.0),
                                   ValueError, "k_scale dequantizes an 8-bit cache"),
    "8-bit beside float": (dict(v_cache=torch.zeros(3, 4, 2, 8)), TypeError, "share one dtype"),
    "two 8-bit dtypes": (dict(v_cache=torch.zeros(3, 4, 2, 8, dtype=torch.float8_e5m2)),
                         TypeError, "share one dtype"),
    "float64 q": (dict(q=torch.randn(1, 1, 2, 8, dtype=torch.float64)), TypeError, "q must be"),
    "uint8 cache": (dict(k_cache=torch.zeros(3, 4, 2, 8, dtype=torch.uint8),
                         v_cache=torch.zeros(3, 4, 2, 8, dtype=torch.uint8)), TypeError,
                    "k_cache must have q's dtype"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_dtypes_and_scales_are_refused(case):
    changes, error, match = BAD[case]
    with pytest.raises(error, match=match):
        small_call(**changes)


def per_token_scales(layout, value=None, slot=None):
    """small_call's (3, 4, 2) per-token scales, 1 but `value` at `slot`: contiguous, as
    paged_cache_append writes them (each page's scales checked at once), or a transposed view of
    (3, 2, 4) storage (checked one by one)."""
    scales = torch.ones(3, 4, 2) if layout == "contiguous" else torch.ones(3, 2, 4).transpose(1, 2)
    if slot is not None:
        scales[slot] = value
    return scales


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("value", [0.0, -0.0, -1.0, -1e-45, math.nan, math.inf, -math.inf])
def test_every_read_slot_of_per_token_scales_is_checked(layout, value):
    """A bad scale in any slot a sequence reads (the 6 keys on pages 0 and 1, both heads) is named
    exactly, whichever layout the scales have."""
    for key in range(6):
        for head in range(2):
            slot = (key // 4, key % 4, head)
            match = r"v_scale\[{}\]\[{}\]\[{}\]=".format(*slot)
            with pytest.raises(ValueError, match=match):
                small_call(k_scale=per_token_scales(layout),
                           v_scale=per_token_scales(layout, value, slot))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("value", [1e-45, torch.finfo(torch.float32).tiny,
                                   torch.finfo(torch.float32).max])
def test_the_edges_of_the_positive_finite_scales_are_accepted(layout, value):
    """The smallest subnormal, the smallest normal and the largest float32 are valid scales in
    every read slot (the zero cache keeps the output finite even at the largest)."""
    scales = per_token_scales(layout).fill_(value)
    assert float(scales[0, 0, 0]) > 0
    out = small_call(k_scale=scales, v_scale=scales)
    assert torch.isfinite(out).all()


def test_a_slot_no_sequence_reads_may_hold_any_scale():
    """Scales are checked where the sequences read them: a pool's unwritten slots (zeros, as a
    fresh pool may hold) are never looked at."""
    scales = torch.zeros(3, 4, 2)
    scales[:2, :, :] = 1.0
    scales[1, 2:] = 0.0  # the sixth key is the last read: slots 2 and 3 of page 1 are not
    out = small_call(k_scale=scales, v_scale=scales)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("window", [(-1, 0), (40, 0)])
@pytest.mark.parametrize("len_q", [1, 3, 5])
def test_e4m3_nan_bytes_reach_exactly_the_rows_that_see_them(len_q, window, d, q_dtype):
    """The decode's products read e4m3 rows without setting NaN's byte apart, and each key block
    sets it apart itself (decode.h): a NaN in a key must give NaN to exactly the rows that see that
    key, a NaN in a value to the columns of the rows that see its row, as a float64 reference on
    the dequantized cache does, with every other output as close as without NaN. A KV head's task
    has 4 query heads x len_q rows: the scores' tiles of few rows (1, 3) and the transposed scores
    of 16 rows or more, over a widened copy of the keys (5: 20 rows). A block's rows are tested
    all at once, by vectors of 64 (AVX-512) or 32 (AVX2) bytes and the rest of a row apart: two
    of the NaN bytes lie in the last column, past the last whole vector with D = 80. bfloat16
    rows at D = 64 and fewer than 16 rows a task (len_q 1 and 3) take the pair dot products on
    AVX-512 BF16 chips, whose byte tables carry a key's NaN into its scores themselves; and where
    every row sees the whole block (len_q 1 without the window), the values' pair products, whose
    tables carry a value's NaN into its column (those blocks' value rows are not tested)."""
    torch.manual_seed(3)
    batch, hkv, hq, page = 3, 2, 8, 16
    lengths = [300, 250, 120]
    table_width = (max(lengths) + page - 1) // page
    pages = batch * table_width
    k, v = (torch.randint(-100, 101, (pages, page, hkv, d), dtype=torch.int8)
            .to(torch.float8_e4m3fn) for _ in range(2))
    # (page, row, KV head, column): far from the last query rows (the window hides them) and
    # near them (it does not)
    k.view(torch.uint8)[5, 3, 1, 7] = 0x7F  # key 83 of sequence 0
    k.view(torch.uint8)[18, 2, 0, d - 1] = 0xFF  # key 290 of sequence 0
    v.view(torch.uint8)[20, 2, 0, 9] = 0xFF  # key 18 of sequence 1
    v.view(torch.uint8)[34, 0, 1, d - 1] = 0x7F  # key 240 of sequence 1
    v.view(torch.uint8)[40, 0, 1, 0] = 0x7F  # key 32 of sequence 2
    k.view(torch.uint8)[44, 4, 1, 3] = 0x7F  # key 100 of sequence 2
    table = torch.arange(pages, dtype=torch.int32).view(batch, table_width)
    k_scale, v_scale, scale = 0.01, 0.02, d ** -0.5
    q = torch.randn(batch, len_q, hq, d).to(q_dtype)
    out = paged_attention(q, k, v, table, torch.tensor(lengths, dtype=torch.int32),
                          k_scale=k_scale, v_scale=v_scale, window=window)
    expected = torch.zeros(batch, len_q, hq, d, dtype=torch.float64)
    for b, length in enumerate(lengths):
        keys, values = (c[table[b].long()].flatten(0, 1)[:length].double() * s
                        for c, s in ((k, k_scale), (v, v_scale)))
        for i in range(len_q):
            position = length - len_q + i
            first = 0 if window[0] < 0 else max(0, position - window[0])
            for h in range(hq):
                g = h // (hq // hkv)
                scores = keys[first:position + 1, g] @ q[b, i, h].double() * scale
                expected[b, i, h] = torch.softmax(scores, 0) @ values[first:position + 1, g]
    nan = expected.isnan()
    assert nan.any() and (~nan).any()
    assert torch.equal(out.isnan(), nan)
    torch.testing.assert_close(out[~nan].double(), expected[~nan], atol=TOLERANCE[q_dtype], rtol=0)
