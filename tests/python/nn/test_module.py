"""causal_attention.CausalSelfAttention: equal to nn.MultiheadAttention with a causal mask and to a
nanoGPT-style reference, in output and in every gradient, with and without a key mask, and with
every score option (windows, softcap, sinks, ALiBi) against a materialized reference; attention
dropout in training uses the op's mask and evaluation is exact; nanoGPT checkpoints load strictly,
and the options' sinks and slopes go through the state_dict; bad options and inputs raise typed
errors."""

import pytest
import torch
from torch import nn

from attention_testing.parameters import dtype_params
from causal_attention import CausalSelfAttention
from causal_attention._masks import visible_keys
from causal_attention.nn import alibi_slopes
from nn_testing import (
    CONFIGS,
    EVERY_SCORE_OPTION,
    SCORE_OPTIONS,
    NanoGPTAttention,
    assert_close_to_reference,
    forward_backward,
    left_padded_key_mask,
    randomize_sinks,
)

SMALL = dict(embed_dim=32, num_heads=4)


def module_and_references(config, dtype):
    """Our module, and nanoGPT's in `dtype` and in float64 with the same weights (loading our
    state_dict strictly into nanoGPT's layout is itself part of the claim)."""
    ours = CausalSelfAttention(**config, dtype=dtype)
    randomize_sinks(ours)
    ref = NanoGPTAttention(config).to(dtype)
    ref64 = NanoGPTAttention(config).double()
    ref.load_state_dict(ours.state_dict(), strict=True)
    ref64.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref, ref64


def assert_matches(dtype, out, grads, ref_out, ref_grads, out64, grads64):
    """Output and gradients equal to float64's in float64, else within the reference's own
    distance from float64."""
    if dtype == torch.float64:
        torch.testing.assert_close(out, out64)
        for name in grads:
            torch.testing.assert_close(grads[name], grads64[name], msg=name)
    else:
        assert_close_to_reference(out, ref_out, out64, "output")
        for name in grads:
            assert_close_to_reference(grads[name], ref_grads[name], grads64[name], name)


@pytest.mark.parametrize("dtype", dtype_params((torch.float64, torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("config", CONFIGS)
def test_matches_nanogpt_reference(config, dtype):
    ours, ref, ref64 = module_and_references(config, dtype)
    x = torch.randn(2, 70, config["embed_dim"]).to(dtype)
    grad_out = torch.randn(x.shape).to(dtype)

    out, grads = forward_backward(ours, x, grad_out)
    ref_out, ref_grads = forward_backward(ref, x, grad_out)
    out64, grads64 = forward_backward(ref64, x.double(), grad_out.double())

    assert out.dtype == dtype and out.shape == x.shape
    assert set(grads) == set(ref_grads) == set(grads64)
    assert_matches(dtype, out, grads, ref_out, ref_grads, out64, grads64)


class MultiheadSelfAttention(nn.Module):
    """nn.MultiheadAttention as self-attention with a causal mask, for forward_backward."""

    def __init__(self, mha: nn.MultiheadAttention, length: int):
        super().__init__()
        self.mha = mha
        self.register_buffer("mask", ~visible_keys(length, length))  # True: hidden

    def forward(self, x):
        return self.mha(x, x, x, attn_mask=self.mask, need_weights=False)[0]

    def weights(self, x):
        return self.mha(x, x, x, attn_mask=self.mask, average_attn_weights=False)[1]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", dtype_params((torch.float64, torch.float32)))
def test_matches_multihead_attention(dtype, bias):
    embed_dim, num_heads, length = 32, 4, 19
    ours = CausalSelfAttention(embed_dim, num_heads, bias=bias, dtype=dtype)
    mha = nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True, dtype=dtype)
    ours_to_mha = {"c_attn.weight": "in_proj_weight", "c_proj.weight": "out_proj.weight"}
    if bias:
        ours_to_mha.update({"c_attn.bias": "in_proj_bias", "c_proj.bias": "out_proj.bias"})
    mha.load_state_dict(
        {ours_to_mha[name]: value for name, value in ours.state_dict().items()}, strict=True
    )
    reference = MultiheadSelfAttention(mha, length)
    x = torch.randn(3, length, embed_dim, dtype=dtype)
    grad_out = torch.randn(x.shape, dtype=dtype)

    out, grads = forward_backward(ours, x, grad_out)
    ref_out, ref_grads = forward_backward(reference, x, grad_out)

    tolerance = {} if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, ref_out, **tolerance)
    torch.testing.assert_close(grads["x"], ref_grads["x"], **tolerance)
    for name, mha_name in ours_to_mha.items():
        torch.testing.assert_close(
            grads[f"param.{name}"], ref_grads[f"param.mha.{mha_name}"], **tolerance, msg=name
        )
    with torch.no_grad():
        _, weights = ours(x, need_weights=True)
        torch.testing.assert_close(weights, reference.weights(x), **tolerance)


def padding_and_holes(length: int) -> torch.Tensor:
    """Bool (3, length): left padding; right padding with hidden positions in between (the
    first rows see no key); every position real."""
    mask = torch.ones(3, length, dtype=torch.bool)
    mask[0, :13] = False
    mask[1, :3] = False
    mask[1, 20:25] = False
    mask[1, -9:] = False
    return mask


@pytest.mark.parametrize("dtype", dtype_params((torch.float64, torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("config", CONFIGS)
def test_key_mask_matches_nanogpt_reference_with_the_mask(config, dtype):
    ours, ref, ref64 = module_and_references(config, dtype)
    key_mask = padding_and_holes(70)
    x = torch.randn(3, 70, config["embed_dim"]).to(dtype)
    grad_out = torch.randn(x.shape).to(dtype)

    out, grads = forward_backward(ours, x, grad_out, key_mask=key_mask)
    ref_out, ref_grads = forward_backward(ref, x, grad_out, key_mask=key_mask)
    out64, grads64 = forward_backward(ref64, x.double(), grad_out.double(), key_mask=key_mask)

    # The mask must matter, or this test would be the unmasked one again.
    unmasked64 = ref64(x.double())
    assert (out64 - unmasked64)[~key_mask].abs().max() > 1e-2
    assert set(grads) == set(ref_grads) == set(grads64)
    assert_matches(dtype, out, grads, ref_out, ref_grads, out64, grads64)


@pytest.mark.parametrize("dtype", dtype_params((torch.float64, torch.float32)))
def test_key_mask_matches_multihead_attention_key_padding_mask_at_real_positions(dtype):
    embed_dim, num_heads, length = 32, 4, 19
    ours = CausalSelfAttention(embed_dim, num_heads, dtype=dtype)
    mha = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True, dtype=dtype)
    mha.load_state_dict(
        {
            "in_proj_weight": ours.c_attn.weight,
            "in_proj_bias": ours.c_attn.bias,
            "out_proj.weight": ours.c_proj.weight,
            "out_proj.bias": ours.c_proj.bias,
        },
        strict=True,
    )
    causal = ~visible_keys(length, length)  # MultiheadAttention's attn_mask: True where hidden
    key_mask = left_padded_key_mask([19, 7, 12], length)
    key_mask[2, 10] = False  # a hole among real tokens, too
    x = torch.randn(3, length, embed_dim, dtype=dtype)
    with torch.no_grad():
        out, weights = ours(x, need_weights=True, key_mask=key_mask)
        # MultiheadAttention's key_padding_mask is True where a key is hidden; its rows that see
        # no key are NaN, so only the real positions compare (every real query sees itself).
        ref_out, ref_weights = mha(
            x, x, x, attn_mask=causal, key_padding_mask=~key_mask, average_attn_weights=False
        )
    tolerance = {} if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[key_mask], ref_out[key_mask], **tolerance)
    real_rows = key_mask[:, None, :].expand(-1, num_heads, -1)
    torch.testing.assert_close(weights[real_rows], ref_weights[real_rows], **tolerance)
    # Hidden keys get no weight, and a row that sees no key (the padding before the first real
    # token) none at all.
    assert torch.count_nonzero(weights.transpose(1, 3)[~key_mask]) == 0
    assert torch.count_nonzero(weights[1, :, :12]) == 0


def test_an_all_true_key_mask_changes_nothing():
    module = CausalSelfAttention(32, 4, num_kv_heads=2)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            module(x, key_mask=torch.ones(2, 9, dtype=torch.bool)), module(x)
        )


def test_bad_key_mask_raises_typed_errors_naming_it():
    module = CausalSelfAttention(32, 4)
    x = torch.randn(2, 5, 32)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"must be a bool tensor.*key_mask\.dtype=torch\.int64"):
        module(x, key_mask=mask.long())
    with pytest.raises(TypeError, match="key_mask must be a bool tensor.*got list"):
        module(x, key_mask=[[True] * 5] * 2)
    with pytest.raises(
        ValueError, match=r"key_mask must be \(B, L\)=\[2, 5\] of x, got key_mask\.shape=\[2, 4\]"
    ):
        module(x, key_mask=mask[:, :4])
    with pytest.raises(ValueError, match=r"key_mask\.shape=\[5\]"):
        module(x, key_mask=mask[0])
    with pytest.raises(ValueError, match=r"key_mask must be on x's device cpu.*meta"):
        module(x, key_mask=mask.to("meta"))
    with pytest.raises(ValueError, match=r"key_mask must be \(B, L\)"):
        module.forward_with_weights(x, None, mask[:1])


def test_loads_nanogpt_checkpoint_strictly_and_ignores_its_mask_buffer():
    nanogpt = nn.ModuleDict({"attn": NanoGPTAttention(SMALL, block_size=64)})
    checkpoint = nanogpt.state_dict()
    assert "attn.bias" in checkpoint
    ours = nn.ModuleDict({"attn": CausalSelfAttention(32, 4)})
    ours.load_state_dict(checkpoint, strict=True)
    assert "attn.bias" in checkpoint, "the caller's state_dict must not be modified"
    x = torch.randn(2, 10, 32)
    torch.testing.assert_close(ours["attn"](x), nanogpt["attn"](x))

    # Back again: our state_dict is exactly nanoGPT's flash-attention module's.
    assert set(ours["attn"].state_dict()) == {
        "c_attn.weight",
        "c_attn.bias",
        "c_proj.weight",
        "c_proj.bias",
    }
    flash = NanoGPTAttention(SMALL)
    flash.load_state_dict(ours["attn"].state_dict(), strict=True)
    torch.testing.assert_close(flash(x), nanogpt["attn"](x))


def test_strict_load_still_reports_missing_and_unexpected_keys():
    state = CausalSelfAttention(32, 4).state_dict()
    del state["c_proj.bias"]
    state["c_attn.scale"] = torch.ones(())
    expected = r"(?s)Missing key.*c_proj\.bias.*Unexpected key.*c_attn\.scale"
    with pytest.raises(RuntimeError, match=expected):
        CausalSelfAttention(32, 4).load_state_dict(state, strict=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(embed_dim=0, num_heads=4), "embed_dim and num_heads must be positive.*embed_dim=0"),
        (dict(embed_dim=32, num_heads=-1), "embed_dim and num_heads must be positive"),
        (
            dict(embed_dim=32, num_heads=4, num_kv_heads=3),
            "num_kv_heads must be a positive divisor.*num_heads=4, num_kv_heads=3",
        ),
        (dict(embed_dim=30, num_heads=4), "multiple of num_heads.*embed_dim=30, num_heads=4"),
        (dict(embed_dim=32, num_heads=4, head_dim=0), "head_dim=0"),
        (dict(embed_dim=32, num_heads=4, value_head_dim=-2), "value_head_dim=-2"),
        (dict(embed_dim=32, num_heads=4, dropout=1.5), r"dropout must be in \[0, 1\].*1\.5"),
        # The op has no all-dropped case, unlike nn.Dropout(1.0).
        (dict(embed_dim=32, num_heads=4, attn_dropout=1.0), r"attn_dropout must be in \[0, 1\)"),
        (dict(embed_dim=32, num_heads=4, attn_dropout=-0.1), r"attn_dropout=-0\.1"),
        (dict(embed_dim=32, num_heads=4, window=(-2, 0)), r"entries must be >= -1.*\(-2, 0\)"),
        (dict(embed_dim=32, num_heads=4, window=(4, -3)), r"window=\(4, -3\)"),
        (dict(embed_dim=32, num_heads=4, softcap=0.0), r"softcap must be finite and > 0.*=0\.0"),
        (dict(embed_dim=32, num_heads=4, softcap=-1.0), r"softcap=-1\.0"),
        (dict(embed_dim=32, num_heads=4, softcap=float("inf")), r"softcap=inf"),
        (dict(embed_dim=32, num_heads=4, softcap=float("nan")), r"softcap=nan"),
    ],
)
def test_bad_options_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CausalSelfAttention(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=4), "window must be two ints.*window=4"),
        (dict(window=(4,)), r"window=\(4,\)"),
        (dict(window=(4.0, 0)), r"window=\(4\.0, 0\)"),
        (dict(window="40"), "window='40'"),
        (dict(softcap="2"), "softcap must be a float or None, got str"),
        (dict(softcap=True), "got bool"),
        # Flags are bools: a truthy string or number would pass for True.
        (dict(sinks="yes"), "sinks must be a bool, got str 'yes'"),
        (dict(alibi=2), "alibi must be a bool, got int 2"),
        (dict(bias=None), "bias must be a bool, got NoneType None"),
    ],
)
def test_option_of_the_wrong_type_raises_type_error(kwargs, match):
    with pytest.raises(TypeError, match=rf"CausalSelfAttention: .*{match}"):
        CausalSelfAttention(32, 4, **kwargs)


def test_bad_input_raises_typed_errors():
    module = CausalSelfAttention(32, 4)
    with pytest.raises(ValueError, match=r"\(B, L, E\) with E=embed_dim=32.*\[2, 5, 16\]"):
        module(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"x\.shape=\[5, 32\]"):
        module(torch.randn(5, 32))
    with pytest.raises(TypeError, match="dtype torch.float32, got x.dtype=torch.float64"):
        module(torch.randn(2, 5, 32, dtype=torch.float64))


# Before, None failed inside with "AttributeError: 'NoneType' object has no attribute 'dim'".
@pytest.mark.parametrize("x", [None, [[0.0] * 16], 1.0], ids=["None", "list", "float"])
@pytest.mark.parametrize(
    "call",
    [
        lambda module, x: module(x),
        lambda module, x: module(x, need_weights=True),
        lambda module, x: module.forward_with_weights(x),
        lambda module, x: module(x, module.make_cache(1, 4)),
    ],
    ids=["forward", "need_weights", "forward_with_weights", "with-cache"],
)
def test_an_x_that_is_not_a_tensor_raises_type_error_naming_it(call, x):
    module = CausalSelfAttention(16, 2)
    expected = rf"CausalSelfAttention: x must be a tensor \(B, L, E\), got {type(x).__name__}$"
    with pytest.raises(TypeError, match=expected):
        call(module, x)


def test_dropout_acts_on_the_output_projection_in_training_only():
    module = CausalSelfAttention(32, 4, dropout=1.0)
    x = torch.randn(2, 5, 32)
    assert torch.count_nonzero(module.train()(x)) == 0
    without_dropout = CausalSelfAttention(32, 4)
    without_dropout.load_state_dict(module.state_dict())
    torch.testing.assert_close(module.eval()(x), without_dropout(x))
    assert torch.count_nonzero(module(x)) > 0


def test_options_are_resolved_and_shown():
    module = CausalSelfAttention(48, 6, num_kv_heads=2, value_head_dim=4)
    assert (module.num_kv_heads, module.head_dim, module.value_head_dim) == (2, 8, 4)
    assert module.c_attn.weight.shape == ((6 + 2) * 8 + 2 * 4, 48)
    assert module.c_proj.weight.shape == (48, 6 * 4)
    assert "num_kv_heads=2, head_dim=8, value_head_dim=4" in repr(module)
    assert "window" not in repr(module) and module.sinks is None and module.alibi_slopes is None
    with_options = CausalSelfAttention(
        48, 6, attn_dropout=0.1, window=[7, 0], softcap=30, sinks=True, alibi=True
    )
    assert (with_options.window, with_options.softcap) == ((7, 0), 30.0)
    assert isinstance(with_options.softcap, float)
    assert "attn_dropout=0.1, window=(7, 0), softcap=30.0, sinks=True, alibi=True" in repr(
        with_options
    )


@pytest.mark.parametrize("dtype", dtype_params((torch.float64, torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("masked", [False, True], ids=["", "key-mask"])
@pytest.mark.parametrize("options", SCORE_OPTIONS)
@pytest.mark.parametrize("config", CONFIGS[1:3])
def test_score_options_match_the_materialized_reference(config, options, masked, dtype):
    plain64 = NanoGPTAttention(config).double()
    config = {**config, **options}
    ours, ref, ref64 = module_and_references(config, dtype)
    key_mask = padding_and_holes(40) if masked else None
    x = torch.randn(3, 40, config["embed_dim"]).to(dtype)
    grad_out = torch.randn(x.shape).to(dtype)

    out, grads = forward_backward(ours, x, grad_out, key_mask=key_mask)
    ref_out, ref_grads = forward_backward(ref, x, grad_out, key_mask=key_mask)
    out64, grads64 = forward_backward(ref64, x.double(), grad_out.double(), key_mask=key_mask)

    # The options must matter, or this would test the plain module again.
    plain64.load_state_dict(ours.state_dict(), strict=False)  # without sinks and slopes
    with torch.no_grad():
        assert (out64 - plain64(x.double(), key_mask=key_mask)).abs().max() > 1e-2
    assert ("param.sinks" in grads) == bool(options.get("sinks"))
    assert set(grads) == set(ref_grads) == set(grads64)
    assert_matches(dtype, out, grads, ref_out, ref_grads, out64, grads64)


def test_weights_with_score_options_are_the_reference_probabilities():
    config = dict(embed_dim=32, num_heads=4, num_kv_heads=2, window=(5, 2), softcap=0.5)
    config.update(sinks=True, alibi=True)
    ours, _, ref64 = module_and_references(config, torch.float64)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    key_mask = left_padded_key_mask([12, 6], 12)
    with torch.no_grad():
        out, weights = ours(x, need_weights=True, key_mask=key_mask)
        torch.testing.assert_close(out, ref64(x, key_mask=key_mask))
        torch.testing.assert_close(weights, ref64.weights(x, key_mask=key_mask))
    # The sinks take their share: every row that sees a key sums to less than 1.
    assert (weights.sum(-1)[key_mask[:, None, :].expand(-1, 4, -1)] < 1 - 1e-3).all()


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 8, 12, 16, 24, 64])
def test_alibi_slopes_are_bloom_s(num_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # BLOOM's bias at key position 1 of a row is its slope; it computes the powers in float32,
    # ours rounds 2^-e once, so they differ by float32 rounding.
    bloom = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]
    slopes = alibi_slopes(num_heads)
    assert slopes.dtype == torch.float32 and slopes.shape == (num_heads,)
    torch.testing.assert_close(slopes, bloom, rtol=1e-6, atol=0)
    module = CausalSelfAttention(8 * num_heads, num_heads, alibi=True)
    assert torch.equal(module.alibi_slopes, slopes)


def test_alibi_slopes_are_the_geometric_sequence_and_its_interpolation():
    exponents8 = [1, 2, 3, 4, 5, 6, 7, 8]
    assert torch.equal(alibi_slopes(8), torch.tensor([2.0**-e for e in exponents8]))
    # 12 heads: 8 slopes of the power of two below, then every other slope of 16 heads.
    exponents12 = exponents8 + [0.5, 1.5, 2.5, 3.5]
    assert torch.equal(alibi_slopes(12), torch.tensor([2.0**-e for e in exponents12]))
    with pytest.raises(ValueError, match="num_heads must be positive, got num_heads=0"):
        alibi_slopes(0)


def test_sinks_and_slopes_go_through_the_state_dict():
    options = dict(num_kv_heads=2, window=(5, 0), softcap=0.5, sinks=True, alibi=True)
    module = CausalSelfAttention(32, 4, **options)
    randomize_sinks(module)
    state = module.state_dict()
    assert set(state) == {
        "c_attn.weight",
        "c_attn.bias",
        "c_proj.weight",
        "c_proj.bias",
        "sinks",
        "alibi_slopes",
    }
    loaded = CausalSelfAttention(32, 4, **options)
    loaded.load_state_dict(state, strict=True)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), module(x))
    # A module without the options has no place for them, and says so.
    with pytest.raises(RuntimeError, match=r"(?s)Unexpected key.*sinks.*alibi_slopes"):
        CausalSelfAttention(32, 4, num_kv_heads=2).load_state_dict(state, strict=True)
    with pytest.raises(RuntimeError, match=r"Missing key.*alibi_slopes"):
        CausalSelfAttention(32, 4, num_kv_heads=2, sinks=True, alibi=True).load_state_dict(
            {name: value for name, value in state.items() if name != "alibi_slopes"}
        )


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.double(),
        lambda m: m.to("cpu", torch.float16),
        lambda m: nn.Sequential(m).to(torch.bfloat16)[0],
    ],
    ids=["to-bf16", "half", "double", "to-device-and-dtype", "as-a-child"],
)
def test_a_dtype_conversion_keeps_the_slopes_float32_and_exact(convert):
    module = convert(CausalSelfAttention(48, 6, sinks=True, alibi=True))
    dtype = module.c_attn.weight.dtype
    assert module.alibi_slopes.dtype == torch.float32
    assert torch.equal(module.alibi_slopes, alibi_slopes(6))  # 6 heads: slopes of 2^-1.5 etc.
    assert module.sinks.dtype == dtype
    # And the module still runs in its new dtype (the op takes float32 slopes only).
    with torch.no_grad():
        assert module(torch.randn(1, 5, 48, dtype=dtype)).dtype == dtype


def test_options_follow_the_device():
    module = CausalSelfAttention(32, 4, sinks=True, alibi=True, device="meta")
    assert module.sinks.device.type == module.alibi_slopes.device.type == "meta"
    module.to_empty(device="cpu")
    assert module.alibi_slopes.device.type == "cpu" and module.alibi_slopes.dtype == torch.float32


DROPOUT_CONFIG = dict(embed_dim=32, num_heads=4, num_kv_heads=2)


def dropout_reference(config, module, x, grad_out, p, seed, key_mask=None):
    """The float64 reference of ``module`` (made from ``config``) under the dropout mask that
    the op draws after ``torch.manual_seed(seed)``: (seed, offset) drawn from the default
    generator as the op draws them, and the op's counter-based keep mask of the scores' shape.
    Returns the output, the gradients, the dropped probabilities and the keep mask."""
    ref64 = NanoGPTAttention(config).double()
    ref64.load_state_dict(module.state_dict(), strict=True)
    torch.manual_seed(seed)
    dropout_seed = torch.empty(2, dtype=torch.int64).random_()
    batch, length = x.shape[:2]
    shape = [batch, module.num_heads, length, length]
    keep = torch.ops.causal_attention.dropout_keep_mask(dropout_seed, shape, p)
    out, grads = forward_backward(ref64, x, grad_out, key_mask=key_mask, keep=keep, dropout_p=p)
    with torch.no_grad():
        weights = ref64.weights(x, key_mask, keep, p)
    return out, grads, weights, keep


@pytest.mark.parametrize(
    "options",
    [pytest.param({}, id="causal"), pytest.param(EVERY_SCORE_OPTION, id="all-options")],
)
def test_attention_dropout_in_training_drops_with_the_op_mask(options):
    config = {**DROPOUT_CONFIG, **options}
    p = 0.3
    module = CausalSelfAttention(**config, attn_dropout=p, dtype=torch.float64).train()
    randomize_sinks(module)
    key_mask = left_padded_key_mask([20, 13], 20)
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    grad_out = torch.randn(x.shape, dtype=torch.float64)

    torch.manual_seed(11)
    out, grads = forward_backward(module, x, grad_out, key_mask=key_mask)
    ref_out, ref_grads, ref_weights, keep = dropout_reference(
        config, module, x, grad_out, p, 11, key_mask
    )
    torch.testing.assert_close(out, ref_out)
    assert set(grads) == set(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=name)

    # forward_with_weights: the dropped weights, and the output made with them.
    torch.manual_seed(11)
    with torch.no_grad():
        out_with_weights, weights = module(x, need_weights=True, key_mask=key_mask)
    torch.testing.assert_close(out_with_weights, ref_out)
    torch.testing.assert_close(weights, ref_weights)
    # Dropout acted, at about its rate.
    assert 0.25 < 1 - keep.double().mean().item() < 0.35
    with torch.no_grad():
        assert (module.eval()(x, key_mask=key_mask) - out).abs().max() > 1e-2


def test_attention_dropout_draws_a_new_mask_per_call_and_none_in_evaluation():
    module = CausalSelfAttention(32, 4, attn_dropout=0.5, sinks=True)
    exact = CausalSelfAttention(32, 4, sinks=True)
    exact.load_state_dict(module.state_dict(), strict=True)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.manual_seed(3)
        first, second = module(x), module(x)
        torch.manual_seed(3)
        assert torch.equal(module(x), first)
        assert (first - second).abs().max() > 1e-3
        # Evaluation is exact, and draws nothing from the generator.
        module.eval()
        state = torch.get_rng_state()
        assert torch.equal(module(x), exact(x))
        assert torch.equal(module.forward_with_weights(x)[1], exact.forward_with_weights(x)[1])
        assert torch.equal(torch.get_rng_state(), state)


def test_attention_dropout_backpropagates_through_forward_with_weights():
    config = {**DROPOUT_CONFIG, "sinks": True, "window": (7, 0)}
    module = CausalSelfAttention(**config, attn_dropout=0.3, dtype=torch.float64).train()
    randomize_sinks(module)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    grad_out = torch.randn(x.shape, dtype=torch.float64)

    class OutputOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = module

        def forward(self, x):
            return self.attn(x, need_weights=True)[0]

    torch.manual_seed(5)
    _, grads = forward_backward(OutputOnly(), x, grad_out)
    _, ref_grads, _, _ = dropout_reference(config, module, x, grad_out, 0.3, 5)
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[name.replace("param.", "param.attn.")], ref_grad)


@pytest.mark.parametrize("dtype", dtype_params([torch.float64, torch.float32]))
def test_a_document_mask_is_each_document_alone_and_a_learned_bias_trains(dtype):
    """attn_mask through the module: a block-diagonal mask over a packed row gives what each
    document gives alone, and a float bias parameter gets the gradient SDPA's math gives it."""
    torch.manual_seed(0)
    module = CausalSelfAttention(32, 4, num_kv_heads=2, dtype=dtype)
    lengths = [5, 11, 8]
    x = torch.randn(1, sum(lengths), 32, dtype=dtype)
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    packed = module(x, attn_mask=document[:, None] == document[None, :])
    alone = torch.cat([module(part) for part in x.split(lengths, dim=1)], dim=1)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert (packed - alone).abs().max().item() <= tolerance

    bias = torch.randn(1, 4, 6, 6, dtype=dtype, requires_grad=True)
    y = torch.randn(2, 6, 32, dtype=dtype)
    out = module(y, attn_mask=bias)
    (grad,) = torch.autograd.grad(out.square().sum(), bias)
    q, k, v = module._project_heads(y, None)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf")), enable_gqa=True
    )
    (want,) = torch.autograd.grad(module._project_output(reference).square().sum(), bias)
    assert (grad - want).abs().max().item() <= 10 * tolerance
    weights = module(y, need_weights=True, attn_mask=bias)[1]
    assert weights.shape == (2, 4, 6, 6) and torch.allclose(
        weights.sum(-1), torch.ones(2, 4, 6, dtype=dtype)
    )
