"""The peak memory of one attention call against the bytes of its own tensors, measured in a
fresh interpreter. The benchmark's memory section and tests/python/test_memory.py both use it.

    python -m benchmarks.memory '{"impl": "ours", "hq": 1, "hkv": 1, "lq": 4096, "lk": 4096,
        "d": 64, "backward": true, "warmup": [256, 256], "threads": 2}'   # prints RESULT={...}

After a small warm-up call of the same kind (so that lazy initialization, the thread pool and code
pages are already paid for), the child returns free heap pages to the kernel (malloc_trim, so
that reusing them cannot hide growth) and resets the peak-RSS counter (writing 5 to
/proc/self/clear_refs resets VmHWM to the current RSS; Linux only), then creates the tensors and
makes the call: VmHWM - VmRSS before is the call's peak growth, tensors included. If the counter
cannot be reset, VmHWM still holds the earlier, higher peak, so the growth is overstated, never
understated.
"""

import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def peak_growth(case, *, path=REPO_ROOT, timeout=1800):
    """Measures `case` in a fresh interpreter, in directory `path` and with `path` first on its
    import path (so that `import causal_attention` finds the package there). Returns
    {"growth": peak RSS growth in bytes, "tensor_bytes": bytes of the call's tensors,
    "hwm_reset", "library": the op library's package file, "threads"}; raises RuntimeError with
    the child's output if it fails.

    case: impl (a name of cases.IMPL_FN, default "ours"), hq, hkv, lq, lk, d, backward (forward
    and backward, else one forward under no_grad), warmup ((lq, lk) of the warm-up call), threads.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(path), str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", json.dumps(case)], env=env,
                          cwd=path, capture_output=True, text=True, timeout=timeout)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT=")]
    if proc.returncode != 0 or len(results) != 1:
        raise RuntimeError(f"benchmarks.memory exited {proc.returncode}:\n"
                           f"{proc.stdout}\n{proc.stderr}".strip())
    return json.loads(results[0].split("=", 1)[1])


def _status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _call(fn, case, lq, lk):
    """One call of the case's kind at (lq, lk); returns every tensor it created."""
    import torch

    shapes = ((1, case["hq"], lq, case["d"]), (1, case["hkv"], lk, case["d"]),
              (1, case["hkv"], lk, case["d"]))
    q, k, v = (torch.randn(s, requires_grad=case["backward"]) for s in shapes)
    if not case["backward"]:
        with torch.no_grad():
            out = fn(q, k, v)
        return [q, k, v, out]
    grad_out = torch.randn(1, case["hq"], lq, case["d"])
    out = fn(q, k, v)
    out.backward(grad_out)
    assert out.shape == grad_out.shape
    return [q, k, v, grad_out, out.detach(), q.grad, k.grad, v.grad]


def _measure(case):
    import torch

    import causal_attention

    from .cases import IMPL_FN

    fn = IMPL_FN[case.get("impl", "ours")]
    torch.manual_seed(0)
    torch.set_num_threads(case["threads"])
    _call(fn, case, *case["warmup"])
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    before = _status_bytes("VmRSS")
    assert reset is False or _status_bytes("VmHWM") <= before + (1 << 20)
    tensors = _call(fn, case, case["lq"], case["lk"])
    growth = _status_bytes("VmHWM") - before
    return {
        "growth": growth,
        "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "hwm_reset": reset,
        "library": causal_attention.__file__,
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    print("RESULT=" + json.dumps(_measure(json.loads(sys.argv[1]))))
