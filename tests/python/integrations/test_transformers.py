"""causal_attention as a transformers attention backend: a small GPT-2 and a small Llama with
grouped-query attention, built from configs with random weights, give the same logits, gradients
and greedy generations with attn_implementation="causal_attention" as with "sdpa" — unpadded,
left- and right-padded batches, generation on a left-padded batch with a dynamic or static
cache — and packed sequences give what each sequence gives alone; so do Mistral and Qwen2 with
sliding windows shorter than the sequences, and Gemma 2 (softcapping, local and global layers)
and gpt-oss (learned sinks, sliding layers) against "eager", which is all transformers runs them
with; GPT-2 trained with attention dropout gives what the op's attention_weights give under the
same generator state; every other mask transformers builds or a user passes (custom 4-D,
prefix-LM, chunked, dilated, a bias in a float mask, a position bias) goes to the op's attn_mask
with SDPA's results and gradients, learned biases' included; non-causal layers (BERT's
bidirectional padding, cross-attention) run too."""

import copy
import math

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    DataCollatorWithFlattening,
    DynamicCache,
    Gemma2Config,
    GPT2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    chunked_causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

import causal_attention
import causal_attention.integrations.transformers as backend
# The module whose calls of the op and of read_mask the spies below replace.
import causal_attention.integrations.transformers.backend as backend_module
from causal_attention._masks import visible_keys

VOCAB = 128
SHARED = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
NO_DROPOUT = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, **SHARED,
)
CONFIGS = {
    "gpt2": GPT2Config(n_positions=64, n_embd=64, n_layer=2, n_head=4, **NO_DROPOUT, **SHARED),
    "llama-gqa": LlamaConfig(**LLAMA),
}
# Keys a sliding layer's query sees (itself included); the test sequences are longer.
WINDOW = 4
SLIDING = {
    "mistral": MistralConfig(**LLAMA, sliding_window=WINDOW),
    # Layer 0 full attention, layer 1 sliding.
    "qwen2": Qwen2Config(**LLAMA, use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1),
}
# Models that SDPA cannot run (transformers runs them with "eager"): layer 0 sliding, 1 global.
# Gemma 2's cap is small enough to bite on scores of randomly initialized weights; gpt-oss's
# sinks are initialized like its weights, about exp(0) = 1 next to sums of about 12 keys.
EAGER_ONLY = {
    "gemma2": Gemma2Config(**LLAMA, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=WINDOW, attn_logit_softcapping=0.05),
    "gpt-oss": GptOssConfig(**{**LLAMA, "intermediate_size": 32}, head_dim=16,
                            sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
# Lengths of the sequences packed into one row; the 1 is a sequence with no next-token target.
PACKED_LENGTHS = (5, 3, 7, 1)


@pytest.fixture(scope="module", autouse=True)
def registered():
    backend.register()


def model_pair(name, config=None, reference="sdpa"):
    """The same random weights with our backend and with ``reference`` (each its own config
    copy: the attention implementation is recorded in the config)."""
    config = config if config is not None else CONFIGS[name]
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    ours = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="causal_attention"
    )
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == "causal_attention"
    assert ref.config._attn_implementation == reference
    return ours.eval(), ref.eval()


def layer_windows(config):
    """The op window each layer of ``config`` should get: (W - 1, 0) for sliding layers."""
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * \
        config.num_hidden_layers
    return [(WINDOW - 1, 0) if t == "sliding_attention" else (-1, 0) for t in types]


def tokens(batch=2, length=12):
    return torch.randint(3, VOCAB, (batch, length))  # avoids the bos/eos ids


def kv_heads(name):
    config = CONFIGS[name]
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def assert_same_gradients(ours, ref):
    ref_params = dict(ref.named_parameters())
    for param_name, p in ours.named_parameters():
        torch.testing.assert_close(
            p.grad, ref_params[param_name].grad, atol=1e-6, rtol=1e-4, msg=param_name
        )


def spy_on(monkeypatch, name, record):
    """Replaces the backend's op ``name`` with one that calls it and appends
    ``record(*args, **kwargs)`` to the list returned."""
    calls = []
    op = getattr(backend_module, name)

    def spy(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return op(*args, **kwargs)

    monkeypatch.setattr(backend_module, name, spy)
    return calls


@pytest.fixture
def op_calls(monkeypatch):
    """Records the key_mask and K/V head count of every call of the op by the backend."""

    def record(q, k, v, *, scale=None, key_mask=None, window=(-1, 0), **options):
        return dict(kv_heads=k.size(1), key_mask=key_mask, keys=k.size(2), window=window,
                    options=options)

    return spy_on(monkeypatch, "attention", record)


@pytest.fixture
def varlen_calls(monkeypatch):
    """Records the cumulative lengths and K/V head count of every packed call by the backend."""

    def record(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window=(-1, 0), **options):
        return dict(kv_heads=k.size(1), cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), window=window)

    return spy_on(monkeypatch, "varlen_attention", record)


@pytest.fixture
def read_masks(monkeypatch):
    """Records the layout the backend reads from every mask it is given."""
    layouts = []
    read = backend_module.read_mask
    monkeypatch.setattr(
        backend_module, "read_mask", lambda *a: layouts.append(read(*a)) or layouts[-1]
    )
    return layouts


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_gradients_match_sdpa(name, op_calls):
    ours, ref = model_pair(name)
    ids = tokens()
    out, ref_out = ours(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    ref_out.loss.backward()
    assert_same_gradients(ours, ref)
    # Every layer went through our op, GQA's K/V heads unrepeated, with no key mask.
    layers = CONFIGS[name].num_hidden_layers
    assert [c["kv_heads"] for c in op_calls] == [kv_heads(name)] * layers
    assert all(c["key_mask"] is None for c in op_calls)
    if name == "llama-gqa":
        assert kv_heads(name) < CONFIGS[name].num_attention_heads


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
def test_chunked_prefill_through_a_cache_matches_sdpa(name, read_masks):
    # The second chunk's queries follow cached keys: transformers passes a 4-D causal mask,
    # bottom-right aligned, which the backend reads as causality alone.
    ours, ref = model_pair(name)
    ids = tokens()
    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        first = ours(ids[:, :5], cache=cache, use_cache=True).logits
        assert not read_masks  # no mask: causality alone suffices
        second = ours(ids[:, 5:], cache=cache, use_cache=True).logits
        assert len(read_masks) == ours.config.num_hidden_layers
        assert all(
            layout == backend.MaskLayout(ids.size(1)) for layout in read_masks
        ), read_masks
        chunked = torch.cat([first, second], 1)
        torch.testing.assert_close(chunked, ref(ids).logits, atol=1e-5, rtol=1e-5)


def padding_mask(ids, side):
    """transformers' attention_mask for ``ids`` with its first rows padded on ``side`` (3 and
    1 pad tokens) and its last row unpadded."""
    mask = torch.ones_like(ids)
    for row, pads in ((0, 3), (1, 1)):
        if side == "left":
            mask[row, :pads] = 0
        else:
            mask[row, -pads:] = 0
    return mask


def real_targets(ids, mask):
    """Labels whose loss (transformers shifts them by one) counts only predictions made at a
    real position of a real next token."""
    real = mask.bool()
    keep = real.clone()
    keep[:, 1:] &= real[:, :-1]
    keep[:, 0] = False
    return ids.masked_fill(~keep, -100)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", CONFIGS)
def test_padded_batch_matches_sdpa_at_real_positions(name, side, op_calls):
    ours, ref = model_pair(name)
    ids = tokens(batch=3)
    mask = padding_mask(ids, side)
    labels = real_targets(ids, mask)
    out = ours(ids, attention_mask=mask, labels=labels)
    ref_out = ref(ids, attention_mask=mask, labels=labels)
    # A query at a pad position sees no key, so ours gives zeros there and SDPA whatever its
    # fully masked rows give: only real positions are compared, and the loss reads only them.
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref_out.logits[real], atol=1e-5, rtol=1e-5)
    out.loss.backward()
    ref_out.loss.backward()
    assert_same_gradients(ours, ref)
    # The key mask the op got is exactly the padding, in every layer.
    assert len(op_calls) == CONFIGS[name].num_hidden_layers
    for call in op_calls:
        assert torch.equal(call["key_mask"], real)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_on_a_left_padded_batch_matches_sdpa(name, cache, op_calls):
    ours, ref = model_pair(name)
    ids = tokens(batch=3, length=6)
    mask = padding_mask(ids, "left")
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    kwargs.update(return_dict_in_generate=True, output_logits=True, cache_implementation=cache)
    got, expected = ours.generate(ids, **kwargs), ref.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    # Every step's logits are at the last position, real in every row of a left-padded batch.
    for step_logits, ref_logits in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(step_logits, ref_logits, atol=1e-5, rtol=1e-5)
    # Each step hid the pad tokens from the op; a static cache's unused slots were cut off.
    layers = CONFIGS[name].num_hidden_layers
    assert len(op_calls) == layers * kwargs["max_new_tokens"]
    for step in range(kwargs["max_new_tokens"]):
        keys = ids.size(1) + step
        for call in op_calls[step * layers : (step + 1) * layers]:
            assert call["keys"] == keys
            padded = torch.cat([mask, torch.ones(3, step, dtype=mask.dtype)], 1).bool()
            assert torch.equal(call["key_mask"], padded)


def packed_batch(mode, lengths=PACKED_LENGTHS):
    """The sequences and the model kwargs that pack them in one row, the way ``mode`` says."""
    sequences = [tokens(batch=1, length=n)[0] for n in lengths]
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=mode == "flash-kwargs")
    batch = collate([{"input_ids": s.tolist()} for s in sequences])
    # With a cache (use_cache's default) transformers builds no mask from position_ids.
    batch["use_cache"] = False if mode == "mask" else None
    return sequences, batch


@pytest.mark.parametrize("mode", ["flash-kwargs", "position-ids", "mask"])
@pytest.mark.parametrize("name", CONFIGS)
def test_packed_sequences_match_each_sequence_alone(name, mode, varlen_calls, read_masks):
    ours, ref = model_pair(name)
    # Padding-free training; the configs have no dropout.
    ours.train()
    ref.train()
    sequences, batch = packed_batch(mode)
    out = ours(**batch)
    alone = [ref(s[None], labels=s[None]) for s in sequences]
    torch.testing.assert_close(
        out.logits[0], torch.cat([a.logits[0] for a in alone]), atol=1e-5, rtol=1e-5
    )
    # The packed loss is the mean over every sequence's targets (none for a 1-token one).
    targets = [len(s) - 1 for s in sequences]
    ref_loss = sum(a.loss * n for a, n in zip(alone, targets) if n) / sum(targets)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-5)
    out.loss.backward()
    ref_loss.backward()
    assert_same_gradients(ours, ref)
    # Every layer ran packed, on these sequences, K/V heads unrepeated; only "mask" had a mask.
    cu = torch.tensor([0, *PACKED_LENGTHS]).cumsum(0).tolist()
    layers = CONFIGS[name].num_hidden_layers
    expected = dict(kv_heads=kv_heads(name), cu_q=cu, cu_k=cu, window=(-1, 0))
    assert varlen_calls == [expected] * layers
    assert len(read_masks) == (layers if mode == "mask" else 0)


@pytest.mark.parametrize("use_cache", [False, None], ids=["mask", "position-ids"])
def test_packed_rows_of_a_batch_match_each_sequence_alone(use_cache, varlen_calls):
    # Two rows, each packing two sequences: the op sees them flattened, one after the other.
    ours, ref = model_pair("llama-gqa")
    rows = [(5, 3), (2, 6)]
    sequences = [[tokens(batch=1, length=n) for n in row] for row in rows]
    ids = torch.cat([torch.cat(row, 1) for row in sequences])
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    with torch.no_grad():
        logits = ours(ids, position_ids=position_ids, use_cache=use_cache).logits
        for b, row in enumerate(sequences):
            alone = torch.cat([ref(s).logits for s in row], 1)[0]
            torch.testing.assert_close(logits[b], alone, atol=1e-5, rtol=1e-5)
    assert varlen_calls[0]["cu_q"] == [0, 5, 8, 10, 16]


def with_changes(config, **changes):
    config = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def train_step(model, ids, mask=None):
    """Logits of a training forward (labels: the real next tokens) and its backward."""
    model.zero_grad(set_to_none=True)
    labels = ids if mask is None else real_targets(ids, mask)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach()


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("name", list(SLIDING) + list(EAGER_ONLY))
def test_sliding_softcap_and_sink_models_match_their_reference(name, padding, op_calls):
    config = SLIDING.get(name) or EAGER_ONLY[name]
    ours, ref = model_pair(name, config, "sdpa" if name in SLIDING else "eager")
    ids = tokens(batch=3, length=12)
    mask = None if padding is None else padding_mask(ids, padding)
    logits, ref_logits = train_step(ours, ids, mask), train_step(ref, ids, mask)
    real = slice(None) if mask is None else mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], atol=1e-5, rtol=1e-5)
    assert_same_gradients(ours, ref)
    # Each layer's window (and padding) went to the op, and the model's score options.
    assert [c["window"] for c in op_calls] == layer_windows(config)
    for call, module in zip(op_calls, (layer.self_attn for layer in ours.model.layers)):
        assert torch.equal(call["key_mask"], mask.bool()) if mask is not None \
            else call["key_mask"] is None
        assert call["options"]["softcap"] == getattr(config, "attn_logit_softcapping", None)
        assert call["options"]["sinks"] is getattr(module, "sinks", None)
        assert call["options"]["dropout_p"] == 0.0
    # The test can fail: without its window (and cap, and sinks) the model gives other logits.
    plain = with_changes(config, sliding_window=10**6, attn_logit_softcapping=None)
    unwindowed = AutoModelForCausalLM.from_config(plain, attn_implementation="eager")
    unwindowed.load_state_dict(ref.state_dict())
    with torch.no_grad():
        assert not torch.allclose(unwindowed(ids, attention_mask=mask).logits[real],
                                  ref_logits[real], atol=1e-3)


@pytest.mark.parametrize(
    "name,cache",
    [("mistral", "dynamic"), ("mistral", "static"), ("qwen2", "dynamic"), ("gemma2", "static"),
     ("gpt-oss", "dynamic")],
)
def test_sliding_window_generation_on_a_left_padded_batch_matches_reference(name, cache):
    # 6 prompt tokens and 8 new ones: the sliding layers' caches keep only the window.
    config = SLIDING.get(name) or EAGER_ONLY[name]
    ours, ref = model_pair(name, config, "sdpa" if name in SLIDING else "eager")
    ids = tokens(batch=3, length=6)
    kwargs = dict(attention_mask=padding_mask(ids, "left"), max_new_tokens=8, do_sample=False,
                  pad_token_id=0, cache_implementation=cache)
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    got, expected = ours.generate(ids, **kwargs), ref.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step_logits, ref_logits in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(step_logits, ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["flash-kwargs", "position-ids", "mask"])
def test_packed_sequences_with_a_sliding_window_match_each_sequence_alone(mode, varlen_calls):
    ours, ref = model_pair("mistral", SLIDING["mistral"])
    lengths = (7, 3, 9, 1)  # two longer than the window
    sequences, batch = packed_batch(mode, lengths)
    with torch.no_grad():
        # With a cache ("flash-kwargs", "position-ids") transformers builds the sliding mask of
        # the whole row, blind to the packing, which the kwargs or position_ids then give; without
        # one ("mask") it builds the packed sequences' mask.
        out = ours(**batch).logits[0]
        alone = torch.cat([ref(s[None]).logits[0] for s in sequences])
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    expected = dict(kv_heads=2, cu_q=cu, cu_k=cu, window=(WINDOW - 1, 0))
    assert varlen_calls == [expected] * SLIDING["mistral"].num_hidden_layers


@pytest.mark.parametrize("use_cache", [None, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gpt-oss"])
def test_packed_position_ids_in_models_mixing_sliding_and_full_layers_match_each_sequence_alone(
    name, use_cache, varlen_calls
):
    # position_ids restart, no mask. transformers builds its masks without the packing while a
    # cache is in use (gpt-oss: always), the full layers' none and the sliding layers' a band
    # over the whole row; every layer must run packed all the same, the sliding ones with their
    # window inside each sequence.
    config = SLIDING.get(name) or EAGER_ONLY[name]
    ours, ref = model_pair(name, config, "sdpa" if name in SLIDING else "eager")
    lengths = (7, 3, 9)  # two longer than the window
    sequences, batch = packed_batch("position-ids", lengths)
    batch["use_cache"] = use_cache
    out = ours(**batch)
    alone = [ref(s[None], labels=s[None]) for s in sequences]
    torch.testing.assert_close(
        out.logits[0], torch.cat([a.logits[0] for a in alone]), atol=1e-5, rtol=1e-5
    )
    targets = [len(s) - 1 for s in sequences]
    ref_loss = sum(a.loss * n for a, n in zip(alone, targets)) / sum(targets)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-5)
    out.loss.backward()
    ref_loss.backward()
    assert_same_gradients(ours, ref)
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    assert [(c["cu_q"], c["cu_k"], c["window"]) for c in varlen_calls] == [
        (cu, cu, window) for window in layer_windows(config)
    ]


def register_weights_reference():
    """``attn_implementation="weights_reference"``: attention_weights (dropped as the op drops
    them for the same generator state) times the values, causality alone (it asserts that it
    gets no mask, as in an unpadded batch)."""

    def weights_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          **kwargs):
        assert attention_mask is None
        weights = causal_attention.attention_weights(query, key, value, scale=scaling,
                                                     dropout_p=dropout)
        return (weights @ value).transpose(1, 2), weights

    AttentionInterface.register("weights_reference", weights_reference)
    AttentionMaskInterface.register("weights_reference", sdpa_mask)


def test_attention_dropout_in_training_is_attention_weights_dropout_for_the_same_seed():
    register_weights_reference()
    config = with_changes(CONFIGS["gpt2"], attn_pdrop=0.3)
    ours, ref = model_pair("gpt2", config, "weights_reference")
    ours.train()
    ref.train()
    ids = tokens()
    torch.manual_seed(5)
    logits = train_step(ours, ids)
    torch.manual_seed(5)
    ref_logits = train_step(ref, ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert_same_gradients(ours, ref)
    with torch.no_grad():
        # The same seed gives the same logits bit for bit, another seed others...
        torch.manual_seed(5)
        assert torch.equal(ours(ids).logits, logits)
        assert not torch.allclose(ours(ids).logits, logits, atol=1e-3)
        # ... and in evaluation there is no dropout: the logits of SDPA.
        sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
        sdpa.load_state_dict(ref.state_dict())
        torch.testing.assert_close(ours.eval()(ids).logits, sdpa.eval()(ids).logits, atol=1e-5,
                                   rtol=1e-5)


def test_read_mask_takes_apart_exactly_causal_padded_and_packed_masks():
    lq, lk = 3, 5
    causal = visible_keys(lq, lk).expand(2, 1, lq, lk)
    assert backend.read_mask(causal, lq, lk) == backend.MaskLayout(lk)
    additive = torch.zeros(2, 1, lq, lk).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert backend.read_mask(backend.as_boolean_mask(additive, 2, lq, lk), lq, lk).key_mask is None
    key_ok = torch.tensor([[False, True, True, True, True], [True, True, False, True, True]])
    layout = backend.read_mask(causal & key_ok[:, None, None, :], lq, lk)
    assert layout.key_length == lk and torch.equal(layout.key_mask, key_ok)
    # A static cache's unused slots: keys no query sees are cut off, causality realigned.
    slots = torch.cat([visible_keys(lq, 4), torch.zeros(lq, 3, dtype=torch.bool)], 1)
    assert backend.read_mask(slots.expand(2, 1, lq, 7), lq, 7) == backend.MaskLayout(4)
    # Packed sequences of lengths 2 and 3 in one row.
    starts = torch.tensor([[True, False, True, False, False]])
    layout = backend.read_mask(backend.block_causal(starts), 5, 5)
    assert layout.sequences.cu_seqlens_q.tolist() == [0, 2, 5]
    assert layout.sequences.max_seqlen_q == 3


def test_read_mask_takes_apart_sliding_windows_with_padding_slots_and_packing():
    # A window of 4 keys over 3 cached and 4 new ones in 9 slots; padding hides key 0 of row 0.
    mask = transformers_mask(4, 9, cached=3, filled=7, pads=[1, 0], window=4)
    layout = backend.read_mask(mask, 4, 9)
    assert layout.window == (3, 0) and layout.key_length == 7  # the static cache's slots cut
    assert torch.equal(layout.key_mask, torch.tensor([[False] + [True] * 6, [True] * 7]))
    # Padding that covers every key the window hides: that is causality with the padding.
    mask = transformers_mask(2, 6, cached=4, filled=6, pads=[4, 4], window=3)
    layout = backend.read_mask(mask, 2, 6)
    assert layout.window == (-1, 0) and layout.key_mask[0].tolist() == [False] * 4 + [True] * 2
    # Packed sequences of lengths 4 and 3 seen through a window of 2 keys.
    starts = torch.tensor([[True, False, False, False, True, False, False]])
    layout = backend.read_mask(backend.block_causal(starts, 1), 7, 7)
    assert layout.window == (1, 0) and layout.sequences.cu_seqlens_q.tolist() == [0, 4, 7]


def prefix_lm(length, prefix):
    """Causal, but the first ``prefix`` tokens see each other (a prefix-LM's mask)."""
    rows = torch.arange(length)
    return visible_keys(length, length) | ((rows[:, None] < prefix) & (rows[None, :] < prefix))


OTHER_MASKS = {
    # Chunks of 2 for 2 queries after 3 cached keys: query 3 sees keys 2-3, query 4 key 4.
    # (Without a cache, chunks are packed sequences, and served as such.)
    "chunked-after-cache": sdpa_mask(
        batch_size=1, q_length=2, kv_length=5, q_offset=3, allow_is_causal_skip=False,
        mask_function=chunked_causal_mask_function(2, torch.zeros(1, dtype=torch.long)),
    )[0, 0],
    "dilated": visible_keys(5, 5) & ((torch.arange(5)[:, None] - torch.arange(5)) % 2 == 0),
    "bidirectional": torch.ones(5, 5, dtype=torch.bool),
    "prefix-lm": prefix_lm(7, 3),
    "float-bias": torch.zeros(6, 6).masked_fill(~visible_keys(6, 6), torch.finfo(torch.float32).min)
    + torch.randn(6, 6),
}


@pytest.mark.parametrize("mask", OTHER_MASKS.values(), ids=OTHER_MASKS.keys())
def test_other_masks_go_to_the_op_as_attn_mask_as_sdpa_computes_them(mask, op_calls):
    """Masks that are no per-key mask, window or packing (read_mask gives None for them) are
    the op's attn_mask over every key, forward and gradients as transformers' SDPA function."""
    lq, lk = mask.shape
    mask = mask.expand(2, 1, lq, lk)
    if not mask.is_floating_point():
        assert backend.read_mask(mask, lq, lk) is None
    inputs = [torch.randn(2, 4, lq, 8), *torch.randn(2, 2, 2, lk, 8).unbind(0)]
    grad_out = torch.randn(2, lq, 4, 8)
    results = []
    for function in (backend.attention_forward, sdpa_attention_forward):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out, _ = function(Attention(), *leaves, mask, scaling=0.3)
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    assert op_calls[-1]["window"] == (-1, -1) and "attn_mask" in op_calls[-1]["options"]


def test_a_learned_bias_and_position_bias_get_their_gradients_as_in_sdpa():
    lq, lk = 6, 9
    causal = visible_keys(lq, lk).expand(2, 1, lq, lk)
    inputs = [torch.randn(2, 4, lq, 8), *torch.randn(2, 2, 2, lk, 8).unbind(0)]
    bias = torch.randn(1, 4, lq, lk)
    grad_out = torch.randn(2, lq, 4, 8)
    for kwargs_of in (
        lambda b: dict(attention_mask=b.masked_fill(~causal, torch.finfo(torch.float32).min)),
        lambda b: dict(attention_mask=causal, position_bias=b),
    ):
        results = []
        for function in (backend.attention_forward, sdpa_attention_forward):
            leaves = [t.clone().requires_grad_() for t in inputs + [bias]]
            kwargs = kwargs_of(leaves[3])
            if function is sdpa_attention_forward and "position_bias" in kwargs:
                mask = kwargs.pop("position_bias").masked_fill(~causal, -math.inf)
                kwargs["attention_mask"] = mask
            out, _ = function(Attention(), *leaves[:3], scaling=0.3, **kwargs)
            results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
        for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), *results):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_biases_and_bad_shapes():
    causal = visible_keys(3, 5).expand(2, 1, 3, 5)
    biased = torch.zeros(2, 1, 3, 5).masked_fill(~causal, torch.finfo(torch.float32).min) + 0.5
    assert backend.as_boolean_mask(biased, 2, 3, 5) is None
    with pytest.raises(ValueError, match=r"attention_mask.shape=\[2, 1, 3, 5\]"):
        backend.as_boolean_mask(causal, 2, 3, 6)


class Attention(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def transformers_mask(lq, lk, cached, filled, pads, window=None):
    """The mask transformers builds (sdpa_mask) for ``lq`` queries after ``cached`` keys, in a
    cache of ``lk`` slots of which ``filled`` are written, row ``b`` left-padded by
    ``pads[b]``; with a sliding ``window`` (keys a query sees, itself included) where given."""
    attention_mask = torch.zeros(len(pads), lk, dtype=torch.bool)
    for row, pad in enumerate(pads):
        attention_mask[row, pad:filled] = True
    kwargs = {}
    if window is not None:
        kwargs = dict(mask_function=sliding_window_causal_mask_function(window), local_size=window)
    return sdpa_mask(
        batch_size=len(pads), q_length=lq, kv_length=lk, q_offset=cached,
        attention_mask=attention_mask, allow_is_causal_skip=False, **kwargs,
    )


@pytest.mark.parametrize(
    "lq, lk, mask",
    [
        (6, 6, None),
        (1, 6, None),
        (3, 7, None),
        (3, 7, transformers_mask(3, 7, cached=4, filled=7, pads=[0, 0])),
        (6, 6, transformers_mask(6, 6, cached=0, filled=6, pads=[0, 0])),
        (6, 6, transformers_mask(6, 6, cached=0, filled=6, pads=[2, 0])),
        (1, 6, transformers_mask(1, 6, cached=5, filled=6, pads=[3, 1])),
        (3, 9, transformers_mask(3, 9, cached=2, filled=5, pads=[1, 0])),
        (8, 8, transformers_mask(8, 8, cached=0, filled=8, pads=[2, 0], window=3)),
        (4, 7, transformers_mask(4, 7, cached=3, filled=7, pads=[0, 1], window=3)),
        (1, 4, transformers_mask(1, 4, cached=3, filled=4, pads=[1, 0], window=4)),
        (3, 9, transformers_mask(3, 9, cached=2, filled=5, pads=[0, 2], window=2)),
    ],
    ids=[
        "prefill", "decode", "static-cache-prefill", "chunk-after-cache", "causal-mask",
        "left-padded", "decode-padded", "static-cache-slots-padded", "sliding-left-padded",
        "sliding-chunk-after-cache", "sliding-decode", "sliding-static-cache-slots",
    ],
)
def test_attention_function_matches_transformers_sdpa_function(lq, lk, mask):
    # Called as transformers calls it: GQA heads, and the mask (or None) transformers passes.
    q = torch.randn(2, 4, lq, 8)
    k, v = torch.randn(2, 2, 2, lk, 8).unbind(0)
    out, weights = backend.attention_forward(Attention(), q, k, v, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(Attention(), q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (2, lq, 4, 8)
    # Queries that see no key (a pad query) give zeros in ours, whatever they give in SDPA.
    sees = torch.ones(2, lq, dtype=torch.bool) if mask is None else mask[:, 0].any(-1)
    torch.testing.assert_close(out[sees], expected[sees], atol=1e-6, rtol=1e-5)
    assert not out[~sees].any()


def packed_kwargs(cu):
    cu = torch.tensor(cu, dtype=torch.int32)
    longest = int(cu.diff().max())
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_attention_function_on_flash_kwargs_matches_each_sequence_alone(sliding_window):
    q = torch.randn(1, 4, 9, 8)
    k, v = torch.randn(2, 1, 2, 9, 8).unbind(0)
    out, _ = backend.attention_forward(Attention(), q, k, v, None, sliding_window=sliding_window,
                                       **packed_kwargs([0, 4, 9]))
    for start, end in ((0, 4), (4, 9)):
        piece = [t[:, :, start:end] for t in (q, k, v)]
        mask = None
        if sliding_window is not None:
            mask = transformers_mask(end - start, end - start, cached=0, filled=end - start,
                                     pads=[0], window=sliding_window)
        expected, _ = sdpa_attention_forward(Attention(), *piece, mask, scaling=None)
        torch.testing.assert_close(out[:, start:end], expected, atol=1e-6, rtol=1e-5)


def test_attention_function_packs_a_whole_row_mask_by_restarting_position_ids():
    # A sliding layer while a cache is in use: transformers, blind to the packing, passes the
    # band of the whole row, and the position_ids restart where each sequence starts.
    q = torch.randn(1, 4, 9, 8)
    k, v = torch.randn(2, 1, 2, 9, 8).unbind(0)
    band = transformers_mask(9, 9, cached=0, filled=9, pads=[0], window=3)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    out, _ = backend.attention_forward(Attention(), q, k, v, band, sliding_window=3,
                                       position_ids=position_ids)
    for start, end in ((0, 4), (4, 9)):
        piece = [t[:, :, start:end] for t in (q, k, v)]
        mask = transformers_mask(end - start, end - start, cached=0, filled=end - start,
                                 pads=[0], window=3)
        expected, _ = sdpa_attention_forward(Attention(), *piece, mask, scaling=None)
        torch.testing.assert_close(out[:, start:end], expected, atol=1e-6, rtol=1e-5)
    # Padding is no packing: a left-padded row's position_ids restart after its pads (generate
    # builds them so), and its mask is read as padding, the row one sequence.
    padded = transformers_mask(9, 9, cached=0, filled=9, pads=[2], window=3)
    position_ids = torch.tensor([[1, 1, 0, 1, 2, 3, 4, 5, 6]])
    out, _ = backend.attention_forward(Attention(), q, k, v, padded, sliding_window=3,
                                       position_ids=position_ids)
    expected, _ = sdpa_attention_forward(Attention(), q, k, v, padded, scaling=None)
    torch.testing.assert_close(out[:, 2:], expected[:, 2:], atol=1e-6, rtol=1e-5)


def test_inconsistent_or_bad_packing_kwargs_are_refused():
    q = torch.randn(1, 2, 5, 8)
    two_sequences = backend.block_causal(torch.tensor([[True, False, True, False, False]]))
    with pytest.raises(ValueError, match="describe different sequences"):
        backend.attention_forward(Attention(), q, q, q, two_sequences, **packed_kwargs([0, 3, 5]))
    # Agreeing mask and kwargs run.
    backend.attention_forward(Attention(), q, q, q, two_sequences, **packed_kwargs([0, 2, 5]))
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must be .* got cu_seq_lens_q=\[0, 4\]"):
        backend.attention_forward(Attention(), q, q, q, None, **packed_kwargs([0, 4]))
    with pytest.raises(ValueError, match="got cu_seq_lens_k=None"):
        backend.attention_forward(Attention(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 5]))


class Encoder(torch.nn.Module):
    is_causal = False
    num_key_value_groups = 1


@pytest.mark.parametrize(
    "lq, lk, mask, passed_as",
    [
        (5, 5, None, None),
        (5, 5, torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]
         .expand(2, 1, 5, 5), "key_mask"),
        (3, 7, torch.tensor([[True] * 7, [False] + [True] * 6])[:, None, None, :]
         .expand(2, 1, 3, 7), "key_mask"),
        (5, 5, prefix_lm(5, 2).expand(2, 1, 5, 5), "attn_mask"),
    ],
    ids=["full", "padding", "cross-attention-padding", "custom"],
)
def test_non_causal_layers_match_transformers_sdpa_function(lq, lk, mask, passed_as, op_calls):
    q = torch.randn(2, 2, lq, 8)
    k, v = torch.randn(2, 2, 2, lk, 8).unbind(0)
    out, _ = backend.attention_forward(Encoder(), q, k, v, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(Encoder(), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    call = op_calls[-1]
    assert call["window"] == (-1, -1)
    # Padding is the op's key_mask, any other mask its attn_mask.
    assert (call["key_mask"] is not None) == (passed_as == "key_mask")
    assert ("attn_mask" in call["options"]) == (passed_as == "attn_mask")


def test_a_custom_4d_mask_runs_a_model_as_sdpa_does(op_calls):
    """A prefix-LM's mask passed to the model itself (transformers hands a 4-D mask to every
    layer as it is): logits and every gradient as with "sdpa"."""
    ours, ref = model_pair("llama-gqa")
    ids = tokens(length=10)
    mask = prefix_lm(10, 4).expand(2, 1, 10, 10)
    out = ours(ids, attention_mask=mask, labels=ids)
    ref_out = ref(ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    ref_out.loss.backward()
    assert_same_gradients(ours, ref)
    assert op_calls and all(c["window"] == (-1, -1) for c in op_calls)


def test_a_bidirectional_encoder_with_padding_matches_sdpa():
    """BERT (non-causal layers, transformers' bidirectional padding mask): logits and every
    gradient at the real tokens as with "sdpa"."""
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    ref = AutoModelForMaskedLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = AutoModelForMaskedLM.from_config(copy.deepcopy(config),
                                            attn_implementation="causal_attention")
    ours.load_state_dict(ref.state_dict())
    ids = tokens(length=9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for model in (ours.eval(), ref.eval()):
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append(out.logits[mask.bool()])
    torch.testing.assert_close(*results, atol=1e-5, rtol=1e-5)
    assert_same_gradients(ours, ref)
