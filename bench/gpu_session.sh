#!/usr/bin/env bash
# One device call that runs every GPU check of the project on an H200 (the device time of a
# session is short, so everything shares one machine start):
#   1. trains the example model (examples/kimi_mini) in the background while megamoe builds;
#   2. the GPU tests (megamoe_gpu_tests Sm90*), the Python GPU tests (python/test.sh);
#   3. the example model's GPU gate (ModelGpu*) on the freshly trained checkpoint;
#   4. the side-by-side comparison with the peers (bench/peers/compare.py, runs `megamoe bench`);
#   5. the sm90 soak (tests/gpu/run_reliability.sh soak) with whatever time is left.
#
#   bench/gpu_session.sh [SRC_DIR]
#
# SRC_DIR: the source tree to build (default: this checkout). The lead exports the revision
# under test with `git archive HEAD | tar -x -C .carry/src` so that uncommitted work in the
# checkout cannot leak into the measured build. Needs carry [".carry", ".whl"]
# (bench/prepare_carry.sh; bench/peers/fetch_wheels.sh). Writes $OUT/log.txt (summary of every
# step), $OUT/logs.tgz (full logs), $OUT/km/* (trained checkpoint), $OUT/peers.* (comparison).
set -uo pipefail
ROOT=$PWD
SRC=$(cd "${1:-.}" && pwd)
OUT=${OUT:-$ROOT/out}
LOG=$OUT/log.txt
LOGS=/tmp/session-logs
mkdir -p "$OUT" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
t0=$(date +%s)
say() { echo "== +$(( $(date +%s) - t0 ))s $*" | tee -a "$LOG"; }
keep_logs() { tar czf "$OUT/logs.tgz" -C /tmp session-logs 2>/dev/null; }
trap keep_logs EXIT

cd "$SRC"
[ -e .whl ] || ln -s "$ROOT/.whl" .whl
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader >>"$LOG"
echo "revision $(cat REVISION 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)" >>"$LOG"

say "train kimi_mini (${TRAIN_SECONDS:-180} s) in the background"
(bash examples/kimi_mini/train_on_device.sh /tmp/km "${TRAIN_SECONDS:-180}" 6 >"$LOGS/train.log" 2>&1
 echo "train exit $?" >>"$LOGS/train.log") &
train_pid=$!

say "build"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_BUILD_PYTHON=ON \
  -DMEGAMOE_DEPS_DIR="$ROOT/.carry/deps" >"$LOGS/build.log" 2>&1 &&
  ninja -C build -j10 >>"$LOGS/build.log" 2>&1
rc=$?
say "build exit $rc"
if [ "$rc" != 0 ]; then grep -E "error|Error" "$LOGS/build.log" | head -40 >>"$LOG"; wait; exit 1; fi

say "gpu tests (Sm90*)"
timeout 200 build/tests/megamoe_gpu_tests --gtest_filter='Sm90*:Reliability*:-*Bench*:ReliabilitySoak*' \
  >"$LOGS/gpu_tests.log" 2>&1
echo "exit $?" >>"$LOGS/gpu_tests.log"
grep -E "^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran|^exit" "$LOGS/gpu_tests.log" | tail -30 >>"$LOG"

say "python tests"
timeout 180 bash python/test.sh build >"$LOGS/python.log" 2>&1
echo "exit $?" >>"$LOGS/python.log"
tail -15 "$LOGS/python.log" >>"$LOG"

say "wait for training"
wait "$train_pid"
tail -30 "$LOGS/train.log" >>"$LOG"
mkdir -p "$OUT/km"
for f in config.json model.safetensors train_log.json; do
  cp "/tmp/km/$f" "$OUT/km/" && cp "/tmp/km/$f" examples/kimi_mini/
done

say "model GPU gate"
timeout 150 build/tests/megamoe_gpu_tests --gtest_filter='ModelGpu*' >"$LOGS/model_gpu.log" 2>&1
echo "exit $?" >>"$LOGS/model_gpu.log"
tail -25 "$LOGS/model_gpu.log" >>"$LOG"

say "peers comparison"
timeout "${PEERS_SECONDS:-210}" python3 bench/peers/compare.py --megamoe-bin build/megamoe --out /tmp/peers \
  --shapes kimi-k3,deepseek-v3 --warm-parallel 3 --point-budget-s 0.1 --megamoe-timeout 90 \
  --peer-timeout 70 --total-timeout 150 >"$LOGS/peers.log" 2>&1
echo "exit $?" >>"$LOGS/peers.log"
tail -70 "$LOGS/peers.log" >>"$LOG"
for f in peers.jsonl table.md peers.png; do cp "/tmp/peers/$f" "$OUT/peers.${f#peers.}" 2>/dev/null; done
cp /tmp/peers/megamoe_bench.jsonl "$LOGS/" 2>/dev/null

left=$(( 560 - ($(date +%s) - t0) ))
say "soak (${left} s left)"
if [ "$left" -gt 40 ]; then
  OUT="$LOGS" MEGAMOE_SOAK_MAX_SECONDS=$(( left - 30 )) timeout "$left" \
    bash tests/gpu/run_reliability.sh build soak >"$LOGS/soak.log" 2>&1
  cat "$LOGS/reliability_summary.txt" >>"$LOG" 2>/dev/null
fi
say "done"
