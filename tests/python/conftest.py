"""Fixtures shared by the causal_attention Python tests, and the shards of a run.

Time budget: CI (.ci/run on a fresh clone) stays under 25 minutes, this suite about 5 of them
(run as two shards at once by scripts/test.sh). A test that takes over 30 s on the CI machine
(``pytest --durations=40`` shows them) says why in its docstring; tests that only repeat an input
at a larger size are cut instead."""

import os

import pytest
import torch

SHARD_VARIABLE = "CAUSAL_ATTENTION_TEST_SHARD"


def pytest_sessionstart(session):
    """Calls torch's elementwise exp, log and tanh once each, float32 and float64, on one thread,
    before any test. torch 2.13's CPU build computes them through MKL's vector math, whose first
    call in a process, when it starts on two threads at once, was off by up to 1.5e-7 in a float64
    exp (values up to ~50; about 1 process in 100 on an Intel Xeon with AMX, without our library:
    a warm 2-thread pool, then torch.exp twice on 29,400 float64 values, the second call right;
    0 in 150 processes after this warm-up). A float64 reference built with torch.exp or
    torch.logsumexp is compared with ours at 1e-12 to 1e-13, so such a first call failed tests
    that were right."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.float64):
            x = torch.linspace(0.5, 1.5, 4096, dtype=dtype)
            for fn in (torch.exp, torch.log, torch.tanh):
                fn(x)
    finally:
        torch.set_num_threads(saved)


def pytest_collection_modifyitems(config, items):
    """With CAUSAL_ATTENTION_TEST_SHARD="i/n", runs shard i of n: the collected tests whose
    place in the sorted test ids is i, i + n, i + 2n, ..., in their usual order.
    scripts/setup_env.sh's pytest_in_shards runs the shards of a run at once, one process each,
    so that both cores work (most tests keep one core busy with Python). Every n-th test splits
    each file, the slow ones too, about evenly; sorted ids, not the order of collection, decide,
    so that the shards stay complementary even where two processes collect in different orders
    (a parametrization drawn from a set of strings follows each process's hash seed)."""
    shard = os.environ.get(SHARD_VARIABLE)
    if not shard:
        return
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise pytest.UsageError(f'{SHARD_VARIABLE} must be "i/n" with 0 <= i < n, got "{shard}"')
    place = {test_id: i for i, test_id in enumerate(sorted(item.nodeid for item in items))}
    shards = {True: [], False: []}  # in this shard or not
    for item in items:
        shards[place[item.nodeid] % count == index].append(item)
    config.hook.pytest_deselected(items=shards[False])
    items[:] = shards[True]


@pytest.fixture(autouse=True)
def _seed():
    """Every test draws the same random inputs, whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture
def restore_num_threads():
    """Lets a test change torch's intra-op thread count and restores it afterwards."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Runs a module's tests on one intra-op thread: results do not depend on the thread count
    (ops/test_determinism.py), and many small calls with a 2-thread OpenMP region each are 10x
    slower on a busy 2-core machine. Use as ``pytestmark = pytest.mark.usefixtures(...)``."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
