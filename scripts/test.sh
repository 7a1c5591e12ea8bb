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
