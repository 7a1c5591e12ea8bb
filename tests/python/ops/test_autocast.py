"""The ops under torch.autocast("cpu"): the autocast kernels (csrc/ops/autocast/) cast q, k and v to
the region's dtype with SDPA's policy and redispatch, so results are bitwise those of calling with
explicitly cast inputs, float32 leaves get float32 gradients, and mixed dtypes are served inside a
region and refused outside it; the module, compile, TorchScript and the transformers backend
follow."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import causal_attention
import causal_attention.integrations.transformers as backend
from attention_testing.inputs import make_key_mask

AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]


def leaves(*shapes, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(*shape, dtype=dtype, requires_grad=True) for shape in shapes]


def grads_of(out, inputs):
    return torch.autograd.grad(out.float().square().sum(), inputs)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
def test_attention_under_autocast_is_the_call_with_cast_inputs(dtype):
    q, k, v = leaves((2, 4, 40, 16), (2, 2, 40, 16), (2, 2, 40, 8))
    with torch.autocast("cpu", dtype=dtype):
        out = causal_attention.attention(q, k, v)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == sdpa.dtype == dtype
    cast = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    explicit = causal_attention.attention(*cast)
    assert torch.equal(out, explicit)
    grads, explicit_grads = grads_of(out, (q, k, v)), grads_of(explicit, cast)
    for grad, explicit_grad in zip(grads, explicit_grads):
        assert grad.dtype == torch.float32
        assert torch.equal(grad, explicit_grad.float())


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
def test_mixed_dtypes_are_served_inside_a_region_and_refused_outside(dtype):
    q, k = leaves((3, 20, 8), (3, 20, 8))
    (v,) = leaves((3, 20, 8), dtype=dtype)
    with pytest.raises(TypeError, match="q, k and v must have the same dtype"):
        causal_attention.attention(q, k, v)
    with torch.autocast("cpu", dtype=dtype):
        out = causal_attention.attention(q, k, v)
    assert out.dtype == dtype
    assert torch.equal(out, causal_attention.attention(q.to(dtype), k.to(dtype), v))
    assert [g.dtype for g in grads_of(out, (q, k, v))] == [torch.float32, torch.float32, dtype]


def test_float64_stays_float64_under_autocast_as_in_sdpa():
    q, k, v = leaves((2, 16, 8), (2, 16, 8), (2, 16, 8), dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = causal_attention.attention(q, k, v)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == sdpa.dtype == torch.float64


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
def test_forward_op_and_key_mask_under_autocast(dtype):
    q, k, v = leaves((2, 3, 33, 16), (2, 3, 33, 16), (2, 3, 33, 16))
    mask = make_key_mask((2, 33), "holes")
    with torch.autocast("cpu", dtype=dtype):
        out, lse = causal_attention.attention_forward(q, k, v, 0.25, mask)
        masked = causal_attention.attention(q, k, v, key_mask=mask)
    # The mask stays boolean and lse in the accumulation dtype.
    assert out.dtype == masked.dtype == dtype and lse.dtype == torch.float32
    expected, expected_lse = causal_attention.attention_forward(
        q.to(dtype), k.to(dtype), v.to(dtype), 0.25, mask
    )
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert torch.equal(masked, causal_attention.attention(*(t.to(dtype) for t in (q, k, v)),
                                                          key_mask=mask))


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
def test_varlen_attention_under_autocast(dtype):
    lengths = (5, 0, 30, 12)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    q, k, v = leaves((47, 4, 16), (47, 2, 16), (47, 2, 8))
    with torch.autocast("cpu", dtype=dtype):
        out = causal_attention.varlen_attention(q, k, v, cu, cu, 30, 30)
        out_lse = causal_attention.varlen_attention_forward(q, k, v, cu, cu, 30, 30, 0.25)
    cast = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    explicit = causal_attention.varlen_attention(*cast, cu, cu, 30, 30)
    assert out.dtype == dtype and torch.equal(out, explicit)
    assert out_lse[0].dtype == dtype and out_lse[1].dtype == torch.float32
    for grad, explicit_grad in zip(grads_of(out, (q, k, v)), grads_of(explicit, cast)):
        assert grad.dtype == torch.float32 and torch.equal(grad, explicit_grad.float())


def test_compiled_call_under_autocast_has_no_graph_break_and_matches_eager():
    q, k, v = leaves((2, 4, 24, 16), (2, 4, 24, 16), (2, 4, 24, 16))
    mask = make_key_mask((2, 24), "left-pad")

    def attend(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return causal_attention.attention(q, k, v, key_mask=mask)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    out, eager = compiled(q, k, v), attend(q, k, v)
    assert out.dtype == torch.bfloat16 and torch.equal(out, eager)
    for grad, eager_grad in zip(grads_of(out, (q, k, v)), grads_of(eager, (q, k, v))):
        assert grad.dtype == torch.float32 and torch.equal(grad, eager_grad)


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "torchscript"])
def test_module_trains_under_autocast_with_float32_weights(scripted):
    torch.manual_seed(0)
    module = causal_attention.CausalSelfAttention(32, 4, num_kv_heads=2)
    x = torch.randn(2, 10, 32)
    reference = copy.deepcopy(module)
    run = torch.jit.script(module) if scripted else module
    # TorchScript: the scripted module runs under an eager autocast region (the dispatcher's
    # autocast kernels fire for every op it calls); autocast inside scripted code is not used.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(x)
        expected = reference(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in module.parameters())


LLAMA = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    vocab_size=128, bos_token_id=1, eos_token_id=2)
GPT2 = GPT2Config(n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0,
                  resid_pdrop=0.0, embd_pdrop=0.0, vocab_size=128, bos_token_id=1,
                  eos_token_id=2)


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-gqa", "gpt2"])
def test_transformers_training_step_under_bfloat16_autocast_matches_sdpa(config):
    backend.register()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                            attn_implementation="causal_attention")
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 128, (2, 16))
    losses = []
    for model in (ours, ref):
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], atol=2e-2, rtol=1e-2)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        ref_grad = ref_params[name].grad
        assert p.grad.dtype == torch.float32, name
        # bfloat16 tolerance: relative to the gradient's size, as bfloat16 rounds relatively.
        error = (p.grad - ref_grad).norm() / ref_grad.norm().clamp_min(1e-12)
        assert error < 5e-2, (name, float(error))


def test_exported_module_with_an_autocast_region_matches_eager():
    class Autocast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = causal_attention.CausalSelfAttention(32, 4, num_kv_heads=2)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.attn(x)

    torch.manual_seed(0)
    model, x = Autocast(), torch.randn(2, 10, 32)
    exported = torch.export.export(model, (x,))
    out = exported.module()(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, model(x))


def test_training_script_in_bfloat16_trains_on_our_op_as_on_sdpa(tmp_path, restore_num_threads):
    from training_testing import TINY_RUN, train

    torch.set_num_threads(1)
    losses = {
        attention: train.main([*TINY_RUN, "--out", str(tmp_path / attention), "--steps", "8",
                               "--dtype", "bfloat16", "--attention", attention])
        for attention in ("causal_attention", "sdpa")
    }
    # bfloat16 rounding separates the runs a little (about 1e-4 here); 8 steps still learn.
    for ours, sdpa in zip(losses["causal_attention"], losses["sdpa"]):
        assert abs(ours - sdpa) <= 2e-2 * abs(sdpa), losses
    assert losses["causal_attention"][-1] < losses["causal_attention"][0] - 0.1, losses
