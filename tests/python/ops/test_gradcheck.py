"""torch.autograd.gradcheck of the ops' C++ backward in float64: attention without and with a
key mask, and varlen_attention; with the score options (the sinks' gradient included) and with
dropout."""

import pytest
import torch

import causal_attention
from attention_testing.inputs import Case, ScoreOptions, make_key_mask
from attention_testing.packed import Packed

CASES = [
    pytest.param(Case(5, 5, 3, hq=2, hkv=2), None, id="L5-D3-H2"),
    pytest.param(Case(6, 6, 3, dv=2, hq=4, hkv=2), None, id="gqa2-Dv2"),
    pytest.param(Case(3, 7, 2, hq=2, hkv=1), None, id="Lq3-Lk7-gqa2"),
    pytest.param(Case(7, 3, 2), None, id="Lq7-Lk3-empty-rows"),
    pytest.param(Case(4, 4, 3, hq=2, hkv=2), 0.7, id="scale0.7"),
    pytest.param(Case(5, 5, 3, heads=False), None, id="2d"),
    pytest.param(Case(70, 70, 2, batch=()), None, id="3d-L70-two-blocks"),
    pytest.param(Case(4, 6, 3, hq=2, hkv=2, layout="transposed"), None, id="transposed"),
]


@pytest.mark.parametrize("fast_mode", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("case,scale", CASES)
def test_gradcheck(case, scale, fast_mode):
    inputs = case.inputs(torch.float64, requires_grad=True)

    def fn(q, k, v):
        return causal_attention.attention(q, k, v, scale=scale)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode)


# (case, mask kind): holes, left padding (first rows without a visible key), a batch element that
# hides every key, Lq > Lk, and a hidden block of 64 keys among three.
KEY_MASK_CASES = [
    pytest.param(Case(6, 6, 3, hq=4, hkv=2, batch=(2,)), "holes", id="gqa2-holes"),
    pytest.param(Case(5, 5, 3, dv=2, batch=(3,)), "left-pad", id="Dv2-left-pad"),
    pytest.param(Case(3, 7, 2, hq=2, hkv=1, batch=(2,)), "one-all-false", id="Lq3-Lk7-none"),
    pytest.param(Case(7, 4, 2, batch=(2,), layout="transposed"), "right-pad", id="Lq7-Lk4-right"),
    pytest.param(Case(20, 150, 2, heads=False), "holes", id="2d-Lk150-hidden-block"),
]


@pytest.mark.parametrize("fast_mode", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("case,kind", KEY_MASK_CASES)
def test_gradcheck_with_key_mask(case, kind, fast_mode):
    inputs = case.inputs(torch.float64, requires_grad=True)
    key_mask = make_key_mask(case.key_mask_shape, kind)

    def fn(q, k, v):
        return causal_attention.attention(q, k, v, key_mask=key_mask)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode)


# An empty sequence, single tokens, a chunk against its cache, rows without keys, GQA, Dv != D.
VARLEN_CASES = [
    pytest.param(Packed((3, 0, 4, 1), (3, 2, 6, 1), 3, hq=2, hkv=2), None, id="mixed"),
    pytest.param(Packed((5, 2), (2, 0), 2, dv=3, hq=4, hkv=2), 0.7, id="no-keys-gqa2-Dv3"),
    pytest.param(Packed((70,), (70,), 2), None, id="L70-two-blocks"),
]


@pytest.mark.parametrize("fast_mode", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("packed,scale", VARLEN_CASES)
def test_gradcheck_varlen(packed, scale, fast_mode):
    inputs = packed.inputs(torch.float64, requires_grad=True)
    lengths = packed.lengths_args()

    def fn(q, k, v):
        return causal_attention.varlen_attention(q, k, v, *lengths, scale=scale)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode)


# --- score options (window, softcap, ALiBi, sinks, dropout) ------------------------------------

# (case, options): each option, and all together with GQA, a key mask and rows without keys;
# the sinks (float64 here) are an input of the check, ALiBi's slopes are not (no gradient).
OPTION_CASES = [
    pytest.param(Case(6, 6, 3, hq=2, hkv=2), ScoreOptions(window=(2, 1)), id="window"),
    pytest.param(Case(5, 7, 3, hq=2, hkv=1), ScoreOptions(softcap=0.8), id="softcap-gqa2"),
    pytest.param(Case(6, 4, 2, batch=(2,)), ScoreOptions(alibi="batch"), id="alibi-Lq6-Lk4"),
    pytest.param(Case(7, 3, 2, hq=2, hkv=2), ScoreOptions(sinks="q"), id="sinks-empty-rows"),
    pytest.param(
        Case(6, 8, 3, dv=2, hq=4, hkv=2, batch=(), layout="transposed"),
        ScoreOptions(window=(3, 0), softcap=1.5, alibi="heads", sinks="q", key_mask="holes"),
        id="all-gqa2-Dv2",
    ),
    # Windows across the edge of two key blocks of 64.
    pytest.param(
        Case(70, 70, 1, heads=False), ScoreOptions(window=(20, 5), sinks="q"), id="L70-blocks"
    ),
]


def _option_function(kwargs, function=causal_attention.attention):
    """(function of (q, k, v[, sinks]), whether it takes the sinks)."""
    options = {name: value for name, value in kwargs.items() if name != "sinks"}
    if "sinks" not in kwargs:
        return lambda q, k, v: function(q, k, v, **options), False
    return lambda q, k, v, sinks: function(q, k, v, sinks=sinks, **options), True


@pytest.mark.parametrize("fast_mode", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("case,options", OPTION_CASES)
def test_gradcheck_with_score_options(case, options, fast_mode):
    inputs = case.inputs(torch.float64, requires_grad=True)
    kwargs = options.for_case(case, torch.float64)
    fn, takes_sinks = _option_function(kwargs)
    if takes_sinks:
        inputs = inputs + (kwargs["sinks"],)
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode)


# Dropout: the same mask at every evaluation, from a fixed dropout_seed (attention_forward) or a
# generator seeded afresh at each call (attention).
DROPOUT_CASES = [
    pytest.param(Case(6, 6, 3, hq=4, hkv=2), ScoreOptions(), id="gqa2"),
    pytest.param(
        Case(7, 5, 3, dv=2, hq=2, hkv=2, batch=(2,)),
        ScoreOptions(window=(2, 2), softcap=1.0, alibi="heads", sinks="q"),
        id="all-options",
    ),
]


@pytest.mark.parametrize("entry", ["attention_forward", "attention"])
@pytest.mark.parametrize("case,options", DROPOUT_CASES)
def test_gradcheck_with_dropout(case, options, entry):
    inputs = case.inputs(torch.float64, requires_grad=True)
    kwargs = options.for_case(case, torch.float64)
    if entry == "attention_forward":
        seed = torch.tensor([77, 3], dtype=torch.int64)

        def function(q, k, v, **kw):
            out, _ = causal_attention.attention_forward(
                q, k, v, 0.6, dropout_p=0.4, dropout_seed=seed, **kw
            )
            return out

    else:

        def function(q, k, v, **kw):
            generator = torch.Generator().manual_seed(77)
            return causal_attention.attention(q, k, v, dropout_p=0.4, generator=generator, **kw)

    fn, takes_sinks = _option_function(kwargs, function)
    if takes_sinks:
        inputs = inputs + (kwargs["sinks"],)
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


VARLEN_OPTION_CASES = [
    pytest.param(
        Packed((3, 0, 4, 1), (3, 2, 6, 1), 3, hq=2, hkv=2),
        ScoreOptions(window=(1, 2), alibi="heads", sinks="q"),
        id="mixed-window-alibi-sinks",
    ),
    pytest.param(
        Packed((5, 2), (2, 0), 2, dv=3, hq=4, hkv=2),
        ScoreOptions(softcap=1.0, sinks="q"),
        id="no-keys-softcap-sinks",
    ),
]


@pytest.mark.parametrize("packed,options", VARLEN_OPTION_CASES)
def test_gradcheck_varlen_with_score_options(packed, options):
    inputs = packed.inputs(torch.float64, requires_grad=True)
    lengths = packed.lengths_args()
    kwargs = options.kwargs(torch.float64, packed.hq)

    def varlen(q, k, v, **kw):
        return causal_attention.varlen_attention(q, k, v, *lengths, **kw)

    fn, _ = _option_function(kwargs, varlen)
    assert torch.autograd.gradcheck(fn, inputs + (kwargs["sinks"],), fast_mode=False)
