"""paged_attention's spec_mask: which of its sequence's new tokens each query row sees (a step
that verifies a chain or a tree of draft tokens), every cached key before them visible.

Held against the op on each sequence's gathered keys with the same mask as an attn_mask (float64
within 1e-12, every score option), and against SDPA with that mask by the suite's rule (at most
twice SDPA's error against float64) in every dtype; through flash_attn_with_kvcache (paged and
dense caches) and PagedKVCache.step; bad masks get typed errors naming spec_mask.
"""

import pytest
import torch
import torch.nn.functional as F

import causal_attention
from attention_testing.paged import paged
from attention_testing.tolerances import twice_sdpa_error_failures
from causal_attention.integrations.flash_attn import flash_attn_with_kvcache

HQ, HKV, D = 4, 2, 32


def _tree(n: int, generator: torch.Generator) -> torch.Tensor:
    """(n, n) bool: token i sees its ancestors in a random tree over the n tokens (each token's
    parent an earlier one, token 0 the root) and itself."""
    sees = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = int(torch.randint(0, i, (1,), generator=generator))
        sees[i] |= sees[parent]
    return sees


def _step(dtype, cache_lens, new_tokens, page_size, mask_kind, seed=0):
    """A packed step: q (total, HQ, D), the pages of each sequence's keys (its cache plus its new
    tokens) and the spec_mask (total, max new tokens) of the mask kind ("tree" or "chain")."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(cache_lens, new_tokens)]
    keys = [torch.randn(n, HKV, D, generator=g).to(dtype) for n in lens]
    values = [torch.randn(n, HKV, D, generator=g).to(dtype) for n in lens]
    k_cache, v_cache, table = paged(keys, values, page_size, seed=seed)
    cu = torch.tensor([0] + new_tokens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), HQ, D, generator=g).to(dtype)
    width = max(new_tokens)
    spec = torch.zeros(int(cu[-1]), width, dtype=torch.bool)
    for b, n in enumerate(new_tokens):
        block = _tree(n, g) if mask_kind == "tree" else torch.ones(n, n, dtype=torch.bool).tril()
        spec[cu[b] : cu[b + 1], :n] = block
    return q, keys, values, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), cu, spec


def _sequence_mask(spec, cu, b, n_keys):
    """Sequence b's spec_mask over all its keys, (Lq_b, Lk_b): the cache visible, the new tokens
    as spec_mask says, bottom-right causal."""
    rows = int(cu[b + 1] - cu[b])
    first_new = n_keys - rows
    mask = torch.ones(rows, n_keys, dtype=torch.bool)
    mask[:, first_new:] = spec[cu[b] : cu[b + 1], :rows]
    causal = torch.ones(rows, n_keys, dtype=torch.bool).tril(first_new)
    return mask & causal


def _per_sequence(q, keys, values, cu, fn):
    return torch.cat(
        [
            fn(b, q[cu[b] : cu[b + 1]].transpose(0, 1), keys[b].transpose(0, 1),
               values[b].transpose(0, 1)).transpose(0, 1)
            for b in range(len(keys))
        ]
    )


OPTIONS = {
    "plain": {},
    "window-softcap": {"window": (20, 0), "softcap": 15.0},
    "alibi-sinks": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625]),
                    "sinks": torch.tensor([0.5, -1.0, 0.0, 2.0])},
}


@pytest.mark.parametrize("mask_kind", ["tree", "chain"])
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize(
    "cache_lens, new_tokens, page_size",
    [
        pytest.param([40, 300, 7], [8, 5, 1], 16, id="decode-steps"),
        pytest.param([130, 0, 64], [40, 33, 64], 1, id="chunks-page1"),
        pytest.param([500, 90], [9, 17], 272, id="page272"),
        # Decode rows and a chunk in one call run as two calls of their own (each with its
        # sequences' slices of the mask): the short sequence first.
        pytest.param([37, 37, 900], [2, 40, 5], 16, id="mixed-decode-and-chunk"),
    ],
)
def test_float64_equals_the_op_with_the_mask_as_attn_mask(mask_kind, options, cache_lens,
                                                         new_tokens, page_size):
    q, keys, values, k_cache, v_cache, table, lens, cu, spec = _step(
        torch.float64, cache_lens, new_tokens, page_size, mask_kind)
    kwargs = OPTIONS[options]
    out, lse = causal_attention.paged_attention(
        q, k_cache, v_cache, table, lens, cu_seqlens_q=cu, max_seqlen_q=max(new_tokens),
        spec_mask=spec, return_lse=True, **kwargs)

    def reference(b, qb, kb, vb):
        mask = _sequence_mask(spec, cu, b, kb.shape[1])
        return causal_attention.attention(qb, kb, vb, attn_mask=mask, **kwargs)

    torch.testing.assert_close(out, _per_sequence(q, keys, values, cu, reference), rtol=0,
                               atol=1e-12)
    assert torch.isfinite(lse).all()
    # The mask matters: without it the trees' rows see other branches.
    if mask_kind == "tree" and max(new_tokens) > 2 and not bool(spec.tril().all()):
        plain = causal_attention.paged_attention(
            q, k_cache, v_cache, table, lens, cu_seqlens_q=cu, max_seqlen_q=max(new_tokens),
            **kwargs)
        assert not torch.allclose(plain, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("new_tokens", [[8, 4, 6], [40, 36, 2]], ids=["decode", "chunk"])
def test_within_twice_sdpa_error_with_the_mask(dtype, new_tokens):
    q, keys, values, k_cache, v_cache, table, lens, cu, spec = _step(
        dtype, [200, 37, 1000], new_tokens, 16, "tree", seed=3)
    out = causal_attention.paged_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu,
                                           max_seqlen_q=max(new_tokens), spec_mask=spec)

    def sdpa(b, qb, kb, vb):
        mask = _sequence_mask(spec, cu, b, kb.shape[1])
        kb, vb = (t.repeat_interleave(HQ // HKV, dim=0) for t in (kb, vb))
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)

    same = _per_sequence(q, keys, values, cu, sdpa)
    ref = _per_sequence(q.double(), [k.double() for k in keys], [v.double() for v in values],
                        cu, sdpa)
    failures = twice_sdpa_error_failures(["out"], [out], [same], [ref])
    assert not failures, failures


def test_an_eight_bit_cache_with_the_mask_reads_its_dequantized_keys():
    q, keys, values, k_cache, v_cache, table, lens, cu, spec = _step(
        torch.float32, [100, 30], [6, 9], 16, "tree", seed=5)
    k8, v8 = (t.nan_to_num(0).clamp(-3, 3).mul(40).round().to(torch.int8) for t in (k_cache,
                                                                                       v_cache))
    scale = 1 / 40
    out = causal_attention.paged_attention(q, k8, v8, table, lens, cu_seqlens_q=cu,
                                           max_seqlen_q=9, spec_mask=spec, k_scale=scale,
                                           v_scale=scale)
    want = causal_attention.paged_attention(q.double(), k8.double() * scale, v8.double() * scale,
                                            table, lens, cu_seqlens_q=cu, max_seqlen_q=9,
                                            spec_mask=spec)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)


def test_dense_q_takes_a_batch_of_square_masks():
    batch, lq, cached = 3, 6, 50
    q, keys, values, k_cache, v_cache, table, lens, cu, spec = _step(
        torch.float64, [cached] * batch, [lq] * batch, 16, "tree", seed=7)
    dense = causal_attention.paged_attention(
        q.view(batch, lq, HQ, D), k_cache, v_cache, table, lens,
        spec_mask=spec.view(batch, lq, lq))
    packed = causal_attention.paged_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu,
                                              max_seqlen_q=lq, spec_mask=spec)
    assert torch.equal(dense.reshape(-1, HQ, D), packed)


def test_flash_attn_with_kvcache_takes_the_mask_on_paged_and_dense_caches():
    batch, lq, cached, page = 2, 5, 60, 16
    q, keys, values, k_cache, v_cache, table, lens, cu, spec = _step(
        torch.float64, [cached] * batch, [lq] * batch, page, "tree", seed=11)
    square = spec.view(batch, lq, lq)
    want = causal_attention.paged_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu,
                                            max_seqlen_q=lq, spec_mask=spec).view(batch, lq, HQ, D)
    qb = q.view(batch, lq, HQ, D)
    got_paged = flash_attn_with_kvcache(qb, k_cache, v_cache, cache_seqlens=lens,
                                        block_table=table, causal=True, spec_mask=square)
    torch.testing.assert_close(got_paged, want, rtol=0, atol=1e-12)
    dense_k = torch.zeros(batch, 80, HKV, D, dtype=torch.float64)
    dense_v = torch.zeros(batch, 80, HKV, D, dtype=torch.float64)
    for b in range(batch):
        dense_k[b, : keys[b].shape[0]], dense_v[b, : values[b].shape[0]] = keys[b], values[b]
    got_dense = flash_attn_with_kvcache(qb, dense_k, dense_v, cache_seqlens=lens, causal=True,
                                        spec_mask=square)
    torch.testing.assert_close(got_dense, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="causal=True"):
        flash_attn_with_kvcache(qb, dense_k, dense_v, cache_seqlens=lens, spec_mask=square)


def test_a_paged_step_carries_the_mask_to_every_layer():
    torch.manual_seed(0)
    cache = causal_attention.PagedKVCache(num_pages=8, page_size=4, num_layers=1,
                                          num_kv_heads=HKV, head_dim=D)
    cache.allocate("a")
    cache.allocate("b")
    prefill = cache.step(["a", "b"], [6, 3])
    prefill.attend(0, torch.randn(9, HQ, D), torch.randn(9, HKV, D), torch.randn(9, HKV, D))
    # Request a verifies a root and two branches, request b a chain of two.
    spec = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    verify = cache.step(["a", "b"], [3, 2], spec_mask=spec)
    q, k, v = torch.randn(5, HQ, D), torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    got = verify.attend(0, q, k, v)
    want = causal_attention.paged_attention(
        q, cache.key_pages[0], cache.value_pages[0], verify.block_table, verify.seqlens,
        cu_seqlens_q=verify.cu_seqlens_q, max_seqlen_q=3, spec_mask=spec)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="spec_mask"):
        cache.step(["a"], [2], spec_mask=torch.ones(3, 3, dtype=torch.bool))


def test_bad_masks_get_typed_errors_naming_spec_mask():
    q, keys, values, k_cache, v_cache, table, lens, cu, spec = _step(
        torch.float32, [20, 30], [4, 3], 16, "tree")
    call = dict(cu_seqlens_q=cu, max_seqlen_q=4)
    with pytest.raises(TypeError, match="spec_mask"):
        causal_attention.paged_attention(q, k_cache, v_cache, table, lens, **call,
                                         spec_mask=spec.float())
    with pytest.raises(ValueError, match=r"spec_mask must be \(total_q, max_seqlen_q\)"):
        causal_attention.paged_attention(q, k_cache, v_cache, table, lens, **call,
                                         spec_mask=spec[:, :3])
    hidden = spec.clone()
    hidden[5, 1] = False  # sequence 1's row 1 hides itself
    with pytest.raises(ValueError, match=r"spec_mask\[5\]\[1\]=False"):
        causal_attention.paged_attention(q, k_cache, v_cache, table, lens, **call,
                                         spec_mask=hidden)
    long_q = torch.randn(65, HQ, D)
    with pytest.raises(ValueError, match="at most 64 new tokens"):
        causal_attention.paged_attention(
            long_q, k_cache, v_cache, table[:1], torch.tensor([65], dtype=torch.int32).clamp(
                max=int(lens[0])), cu_seqlens_q=torch.tensor([0, 65], dtype=torch.int32),
            max_seqlen_q=65, spec_mask=torch.ones(65, 65, dtype=torch.bool))


def test_opcheck():
    q, keys, values, k_cache, v_cache, table, lens, cu, spec = _step(
        torch.float32, [20, 30], [4, 3], 16, "tree")
    torch.library.opcheck(
        torch.ops.causal_attention.paged_attention.default,
        (q, k_cache, v_cache, table, lens),
        {"cu_seqlens_q": cu, "max_seqlen_q": 4, "spec_mask": spec},
    )
