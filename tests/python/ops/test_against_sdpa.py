"""Forward and gradients against torch.nn.functional.scaled_dot_product_attention.

For each of out, dq, dk, dv: ``max|ours - ref64| <= 2 * max|sdpa_same_dtype - ref64| + 1e-6``,
where ref64 is SDPA in float64 on the same (dtype-rounded) inputs and grad_out. So in every
dtype the op must be at most twice as far from the exact answer as PyTorch's own kernel
(attention_testing.tolerances.twice_sdpa_error_failures; test_key_mask.py and test_varlen.py
hold the key mask and packed sequences to the same rule).
"""

import pytest
import torch

import causal_attention
from attention_testing.inputs import Case, make_tensor
from attention_testing.parameters import dtype_params
from attention_testing.references import empty_rows, sdpa_reference, to64
from attention_testing.results import RESULT_NAMES, forward_and_grads
from attention_testing.tolerances import twice_sdpa_error_failures

# Together these cover every L in {1, 2, 17, 64, 129, 1000}, D in {1, 8, 64, 80, 128},
# Hq/Hkv in {1, 2, 4}, batch * Hkv >= 8 (the one-pass backward), Dv != D, Lq < Lk, Lq > Lk,
# 2-D/3-D/4-D/5-D inputs and the transposed-view and sliced/strided layouts; each case runs in
# every dtype.
CASES = [
    pytest.param(Case(1, 1, 8, hq=2, hkv=2), id="L1-D8-H2"),
    pytest.param(Case(2, 2, 1, batch=(2,)), id="L2-D1-B2"),
    pytest.param(Case(17, 17, 80, dv=32, hq=4, hkv=2), id="L17-D80-Dv32-gqa2"),
    pytest.param(
        Case(64, 64, 64, hq=4, hkv=1, batch=(2,), layout="transposed"),
        id="L64-D64-gqa4-transposed",
    ),
    pytest.param(Case(129, 129, 128, hq=2, hkv=2, layout="strided"), id="L129-D128-strided"),
    pytest.param(Case(1000, 1000, 64, hq=2, hkv=1), id="L1000-D64-gqa2"),
    # Lq >= 1024: forward tasks take tiles of several query blocks (the last one partial); with
    # few tiles and Lk > 1024 the keys are split too.
    pytest.param(Case(1100, 1100, 16, hq=2, hkv=1), id="L1100-D16-gqa2-tiles"),
    pytest.param(
        Case(1030, 1600, 32, hq=2, hkv=2, layout="transposed"),
        id="Lq1030-Lk1600-D32-tiles-split-transposed",
    ),
    pytest.param(Case(129, 129, 8, heads=False), id="2d-L129-D8"),
    pytest.param(Case(17, 64, 64, heads=False, layout="strided"), id="2d-Lq17-Lk64-D64-strided"),
    pytest.param(Case(17, 17, 8, hq=3, hkv=3, batch=()), id="3d-H3-L17-D8"),
    pytest.param(Case(64, 64, 8, dv=16, hq=2, hkv=1, batch=(2, 3)), id="5d-L64-D8-Dv16-gqa2"),
    pytest.param(Case(1, 129, 64, hq=4, hkv=1), id="kvcache-Lq1-Lk129-D64-gqa4"),
    pytest.param(
        Case(17, 1000, 80, hq=2, hkv=2, layout="transposed"),
        id="kvcache-Lq17-Lk1000-D80-transposed",
    ),
    pytest.param(Case(129, 64, 8, hq=2, hkv=1), id="Lq129-Lk64-D8-gqa2"),
    pytest.param(Case(1000, 17, 128, dv=8), id="Lq1000-Lk17-D128-Dv8"),
    pytest.param(Case(2, 1, 1), id="Lq2-Lk1-D1"),
    # At least 8 (batch, KV head) pairs: the one-pass backward (float32/float64).
    pytest.param(Case(130, 130, 64, hq=8, hkv=8), id="L130-D64-H8-one-pass"),
    pytest.param(
        Case(100, 160, 32, dv=48, hq=16, hkv=8, layout="transposed"),
        id="Lq100-Lk160-D32-Dv48-gqa2-H16-one-pass-transposed",
    ),
    pytest.param(Case(150, 100, 16, hq=8, hkv=4, batch=(2,)), id="Lq150-Lk100-B2-gqa2-one-pass"),
    # Decoding (Lq <= 32: one task per KV head and key split). Fewer rows than a vector holds
    # take the dot-product scores, more the transposed ones, and at least 16 bfloat16/float16
    # rows the block products where the CPU's are native (decode.h); odd D and Dv exercise the
    # tails, Lk > 1024 with few KV heads the key splits and their merge.
    pytest.param(Case(16, 2100, 64, hq=4, hkv=2), id="decode-Lq16-Lk2100-D64-gqa2-split"),
    pytest.param(
        Case(3, 1500, 17, dv=24, hq=2, hkv=1, layout="strided"),
        id="decode-Lq3-Lk1500-D17-Dv24-gqa2-strided",
    ),
    pytest.param(Case(9, 300, 64, dv=72), id="decode-Lq9-Lk300-D64-Dv72"),
    pytest.param(Case(32, 32, 8, hq=3, hkv=1, batch=(2,)), id="decode-L32-D8-gqa3"),
    # A group of 40 query heads x 16 rows is cut into tasks of 256, 256 and 128 rows.
    pytest.param(Case(16, 700, 32, hq=40, hkv=1), id="decode-Lq16-Lk700-D32-mqa40-row-chunks"),
    pytest.param(
        Case(64, 2, 64, hq=2, hkv=2, batch=(), layout="transposed"),
        id="3d-Lq64-Lk2-D64-transposed",
    ),
    # batch * Hkv >= 8: the one-pass backward in float32 and float64 (the two passes otherwise).
    pytest.param(Case(150, 150, 64, hq=8, hkv=8, layout="transposed"), id="L150-D64-H8-one-pass"),
    pytest.param(
        Case(200, 333, 32, dv=16, hq=16, hkv=4, batch=(2,), layout="strided"),
        id="kvcache-Lq200-Lk333-D32-Dv16-gqa4-B2-one-pass-strided",
    ),
]

EMPTY_ROW_CASES = [p for p in CASES if p.values[0].lq > p.values[0].lk]


def _ours_with_grads(case: Case, dtype: torch.dtype):
    """Runs our op forward and backward; returns inputs, grad_out, out and (dq, dk, dv)."""
    inputs = case.inputs(dtype)
    grad_out = make_tensor(case.out_shape, dtype)
    out, *grads = forward_and_grads(causal_attention.attention, inputs, grad_out)
    return inputs, grad_out, out, tuple(grads)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case", CASES)
def test_matches_sdpa_within_twice_its_error(case, dtype):
    inputs, grad_out, out, grads = _ours_with_grads(case, dtype)
    ref_out, ref_grads = sdpa_reference(*(to64(t) for t in inputs), to64(grad_out))
    same_out, same_grads = sdpa_reference(*inputs, grad_out)

    names = RESULT_NAMES
    for name, ours, input_ in zip(names, (out,) + tuple(grads), (None,) + tuple(inputs)):
        expected_shape = case.out_shape if input_ is None else input_.shape
        assert ours.shape == expected_shape, f"{name}: shape {tuple(ours.shape)}"
        assert ours.dtype == dtype, f"{name}: dtype {ours.dtype}"
    failures = twice_sdpa_error_failures(
        names, (out,) + tuple(grads), (same_out,) + tuple(same_grads), (ref_out,) + tuple(ref_grads)
    )
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case", EMPTY_ROW_CASES)
def test_rows_without_keys_are_exact_zeros(case, dtype):
    _, _, out, (dq, _, _) = _ours_with_grads(case, dtype)
    rows = empty_rows(case.lq, case.lk)
    assert rows.any()
    assert torch.equal(out[..., rows, :], torch.zeros_like(out[..., rows, :]))
    assert torch.equal(dq[..., rows, :], torch.zeros_like(dq[..., rows, :]))
    # The rows that do see keys are not all zero (the mask is not shifted by one).
    assert out[..., ~rows, :].abs().amax(dim=-1).gt(0).all()
