"""The decode's integer products (csrc/ops/cpu/kernels/integer_products.h) of an int8 cache's
rows beside bfloat16 and float16 query rows.

Scores: each query row held as int16 times a power of two, its products with the int8 keys
summed exactly in int32. Read through the log-sum-exp paged_attention returns: with one visible key it is the score
itself (times the softmax scale), with several the log of the sum of their exponentials, in
float32 either way, where the output is only as exact as q's dtype. So these tests see the
scores to float32's precision:
- every element within 7 binades of its row's largest (4 in float16) is held exactly, and the
  score is q . k x scales up to float32's rounding;
- farther elements are rounded to units of 2^-15 of the power of two above the row's largest,
  the score is that of the query so held (and not of the query itself);
- a row holding inf or NaN is scored in float32 instead, NaN as q . k gives.

Values: each row's weights of a key block (P times V's scales) held as int16 in units of 2^-15
of the power of two above the block's largest, their products with the int8 value rows summed
exactly; blocks a row sees only in part keep the float32 tiles. Against float64 on the
dequantized cache within q's dtype's error, for every value width of whole 32s, odd key counts
(the products take keys in pairs), groups of 1-4 rows and windows; and a weight below half a
unit of its block's largest adds nothing.

All of it in every kernel build (AVX-512 with VNNI, AVX2, the scalar baseline).
"""

import textwrap
from pathlib import Path

import pytest
import torch

import causal_attention
from attention_testing.kernel_builds import EVERY_BUILD, run_in_build
from attention_testing.quantized import decode_one_page_each, one_page_each_reference

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

PACKAGE_PARENT = Path(causal_attention.__file__).resolve().parents[1]
HQ, HKV = 8, 2  # groups of four query heads: the tiles of four rows
# The binades below its row's largest over which a query element is held exactly.
EXACT_BINADES = {torch.bfloat16: 7, torch.float16: 4}


def query_rows(count, dim, dtype, binades, generator):
    """count x HQ rows of `dim` elements of dtype, each element's magnitude within `binades`
    binades below 1 (its row's largest: 1 or just under), signs random, some exactly 0."""
    exponent = -torch.rand(count, HQ, dim, generator=generator, dtype=torch.float64) * binades
    sign = torch.randint(0, 2, (count, HQ, dim), generator=generator) * 2 - 1
    rows = (sign * torch.exp2(exponent)).to(dtype)
    rows[..., 0] = 1.0
    rows[..., 1] = 0.0
    return rows


def decode_lse(q, keys, values, k_scale, lengths, v_scale=None, **options):
    """out (B, Hq, Dv) and lse (Hq, B) of one query row a sequence against `lengths` of its
    int8 keys; V's scales 0.01 unless given."""
    v_scale = torch.full(k_scale.shape, 0.01) if v_scale is None else v_scale
    return decode_one_page_each(q, keys, values, k_scale, v_scale, lengths, return_lse=True,
                                **options)


def exact_scores(q, keys, k_scale):
    """float64 (B, HQ, L) scores q . (k x scale) / sqrt(D) of every key, GQA's heads repeated."""
    dim = q.shape[-1]
    k = (keys.double() * k_scale.double()[..., None]).repeat_interleave(HQ // HKV, dim=2)
    return torch.einsum("bhd,blhd->bhl", q.double(), k) / dim**0.5


def int8_keys(batch, length, dim, generator):
    keys = torch.randint(-128, 128, (batch, length, HKV, dim), generator=generator,
                         dtype=torch.int8)
    scale = torch.rand(batch, length, HKV, generator=generator) * 0.02 + 0.001
    return keys, scale


def held_as_units(q):
    """q as the kernel holds it, in float64: each row in int16 units of 2^-15 of the power of two
    above its largest magnitude, rounded half to even."""
    rows = q.double()
    _, exponent = torch.frexp(rows.abs().amax(-1, keepdim=True))
    unit = torch.exp2((exponent - 15).clamp_min(-126).double())
    return torch.round(rows / unit).clamp(-32767, 32767) * unit


# A single key's score, its integer sum rounded once to float32 and times the scales: a few
# roundings of float32.
ROUNDINGS = 4 * 2.0**-24


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [32, 128, 512])
def test_one_key_score_is_exact_where_elements_lie_within_binades(dtype, dim):
    generator = torch.Generator().manual_seed(dim)
    batch = 12
    q = query_rows(batch, dim, dtype, EXACT_BINADES[dtype], generator)
    assert torch.equal(held_as_units(q), q.double())
    keys, k_scale = int8_keys(batch, 1, dim, generator)
    values = torch.randint(-128, 128, (batch, 1, HKV, 16), generator=generator, dtype=torch.int8)
    _, lse = decode_lse(q, keys, values, k_scale, [1] * batch)
    want = exact_scores(q, keys, k_scale)[..., 0].T  # (HQ, B)
    error = (lse.double() - want).abs()
    assert (error <= want.abs() * ROUNDINGS + 1e-30).all(), error.max()


@pytest.mark.parametrize("dim", [32, 128, 512])
def test_far_elements_are_rounded_to_units_of_two_to_the_minus_15(dim):
    """Elements down to 2^-40 of their row's largest: the score is that of the query held in
    units (off by at most half a unit an element), and not that of the query itself."""
    generator = torch.Generator().manual_seed(2)
    batch = 12
    q = query_rows(batch, dim, torch.bfloat16, 40, generator)
    keys, k_scale = int8_keys(batch, 1, dim, generator)
    values = torch.zeros(batch, 1, HKV, 16, dtype=torch.int8)
    _, lse = decode_lse(q, keys, values, k_scale, [1] * batch)
    held = exact_scores(held_as_units(q), keys, k_scale)[..., 0].T
    error = (lse.double() - held).abs()
    assert (error <= held.abs() * ROUNDINGS + 1e-30).all(), error.max()
    exact = exact_scores(q, keys, k_scale)[..., 0].T
    bound = exact_scores(torch.ones_like(q), keys.double().abs(), k_scale)[..., 0].T * 2.0**-16
    assert ((lse.double() - exact).abs() <= bound + exact.abs() * ROUNDINGS).all()
    assert ((lse.double() - exact).abs() > exact.abs() * 8 * ROUNDINGS).any()


def test_an_element_below_half_a_unit_adds_nothing():
    q = torch.zeros(1, HQ, 32, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    q[..., 1] = 2.0**-20  # a 32nd of a unit (2^-15)
    keys = torch.zeros(1, 1, HKV, 32, dtype=torch.int8)
    keys[..., 1] = 127
    _, lse = decode_lse(q, keys, torch.zeros(1, 1, HKV, 16, dtype=torch.int8),
                        torch.ones(1, 1, HKV), [1])
    assert torch.equal(lse, torch.zeros_like(lse))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [4, 37, 300])
def test_many_keys_log_sum_exp_matches_exact_scores(dtype, length):
    """Whole tiles of four keys, the tail's single keys and several key blocks: the log of the
    sum of the exponentials of the exact scores, to float32's precision."""
    generator = torch.Generator().manual_seed(length)
    batch, dim = 3, 64
    q = query_rows(batch, dim, dtype, EXACT_BINADES[dtype], generator)
    keys, k_scale = int8_keys(batch, length, dim, generator)
    values = torch.randint(-128, 128, (batch, length, HKV, 16), generator=generator,
                           dtype=torch.int8)
    lengths = [length, length - 1, max(1, length // 2)]
    _, lse = decode_lse(q, keys, values, k_scale, lengths)
    scores = exact_scores(q, keys, k_scale)
    for b, n in enumerate(lengths):
        want = torch.logsumexp(scores[b, :, :n], dim=-1)
        torch.testing.assert_close(lse[:, b].double(), want, rtol=2e-6, atol=2e-6)


def test_query_rows_with_inf_or_nan_are_scored_in_float():
    generator = torch.Generator().manual_seed(3)
    batch, length, dim = 2, 20, 64
    q = query_rows(batch, dim, torch.bfloat16, 7, generator)
    keys, k_scale = int8_keys(batch, length, dim, generator)
    values = torch.randint(-128, 128, (batch, length, HKV, 16), generator=generator,
                           dtype=torch.int8)
    q[0, 1, 5] = float("inf")
    q[1, 6, 9] = float("nan")
    out, lse = decode_lse(q, keys, values, k_scale, [length, length])
    assert out[0, 1].isnan().all() and out[1, 6].isnan().all()
    # the other rows, in the same tasks, scored in float32 instead: right to float32's precision
    scores = exact_scores(q, keys, k_scale)
    finite = torch.ones(batch, HQ, dtype=torch.bool)
    finite[0, 1] = finite[1, 6] = False
    want = torch.logsumexp(scores, dim=-1).T
    torch.testing.assert_close(lse.double()[finite.T], want[finite.T], rtol=2e-6, atol=2e-6)


def test_zero_query_row_weighs_every_key_alike():
    generator = torch.Generator().manual_seed(4)
    batch, length, dim = 1, 9, 32
    q = torch.zeros(batch, HQ, dim, dtype=torch.bfloat16)
    keys, k_scale = int8_keys(batch, length, dim, generator)
    values = torch.randint(-128, 128, (batch, length, HKV, 16), generator=generator,
                           dtype=torch.int8)
    out, lse = decode_lse(q, keys, values, k_scale, [length])
    assert torch.equal(lse, torch.full_like(lse, torch.log(torch.tensor(float(length))).item()))
    mean = (values.double() * 0.01).mean(1).repeat_interleave(HQ // HKV, dim=1)
    torch.testing.assert_close(out.double(), mean, rtol=1e-2, atol=1e-3)


# The error of out against float64, over its largest magnitude, as test_paged_attention_8bit's.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim_v", [32, 96, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [(-1, 0), (40, 0)])
def test_values_match_float64(dtype, dim_v, group, window):
    """Sequences of 150 and 77 keys (blocks of 64: whole ones, and last ones of 22 and 13 keys,
    an odd count), query heads in groups of 1, 3 or 4 a KV head; a window of 40 leaves a block
    its rows see in part."""
    generator = torch.Generator().manual_seed(dim_v * group)
    hkv, dim, lengths = 2, 64, [150, 77]
    q = torch.randn(2, hkv * group, dim, generator=generator).to(dtype)
    keys = torch.randint(-128, 128, (2, 150, hkv, dim), generator=generator, dtype=torch.int8)
    values = torch.randint(-128, 128, (2, 150, hkv, dim_v), generator=generator,
                           dtype=torch.int8)
    k_scale = torch.rand(2, 150, hkv, generator=generator) * 0.04 + 0.001
    v_scale = torch.rand(2, 150, hkv, generator=generator) * 0.02 + 0.001
    out, _ = decode_lse(q, keys, values, k_scale, lengths, v_scale=v_scale, window=window)
    for b, (want, _) in enumerate(
            one_page_each_reference(q, keys, values, k_scale, v_scale, lengths, window)):
        error = ((out[b].double() - want).abs().max() / want.abs().max()).item()
        assert error <= TOLERANCE[dtype], (b, error)


def test_a_weight_below_half_a_unit_adds_nothing():
    """Two keys, the second's probability 2^-24 of the first's (a 2^-10 of a unit): its value
    row, the only one not zero, adds nothing to the output."""
    hkv, dim = 2, 32
    q = torch.zeros(1, 2 * hkv, dim, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    keys = torch.zeros(1, 2, hkv, dim, dtype=torch.int8)
    keys[:, 1, :, 0] = -128
    # the second key's score 24 ln 2 below the first's
    k_scale = torch.tensor([[[1.0] * hkv, [24 * 0.6931471805599453 * dim**0.5 / 128] * hkv]])
    values = torch.zeros(1, 2, hkv, 32, dtype=torch.int8)
    values[:, 1] = 127
    out, lse = decode_lse(q, keys, values, k_scale, [2], v_scale=torch.ones(1, 2, hkv))
    assert torch.equal(out, torch.zeros_like(out))
    # where exact, 127 x 2^-24 / (1 + 2^-24): a bfloat16 far from zero
    assert torch.tensor(127 * 2.0**-24).bfloat16().item() > 7e-6


MARKER = "INTEGER_PRODUCTS_OK"
SCRIPT = textwrap.dedent(
    f"""
    import os, sys
    import torch
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
    assert torch.backends.cpu.get_cpu_capability() == os.environ["ATEN_CPU_CAPABILITY"].upper()
    import test_integer_products as t
    for dtype in (torch.bfloat16, torch.float16):
        for dim in (32, 128):
            t.test_one_key_score_is_exact_where_elements_lie_within_binades(dtype, dim)
        for length in (4, 37):
            t.test_many_keys_log_sum_exp_matches_exact_scores(dtype, length)
    t.test_far_elements_are_rounded_to_units_of_two_to_the_minus_15(128)
    t.test_an_element_below_half_a_unit_adds_nothing()
    t.test_query_rows_with_inf_or_nan_are_scored_in_float()
    for dtype in (torch.bfloat16, torch.float16):
        for dim_v in (32, 128):
            t.test_values_match_float64(dtype, dim_v, 4, (-1, 0))
        t.test_values_match_float64(dtype, 96, 3, (40, 0))
    t.test_a_weight_below_half_a_unit_adds_nothing()
    print("{MARKER}", os.environ["ATEN_CPU_CAPABILITY"])
    """
)


@pytest.mark.parametrize("capability", EVERY_BUILD)
def test_every_kernel_build_multiplies_alike(capability, monkeypatch):
    result = run_in_build(capability, SCRIPT, PACKAGE_PARENT, monkeypatch)
    assert f"{MARKER} {capability}" in result.stdout, result.stdout
