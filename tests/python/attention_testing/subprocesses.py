"""Running a script in a fresh Python interpreter, for what only a new process shows: the
package's import, environment variables read at start-up, per-thread CPU time, loading a
packaged program without our library."""

import os
import subprocess
import sys
from pathlib import Path


def run_python(script: str, path: Path, timeout: float) -> subprocess.CompletedProcess:
    """Runs ``script`` in a fresh interpreter, in directory ``path`` and with ``path`` first on
    its import path (so ``import causal_attention`` finds the package there); text output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
