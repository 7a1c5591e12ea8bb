#!/usr/bin/env bash
# Every test, from a fresh machine: installs what is missing, builds once, runs ctest, a C++
# program built against the installed package, and pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sdpa).
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
setup_everything

echo "==> exporting the TorchScript model and compiling the AOTInductor packages the C++ tests load"
export CAUSAL_ATTENTION_INTEROP_DIR="$ROOT/build/interop"
PYTHONPATH="$ROOT" "$PY" "$ROOT/tests/fixtures/export_torchscript_model.py" \
  "$CAUSAL_ATTENTION_INTEROP_DIR"
PYTHONPATH="$ROOT" "$PY" "$ROOT/tests/fixtures/export_aoti_packages.py" \
  "$CAUSAL_ATTENTION_INTEROP_DIR"

echo "==> ctest"
(cd "$ROOT/build" && ctest --output-on-failure)

echo "==> a C++ program outside the tree, built against the installed package (tests/cpp/consumer)"
cmake --install "$ROOT/build" --prefix "$ROOT/build/install" >/dev/null
if [ ! -f "$ROOT/build/consumer/CMakeCache.txt" ]; then
  cmake -S "$ROOT/tests/cpp/consumer" -B "$ROOT/build/consumer" -G Ninja \
    -DCMAKE_PREFIX_PATH="$ROOT/build/install;$(torch_cmake_prefix)" >/dev/null
fi
cmake --build "$ROOT/build/consumer"
"$ROOT/build/consumer/consumer"

echo "==> pytest"
cd "$ROOT"
"$PY" -m pytest -q "$@"

# The bfloat16/float16 tests once more on other block products (csrc/ops/cpu/block_gemm.h), so
# that every chip tests the paths other chips take: the widened products everywhere, and where
# the kernels run their AVX-512 build, oneDNN capped below avx512_bf16 (Skylake to Ice Lake
# servers: no native bf16 kernel) and at AVX2. Only for the whole suite (no pytest arguments).
if [ $# -eq 0 ]; then
  reduced=(tests/python/ops tests/python/integrations -k "bf16 or f16" -p no:cacheprovider)
  echo "==> bfloat16/float16 tests with CAUSAL_ATTENTION_REDUCED_PRODUCTS=widened"
  CAUSAL_ATTENTION_REDUCED_PRODUCTS=widened "$PY" -m pytest -q "${reduced[@]}"
  if [ "$("$PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" = AVX512 ]; then
    for isa in AVX512_CORE_VNNI AVX2; do
      echo "==> bfloat16/float16 tests and block products with ONEDNN_MAX_CPU_ISA=$isa"
      (cd "$ROOT/build" && ONEDNN_MAX_CPU_ISA=$isa ctest --output-on-failure -R BlockGemm)
      ONEDNN_MAX_CPU_ISA=$isa "$PY" -m pytest -q "${reduced[@]}"
    done
  fi
fi
