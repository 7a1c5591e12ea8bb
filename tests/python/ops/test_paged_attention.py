"""paged_attention: attention against a paged KV cache read in place through its block table
equals the op on the gathered contiguous cache (float32 summation order aside), and float64
references, for decode rows, prefill chunks and mixed packed batches, every dtype and score
option, GQA, pages of 1 to 272 rows, caches of 0 to 100k tokens, shuffled, shared and repeated
pages; it is deterministic, traces under opcheck, compile and export, and refuses bad tables
with typed errors naming them."""

import random

import pytest
import torch

import causal_attention as ca
from attention_testing.paged import paged
from causal_attention import paged_attention

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2,
             torch.float16: 2e-3}


def reference(queries, keys, values, dtype=None, **options):
    """Each sequence's queries (Lq_b, Hq, D) against its keys by the contiguous op, as
    (Lq_b, Hq, Dv); in ``dtype`` where given (float64: the exact reference)."""
    outs = []
    for q, k, v in zip(queries, keys, values):
        if dtype is not None:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        out = ca.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), **options)
        outs.append(out.transpose(0, 1))
    return outs


def sequences(lengths_q, lengths_k, hq=4, hkv=2, d=16, dv=8, dtype=torch.float32):
    queries = [torch.randn(lq, hq, d).to(dtype) for lq in lengths_q]
    keys = [torch.randn(lk, hkv, d).to(dtype) for lk in lengths_k]
    values = [torch.randn(lk, hkv, dv).to(dtype) for lk in lengths_k]
    return queries, keys, values


def packed_call(queries, k_cache, v_cache, table, lengths_k, **options):
    cu = torch.tensor([0] + [q.shape[0] for q in queries], dtype=torch.int32).cumsum(0)
    out = paged_attention(torch.cat(queries), k_cache, v_cache, table,
                          torch.tensor(lengths_k, dtype=torch.int32), cu_seqlens_q=cu.int(),
                          max_seqlen_q=max(q.shape[0] for q in queries), **options)
    return [out[cu[b]:cu[b + 1]] for b in range(len(queries))]


def assert_matches(got, queries, keys, values, dtype, **options):
    same_dtype = reference(queries, keys, values, **options)
    exact = reference(queries, keys, values, dtype=torch.float64, **options)
    for b, (g, r, e) in enumerate(zip(got, same_dtype, exact)):
        torch.testing.assert_close(g, r, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                   msg=lambda m: f"sequence {b}: {m}")
        if g.numel() == 0:  # a sequence without queries
            continue
        # And as close to float64 as the contiguous op is (twice, for the summation order).
        bound = 2 * (r.double() - e).abs().max().item() + TOLERANCE[dtype] / 10
        assert (g.double() - e).abs().max().item() <= bound, b


OPTIONS = {
    "causal": {},
    "window": {"window": (5, 0)},
    "softcap": {"softcap": 3.0},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
    "sinks": {"sinks": torch.tensor([0.3, -1.0, 2.0, 0.0])},
    "full": {"window": (-1, -1)},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64, 272])
def test_decode_rows_equal_the_gathered_cache(page_size, dtype):
    lengths_k = [1, 300, 77, 16]
    queries, keys, values = sequences([1] * 4, lengths_k, dtype=dtype)
    k_cache, v_cache, table = paged(keys, values, page_size)
    out = paged_attention(torch.stack(queries), k_cache, v_cache, table,
                          torch.tensor(lengths_k, dtype=torch.int32))
    assert out.shape == (4, 1, 4, 8) and out.dtype == dtype
    assert_matches(list(out), queries, keys, values, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_mixed_batch_of_prefill_chunks_and_decodes_in_one_call(option, dtype):
    # The fifth has no key (and no query), the sixth more queries than keys: its first rows see
    # no key and get zeros, as the contiguous op's.
    lengths_q, lengths_k = [1, 40, 1, 7, 0, 33, 6], [129, 40, 5, 300, 0, 70, 2]
    queries, keys, values = sequences(lengths_q, lengths_k, dtype=dtype)
    k_cache, v_cache, table = paged(keys, values, 16)
    options = OPTIONS[option]
    got = packed_call(queries, k_cache, v_cache, table, lengths_k, **options)
    assert_matches(got, queries, keys, values, dtype, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gap_rows", [0, 1], ids=["pages_continue", "pages_apart"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("group", [4, 16])
def test_pages_in_order_are_read_across_their_ends(group, page_size, gap_rows, dtype):
    """Pages that follow one another in the pool (PagedKVCache lays a request's pages so) are
    read as one run of rows, up to the first page that does not follow; where the cache is a
    view whose pages have NaN rows between them, never across a page's end. Decode rows (the
    register products; with a group of 16, the block products), and prefill chunks (blocks
    packed from the pages)."""
    lengths_q, lengths_k = [1, 3, 40, 1], [300, 129, 90, 64]
    queries, keys, values = sequences(lengths_q, lengths_k, hq=2 * group, hkv=2, d=64, dv=32,
                                      dtype=dtype)
    k_cache, v_cache, table = paged(keys, values, page_size, stretch=6, gap_rows=gap_rows)
    assert_matches(packed_call(queries, k_cache, v_cache, table, lengths_k), queries, keys,
                   values, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64, 272])
def test_prefill_chunks_multiply_blocks_packed_from_the_pages(page_size, dtype):
    """Chunks of more query rows than the decode path takes go through the block products, their
    key blocks packed from the pages run by run (a block spans many 1- or 16-row pages, or lies
    inside one 272-row page): the gathered cache's results, as close to float64."""
    lengths_q, lengths_k = [33, 100, 300, 40], [33, 700, 300, 129]
    queries, keys, values = sequences(lengths_q, lengths_k, hq=4, hkv=2, d=64, dv=32, dtype=dtype)
    k_cache, v_cache, table = paged(keys, values, page_size)
    got = packed_call(queries, k_cache, v_cache, table, lengths_k)
    assert_matches(got, queries, keys, values, dtype)


GROUP_OPTIONS = {
    "causal": {},
    "window": {"window": (70, 0)},  # a window's first block is seen in part: register values
    "softcap-alibi-sinks": {"softcap": 4.0, "alibi_slopes": torch.linspace(0.01, 0.5, 32),
                            "sinks": torch.linspace(-1, 1, 32)},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [7, 16])
@pytest.mark.parametrize("option", list(GROUP_OPTIONS))
def test_decode_groups_of_many_rows_multiply_blocks(option, page_size, dtype):
    """At least 16 query rows a KV head (16 query heads a KV head, decode rows and chunks of 2
    and 4: 16 to 64 rows) of bfloat16/float16, where this CPU's products of them are native,
    multiply each key block through block_gemm, K_j^T packed from pages that cut the blocks
    (7 rows) or tile them (16); the values' product only for blocks that every row sees whole
    (a chunk's last block and a window's first take the register products). Elsewhere the
    register products compute it all. The gathered cache's results (which the same products
    compute) and within the dtype's tolerance of float64 (whose rows take the register
    products)."""
    lengths_q, lengths_k = [1, 4, 2, 1], [300, 1000, 77, 5]
    queries, keys, values = sequences(lengths_q, lengths_k, hq=32, hkv=2, d=40, dv=24,
                                      dtype=dtype)
    k_cache, v_cache, table = paged(keys, values, page_size)
    options = GROUP_OPTIONS[option]
    got = packed_call(queries, k_cache, v_cache, table, lengths_k, **options)
    assert_matches(got, queries, keys, values, dtype, **options)
    exact = reference(queries, keys, values, dtype=torch.float64, **options)
    for g, e in zip(got, exact):
        torch.testing.assert_close(g.double(), e, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_many_row_chunk_reads_an_infinite_value_only_where_a_row_sees_it(dtype):
    """The last key's value is infinite: the chunk's earlier rows do not see it, so the block's
    values go through the register products, which leave it out of their sums (a block product,
    where bfloat16 rows take them, would weigh it by zero: NaN). Those rows are finite and the gathered cache's; the last row's
    infinity is the gathered cache's too."""
    queries, keys, values = sequences([4], [200], hq=32, hkv=2, d=40, dv=24, dtype=dtype)
    values[0][-1, :, 3] = float("inf")
    k_cache, v_cache, table = paged(keys, values, 16)
    got = packed_call(queries, k_cache, v_cache, table, [200])[0]
    want = reference(queries, keys, values)[0]
    assert torch.isfinite(got[:3]).all()
    torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                               equal_nan=True)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["MHA", "GQA", "MQA"])
def test_grouped_heads_read_their_kv_head(heads):
    hq, hkv = heads
    lengths_q, lengths_k = [1, 9, 1], [50, 60, 200]
    queries, keys, values = sequences(lengths_q, lengths_k, hq=hq, hkv=hkv, d=32, dv=32)
    k_cache, v_cache, table = paged(keys, values, 64)
    slopes = torch.linspace(0.1, 1.0, hq)
    got = packed_call(queries, k_cache, v_cache, table, lengths_k, alibi_slopes=slopes,
                      window=(30, 0), softcap=5.0)
    assert_matches(got, queries, keys, values, torch.float32, alibi_slopes=slopes,
                   window=(30, 0), softcap=5.0)


def test_per_sequence_alibi_slopes_and_the_lse():
    lengths_q, lengths_k = [1, 3], [20, 45]
    queries, keys, values = sequences(lengths_q, lengths_k)
    k_cache, v_cache, table = paged(keys, values, 16)
    slopes = torch.rand(2, 4)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    out, lse = paged_attention(torch.cat(queries), k_cache, v_cache, table,
                               torch.tensor(lengths_k, dtype=torch.int32), cu_seqlens_q=cu,
                               max_seqlen_q=3, alibi_slopes=slopes, return_lse=True)
    assert lse.shape == (4, 4) and lse.dtype == torch.float32
    for b in range(2):
        q, k, v = (t.transpose(0, 1) for t in (queries[b], keys[b], values[b]))
        ref_out, ref_lse = ca.attention_forward(q, k, v, 0.25, alibi_slopes=slopes[b])
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], ref_out.transpose(0, 1))
        torch.testing.assert_close(lse[:, cu[b]:cu[b + 1]], ref_lse)


def test_a_dense_call_without_query_rows_gives_empty_results():
    queries, keys, values = sequences([0, 0], [10, 30])
    k_cache, v_cache, table = paged(keys, values, 16)
    out, lse = paged_attention(torch.zeros(2, 0, 4, 16), k_cache, v_cache, table,
                               torch.tensor([10, 30], dtype=torch.int32),
                               alibi_slopes=OPTIONS["alibi"]["alibi_slopes"], return_lse=True)
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 4, 0)


def test_the_dense_lse_is_flash_attns_layout():
    queries, keys, values = sequences([2, 2], [10, 30])
    k_cache, v_cache, table = paged(keys, values, 16)
    out, lse = paged_attention(torch.stack(queries), k_cache, v_cache, table,
                               torch.tensor([10, 30], dtype=torch.int32), return_lse=True)
    assert out.shape == (2, 2, 4, 8) and lse.shape == (2, 4, 2)
    for b in range(2):
        q, k, v = (t.transpose(0, 1) for t in (queries[b], keys[b], values[b]))
        torch.testing.assert_close(lse[b], ca.attention_forward(q, k, v, 0.25)[1])


@pytest.mark.parametrize("length", [0, 1, 271, 272, 273, 100_000])
def test_caches_of_zero_to_a_hundred_thousand_tokens(length):
    queries, keys, values = sequences([min(length, 1)], [length], hq=2, hkv=1, d=16, dv=16)
    k_cache, v_cache, table = paged(keys, values, 272)
    got = packed_call(queries, k_cache, v_cache, table, [length])
    if length == 0:
        assert got[0].shape == (0, 2, 16)
    else:
        assert_matches(got, queries, keys, values, torch.float32)


# Per trial: the pages' sizes, the table's width range for a page size, the least keys a sequence
# holds and its query rows: chunks of 33 to 90 beside decode rows take the block path, their keys
# packed from the pages.
FUZZ_ROWS = {
    "decode rows": ([1, 3, 16, 37], lambda page: (1, 6), 0,
                    lambda rng, keys: rng.randint(0, min(keys, 5))),
    "prefill chunks": ([1, 5, 16, 37], lambda page: (90 // page + 1, 90 // page + 4), 33,
                       lambda rng, keys: rng.choice([1, rng.randint(33, min(keys, 90))])),
}


@pytest.mark.parametrize("rows", list(FUZZ_ROWS))
def test_fuzzed_tables_shuffled_shared_and_repeated_pages(rows):
    """Random pools read through random tables: pages shuffled, several rows naming one page,
    and a page named twice in one row, against the gathered keys they name."""
    page_sizes, widths, least_keys, query_rows = FUZZ_ROWS[rows]
    rng = random.Random(1)
    for trial in range(30):
        page_size = rng.choice(page_sizes)
        pool = rng.randint(1, 12)
        hkv, group = rng.choice([1, 2]), rng.choice([1, 3])
        k_cache = torch.randn(pool, page_size, hkv, 8)
        v_cache = torch.randn(pool, page_size, hkv, 8)
        batch = rng.randint(1, 4)
        width = rng.randint(*widths(page_size))
        table = torch.tensor([[rng.randrange(pool) for _ in range(width)] for _ in range(batch)],
                             dtype=torch.int32)
        lengths_k = [rng.randint(least_keys, width * page_size) for _ in range(batch)]
        lengths_q = [query_rows(rng, n) for n in lengths_k]
        keys = [k_cache[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lengths_k)]
        values = [v_cache[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lengths_k)]
        queries = [torch.randn(n, hkv * group, 8) for n in lengths_q]
        got = packed_call(queries, k_cache, v_cache, table, lengths_k)
        for b, (g, r) in enumerate(zip(got, reference(queries, keys, values))):
            torch.testing.assert_close(g, r, rtol=2e-6, atol=2e-6, msg=f"trial {trial} seq {b}")


@pytest.mark.parametrize("stretch", [1, 8], ids=["pages_shuffled", "pages_in_stretches"])
def test_bitwise_the_same_run_after_run_at_any_thread_count(restore_num_threads, stretch):
    lengths_q, lengths_k = [1, 64, 1], [5000, 700, 12000]
    queries, keys, values = sequences(lengths_q, lengths_k, hq=8, hkv=2, d=64, dv=64)
    k_cache, v_cache, table = paged(keys, values, 16, stretch=stretch)
    runs = []
    for threads in (1, 2, 1, 2):
        torch.set_num_threads(threads)
        runs.append(torch.cat(packed_call(queries, k_cache, v_cache, table, lengths_k)))
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_the_cache_is_read_not_written():
    queries, keys, values = sequences([1, 3], [40, 60])
    k_cache, v_cache, table = paged(keys, values, 16)
    before = k_cache.clone(), v_cache.clone(), table.clone()
    packed_call(queries, k_cache, v_cache, table, [40, 60])
    for t, b in zip((k_cache, v_cache, table), before):
        assert torch.equal(t.nan_to_num(7.0), b.nan_to_num(7.0))


def call_args(batch=2, lq=1, page_size=4, pages=6, hq=2, hkv=1, d=8, dtype=torch.float32):
    return dict(q=torch.randn(batch, lq, hq, d, dtype=dtype),
                k_cache=torch.randn(pages, page_size, hkv, d, dtype=dtype),
                v_cache=torch.randn(pages, page_size, hkv, d, dtype=dtype),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)[:batch],
                cache_seqlens=torch.tensor([5, 8], dtype=torch.int32)[:batch])


def with_changes(**changes):
    args = call_args()
    args.update(changes)
    return args


BAD_CALLS = [
    pytest.param(with_changes(block_table=torch.tensor([[0, 6], [2, 3]], dtype=torch.int32)),
                 ValueError, r"block_table\[0\]\[1\]=6 names no page of the pool",
                 id="page-past-the-pool"),
    pytest.param(with_changes(block_table=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)),
                 ValueError, r"block_table\[0\]\[1\]=-1", id="negative-page"),
    pytest.param(with_changes(cache_seqlens=torch.tensor([5, 9], dtype=torch.int32)),
                 ValueError, r"cache_seqlens\[1\]=9 must lie in \[0, 8\]", id="beyond-the-pages"),
    pytest.param(with_changes(cache_seqlens=torch.tensor([-1, 8], dtype=torch.int32)),
                 ValueError, r"cache_seqlens\[0\]=-1", id="negative-length"),
    pytest.param(with_changes(block_table=torch.tensor([[0, 1], [2, 3]])), TypeError,
                 "block_table must be int32", id="int64-table"),
    pytest.param(with_changes(cache_seqlens=torch.tensor([5, 8])), TypeError,
                 "cache_seqlens must be int32", id="int64-seqlens"),
    pytest.param(with_changes(k_cache=torch.randn(6, 4, 1, 8, dtype=torch.float64)), TypeError,
                 "k_cache must have q's dtype", id="cache-dtype"),
    pytest.param(with_changes(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
                 r"block_table must be \(B, max_pages\) with B=2", id="table-rows"),
    pytest.param(with_changes(cache_seqlens=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
                 r"cache_seqlens must be \(B,\)", id="seqlens-shape"),
    pytest.param(with_changes(v_cache=torch.randn(5, 4, 1, 8)), ValueError,
                 "k_cache and v_cache must be", id="v-pages"),
    pytest.param(with_changes(q=torch.randn(2, 1, 3, 8), k_cache=torch.randn(6, 4, 2, 8),
                              v_cache=torch.randn(6, 4, 2, 8)), ValueError,
                 "multiple of the caches' Hkv", id="heads"),
    pytest.param(with_changes(q=torch.randn(2, 2, 8)), ValueError, r"q must be \(B, Lq, Hq, D\)",
                 id="q-rank"),
    # A page of no token: refused before any page is found by dividing by its size, as with an
    # empty table (a SIGFPE before; issue 41, D15).
    pytest.param(with_changes(k_cache=torch.randn(4, 0, 1, 8), v_cache=torch.randn(4, 0, 1, 8)),
                 ValueError, r"pages must hold at least one token .* k_cache.shape=\[4, 0, 1, 8\]",
                 id="page-size-0"),
    pytest.param(with_changes(k_cache=torch.randn(4, 0, 1, 8), v_cache=torch.randn(4, 0, 1, 8),
                              block_table=torch.zeros(2, 0, dtype=torch.int32),
                              cache_seqlens=torch.zeros(2, dtype=torch.int32)),
                 ValueError, "pages must hold at least one token", id="page-size-0-empty-table"),
    pytest.param(with_changes(block_table=torch.zeros(2, 2, dtype=torch.int32, device="meta")),
                 ValueError, "block_table must be a CPU tensor", id="table-device"),
]


@pytest.mark.parametrize("args, error, match", BAD_CALLS)
def test_bad_calls_raise_typed_errors_naming_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        paged_attention(**args)


def test_more_keys_than_int32_counts_are_refused():
    """A table naming one page over and over can describe 2^31 keys with a one-page pool: the
    total is refused before the kernels count it."""
    k_cache = torch.randn(1, 4096, 1, 8)
    table = torch.zeros(2, 2**19, dtype=torch.int32)
    lengths = torch.tensor([2**31 - 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="more than 2\\^31 - 1 keys"):
        paged_attention(torch.randn(2, 1, 1, 8), k_cache, k_cache, table, lengths)


def test_bad_packed_calls():
    args = call_args()
    q = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        paged_attention(q, args["k_cache"], args["v_cache"], args["block_table"],
                        args["cache_seqlens"], cu_seqlens_q=torch.tensor([0, 1, 3],
                                                                          dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):  # ends at 2, q has 3 rows
        paged_attention(q, args["k_cache"], args["v_cache"], args["block_table"],
                        args["cache_seqlens"],
                        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1)
    with pytest.raises(ValueError, match="max_seqlen_q goes with cu_seqlens_q"):
        paged_attention(args["q"], args["k_cache"], args["v_cache"], args["block_table"],
                        args["cache_seqlens"], max_seqlen_q=1)


def test_opcheck_compile_and_export():
    args = call_args()
    op = torch.ops.causal_attention.paged_attention.default
    positional = (args["q"], args["k_cache"], args["v_cache"], args["block_table"],
                  args["cache_seqlens"])
    torch.library.opcheck(op, positional, {"softcap": 2.0},
                          test_utils=("test_schema", "test_faketensor"))

    def decode(q, k_cache, v_cache, block_table, cache_seqlens):
        return paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, softcap=2.0)

    eager = decode(*positional)
    compiled = torch.compile(decode, fullgraph=True)(*positional)
    assert torch.equal(compiled, eager)

    class Decode(torch.nn.Module):
        def forward(self, *tensors):
            return decode(*tensors)

    exported = torch.export.export(Decode(), positional)
    assert "causal_attention.paged_attention" in str(exported.graph)
    assert torch.equal(exported.module()(*positional), eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lengths", [(1, 3000), (3, 500), (1, 70)], ids=str)
def test_reduced_precision_pages_give_the_contiguous_ops_bits(lengths, dtype):
    """A bfloat16 or float16 decode reads the pages' rows where they lie, run by run, and the
    contiguous op reads its rows at one stride: the same values in the same order of sums, so
    bitwise the contiguous op's results."""
    torch.manual_seed(7)
    len_q, length = lengths
    batch, hq, hkv, d, page = 3, 8, 2, 64, 16
    k, v = (torch.randn(batch, hkv, length, d).to(dtype) for _ in range(2))
    q = torch.randn(batch, hq, len_q, d).to(dtype)
    pages = length // page + 1
    caches = []
    for t in (k, v):
        cache = torch.zeros(batch * pages, page, hkv, d, dtype=dtype)
        cache.view(batch, pages * page, hkv, d)[:, :length] = t.transpose(1, 2)
        caches.append(cache)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    out = paged_attention(q.transpose(1, 2).contiguous(), *caches, table,
                          torch.full((batch,), length, dtype=torch.int32))
    assert torch.equal(out.transpose(1, 2), ca.attention(q, k, v))
