"""Concurrency: the op called from 16 Python threads at once, while another thread keeps changing
the intra-op thread count, and inside forked DataLoader workers. Every call must give bitwise the
result of the same call made serially, and nothing may hang (every wait has a timeout).
"""

import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import causal_attention
from attention_testing.parameters import DTYPES
from attention_testing.results import assert_bitwise_equal, forward_and_grads

THREADS = 16
CALLS_PER_THREAD = 50
JOIN_TIMEOUT_S = 120


def _inputs(seed: int):
    """Small inputs, different for every seed: shapes, GQA ratio and dtype vary with it."""
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[seed % len(DTYPES)]
    lq = 1 + seed % 37
    lk = lq + (seed // 7) % 11
    d, hkv = (8, 16)[seed % 2], 1 + (seed // 3) % 2
    shapes = ((2, 2 * hkv, lq, d), (2, hkv, lk, d), (2, hkv, lk, d), (2, 2 * hkv, lq, d))
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


def _forward_backward(q, k, v, grad_out):
    return forward_and_grads(causal_attention.attention, (q, k, v), grad_out)


def _assert_calls_bitwise_equal(results, expected, label):
    """Each call's results are bitwise those of the same call made serially."""
    assert len(results) == len(expected), label
    for i, (got, want) in enumerate(zip(results, expected)):
        assert_bitwise_equal(got, want, f"{label}: call {i}: ")


def _run_in_threads(work, count):
    """Runs work(i) for i < count, each in its own thread, all released at once. Returns the
    results in order; re-raises the first exception; fails if a thread does not finish."""
    barrier = threading.Barrier(count)
    results, errors = [None] * count, []

    def body(i):
        try:
            barrier.wait(timeout=JOIN_TIMEOUT_S)
            results[i] = work(i)
        except BaseException as e:  # noqa: B902 (reported in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


def _seeds(thread):
    return [thread * CALLS_PER_THREAD + call for call in range(CALLS_PER_THREAD)]


@pytest.fixture(scope="module")
def inputs_and_serial_results():
    """{seed: (inputs, results of a serial call)} for every call of every thread.

    The serial calls run on one intra-op thread: results do not depend on the thread count
    (a documented guarantee, tested in test_determinism.py), and on a busy 2-core machine an
    OpenMP region per tiny call costs more than the call."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        table = {}
        for thread in range(THREADS):
            for seed in _seeds(thread):
                inputs = _inputs(seed)
                table[seed] = (inputs, _forward_backward(*inputs))
        return table
    finally:
        torch.set_num_threads(saved)


def test_16_threads_each_equal_their_serial_results(inputs_and_serial_results):
    table = inputs_and_serial_results

    def work(thread):
        return [_forward_backward(*table[seed][0]) for seed in _seeds(thread)]

    for thread, results in enumerate(_run_in_threads(work, THREADS)):
        expected = [table[seed][1] for seed in _seeds(thread)]
        _assert_calls_bitwise_equal(results, expected, f"thread {thread}")


def test_calls_while_another_thread_changes_the_thread_count(
    inputs_and_serial_results, restore_num_threads
):
    table = inputs_and_serial_results
    workers = 4
    stop = threading.Event()

    def work(i):
        if i == workers:  # the changer: 1, 2, 3, 4, 1, ... until the callers are done
            count = 0
            while True:
                torch.set_num_threads(1 + count % 4)
                count += 1
                if stop.wait(0.001):
                    return count
        try:
            # Each caller also runs at its own thread count, changed between calls.
            results = []
            for n, seed in enumerate(_seeds(i)):
                torch.set_num_threads(1 + (i + n) % 3)
                results.append(_forward_backward(*table[seed][0]))
            return results
        finally:
            if i == 0:
                stop.set()

    outcome = _run_in_threads(work, workers + 1)
    stop.set()
    assert outcome[workers] > 1, "the thread count was not changed during the calls"
    for thread in range(workers):
        expected = [table[seed][1] for seed in _seeds(thread)]
        _assert_calls_bitwise_equal(outcome[thread], expected, f"thread {thread}")


# --- DataLoader workers (fork) -------------------------------------------------------------

# Large enough that at::parallel_for really splits the work (an OpenMP region), which is what
# forked children of a parent that already ran OpenMP regions can hang in.
_LOADER_ITEMS = 6


def _loader_inputs(index):
    generator = torch.Generator().manual_seed(1000 + index)
    dtype = (torch.float32, torch.bfloat16)[index % 2]
    shapes = ((1, 4, 200, 32), (1, 2, 200, 32), (1, 2, 200, 32), (1, 4, 200, 32))
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


class _AttentionDataset(Dataset):
    def __len__(self):
        return _LOADER_ITEMS

    def __getitem__(self, index):
        return _forward_backward(*_loader_inputs(index))


# The workers run at the thread count DataLoader gives them (1). Not 2: after a fork, GNU OpenMP
# cannot start a parallel region in the child of a parent that has run one, so any torch op
# (x.exp() as much as this one) hangs there; DataLoader sets 1 thread in its workers for that.
def test_dataloader_fork_workers_neither_hang_nor_differ(restore_num_threads):
    torch.set_num_threads(2)
    # The parent runs the op (and its OpenMP regions) before forking.
    expected = [_forward_backward(*_loader_inputs(i)) for i in range(_LOADER_ITEMS)]
    loader = DataLoader(
        _AttentionDataset(),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=60,  # a hung worker raises RuntimeError instead of blocking the suite
    )
    _assert_calls_bitwise_equal(list(loader), expected, "DataLoader")
    # And the parent still works after its children are gone.
    _assert_calls_bitwise_equal([_forward_backward(*_loader_inputs(0))], expected[:1], "parent")
