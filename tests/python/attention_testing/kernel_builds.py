"""The kernel builds (baseline, AVX2, AVX-512) a test runs a script under, each in a fresh
interpreter: the op picks its build from ATen's CPU capability, fixed when torch loads, so a
machine runs its highest build unless ``ATEN_CPU_CAPABILITY`` lowers it, and the lower builds
would go untested. (ATen also honours a value above what the CPU has: torch's own kernels and
ours then die of SIGILL, so no build above this process's capability is asked for.)"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from attention_testing.subprocesses import run_python

# The highest build this torch selects here (lower if this process runs under a lowering
# ATEN_CPU_CAPABILITY itself), and the builds it can be lowered to.
MACHINE_CAPABILITY = torch.backends.cpu.get_cpu_capability()
RUNNABLE = {
    "default": True,
    "avx2": MACHINE_CAPABILITY in ("AVX2", "AVX512"),
    "avx512": MACHINE_CAPABILITY == "AVX512",
}

# pytest.mark.parametrize("capability", EVERY_BUILD): each build, skipped (saying why) where
# this machine cannot run it; never passed.
EVERY_BUILD = [
    pytest.param(
        capability,
        marks=pytest.mark.skipif(
            not runnable,
            reason=f"torch's CPU capability in this process is {MACHINE_CAPABILITY} "
            f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}): "
            f"the {capability.upper()} kernel build cannot run here",
        ),
    )
    for capability, runnable in RUNNABLE.items()
]


def run_in_build(capability: str, script: str, path: Path, monkeypatch
                 ) -> subprocess.CompletedProcess:
    """Runs ``script`` in a fresh interpreter under ATEN_CPU_CAPABILITY=``capability`` (its
    package from ``path``) and asserts that it exited cleanly; returns the finished process."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    result = run_python(script, path, timeout=120)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def cpu_vendor_and_flags() -> tuple[str, set[str]]:
    """The first CPU's vendor_id ("GenuineIntel", "AuthenticAMD") and flags in /proc/cpuinfo
    (what the chip has, whatever build or cap this process runs under)."""
    vendor, flags = "", set()
    with open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id" and not vendor:
                vendor = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return vendor, flags
