#!/usr/bin/env bash
# One device call with the expert-parallel checks (issue "Expert parallelism across GPUs"): the
# GPU tests of EP and of the example model at EP 1/2/8, `megamoe run --ep-size` and
# `megamoe model --ep-size` on virtual ranks, the Python EP tests (the extension is built there in
# the background) and megamoe_ep_bench. Writes $OUT/log.txt, $OUT/ep_bench.jsonl and $OUT/*.log.
#
#   STEPS="tests cli model python bench" bench/ep_gpu_check.sh BIN_DIR
#
# PYTESTS replaces the Python test files of the python step (default: the EP and error tests).
# BIN_DIR holds megamoe, megamoe_gpu_tests, megamoe_tests and megamoe_ep_bench built on the
# development machine from this tree (their compiled-in source path is linked to this tree).
# Needs carry [".carry/deps", BIN_DIR]. NCCL: the libnccl of torch's nvidia-nccl wheel goes first
# on the library path, and the extension built there takes the matching headers from
# .carry/deps/nccl/include (bench/prepare_carry.sh; the machine's own are older: docs/design.md).
set -uo pipefail
BIN=$(cd "${1:?usage: ep_gpu_check.sh BIN_DIR}" && pwd)
ROOT=$PWD
STEPS=${STEPS:-tests cli model python ncclpy bench}
. "$(dirname "$0")/device_common.sh"
say "nccl lib: ${NCCL_LIB:-none}"
# megamoe_tests' CLI cases look for the program in the folder it was built in (BUILT_DIR).
BUILT_DIR=${BUILT_DIR:-/work/main/build-new}
[ -e "$BUILT_DIR/megamoe" ] || { mkdir -p "$BUILT_DIR" && ln -s "$BIN/megamoe" "$BUILT_DIR/megamoe"; }

if has python || has ncclpy; then start_python_build 10; fi
if has tests; then
  say "gpu tests Ep* ModelGpu*"
  timeout 300 "$BIN/megamoe_gpu_tests" --gtest_filter='Ep*:ModelGpu*' >"$OUT/gpu_tests.log" 2>&1
  echo "exit $?" >>"$OUT/gpu_tests.log"
  grep -E "^\[  (PASSED|FAILED|SKIPPED)|FAILED|INFO|^exit|Failure" "$OUT/gpu_tests.log" | head -40 >>"$LOG"
  timeout 120 "$BIN/megamoe_tests" --gtest_filter='Cli.Ep*' >"$OUT/cli_tests.log" 2>&1
  echo "exit $?" >>"$OUT/cli_tests.log"
  grep -E "^\[  (PASSED|FAILED)|Failure|^exit" "$OUT/cli_tests.log" >>"$LOG"
fi
if has cli; then
  say "megamoe run --ep-size"
  for args in "--ep-size 4 --tokens 64" "--ep-size 2 --tokens 0" "--shape deepseek-v3 --tokens 64 --ep-size 8" \
              "--shape kimi-k3 --tokens 8 --ep-size 8" "--ep-size 4 --tokens 64 --ep-max-recv-rows 1"; do
    echo "--- megamoe run $args" >>"$LOG"
    timeout 200 "$BIN/megamoe" run $args >>"$LOG" 2>&1; echo "exit $?" >>"$LOG"
  done
fi
if has model; then
  say "megamoe model --ep-size"
  for r in 2 8; do
    timeout 200 "$BIN/megamoe" model --ep-size $r 2>&1 | tail -4 >>"$LOG"; echo "exit $?" >>"$LOG"
  done
fi
if has python; then
  say "python EP tests"
  wait "$pybuild"; echo "python build exit $?" >>"$LOG"; tail -2 "$OUT/python_build.log" >>"$LOG"
  PYTHONPATH=/tmp/build-py/python MEGAMOE_CLI="$BIN/megamoe" timeout 240 python3 -m pytest -q -rs -p no:cacheprovider \
    ${PYTESTS:-tests/python/test_ep.py tests/python/test_ep_gpu.py tests/python/test_errors.py} >"$OUT/python.log" 2>&1
  echo "exit $?" >>"$OUT/python.log"
  grep -E "passed|failed|SKIPPED|Error|^exit" "$OUT/python.log" | tail -20 >>"$LOG"
fi
if has ncclpy; then
  say "NCCL group from Python, with and without torch imported first"
  [ -n "${pybuild:-}" ] && wait "$pybuild"
  for first in "" "import torch; torch.zeros(1, device='cuda'); "; do
    NCCL_DEBUG=WARN PYTHONPATH=/tmp/build-py/python timeout 60 python3 -c "${first}import megamoe, megamoe.ep
c = megamoe.LayerConfig('small'); c.max_tokens_per_rank = 16
g = megamoe.ep.nccl_group(c, megamoe.ep.nccl_unique_id(), 1, 0)
print('ok', g.transport)" >>"$LOG" 2>&1; echo "exit $? (${first:-no torch})" >>"$LOG"
  done
  env | grep -E "^NCCL|^TORCH" >>"$LOG"
fi
if has bench; then
  say "megamoe_ep_bench"
  timeout 300 "$BIN/megamoe_ep_bench" >"$OUT/ep_bench.jsonl" 2>&1; echo "exit $?" >>"$LOG"
fi
say "done"
