"""Peak memory of a call against the bytes of its own tensors: nothing of size L x L (at
L = 16384 that would be 1 GiB in float32), and little beyond the tensors a call cannot do
without.

- Training, B = H = 1, L = 16384, D = 64, float32, forward + backward: the peak RSS growth is at
  most 5 % over q, k, v, grad_out, out, dq, dk, dv (32 MiB), plus ALLOWANCE_MIB.
- Decoding, Hq = 256, Hkv = 1, Lq = 32, Lk = 300000, D = 64, float32, one forward under
  torch.no_grad(): at most 10 % over q, k, v, out (150 MiB), plus ALLOWANCE_MIB. The share is
  larger than training's for the key splits' partial results (schedule.h bounds them to 5 % of
  the call's bytes) and the decode tasks' scratch.
"""

import os
from pathlib import Path

import pytest

import causal_attention
from benchmarks.memory import peak_growth

# The measurement (benchmarks/memory.py, which the benchmark's memory section uses too) runs in
# a fresh interpreter that imports the package this process imported (this checkout's, or the
# sanitized copy scripts/sanitize.sh puts first on the path), not whatever an installed copy
# points to.
PACKAGE_FILE = Path(causal_attention.__file__).resolve()
PACKAGE_ROOT = PACKAGE_FILE.parents[1]

# Fixed allowance over the share, for what a call needs whatever its tensors' bytes: the per-task
# scratch of block tiles (about 350 KiB per task for the D = 64 backward, ~1.4 MiB at THREADS
# tasks), the O(L) lse and delta (64 KiB each here), the autograd graph, Python objects and
# tensor headers, and the allocator's granularity (glibc pads each arena's growth by M_TOP_PAD,
# 128 KiB, and maps whole 4 KiB pages). Training measured +0.5 MiB over its tensors at 1 thread,
# +1.5 MiB at 4 and +7.4 MiB at 16 (the scratch), so 8 MiB holds THREADS = 4 with room. It stays
# small next to the tensors: training's share plus allowance (9.6 MiB) is under one extra copy
# of q, k and v (12 MiB), decoding's (23 MiB) under a third of one copy of the cache's K.
ALLOWANCE_MIB = 8
# Scratch is per task, and tasks run one per thread: a fixed thread count keeps the figures the
# same on every machine but for block sizes (a 64-core machine would run 64 tasks at once).
THREADS = 4

MEMORY_CASES = [
    pytest.param(
        dict(hq=1, hkv=1, lq=16384, lk=16384, d=64, backward=True, warmup=(256, 256)),
        0.05,
        id="train-L16384-D64-forward-backward",
    ),
    pytest.param(
        # The warm-up decodes too (Lq <= 32) against enough keys to split them.
        dict(hq=256, hkv=1, lq=32, lk=300000, d=64, backward=False, warmup=(32, 4096)),
        0.10,
        id="decode-Hq256-Hkv1-Lq32-Lk300000-D64",
    ),
]


def _peak_growth(case):
    """{"growth": peak RSS growth in bytes, "tensor_bytes": bytes of the call's tensors, ...}."""
    measured = peak_growth(dict(case, threads=THREADS), path=PACKAGE_ROOT, timeout=300)
    assert Path(measured["library"]).resolve() == PACKAGE_FILE, measured["library"]
    assert measured["threads"] == THREADS
    return measured


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize("case,share", MEMORY_CASES)
def test_peak_rss_growth_is_within_a_share_of_the_call_tensors(case, share):
    measured = _peak_growth(case)
    mib = 1 << 20
    tensor_bytes, growth = measured["tensor_bytes"], measured["growth"]
    limit = (1 + share) * tensor_bytes + ALLOWANCE_MIB * mib
    print(
        f"\npeak RSS growth {growth / mib:.1f} MiB for {tensor_bytes / mib:.1f} MiB of tensors "
        f"(+{(growth - tensor_bytes) / tensor_bytes:.1%}); limit {limit / mib:.1f} MiB; "
        f"peak counter reset: {measured['hwm_reset']}"
    )
    assert growth <= limit, (
        f"peak RSS grew {growth / mib:.1f} MiB, over {limit / mib:.1f} MiB = "
        f"{1 + share:.2f} x {tensor_bytes / mib:.1f} MiB of tensors + {ALLOWANCE_MIB} MiB"
    )
