# Sourced by the one-call device scripts (ep_gpu_check.sh, fp8_gpu_check.sh) after they set ROOT
# (the tree) and STEPS: the environment of the GPU machine and the steps they share.
#   - OUT (default $ROOT/out) created, LOG=$OUT/log.txt; has STEP: whether STEPS names it;
#   - NCCL: torch's nvidia-nccl wheel's libnccl first on the library path (the machine's own is
#     older than the headers the binaries were built with: docs/design.md), NVLS off;
#   - say MSG: a timestamped line in $LOG;
#   - the source path the test binaries have compiled in ($SRC_BUILT_AT, default /work/main)
#     linked to this tree, so they find examples/;
#   - start_python_build JOBS: the Python extension built from this tree into /tmp/build-py in the
#     background (log $OUT/python_build.log, pid $pybuild), with .carry/deps and its NCCL headers;
#   - run_gpu_tests BIN PATTERN: BIN/megamoe_gpu_tests (every test, or $TESTS_FILTER) into
#     $OUT/gpu_tests.log, its summary and the lines matching PATTERN into $LOG;
#   - run_python_tests BIN: waits for that build, then the sm90 Python tests ($PYTESTS) into
#     $OUT/python.log, the summary into $LOG.
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
has() { [[ " $STEPS " == *" $1 "* ]]; }
export NCCL_NVLS_ENABLE=0
NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
say() { echo "== +$(( $(date +%s) - t0 ))s $*" | tee -a "$LOG"; }
SRC_BUILT_AT=${SRC_BUILT_AT:-/work/main}
[ -e "$SRC_BUILT_AT" ] || { mkdir -p "$(dirname "$SRC_BUILT_AT")" && ln -s "$ROOT" "$SRC_BUILT_AT"; }
start_python_build() {
  (cmake -S . -B /tmp/build-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_BUILD_PYTHON=ON \
     -DMEGAMOE_BUILD_TESTS=OFF -DMEGAMOE_BUILD_TOOLS=OFF -DMEGAMOE_DEPS_DIR="$ROOT/.carry/deps" \
     -DMEGAMOE_NCCL_INCLUDE_DIR="$ROOT/.carry/deps/nccl/include" &&
   ninja -C /tmp/build-py -j"${1:-12}") >"$OUT/python_build.log" 2>&1 &
  pybuild=$!
}
run_gpu_tests() {
  say "gpu tests (${TESTS_FILTER:-all})"
  timeout ${TESTS_TIMEOUT:-280} "$1/megamoe_gpu_tests" --gtest_filter="${TESTS_FILTER:-*}" \
    >"$OUT/gpu_tests.log" 2>&1
  echo "exit $?" >>"$OUT/gpu_tests.log"
  grep -E "^\[  (PASSED|FAILED|SKIPPED)|FAILED|$2|^exit|Failure" "$OUT/gpu_tests.log" | head -60 >>"$LOG"
}
run_python_tests() {
  say "python sm90 tests"
  wait "$pybuild"; echo "python build exit $?" >>"$LOG"; tail -2 "$OUT/python_build.log" >>"$LOG"
  PYTHONPATH=/tmp/build-py/python MEGAMOE_CLI="$1/megamoe" timeout 150 python3 -m pytest -q -rs \
    -p no:cacheprovider ${PYTESTS:-tests/python/test_gpu.py tests/python/test_layer.py} \
    >"$OUT/python.log" 2>&1
  echo "exit $?" >>"$OUT/python.log"
  grep -E "passed|failed|Error|^exit" "$OUT/python.log" | tail -20 >>"$LOG"
}
