#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer run of the CPU side:
#   1. a plain CMake build of the core with -DPAGEDATTN_SANITIZE=ON (no CUDA), the C++
#      tests and the Python module;
#   2. ctest (the C++ tests, leak checking on);
#   3. the CPU Python tests and a batch of API fuzz cases against that build, with the
#      ASan runtime preloaded into Python.
# Any sanitizer report aborts the process that hit it (-fno-sanitize-recover=all,
# halt_on_error=1), which fails this script.
#
# Usage: .ci/sanitize.sh   (inside a venv with the test extras; nanobind is installed
# into it when missing). Environment knobs: SANITIZE_BUILD_DIR (default
# build/sanitize), SANITIZE_JOBS (2), SANITIZE_FUZZ_CASES (20000), PYTHON (python3),
# SANITIZE_WITH_FRAMEWORKS=1 to let the interop tests import torch / jax / cupy (not
# instrumented themselves; hidden by default so that only pagedattn is under test).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
BUILD=${SANITIZE_BUILD_DIR:-$ROOT/build/sanitize}
JOBS=${SANITIZE_JOBS:-2}
FUZZ_CASES=${SANITIZE_FUZZ_CASES:-20000}
t_start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t_start )) s] $*"; }

if ! "$PYTHON" -c "import nanobind" 2>/dev/null; then
  "$PYTHON" -m pip install -q "nanobind>=2.4"
fi
NANOBIND_DIR=$("$PYTHON" -m nanobind --cmake_dir)
PY_EXE=$("$PYTHON" -c "import sys; print(sys.executable)")
GEN=()
command -v ninja > /dev/null && GEN=(-G Ninja)

stamp "configure ($BUILD)"
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPAGEDATTN_SANITIZE=ON -DPAGEDATTN_CUDA=OFF -DPAGEDATTN_BUILD_TESTS=ON -DPAGEDATTN_PYTHON=ON \
  -Dnanobind_DIR="$NANOBIND_DIR" -DPython_EXECUTABLE="$PY_EXE" > "$BUILD.configure.log" 2>&1 \
  || { cat "$BUILD.configure.log"; exit 1; }
stamp "build (-j$JOBS)"
cmake --build "$BUILD" -j "$JOBS"

# UBSan: stop at the first error with a stack trace. ASan: stop at the first error;
# report huge allocations as a failed allocation (bad_alloc / MemoryError) instead of
# aborting, since the fuzzer asks for absurd sizes on purpose.
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
ASAN_COMMON=halt_on_error=1:allocator_may_return_null=1:strict_string_checks=1:detect_stack_use_after_return=1

stamp "ctest"
ASAN_OPTIONS="$ASAN_COMMON:detect_leaks=1" ctest --test-dir "$BUILD" --output-on-failure

# The Python package against the sanitized build: the pure-Python sources plus the
# installed module and library, in a folder of its own on PYTHONPATH.
PKG=$BUILD/pkg
rm -rf "$PKG"
mkdir -p "$PKG/pagedattn"
cp -r python/pagedattn/. "$PKG/pagedattn/"
cmake --install "$BUILD" --prefix "$PKG/pagedattn" > /dev/null
LIBASAN=$(gcc -print-file-name=libasan.so)
LIBSTDCXX=$(gcc -print-file-name=libstdc++.so)
[ -f "$LIBASAN" ] || { echo "libasan.so not found (gcc -print-file-name=libasan.so)"; exit 1; }

# Hide the array frameworks (their importorskip tests then skip) unless asked not to.
HIDE=$BUILD/hidden-frameworks
rm -rf "$HIDE"
if [ "${SANITIZE_WITH_FRAMEWORKS:-0}" != 1 ]; then
  for fw in torch jax cupy; do
    mkdir -p "$HIDE/$fw"
    echo "raise ModuleNotFoundError('$fw is hidden from the sanitizer run (.ci/sanitize.sh)')" > "$HIDE/$fw/__init__.py"
  done
fi

run_py() {
  # Python itself is not instrumented: preload the ASan runtime, and libstdc++ with it
  # (ASan resolves __cxa_throw when it starts; without libstdc++ loaded by then, the first
  # C++ exception trips an ASan CHECK). CPython's arenas "leak" by design, so leak
  # checking is off here (ctest above does it).
  (cd "$BUILD" && env LD_PRELOAD="$LIBASAN $LIBSTDCXX" ASAN_OPTIONS="$ASAN_COMMON:detect_leaks=0" \
    PYTHONPATH="$PKG:$HIDE" PYTHONDONTWRITEBYTECODE=1 PAGEDATTN_NUM_THREADS=2 "$PYTHON" "$@")
}

run_py -c "import pagedattn, sys; assert pagedattn.__file__.startswith('$PKG'), pagedattn.__file__; \
print('sanitized pagedattn', pagedattn.__version__, 'from', pagedattn.__file__)"

stamp "CPU Python tests under ASan + UBSan"
# test_cpp.py builds the C++ tests and a consumer against the package: ctest above
# already ran those tests against this build. test_toolchain.py builds a package of its own
# (with a static C++ runtime, not instrumented); the plain pytest run of CI covers it. --capture=sys: a sanitizer report is
# written to file descriptor 2 just before the process exits, so pytest must not hold it.
run_py -m pytest "$ROOT/tests/python" -q -p no:cacheprovider --ignore="$ROOT/tests/python/test_cpp.py" \
  --ignore="$ROOT/tests/python/test_toolchain.py" \
  -o addopts="" -x --capture=sys

stamp "API fuzz under ASan + UBSan ($FUZZ_CASES cases)"
# The fuzzer is test harness (tests/python/harness), run as a script: it imports the
# sanitized pagedattn from PYTHONPATH, never a source copy.
run_py "$ROOT/tests/python/harness/fuzz.py" --cases "$FUZZ_CASES" --isolate 1000 --max-memory-mb 0

stamp "sanitizers clean"
