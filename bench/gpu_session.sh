#!/usr/bin/env bash
# One device call that runs every GPU check of the project on an H200 (a session's device time
# is short, so everything shares one machine start):
#   1. trains the example model (examples/kimi_mini) in the background;
#   2. the GPU tests (megamoe_gpu_tests Sm90*, Reliability*), compute-sanitizer memcheck on the
#      small reliability driver, and the Python GPU tests (the extension is built there: its
#      Python is not this machine's);
#   3. the example model's GPU gate (ModelGpu*) on the freshly trained checkpoint;
#   4. the side-by-side comparison with the peers (bench/peers/compare.py, runs `megamoe bench`).
#
#   bench/gpu_session.sh SRC_DIR [BIN_DIR]
#
# SRC_DIR: the source tree under test (the lead exports the committed revision with
# `git archive HEAD | tar -x -C .carry/src`, so uncommitted work cannot leak into the run).
# BIN_DIR: prebuilt `megamoe` and `megamoe_gpu_tests` (built on the development machine from the
# same SRC_DIR, whose absolute path the tests have compiled in: SRC_BUILT_AT names it). Needs
# carry [".carry", ".whl"]. Writes $OUT/log.txt (summary of every step), $OUT/logs.tgz (full
# logs), $OUT/km/* (the trained checkpoint) and $OUT/peers.* (the comparison).
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

say "train kimi_mini (${TRAIN_SECONDS:-170} s) in the background"
(bash examples/kimi_mini/train_on_device.sh /tmp/km "${TRAIN_SECONDS:-170}" 6 >"$LOGS/train.log" 2>&1
 echo "train exit $?" >>"$LOGS/train.log") &
train_pid=$!

say "python extension build in the background"
(cmake -S . -B /tmp/build-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_BUILD_PYTHON=ON \
   -DMEGAMOE_BUILD_TESTS=OFF -DMEGAMOE_BUILD_TOOLS=OFF -DMEGAMOE_DEPS_DIR="$ROOT/.carry/deps" &&
 ninja -C /tmp/build-py -j8) >"$LOGS/python_build.log" 2>&1 &
pybuild_pid=$!

say "gpu tests"
timeout 200 "$TESTS" --gtest_filter='Sm90*:ReliabilitySanitize*:-*Bench*' >"$LOGS/gpu_tests.log" 2>&1
echo "exit $?" >>"$LOGS/gpu_tests.log"
grep -E "^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests? ran|^exit|fraction|flip" "$LOGS/gpu_tests.log" | tail -40 >>"$LOG"

say "compute-sanitizer memcheck (small layer driver)"
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 99 "$TESTS" \
  --gtest_filter='ReliabilitySanitize.*' >"$LOGS/memcheck.log" 2>&1
echo "exit $?" >>"$LOGS/memcheck.log"
grep -E "ERROR SUMMARY|PASSED|FAILED|^exit" "$LOGS/memcheck.log" | tail -5 >>"$LOG"

say "python tests"
wait "$pybuild_pid"; echo "python build exit $?" | tee -a "$LOG"
PYTHONPATH=/tmp/build-py/python timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/python \
  >"$LOGS/python.log" 2>&1
echo "exit $?" >>"$LOGS/python.log"
grep -E "passed|failed|SKIPPED|Error" "$LOGS/python.log" | tail -20 >>"$LOG"

say "wait for training"
wait "$train_pid"
tail -25 "$LOGS/train.log" >>"$LOG"
mkdir -p "$OUT/km"
for f in config.json model.safetensors train_log.json; do
  cp "/tmp/km/$f" "$OUT/km/" && cp "/tmp/km/$f" examples/kimi_mini/
done

say "model GPU gate"
timeout 150 "$TESTS" --gtest_filter='ModelGpu*' >"$LOGS/model_gpu.log" 2>&1
echo "exit $?" >>"$LOGS/model_gpu.log"
tail -25 "$LOGS/model_gpu.log" >>"$LOG"

say "peers comparison"
PYTHONPATH=/tmp/build-py/python timeout "${PEERS_SECONDS:-170}" python3 bench/peers/compare.py \
  --megamoe-bin "$CLI" --out /tmp/peers --shapes kimi-k3,deepseek-v3 --warm-parallel 3 \
  --point-budget-s 0.1 --megamoe-timeout 60 --peer-timeout 60 --total-timeout 110 \
  >"$LOGS/peers.log" 2>&1
echo "exit $?" >>"$LOGS/peers.log"
tail -60 "$LOGS/peers.log" >>"$LOG"
for f in peers.jsonl table.md peers.png; do cp "/tmp/peers/$f" "$OUT/peers.${f#peers.}" 2>/dev/null; done
cp /tmp/peers/*.jsonl "$LOGS/" 2>/dev/null
say "done"
