"""Fixtures shared by the causal_attention Python tests, and the shards of a run.

Time budget: CI (.ci/run on a fresh clone) stays under 25 minutes, this suite about 5 of them
(run as two shards at once by scripts/test.sh). A test that takes over 30 s on the CI machine
(``pytest --durations=40`` shows them) says why in its docstring; tests that only repeat an input
at a larger size are cut instead."""

import os

import pytest
import torch
from attention_testing.shards import SHARD_VARIABLE, parse_shard, shard_ids


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
    """With CAUSAL_ATTENTION_TEST_SHARD="i/n", runs shard i of n (attention_testing/shards.py)."""
    spec = os.environ.get(SHARD_VARIABLE)
    if not spec:
        return
    try:
        index, count = parse_shard(spec)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    kept = shard_ids((item.nodeid for item in items), index, count)
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in kept])
    items[:] = [item for item in items if item.nodeid in kept]


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
