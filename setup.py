"""pip's build of the extension: drives the same CMake build as scripts/test.sh, never a second
copy of it. The package's metadata and dependencies are in pyproject.toml.

    pip install --no-build-isolation -e .

--no-build-isolation matters: the library must be compiled against the torch it will be loaded
into, not one that pip picks for an isolated build environment.
"""

import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Builds the library in build/ (shared with scripts/test.sh, so nothing compiles twice), then
    copies it where setuptools wants the extension: a wheel, or the editable install's staging."""

    def get_ext_filename(self, fullname: str) -> str:
        # A plain shared library loaded with torch.ops.load_library, not a CPython module.
        return str(Path(*fullname.split("."))) + ".so"

    def build_extension(self, ext: Extension) -> None:
        import torch

        # Preset "default" of CMakePresets.json: the build in build/.
        prefix = f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"
        subprocess.check_call(["cmake", "--preset", "default", prefix], cwd=ROOT)
        build_dir = ROOT / "build"
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "causal_attention_ops"])
        built = ROOT / "causal_attention" / "libcausal_attention_ops.so"
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        if target != built:
            target.parent.mkdir(parents=True, exist_ok=True)
            # With the torch version it was built against, which the package checks on import.
            for suffix in ("", ".torch_version"):
                shutil.copyfile(f"{built}{suffix}", f"{target}{suffix}")


setup(
    ext_modules=[CMakeExtension("causal_attention.libcausal_attention_ops")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
