#!/usr/bin/env bash
# The AddressSanitizer + UndefinedBehaviorSanitizer run (CI runs it after scripts/test.sh):
#   1. builds the op library and the GoogleTest binaries with -fsanitize=address,undefined in
#      build-asan/ (incremental: a second run rebuilds only what changed). The sanitized library
#      goes to build-asan/package/causal_attention/, next to a copy of the package's Python files,
#      never over the normal causal_attention/libcausal_attention_ops.so;
#   2. runs ctest: every C++ test, the bad-input battery and the std::thread tests included,
#      except the AOTInductor package tests (below);
#   3. runs a Python subset with the ASan runtime preloaded, importing that sanitized copy.
# Exits non-zero on any failing test and on any sanitizer report (reports are collected in
# build-asan/reports/ and printed). Installs nothing beyond what scripts/setup_env.sh does.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ensure_system_packages
ensure_python

# Preset "asan" of CMakePresets.json builds there, and writes the library to $PACKAGE.
BUILD="$ROOT/build-asan"
PACKAGE_ROOT="$BUILD/package"
PACKAGE="$PACKAGE_ROOT/causal_attention"
REPORTS="$BUILD/reports"

# The Python subset (the whole suite would not fit CI's budget with the build): the robustness
# files (bad inputs, numerics, faults, threads and forked DataLoader workers, and the fuzz at a
# quarter of its examples: CAUSAL_ATTENTION_FUZZ_SCALE), then the op's and the module's
# correctness (key masks, attention masks, query offsets and given deltas, packed sequences and
# paged caches, 8-bit ones too, included) and semantics tests. Left out: gradcheck (float64
# gradients are fuzzed here); the determinism tests (60 s here: bitwise equality across thread
# counts is nothing a sanitizer checks, and the other files run the kernels on two threads); and
# the compile, model, training, DDP, context-parallel, benchmark, export, memory and interop
# tests, which add run time but no op inputs of a new kind (the ring's calls are the query-offset
# tests' calls; a compiled graph calls the kernels the eager tests call, and its time goes to
# Inductor's code generation).
PYTHON_TESTS=(
  tests/python/ops/test_bad_input.py
  tests/python/ops/test_numerics.py
  tests/python/ops/test_faults.py
  tests/python/ops/test_concurrency.py
  tests/python/ops/test_fuzz.py
  tests/python/ops/test_semantics.py
  tests/python/ops/test_against_sdpa.py
  tests/python/ops/test_key_mask.py
  tests/python/ops/test_attn_mask.py
  tests/python/ops/test_query_offset.py
  tests/python/ops/test_paged_attention.py
  tests/python/ops/test_paged_attention_8bit.py
  tests/python/ops/test_varlen.py
  tests/python/integrations/test_sdpa_dropin.py
  tests/python/ops/test_opcheck.py
  tests/python/nn/test_module.py
  tests/python/nn/test_kv_cache.py
  tests/python/ops/test_attention_weights.py
)

# Reports go to files (one per reporting process), so that none is lost in a test's captured
# output and the summary can count them. halt_on_error: a UBSan report ends the process as an ASan
# one does. detect_leaks=0: CPython and torch keep memory until exit by design.
# allocator_may_return_null=1: test_faults.py's impossible allocations must fail the way torch
# expects (NULL, then RuntimeError), not abort the process.
rm -rf "$REPORTS"
mkdir -p "$REPORTS" "$PACKAGE"
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan"

started=$SECONDS
status=0
step() {  # step NAME COMMAND...: runs a step, records its outcome for the summary
  local name="$1"
  shift
  banner "$name"
  local t0=$SECONDS
  if "$@"; then
    SUMMARY+=("ok      $name ($((SECONDS - t0)) s)")
  else
    SUMMARY+=("FAILED  $name ($((SECONDS - t0)) s)")
    status=1
  fi
}
SUMMARY=()

# Only the kernel build that this CPU runs (CMakeLists.txt, CAUSAL_ATTENTION_ONLY_CAPABILITY): the
# others would be compiled under the sanitizers and never called. scripts/test.sh runs every
# build (tests/python/ops/test_instruction_sets.py), unsanitized.
configure_and_build() {
  local capability
  capability="$("$PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"
  case "$capability" in AVX512 | AVX2) ;; *) capability=DEFAULT ;; esac
  configure asan -DCAUSAL_ATTENTION_ONLY_CAPABILITY="$capability" && cmake --build "$BUILD"
}

copy_python_files() {
  # The package's Python files next to the sanitized library (copies, not links: the loader
  # resolves its own path to find the library).
  find "$PACKAGE" -name '*.py' -delete
  (cd "$ROOT/causal_attention" &&
    tar cf - --exclude='*.so' --exclude='*.torch_version' --exclude=__pycache__ .) |
    (cd "$PACKAGE" && tar xf -)
}

# Python with the sanitized package first on the path and the ASan runtime loaded first; then
# libstdc++, which python itself does not link: ASan intercepts __cxa_throw only if it is there
# when ASan starts (else the first C++ exception stops the process with a CHECK failure).
sanitized_python() {
  local preload
  preload="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libstdc++.so)"
  PYTHONPATH="$PACKAGE_ROOT:$ROOT" LD_PRELOAD="$preload" "$PY" "$@"
}

# The AOTInductor package tests are left out (preset asan does not build them): compiling a
# package runs g++ from inside the Python process, whose LD_PRELOAD would load the ASan runtime
# into the compiler too, and what they add is torch's generated wrapper code; the op calls inside
# it are our kernels, which the other tests run under the sanitizers.
run_ctest() {
  export CAUSAL_ATTENTION_INTEROP_DIR="$BUILD/interop"
  sanitized_python "$ROOT/tests/fixtures/export_torchscript_model.py" \
    "$CAUSAL_ATTENTION_INTEROP_DIR" &&
    (cd "$BUILD" && ctest --output-on-failure -j2)
}

run_python_subset() {
  # -P and the check below: the tests must import the sanitized copy, not the repo's package
  # (pyproject.toml's pytest pythonpath puts the repo first). Two shards at once (setup_env.sh).
  local run_pytest="
import sys
import causal_attention
import pytest

if not causal_attention.__file__.startswith('$PACKAGE/'):
    sys.exit(f'imported {causal_attention.__file__}, not the sanitized package in $PACKAGE')
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))
"
  (cd "$ROOT" && CAUSAL_ATTENTION_FUZZ_SCALE=0.25 pytest_in_shards sanitized_python -P -c \
    "$run_pytest" "${PYTHON_TESTS[@]}")
}

step "build (ASan + UBSan) in $BUILD" configure_and_build
if [ "$status" -eq 0 ]; then
  copy_python_files
  step "ctest under ASan + UBSan" run_ctest
  step "pytest subset under ASan + UBSan (${#PYTHON_TESTS[@]} files)" run_python_subset
fi

# A file in $REPORTS is an error report if it says so; otherwise it holds warnings only (ASan
# notes each allocation it refuses under allocator_may_return_null, as test_faults.py expects).
reports=()
for log in "$REPORTS"/*; do
  [ -e "$log" ] || continue
  if grep -qE "ERROR: AddressSanitizer|runtime error:|CHECK failed|SUMMARY: .*Sanitizer" "$log"; then
    reports+=("$log")
    banner "sanitizer report $log"
  else
    banner "sanitizer warnings (not errors) $log"
  fi
  cat "$log"
done

echo
banner "sanitize.sh summary ($((SECONDS - started)) s)"
printf '    %s\n' "${SUMMARY[@]}"
echo "    sanitizer reports: ${#reports[@]}"
if [ "${#reports[@]}" -ne 0 ]; then
  status=1
fi
exit "$status"
