#!/usr/bin/env bash
# Every test, from a fresh machine: installs what is missing, builds once, runs ctest, a C++
# program built against the installed package, and pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sdpa).
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
setup_everything

banner "exporting the TorchScript model and compiling the AOTInductor packages the C++ tests load"
export CAUSAL_ATTENTION_INTEROP_DIR="$ROOT/build/interop"
PYTHONPATH="$ROOT" "$PY" "$ROOT/tests/fixtures/export_torchscript_model.py" \
  "$CAUSAL_ATTENTION_INTEROP_DIR"
PYTHONPATH="$ROOT" "$PY" "$ROOT/tests/fixtures/export_aoti_packages.py" \
  "$CAUSAL_ATTENTION_INTEROP_DIR"

banner "ctest"
(cd "$ROOT/build" && ctest --output-on-failure -j2)

banner "a C++ program outside the tree, built against the installed package (tests/cpp/consumer)"
cmake --install "$ROOT/build" --prefix "$ROOT/build/install" >/dev/null
if [ ! -f "$ROOT/build/consumer/CMakeCache.txt" ]; then
  cmake -S "$ROOT/tests/cpp/consumer" -B "$ROOT/build/consumer" -G Ninja \
    -DCMAKE_PREFIX_PATH="$ROOT/build/install;$(torch_cmake_prefix)" >/dev/null
fi
cmake --build "$ROOT/build/consumer"
"$ROOT/build/consumer/consumer"

cd "$ROOT"
if [ $# -eq 0 ]; then
  banner "pytest, the whole suite as two shards at once"
  pytest_in_shards "$PY" -m pytest -q
else
  banner "pytest $*"
  "$PY" -m pytest -q "$@"
fi

# The decode's tests once more under the products this chip does not choose for bfloat16 query
# rows against bfloat16 and float8 cache rows (csrc/ops/cpu/decode_products.h): of the chips with
# AVX-512 BF16 and VBMI, AMD's take the pair dots and Intel's the float32 multiply-adds;
# CAUSAL_ATTENTION_PAIR_DOTS makes a chip take the other, so each such chip tests both paths.
# Only for the whole suite (no pytest arguments).
if [ $# -eq 0 ] && grep -qw avx512_bf16 /proc/cpuinfo && grep -qw avx512vbmi /proc/cpuinfo; then
  chosen="$("$PY" -c 'import torch, causal_attention
print(torch.ops.causal_attention.decode_products())')"
  other="$([ "$chosen" = pairs ] && echo off || echo on)"
  banner "the decode's tests with CAUSAL_ATTENTION_PAIR_DOTS=$other (this chip takes $chosen)"
  CAUSAL_ATTENTION_PAIR_DOTS=$other pytest_in_shards "$PY" -m pytest -q tests/python/ops \
    tests/python/nn -k "bf16 or bfloat16 or float8 or e4m3 or e5m2 or paged or decode or cache" \
    -p no:cacheprovider
fi

# The bfloat16/float16 tests once more on the block products other chips take
# (csrc/ops/cpu/block_gemm.h), where this chip multiplies them natively (avx512_bf16, AMX): with
# oneDNN capped at AVX2 they run on the widened products (the same code that
# CAUSAL_ATTENTION_REDUCED_PRODUCTS=widened selects) beside oneDNN's AVX2 float32 kernels, which
# is every other chip's path; a chip whose products are already widened ran that path above.
# The block products' own tests run under each cap that changes their choice. Only for the whole
# suite (no pytest arguments).
if [ $# -eq 0 ]; then
  native="$("$PY" -c 'import torch, causal_attention
print(" ".join(d for d in ("bfloat16", "float16")
               if torch.ops.causal_attention.block_products(getattr(torch, d)) == "native"))')"
  if [ -n "$native" ]; then
    for isa in AVX512_CORE_VNNI AVX2; do
      banner "block products with ONEDNN_MAX_CPU_ISA=$isa"
      (cd "$ROOT/build" && ONEDNN_MAX_CPU_ISA=$isa ctest --output-on-failure -R BlockGemm)
    done
    banner "bfloat16/float16 tests with ONEDNN_MAX_CPU_ISA=AVX2 (native here: $native)"
    ONEDNN_MAX_CPU_ISA=AVX2 pytest_in_shards "$PY" -m pytest -q tests/python/ops \
      tests/python/integrations -k "bf16 or f16" -p no:cacheprovider
  fi
fi
