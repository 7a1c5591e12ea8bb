"""What the attention tests parametrize over: the dtypes and their short test ids, and the
hypothesis settings that make every property test reproducible."""

from typing import Sequence

import pytest
import torch
from hypothesis import HealthCheck


DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
}

# hypothesis settings of every property test: the same examples on every run and machine (no
# database, derandomized), no deadline (the machines' speed varies), the failing example printed.
REPRODUCIBLE_EXAMPLES = dict(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def dtype_params(dtypes: Sequence[torch.dtype] = DTYPES):
    """``pytest.param`` per dtype, with short readable ids."""
    return [pytest.param(dtype, id=DTYPE_IDS[dtype]) for dtype in dtypes]
