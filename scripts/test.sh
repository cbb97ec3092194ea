#!/usr/bin/env bash
# The tests on a fresh machine: install what is missing, build everything (Release; the CUDA
# parts too when nvcc is present, MEGAMOE_ENABLE_CUDA=OFF skips them), run ctest and print its
# summary. GPU tests skip with a printed reason on a machine without an sm_90 GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
BUILD_DIR="${MEGAMOE_BUILD_DIR:-build}"
JOBS="$(nproc)"
start=$(date +%s)
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DMEGAMOE_ENABLE_CUDA="${MEGAMOE_ENABLE_CUDA:-ON}"
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "test.sh: build took $(( $(date +%s) - start )) s"

cd "$BUILD_DIR"
set +e
ctest --output-on-failure -j "$JOBS" --timeout 900 2>&1 | tee ctest.log
status=${PIPESTATUS[0]}
cd - >/dev/null

# The Python package on the same build (only the extension is compiled anew), then the CPU
# suite under ASan+UBSan and a bounded fuzz pass (docs/reliability.md). Each keeps its own
# summary line; the exit status is non-zero when any part failed.
bash python/test.sh "$BUILD_DIR" 2>&1 | tee "$BUILD_DIR/python.log"
py_status=${PIPESTATUS[0]}
JOBS="$JOBS" bash tests/sanitize.sh 2>&1 | tee "$BUILD_DIR/sanitize.log"
asan_status=${PIPESTATUS[0]}
bash tests/fuzz/run.sh 2>&1 | tee "$BUILD_DIR/fuzz.log"
fuzz_status=${PIPESTATUS[0]}
set -e

echo "test.sh: python tests exit ${py_status}: $(grep -E '[0-9]+ passed' "$BUILD_DIR/python.log" | tail -n1)"
echo "test.sh: sanitizers exit ${asan_status}: $(grep -E 'tests passed|tests failed' "$BUILD_DIR/sanitize.log" | tail -n1)"
echo "test.sh: fuzz exit ${fuzz_status}"
for s in "$py_status" "$asan_status" "$fuzz_status"; do [ "$s" = 0 ] || status=1; done
echo "test.sh: total $(( $(date +%s) - start )) s"
# ctest's summary line last, as ctest printed it (what CI reads).
grep -E 'tests passed|tests failed' "$BUILD_DIR/ctest.log" | tail -n1
exit "$status"
