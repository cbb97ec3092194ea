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
set -e
echo "test.sh: $(grep -E 'tests passed|tests failed' ctest.log | tail -n1)"
exit "$status"
