#!/usr/bin/env bash
# One device call for the FP8 mode (issue "FP8 tensor cores"): every GPU test, the Python tests
# of the sm90 layer (the extension is built there in the background), then `megamoe bench` of the
# exact mode and of the FP8 mode on the same shapes and token counts. Writes $OUT/log.txt,
# $OUT/gpu_tests.log, $OUT/python.log, $OUT/bench_{exact,fp8}.{txt,jsonl}.
#
#   [STEPS="tests python bench"] [BENCH_ARGS="--shape kimi-k3,deepseek-v3 --tokens 512,4096,8192"] \
#   [FP8_MIN_ROWS=0] bench/fp8_gpu_check.sh BIN_DIR
#
# BIN_DIR holds megamoe and megamoe_gpu_tests built on the development machine from this tree.
# Needs carry [".carry/deps", BIN_DIR] (the python step builds the extension from .carry/deps).
set -uo pipefail
BIN=$(cd "${1:?usage: fp8_gpu_check.sh BIN_DIR}" && pwd)
ROOT=$PWD
STEPS=${STEPS:-tests python bench}
BENCH_ARGS=${BENCH_ARGS:---shape kimi-k3,deepseek-v3 --tokens 512,4096,8192 --no-stages}
FP8_MIN_ROWS=${FP8_MIN_ROWS:-0}
. "$(dirname "$0")/device_common.sh"

if has python; then start_python_build 12; fi
if has tests; then run_gpu_tests "$BIN" "fp8|Fp8"; fi
if has python; then run_python_tests "$BIN"; fi
if has gemmbench; then
  say "grouped-GEMM benchmark (tiles ${MEGAMOE_BENCH_TILES:-all}, tokens ${MEGAMOE_BENCH_TOKENS:-default})"
  timeout ${GEMMBENCH_TIMEOUT:-200} "$BIN/megamoe_gemm_bench" >"$OUT/gemm_bench.txt" 2>&1
  echo "exit $?" >>"$OUT/gemm_bench.txt"
  grep -E "^\[bench\].*(fp8|tile=auto )|^exit" "$OUT/gemm_bench.txt" | cut -c1-150 >>"$LOG"
fi
if has ncu; then
  . "$(dirname "$0")/ncu_full.sh"
  for run in ${NCU_RUNS:-deepseek-v3:4096}; do
    IFS=: read -r shape nt <<<"$run"
    tag="fp8_${shape}_t${nt}"
    say "nsight compute ($tag)"
    ncu_full "$tag" "$OUT" "$OUT/ncu_$tag.log" "${NCU_TIMEOUT:-200}" "$BIN/megamoe" bench \
      --precision fp8 --fp8-min-rows 0 --shape "$shape" --tokens "$nt" --replays 1 --warmup 0 \
      --no-stages --no-ceilings
    grep -E "grouped_gemm|Duration|Compute \(SM\) Throughput|Issued Warp|Executed Ipc A|^exit" \
      "$OUT/ncu_$tag.txt" | head -20 >>"$LOG"
  done
fi
if has bench; then
  for mode in exact fp8; do
    say "bench $mode"
    extra=""
    [ "$mode" = fp8 ] && extra="--precision fp8 --fp8-min-rows $FP8_MIN_ROWS"
    # shellcheck disable=SC2086
    timeout ${BENCH_TIMEOUT:-120} "$BIN/megamoe" bench $BENCH_ARGS $extra --replays 5 --json "$OUT/bench_$mode.jsonl" \
      >"$OUT/bench_$mode.txt" 2>&1
    echo "exit $?" >>"$OUT/bench_$mode.txt"
    grep -vE "^$" "$OUT/bench_$mode.txt" | tail -12 >>"$LOG"
  done
fi
say "done"
