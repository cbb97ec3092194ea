#!/usr/bin/env bash
# A/B of GEMM builds in one device call: the grouped-GEMM benchmark of each prebuilt
# megamoe_gemm_bench binary, in the given order and then in the reverse order (a later run in a
# call reads a few percent slower: docs/perf.md), so each build has one early and one late
# reading. Optionally, first, GPU tests on named megamoe_gpu_tests binaries.
#
#   [AB_TESTS="NAME:TESTS_PATH:FILTER ..."] [MEGAMOE_BENCH_TOKENS=1,8] [MEGAMOE_BENCH_TILES=auto] \
#     bench/gemm_ab.sh NAME=BENCH_PATH [NAME=BENCH_PATH ...]
#
# Writes $OUT/ab_NAME_{1,2}.txt (the benchmark's [bench] lines), $OUT/ab_tests_NAME.txt and a
# summary in $OUT/ab_log.txt.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$OUT/ab_log.txt
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
. "$(dirname "$0")/ab_builds.sh"
ab_builds gemm_ab.sh "$@"
t0=$(date +%s)
say() { echo "== +$(( $(date +%s) - t0 ))s $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader >>"$LOG"

for spec in ${AB_TESTS:-}; do
  IFS=: read -r name tests filter <<<"$spec"
  say "tests $name: $filter"
  timeout 300 "$tests" --gtest_filter="$filter" >"$OUT/ab_tests_$name.txt" 2>&1
  echo "exit $?" >>"$OUT/ab_tests_$name.txt"
  grep -E "^\[  FAILED|^\[  PASSED|tests? ran|^exit" "$OUT/ab_tests_$name.txt" >>"$LOG"
done

pass=1
for order in "${names[*]}" "${reversed[*]}"; do
  for name in $order; do
    say "bench $name (pass $pass)"
    timeout 300 "${BIN[$name]}" >"$OUT/ab_${name}_$pass.log" 2>&1
    echo "exit $?" >>"$OUT/ab_${name}_$pass.log"
    grep -E "bench|^exit|FAILED" "$OUT/ab_${name}_$pass.log" >"$OUT/ab_${name}_$pass.txt"
    rm -f "$OUT/ab_${name}_$pass.log"
    tail -1 "$OUT/ab_${name}_$pass.txt" >>"$LOG"
  done
  pass=$((pass + 1))
done
say done
