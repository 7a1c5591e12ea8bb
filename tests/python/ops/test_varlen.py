"""varlen_attention (packed sequences, FlashAttention's layout): each sequence's out, lse and
gradients are those of attention() called on that sequence alone (within round-off) and of the
float64 reference, also with the score options (window, softcap, ALiBi, sinks) per sequence; the
padded batch given to SDPA with the equivalent boolean mask bounds the error by FlashAttention's
twice-SDPA's-error rule; empty sequences, rows without keys, chunks
against a cache, single tokens, decoding and long sequences; sequences never see each other;
random lengths under hypothesis."""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import causal_attention
from attention_testing.inputs import ScoreOptions, default_scale, make_tensor
from attention_testing.packed import Packed
from attention_testing.parameters import REPRODUCIBLE_EXAMPLES, DTYPES, dtype_params
from attention_testing.references import empty_rows, float64_reference, sdpa_reference, to64
from attention_testing.results import RESULT_NAMES
from attention_testing.tolerances import (
    abs_magnitudes,
    assert_close_to_reference,
    dsinks_tolerance,
    logit_l1,
    roundoff_tolerance,
    twice_sdpa_error_failures,
)

# Many small calls: on one thread, as test_fuzz.py does.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# Together: an empty sequence, single tokens, Lq_i < Lk_i (a chunk against its cache), Lq_i >
# Lk_i (rows without keys), Lk_i = 0, GQA and MQA, Dv != D, max_seqlen_q <= 32 (the decode path,
# with key splits past 1024 keys), Lq_i >= 1024 (the tiled forward), N * Hkv >= 8 and many short
# sequences.
CONFIGS = [
    pytest.param(Packed((5, 0, 17, 1, 64), (5, 3, 17, 1, 64), 16, hq=2, hkv=2), id="mixed-empty"),
    pytest.param(Packed((3, 40, 65), (3, 40, 65), 32, dv=12, hq=4, hkv=2), id="gqa2-Dv12"),
    pytest.param(Packed((16, 1, 8), (600, 700, 2000), 64, hq=4, hkv=2), id="decode-chunks-split"),
    pytest.param(Packed((1, 1, 1, 1), (1, 5, 1, 9), 8, hq=3, hkv=1), id="single-tokens-mqa3"),
    pytest.param(Packed((10, 0, 40, 4), (0, 0, 25, 2), 8, hq=2, hkv=1), id="Lq-gt-Lk-no-keys"),
    pytest.param(Packed((70, 130), (200, 130), 16, dv=24, hq=2, hkv=2), id="chunk-vs-cache"),
    pytest.param(Packed((1100, 30), (1100, 30), 16, hq=2, hkv=1), id="long-tiles"),
    pytest.param(Packed((150, 130, 20), (150, 130, 20), 64, hq=8, hkv=8), id="H8"),
    pytest.param(
        Packed(tuple(range(0, 40, 3)), tuple(range(0, 40, 3))[::-1], 8, hq=2, hkv=2),
        id="many-short",
    ),
]
SDPA_CONFIGS = [p for p in CONFIGS if p.values[0].max_seqlen_k > 0]


def _run(packed: Packed, inputs, grad_out, max_extra: int = 0, **options):
    """varlen_attention forward and backward with the score options ``options`` (window,
    softcap, alibi_slopes, sinks), and the forward op's lse: (out, (dq, dk, dv), lse), and dsinks
    after dv with sinks."""
    cu_q, cu_k, max_q, max_k = packed.lengths_args()
    out = causal_attention.varlen_attention(
        *inputs, cu_q, cu_k, max_q + max_extra, max_k + max_extra, **options
    )
    sinks = options.get("sinks")
    grads = torch.autograd.grad(out, list(inputs) + ([] if sinks is None else [sinks]), grad_out)
    _, lse = causal_attention.varlen_attention_forward(
        *(t.detach() for t in inputs), cu_q, cu_k, max_q, max_k, default_scale(packed.d), **options
    )
    return out.detach(), grads, lse


def _fresh(packed: Packed, dtype):
    return packed.inputs(dtype, requires_grad=True), make_tensor(packed.out_shape, dtype)


def assert_matches_sequences_alone(packed: Packed, dtype, inputs, grad_out, **options):
    """Each sequence of the packed call against attention() on it alone with the same score
    options (within twice the round-off bound: both are within it of the exact result) and
    against the float64 reference (within the bound); lse against attention_forward's; with
    sinks, dsinks against the sum over the sequences of theirs."""
    out, grads, lse = _run(packed, inputs, grad_out, **options)
    dq, dk, dv = grads[:3]
    assert out.shape == packed.out_shape and out.dtype == dtype
    assert lse.shape == (packed.hq, packed.total_q)
    packed_parts = {
        "out": packed.split(out, keys=False),
        "dq": packed.split(dq, keys=False),
        "dk": packed.split(dk, keys=True),
        "dv": packed.split(dv, keys=True),
        "lse": list(torch.split(lse, list(packed.lengths_q), dim=-1)),
    }
    q_parts, k_parts, v_parts = (
        packed.split(t, keys) for t, keys in zip(inputs, (False, True, True))
    )
    g_parts = packed.split(grad_out, keys=False)
    scale = default_scale(packed.d)
    sinks = options.get("sinks")
    summed = {"alone": 0, "exact": 0, "peak": 0.0, "tolerance": 0.0}
    slopes = options.get("alibi_slopes")
    for i, (lq, lk) in enumerate(zip(packed.lengths_q, packed.lengths_k)):
        part = [t[i].detach().requires_grad_(True) for t in (q_parts, k_parts, v_parts)]
        wrt = part + ([] if sinks is None else [sinks])
        own = dict(options)
        if slopes is not None and slopes.dim() == 2:
            own["alibi_slopes"] = slopes[i]  # (N, Hq): each sequence's own slopes
        alone = causal_attention.attention(*part, **own)
        alone_grads = torch.autograd.grad(alone, wrt, g_parts[i])
        _, alone_lse = causal_attention.attention_forward(*part, scale, **own)
        ref = float64_reference(*part, scale, g_parts[i], **own)
        peaks = abs_magnitudes(
            *part, scale, ref.probs, g_parts[i], undropped=ref.undropped, sink_probs=ref.sink_probs
        )
        sum_length = lq + lk + packed.d + packed.value_dim
        l1 = logit_l1(*part[:2], scale, ref.logit_shift)
        tolerance = roundoff_tolerance(dtype, packed.d, sum_length, l1)
        singles = (alone.detach(),) + alone_grads[:3]
        for name, single, exact in zip(RESULT_NAMES, singles, (ref.out,) + ref.grads):
            ours, peak = packed_parts[name][i], peaks[name]
            assert ours.shape == single.shape, f"{name}[{i}]"
            assert_close_to_reference(f"{name}[{i}]", ours, exact, peak, tolerance)
            assert_close_to_reference(f"{name}[{i}] vs alone", ours, single, peak, 2 * tolerance)
        ours_lse = packed_parts["lse"][i]
        finite = torch.isfinite(alone_lse)
        assert torch.equal(ours_lse[~finite], alone_lse[~finite]), f"lse[{i}]"
        if finite.any():
            error = (to64(ours_lse) - to64(alone_lse))[finite].abs().max().item()
            assert error <= 2 * tolerance * (1 + alone_lse[finite].abs().max().item()), f"lse[{i}]"
        if sinks is not None:
            summed["alone"] = summed["alone"] + to64(alone_grads[3])
            summed["exact"] = summed["exact"] + ref.dsinks
            summed["peak"] += peaks["dsinks"]
            # dsinks sums over every row of every sequence.
            rows_tolerance = dsinks_tolerance(
                dtype, sinks.dtype, packed.d, sum_length + packed.total_q, l1
            )
            summed["tolerance"] = max(summed["tolerance"], rows_tolerance)
    if sinks is not None:
        dsinks = grads[3]
        assert dsinks.shape == sinks.shape and dsinks.dtype == sinks.dtype
        peak, tolerance = summed["peak"], summed["tolerance"]
        assert_close_to_reference("dsinks", dsinks, summed["exact"], peak, tolerance)
        assert_close_to_reference("dsinks vs alone", dsinks, summed["alone"], peak, 2 * tolerance)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("packed", CONFIGS)
def test_each_sequence_is_attention_on_it_alone(packed, dtype):
    assert_matches_sequences_alone(packed, dtype, *_fresh(packed, dtype))


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("packed", SDPA_CONFIGS)
def test_matches_sdpa_on_the_padded_batch_within_twice_its_error(packed, dtype):
    inputs, grad_out = _fresh(packed, dtype)
    out, grads, _ = _run(packed, inputs, grad_out)
    padded = [packed.pad(t.detach(), keys) for t, keys in zip(inputs, (False, True, True))]
    padded_grad = packed.pad(grad_out, keys=False)
    visible = packed.padded_visibility()

    def unpadded(result):
        out, grads = result
        return (packed.unpad(out, False),) + tuple(
            packed.unpad(g, keys) for g, keys in zip(grads, (False, True, True))
        )

    ref = unpadded(sdpa_reference(*map(to64, padded), to64(padded_grad), visible=visible))
    same = unpadded(sdpa_reference(*padded, padded_grad, visible=visible))
    failures = twice_sdpa_error_failures(RESULT_NAMES, (out,) + grads, same, ref)
    assert not failures, "; ".join(failures)


# The score options per sequence: a window (bottom-right aligned in each sequence, so a chunk
# against its cache sees the cache's last keys), softcap, ALiBi (distances within the sequence)
# and sinks (each sequence's rows share them, their gradient sums over all).
VARLEN_OPTIONS = {
    "sliding": ScoreOptions(window=(10, 0)),
    "window-both-sides": ScoreOptions(window=(20, 3)),
    "alibi-sinks": ScoreOptions(alibi="heads", sinks="q"),
    # Slopes (N, Hq): one row per sequence.
    "all": ScoreOptions(window=(30, 2), softcap=2.0, alibi="batch", sinks="float32"),
}
# An empty sequence, decoding with key splits, rows without keys, a chunk against its cache.
OPTION_CONFIGS = [CONFIGS[i] for i in (0, 2, 4, 5)]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name", VARLEN_OPTIONS)
@pytest.mark.parametrize("packed", OPTION_CONFIGS)
def test_each_sequence_is_attention_on_it_alone_with_score_options(packed, name, dtype):
    sequences = (len(packed.lengths_q),)
    options = VARLEN_OPTIONS[name].kwargs(dtype, packed.hq, batch=sequences)
    assert_matches_sequences_alone(packed, dtype, *_fresh(packed, dtype), **options)


EMPTY_ROW_CONFIGS = [
    pytest.param(Packed((10, 0, 40, 4), (0, 0, 25, 2), 8, hq=2, hkv=1), id="Lk0-and-Lq-gt-Lk"),
    pytest.param(Packed((3, 5), (0, 0), 8, hq=2, hkv=2), id="no-keys-at-all"),
    pytest.param(Packed((1200, 7), (1000, 7), 8), id="long-Lq-gt-Lk"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("packed", EMPTY_ROW_CONFIGS)
def test_rows_without_keys_are_exact_zeros(packed, dtype):
    inputs, grad_out = _fresh(packed, dtype)
    out, (dq, dk, dv), lse = _run(packed, inputs, grad_out)
    rows = torch.cat([empty_rows(lq, lk) for lq, lk in zip(packed.lengths_q, packed.lengths_k)])
    assert rows.any()
    for name, t in (("out", out), ("dq", dq)):
        assert torch.equal(t[rows], torch.zeros_like(t[rows])), name
    assert out[~rows].abs().amax(-1).gt(0).all()
    assert (lse[:, rows] == -math.inf).all() and torch.isfinite(lse[:, ~rows]).all()
    for name, t in (("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), name


@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.float16]))
@pytest.mark.parametrize(
    "packed",
    [
        pytest.param(Packed((), (), 8, hq=2, hkv=1), id="no-sequences"),
        pytest.param(Packed((0, 0, 0), (0, 0, 0), 8, dv=4, hq=2, hkv=2), id="all-empty"),
        pytest.param(Packed((0, 0), (3, 4), 8, dv=4, hq=2, hkv=2), id="no-queries"),
    ],
)
def test_no_query_rows_give_empty_results(packed, dtype):
    inputs, grad_out = _fresh(packed, dtype)
    out, (dq, dk, dv), lse = _run(packed, inputs, grad_out)
    assert out.shape == packed.out_shape and lse.shape == (packed.hq, 0)
    assert dq.shape == packed.q_shape and dk.shape == packed.k_shape and dv.shape == packed.v_shape
    # Keys no query sees get zero gradient.
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize(
    "packed",
    [
        pytest.param(Packed((20, 30, 25), (20, 60, 25), 16, hq=4, hkv=2), id="decode-rows"),
        pytest.param(Packed((200, 90, 140), (200, 150, 140), 16, hq=2, hkv=1), id="blocks"),
    ],
)
def test_a_sequence_never_sees_another(packed, dtype):
    """NaN and inf in the keys and values of the middle sequence stay in it: the other
    sequences' results, gradients included, are bitwise unchanged."""
    inputs, grad_out = _fresh(packed, dtype)
    clean = _run(packed, inputs, grad_out)
    start, stop = packed.lengths_k[0], packed.lengths_k[0] + packed.lengths_k[1]
    poisoned = [t.detach().clone() for t in inputs]
    poisoned[1][start:stop, :, 0::2] = math.nan
    poisoned[2][start:stop, :, 1::2] = math.inf
    dirty = _run(packed, [t.requires_grad_(True) for t in poisoned], grad_out)
    rows_q = torch.ones(packed.total_q, dtype=torch.bool)
    rows_q[packed.lengths_q[0] : packed.lengths_q[0] + packed.lengths_q[1]] = False
    rows_k = torch.ones(packed.total_k, dtype=torch.bool)
    rows_k[start:stop] = False
    (out, grads, lse), (out2, grads2, lse2) = clean, dirty
    assert torch.equal(out[rows_q], out2[rows_q]) and torch.equal(lse[:, rows_q], lse2[:, rows_q])
    for name, a, b, rows in zip(RESULT_NAMES[1:], grads, grads2, (rows_q, rows_k, rows_k)):
        assert torch.equal(a[rows], b[rows]), name
    assert out2[~rows_q].isnan().any()  # the poison did reach its own sequence


@pytest.mark.parametrize("dtype", dtype_params([torch.float64, torch.bfloat16]))
@pytest.mark.parametrize(
    "packed",
    [
        pytest.param(Packed((16, 1, 8), (600, 700, 2000), 32, hq=4, hkv=2), id="decode"),
        pytest.param(Packed((3, 40, 65), (3, 40, 65), 32, dv=12, hq=4, hkv=2), id="mixed"),
    ],
)
def test_looser_max_seqlen_changes_nothing(packed, dtype):
    """max_seqlen_q and max_seqlen_k are upper bounds: larger ones (past the decode path's 32
    rows) give bitwise the same results."""
    inputs, grad_out = _fresh(packed, dtype)
    tight = _run(packed, inputs, grad_out)
    loose = _run(packed, inputs, grad_out, max_extra=40)
    for name, a, b in zip(RESULT_NAMES, (tight[0],) + tight[1], (loose[0],) + loose[1]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16]))
def test_strided_packed_tensors_and_lengths(dtype):
    """q, k, v sliced out of one fused projection (total, 3, H, D) and cumulative lengths with
    stride 2 give bitwise what contiguous copies give."""
    packed = Packed((5, 33, 70), (5, 33, 70), 16, hq=2, hkv=2)
    fused = make_tensor((packed.total_q, 3, packed.hq, packed.d), dtype)
    q, k, v = fused.unbind(1)
    cu_q, cu_k, max_q, max_k = packed.lengths_args()
    cu_strided = torch.stack([cu_q, torch.zeros_like(cu_q)], dim=-1).flatten()[0::2]
    assert not q.is_contiguous() and not cu_strided.is_contiguous()
    strided = causal_attention.varlen_attention(q, k, v, cu_strided, cu_strided, max_q, max_k)
    dense = causal_attention.varlen_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k
    )
    assert torch.equal(strided, dense)


@pytest.mark.parametrize("dtype", dtype_params())
def test_is_key_mask_attention_on_the_left_padded_batch(dtype):
    """Left padding keeps bottom-right causality aligned in every sequence, so the packed call is
    attention(key_mask=) on the left-padded batch with the padding keys hidden (its padding rows
    discarded), within round-off."""
    packed = Packed((40, 7, 100, 1), (70, 7, 100, 30), 16, dv=8, hq=4, hkv=2)
    inputs, grad_out = _fresh(packed, dtype)
    out, grads, _ = _run(packed, inputs, grad_out)

    def left_pad(t, keys):
        right = packed.pad(t, keys)
        lengths = packed.lengths_k if keys else packed.lengths_q
        return torch.stack([r.roll(right.shape[2] - n, dims=1) for r, n in zip(right, lengths)])

    def unpad_left(t, keys):
        lengths = packed.lengths_k if keys else packed.lengths_q
        rolled = torch.stack([r.roll(n - t.shape[2], dims=1) for r, n in zip(t, lengths)])
        return packed.unpad(rolled, keys)

    batch = [
        left_pad(t.detach(), keys).requires_grad_(True)
        for t, keys in zip(inputs, (False, True, True))
    ]
    key_mask = left_pad(torch.ones(packed.total_k, 1, 1, dtype=torch.bool), True)[:, 0, :, 0]
    batch_grad = left_pad(grad_out, False)
    dense = causal_attention.attention(*batch, key_mask=key_mask)
    dense_grads = torch.autograd.grad(dense, batch, batch_grad)
    dense_results = [unpad_left(dense.detach(), False)] + [
        unpad_left(g, keys) for g, keys in zip(dense_grads, (False, True, True))
    ]
    lq, lk = packed.max_seqlen_q, packed.max_seqlen_k
    scale = default_scale(packed.d)
    ref = float64_reference(*batch, scale, batch_grad, key_mask=key_mask)
    peaks = abs_magnitudes(*batch, scale, ref.probs, batch_grad)
    sum_length = lq + lk + packed.d + packed.value_dim
    # Both are within the round-off bound of the exact result.
    tolerance = 2 * roundoff_tolerance(dtype, packed.d, sum_length, logit_l1(*batch[:2], scale))
    for name, ours, theirs in zip(RESULT_NAMES, (out,) + grads, dense_results):
        assert_close_to_reference(name, ours, theirs, peaks[name], tolerance)


# --- random lengths ------------------------------------------------------------------------

_SCALE = float(os.environ.get("CAUSAL_ATTENTION_FUZZ_SCALE", "1"))
EXAMPLES = max(1, int(40 * _SCALE))


@st.composite
def packed_calls(draw):
    """(Packed, dtype, seed): 0-5 sequences of 0-80 query rows each, with as many keys, a cache
    of up to 100 more, or fewer (rows without keys)."""
    lengths_q, lengths_k = [], []
    for _ in range(draw(st.integers(0, 5))):
        lq = draw(st.one_of(st.integers(0, 3), st.integers(0, 80)))
        relation = draw(st.sampled_from(["same", "cache", "fewer"]))
        if relation == "same":
            lk = lq
        elif relation == "cache":
            lk = lq + draw(st.integers(1, 100))
        else:
            lk = draw(st.integers(0, max(lq - 1, 0)))
        lengths_q.append(lq)
        lengths_k.append(lk)
    hkv = draw(st.sampled_from([1, 2]))
    packed = Packed(
        tuple(lengths_q),
        tuple(lengths_k),
        draw(st.sampled_from([1, 8, 17, 64])),
        dv=draw(st.sampled_from([None, 5, 32])),
        hq=hkv * draw(st.sampled_from([1, 3])),
        hkv=hkv,
    )
    return packed, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**16))


@settings(max_examples=EXAMPLES, **REPRODUCIBLE_EXAMPLES)
@given(call=packed_calls())
def test_random_lengths_match_sequences_alone(call):
    packed, dtype, seed = call
    torch.manual_seed(seed)
    assert_matches_sequences_alone(packed, dtype, *_fresh(packed, dtype))
