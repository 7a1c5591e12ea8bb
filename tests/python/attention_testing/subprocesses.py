"""Running a script in a fresh Python interpreter, for what only a new process shows: the
package's import, environment variables read at start-up, per-thread CPU time, loading a
packaged program without our library."""

import os
import subprocess
import sys
import textwrap
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


def assert_first_call_refuses(variable: str, value: str, path: Path) -> None:
    """Asserts that the first attention call of a fresh interpreter (its package from ``path``),
    under the environment ``variable`` already set to the bad ``value`` (read at a process's
    first call), raises ValueError naming the variable and quoting the value."""
    result = run_python(textwrap.dedent(
        """
        import torch
        import causal_attention
        q = torch.randn(1, 1, 100, 8)
        try:
            causal_attention.attention(q, q, q)
        except ValueError as error:
            print("VALUE_ERROR", error)
        """), path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "VALUE_ERROR" in result.stdout and variable in result.stdout, result.stdout
    assert f'got "{value}"' in result.stdout, result.stdout


def saved_results(script: str, results_path: Path, path: Path):
    """Runs ``script``, which saves its results with torch.save at RESULTS_PATH (replaced by
    ``results_path``), in a fresh interpreter (its package from ``path``), and returns them."""
    import torch
    result = run_python(script.replace("RESULTS_PATH", repr(str(results_path))), path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(results_path)
