"""causal_attention.models.GPT: the SDPA variant is the same function of the same parameters
(full sequences, gradients, and decoding with KV caches), and generate() with the caches picks
the tokens a full recomputation would."""

import pytest
import torch

from causal_attention.models import SDPASelfAttention
from fixtures.tiny_gpt import TinyGPT

VOCAB = 64


def gpt(attention="causal_attention"):
    torch.manual_seed(0)
    return TinyGPT(VOCAB, max_len=24, value_head_dim=None, attention=attention)


def test_sdpa_variant_has_the_same_parameters_and_computes_the_same_function():
    ours, sdpa = gpt(), gpt("sdpa")
    assert isinstance(sdpa.blocks[0].attn, SDPASelfAttention)
    sdpa.load_state_dict(ours.state_dict(), strict=True)
    tokens = torch.randint(0, VOCAB, (3, 17))
    out, ref = ours(tokens), sdpa(tokens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), q in zip(ours.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "option",
    [
        dict(window=(3, 0)),
        dict(softcap=1.0),
        dict(sinks=True),
        dict(alibi=True),
        dict(attn_dropout=0.1),
    ],
    ids=lambda option: next(iter(option)),
)
def test_sdpa_variant_refuses_the_score_options_rather_than_ignoring_them(option):
    expected = f"score options are not implemented.*{next(iter(option))}="
    with pytest.raises(NotImplementedError, match=expected):
        SDPASelfAttention(32, 4, **option)
    SDPASelfAttention(32, 4)


@pytest.mark.parametrize("attention", ["causal_attention", "sdpa"])
def test_decoding_in_chunks_through_the_caches_matches_the_full_forward(attention):
    model = gpt(attention).eval()
    tokens = torch.randint(0, VOCAB, (2, 20))
    caches = model.make_caches(2, 20)
    with torch.no_grad():
        # Chunks of 1 and of several positions: the SDPA variant masks bottom-right for both.
        chunks = [model(tokens[:, a:b], caches) for a, b in ((0, 7), (7, 8), (8, 13), (13, 20))]
        torch.testing.assert_close(torch.cat(chunks, 1), model(tokens), atol=1e-5, rtol=1e-5)
    assert [c.length for c in caches] == [20, 20]


def test_greedy_generate_with_caches_equals_full_recomputation():
    model = gpt().eval()
    prompt = torch.randint(0, VOCAB, (2, 5))
    generated = model.generate(prompt, 10, temperature=0)
    expected = prompt
    with torch.no_grad():
        for _ in range(10):
            next_token = model(expected)[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], 1)
    assert torch.equal(generated, expected)


def test_sampling_is_seeded_and_respects_top_k():
    model = gpt().eval()
    prompt = torch.randint(0, VOCAB, (1, 3))

    def sample(seed, top_k=None):
        generator = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 12, temperature=1.0, top_k=top_k, generator=generator)

    assert torch.equal(sample(1, top_k=1), model.generate(prompt, 12, temperature=0))
    assert torch.equal(sample(3), sample(3))
    assert not torch.equal(sample(3), sample(4))


def test_generate_refuses_to_run_past_max_len():
    with pytest.raises(ValueError, match="max_len=24"):
        gpt().generate(torch.zeros(1, 20, dtype=torch.long), 5)


def test_forward_packed_equals_forward_on_each_document():
    """A packed batch of documents: each document's logits (and the parameters' gradients) are
    forward's on it alone, positions restarted."""
    model = gpt()
    lengths = (5, 17, 1, 11)
    tokens = torch.randint(0, VOCAB, (sum(lengths),))
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).int()
    packed = model.forward_packed(tokens, cu_seqlens)
    packed.square().sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = torch.cat([model(document[None])[0] for document in tokens.split(lengths)])
    alone.square().sum().backward()
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    for p, g in zip(model.parameters(), packed_grads):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)
