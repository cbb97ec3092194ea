#!/usr/bin/env bash
# One device call for the Hopper pipeline (issue 4): GPU tests, then `megamoe bench`.
#
#   bench/pipeline_device_run.sh [gtest-filter] [bench args...]
#
# Uses binaries prebuilt on the (GPU-less) development machine and carried in .carry/pipe/ when
# they start here; otherwise builds with CMake + ninja on this machine. Logs go to $OUT (or
# ./out when OUT is unset). Prints a short summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
FILTER="${1:-Sm90*}"
shift || true
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version --format=csv | tee "$OUT/gpu.txt"

TESTS=.carry/pipe/megamoe_gpu_tests
CLI=.carry/pipe/megamoe
if ! "$TESTS" --gtest_list_tests > /dev/null 2>&1 || ! "$CLI" --version > /dev/null 2>&1; then
  echo "prebuilt binaries do not start here: building" | tee "$OUT/build.log"
  cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_ENABLE_CUDA=ON \
    -DMEGAMOE_BUILD_PYTHON=OFF >> "$OUT/build.log" 2>&1 &&
    ninja -C build-dev -j16 megamoe_gpu_tests megamoe_cli >> "$OUT/build.log" 2>&1 ||
    { tail -40 "$OUT/build.log"; exit 1; }
  TESTS=build-dev/tests/megamoe_gpu_tests
  CLI=build-dev/megamoe
fi
TEST_TIMEOUT="${TEST_TIMEOUT:-300}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-240}"

timeout "$TEST_TIMEOUT" "$TESTS" --gtest_filter="$FILTER" 2>&1 | tee "$OUT/gpu_tests.log"
echo "gpu tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.log"

if [ "$#" -gt 0 ]; then
  timeout "$BENCH_TIMEOUT" "$CLI" bench --json "$OUT/bench.jsonl" "$@" 2>&1 | tee "$OUT/bench.log"
  echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
fi

echo "==== summary"
grep -E "^\[  (PASSED|FAILED) |^\[==========\]|layer    \]" "$OUT/gpu_tests.log" | tail -60
[ -f "$OUT/bench.log" ] && grep -vE "^$" "$OUT/bench.log" | tail -40
