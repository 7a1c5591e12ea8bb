"""KV-cache decoding with causal_attention.CausalSelfAttention: token by token and in chunks it
equals the full-sequence forward; every misuse raises a typed error and leaves the cache as it
was; reset and reuse work."""

import pytest
import torch

from causal_attention import CausalSelfAttention, KVCache
from nn_testing import CONFIGS

LENGTH = 11


def decode(module, x, cache, chunks):
    """Feeds x (B, L, E) through the module chunk by chunk; returns the concatenated outputs."""
    outputs, start = [], 0
    for size in chunks:
        outputs.append(module(x[:, start : start + size], cache=cache))
        start += size
    assert start == x.size(1)
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize(
    "chunks", [[1] * LENGTH, [3, 1, 4, 2, 1], [LENGTH]], ids=["tokens", "chunks", "whole"]
)
@pytest.mark.parametrize("config", CONFIGS)
def test_decoding_equals_the_full_forward(config, chunks):
    module = CausalSelfAttention(**config).eval()
    x = torch.randn(2, LENGTH, config["embed_dim"])
    cache = module.make_cache(batch_size=2, max_len=LENGTH + 5)
    with torch.no_grad():
        full = module(x)
        decoded = decode(module, x, cache, chunks)
    torch.testing.assert_close(decoded, full, atol=1e-5, rtol=1e-5)
    assert cache.length == LENGTH
    heads_kv = module.num_kv_heads
    assert cache.keys.shape == (2, heads_kv, LENGTH, module.head_dim)
    assert cache.values.shape == (2, heads_kv, LENGTH, module.value_head_dim)


def test_reset_and_reuse_give_the_same_outputs():
    module = CausalSelfAttention(32, 4, num_kv_heads=2)
    x, other = torch.randn(2, 2, 6, 32).unbind(0)
    cache = module.make_cache(2, 6)
    with torch.inference_mode():
        first = decode(module, x, cache, [2, 4])
        cache.reset()
        assert cache.length == 0 and cache.keys.shape[2] == 0
        decode(module, other, cache, [6])
        cache.reset()
        again = decode(module, x, cache, [1] * 6)
    torch.testing.assert_close(again, first, atol=1e-6, rtol=1e-5)


def test_weights_with_a_cache_see_the_cached_positions():
    module = CausalSelfAttention(32, 4)
    x = torch.randn(1, 7, 32)
    cache = module.make_cache(1, 8)
    with torch.no_grad():
        _, full_weights = module(x, need_weights=True)
        module(x[:, :4], cache=cache)
        out, weights = module(x[:, 4:], cache=cache, need_weights=True)
        torch.testing.assert_close(out, module(x)[:, 4:], atol=1e-6, rtol=1e-5)
    assert weights.shape == (1, 4, 3, 7)
    torch.testing.assert_close(weights, full_weights[:, :, 4:], atol=1e-6, rtol=1e-5)


def test_decoding_backpropagates_into_the_parameters():
    module = CausalSelfAttention(16, 2, dtype=torch.float64)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    module(x).sum().backward()
    full_grad = module.c_attn.weight.grad.clone()
    module.zero_grad()
    cache = module.make_cache(1, 5)
    decode(module, x, cache, [2, 3]).sum().backward()
    torch.testing.assert_close(module.c_attn.weight.grad, full_grad)
    assert cache.key_storage.grad_fn is not None
    cache.reset()
    assert cache.key_storage.grad_fn is None and cache.value_storage.grad_fn is None


def assert_unchanged_after(error, match, fn, cache):
    before = (cache.length, cache.key_storage.clone(), cache.value_storage.clone())
    with pytest.raises(error, match=match):
        fn()
    assert cache.length == before[0]
    assert torch.equal(cache.key_storage, before[1])
    assert torch.equal(cache.value_storage, before[2])


def test_cache_misuse_raises_and_leaves_the_cache_unchanged():
    module = CausalSelfAttention(32, 4, num_kv_heads=2)
    cache = module.make_cache(2, 5)
    module(torch.randn(2, 3, 32), cache=cache)

    assert_unchanged_after(
        ValueError,
        "cannot append 3 positions to a cache holding 3 of max_len=5",
        lambda: module(torch.randn(2, 3, 32), cache=cache),
        cache,
    )
    assert_unchanged_after(
        ValueError,
        r"must match the cache's batch size.*keys\.shape=\[3, 2, 1, 8\]",
        lambda: module(torch.randn(3, 1, 32), cache=cache),
        cache,
    )
    other_heads = CausalSelfAttention(32, 4)  # Hkv = 4: a cache of another shape
    assert_unchanged_after(
        ValueError,
        r"keys\.shape=\[2, 4, 1, 8\].*\(B, Hkv, max_len, D\)=\[2, 2, 5, 8\]",
        lambda: other_heads(torch.randn(2, 1, 32), cache=cache),
        cache,
    )
    other_value_width = CausalSelfAttention(32, 4, num_kv_heads=2, value_head_dim=4)
    assert_unchanged_after(
        ValueError,
        r"values\.shape=\[2, 2, 1, 4\]",
        lambda: other_value_width(torch.randn(2, 1, 32), cache=cache),
        cache,
    )
    float64 = CausalSelfAttention(32, 4, num_kv_heads=2, dtype=torch.float64)
    assert_unchanged_after(
        TypeError,
        "cache's dtype torch.float32, got keys.dtype=torch.float64",
        lambda: float64(torch.randn(2, 1, 32, dtype=torch.float64), cache=cache),
        cache,
    )
    # The cache stays usable after every refused call.
    module(torch.randn(2, 2, 32), cache=cache)
    assert cache.length == 5


@pytest.mark.parametrize("batch_size, max_len", [(0, 4), (2, 0), (-1, 3)])
def test_make_cache_needs_positive_sizes(batch_size, max_len):
    with pytest.raises(ValueError, match=f"batch_size={batch_size}, max_len={max_len}"):
        CausalSelfAttention(32, 4).make_cache(batch_size, max_len)


def test_cache_storage_is_checked():
    with pytest.raises(ValueError, match=r"must be 4-D.*key_storage\.shape=\[2, 5, 8\]"):
        KVCache(torch.zeros(2, 5, 8), torch.zeros(2, 1, 5, 8))
    with pytest.raises(ValueError, match=r"agree in \(B, Hkv, max_len\)"):
        KVCache(torch.zeros(2, 1, 5, 8), torch.zeros(2, 1, 6, 8))
    with pytest.raises(TypeError, match="same dtype"):
        KVCache(torch.zeros(2, 1, 5, 8), torch.zeros(2, 1, 5, 8, dtype=torch.float64))


def test_make_cache_follows_the_parameters():
    module = CausalSelfAttention(24, 4, num_kv_heads=1, head_dim=10, value_head_dim=6)
    cache = module.to(torch.float64).make_cache(3, 9)
    assert cache.key_storage.shape == (3, 1, 9, 10)
    assert cache.value_storage.shape == (3, 1, 9, 6)
    assert cache.key_storage.dtype == torch.float64
    assert (cache.length, cache.max_len, cache.batch_size) == (0, 9, 3)
