"""Faults: a call whose result cannot be allocated raises RuntimeError and leaves the process
working; the compiled library refuses to load into a torch other than the one it was built
against, naming both versions."""

import shutil
import textwrap
from pathlib import Path

import pytest
import torch

import causal_attention
from attention_testing.subprocesses import run_python
from causal_attention import _library

# --- allocation failure --------------------------------------------------------------------

# Inputs are stride-0 views of a few elements, so only the results (and the lse buffer) are
# large: each at least 2**46 float32 elements, 256 TiB, beyond the 128 TiB of any x86-64 address
# space, so no allocator (overcommitting or not, ASan's included, with
# allocator_may_return_null=1) can succeed, and nothing is ever touched.
ROWS = 2**46


def _rows(count, dim):
    """(count, dim) with every row the same: stride 0 along the rows, 1 along dim."""
    return torch.randn(1, dim).expand(count, dim)


def _huge_output_forward(requires_grad):
    q, k, v = _rows(ROWS, 4), torch.randn(3, 4), torch.randn(3, 256)  # out: (2**46, 256)
    if requires_grad:
        q = q.detach().requires_grad_(True)
    return causal_attention.attention(q, k, v)


def _huge_gradient_backward():
    q, k, v = _rows(ROWS, 256), torch.randn(3, 256), torch.randn(3, 2)  # dq: (2**46, 256)
    out, grad_out, lse = _rows(ROWS, 2), _rows(ROWS, 2), torch.zeros(1).expand(ROWS)
    return causal_attention.attention_backward(grad_out, q, k, v, out, lse, 0.5)


FAULTS = {
    "forward-output": lambda: _huge_output_forward(requires_grad=False),
    "forward-output-autograd": lambda: _huge_output_forward(requires_grad=True),
    "backward-gradient": _huge_gradient_backward,
}


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_unallocatable_result_raises_and_the_process_keeps_working(fault):
    q, k, v = (torch.randn(2, 3, 70, 16, requires_grad=True) for _ in range(3))
    before = causal_attention.attention(q, k, v)
    before_grads = torch.autograd.grad(before.sum(), (q, k, v))

    # torch raises its OutOfMemoryError (a RuntimeError) or a plain RuntimeError for the
    # allocation; either way a RuntimeError, never a crash.
    with pytest.raises(RuntimeError) as info:
        fault()
    print(f"{type(info.value).__name__}: {str(info.value).splitlines()[0]}")

    after = causal_attention.attention(q, k, v)
    after_grads = torch.autograd.grad(after.sum(), (q, k, v))
    assert torch.equal(before, after)
    assert all(torch.equal(a, b) for a, b in zip(before_grads, after_grads))


# --- torch version check -------------------------------------------------------------------


def _package_copy(tmp_path: Path) -> Path:
    """A copy of the built package (Python files, library, version record) under tmp_path."""
    source = Path(causal_attention.__file__).resolve().parent
    target = tmp_path / "causal_attention"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def _record(package: Path) -> Path:
    return package / (_library.LIBRARY_NAME + _library.TORCH_VERSION_SUFFIX)


def test_the_library_records_the_torch_it_was_built_against():
    library = Path(causal_attention.__file__).resolve().parent / _library.LIBRARY_NAME
    recorded = library.with_name(library.name + _library.TORCH_VERSION_SUFFIX).read_text()
    assert recorded.strip() == torch.__version__.split("+")[0]


@pytest.mark.parametrize("running", ["2.12.1", "2.13.1+cu128", "3.0.0"])
def test_another_torch_version_is_refused_naming_both(tmp_path, running):
    package = _package_copy(tmp_path)
    library = package / _library.LIBRARY_NAME
    _library.check_torch_version(library, running=torch.__version__)  # the real one passes
    with pytest.raises(ImportError) as info:
        _library.check_torch_version(library, running=running)
    message = str(info.value)
    assert f"built against torch {_record(package).read_text().strip()}" in message
    assert f"torch {running} is imported" in message


def test_a_missing_version_record_is_refused(tmp_path):
    package = _package_copy(tmp_path)
    _record(package).unlink()
    with pytest.raises(ImportError, match="torch_version is missing"):
        _library.check_torch_version(package / _library.LIBRARY_NAME)


def test_importing_a_library_built_for_another_torch_fails_clearly(tmp_path):
    # End to end, in a fresh interpreter: the package copy's record claims another torch.
    package = _package_copy(tmp_path)
    _record(package).write_text("1.13.1\n")
    script = textwrap.dedent(
        """
        import torch
        try:
            import causal_attention
        except ImportError as e:
            print("IMPORT ERROR:", e)
        else:
            print("IMPORTED", causal_attention.__file__)
        """
    )
    result = run_python(script, tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "IMPORT ERROR:" in result.stdout, result.stdout
    assert "built against torch 1.13.1" in result.stdout
    assert f"torch {torch.__version__} is imported" in result.stdout
