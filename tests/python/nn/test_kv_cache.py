"""KV-cache decoding with causal_attention.CausalSelfAttention: token by token and in chunks it
equals the full-sequence forward, with every causal score option too (sliding windows, softcap,
sinks, ALiBi: the op's bottom-right alignment counts positions from the first cached one); with a
key mask, a left-padded batch of prompts decodes as each prompt alone, unpadded; every misuse
raises a typed error and leaves the cache as it was; reset and reuse work."""

import pytest
import torch

from causal_attention import CausalSelfAttention, KVCache
from nn_testing import CAUSAL_SCORE_OPTIONS, CONFIGS, left_padded_key_mask, randomize_sinks

LENGTH = 11


def decode(module, x, cache, chunks, key_mask=None):
    """Feeds x (B, L, E) through the module chunk by chunk, each chunk with its slice of
    ``key_mask`` (B, L) if given; returns the concatenated outputs."""
    outputs, start = [], 0
    for size in chunks:
        step_mask = None if key_mask is None else key_mask[:, start : start + size]
        outputs.append(module(x[:, start : start + size], cache=cache, key_mask=step_mask))
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


@pytest.mark.parametrize("options", CAUSAL_SCORE_OPTIONS)
def test_decoding_with_score_options_equals_the_full_forward(options):
    # 40 positions: past the sliding window of 16, and far enough for ALiBi's bias to matter.
    module = CausalSelfAttention(24, 4, num_kv_heads=2, value_head_dim=5, **options).eval()
    randomize_sinks(module)
    x = torch.randn(2, 40, 24)
    with torch.no_grad():
        full = module(x)
        for chunks in ([1] * 40, [13, 1, 9, 17]):
            cache = module.make_cache(batch_size=2, max_len=40)
            decoded = decode(module, x, cache, chunks)
            torch.testing.assert_close(decoded, full, atol=1e-5, rtol=1e-5)
        # The last step's weights are the last row of the full forward's.
        cache = module.make_cache(batch_size=2, max_len=40)
        decode(module, x[:, :39], cache, [39])
        _, step_weights = module(x[:, 39:], cache=cache, need_weights=True)
        torch.testing.assert_close(
            step_weights, module(x, need_weights=True)[1][:, :, 39:], atol=1e-6, rtol=1e-5
        )
    if "window" in options:
        assert torch.count_nonzero(step_weights[..., : 40 - 16]) == 0


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
    before = (
        cache.length,
        cache.key_storage.clone(),
        cache.value_storage.clone(),
        cache.mask_storage.clone(),
        cache.key_mask is None,
    )
    with pytest.raises(error, match=match):
        fn()
    assert cache.length == before[0]
    assert torch.equal(cache.key_storage, before[1])
    assert torch.equal(cache.value_storage, before[2])
    assert torch.equal(cache.mask_storage, before[3])
    assert (cache.key_mask is None) == before[4]


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


PROMPT_LENGTHS = [7, 3, 5]
PROMPT = max(PROMPT_LENGTHS)


def left_padded_batch(embed_dim, new_tokens):
    """Prompts of PROMPT_LENGTHS, each followed by ``new_tokens`` decoded positions, left-padded
    to one batch: the sequences (unpadded, one per prompt), the batch (B, PROMPT + new_tokens,
    E) and its key mask. The padding holds random values, so that any leak of it shows."""
    sequences = [torch.randn(1, n + new_tokens, embed_dim) for n in PROMPT_LENGTHS]
    x = torch.randn(len(PROMPT_LENGTHS), PROMPT + new_tokens, embed_dim)
    for row, sequence in enumerate(sequences):
        x[row, x.size(1) - sequence.size(1) :] = sequence[0]
    key_mask = torch.cat(
        [
            left_padded_key_mask(PROMPT_LENGTHS, PROMPT),
            torch.ones(len(PROMPT_LENGTHS), new_tokens, dtype=torch.bool),
        ],
        dim=1,
    )
    return sequences, x, key_mask


@pytest.mark.parametrize("decode_mask", ["none", "all-true"])
@pytest.mark.parametrize("steps", [[1, 1, 1, 1], [2, 1, 1]], ids=["tokens", "chunks"])
@pytest.mark.parametrize("config", CONFIGS)
def test_left_padded_prompts_decode_like_each_prompt_alone(config, steps, decode_mask):
    module = CausalSelfAttention(**config).eval()
    new_tokens = sum(steps)
    sequences, x, key_mask = left_padded_batch(config["embed_dim"], new_tokens)
    cache = module.make_cache(len(sequences), PROMPT + new_tokens + 2)
    with torch.no_grad():
        outputs = [module(x[:, :PROMPT], cache=cache, key_mask=key_mask[:, :PROMPT])]
        start = PROMPT
        for size in steps:
            # The decoded positions are real: a step passes no mask or an all-True one.
            step_mask = None if decode_mask == "none" else key_mask[:, start : start + size]
            outputs.append(module(x[:, start : start + size], cache=cache, key_mask=step_mask))
            start += size
        batched = torch.cat(outputs, dim=1)
        alone = [module(sequence) for sequence in sequences]
    for row, expected in enumerate(alone):
        real = batched[row, key_mask[row]]
        torch.testing.assert_close(real, expected[0], atol=1e-5, rtol=1e-5, msg=f"row {row}")
    assert torch.equal(cache.key_mask, key_mask)


def test_left_padded_prompts_decode_like_each_prompt_alone_with_score_options():
    # A window of 4 positions binds within the prompts; padding lies before every real position,
    # so it shifts no window and no ALiBi distance between real positions.
    options = dict(window=(3, 0), softcap=0.5, sinks=True, alibi=True)
    module = CausalSelfAttention(32, 4, num_kv_heads=2, **options).eval()
    randomize_sinks(module)
    sequences, x, key_mask = left_padded_batch(32, 4)
    cache = module.make_cache(len(sequences), x.size(1))
    with torch.no_grad():
        batched = decode(module, x, cache, [PROMPT, 1, 2, 1], key_mask)
        alone = [module(sequence) for sequence in sequences]
    for row, expected in enumerate(alone):
        real = batched[row, key_mask[row]]
        torch.testing.assert_close(real, expected[0], atol=1e-5, rtol=1e-5, msg=f"row {row}")


def test_positions_hidden_in_any_step_stay_hidden_in_every_later_one():
    module = CausalSelfAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 11, 32)
    key_mask = torch.ones(2, 11, dtype=torch.bool)
    key_mask[0, [0, 1, 5, 6]] = False  # left padding, then padding in the third step
    key_mask[1, [4, 9]] = False
    chunks = [4, 1, 2, 1, 3]
    cache = module.make_cache(2, 11)
    with torch.no_grad():
        decoded = decode(module, x, cache, chunks, key_mask)
        for row in range(2):
            # The sequence with its hidden positions removed, in one full forward.
            expected = module(x[row : row + 1, key_mask[row]])[0]
            torch.testing.assert_close(decoded[row, key_mask[row]], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache.key_mask, key_mask)
        # A step without a mask after masked ones still attends with the cached mask.
        cache.reset()
        decode(module, x[:, :10], cache, [10], key_mask[:, :10])
        last = module(x[:, 10:], cache=cache)
        for row in range(2):
            expected = module(x[row : row + 1, key_mask[row]])[0, -1]
            torch.testing.assert_close(last[row, 0], expected, atol=1e-5, rtol=1e-5)


def test_weights_of_a_decoding_step_hide_the_padding():
    module = CausalSelfAttention(32, 4, num_kv_heads=2)
    sequences, x, key_mask = left_padded_batch(32, new_tokens=1)
    cache = module.make_cache(len(sequences), PROMPT + 1)
    with torch.no_grad():
        module(x[:, :PROMPT], cache=cache, key_mask=key_mask[:, :PROMPT])
        out, weights = module(x[:, PROMPT:], cache=cache, need_weights=True)
        assert weights.shape == (len(sequences), 4, 1, PROMPT + 1)
        for row, sequence in enumerate(sequences):
            expected_out, expected_weights = module(sequence, need_weights=True)
            torch.testing.assert_close(out[row, 0], expected_out[0, -1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                weights[row, :, :, key_mask[row]],
                expected_weights[0, :, -1:],
                atol=1e-6,
                rtol=1e-5,
            )
            assert torch.count_nonzero(weights[row, :, :, ~key_mask[row]]) == 0


def test_reset_forgets_the_key_mask():
    module = CausalSelfAttention(32, 4)
    x = torch.randn(2, 6, 32)
    cache = module.make_cache(2, 6)
    key_mask = left_padded_key_mask([2, 6], 6)
    with torch.no_grad():
        module(x, cache=cache, key_mask=key_mask)
        assert torch.equal(cache.key_mask, key_mask)
        cache.reset()
        assert cache.key_mask is None
        decoded = decode(module, x, cache, [3, 3])
        assert cache.key_mask is None
        torch.testing.assert_close(decoded, module(x), atol=1e-5, rtol=1e-5)
        # Positions appended without a mask are real even where the last sequence had padding:
        # a masked step after them must not find that sequence's mask in the storage.
        cache.reset()
        unmasked = decode(module, x[:, :3], cache, [3])
        masked = module(x[:, 3:], cache=cache, key_mask=torch.ones(2, 3, dtype=torch.bool))
        assert torch.equal(cache.key_mask, torch.ones(2, 6, dtype=torch.bool))
        torch.testing.assert_close(
            torch.cat([unmasked, masked], dim=1), module(x), atol=1e-5, rtol=1e-5
        )


def test_decoding_with_a_key_mask_backpropagates_even_after_reuse():
    module = CausalSelfAttention(16, 2, dtype=torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    key_mask = left_padded_key_mask([6, 3], 6)
    grad_out = torch.randn(x.shape, dtype=torch.float64) * key_mask[..., None]
    (module(x, key_mask=key_mask) * grad_out).sum().backward()
    full_grad = module.c_attn.weight.grad.clone()
    module.zero_grad()
    cache = module.make_cache(2, 6)
    decoded = decode(module, x, cache, [4, 2], key_mask)
    # The cache serves another sequence, with another mask, before this one's backward runs.
    cache.reset()
    decode(module, x, cache, [6], ~key_mask | torch.eye(2, 6, dtype=torch.bool))
    (decoded * grad_out).sum().backward()
    torch.testing.assert_close(module.c_attn.weight.grad, full_grad)


def test_bad_key_mask_raises_and_leaves_the_cache_unchanged():
    module = CausalSelfAttention(32, 4, num_kv_heads=2)
    cache = module.make_cache(2, 6)
    module(torch.randn(2, 3, 32), cache=cache, key_mask=left_padded_key_mask([1, 3], 3))
    step = torch.randn(2, 1, 32)
    assert_unchanged_after(
        TypeError,
        r"key_mask must be a bool tensor.*key_mask\.dtype=torch\.int64",
        lambda: module(step, cache=cache, key_mask=torch.ones(2, 1, dtype=torch.long)),
        cache,
    )
    # The mask of the new positions, not of the whole cache.
    assert_unchanged_after(
        ValueError,
        r"key_mask must be \(B, L\)=\[2, 1\] of x, got key_mask\.shape=\[2, 4\]",
        lambda: module(step, cache=cache, key_mask=torch.ones(2, 4, dtype=torch.bool)),
        cache,
    )
    assert_unchanged_after(
        ValueError,
        "key_mask must be on x's device",
        lambda: module(step, cache=cache, key_mask=torch.ones(2, 1, dtype=torch.bool).to("meta")),
        cache,
    )
    assert_unchanged_after(
        ValueError,
        "cannot append 4 positions",
        lambda: module(
            torch.randn(2, 4, 32), cache=cache, key_mask=torch.zeros(2, 4, dtype=torch.bool)
        ),
        cache,
    )
    # KVCache.append checks the mask itself too, for callers other than the module.
    keys, values = torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8)
    assert_unchanged_after(
        TypeError,
        r"KVCache: key_mask must be a bool tensor.*torch\.float32",
        lambda: cache.append(keys, values, torch.ones(2, 1)),
        cache,
    )
    assert_unchanged_after(
        ValueError,
        r"KVCache: key_mask must be \(B, L\)=\[2, 1\] of the new keys, got "
        r"key_mask\.shape=\[1, 2\]",
        lambda: cache.append(keys, values, torch.ones(1, 2, dtype=torch.bool)),
        cache,
    )
    module(step, cache=cache)  # still usable
    assert cache.length == 4
    assert torch.equal(cache.key_mask, torch.tensor([[False, False, True, True], [True] * 4]))


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
