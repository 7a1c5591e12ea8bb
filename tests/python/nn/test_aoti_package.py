"""AOTInductor packages with our ops inside, run from Python: the packages that
tests/fixtures/export_aoti_packages.py compiled into $CAUSAL_ATTENTION_INTEROP_DIR (scripts/test.sh
runs it before ctest and pytest) load with torch._inductor.aoti_load_package and reproduce the
eager model's outputs at two (batch, length) shapes, neither the one they were exported with; the
key mask reaches the packaged op; the op runs through torch's proxy executor, which needs our
library loaded first, and says so when it is not. Without the packages these tests fail, saying
how to make them; they never skip.
"""

import zipfile

import pytest
import torch

import causal_attention  # noqa: F401  (registers the ops the packages call)
from attention_testing.subprocesses import run_python
from attention_testing.tolerances import max_abs_diff
from nn_testing import ROOT, interop_dir

# How many inputs each package's forward takes (tests/fixtures/export_aoti_packages.py).
PACKAGES = {"tiny_gpt": 1, "masked_attention": 2}


def package_path(name: str):
    path = interop_dir() / f"{name}.pt2"
    assert path.exists(), (
        f"{path} is missing: tests/fixtures/export_aoti_packages.py writes it (scripts/test.sh "
        "runs it), into $CAUSAL_ATTENTION_INTEROP_DIR"
    )
    return path


@pytest.fixture(scope="module")
def expected():
    package_path("tiny_gpt")
    return torch.load(interop_dir() / "aoti_expected.pt")


def saved_call(expected, name: str, length: int):
    inputs = [expected[f"{name}.{length}.input{i}"] for i in range(PACKAGES[name])]
    return inputs, expected[f"{name}.{length}.output"]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_reproduces_eager_at_two_shapes(name, expected):
    loaded = torch._inductor.aoti_load_package(str(package_path(name)))
    assert len(expected["lengths"]) == 2
    for length in expected["lengths"]:
        inputs, eager = saved_call(expected, name, length)
        out = loaded(*inputs)
        assert out.shape == eager.shape
        assert max_abs_diff(out, eager) <= 1e-5, (name, length)


def test_key_mask_reaches_the_packaged_op(expected):
    loaded = torch._inductor.aoti_load_package(str(package_path("masked_attention")))
    length = max(expected["lengths"])
    (x, key_mask), eager = saved_call(expected, "masked_attention", length)
    assert not key_mask.all()
    unmasked = loaded(x, torch.ones_like(key_mask))
    assert max_abs_diff(unmasked, eager) > 1e-2


@pytest.mark.parametrize("name", PACKAGES)
def test_package_calls_our_op_through_the_proxy_executor(name):
    # AOTInductor cannot inline a custom op's kernel: the compiled wrapper hands the call, by
    # name, to torch's proxy executor (its node list is in the package's wrapper JSON), which
    # calls the dispatcher, so our CPU kernel runs exactly as in eager.
    with zipfile.ZipFile(package_path(name)) as package:
        wrappers = [n for n in package.namelist() if n.endswith(".wrapper.cpp")]
        assert len(wrappers) == 1
        source = package.read(wrappers[0]).decode()
        nodes = package.read(wrappers[0].replace(".cpp", ".json")).decode()
    assert "aoti_torch_proxy_executor_call_function" in source
    assert '"target": "causal_attention::attention_forward"' in nodes


def test_loading_without_our_library_names_the_missing_op():
    script = (
        "import torch\n"
        f"torch._inductor.aoti_load_package({str(package_path('tiny_gpt'))!r})\n"
    )
    result = run_python(script, ROOT / "tests", timeout=120)
    assert result.returncode != 0
    assert "Could not find schema for causal_attention::attention_forward" in result.stderr
