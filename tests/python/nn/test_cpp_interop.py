"""C++ -> Python: the state_dict of a C++ causal_attention::nn::CausalSelfAttention with every
score option, written by the GoogleTest case PythonInterop.CppWeightsAreWrittenForPython with
torch::pickle_save, loads strictly into the Python module made with the same options (its sinks
parameter and ALiBi slopes buffer included, the slopes equal to Python's), which then reproduces
the C++ output. And the C++ KVCache's 8-bit storage (PythonInterop.QuantizedCachesAreWrittenForPython):
Python's KVCache stores the same keys and values in the same bytes with the same scales, for every
format and scale layout, and Python's module decodes from it to the C++ module's outputs.

The file lives in $CAUSAL_ATTENTION_INTEROP_DIR (default build/interop), where scripts/test.sh has
ctest write it before pytest runs. Without it this test fails, saying so; it never skips.
"""

import torch
from torch.jit._pickle import build_intlist, restore_type_tag

from causal_attention import CausalSelfAttention
from causal_attention.nn import alibi_slopes
from nn_testing import interop_dir


def written_by_cpp(name, writer):
    """The dict the GoogleTest case PythonInterop.``writer`` saved as ``name`` in the interop
    directory; fails, saying how to make it, where it is missing."""
    path = interop_dir() / name
    assert path.exists(), (
        f"{path} is missing: the C++ test PythonInterop.{writer} writes it; run ctest first "
        "(scripts/test.sh does), with CAUSAL_ATTENTION_INTEROP_DIR set to the same directory"
    )
    # torch::pickle_save tags typed C++ dicts and builds int lists (the window) with these
    # (harmless) functions; allow them by name rather than loading with weights_only=False.
    with torch.serialization.safe_globals([restore_type_tag, build_intlist]):
        return torch.load(path)


def test_cpp_state_dict_loads_into_the_python_module():
    written = written_by_cpp("cpp_attention.pt", "CppWeightsAreWrittenForPython")
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


def test_cpp_quantized_caches_match_pythons():
    written = written_by_cpp("cpp_quantized_caches.pt", "QuantizedCachesAreWrittenForPython")
    module = CausalSelfAttention(24, 4, num_kv_heads=2, value_head_dim=5, window=(6, 0)).eval()
    module.load_state_dict(written["state_dict"], strict=True)
    x, chunks = written["x"], list(written["chunks"])
    assert len(written["caches"]) == 6
    for name, cpp in written["caches"].items():
        dtype, layout = getattr(torch, name.split("/")[0]), name.split("/")[1]
        per_tensor = {"k_scale": 0.004, "v_scale": 0.003} if layout == "tensor" else {}
        cache = module.make_cache(2, 9, dtype=dtype, scales=layout, **per_tensor)
        outputs, start = [], 0
        with torch.no_grad():
            for size in chunks:
                outputs.append(module(x[:, start:start + size], cache=cache))
                start += size
        assert torch.equal(cache.keys.contiguous().view(torch.uint8), cpp["keys"]), name
        assert torch.equal(cache.values.contiguous().view(torch.uint8), cpp["values"]), name
        assert torch.equal(cache.key_scales, cpp["key_scales"]), name
        assert torch.equal(cache.value_scales, cpp["value_scales"]), name
        torch.testing.assert_close(torch.cat(outputs, 1), cpp["y"], rtol=0, atol=1e-6)
