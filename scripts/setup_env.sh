# Sourced by scripts/run.sh, scripts/test.sh and scripts/sanitize.sh: brings a fresh machine to a
# built checkout, and does nothing the second time (no install when present, no rebuild when
# nothing changed).
#   - system packages (compiler, CMake, Ninja, GoogleTest): installed when root, else named;
#   - into the active virtual environment, or .venv at the repo root, what pyproject.toml lists:
#     what the build needs (setuptools, the pinned torch), then the package and its test extra
#     (`.[test]`, editable);
#   - the CMake build in build/ (library, GoogleTest binaries, the benchmark's block-product
#     probe), preset "tests" of CMakePresets.json.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# banner TEXT: a step's heading, with the time of day, so that a log (CI's) tells how long each
# step took.
banner() {
  echo "==> $* [$(date +%T)]"
}

ensure_system_packages() {
  local missing=()
  command -v g++ >/dev/null || missing+=(g++)
  command -v cmake >/dev/null || missing+=(cmake)
  command -v ninja >/dev/null || missing+=(ninja-build)
  [ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ]; then
    banner "installing system packages: ${missing[*]}"
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
      banner "creating $ROOT/.venv"
      python3 -m venv "$ROOT/.venv"
    fi
    PY="$ROOT/.venv/bin/python"
  fi
  local missing
  missing="$(unsatisfied --build)"
  if [ -n "$missing" ]; then
    mapfile -t missing <<<"$missing"
    banner "installing what the build needs: ${missing[*]}"
    "$PY" -m pip install -q "${missing[@]}"
  fi
  # --no-build-isolation: the library is compiled against the torch just checked, the one it is
  # loaded into; the exact torch pin then keeps pip from replacing it.
  if [ -n "$(unsatisfied)" ]; then
    banner "pip install --no-build-isolation -e '.[test]' (builds the library in build/)"
    "$PY" -m pip install -q --no-build-isolation -e "$ROOT[test]"
  fi
  export PY
}

# Prints, one a line, the requirements in pyproject.toml that the environment does not satisfy:
# with --build, the build's (its build-system requirements, and the torch pin: the build uses the
# installed torch); else the package itself, its dependencies and its test extra. It parses with
# pip's vendored copies: a fresh environment has pip, not yet packaging (nor, before Python 3.11,
# tomllib).
unsatisfied() {
  "$PY" - "$ROOT/pyproject.toml" "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
from pip._vendor.packaging.requirements import Requirement

with open(sys.argv[1], "rb") as f:
    pyproject = tomllib.load(f)
project = pyproject["project"]
if "--build" in sys.argv:
    torch = [spec for spec in project["dependencies"] if Requirement(spec).name == "torch"]
    wanted = pyproject["build-system"]["requires"] + torch
else:
    wanted = [project["name"], *project["dependencies"], *project["optional-dependencies"]["test"]]
for spec in wanted:
    requirement = Requirement(spec)
    try:
        installed = version(requirement.name)
    except PackageNotFoundError:
        installed = None
    if installed is None or not requirement.specifier.contains(installed, prereleases=True):
        print(spec)
EOF
}

# Where the environment's torch keeps its CMake package.
torch_cmake_prefix() {
  "$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)'
}

# configure PRESET [CMAKE ARGS...]: configures the build of a preset in CMakePresets.json (the one
# spelling of every CMake build here) against the environment's torch.
configure() {
  local preset="$1"
  shift
  banner "configuring (preset $preset)"
  (cd "$ROOT" && cmake --preset "$preset" -DCMAKE_PREFIX_PATH="$(torch_cmake_prefix)" "$@" >/dev/null)
}

build() {
  local cache="$ROOT/build/CMakeCache.txt"
  if [ ! -f "$cache" ] || ! grep -q "CAUSAL_ATTENTION_BUILD_TESTS:BOOL=ON" "$cache" ||
    ! grep -q "CAUSAL_ATTENTION_BUILD_BENCH_PROBE:BOOL=ON" "$cache"; then
    configure tests
  fi
  banner "building"
  cmake --build "$ROOT/build"
}

# pytest_in_shards COMMAND...: runs COMMAND, a pytest run, as two processes at once, each on half
# of the tests it collects (CAUSAL_ATTENTION_TEST_SHARD, tests/python/attention_testing/
# shards.py); fails if either fails. Most tests are small calls that keep one core busy with
# Python, so one process leaves the second core idle: the whole suite took 245-364 s as two
# shards (the slower one, fresh-clone CI runs of 2026-12-05) against ~545 s as one process
# (Intel Xeon with AMX, 2 cores). OMP_WAIT_POLICY=PASSIVE: OpenMP's idle workers sleep instead
# of spinning on the core the other shard needs. The first shard prints as it runs, the second's
# output follows when both are done.
pytest_in_shards() {
  local log status=0 second
  log="$(mktemp)"
  OMP_WAIT_POLICY=PASSIVE CAUSAL_ATTENTION_TEST_SHARD=1/2 "$@" >"$log" 2>&1 &
  second=$!
  OMP_WAIT_POLICY=PASSIVE CAUSAL_ATTENTION_TEST_SHARD=0/2 "$@" || status=1
  wait "$second" || status=1
  banner "the second shard"
  cat "$log"
  rm -f "$log"
  return "$status"
}

setup_everything() {
  ensure_system_packages
  ensure_python
  build
}
