"""The README's "Use it in your model" section cannot rot: its Python blocks run here, and its C++
block is, character for character, tests/cpp/nn/readme_use_in_model.h, which the GoogleTest case
ReadmeExample.CompilesAndRuns compiles and runs. The deployment example of docs/reference.md runs
here too."""

import re
import runpy

from nn_testing import IGNORE_TORCHSCRIPT_DEPRECATION, ROOT

SECTION = "## Use it in your model"
DEPLOYMENT_SECTION = "## Deploying to C++"


def section_blocks(language, section_title=SECTION, document="README.md"):
    readme = (ROOT / document).read_text()
    start = readme.index(section_title)
    end = readme.find("\n## ", start + len(section_title))
    section = readme[start : end if end != -1 else len(readme)]
    return re.findall(rf"^```{language}\n(.*?)^```$", section, flags=re.S | re.M)


def run_blocks(blocks, directory):
    """Runs each block from a file in ``directory`` (TorchScript reads the source of what it
    scripts, so not from exec'd text)."""
    for number, block in enumerate(blocks):
        path = directory / f"readme_block_{number}.py"
        path.write_text(block)
        runpy.run_path(str(path), run_name="readme_example")


@IGNORE_TORCHSCRIPT_DEPRECATION
def test_python_blocks_run(tmp_path, monkeypatch):
    blocks = section_blocks("python")
    assert blocks, f"no python block under {SECTION!r} in README.md"
    monkeypatch.chdir(tmp_path)  # the example saves a file
    run_blocks(blocks, tmp_path)
    assert (tmp_path / "block.pt").exists()


def test_deployment_block_compiles_a_package_that_matches_eager(tmp_path, monkeypatch):
    blocks = section_blocks("python", DEPLOYMENT_SECTION, "docs/reference.md")
    assert len(blocks) == 1, f"expected one python block under {DEPLOYMENT_SECTION!r}"
    assert "assert_close" in blocks[0]
    monkeypatch.chdir(tmp_path)  # the example writes gpt.pt2
    run_blocks(blocks, tmp_path)
    assert (tmp_path / "gpt.pt2").exists()


def test_cpp_block_is_the_compiled_example():
    blocks = section_blocks("cpp")
    assert len(blocks) == 1, f"expected one cpp block under {SECTION!r}, found {len(blocks)}"
    assert blocks[0] == (ROOT / "tests/cpp/nn/readme_use_in_model.h").read_text()
