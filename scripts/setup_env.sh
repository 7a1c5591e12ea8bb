# Sourced by training/run.sh, scripts/test.sh and scripts/sanitize.sh: brings a fresh machine to a
# built checkout, and does nothing the second time (no install when present, no rebuild when
# nothing changed).
#   - system packages (compiler, CMake, Ninja, GoogleTest): installed when root, else named;
#   - Python packages into the active virtual environment, or .venv at the repo root;
#   - the CMake build in build/ (library, GoogleTest binaries, the benchmark's block-product
#     probe) and the editable install.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_SPEC="torch==2.13.0"  # pinned exactly: any other spec may pull a multi-GB CUDA build
PY_TEST_DEPS=(pytest hypothesis numpy expecttest tqdm matplotlib transformers)

ensure_system_packages() {
  local missing=()
  command -v g++ >/dev/null || missing+=(g++)
  command -v cmake >/dev/null || missing+=(cmake)
  command -v ninja >/dev/null || missing+=(ninja-build)
  [ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ]; then
    echo "==> installing system packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "Missing system packages. Install them with:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
}

ensure_python() {
  if [ -n "${VIRTUAL_ENV:-}" ]; then
    PY="$VIRTUAL_ENV/bin/python"
  else
    if [ ! -x "$ROOT/.venv/bin/python" ]; then
      echo "==> creating $ROOT/.venv"
      python3 -m venv "$ROOT/.venv"
    fi
    PY="$ROOT/.venv/bin/python"
  fi
  if ! "$PY" -c "import torch, sys; sys.exit(not torch.__version__.startswith('2.13.0'))" 2>/dev/null; then
    echo "==> installing $TORCH_SPEC"
    "$PY" -m pip install -q "$TORCH_SPEC"
  fi
  if ! "$PY" -c "import pytest, hypothesis, numpy, expecttest, tqdm, matplotlib, transformers" 2>/dev/null; then
    echo "==> installing test dependencies: ${PY_TEST_DEPS[*]}"
    "$PY" -m pip install -q "$TORCH_SPEC" "${PY_TEST_DEPS[@]}"
  fi
  export PY
}

build() {
  local build_dir="$ROOT/build"
  if [ ! -f "$build_dir/CMakeCache.txt" ] ||
    ! grep -q "CAUSAL_ATTENTION_BUILD_TESTS:BOOL=ON" "$build_dir/CMakeCache.txt" ||
    ! grep -q "CAUSAL_ATTENTION_BUILD_BENCH_PROBE:BOOL=ON" "$build_dir/CMakeCache.txt"; then
    echo "==> configuring $build_dir"
    cmake -S "$ROOT" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCAUSAL_ATTENTION_BUILD_TESTS=ON -DCAUSAL_ATTENTION_BUILD_BENCH_PROBE=ON \
      -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
  fi
  echo "==> building"
  cmake --build "$build_dir"
  if ! "$PY" -c "import importlib.metadata as m; m.version('causal_attention')" 2>/dev/null; then
    echo "==> pip install --no-build-isolation -e ."
    "$PY" -m pip install -q --no-build-isolation --no-deps -e "$ROOT"
  fi
}

setup_everything() {
  ensure_system_packages
  ensure_python
  build
}
