"""MLA's latent cache: v_cache a view of k_cache's first Dv features (one KV head, absorbed query
heads). A decode reads and widens each page once for the scores and the values, and gives
bitwise the results of the same call with V copied into a cache of its own."""

import pytest
import torch

import causal_attention
from attention_testing.paged import paged

D, DV = 72, 64  # the latent's layout at a small size: values are its first DV features


def _latent_cache(dtype, lengths, page_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(n, 1, D, generator=g).to(dtype) for n in lengths]
    k_cache, _, table = paged(latents, latents, page_size, seed=seed)
    return k_cache.nan_to_num(0), table, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("heads", [16, 40])
def test_values_viewed_in_the_keys_equal_a_copied_value_cache(dtype, heads):
    k_cache, table, lens = _latent_cache(dtype, [300, 1000, 17], 16)
    q = torch.randn(3, 1, heads, D).to(dtype)
    v_view = k_cache[..., :DV]
    assert v_view.data_ptr() == k_cache.data_ptr()
    got = causal_attention.paged_attention(q, k_cache, v_view, table, lens)
    want = causal_attention.paged_attention(q, k_cache, v_view.contiguous(), table, lens)
    assert torch.equal(got, want)
    ref = causal_attention.paged_attention(q.double(), k_cache.double(), v_view.double(), table,
                                           lens)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-2 if dtype != torch.float32
                               else 1e-5)


def test_an_eight_bit_latent_with_one_scale_tensor_equals_a_copied_value_cache():
    k_cache, table, lens = _latent_cache(torch.float32, [200, 90], 16, seed=1)
    latent = k_cache.clamp(-3, 3).mul(40).round().to(torch.int8)
    scales = torch.full(latent.shape[:3], 1 / 40)
    q = torch.randn(2, 1, 16, D)
    got = causal_attention.paged_attention(q, latent, latent[..., :DV], table, lens,
                                           k_scale=scales, v_scale=scales)
    want = causal_attention.paged_attention(q, latent, latent[..., :DV].contiguous(), table, lens,
                                            k_scale=scales, v_scale=scales.clone())
    assert torch.equal(got, want)
