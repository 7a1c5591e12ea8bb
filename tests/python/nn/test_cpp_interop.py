"""C++ -> Python: the state_dict of a C++ causal_attention::nn::CausalSelfAttention, written by
the GoogleTest case PythonInterop.CppWeightsAreWrittenForPython with torch::pickle_save, loads
strictly into the Python module, which then reproduces the C++ output.

The file lives in $CAUSAL_ATTENTION_INTEROP_DIR (default build/interop), where scripts/test.sh has
ctest write it before pytest runs. Without it this test fails, saying so; it never skips.
"""

import torch
from torch.jit._pickle import restore_type_tag

from causal_attention import CausalSelfAttention
from nn_testing import interop_dir


def test_cpp_state_dict_loads_into_the_python_module():
    path = interop_dir() / "cpp_attention.pt"
    assert path.exists(), (
        f"{path} is missing: the C++ test PythonInterop.CppWeightsAreWrittenForPython writes it; "
        "run ctest first (scripts/test.sh does), with CAUSAL_ATTENTION_INTEROP_DIR set to the "
        "same directory"
    )
    # torch::pickle_save tags typed C++ dicts with this (harmless) function; allow it by name
    # rather than loading with weights_only=False.
    with torch.serialization.safe_globals([restore_type_tag]):
        written = torch.load(path)
    module = CausalSelfAttention(
        written["embed_dim"],
        written["num_heads"],
        num_kv_heads=written["num_kv_heads"],
        head_dim=written["head_dim"],
        value_head_dim=written["value_head_dim"],
        bias=written["bias"],
    )
    module.load_state_dict(written["state_dict"], strict=True)
    with torch.no_grad():
        torch.testing.assert_close(module(written["x"]), written["y"])
