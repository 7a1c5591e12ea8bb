"""The decode's P V for float8 value rows beside bfloat16 query rows
(csrc/ops/cpu/kernels/float8_pair_values.h): where the decode takes AVX-512 BF16's pair dots
(csrc/ops/cpu/decode_products.h: AMD's chips with them by default, any chip with them under
CAUSAL_ATTENTION_PAIR_DOTS=on, which scripts/test.sh sets on Intel's) and every row of a task sees a
whole key block, each row's weights rounded to bfloat16 and two keys' products added by one
vdpbf16ps; elsewhere (other chips, builds and blocks seen in part) the float32 tiles.

Against float64 on the dequantized cache, the bound is what rounding the weights to bfloat16 and
the output to bfloat16 allow: 2^-8 (bfloat16's unit roundoff) of sum_j P_j |v_j| each, so 2^-7
of its largest over the rows (and a little for float32's sums). The float32 tiles meet it too, so these tests hold on
every chip; where the pair dots are not taken they test the float32 tiles.
"""

import pytest
import torch

from attention_testing.quantized import decode_one_page_each, one_page_each_reference

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def float8_rows(shape, fmt, generator):
    """Values spread over the format's range (magnitudes 2^-8 to 2^7, signs random), stored."""
    magnitude = torch.exp2(torch.rand(shape, generator=generator) * 15 - 8)
    sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
    return (sign * magnitude).to(fmt)


def bound(peak):
    """The two bfloat16 roundings' 2^-8 of sum_j P_j |v_j| each (one_page_each_reference's
    peak), and a hundredth for float32's sums."""
    return 2.0**-7 * peak * 1.01


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dim_v", [64, 128, 192, 96])
@pytest.mark.parametrize("group", [1, 3, 4, 6])
@pytest.mark.parametrize("window", [(-1, 0), (40, 0)])
def test_values_match_float64(fmt, dim_v, group, window):
    """Sequences of 150, 77 and 1 keys (blocks of 64: whole ones, and last ones of 22, 13 and
    1 keys, odd counts taking a zero row as their last pair's second), query heads in groups of
    1, 3, 4 or 6 (bands of 4 and 2 rows) a KV head; a window of 40 leaves a block its rows see in part (the float32 tiles),
    and value widths of whole 64s take the pair products (96: the float32 tiles)."""
    generator = torch.Generator().manual_seed(dim_v * group + (window[0] > 0))
    hkv, dim, lengths = 2, 64, [150, 77, 1]
    batch = len(lengths)
    q = torch.randn(batch, hkv * group, dim, generator=generator).to(torch.bfloat16)
    keys = float8_rows((batch, 150, hkv, dim), fmt, generator)
    values = float8_rows((batch, 150, hkv, dim_v), fmt, generator)
    k_scale = torch.rand(batch, 150, hkv, generator=generator) * 0.004 + 0.0001
    v_scale = torch.rand(batch, 150, hkv, generator=generator) * 0.02 + 0.001
    out = decode_one_page_each(q, keys, values, k_scale, v_scale, lengths, window=window)
    for b, (want, peak) in enumerate(
            one_page_each_reference(q, keys, values, k_scale, v_scale, lengths, window)):
        error = (out[b].double() - want).abs().max().item()
        assert error <= bound(peak), (b, error, bound(peak))


def test_an_infinite_value_in_an_odd_blocks_last_row_stays_infinite():
    """e5m2 holds infinities. A block of 65 keys (64 and 1) whose last value row holds +inf in
    one column: that column is +inf and every other finite. (Pairing the lone key with a copy of
    itself, weighted zero, would add 0 x inf = NaN.)"""
    generator = torch.Generator().manual_seed(7)
    hkv, group, dim, dim_v, length = 1, 4, 64, 64, 65
    q = torch.randn(1, hkv * group, dim, generator=generator).to(torch.bfloat16)
    keys = float8_rows((1, length, hkv, dim), torch.float8_e5m2, generator)
    values = float8_rows((1, length, hkv, dim_v), torch.float8_e5m2, generator)
    values[0, length - 1, 0, 5] = float("inf")
    scales = torch.full((1, length, hkv), 0.01)
    out = decode_one_page_each(q, keys, values, scales, scales, [length])
    assert torch.isposinf(out[0, :, 5]).all(), out[0, :, 5]
    others = torch.cat([out[0, :, :5], out[0, :, 6:]], dim=-1)
    assert torch.isfinite(others).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_bitwise_the_same_at_any_thread_count(fmt):
    """A decode of 8 sequences of 500 keys, 4 query rows a KV head, at 1 and 2 threads."""
    generator = torch.Generator().manual_seed(3)
    batch, hkv, group, dim, length = 8, 2, 4, 128, 500
    q = torch.randn(batch, hkv * group, dim, generator=generator).to(torch.bfloat16)
    keys = float8_rows((batch, length, hkv, dim), fmt, generator)
    values = float8_rows((batch, length, hkv, dim), fmt, generator)
    scales = torch.rand(batch, length, hkv, generator=generator) * 0.01 + 0.001
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(decode_one_page_each(q, keys, values, scales, scales, [length] * batch))
    torch.set_num_threads(1)
    assert torch.equal(outs[0], outs[1])
