"""Peak memory: forward + backward at L = 16384 must not materialize anything of size L x L
(that would be 1 GiB in float32)."""

import textwrap
from pathlib import Path

from attention_testing import run_python

REPO_ROOT = Path(__file__).resolve().parents[2]
LIMIT_MB = 200

# Runs in a fresh interpreter so that the peak RSS (ru_maxrss, KiB on Linux) is this workload's.
SCRIPT = textwrap.dedent(
    """
    import resource
    import torch
    import causal_attention

    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def forward_backward(q, k, v, grad_out):
        out = causal_attention.attention(q, k, v)
        out.backward(grad_out)

    torch.manual_seed(0)
    shape = (1, 1, 16384, 64)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape)
    tiny = [t[..., :64, :].detach().clone().requires_grad_() for t in (q, k, v)]
    forward_backward(*tiny, grad_out[..., :64, :])

    baseline = peak_mb()
    forward_backward(q, k, v, grad_out)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    print(f"PEAK_GROWTH_MB={peak_mb() - baseline:.1f}")
    """
)


def test_peak_rss_growth_of_long_sequence_forward_backward():
    result = run_python(SCRIPT, REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("PEAK_GROWTH_MB=")]
    assert len(lines) == 1, result.stdout
    growth_mb = float(lines[0].split("=", 1)[1])
    print(f"\npeak RSS growth for B=H=1, L=16384, D=64 float32 forward+backward: {growth_mb} MB")
    assert growth_mb < LIMIT_MB
