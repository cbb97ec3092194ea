#!/usr/bin/env bash
# One device call that runs the GPU checks of the project on an H200 (a session's device time is
# short, so everything shares one machine start). STEPS picks and orders them (default:
# "tests model python gemmbench"):
#   train       trains the example model (examples/kimi_mini, TRAIN_SECONDS) ALONE: sharing the
#               GPU slowed training and made two layer tests run out of memory
#   tests       megamoe_gpu_tests Sm90* (every shipped GEMM tile, the layer on the policy, the
#               serial tiles and forced tiles) and ReliabilitySanitize*
#   memcheck    compute-sanitizer memcheck on the small reliability driver
#   model       the example model's GPU gate (ModelGpu*)
#   python      the Python tests (the extension is built there, in the background from the
#               start, since its Python is not this machine's), with faulthandler on, after the
#               crash reproduction of issue 6
#   gemmbench   the grouped-GEMM benchmark of every shipped tile (megamoe_gemm_bench)
#   readbench   what one launch reads at the decode GEMMs' weight sizes (megamoe_bench_read_ceiling)
#   layerbench  `megamoe bench` on kimi-k3 and deepseek-v3 with the default options
#               (LAYERBENCH_SERIAL=1: also --tile serial; LAYERBENCH_NOPDL=1: also --no-pdl)
#   ncu         Nsight Compute on the GEMMs of `megamoe bench` (NCU_RUNS, NCU_FULL)
#   reliability tests/gpu/run_reliability.sh (REL_PART: all, soak or sanitizers)
#   peers       the side-by-side comparison with the peers (bench/peers/compare.py)
# Benchmarks should come last: the Python build runs in the background until `python` waits.
#
#   STEPS="..." bench/gpu_session.sh SRC_DIR [BIN_DIR]
#
# SRC_DIR: the source tree under test (the lead exports the committed revision with
# `git archive HEAD | tar -x -C .carry/src`, so uncommitted work cannot leak into the run).
# BIN_DIR: prebuilt `megamoe`, `megamoe_gpu_tests`, `megamoe_gemm_bench` and
# `megamoe_bench_read_ceiling` (built on the development machine from the same SRC_DIR, whose
# absolute path the tests have compiled in: SRC_BUILT_AT names it). Needs
# carry [".carry", ".whl"]. Writes $OUT/log.txt (summary of every step), $OUT/logs.tgz (full
# logs), $OUT/km/* (a trained checkpoint), $OUT/*.jsonl (benchmarks) and $OUT/peers.*.
set -uo pipefail
ROOT=$PWD
SRC=$(cd "${1:?usage: gpu_session.sh SRC_DIR [BIN_DIR]}" && pwd)
BIN=$(cd "${2:-$SRC/build}" && pwd)
OUT=${OUT:-$ROOT/out}
LOG=$OUT/log.txt
LOGS=/tmp/session-logs
mkdir -p "$OUT" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
t0=$(date +%s)
say() { echo "== +$(( $(date +%s) - t0 ))s $*" | tee -a "$LOG"; }
keep_logs() { tar czf "$OUT/logs.tgz" -C /tmp session-logs 2>/dev/null; }
trap keep_logs EXIT TERM

# The tests find examples/ through the source path compiled into them.
if [ -n "${SRC_BUILT_AT:-}" ] && [ ! -e "$SRC_BUILT_AT" ]; then
  mkdir -p "$(dirname "$SRC_BUILT_AT")" && ln -s "$SRC" "$SRC_BUILT_AT"
fi
cd "$SRC"
[ -e .whl ] || ln -s "$ROOT/.whl" .whl
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader >>"$LOG"
echo "revision $(cat REVISION 2>/dev/null || echo unknown)" >>"$LOG"
TESTS=$BIN/tests/megamoe_gpu_tests
[ -x "$TESTS" ] || TESTS=$BIN/megamoe_gpu_tests
CLI=$BIN/megamoe
export MEGAMOE_CLI="$CLI"  # the Python GPU tests cross-check against it

GEMMBENCH=$BIN/tests/megamoe_gemm_bench
[ -x "$GEMMBENCH" ] || GEMMBENCH=$BIN/megamoe_gemm_bench

STEPS=${STEPS:-tests model python gemmbench}
has() { [[ " $STEPS " == *" $1 "* ]]; }
pybuild_pid=""
if has python; then
  say "python extension build in the background"
  # MEGAMOE_PY_CRASH_TRACE: the crash backtrace that the repro step below turns on.
  (cmake -S . -B /tmp/build-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_BUILD_PYTHON=ON \
     -DMEGAMOE_PY_CRASH_TRACE=ON -DMEGAMOE_BUILD_TESTS=OFF -DMEGAMOE_BUILD_TOOLS=OFF -DMEGAMOE_DEPS_DIR="$ROOT/.carry/deps" &&
   ninja -C /tmp/build-py -j8) >"$LOGS/python_build.log" 2>&1 &
  pybuild_pid=$!
fi

# gtest_step LOG TIMEOUT FILTER GREP_PATTERN LINES: one run of the GPU test binary; its full
# output goes to $LOGS/LOG, the lines matching GREP_PATTERN (the last LINES) to the summary.
gtest_step() {
  timeout "$2" "$TESTS" --gtest_filter="$3" >"$LOGS/$1" 2>&1
  echo "exit $?" >>"$LOGS/$1"
  grep -E "$4" "$LOGS/$1" | tail -n "$5" >>"$LOG"
}

# bench_step NAME TIMEOUT BINARY GREP_PATTERN: one run of a benchmark program; its full output
# goes to $LOGS/NAME.log, the lines matching GREP_PATTERN to $OUT/NAME.txt, its last lines to the
# summary.
bench_step() {
  timeout "$2" "$3" >"$LOGS/$1.log" 2>&1
  echo "exit $?" >>"$LOGS/$1.log"
  grep -E "$4" "$LOGS/$1.log" >>"$OUT/$1.txt"
  tail -3 "$LOGS/$1.log" >>"$LOG"
}

for step in $STEPS; do
  case $step in
  train)
    say "train kimi_mini (${TRAIN_SECONDS:-185} s), alone"
    bash examples/kimi_mini/train_on_device.sh /tmp/km "${TRAIN_SECONDS:-185}" 12 >"$LOGS/train.log" 2>&1
    echo "train exit $?" >>"$LOGS/train.log"
    grep -v "^step" "$LOGS/train.log" | tail -12 >>"$LOG"
    mkdir -p "$OUT/km"
    for f in config.json model.safetensors train_log.json; do
      cp "/tmp/km/$f" "$OUT/km/" && cp "/tmp/km/$f" examples/kimi_mini/
    done ;;
  tests)
    say "gpu tests"
    gtest_step gpu_tests.log 240 "${TESTS_FILTER:-Sm90*:ReliabilitySanitize*:-*Bench*}" \
      "^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests? ran|^exit|fraction|flip|Failure" 40 ;;
  memcheck)
    say "compute-sanitizer memcheck (small layer driver)"
    timeout 100 compute-sanitizer --tool memcheck --error-exitcode 99 "$TESTS" \
      --gtest_filter='ReliabilitySanitize.*' >"$LOGS/memcheck.log" 2>&1
    echo "exit $?" >>"$LOGS/memcheck.log"
    grep -E "ERROR SUMMARY|PASSED|FAILED|^exit" "$LOGS/memcheck.log" | tail -5 >>"$LOG" ;;
  model)
    say "model GPU gate"
    gtest_step model_gpu.log 150 'ModelGpu*' "kimi_mini|OK|FAILED|PASSED|Failure|^exit" 10 ;;
  python)
    say "python tests"
    wait "$pybuild_pid"; echo "python build exit $?" | tee -a "$LOG"
    tail -3 "$LOGS/python_build.log" >>"$LOG"
    python3 -c "import nanobind, sys; print('python', sys.version.split()[0], 'nanobind', nanobind.__version__)" >>"$LOG" 2>&1
    g++ --version | head -1 >>"$LOG" 2>&1
    echo "g++ -print-file-name=libstdc++.so: $(g++ -print-file-name=libstdc++.so); LDFLAGS='${LDFLAGS:-}'" >>"$LOG"
    readelf -d /tmp/build-py/python/megamoe/_megamoe*.so 2>&1 | grep NEEDED >>"$LOG"
    # The first C++ error raised in the extension crashed this image once (issue 6: libstdc++
    # linked statically; the NEEDED line above shows the fix): the minimal reproduction, without
    # and with torch loaded first, with a native backtrace if it crashes again.
    for flag in "" --torch; do
      MEGAMOE_CRASH_TRACE=1 PYTHONPATH=/tmp/build-py/python timeout 60 python3 \
        tests/python/repro_forward_error.py $flag >>"$LOG" 2>&1
      echo "repro_forward_error.py $flag: exit $?" >>"$LOG"
    done
    PYTHONPATH=/tmp/build-py/python timeout 200 python3 -X faulthandler -m pytest -q -rs -p no:cacheprovider tests/python \
      >"$LOGS/python.log" 2>&1
    echo "exit $?" >>"$LOGS/python.log"
    grep -E "passed|failed|SKIPPED|Error|Fatal|^exit|\.py\", line" "$LOGS/python.log" | tail -30 >>"$LOG" ;;
  gemmbench)
    say "grouped GEMM benchmark (every shipped tile)"
    bench_step gemm_bench "${GEMMBENCH_SECONDS:-200}" "$GEMMBENCH" "bench|copy|^exit|FAILED" ;;
  readbench)
    say "read ceiling by size (megamoe_bench_read_ceiling)"
    bench_step read_ceiling "${READBENCH_SECONDS:-150}" "$BIN/megamoe_bench_read_ceiling" "^\[read\]|^exit" ;;
  layerbench)
    say "layer benchmark (default options, then --tile serial)"
    timeout 150 "$CLI" bench --shape kimi-k3,deepseek-v3 --replays 5 --git-rev "$(cat REVISION 2>/dev/null || echo unknown)" \
      --json "$OUT/layer_default.jsonl" >"$OUT/layer_default.txt" 2>&1
    echo "exit $?" >>"$OUT/layer_default.txt"
    if [ "${LAYERBENCH_SERIAL:-1}" = 1 ]; then
      timeout 150 "$CLI" bench --tile serial --shape kimi-k3,deepseek-v3 --replays 5 \
        --git-rev "$(cat REVISION 2>/dev/null || echo unknown)-serial" --json "$OUT/layer_serial.jsonl" \
        >"$OUT/layer_serial.txt" 2>&1
      echo "exit $?" >>"$OUT/layer_serial.txt"
    fi
    if [ "${LAYERBENCH_NOPDL:-0}" = 1 ]; then
      # The same with plain launches (no programmatic dependent launch): what PDL gains.
      timeout 150 "$CLI" bench --no-pdl --shape kimi-k3,deepseek-v3 --replays 5 \
        --git-rev "$(cat REVISION 2>/dev/null || echo unknown)-nopdl" --json "$OUT/layer_nopdl.jsonl" \
        >"$OUT/layer_nopdl.txt" 2>&1
      echo "exit $?" >>"$OUT/layer_nopdl.txt"
    fi
    tail -n 2 "$OUT/layer_default.txt" "$OUT/layer_serial.txt" "$OUT/layer_nopdl.txt" >>"$LOG" 2>/dev/null ;;
  ncu)
    # Where the GEMMs' time goes: the first NCU_COUNT (default 2: L1 and L2) grouped-GEMM launches
    # of `megamoe bench --shape S --tokens T` for each S:T[:TILE] in NCU_RUNS (default
    # kimi-k3:64; TILE: a tile name forced with --tile).
    # NCU_FULL=1: the full section set plus per-instruction (SASS) samples; the details in $OUT,
    # the source page summarized by bench/ncu_sass_summary.py and kept gzipped.
    . "$ROOT/bench/ncu_full.sh"
    for run in ${NCU_RUNS:-kimi-k3:64}; do
      IFS=: read -r shape nt ftile <<<"$run"
      tag="${shape}_t${nt}${ftile:+_tile$ftile}"
      say "nsight compute on the GEMMs ($tag)"
      if [ "${NCU_FULL:-0}" = 1 ]; then
        ncu_full "$tag" "$OUT" "$LOGS/ncu_$tag.log" 200 \
          "$CLI" bench --tile "${ftile:-auto}" --shape "$shape" --tokens "$nt" --replays 1
      else
        timeout 150 "$NCU" -k regex:grouped_gemm \
          --launch-count "${NCU_COUNT:-2}" --section SpeedOfLight \
          --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
          --section Occupancy --section LaunchStats "$CLI" bench --tile "${ftile:-auto}" --shape "$shape" \
          --tokens "$nt" --replays 1 >"$OUT/ncu_$tag.txt" 2>&1
        echo "exit $?" >>"$OUT/ncu_$tag.txt"
      fi
      grep -E "grouped_gemm|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued|Issued Warp|Executed Ipc A|^exit" \
        "$OUT/ncu_$tag.txt" | head -30 >>"$LOG"
    done ;;
  reliability)
    say "reliability (${REL_PART:-all})"
    OUT="$OUT/reliability" timeout 560 bash tests/gpu/run_reliability.sh "$BIN" "${REL_PART:-all}" >"$LOGS/reliability.log" 2>&1
    echo "exit $?" >>"$LOGS/reliability.log"
    cat "$OUT/reliability/reliability_summary.txt" >>"$LOG" 2>/dev/null ;;
  peers)
    say "peers comparison"
    PYTHONPATH=/tmp/build-py/python timeout "${PEERS_SECONDS:-170}" python3 bench/peers/compare.py \
      --megamoe-bin "$CLI" --out /tmp/peers --shapes kimi-k3,deepseek-v3 --warm-parallel 3 \
      --point-budget-s 0.1 --megamoe-timeout 60 --peer-timeout 60 --total-timeout 110 \
      >"$LOGS/peers.log" 2>&1
    echo "exit $?" >>"$LOGS/peers.log"
    tail -60 "$LOGS/peers.log" >>"$LOG"
    for f in peers.jsonl table.md peers.png; do cp "/tmp/peers/$f" "$OUT/peers.${f#peers.}" 2>/dev/null; done
    cp /tmp/peers/*.jsonl "$LOGS/" 2>/dev/null ;;
  *) say "unknown step '$step'" ;;
  esac
done
[ -n "$pybuild_pid" ] && wait "$pybuild_pid" 2>/dev/null
say "done"
