"""The README's "Use it in your model" section cannot rot: its Python blocks run here, and its C++
block is, character for character, tests/cpp/nn/readme_use_in_model.h, which the GoogleTest case
ReadmeExample.CompilesAndRuns compiles and runs."""

import re
import runpy

from nn_testing import IGNORE_TORCHSCRIPT_DEPRECATION, ROOT

SECTION = "## Use it in your model"


def section_blocks(language):
    readme = (ROOT / "README.md").read_text()
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start : end if end != -1 else len(readme)]
    return re.findall(rf"^```{language}\n(.*?)^```$", section, flags=re.S | re.M)


@IGNORE_TORCHSCRIPT_DEPRECATION
def test_python_blocks_run(tmp_path, monkeypatch):
    blocks = section_blocks("python")
    assert blocks, f"no python block under {SECTION!r} in README.md"
    monkeypatch.chdir(tmp_path)  # the example saves a file
    for number, block in enumerate(blocks):
        # From a file rather than exec'd text: TorchScript reads the source of what it scripts.
        path = tmp_path / f"readme_block_{number}.py"
        path.write_text(block)
        runpy.run_path(str(path), run_name="readme_example")
    assert (tmp_path / "block.pt").exists()


def test_cpp_block_is_the_compiled_example():
    blocks = section_blocks("cpp")
    assert len(blocks) == 1, f"expected one cpp block under {SECTION!r}, found {len(blocks)}"
    assert blocks[0] == (ROOT / "tests/cpp/nn/readme_use_in_model.h").read_text()
