"""Fixtures shared by the causal_attention Python tests."""

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
