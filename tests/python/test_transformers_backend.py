"""causal_attention as a transformers attention backend: a small GPT-2 and a small Llama with
grouped-query attention, built from configs with random weights, give the same logits, gradients
and greedy generations with attn_implementation="causal_attention" as with "sdpa"; masks that
hide nothing beyond causality run; padding and attention dropout are refused by name."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import causal_attention.integrations.transformers as backend

VOCAB = 128
SHARED = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
NO_DROPOUT = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
CONFIGS = {
    "gpt2": GPT2Config(n_positions=64, n_embd=64, n_layer=2, n_head=4, **NO_DROPOUT, **SHARED),
    "llama-gqa": LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **SHARED,
    ),
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    backend.register()


def model_pair(name):
    """The same random weights with our backend and with SDPA (each its own config copy: the
    attention implementation is recorded in the config)."""
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[name]), attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(
        copy.deepcopy(CONFIGS[name]), attn_implementation="causal_attention"
    )
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == "causal_attention"
    assert ref.config._attn_implementation == "sdpa"
    return ours.eval(), ref.eval()


def tokens(batch=2, length=12):
    return torch.randint(3, VOCAB, (batch, length))  # avoids the bos/eos ids


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_gradients_match_sdpa(name, monkeypatch):
    ours, ref = model_pair(name)
    seen_kv_heads = []
    op = backend.attention

    def spy(q, k, v, *, scale=None):
        seen_kv_heads.append(k.size(1))
        return op(q, k, v, scale=scale)

    monkeypatch.setattr(backend, "attention", spy)
    ids = tokens()
    out, ref_out = ours(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    ref_out.loss.backward()
    ref_params = dict(ref.named_parameters())
    for param_name, p in ours.named_parameters():
        torch.testing.assert_close(
            p.grad, ref_params[param_name].grad, atol=1e-6, rtol=1e-4, msg=param_name
        )
    # Every layer went through our op, GQA's K/V heads unrepeated.
    config = CONFIGS[name]
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    assert seen_kv_heads == [kv_heads] * config.num_hidden_layers
    if name == "llama-gqa":
        assert kv_heads < config.num_attention_heads


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_with_kv_cache_matches_sdpa(name):
    ours, ref = model_pair(name)
    ids = tokens(length=6)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    got, expected = ours.generate(ids, **kwargs), ref.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step_logits, ref_logits in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(step_logits, ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_prefill_through_a_cache_matches_sdpa(name, monkeypatch):
    # The second chunk's queries follow cached keys: transformers passes a 4-D causal mask,
    # bottom-right aligned, which the backend checks and accepts.
    ours, ref = model_pair(name)
    checked = []
    check = backend.check_mask_is_causal
    monkeypatch.setattr(backend, "check_mask_is_causal", lambda *a: checked.append(check(*a)))
    ids = tokens()
    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        first = ours(ids[:, :5], cache=cache, use_cache=True).logits
        assert not checked  # no mask: causality alone suffices
        second = ours(ids[:, 5:], cache=cache, use_cache=True).logits
        assert len(checked) == ours.config.num_hidden_layers
        chunked = torch.cat([first, second], 1)
        torch.testing.assert_close(chunked, ref(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_mask_without_padding_runs_and_padding_is_refused(name):
    ours, ref = model_pair(name)
    ids = tokens()
    with torch.no_grad():
        unpadded = ours(ids, attention_mask=torch.ones_like(ids)).logits
        torch.testing.assert_close(unpadded, ref(ids).logits, atol=1e-5, rtol=1e-5)
        padded = torch.ones_like(ids)
        padded[0, :3] = 0  # left padding of the first sequence
        with pytest.raises(ValueError, match="attention_mask masks more than causality.*padding"):
            ours(ids, attention_mask=padded)


def test_attention_dropout_in_training_is_refused():
    config = copy.deepcopy(CONFIGS["gpt2"])
    config.attn_pdrop = 0.1
    model = AutoModelForCausalLM.from_config(config, attn_implementation="causal_attention")
    model.train()
    with pytest.raises(NotImplementedError, match="dropout=0.1"):
        model(tokens())
    model.eval()
    model(tokens())  # no dropout in eval


def test_mask_check_accepts_exactly_bottom_right_causal_masks():
    lq, lk = 3, 5
    causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).expand(2, 1, lq, lk)
    backend.check_mask_is_causal(causal, lq, lk)
    additive = torch.zeros(2, 1, lq, lk).masked_fill(~causal, torch.finfo(torch.float32).min)
    backend.check_mask_is_causal(additive, lq, lk)
    padded = causal.clone()
    padded[1, :, :, 0] = False
    top_left = torch.ones(lq, lk, dtype=torch.bool).tril().expand(2, 1, lq, lk)
    biased = additive + 0.5  # e.g. ALiBi: a bias the op cannot add
    for mask in (padded, top_left, biased):
        with pytest.raises(ValueError, match="attention_mask"):
            backend.check_mask_is_causal(mask, lq, lk)
    with pytest.raises(ValueError, match=r"attention_mask.shape=\[2, 1, 3, 5\]"):
        backend.check_mask_is_causal(causal, lq, lk + 1)


@pytest.mark.parametrize(
    "lq, lk, with_mask",
    [(6, 6, False), (1, 6, False), (3, 7, False), (3, 7, True), (6, 6, True)],
    ids=["prefill", "decode", "static-cache-prefill", "chunk-after-cache", "causal-mask"],
)
def test_attention_function_matches_transformers_sdpa_function(lq, lk, with_mask):
    # Called as transformers calls it: GQA heads, and the mask (or None) transformers passes.
    class Attention(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    q = torch.randn(2, 4, lq, 8)
    k, v = torch.randn(2, 2, 2, lk, 8).unbind(0)
    mask = None
    if with_mask:
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).expand(2, 1, lq, lk)
    out, weights = backend.attention_forward(Attention(), q, k, v, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(Attention(), q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (2, lq, 4, 8)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_non_causal_attention_is_refused():
    class Encoder(torch.nn.Module):
        is_causal = False

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="is_causal=False"):
        backend.attention_forward(Encoder(), q, q, q, None)
