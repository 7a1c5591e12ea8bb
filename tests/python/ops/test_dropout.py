"""Dropout on the attention probabilities (the score option dropout_p): the keep rate is 1 - p
within 4 sigma over many p, and the masks of other heads, batch elements, rows and keys are
independent; kept probabilities are rescaled by 1 / (1 - p); the same seed gives the same bits
and another seed (or offset) other bits; the public ops draw the seed from the generator exactly
as documented; attention is attention_weights' dropped probabilities times v; the backward drops
what the forward dropped (gradients against the float64 reference rebuilt from
attention_weights' keep mask, in every dtype, with the other options); packed sequences drop as
the padded batch does."""

import pytest
import torch

import causal_attention
from attention_testing.inputs import Case, ScoreOptions, default_scale, make_tensor
from attention_testing.packed import Packed
from attention_testing.parameters import dtype_params
from attention_testing.references import expand_kv_heads, float64_reference, to64
from attention_testing.results import (
    RESULT_NAMES,
    assert_bitwise_equal,
    assert_matches_float64_reference,
    forward_and_grads,
)
from attention_testing.tolerances import (
    abs_magnitudes,
    assert_close_to_reference,
    dsinks_tolerance,
    logit_l1,
    roundoff_tolerance,
)
from causal_attention._masks import visible_keys

# Many small calls: on one thread, as test_fuzz.py does.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def seed_tensor(seed: int, offset: int = 0) -> torch.Tensor:
    """The (seed, offset) int64 CPU tensor that the kernel ops take as dropout_seed."""
    return torch.tensor([seed, offset], dtype=torch.int64)


def dropped_weights(inputs, p: float, seed: int, **kwargs) -> torch.Tensor:
    return causal_attention.attention_weights(
        *inputs, dropout_p=p, generator=generator(seed), **kwargs
    )


# --- the keep mask -----------------------------------------------------------------------------

# 2 batch elements x 4 query heads (2 per KV head) x 256 rows, causal: 263,168 visible pairs.
STATS_CASE = Case(256, 256, 8, hq=4, hkv=2, batch=(2,))


@pytest.mark.parametrize("p", [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99])
def test_keep_rate_is_one_minus_p_within_four_sigma(p):
    """Over the visible pairs, and in each (batch, head) alone; the kept weights are the
    undropped ones divided by 1 - p, the rest exactly zero."""
    inputs = STATS_CASE.inputs(torch.float32)
    undropped = causal_attention.attention_weights(*inputs)
    weights = dropped_weights(inputs, p, seed=1234)
    visible = undropped > 0
    assert visible.sum().item() == 2 * 4 * 256 * 257 // 2  # no probability underflowed
    assert torch.equal(weights[~visible], torch.zeros_like(weights[~visible]))
    kept = (weights != 0) & visible
    per_head_kept = kept.sum((-2, -1)).double()
    per_head_visible = visible.sum((-2, -1)).double()
    for count, total, label in (
        (per_head_kept.sum(), per_head_visible.sum(), "all"),
        (per_head_kept, per_head_visible, "per head"),
    ):
        sigma = (total * p * (1 - p)).sqrt()
        deviation = (count - total * (1 - p)).abs() / sigma
        assert (deviation <= 4).all(), f"{label}: keep counts {count} of {total}, {deviation} sigma"
    rescaled = undropped[kept].double() / (1 - p)
    error = (weights[kept].double() - rescaled).abs() / rescaled
    assert error.max().item() <= 8 * 2.0**-24


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).double().mean().item()


def test_masks_of_heads_batch_elements_rows_and_keys_are_independent():
    """At p = 1/2 two independent masks agree on half their pairs (within 4 sigma); a hash that
    ignored the head (query heads of one KV head included), the batch element, or mixed row and
    key into i - j or i + j would agree on all of them."""
    inputs = STATS_CASE.inputs(torch.float32)
    keep = dropped_weights(inputs, 0.5, seed=99) != 0
    causal = visible_keys(256, 256)
    pairs = {
        "query heads of one KV head": (keep[:, 0], keep[:, 1], causal),
        "KV heads": (keep[:, 0], keep[:, 2], causal),
        "batch elements": (keep[0], keep[1], causal),
        # (i + 1, j + 1) against (i, j): both visible where (i, j) is, j <= i.
        "diagonals": (keep[..., 1:, 1:], keep[..., :-1, :-1], causal[:-1, :-1]),
        # (i + 1, j) against (i, j + 1): both visible where (i, j + 1) is, j < i.
        "anti-diagonals": (keep[..., 1:, :-1], keep[..., :-1, 1:], causal[:-1, 1:]),
    }
    for label, (a, b, visible) in pairs.items():
        a, b = a[..., visible], b[..., visible]
        agreement = (a == b).double().mean().item()
        assert abs(agreement - 0.5) <= 4 * 0.5 / a.numel() ** 0.5, f"{label}: {agreement:.4f}"


def test_same_seed_same_bits_other_seed_or_offset_other_bits():
    """Through attention_forward / attention_backward's dropout_seed, and through attention's
    generator (gradients included)."""
    case = Case(70, 90, 16, hq=4, hkv=2, batch=(2,))
    inputs = case.inputs(torch.float32)
    grad_out = make_tensor(case.out_shape, torch.float32)
    scale = default_scale(case.d)

    def forward(seed, offset=0):
        return causal_attention.attention_forward(
            *inputs, scale, dropout_p=0.3, dropout_seed=seed_tensor(seed, offset)
        )

    out, lse = forward(7)
    again, again_lse = forward(7)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)
    for other in (forward(8), forward(7, offset=1)):
        assert not torch.equal(other[0], out)
        # The undropped row sums are the same whatever is dropped.
        assert torch.equal(other[1], lse)
    backward = [
        causal_attention.attention_backward(
            grad_out, *inputs, out, lse, scale, dropout_p=0.3, dropout_seed=seed_tensor(7)
        )
        for _ in range(2)
    ]
    for a, b in zip(*backward):
        assert torch.equal(a, b)

    def attention(seed):
        return forward_and_grads(
            causal_attention.attention, inputs, grad_out, dropout_p=0.3, generator=generator(seed)
        )

    first, second, other = attention(5), attention(5), attention(6)
    assert_bitwise_equal(first, second)
    for name, a, b in zip(RESULT_NAMES, first, other):
        assert not torch.equal(a, b), name


def test_the_public_ops_draw_the_seed_from_the_generator_as_documented():
    """attention(..., generator=g) is attention_forward with dropout_seed =
    torch.empty(2, dtype=torch.int64).random_(generator=g'), g' in g's state, and leaves g in
    g''s state after that draw; without a generator the default one; without dropout none."""
    case = Case(40, 40, 8, hq=2, hkv=2)
    inputs = case.inputs(torch.float32)
    scale = default_scale(case.d)
    g, mirror = generator(11), generator(11)
    out = causal_attention.attention(*inputs, dropout_p=0.4, generator=g)
    seed = torch.empty(2, dtype=torch.int64).random_(generator=mirror)
    expected, _ = causal_attention.attention_forward(
        *inputs, scale, dropout_p=0.4, dropout_seed=seed
    )
    assert torch.equal(out, expected)
    assert torch.equal(g.get_state(), mirror.get_state())
    weights = causal_attention.attention_weights(*inputs, dropout_p=0.4, generator=generator(11))
    assert torch.equal(weights != 0, dropped_weights(inputs, 0.4, 11) != 0)

    torch.manual_seed(3)
    out = causal_attention.attention(*inputs, dropout_p=0.4)
    torch.manual_seed(3)
    seed = torch.empty(2, dtype=torch.int64).random_()
    expected, _ = causal_attention.attention_forward(
        *inputs, scale, dropout_p=0.4, dropout_seed=seed
    )
    assert torch.equal(out, expected)

    g = generator(12)
    state = g.get_state()
    out = causal_attention.attention(*inputs, dropout_p=0.0, generator=g)
    assert torch.equal(g.get_state(), state), "dropout_p=0 drew from the generator"
    assert torch.equal(out, causal_attention.attention(*inputs))


# --- what is dropped -----------------------------------------------------------------------------

DROPOUT_CASES = [
    pytest.param(Case(33, 50, 16, dv=8, hq=4, hkv=2, batch=(2,)), ScoreOptions(), id="gqa2-Dv8"),
    pytest.param(
        Case(70, 130, 16, hq=2, hkv=1, layout="transposed"),
        ScoreOptions(window=(40, 3), softcap=2.0, alibi="heads", sinks="q"),
        id="Lq70-Lk130-all-options",
    ),
    pytest.param(
        Case(100, 40, 8, hq=2, hkv=2, batch=(2,), layout="strided"),
        ScoreOptions(sinks="float32", key_mask="left-pad", alibi="batch"),
        id="Lq100-Lk40-strided-sinks-key-mask",
    ),
    pytest.param(Case(9, 600, 32, hq=4, hkv=1), ScoreOptions(window=(200, 0)), id="decode"),
    pytest.param(Case(20, 20, 8, heads=False), ScoreOptions(sinks="q"), id="2d"),
    pytest.param(Case(130, 130, 32, hq=8, hkv=8), ScoreOptions(window=(-1, -1)), id="one-pass"),
]


@pytest.mark.parametrize("dtype", dtype_params([torch.float64, torch.float32, torch.bfloat16]))
@pytest.mark.parametrize("p", [0.1, 0.6])
@pytest.mark.parametrize("case,options", DROPOUT_CASES[:3])
def test_attention_is_the_dropped_weights_times_v(case, options, p, dtype):
    kwargs = options.for_case(case, dtype)
    q, k, v = case.inputs(dtype)
    out = causal_attention.attention(q, k, v, dropout_p=p, generator=generator(21), **kwargs)
    weights = dropped_weights((q, k, v), p, 21, **kwargs)
    heads = case.hq if case.heads else 1
    expected = to64(weights) @ expand_kv_heads(to64(v), heads)
    scale = default_scale(case.d)
    ref = float64_reference(q, k, v, scale, **kwargs)
    peak = abs_magnitudes(q, k, v, scale, to64(weights))["out"]
    l1 = logit_l1(q, k, scale, ref.logit_shift)
    # Both within the round-off bound of the exact product of the dropped weights and v.
    tolerance = 2 * roundoff_tolerance(dtype, case.d, case.lq + case.lk + case.d, l1)
    assert_close_to_reference("out", out, expected, peak, tolerance)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case,options", DROPOUT_CASES)
def test_backward_drops_what_the_forward_dropped(case, options, dtype):
    """Out and the gradients (the sinks' too) against the float64 reference that keeps exactly
    what attention_weights (with the generator in the same state) kept: where its dropped
    weights are nonzero (the undropped probabilities, here far from underflow, are not)."""
    p = 0.3
    kwargs = options.for_case(case, dtype)
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    keep = dropped_weights(inputs, p, 31, **kwargs) != 0

    def attention(*args, **kw):
        return causal_attention.attention(*args, dropout_p=p, generator=generator(31), **kw)

    results = forward_and_grads(attention, inputs, grad_out, **kwargs)
    ref = assert_matches_float64_reference(
        case, dtype, inputs, grad_out, results, default_scale(case.d), kwargs, p, keep
    )
    dropped = ~keep & (ref.undropped > 0)
    assert dropped.any() and (keep & (ref.undropped > 0)).any()


@pytest.mark.parametrize("dtype", dtype_params([torch.float64, torch.bfloat16]))
def test_the_kernel_backward_takes_the_forwards_seed(dtype):
    """attention_backward with the forward's dropout_seed gives the reference's gradients of the
    forward's mask; with another seed, other gradients."""
    case = Case(40, 60, 16, hq=4, hkv=2, batch=(2,))
    kwargs = ScoreOptions(window=(20, 2), sinks="q").for_case(case, dtype)
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    scale = default_scale(case.d)
    seed = seed_tensor(2024, 5)
    out, lse = causal_attention.attention_forward(
        *inputs, scale, dropout_p=0.5, dropout_seed=seed, **kwargs
    )
    grads = causal_attention.attention_backward(
        grad_out, *inputs, out, lse, scale, dropout_p=0.5, dropout_seed=seed, **kwargs
    )
    # attention_weights takes a generator, not a seed: the forward's own mask is read off
    # attention_forward with V the identity, whose output is then the dropped weights.
    eye = torch.eye(case.lk, dtype=dtype).expand(case.batch + (case.hkv, case.lk, case.lk))
    probe, _ = causal_attention.attention_forward(
        inputs[0], inputs[1], eye, scale, dropout_p=0.5, dropout_seed=seed, **kwargs
    )
    keep = probe != 0
    results = (out.detach(),) + tuple(grads)
    assert_matches_float64_reference(
        case, dtype, inputs, grad_out, results, scale, kwargs, 0.5, keep
    )
    other = causal_attention.attention_backward(
        grad_out, *inputs, out, lse, scale, dropout_p=0.5, dropout_seed=seed_tensor(2025, 5),
        **kwargs
    )
    assert not torch.equal(other[0], grads[0])


# --- packed sequences ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtype_params([torch.float64, torch.float32, torch.bfloat16]))
def test_packed_sequences_drop_as_the_padded_batch(dtype):
    """The mask is keyed by (sequence, head, row, key) with positions within the sequence, so
    sequence n of a packed call drops what batch element n of the right-padded batch drops (Lq ==
    Lk per sequence: the same bottom-right alignment); out and gradients against the float64
    reference with those keep masks, sequence by sequence; varlen_attention_forward with the seed
    drawn from the generator is the same call."""
    packed = Packed((30, 5, 70), (30, 5, 70), 16, dv=8, hq=4, hkv=2)
    options = ScoreOptions(window=(20, 0), alibi="heads", sinks="q")
    kwargs = options.kwargs(dtype, packed.hq)
    inputs = packed.inputs(dtype)
    grad_out = make_tensor(packed.out_shape, dtype)
    lengths = packed.lengths_args()
    p = 0.4

    def varlen(*args, **kw):
        return causal_attention.varlen_attention(
            *args, *lengths, dropout_p=p, generator=generator(41), **kw
        )

    results = forward_and_grads(varlen, inputs, grad_out, **kwargs)
    padded = [packed.pad(t, keys) for t, keys in zip(inputs, (False, True, True))]
    key_mask = packed.pad(torch.ones(packed.total_k, 1, 1, dtype=torch.bool), True)[:, 0, :, 0]
    keep = dropped_weights(padded, p, 41, key_mask=key_mask, **kwargs) != 0

    parts = {
        "out": packed.split(results[0], keys=False),
        "dq": packed.split(results[1], keys=False),
        "dk": packed.split(results[2], keys=True),
        "dv": packed.split(results[3], keys=True),
    }
    q_parts, k_parts, v_parts = (
        packed.split(t, keys) for t, keys in zip(inputs, (False, True, True))
    )
    g_parts = packed.split(grad_out, keys=False)
    scale = default_scale(packed.d)
    # dsinks sums over every sequence: its reference, magnitude and tolerance too.
    dsinks, sinks_peak, sinks_tolerance = 0, 0.0, 0.0
    sinks_dtype = kwargs["sinks"].dtype
    for n, length in enumerate(packed.lengths_q):
        case = Case(length, length, packed.d, dv=packed.dv, hq=packed.hq, hkv=packed.hkv, batch=())
        part = (q_parts[n], k_parts[n], v_parts[n])
        own = (parts["out"][n], parts["dq"][n], parts["dk"][n], parts["dv"][n])
        part_keep = keep[n, :, :length, :length]
        ref = assert_matches_float64_reference(
            case, dtype, part, g_parts[n], own, scale, kwargs, p, part_keep
        )
        dsinks = dsinks + ref.dsinks
        sinks_peak += abs_magnitudes(
            *part, scale, ref.probs, g_parts[n], undropped=ref.undropped, sink_probs=ref.sink_probs
        )["dsinks"]
        l1 = logit_l1(*part[:2], scale, ref.logit_shift)
        sum_length = 2 * packed.max_seqlen_k + packed.d + packed.value_dim + packed.total_q
        tolerance = dsinks_tolerance(dtype, sinks_dtype, packed.d, sum_length, l1)
        sinks_tolerance = max(sinks_tolerance, tolerance)
    assert_close_to_reference("dsinks", results[4], dsinks, sinks_peak, sinks_tolerance)

    seed = torch.empty(2, dtype=torch.int64).random_(generator=generator(41))
    out, _ = causal_attention.varlen_attention_forward(
        *inputs, *lengths, scale, dropout_p=p, dropout_seed=seed, **kwargs
    )
    assert torch.equal(out, results[0])
