"""CausalSelfAttention and TinyGPT under TorchScript and torch.export: the scripted module (with
and without a KV cache, with and without a key mask, with every score option and attention
dropout) and the exported programs run and match eager, and
tests/fixtures/export_torchscript_model.py writes a model that reproduces its expected outputs and
gradients when loaded back."""

import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from causal_attention import CausalSelfAttention
from fixtures.tiny_gpt import TinyGPT
from nn_testing import (
    CONFIGS,
    IGNORE_TORCHSCRIPT_DEPRECATION,
    ROOT,
    forward_backward,
    left_padded_key_mask,
    randomize_sinks,
)

pytestmark = IGNORE_TORCHSCRIPT_DEPRECATION

# Every score option, each binding on 9 positions (a window of 6).
ALL_OPTIONS = dict(window=(5, 0), softcap=0.5, sinks=True, alibi=True, attn_dropout=0.2)


def module_with_all_options():
    module = CausalSelfAttention(32, 4, num_kv_heads=2, **ALL_OPTIONS)
    randomize_sinks(module)
    return module


def reload(scripted):
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    return torch.jit.load(buffer)


@pytest.mark.parametrize("config", CONFIGS)
def test_scripted_module_matches_eager_after_save_and_load(config):
    module = CausalSelfAttention(**config)
    scripted = reload(torch.jit.script(module))
    assert "causal_attention::attention(" in str(scripted.inlined_graph)
    x = torch.randn(2, 9, config["embed_dim"])
    grad_out = torch.randn(x.shape)
    out, grads = forward_backward(module, x, grad_out)
    scripted_out, scripted_grads = forward_backward(scripted, x, grad_out)
    torch.testing.assert_close(scripted_out, out)
    assert scripted_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(scripted_grads[name], grads[name], msg=name)
    with torch.no_grad():
        for scripted_value, value in zip(
            scripted.forward_with_weights(x), module(x, need_weights=True)
        ):
            torch.testing.assert_close(scripted_value, value)


def test_scripted_forward_points_to_forward_with_weights():
    scripted = torch.jit.script(CausalSelfAttention(32, 4))
    with pytest.raises(torch.jit.Error, match="call forward_with_weights"):
        scripted(torch.randn(1, 3, 32), None, True)


def test_scripted_module_decodes_with_a_cache():
    module = CausalSelfAttention(32, 4, num_kv_heads=2, value_head_dim=4).eval()
    scripted = torch.jit.script(module)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        full = module(x)
        # A cache made by the scripted module, then one made in eager Python: both must keep
        # their length across calls from Python into TorchScript.
        for cache in (scripted.make_cache(2, 6), module.make_cache(2, 6)):
            steps = [scripted(x[:, i : i + 1], cache) for i in range(6)]
            torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
            assert cache.length == 6
            with pytest.raises(torch.jit.Error, match="ValueError: KVCache: cannot append 1"):
                scripted(x[:, :1], cache)
            cache.reset()
            assert cache.length == 0


def test_caches_scripted_modules_make_keep_their_own_lengths():
    """Every cache a scripted module makes (any scripted module in the process) has its own
    length and key mask flag: TorchScript once folded their zeros into one constant tensor, so
    that a second cache started where the first one's decoding had got to."""
    first = torch.jit.script(CausalSelfAttention(32, 4).eval())
    second = torch.jit.script(CausalSelfAttention(32, 4).eval())
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        caches = [first.make_cache(2, 6), first.make_cache(2, 6), second.make_cache(2, 6)]
        first(x, caches[0], False, torch.ones(2, 3, dtype=torch.bool))
    assert [cache.length for cache in caches] == [3, 0, 0]
    assert caches[0].key_mask is not None
    assert caches[1].key_mask is None and caches[2].key_mask is None


@pytest.mark.parametrize("config", CONFIGS)
def test_scripted_module_takes_a_key_mask(config):
    module = CausalSelfAttention(**config)
    scripted = reload(torch.jit.script(module))
    x = torch.randn(3, 9, config["embed_dim"])
    key_mask = left_padded_key_mask([9, 4, 6], 9)
    grad_out = torch.randn(x.shape)
    out, grads = forward_backward(module, x, grad_out, key_mask=key_mask)
    scripted_out, scripted_grads = forward_backward(scripted, x, grad_out, key_mask=key_mask)
    torch.testing.assert_close(scripted_out, out)
    for name in grads:
        torch.testing.assert_close(scripted_grads[name], grads[name], msg=name)
    with torch.no_grad():
        assert (out - module(x)).abs().max() > 1e-3, "the mask must matter here"
        for scripted_value, value in zip(
            scripted.forward_with_weights(x, None, key_mask),
            module(x, need_weights=True, key_mask=key_mask),
        ):
            torch.testing.assert_close(scripted_value, value)
    with pytest.raises(torch.jit.Error, match=r"ValueError: .*key_mask must be \(B, L\)=\[3, 9\]"):
        scripted(x, key_mask=key_mask[:, 1:])
    # TorchScript prints a dtype as its number, so the message names the argument only.
    with pytest.raises(torch.jit.Error, match="TypeError: .*key_mask must be a bool tensor"):
        scripted(x, key_mask=key_mask.float())


def test_scripted_module_decodes_left_padded_prompts():
    module = CausalSelfAttention(32, 4, num_kv_heads=2).eval()
    scripted = torch.jit.script(module)
    x = torch.randn(2, 8, 32)
    key_mask = left_padded_key_mask([2, 5], 5)
    with torch.no_grad():
        outputs = {}
        for name, runner, cache in (
            ("eager", module, module.make_cache(2, 8)),
            ("scripted", scripted, scripted.make_cache(2, 8)),
            ("scripted, eager cache", scripted, module.make_cache(2, 8)),
        ):
            steps = [runner(x[:, :5], cache, False, key_mask)]
            steps += [runner(x[:, i : i + 1], cache) for i in range(5, 8)]
            outputs[name] = torch.cat(steps, dim=1)
            assert cache.length == 8
            assert torch.equal(cache.key_mask[:, :5], key_mask), name
        alone = module(x[:1, 3:])  # row 0: its 3 padding positions removed
    for name, out in outputs.items():
        torch.testing.assert_close(out, outputs["eager"], msg=name)
    torch.testing.assert_close(outputs["eager"][:1, 3:], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_scripted_module_keeps_the_score_options_after_save_and_load(training):
    module = module_with_all_options().train(training)
    scripted = reload(torch.jit.script(module)).train(training)
    assert scripted.state_dict().keys() == module.state_dict().keys()
    for name, value in module.state_dict().items():
        assert torch.equal(scripted.state_dict()[name], value), name
    x = torch.randn(3, 9, 32)
    key_mask = left_padded_key_mask([9, 4, 6], 9)
    grad_out = torch.randn(x.shape)
    # In training, the same generator state gives the same dropout mask in both.
    torch.manual_seed(1)
    out, grads = forward_backward(module, x, grad_out, key_mask=key_mask)
    torch.manual_seed(1)
    scripted_out, scripted_grads = forward_backward(scripted, x, grad_out, key_mask=key_mask)
    torch.testing.assert_close(scripted_out, out)
    assert "param.sinks" in grads and scripted_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(scripted_grads[name], grads[name], msg=name)
    with torch.no_grad():
        torch.manual_seed(2)
        expected = module(x, need_weights=True, key_mask=key_mask)
        torch.manual_seed(2)
        for scripted_value, value in zip(
            scripted.forward_with_weights(x, None, key_mask), expected
        ):
            torch.testing.assert_close(scripted_value, value)
        # The options are in the scripted module: without them it would attend otherwise.
        plain = CausalSelfAttention(32, 4, num_kv_heads=2)
        plain.load_state_dict(module.state_dict(), strict=False)
        assert (plain(x, key_mask=key_mask) - scripted(x, key_mask=key_mask)).abs().max() > 1e-2


def test_scripted_module_decodes_with_score_options():
    module = module_with_all_options().eval()
    scripted = torch.jit.script(module)
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        cache = scripted.make_cache(2, 12)
        steps = [scripted(x[:, :5], cache)]
        steps += [scripted(x[:, i : i + 1], cache) for i in range(5, 12)]
        torch.testing.assert_close(torch.cat(steps, dim=1), module(x), atol=1e-5, rtol=1e-5)


def test_scripted_tiny_gpt_matches_eager_forward_and_backward():
    model = TinyGPT()
    scripted = reload(torch.jit.script(model))
    tokens = torch.randint(0, 64, (2, 12))
    logits = model(tokens)
    scripted_logits = scripted(tokens)
    torch.testing.assert_close(scripted_logits, logits)
    logits.square().mean().backward()
    scripted_logits.square().mean().backward()
    for (name, p), (scripted_name, scripted_p) in zip(
        model.named_parameters(), scripted.named_parameters()
    ):
        assert scripted_name == name
        torch.testing.assert_close(scripted_p.grad, p.grad, msg=name)


@pytest.mark.parametrize("need_weights", [False, True], ids=["output", "with-weights"])
def test_exported_module_matches_eager_at_any_length(need_weights):
    module = CausalSelfAttention(32, 4, num_kv_heads=2).eval()
    length = torch.export.Dim("length", min=2, max=128)
    exported = torch.export.export(
        module,
        (torch.randn(2, 9, 32),),
        {"need_weights": need_weights},
        dynamic_shapes={"x": {1: length}, "need_weights": None},
    )
    for size in (9, 70):
        x = torch.randn(2, size, 32)
        torch.testing.assert_close(
            exported.module()(x, need_weights=need_weights), module(x, need_weights=need_weights)
        )


@pytest.mark.parametrize("need_weights", [False, True], ids=["output", "with-weights"])
def test_exported_module_takes_a_key_mask_at_any_length(need_weights):
    module = CausalSelfAttention(32, 4, num_kv_heads=2).eval()
    length = torch.export.Dim("length", min=2, max=128)
    exported = torch.export.export(
        module,
        (torch.randn(2, 9, 32),),
        {"need_weights": need_weights, "key_mask": left_padded_key_mask([9, 4], 9)},
        dynamic_shapes={"x": {1: length}, "need_weights": None, "key_mask": {1: length}},
    )
    assert any(
        node.target is torch.ops.causal_attention.attention.default
        and node.kwargs.get("key_mask") is not None
        for node in exported.graph.nodes
    )
    for size in (9, 70):
        x = torch.randn(2, size, 32)
        key_mask = left_padded_key_mask([size - 3, size // 2], size)
        kwargs = dict(need_weights=need_weights, key_mask=key_mask)
        torch.testing.assert_close(exported.module()(x, **kwargs), module(x, **kwargs))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["output", "with-weights"])
def test_exported_module_keeps_the_score_options_at_any_length(need_weights, training):
    module = module_with_all_options().train(training)
    length = torch.export.Dim("length", min=2, max=128)
    exported = torch.export.export(
        module,
        (torch.randn(2, 9, 32),),
        {"need_weights": need_weights},
        dynamic_shapes={"x": {1: length}, "need_weights": None},
    )
    calls = [
        node
        for node in exported.graph.nodes
        if node.target
        in (
            torch.ops.causal_attention.attention.default,
            torch.ops.causal_attention.attention_weights.default,
        )
    ]
    assert calls
    for node in calls:
        assert (node.kwargs["window"], node.kwargs["softcap"]) == ([5, 0], 0.5)
        assert node.kwargs["sinks"] is not None and node.kwargs["alibi_slopes"] is not None
        assert node.kwargs.get("dropout_p", 0.0) == (0.2 if training else 0.0)
    assert {"sinks", "alibi_slopes"} <= exported.state_dict.keys()
    for size in (9, 70):
        x = torch.randn(2, size, 32)
        torch.manual_seed(3)
        result = exported.module()(x, need_weights=need_weights)
        torch.manual_seed(3)
        torch.testing.assert_close(result, module(x, need_weights=need_weights))


def test_exported_tiny_gpt_matches_eager():
    model = TinyGPT().eval()
    tokens = torch.randint(0, 64, (3, 20))
    exported = torch.export.export(model, (tokens,))
    assert any(
        node.target is torch.ops.causal_attention.attention.default
        for node in exported.graph.nodes
    )
    torch.testing.assert_close(exported.module()(tokens), model(tokens))


def test_export_script_writes_a_model_that_reproduces_its_expectations(tmp_path):
    python_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=python_path)
    subprocess.run(
        [sys.executable, str(ROOT / "tests/fixtures/export_torchscript_model.py"), str(tmp_path)],
        check=True,
        env=env,
    )
    model = torch.jit.load(str(tmp_path / "tiny_gpt.pt"))
    expected = torch.load(tmp_path / "tiny_gpt_expected.pt")
    logits = model(expected["tokens"])
    torch.testing.assert_close(logits, expected["logits"])
    F.cross_entropy(logits.flatten(0, 1), expected["targets"].flatten()).backward()
    parameters = dict(model.named_parameters())
    assert {f"grad.{name}" for name in parameters} == {
        key for key in expected if key.startswith("grad.")
    }
    for name, p in parameters.items():
        torch.testing.assert_close(p.grad, expected[f"grad.{name}"], msg=name)
