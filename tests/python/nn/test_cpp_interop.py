"""C++ -> Python: the state_dict of a C++ causal_attention::nn::CausalSelfAttention with every
score option, written by the GoogleTest case PythonInterop.CppWeightsAreWrittenForPython with
torch::pickle_save, loads strictly into the Python module made with the same options (its sinks
parameter and ALiBi slopes buffer included, the slopes equal to Python's), which then reproduces
the C++ output.

The file lives in $CAUSAL_ATTENTION_INTEROP_DIR (default build/interop), where scripts/test.sh has
ctest write it before pytest runs. Without it this test fails, saying so; it never skips.
"""

import torch
from torch.jit._pickle import build_intlist, restore_type_tag

from causal_attention import CausalSelfAttention
from causal_attention.nn import alibi_slopes
from nn_testing import interop_dir


def test_cpp_state_dict_loads_into_the_python_module():
    path = interop_dir() / "cpp_attention.pt"
    assert path.exists(), (
        f"{path} is missing: the C++ test PythonInterop.CppWeightsAreWrittenForPython writes it; "
        "run ctest first (scripts/test.sh does), with CAUSAL_ATTENTION_INTEROP_DIR set to the "
        "same directory"
    )
    # torch::pickle_save tags typed C++ dicts and builds int lists (the window) with these
    # (harmless) functions; allow them by name rather than loading with weights_only=False.
    with torch.serialization.safe_globals([restore_type_tag, build_intlist]):
        written = torch.load(path)
    module = CausalSelfAttention(
        written["embed_dim"],
        written["num_heads"],
        num_kv_heads=written["num_kv_heads"],
        head_dim=written["head_dim"],
        value_head_dim=written["value_head_dim"],
        bias=written["bias"],
        window=tuple(written["window"]),
        softcap=written["softcap"],
        sinks=written["sinks"],
        alibi=written["alibi"],
    )
    assert module.sinks is not None and module.alibi_slopes is not None
    module.load_state_dict(written["state_dict"], strict=True)
    # C++ computes the slopes itself, to the bit.
    assert torch.equal(written["state_dict"]["alibi_slopes"], alibi_slopes(written["num_heads"]))
    with torch.no_grad():
        torch.testing.assert_close(module(written["x"]), written["y"])
