#!/usr/bin/env bash
# Every test, from a fresh machine: installs what is missing, builds once, runs ctest and pytest.
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

echo "==> pytest"
cd "$ROOT"
"$PY" -m pytest -q "$@"
