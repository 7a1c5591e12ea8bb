"""Fixtures shared by the causal_attention Python tests.

Time budget: CI (.ci/run on a fresh clone) stays under 25 minutes, this suite about 6 of them. A
test that takes over 30 s on the CI machine (``pytest --durations=40`` shows them) says why in its
docstring; tests that only repeat an input at a larger size are cut instead."""

import pytest
import torch


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
