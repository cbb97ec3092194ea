#!/usr/bin/env bash
# One device call for the MegaMoE kernel (issue 32): the GPU tests (all, or TESTS_FILTER), the
# Python tests of the sm90 layer (the extension is built there in the background), then
# `megamoe bench` of the chained GEMMs and of the MegaMoE kernel on the same shapes and token
# counts, in the order chain, mega, mega, chain (each binary's drift shows as the spread of its
# two runs); with the ncu step, Nsight Compute sections of both. Writes $OUT/log.txt,
# $OUT/gpu_tests.log, $OUT/python.log, $OUT/ncu_mega_{chain,mega}_*.txt and
# $OUT/bench_{chain,mega}_{1,2}.{txt,jsonl}.
#
#   [STEPS="tests python ncu bench"] [BENCH_ARGS="--shape kimi-k3,deepseek-v3 --tokens 1,8,64,512,4096"] \
#   [NCU_RUNS="kimi-k3:512 kimi-k3:8"] bench/mega_gpu_check.sh BIN_DIR
#
# BIN_DIR holds megamoe and megamoe_gpu_tests built on the development machine from this tree.
# Needs carry [".carry/deps", BIN_DIR] (the python step builds the extension from .carry/deps).
set -uo pipefail
BIN=$(cd "${1:?usage: mega_gpu_check.sh BIN_DIR}" && pwd)
ROOT=$PWD
STEPS=${STEPS:-tests python bench}
BENCH_ARGS=${BENCH_ARGS:---shape kimi-k3,deepseek-v3 --tokens 1,8,64,512,4096}
. "$(dirname "$0")/device_common.sh"

if has python; then start_python_build 12; fi
if has tests; then run_gpu_tests "$BIN" "Mega"; fi
if has python; then run_python_tests "$BIN"; fi
if has ncu; then
  # Where the time goes: the chain's two GEMM launches and the fused kernel of one call, with
  # the speed-of-light, warp-state and scheduler sections (NCU_RUNS="shape:tokens ...").
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for run in ${NCU_RUNS:-kimi-k3:512 kimi-k3:8}; do
    IFS=: read -r shape nt <<<"$run"
    for mode in chain mega; do
      tag="mega_${mode}_${shape}_t${nt}"
      extra=""; count=2
      [ "$mode" = mega ] && { extra="--mega"; count=1; }
      say "nsight compute ($tag)"
      # shellcheck disable=SC2086
      timeout ${NCU_TIMEOUT:-150} "$NCU" -k regex:"grouped_gemm|mega_moe" --launch-count $count \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section LaunchStats --section Occupancy "$BIN/megamoe" bench --shape "$shape" \
        --tokens "$nt" --replays 1 --warmup 0 --no-stages --no-ceilings $extra \
        >"$OUT/ncu_$tag.txt" 2>&1
      echo "exit $?" >>"$OUT/ncu_$tag.txt"
      grep -E "sm90_|Duration|Compute \(SM\) Throughput|Memory Throughput|Issued Warp|No Eligible|Stall|Registers|^exit" \
        "$OUT/ncu_$tag.txt" | head -24 >>"$LOG"
    done
  done
fi
if has bench; then
  for run in chain_1 mega_1 mega_2 chain_2; do
    say "bench $run"
    extra=""
    [[ $run == mega_* ]] && extra="--mega"
    # shellcheck disable=SC2086
    timeout ${BENCH_TIMEOUT:-120} "$BIN/megamoe" bench $BENCH_ARGS $extra --replays 5 \
      --json "$OUT/bench_$run.jsonl" >"$OUT/bench_$run.txt" 2>&1
    echo "exit $?" >>"$OUT/bench_$run.txt"
    grep -vE "^$" "$OUT/bench_$run.txt" | tail -14 | cut -c1-200 >>"$LOG"
  done
fi
say "done"
