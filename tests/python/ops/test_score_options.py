"""The score options (window, softcap, ALiBi, sinks) on attention,
attention_forward / attention_backward and attention_weights: forward, lse and gradients (the
sinks' included) against the float64 reference (attention_testing.references) in every
dtype, alone and combined, with the round-off bound; against SDPA by FlashAttention's
twice-SDPA's-error rule where SDPA can express the call (a window is a boolean attn_mask, ALiBi a
float one, a softcap's forward too); long sequences with small windows (the skipped key blocks);
rows that see no key; random calls under hypothesis. The first tests check the reference itself
against formulas written out by hand, so that the rest rest on it."""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import causal_attention
from attention_testing.inputs import (
    Case,
    ScoreOptions,
    alibi_slopes_for,
    default_scale,
    make_key_mask,
    make_sinks,
    make_tensor,
)
from attention_testing.parameters import REPRODUCIBLE_EXAMPLES, DTYPE_IDS, DTYPES, dtype_params
from attention_testing.references import (
    expand_kv_heads,
    float64_reference,
    scaled_scores,
    sdpa_reference,
    to64,
)
from attention_testing.results import (
    RESULT_NAMES,
    SINK_RESULT_NAMES,
    assert_bitwise_equal,
    assert_matches_float64_reference,
    forward_and_grads,
)
from attention_testing.tolerances import (
    UNIT_ROUNDOFF,
    abs_magnitudes,
    assert_close_to_reference,
    logit_l1,
    max_abs_diff,
    roundoff_tolerance,
    twice_sdpa_error_failures,
)
from causal_attention._masks import visible_keys

# Many small calls: on one thread, as test_fuzz.py does.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# --- the reference itself --------------------------------------------------------------------


def _explicit_visibility(lq, lk, window):
    """Bool (lq, lk) from the definition, one pair at a time."""
    left, right = window
    off = lk - lq

    def sees(i, j):
        return (left < 0 or i + off - left <= j) and (right < 0 or j <= i + off + right)

    rows = [[sees(i, j) for j in range(lk)] for i in range(lq)]
    return torch.tensor(rows, dtype=torch.bool).reshape(lq, lk)


REFERENCE_CASES = [
    pytest.param(Case(9, 13, 8, dv=5, hq=4, hkv=2, batch=(2,)), id="Lq9-Lk13-gqa2"),
    pytest.param(Case(13, 6, 4, hq=2, hkv=1), id="Lq13-Lk6-empty-rows"),
    pytest.param(Case(7, 7, 4, heads=False), id="2d"),
]


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_with_default_options_is_sdpa(case):
    q, k, v = case.inputs(torch.float64)
    grad_out = make_tensor(case.out_shape, torch.float64)
    key_mask = make_key_mask(case.key_mask_shape, "holes")
    for mask in (None, key_mask):
        ref = float64_reference(q, k, v, 0.4, grad_out, key_mask=mask)
        visible = None if mask is None else visible_keys(case.lq, case.lk, key_mask=mask)
        out, grads = sdpa_reference(q, k, v, grad_out, scale=0.4, visible=visible)
        for name, a, b in zip(RESULT_NAMES, (ref.out,) + ref.grads, (out,) + grads):
            assert max_abs_diff(a, b) < 1e-13, name
        assert ref.dsinks is None and ref.sink_probs is None
        assert torch.equal(ref.probs, ref.undropped)
        assert torch.equal(ref.logit_shift, torch.zeros_like(ref.logit_shift))


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (0, 0), (3, 0), (2, 4), (-1, 2), (5, -1)])
@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_windows_are_the_definition(case, window):
    ref = float64_reference(*case.inputs(torch.float64), 0.4, window=window)
    assert torch.equal(ref.visible, _explicit_visibility(case.lq, case.lk, window))
    hidden = ~ref.visible.expand(ref.probs.shape)
    assert torch.equal(ref.probs[hidden], torch.zeros_like(ref.probs[hidden]))


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (0, 0), (3, 0), (2, 4), (-1, 2), (5, -1)])
@pytest.mark.parametrize("lq,lk", [(9, 13), (13, 6), (7, 7), (0, 4), (3, 0)])
def test_visible_keys_is_the_definition_with_and_without_a_key_mask(lq, lk, window):
    """causal_attention._masks.visible_keys, the reference's visibility and that of every mask
    the package, tests and benchmarks spell out: (lq, lk) alone and with a (lk,) key mask, (*batch,
    1, lq, lk) with a (*batch, lk) one; a key mask of another length is refused."""
    expected = _explicit_visibility(lq, lk, window)
    assert torch.equal(visible_keys(lq, lk, window), expected)
    for shape in ((lk,), (2, lk), (2, 3, lk)):
        key_mask = torch.rand(shape) >= 0.3
        want = expected & key_mask[..., None, :]
        if key_mask.dim() > 1:
            want = want.unsqueeze(-3)
        got = visible_keys(lq, lk, window, key_mask=key_mask)
        assert got.shape == want.shape and torch.equal(got, want), shape
    with pytest.raises(ValueError, match="key_mask"):
        visible_keys(lq, lk, window, key_mask=torch.ones(lk + 1, dtype=torch.bool))


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_softcap_and_alibi_are_the_formulas(case):
    """Scores written out per pair: softcap * tanh(s / softcap) - slope * |i + off - j|, the
    softmax over the window's keys; SDPA with them as a float mask gives the same forward."""
    q, k, v = case.inputs(torch.float64)
    heads = case.hq if case.heads else 1
    slopes = alibi_slopes_for((heads,))
    window = (4, 1)
    ref = float64_reference(q, k, v, 0.4, softcap=1.5, alibi_slopes=slopes, window=window)
    raw = 0.4 * to64(q) @ expand_kv_heads(to64(k), heads).transpose(-2, -1)
    off = case.lk - case.lq
    distance = torch.tensor(
        [[abs(i + off - j) for j in range(case.lk)] for i in range(case.lq)], dtype=torch.float64
    )
    per_head = slopes.double().reshape((-1, 1, 1) if case.heads else (1, 1))
    scores = 1.5 * torch.tanh(raw / 1.5) - per_head * distance
    visible = _explicit_visibility(case.lq, case.lk, window)
    expected = scores.masked_fill(~visible, -math.inf).softmax(-1).nan_to_num(0.0)
    assert max_abs_diff(ref.probs, expected) < 1e-14
    out, _ = sdpa_reference(q, k, v, scale=0.4, visible=ref.visible, bias=ref.logit_shift)
    assert max_abs_diff(ref.out, out) < 1e-13


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_sinks_are_an_extra_softmax_column(case):
    """A manual softmax over the visible scores and one more column holding the sink: the
    probabilities, lse and sink probabilities; rows without keys give zeros and lse = sink; the
    sinks' gradient is -sum P_sink (dO . out) over each head's rows, within its magnitude."""
    q, k, v = case.inputs(torch.float64)
    grad_out = make_tensor(case.out_shape, torch.float64)
    heads = case.hq if case.heads else 1
    sinks = make_sinks(heads, torch.float64)
    ref = float64_reference(q, k, v, 0.4, grad_out, sinks=sinks)
    visible = _explicit_visibility(case.lq, case.lk, (-1, 0))
    scores = scaled_scores(q, k, 0.4).masked_fill(~visible, -math.inf)
    column = sinks.reshape((-1, 1, 1) if case.heads else (1, 1)).expand(scores.shape[:-1] + (1,))
    manual = torch.cat([scores, column], -1).softmax(-1)
    assert max_abs_diff(ref.probs, manual[..., :-1]) < 1e-15
    assert max_abs_diff(ref.sink_probs, manual[..., -1]) < 1e-15
    assert max_abs_diff(ref.lse, torch.cat([scores, column], -1).logsumexp(-1)) < 1e-13
    no_key = ~visible.any(-1)
    if no_key.any():
        assert torch.equal(ref.out[..., no_key, :], torch.zeros_like(ref.out[..., no_key, :]))
        assert torch.equal(ref.lse[..., no_key], column[..., no_key, 0])
    per_row = -ref.sink_probs * (grad_out * ref.out).sum(-1)
    closed_form = per_row.sum(-1).reshape(-1, heads).sum(0)
    assert max_abs_diff(ref.dsinks, closed_form) < 1e-13
    magnitudes = abs_magnitudes(q, k, v, 0.4, ref.probs, grad_out, sink_probs=ref.sink_probs)
    assert ref.dsinks.abs().max().item() <= magnitudes["dsinks"]


def test_reference_dropout_rescales_the_kept_probabilities():
    case = Case(9, 13, 8, dv=5, hq=4, hkv=2, batch=(2,))
    q, k, v = case.inputs(torch.float64)
    grad_out = make_tensor(case.out_shape, torch.float64)
    plain = float64_reference(q, k, v, 0.4, grad_out)
    everything = torch.ones(plain.probs.shape, dtype=torch.bool)
    kept_all = float64_reference(q, k, v, 0.4, grad_out, dropout_p=0.5, keep=everything)
    assert max_abs_diff(kept_all.out, 2 * plain.out) < 1e-14
    assert torch.equal(kept_all.lse, plain.lse) and torch.equal(kept_all.undropped, plain.probs)
    keep = torch.rand(plain.probs.shape) >= 0.3
    dropped = float64_reference(q, k, v, 0.4, grad_out, dropout_p=0.3, keep=keep)
    assert max_abs_diff(dropped.probs, plain.probs * keep / 0.7) < 1e-15
    v_all = expand_kv_heads(to64(v), case.hq)
    assert max_abs_diff(dropped.out, dropped.probs @ v_all) < 1e-14
    with pytest.raises(ValueError, match="keep mask"):
        float64_reference(q, k, v, 0.4, dropout_p=0.3)


# --- the op against the reference, every option alone and combined ---------------------------

OPTIONS = {
    "sliding": ScoreOptions(window=(15, 0)),
    "window-both-sides": ScoreOptions(window=(20, 7)),
    "right-only": ScoreOptions(window=(-1, 5)),
    "full": ScoreOptions(window=(-1, -1)),
    "softcap": ScoreOptions(softcap=1.5),
    "alibi": ScoreOptions(alibi="heads"),
    "alibi-batch": ScoreOptions(alibi="batch"),
    "sinks": ScoreOptions(sinks="q"),
    "sinks-float32": ScoreOptions(sinks="float32"),
    "all": ScoreOptions(window=(30, 4), softcap=3.0, alibi="heads", sinks="q"),
    "all-key-mask": ScoreOptions(
        window=(-1, 9), softcap=2.0, alibi="batch", sinks="float32", key_mask="holes"
    ),
}
# What SDPA can express: windows and key masks (boolean masks), ALiBi and a softcap's forward
# (float masks).
SDPA_OPTIONS = {
    **{name: OPTIONS[name] for name in ("sliding", "window-both-sides", "right-only", "full")},
    **{name: OPTIONS[name] for name in ("softcap", "alibi", "alibi-batch")},
    "window-alibi-key-mask": ScoreOptions(window=(25, 3), alibi="batch", key_mask="left-pad"),
    "window-softcap-alibi": ScoreOptions(window=(40, 0), softcap=2.0, alibi="heads"),
}

# GQA, Lq < Lk over several blocks with Dv != D in the transposed layout, Lq > Lk (rows without
# keys) strided, decoding (Lq <= 32), 2-D and 5-D inputs, and batch * Hkv >= 8 (the one-pass
# backward in float32 / float64).
CASES = [
    pytest.param(Case(17, 17, 8, hq=4, hkv=2), id="L17-gqa2"),
    pytest.param(
        Case(70, 130, 16, dv=8, hq=2, hkv=1, batch=(2,), layout="transposed"),
        id="Lq70-Lk130-Dv8-gqa2-transposed",
    ),
    pytest.param(Case(100, 40, 16, hq=2, hkv=2, layout="strided"), id="Lq100-Lk40-strided"),
    pytest.param(Case(9, 600, 32, hq=4, hkv=1, batch=(2,)), id="decode-Lq9-Lk600-mqa4"),
    pytest.param(Case(20, 20, 8, heads=False), id="2d-L20"),
    pytest.param(Case(33, 50, 8, dv=16, hq=2, hkv=1, batch=(2, 3)), id="5d-Lq33-Lk50-Dv16"),
    pytest.param(Case(130, 130, 32, hq=8, hkv=8), id="one-pass-H8-L130"),
]


def _run(case: Case, dtype, kwargs, function=causal_attention.attention):
    """(inputs, grad_out, results): out, dq, dk, dv and, with sinks, dsinks."""
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    return inputs, grad_out, forward_and_grads(function, inputs, grad_out, **kwargs)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(case, name, dtype):
    kwargs = OPTIONS[name].for_case(case, dtype)
    inputs, grad_out, results = _run(case, dtype, kwargs)
    assert_matches_float64_reference(
        case, dtype, inputs, grad_out, results, default_scale(case.d), kwargs
    )


@pytest.mark.parametrize("dtype", dtype_params([torch.float64, torch.bfloat16]))
@pytest.mark.parametrize(
    "case,options",
    [
        pytest.param(Case(17, 23, 8, hq=4, hkv=2), OPTIONS["all"], id="all"),
        pytest.param(
            Case(33, 50, 8, dv=16, hq=2, hkv=1, batch=(2, 3)), OPTIONS["all-key-mask"], id="mask"
        ),
    ],
)
@pytest.mark.parametrize("scale", [0.0, -0.7, 1.9])
def test_explicit_scales_with_every_option(case, options, scale, dtype):
    """The scale multiplies q k^T before the softcap and ALiBi (0: only ALiBi and the sinks
    shape the weights; negative: reversed scores)."""
    kwargs = options.for_case(case, dtype)
    inputs, grad_out, results = _run(
        case, dtype, kwargs, lambda *a, **kw: causal_attention.attention(*a, scale=scale, **kw)
    )
    assert_matches_float64_reference(case, dtype, inputs, grad_out, results, scale, kwargs)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name", SDPA_OPTIONS)
@pytest.mark.parametrize("case", CASES[:4] + CASES[5:6])
def test_matches_sdpa_within_twice_its_error(case, name, dtype):
    """SDPA given the reference's visibility as a boolean mask and its logit shift (ALiBi's bias,
    the softcap's change) as a float one. SDPA's gradients do not see that a softcap's shift
    depends on q and k, so with a softcap only the forward is compared (the gradients are the
    reference's, above)."""
    options = SDPA_OPTIONS[name]
    kwargs = options.for_case(case, dtype)
    inputs, grad_out, results = _run(case, dtype, kwargs)
    ref = float64_reference(*inputs, default_scale(case.d), **kwargs)
    mask = dict(visible=ref.visible, bias=ref.logit_shift)
    exact = sdpa_reference(*(to64(t) for t in inputs), to64(grad_out), **mask)
    same = sdpa_reference(*inputs, grad_out, **mask)
    count = 1 if options.softcap is not None else 4
    failures = twice_sdpa_error_failures(
        RESULT_NAMES[:count],
        results[:count],
        ((same[0],) + same[1])[:count],
        ((exact[0],) + exact[1])[:count],
    )
    assert not failures, "; ".join(failures)


# --- windows -----------------------------------------------------------------------------------

WINDOW_CASES = [
    pytest.param(Case(64, 64, 16, hq=2, hkv=1, batch=(2,)), id="L64-gqa2"),
    pytest.param(Case(40, 150, 8, dv=4, hq=2, hkv=2, layout="transposed"), id="Lq40-Lk150-Dv4"),
    pytest.param(Case(150, 40, 8, hq=3, hkv=1), id="Lq150-Lk40-mqa3"),
    pytest.param(Case(12, 700, 32, hq=4, hkv=2), id="decode-Lq12-Lk700"),
]


def _sdpa_rule(inputs, grad_out, results, visible):
    exact = sdpa_reference(*(to64(t) for t in inputs), to64(grad_out), visible=visible)
    same = sdpa_reference(*inputs, grad_out, visible=visible)
    failures = twice_sdpa_error_failures(
        RESULT_NAMES, results, (same[0],) + same[1], (exact[0],) + exact[1]
    )
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_full_window_is_non_causal_sdpa(case, dtype):
    inputs, grad_out, results = _run(case, dtype, {"window": (-1, -1)})
    _sdpa_rule(inputs, grad_out, results, torch.ones((case.lq, case.lk), dtype=torch.bool))


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("width", [1, 7, 64, 65])
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_sliding_window_is_sdpa_with_a_band_mask(case, width, dtype):
    """window = (W - 1, 0): each row sees its last W keys (bottom-right aligned)."""
    inputs, grad_out, results = _run(case, dtype, {"window": (width - 1, 0)})
    _sdpa_rule(inputs, grad_out, results, visible_keys(case.lq, case.lk, (width - 1, 0)))


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case", WINDOW_CASES[:3])
def test_diagonal_window_copies_the_values(case, dtype):
    """window = (0, 0): row i sees key i + Lk - Lq alone, so its output is that value row (one
    weight of exactly 1, up to the dtype's rounding), and other rows are zeros."""
    q, k, v = case.inputs(dtype)
    out = causal_attention.attention(q, k, v, window=(0, 0))
    heads = case.hq if case.heads else 1
    v_all = expand_kv_heads(v, heads)
    off = case.lk - case.lq
    rows = torch.arange(case.lq)
    seen = (rows + off >= 0) & (rows + off < case.lk)
    expected = torch.zeros_like(out)
    expected[..., seen, :] = v_all[..., rows[seen] + off, :]
    bound = 2 * UNIT_ROUNDOFF[dtype] * to64(v).abs().max().item()
    assert max_abs_diff(out, expected) <= bound


F64, F32, BF16, F16 = DTYPES
# Lq and Lk past 1024 (the tiled forward, key splits), and decoding with key splits, with windows
# a few keys wide that straddle block edges: most key blocks are skipped, the rest partial. Two
# dtypes each (every dtype runs the same skipping): all four together.
LONG_CASES = [
    ("L1100-sliding17", Case(1100, 1100, 16, hq=2, hkv=1), (16, 0), (F64, BF16)),
    ("Lq1030-Lk1600-w70-3", Case(1030, 1600, 32, hq=2, layout="transposed"), (70, 3), (F32, F16)),
    ("decode-Lk2100-sliding101", Case(16, 2100, 64, hq=4, hkv=2), (100, 0), (F32, BF16)),
    ("L1100-ahead63", Case(1100, 1100, 8, batch=(2,)), (0, 63), (F64, F16)),
]


@pytest.mark.parametrize(
    "case,window,dtype",
    [
        pytest.param(case, window, dtype, id=f"{name}-{DTYPE_IDS[dtype]}")
        for name, case, window, dtypes in LONG_CASES
        for dtype in dtypes
    ],
)
def test_long_sequences_with_small_windows_are_exact(case, window, dtype):
    kwargs = {"window": window, "alibi_slopes": alibi_slopes_for((case.hq,))}
    inputs, grad_out, results = _run(case, dtype, kwargs)
    assert_matches_float64_reference(
        case, dtype, inputs, grad_out, results, default_scale(case.d), kwargs
    )
    # Keys that no row's window reaches get exactly zero gradient.
    unseen = ~visible_keys(case.lq, case.lk, window).any(0)
    for name, t in zip(("dk", "dv"), results[2:4]):
        assert torch.equal(t[..., unseen, :], torch.zeros_like(t[..., unseen, :])), name


# --- rows that see no key ----------------------------------------------------------------------


def _hiding(case: Case, start: int, stop: int, batch_index=None) -> torch.Tensor:
    """A key mask that hides keys start:stop (of one batch element, or all)."""
    key_mask = torch.ones(case.key_mask_shape, dtype=torch.bool)
    if batch_index is None:
        key_mask[..., start:stop] = False
    else:
        key_mask[batch_index, start:stop] = False
    return key_mask


NO_KEY_CASES = [
    # Lq > Lk: row i's window ends at i - 20 + 2, before key 0 for i < 18.
    pytest.param(Case(40, 20, 8, hq=2, hkv=1, batch=(2,)), (3, 2), None, id="Lq40-Lk20-w3-2"),
    # The key mask hides keys 30:45, all that rows 34:45 see.
    pytest.param(Case(64, 64, 8, hq=2, hkv=2, batch=(2,)), (4, 0), (30, 45, None), id="hidden"),
    # Decoding: the first batch element's rows see keys 290:300 at most, all hidden.
    pytest.param(
        Case(8, 300, 16, hq=4, hkv=2, batch=(2,)), (2, 0), (280, 300, 0), id="decode-hidden"
    ),
    # Across a block edge of the tiled forward.
    pytest.param(Case(1030, 1030, 8), (5, 0), (60, 200, None), id="tiles-hidden-blocks"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("sinks", [None, "q"], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("case,window,hidden", NO_KEY_CASES)
def test_rows_without_keys_are_zeros_and_sink_rows_have_finite_gradients(
    case, window, hidden, sinks, dtype
):
    kwargs = ScoreOptions(window=window, sinks=sinks, alibi="heads").for_case(case, dtype)
    if hidden is not None:
        kwargs["key_mask"] = _hiding(case, *hidden)
    inputs, grad_out, results = _run(case, dtype, kwargs)
    out, dq = results[0], results[1]
    no_key = ~visible_keys(case.lq, case.lk, window, key_mask=kwargs.get("key_mask")).any(-1)
    assert no_key.any() and not no_key.all()
    rows = no_key.expand(out.shape[:-1])
    for name, t in (("out", out), ("dq", dq)):
        assert torch.equal(t[rows], torch.zeros_like(t[rows])), name
    assert out[~rows].abs().amax(-1).gt(0).all(), "a row that sees keys is zero"
    for name, t in zip(SINK_RESULT_NAMES, results):
        assert torch.isfinite(t).all(), name
    _, lse = causal_attention.attention_forward(*inputs, default_scale(case.d), **kwargs)
    if sinks is None:
        assert (lse[rows] == -math.inf).all()
    else:
        # lse = log(exp(sink)) exactly: the sink is the row's only term.
        sink_of_row = kwargs["sinks"].detach().to(lse.dtype).reshape(-1, 1).expand(lse.shape)
        assert torch.equal(lse[rows], sink_of_row[rows])
        assert results[4].abs().gt(0).any(), "dsinks all zero"
    assert torch.isfinite(lse[~rows]).all()


# --- attention_weights and the kernel entries --------------------------------------------------


@pytest.mark.parametrize("dtype", dtype_params([torch.float64, torch.float32, torch.bfloat16]))
@pytest.mark.parametrize("name", ["window-both-sides", "softcap", "alibi-batch", "sinks", "all"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]])
def test_attention_weights_are_the_reference_probabilities(case, name, dtype):
    """With sinks a row's weights sum to 1 - its sink's probability."""
    kwargs = OPTIONS[name].for_case(case, dtype)
    q, k, v = case.inputs(dtype)
    weights = causal_attention.attention_weights(q, k, v, **kwargs)
    scale = default_scale(case.d)
    ref = float64_reference(q, k, v, scale, **kwargs)
    assert weights.shape == ref.probs.shape and weights.dtype == dtype
    hidden = ~ref.visible.expand(weights.shape)
    assert torch.equal(weights[hidden], torch.zeros_like(weights[hidden]))
    l1 = logit_l1(q, k, scale, ref.logit_shift)
    tolerance = roundoff_tolerance(dtype, case.d, case.lk + case.d, l1)
    assert_close_to_reference("weights", weights, ref.probs, 1.0, tolerance)


@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16]))
@pytest.mark.parametrize("sinks", [None, "q", "float32"], ids=["no-sinks", "sinks", "sinks-f32"])
def test_the_kernel_entries_are_what_autograd_runs(sinks, dtype):
    """attention_backward's (dq, dk, dv, dsinks) from attention_forward's (out, lse) are bitwise
    attention's gradients; dsinks is (0,) without sinks, else (Hq,) in the sinks' dtype."""
    case = Case(70, 90, 16, dv=8, hq=4, hkv=2, batch=(2,))
    kwargs = ScoreOptions(window=(30, 2), softcap=2.5, alibi="batch", sinks=sinks).for_case(
        case, dtype
    )
    inputs, grad_out, results = _run(case, dtype, kwargs)
    scale = default_scale(case.d)
    out, lse = causal_attention.attention_forward(*inputs, scale, **kwargs)
    dq, dk, dv, dsinks = causal_attention.attention_backward(
        grad_out, *inputs, out, lse, scale, **kwargs
    )
    if sinks is None:
        assert dsinks.shape == (0,)
        assert_bitwise_equal((out, dq, dk, dv), results)
    else:
        assert dsinks.shape == (case.hq,) and dsinks.dtype == kwargs["sinks"].dtype
        assert_bitwise_equal((out, dq, dk, dv, dsinks), results)


def test_alibi_slopes_per_batch_element_are_each_elements_own():
    """Slopes (*batch, Hq): batch element b is the call with slopes[b] alone."""
    case = Case(30, 40, 8, hq=2, hkv=1, batch=(3,))
    q, k, v = case.inputs(torch.float32)
    slopes = alibi_slopes_for((3, 2))
    out = causal_attention.attention(q, k, v, alibi_slopes=slopes, window=(-1, -1))
    for b in range(3):
        alone = causal_attention.attention(
            q[b], k[b], v[b], alibi_slopes=slopes[b], window=(-1, -1)
        )
        assert max_abs_diff(out[b], alone) < 1e-6, b


# --- random calls --------------------------------------------------------------------------------

_SCALE = float(os.environ.get("CAUSAL_ATTENTION_FUZZ_SCALE", "1"))
EXAMPLES = max(1, int(80 * _SCALE))

_lengths = st.one_of(st.integers(0, 9), st.integers(0, 140), st.sampled_from([63, 64, 65, 129]))
_dims = st.one_of(st.integers(1, 8), st.integers(1, 40))


def _window_side(length):
    return st.one_of(st.just(-1), st.integers(0, 5), st.integers(0, length + 2))


@st.composite
def option_calls(draw):
    """(case, options, dropout_p, scale, seed): 2-D to 5-D, GQA, Dv != D, Lq != Lk, every
    option at once or not, a key mask and dropout."""
    two_d = draw(st.integers(0, 6)) == 0
    lq, lk = draw(_lengths), draw(_lengths)
    if two_d:
        case = Case(lq, lk, draw(_dims), draw(_dims), heads=False,
                    layout=draw(st.sampled_from(["contiguous", "strided"])))
    else:
        hkv = draw(st.sampled_from([1, 2]))
        case = Case(
            lq,
            lk,
            draw(_dims),
            draw(_dims),
            hq=hkv * draw(st.sampled_from([1, 2, 3])),
            hkv=hkv,
            batch=tuple(draw(st.lists(st.sampled_from([1, 2]), max_size=2))),
            layout=draw(st.sampled_from(["contiguous", "transposed", "strided"])),
        )
    options = ScoreOptions(
        window=(draw(_window_side(lk)), draw(_window_side(lk))),
        softcap=draw(st.one_of(st.none(), st.floats(0.3, 30.0))),
        alibi=draw(st.sampled_from([None, "heads", "batch"])),
        sinks=draw(st.sampled_from([None, "q", "float32"])),
        key_mask=draw(st.sampled_from([None, "holes", "left-pad", "one-all-false"])),
    )
    dropout_p = draw(st.sampled_from([0.0, 0.0, 0.2, 0.7]))
    scale = draw(st.one_of(st.none(), st.floats(-2.0, 2.0)))
    return case, options, dropout_p, scale, draw(st.integers(0, 2**16))


@settings(max_examples=EXAMPLES, **REPRODUCIBLE_EXAMPLES)
@given(call=option_calls())
def test_random_calls_with_every_option_match_float64_reference(call):
    """In float64. With dropout the op's keep mask is read off attention_weights (called with a
    generator in the same state), where the undropped probabilities are nonzero."""
    case, options, dropout_p, scale, seed = call
    torch.manual_seed(seed)
    dtype = torch.float64
    kwargs = options.for_case(case, dtype)
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    resolved = default_scale(case.d) if scale is None else scale
    dropout = dict(scale=scale, dropout_p=dropout_p)
    keep = None
    if dropout_p > 0:
        generator = torch.Generator().manual_seed(seed)
        weights = causal_attention.attention_weights(
            *inputs, generator=generator, **dropout, **kwargs
        )
        keep = weights != 0

    def attention(*args, **kw):
        generator = torch.Generator().manual_seed(seed)
        return causal_attention.attention(*args, generator=generator, **dropout, **kw)

    results = forward_and_grads(attention, inputs, grad_out, **kwargs)
    assert_matches_float64_reference(
        case, dtype, inputs, grad_out, results, resolved, kwargs, dropout_p, keep
    )
