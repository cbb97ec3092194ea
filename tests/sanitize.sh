#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer + UndefinedBehaviorSanitizer (docs/reliability.md).
#
#   tests/sanitize.sh              configure + build build-asan (CUDA off), run every cpu test
#   BUILD_DIR=/tmp/asan tests/sanitize.sh     another build folder
#   JOBS=2 tests/sanitize.sh       parallelism of the build and of ctest (default: nproc)
#   tests/sanitize.sh -R Reliability          extra arguments go to ctest
#
# Any sanitizer report fails the test that triggered it (halt_on_error / abort_on_error), so a
# clean run prints ctest's "100% tests passed". Exit status: ctest's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-asan}"
JOBS="${JOBS:-$(nproc)}"

# NOTES: -O1 keeps ASan builds fast to compile and the CPU reference fast enough to run the whole
# suite (-O0 makes the kimi-k3-shaped reference tests minutes long); -g1 gives line numbers in
# reports at a fraction of -g's compile cost.
cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DMEGAMOE_ENABLE_CUDA=OFF \
  -DMEGAMOE_SANITIZE=address,undefined \
  -DMEGAMOE_BUILD_TESTS=ON -DMEGAMOE_BUILD_TOOLS=ON >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target megamoe_tests megamoe_cli

export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
start=$(date +%s)
status=0
# Timing tests (names ending in IsFast) bound the speed of the uninstrumented build: excluded.
# The example model's gate (ModelGate.*: 200 problems decoded through 6 layers, once per test
# process) takes over 5 minutes per test under ASan: excluded too; the model's loading and
# tokenizer tests (ModelTask.*) still run here.
ctest --test-dir "$BUILD_DIR" -L cpu -E 'IsFast$|^Model(Gate|Cli)\.' -j "$JOBS" --timeout 900 --output-on-failure "$@" || status=$?
echo "sanitize.sh: ASan+UBSan CPU tests finished in $(( $(date +%s) - start )) s, ctest exit $status"
exit $status
