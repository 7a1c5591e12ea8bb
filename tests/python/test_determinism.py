"""Bitwise reproducibility across thread counts and repeated calls, and proof that two threads
really share the work."""

import os

import pytest
import torch

import causal_attention
from attention_testing import Case, dtype_params, make_tensor

# Many query/key blocks (64 rows each) per head, or many key splits, so the work is split into
# many tasks.
CASES = [
    pytest.param(Case(700, 700, 64, hq=2, hkv=2), id="H2-L700-D64"),
    pytest.param(Case(500, 700, 64, dv=32, hq=4, hkv=1), id="gqa4-Lq500-Lk700-Dv32"),
    # Decoding: one task per KV head and 1024-key split, merged in split order.
    pytest.param(Case(16, 3000, 64, hq=4, hkv=2), id="decode-gqa2-Lq16-Lk3000"),
]


def _forward_backward(inputs, grad_out, threads):
    torch.set_num_threads(threads)
    out = causal_attention.attention(*inputs)
    return (out,) + torch.autograd.grad(out, inputs, grad_out)


def _assert_bitwise_equal(a, b):
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), name


def _inputs(case, dtype):
    return case.inputs(dtype, requires_grad=True), make_tensor(case.out_shape, dtype)


@pytest.mark.parametrize("dtype", dtype_params((torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("case", CASES)
def test_bitwise_equal_for_one_and_two_threads(case, dtype, restore_num_threads):
    inputs, grad_out = _inputs(case, dtype)
    one = _forward_backward(inputs, grad_out, threads=1)
    two = _forward_backward(inputs, grad_out, threads=2)
    _assert_bitwise_equal(one, two)


@pytest.mark.parametrize("dtype", dtype_params((torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("case", CASES)
def test_bitwise_equal_across_repeated_calls(case, dtype, restore_num_threads):
    inputs, grad_out = _inputs(case, dtype)
    first = _forward_backward(inputs, grad_out, threads=2)
    for _ in range(2):
        _assert_bitwise_equal(first, _forward_backward(inputs, grad_out, threads=2))


def _cpu_ticks_per_thread():
    """{thread id: utime + stime in clock ticks} for this process's threads."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread exited meanwhile
            continue
        # Fields after "pid (comm)" start at field 3 (state); utime, stime are fields 14, 15.
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_two_threads_share_the_work(restore_num_threads):
    torch.set_num_threads(2)
    case = Case(2048, 2048, 64, hq=8, hkv=8)
    inputs, grad_out = _inputs(case, torch.float32)
    before = _cpu_ticks_per_thread()
    _forward_backward(inputs, grad_out, threads=2)
    after = _cpu_ticks_per_thread()
    gains = sorted((after[t] - before.get(t, 0) for t in after), reverse=True)
    busiest = gains[0]
    assert busiest >= 10, f"workload too small to measure: {gains} ticks"
    sharing = [g for g in gains if g >= 0.25 * busiest]
    assert len(sharing) >= 2, f"CPU ticks gained per thread: {gains}"
