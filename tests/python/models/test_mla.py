"""MLA's absorbed decode (DeepSeek-V2) end to end: a layer's absorbed form, every query head
against one KV head holding the latent through causal_attention.paged_attention with v_cache a
view of k_cache's first features (the latent read once), equals its unabsorbed form (per-head
keys and values, causal_attention.attention) token by token, over prefill chunks and decode
steps of sequences of different lengths."""

import copy

import pytest
import torch

import causal_attention
from attention_testing.parameters import dtype_params
from attention_testing.quantized import EIGHT_BIT, EIGHT_BIT_IDS
from attention_testing.tolerances import (
    UNIT_ROUNDOFF,
    max_abs_diff,
    twice_sdpa_error_failures,
)
from causal_attention import PagedKVCache
from causal_attention.quantization import dequantize
from mla_testing import LatentAttention

# Small enough to be quick, with the absorbed heads of a real model (16 to 128).
SMALL = dict(embed_dim=64, num_heads=16, latent_dim=64, rope_dim=16, nope_dim=32, value_dim=32)
# DeepSeek-V2's attention sizes (its hidden size aside): D = 576, Dv = 512.
DEEPSEEK_V2 = dict(embed_dim=256, num_heads=16, latent_dim=512, rope_dim=64, nope_dim=128,
                   value_dim=128)

PAGE_SIZE = 16
# The tokens each sequence adds per step: prompts prefilled in chunks across pages, the second
# sequence decoding while the first still prefills (one call holding both kinds), then decodes.
STEPS = [[23, 9], [14, 1], [1, 1], [1, 1], [1, 1]]
FEW_STEPS = [[5, 3], [1, 1], [1, 1]]

# Half a step of each 8-bit format relative to a row's largest value, which its per-token scale
# stores as the format's largest: e4m3's 3 and e5m2's 2 mantissa bits, int8's 127 steps.
HALF_STEP = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3, torch.int8: 1 / 254}


@pytest.fixture
def paged_reads(monkeypatch):
    """The (k_cache, v_cache) of every causal_attention.paged_attention call the test makes."""
    reads = []
    paged_attention = causal_attention.paged_attention

    def recording(q, k_cache, v_cache, *args, **kwargs):
        reads.append((k_cache, v_cache))
        return paged_attention(q, k_cache, v_cache, *args, **kwargs)

    monkeypatch.setattr(causal_attention, "paged_attention", recording)
    return reads


def assert_values_read_in_the_keys(reads, model: LatentAttention, steps):
    """Each step read one KV head whose values are a view of the keys' first latent_dim
    features, the same memory (no copy, no second cache): the latent read once."""
    assert len(reads) == len(steps)
    for k_cache, v_cache in reads:
        assert k_cache.shape[2:] == (1, model.latent_dim + model.rope_dim)
        assert v_cache.shape == k_cache.shape[:3] + (model.latent_dim,)
        assert v_cache.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()
        assert v_cache.data_ptr() == k_cache.data_ptr()
        assert v_cache.stride() == k_cache.stride()


def absorbed_outputs(model: LatentAttention, xs, steps, cache_dtype):
    """Each sequence's outputs ``(L_b, E)`` from the absorbed form, step by step (``steps[i][b]``
    new tokens of sequence b at step i), and the cache it wrote."""
    pages = sum(-(-x.shape[0] // PAGE_SIZE) for x in xs)
    cache = PagedKVCache(pages, PAGE_SIZE, 1, model.latent_dim + model.rope_dim,
                         value_dim=model.latent_dim, dtype=cache_dtype, values_in_keys=True)
    for b in range(len(xs)):
        cache.allocate(b)
    done = [0] * len(xs)
    outputs = [[] for _ in xs]
    with torch.no_grad():
        for tokens in steps:
            new = torch.cat([x[d:d + n] for x, d, n in zip(xs, done, tokens)])
            for b, rows in enumerate(model.absorbed_step(new, tokens, cache).split(tokens)):
                outputs[b].append(rows)
            done = [d + n for d, n in zip(done, tokens)]
    assert done == [x.shape[0] for x in xs]
    return [torch.cat(rows) for rows in outputs], cache


def unabsorbed_outputs(model: LatentAttention, xs, latents=None):
    """Each sequence's outputs from the unabsorbed form, on its own latent or on ``latents``."""
    with torch.no_grad():
        if latents is None:
            return [model(x.unsqueeze(0)).squeeze(0) for x in xs]
        return [model.unabsorbed(x.unsqueeze(0), c.unsqueeze(0)).squeeze(0)
                for x, c in zip(xs, latents)]


def inputs(config, steps, dtype):
    """The layer in ``dtype`` and each sequence's hidden states, as many as its steps add."""
    model = LatentAttention(**config).to(dtype)
    lengths = [sum(column) for column in zip(*steps)]
    return model, [torch.randn(n, config["embed_dim"]).to(dtype) for n in lengths]


def assert_within_twice_the_unabsorbed_error(absorbed, model, xs, latents=None):
    """FlashAttention's rule with the unabsorbed form as the kernel to match: each absorbed
    output is at most twice as far from the unabsorbed form in float64 (on the same rounded
    parameters and inputs) as the unabsorbed form run in the layer's dtype."""
    model64 = copy.deepcopy(model).double()
    latents64 = None if latents is None else [c.double() for c in latents]
    reference = unabsorbed_outputs(model64, [x.double() for x in xs], latents64)
    same = unabsorbed_outputs(model, xs, latents)
    names = [f"sequence {b}" for b in range(len(xs))]
    failures = twice_sdpa_error_failures(names, absorbed, same, reference)
    assert not failures, failures


def stored_latent(cache: PagedKVCache, b: int) -> torch.Tensor:
    """Request b's latent rows ``(length, D)`` as paged_attention reads them (8-bit ones times
    their per-token scales, in float32)."""
    positions = torch.arange(cache.length(b))
    pages = torch.tensor(cache.pages_of(b))[positions // cache.page_size]
    rows = positions % cache.page_size
    stored = cache.key_pages[0][pages, rows, 0]
    scales = cache.key_scales[0]
    return stored if scales is None else dequantize(stored, scales[pages, rows])


def assert_latent_within_half_a_step(cache: PagedKVCache, model: LatentAttention, xs):
    """The 8-bit pages hold each token's latent rows to half a step of their format."""
    with torch.no_grad():
        exact = [model.latent(x, torch.arange(x.shape[0])) for x in xs]
    # Plus float32 round-off: the steps computed the latent rows in products of their own.
    bound = HALF_STEP[cache.dtype] + 8 * UNIT_ROUNDOFF[torch.float32]
    for b, want in enumerate(exact):
        error = ((stored_latent(cache, b) - want).abs().amax(-1) / want.abs().amax(-1)).max()
        assert error <= bound, f"sequence {b}'s latent: {error:.3e} > {bound:.3e}"


CONFIGS = [pytest.param(SMALL, STEPS, id="small"),
           pytest.param(DEEPSEEK_V2, FEW_STEPS, id="deepseek-v2")]


@pytest.mark.parametrize("config, steps", CONFIGS)
def test_absorbed_decode_equals_the_unabsorbed_form_in_float64(config, steps, paged_reads):
    model, xs = inputs(config, steps, torch.float64)
    absorbed, _ = absorbed_outputs(model, xs, steps, torch.float64)
    assert_values_read_in_the_keys(paged_reads, model, steps)
    for b, (got, want) in enumerate(zip(absorbed, unabsorbed_outputs(model, xs))):
        assert want.abs().max() > 0.1, f"sequence {b}: outputs too small to tell anything"
        assert max_abs_diff(got, want) <= 1e-12, f"sequence {b}: {max_abs_diff(got, want):.3e}"


@pytest.mark.parametrize("config, steps", CONFIGS)
@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16, torch.float16]))
def test_absorbed_decode_is_as_accurate_as_the_unabsorbed_form(config, steps, dtype,
                                                                 paged_reads):
    model, xs = inputs(config, steps, dtype)
    absorbed, _ = absorbed_outputs(model, xs, steps, dtype)
    assert_values_read_in_the_keys(paged_reads, model, steps)
    assert_within_twice_the_unabsorbed_error(absorbed, model, xs)


@pytest.mark.parametrize("cache_dtype", EIGHT_BIT, ids=EIGHT_BIT_IDS)
def test_absorbed_decode_from_an_eight_bit_latent_matches_the_unabsorbed_form_on_it(cache_dtype,
                                                                                   paged_reads):
    """The latent stored 8-bit with a scale per token (one for keys and values alike), the
    unabsorbed form run on the latent dequantized as paged_attention reads it."""
    model, xs = inputs(SMALL, STEPS, torch.float32)
    absorbed, cache = absorbed_outputs(model, xs, STEPS, cache_dtype)
    assert_values_read_in_the_keys(paged_reads, model, STEPS)
    assert_latent_within_half_a_step(cache, model, xs)
    latents = [stored_latent(cache, b) for b in range(len(xs))]
    assert_within_twice_the_unabsorbed_error(absorbed, model, xs, latents)
