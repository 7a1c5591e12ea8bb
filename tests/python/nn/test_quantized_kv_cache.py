"""8-bit KVCache (float8_e4m3fn, float8_e5m2, int8; scales per token and KV head or per tensor):
append quantizes as the tests' torch reference does (nearest, saturating; per-token scales the
row's largest |value| over the format's); CausalSelfAttention decodes from it, eager and
scripted, as causal_attention.attention with the cache's scales (bitwise) and as the float64
reference on the dequantized cache, and within the measured quantization error of a float
cache; GPT.generate decodes with 8-bit caches given to it; bad arguments and what the 8-bit
attention does not serve (masks, gradients, weights, dropout) raise typed errors before anything
enters the cache."""

import math

import pytest
import torch

import causal_attention as ca
from attention_testing.quantized import (
    EIGHT_BIT,
    EIGHT_BIT_IDS,
    LARGEST,
    assert_matches_dequantized,
    quantize_reference,
    token_scale_reference,
)
from causal_attention import CausalSelfAttention, KVCache
from causal_attention.models import GPT
from nn_testing import IGNORE_TORCHSCRIPT_DEPRECATION

pytestmark = IGNORE_TORCHSCRIPT_DEPRECATION

LAYOUTS = ["token", "tensor"]


def layout_options(dtype, layout):
    """make_cache's options for ``layout``; per tensor, scales under which keys of magnitude up
    to 4 and values up to 3 fit the format (the module's are about 1; larger ones saturate,
    which the error bounds measure), two scales so that swapping them shows."""
    if layout == "token":
        return dict(scales="token")
    return dict(scales="tensor", k_scale=4.0 / LARGEST[dtype], v_scale=3.0 / LARGEST[dtype])


def dequantized(cache):
    """The cached keys and values, stored value x scale, in float64."""
    out = []
    for stored, scales in ((cache.keys, cache.key_scales), (cache.values, cache.value_scales)):
        scale = scales.double().unsqueeze(-1) if scales.dim() == 3 else scales.double()
        out.append(stored.double() * scale)
    return out


def bits(t):
    """``t``, 8-bit as its bytes (torch compares no float8 tensors)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_stored(got, x, dtype, scale):
    """``got`` (8-bit) holds the reference quantization of ``x / scale``, value for value."""
    want = quantize_reference(x, dtype, scale)
    assert got.dtype == dtype
    mismatch = (got.double() != want.double()).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.shape[0]} values differ, first at {mismatch[0].tolist()}: stored "
        f"{got[tuple(mismatch[0])].item()}, reference {want[tuple(mismatch[0])].item()}")


# --- append ------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=EIGHT_BIT_IDS)
def test_append_quantizes_as_the_reference(dtype, layout, x_dtype):
    """Two appends (a prompt, then one position) store each key and value as the reference
    quantizes it, with the per-token scales the reference computes (written beside them) or the
    given per-tensor ones; values past the range saturate (per tensor: a few 100x larger rows
    here), zeros stay zeros, and a row of zeros gets scale 1."""
    batch, heads, dim, dim_v = 2, 3, 16, 8
    options = layout_options(dtype, layout)
    cache = KVCache(torch.zeros(batch, heads, 9, dim, dtype=dtype),
                    torch.zeros(batch, heads, 9, dim_v, dtype=dtype), **options)
    keys = torch.randn(batch, heads, 6, dim)
    keys[0, 1, 2] *= 300  # saturates per tensor
    keys[1, 0, 4] = 0  # a row of zeros
    values = torch.randn(batch, heads, 6, dim_v) * torch.rand(batch, heads, 6, 1) * 3
    keys, values = keys.to(x_dtype), values.to(x_dtype)
    for start, end in ((0, 5), (5, 6)):
        returned = cache.append(keys[:, :, start:end], values[:, :, start:end])
        assert returned[2] is None and cache.key_mask is None
        # Views of the storage, as a float cache's.
        assert returned[0].data_ptr() == cache.key_storage.data_ptr()
        assert torch.equal(bits(returned[0]), bits(cache.keys))
        assert torch.equal(bits(returned[1]), bits(cache.values))
    assert cache.length == 6 and cache.quantized and cache.scales == layout
    for stored, scales, x, name in ((cache.keys, cache.key_scales, keys, "k_scale"),
                                    (cache.values, cache.value_scales, values, "v_scale")):
        if layout == "token":
            want = token_scale_reference(x, dtype)
            assert scales.shape == (batch, heads, 6) and torch.equal(scales, want)
            assert_stored(stored, x, dtype, want.unsqueeze(-1))
        else:
            assert scales.shape == () and scales.dtype == torch.float32
            assert scales.item() == torch.tensor(options[name]).item()
            assert_stored(stored, x, dtype, options[name])
    if layout == "token":
        assert cache.key_scales[1, 0, 4] == 1.0
    else:
        assert cache.keys[0, 1, 2].double().abs().max() == LARGEST[dtype]  # saturated
    # The storage past the cached positions is untouched.
    assert not cache.key_storage[:, :, 6:].double().any()


def test_a_float_cache_has_no_scales():
    cache = CausalSelfAttention(32, 4).make_cache(2, 5)
    assert not cache.quantized and cache.scales is None
    assert cache.key_scales is None and cache.value_scales is None


# --- the module decoding from it ---------------------------------------------------------------


def decode_capturing(module, x, cache, chunks):
    """Feeds ``x`` chunk by chunk; returns the outputs and, per call, its queries ``(B, Hq, L,
    D)``, what the attention returned ``(B, Hq, L, Dv)`` (c_proj's input) and the end of its
    positions."""
    calls = []
    heads, dim, dim_v = module.num_heads, module.head_dim, module.value_head_dim

    def keep_queries(_, __, qkv):
        batch, length = qkv.shape[:2]
        q = qkv[..., : heads * dim].reshape(batch, length, heads, dim).transpose(1, 2)
        calls.append({"q": q.clone()})

    def keep_attended(_, inputs):
        batch, length = inputs[0].shape[:2]
        calls[-1]["out"] = inputs[0].reshape(batch, length, heads, dim_v).transpose(1, 2)

    hooks = [module.c_attn.register_forward_hook(keep_queries),
             module.c_proj.register_forward_pre_hook(keep_attended)]
    outputs, start = [], 0
    try:
        for size in chunks:
            outputs.append(module(x[:, start: start + size], cache))
            start += size
            calls[-1]["end"] = start
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(outputs, dim=1), calls


def quantization_bound(module, q, exact, quantized):
    """How far the module's output on 8-bit keys and values may move from the float cache's
    by the quantization error measured in the cache: dK shifts query i's scores by at most
    d_i = scale * max_j |q_i . dK_j| (softcap only shrinks a shift; ALiBi, sinks and the window
    shift nothing), which moves its probabilities by at most e^(2 d_i) - 1 in sum, so its
    head's output by at most that times max |V| plus max |dV| (per value dim); c_proj passes
    that on through |W|. ``q`` (B, Hq, L, D); ``exact`` and ``quantized`` (keys, values)
    (B, Hkv, L, D) in float64."""
    group = module.num_heads // module.num_kv_heads
    dk, dv = (quantized[i] - exact[i] for i in range(2))
    shift = module.head_dim ** -0.5 * torch.einsum(
        "bhid,bhjd->bhij", q.double(), dk.repeat_interleave(group, dim=1)).abs().amax(-1)
    moved = torch.expm1(2 * shift)  # (B, Hq, L)
    largest_v = exact[1].abs().amax(2, keepdim=True).repeat_interleave(group, dim=1)
    error_v = dv.abs().amax(2, keepdim=True).repeat_interleave(group, dim=1)
    attended = error_v + moved.unsqueeze(-1) * largest_v  # (B, Hq, L, Dv)
    merged = attended.transpose(1, 2).flatten(2)  # (B, L, Hq * Dv)
    return (merged @ module.c_proj.weight.double().abs().T).max().item() + 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=EIGHT_BIT_IDS)
def test_the_module_decodes_from_an_eight_bit_cache(dtype, layout):
    """CausalSelfAttention (GQA, every causal score option) decodes a prompt then token by
    token from an 8-bit cache, forward unchanged: each call's attention is
    causal_attention.attention on the cache with its scales, bitwise, and the float64 reference
    on the dequantized cache within float32's round-off; the outputs differ from decoding from
    a float32 cache by something (the cache is 8-bit), but no more than the quantization error
    measured in the cache allows."""
    module = CausalSelfAttention(32, 4, num_kv_heads=2, value_head_dim=6, window=(9, 0),
                                 softcap=5.0, sinks=True, alibi=True).eval()
    with torch.no_grad():
        module.sinks.normal_()
    x = torch.randn(2, 14, 32)
    chunks = [6] + [1] * 8
    with torch.no_grad():
        exact = module.make_cache(2, 16)
        want, _ = decode_capturing(module, x, exact, chunks)
        cache = module.make_cache(2, 16, dtype=dtype, **layout_options(dtype, layout))
        got, calls = decode_capturing(module, x, cache, chunks)
        assert cache.length == 14 and cache.keys.dtype == dtype
        k64, v64 = dequantized(cache)
        options = dict(window=module.window, softcap=module.softcap,
                       alibi_slopes=module.alibi_slopes, sinks=module.sinks)
        for call in calls:
            end = call["end"]
            key_scales, value_scales = cache.key_scales, cache.value_scales
            if layout == "token":
                key_scales, value_scales = key_scales[:, :, :end], value_scales[:, :, :end]
            by_attention = ca.attention(call["q"], cache.keys[:, :, :end],
                                        cache.values[:, :, :end], k_scale=key_scales,
                                        v_scale=value_scales, **options)
            assert torch.equal(call["out"], by_attention), end
            assert_matches_dequantized(call["out"], call["q"], k64[:, :, :end], v64[:, :, :end],
                                       module.head_dim ** -0.5, f"out at {end}", **options)
        q = torch.cat([call["q"] for call in calls], dim=2)
        bound = quantization_bound(module, q, [exact.keys.double(), exact.values.double()],
                                   [k64, v64])
    difference = (got - want).abs().max().item()
    assert 0 < difference <= bound, (difference, bound)


@pytest.mark.parametrize(
    "dtype, options",
    [(torch.int8, dict()),
     (torch.float8_e5m2, dict(scales="tensor", k_scale=2.0 ** -12, v_scale=2.0 ** -11))],
    ids=["int8-token", "e5m2-tensor"])
def test_a_scripted_module_decodes_from_an_eight_bit_cache(dtype, options):
    """The scripted module (without biases: the check of what records autograd compiles without
    them too) decodes from an 8-bit cache made by itself or in eager Python bitwise as the eager
    module, the cache's length and scales kept across calls from Python into TorchScript."""
    module = CausalSelfAttention(24, 3, num_kv_heads=1, bias=False, softcap=5.0).eval()
    scripted = torch.jit.script(module)
    x = torch.randn(2, 7, 24)
    chunks = [4, 1, 1, 1]
    layout = options.get("scales", "token")
    with torch.no_grad():
        eager_cache = module.make_cache(2, 7, dtype=dtype, **options)
        want, _ = decode_capturing(module, x, eager_cache, chunks)
        made = scripted.make_cache(2, 7, dtype, options.get("scales"), options.get("k_scale"),
                                   options.get("v_scale"))
        for cache in (made, module.make_cache(2, 7, dtype=dtype, **options)):
            steps, start = [], 0
            for size in chunks:
                steps.append(scripted(x[:, start: start + size], cache))
                start += size
            assert torch.equal(torch.cat(steps, dim=1), want)
            assert cache.length == 7 and cache.scales == layout
            assert torch.equal(bits(cache.keys), bits(eager_cache.keys))
            assert torch.equal(cache.key_scales, eager_cache.key_scales)
        with pytest.raises(torch.jit.Error, match="NotImplementedError: .*key_mask with an 8-bit"):
            scripted(x[:, :1], made, False, torch.ones(2, 1, dtype=torch.bool))
        assert made.length == 7


# --- GPT ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=EIGHT_BIT_IDS)
def test_gpt_decodes_and_generates_with_eight_bit_caches(dtype, layout):
    """GPT.make_caches makes 8-bit caches and the model decodes from them: fed the same
    tokens, its logits differ from the float caches' by something, but under 5 % of their
    spread; generate with 8-bit caches given to it picks the tokens a greedy loop over those
    caches picks, and leaves the sequences in them."""
    model = GPT(64, 24, 32, 4, 2, num_kv_heads=2).eval()
    prompt = torch.randint(0, 64, (2, 5))
    options = layout_options(dtype, layout)
    with torch.no_grad():
        tokens = model.generate(prompt, 8, temperature=0)
        logits = {}
        for name, caches in (("float", model.make_caches(2, 13)),
                             ("8-bit", model.make_caches(2, 13, dtype=dtype, **options))):
            steps = [model(tokens[:, :5], caches)[:, -1]]
            steps += [model(tokens[:, i: i + 1], caches)[:, -1] for i in range(5, 12)]
            logits[name] = torch.stack(steps, dim=1)
        assert all(c.keys.dtype == dtype and c.scales == layout for c in caches)
        difference = (logits["8-bit"] - logits["float"]).abs().max().item()
        assert 0 < difference < 0.05 * logits["float"].std().item()

        caches = model.make_caches(2, 16, dtype=dtype, **options)
        generated = model.generate(prompt, 8, temperature=0, caches=caches)
        assert all(c.length == 12 for c in caches)  # the last token is picked, not fed
        greedy, loop_caches = prompt, model.make_caches(2, 13, dtype=dtype, **options)
        step_logits = model(prompt, loop_caches)[:, -1]
        for _ in range(8):
            greedy = torch.cat([greedy, step_logits.argmax(-1, keepdim=True)], dim=1)
            step_logits = model(greedy[:, -1:], loop_caches)[:, -1]
    assert torch.equal(generated, greedy)


def test_gpt_takes_per_block_scales_and_refuses_bad_caches():
    model = GPT(64, 24, 32, 4, 2).eval()
    caches = model.make_caches(1, 8, dtype=torch.int8, scales="tensor", k_scale=[0.01, 0.02],
                               v_scale=0.03)
    assert [c.key_scales.item() for c in caches] == [torch.tensor(s).item() for s in (.01, .02)]
    assert [c.value_scales.item() for c in caches] == [torch.tensor(.03).item()] * 2
    with pytest.raises(ValueError, match=r"k_scale must be a float or one per block \(2\), got 3"):
        model.make_caches(1, 8, dtype=torch.int8, scales="tensor", k_scale=[1.0] * 3)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"one KVCache per block \(2\), got 1"):
        model.generate(prompt, 2, caches=caches[:1])
    with pytest.raises(ValueError, match="caches\\[0\\] must be empty.* at least 9 positions"):
        model.generate(prompt, 6, caches=caches)
    with torch.no_grad():
        model(prompt, caches)
    with pytest.raises(ValueError, match="holding 3 of max_len=8"):
        model.generate(prompt, 2, caches=caches)
    with pytest.raises(TypeError, match="caches\\[1\\] must be a KVCache"):
        model.generate(prompt, 2, caches=[model.make_caches(1, 8)[0], "cache"])


# --- what the 8-bit cache refuses --------------------------------------------------------------


def storage(dtype=torch.int8, shape=(2, 2, 5, 4)):
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: KVCache(*storage(torch.float32), scales="token"), ValueError,
         "scales, k_scale and v_scale are for 8-bit storage"),
        (lambda: KVCache(*storage(torch.bfloat16), k_scale=1.0), ValueError,
         "are for 8-bit storage"),
        (lambda: KVCache(*storage(), scales="rows"), ValueError,
         "scales must be 'token' .* or 'tensor'"),
        (lambda: KVCache(*storage(), scales=1), TypeError, "scales must be 'token' or 'tensor'"),
        (lambda: KVCache(*storage(), k_scale=0.5), ValueError,
         "k_scale and v_scale are the scales of scales='tensor'"),
        (lambda: KVCache(*storage(), scales="tensor", k_scale=0.0), ValueError,
         "k_scale must be positive and finite"),
        (lambda: KVCache(*storage(), scales="tensor", v_scale=-1.0), ValueError,
         "v_scale must be positive and finite"),
        (lambda: KVCache(*storage(), scales="tensor", k_scale=math.nan), ValueError,
         "k_scale must be positive and finite"),
        (lambda: KVCache(*storage(), scales="tensor", v_scale=1e39), ValueError,
         r"v_scale must be positive and finite \(in float32\)"),
        (lambda: KVCache(*storage(), scales="tensor", k_scale="1"), TypeError,
         "k_scale must be a float"),
        (lambda: KVCache(*storage(), scales="tensor", k_scale=torch.tensor(1.0)), TypeError,
         "k_scale must be a float"),
        (lambda: CausalSelfAttention(32, 4).make_cache(1, 4, dtype=torch.int8, scales="tensor",
                                                        k_scale=-2.0),
         ValueError, "k_scale must be positive and finite"),
    ],
    ids=["float-scales", "float-k_scale", "bad-layout", "layout-type", "token-with-k_scale",
         "zero", "negative", "nan", "inf-in-float32", "k_scale-type", "tensor-k_scale",
         "make_cache"],
)
def test_bad_cache_arguments_raise_typed_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_append_refuses_what_it_cannot_store_and_leaves_the_cache():
    """Non-finite keys or values (named), keys that are not float32/bfloat16/float16 or not of
    one dtype, and a key mask raise before anything is written."""
    cache = KVCache(*storage(torch.float8_e4m3fn))
    keys, values = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    cache.append(keys[:, :, :1], values[:, :, :1])
    before = [t.clone() for t in (cache.key_storage, cache.value_storage,
                                  cache.key_scale_storage, cache.value_scale_storage)]
    bad_keys, bad_values = keys.clone(), values.clone()
    bad_keys[1, 0, 2, 3], bad_values[0, 1, 1, 0] = math.nan, math.inf
    cases = [
        ((bad_keys, values), ValueError, "new keys must be finite"),
        ((keys, bad_values), ValueError, "new values must be finite"),
        ((keys.double(), values.double()), TypeError, "must be float32, bfloat16 or float16"),
        ((keys, values.half()), TypeError, "one dtype"),
        ((keys, values, torch.ones(2, 3, dtype=torch.bool)), NotImplementedError,
         "a key_mask with torch.float8_e4m3fn storage is not supported"),
        ((keys[:, :1], values), ValueError, "must match the cache's batch size"),
    ]
    for arguments, error, match in cases:
        with pytest.raises(error, match=match):
            cache.append(*arguments)
        assert cache.length == 1, match
        for now, then in zip((cache.key_storage, cache.value_storage, cache.key_scale_storage,
                              cache.value_scale_storage), before):
            assert torch.equal(bits(now), bits(then))


def test_the_module_refuses_what_the_eight_bit_attention_does_not_serve():
    """Gradients, key_mask, attn_mask, attention dropout in training, weights and the SDPA
    baseline raise typed errors, the cache left as it was."""
    from causal_attention.models.sdpa_attention import SDPASelfAttention

    module = CausalSelfAttention(32, 4, attn_dropout=0.1).eval()
    cache = module.make_cache(2, 8, dtype=torch.int8)
    x = torch.randn(2, 2, 32)
    with torch.no_grad():
        module(x, cache)
    mask = torch.ones(2, 2, dtype=torch.bool)
    cases = [
        (lambda: module(x, cache), "inference only .* torch.no_grad"),
        (lambda: module(x, cache, key_mask=mask), "key_mask with an 8-bit KVCache"),
        (lambda: module(x, cache, attn_mask=torch.ones(2, 4, dtype=torch.bool)),
         "attn_mask with an 8-bit KVCache"),
        (lambda: module.train()(x, cache), "attn_dropout in training with an 8-bit KVCache"),
        (lambda: module(x, cache, need_weights=True), "weights from an 8-bit KVCache"),
        (lambda: SDPASelfAttention(32, 4)(x, cache), "reads float KV caches only"),
    ]
    for call, match in cases:
        module.eval()
        with torch.no_grad() if "inference" not in match else torch.enable_grad():
            with pytest.raises(NotImplementedError, match=match):
                call()
        assert cache.length == 2, match
