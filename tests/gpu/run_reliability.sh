#!/usr/bin/env bash
# GPU reliability run (docs/reliability.md): the sm90 soak and compute-sanitizer on small shapes.
#
#   tests/gpu/run_reliability.sh BUILD_DIR [all|soak|sanitizers]
#
# BUILD_DIR: configured with CUDA and megamoe_gpu_tests built (tests/gpu/test_reliability_soak.cu
# is part of it). Writes logs and reliability_summary.txt to $OUT (default ./reliability-out).
# Budget (H200): soak <= MEGAMOE_SOAK_MAX_SECONDS (150 s) of layer calls plus ~30 s of setup;
# each compute-sanitizer tool at most SANITIZER_TIMEOUT (110 s): under 9 minutes in all, or run
# the two parts in separate device calls. Exit status: 0 when everything passed.
set -uo pipefail

BUILD_DIR="${1:?usage: tests/gpu/run_reliability.sh BUILD_DIR [all|soak|sanitizers]}"
PART="${2:-all}"
OUT="${OUT:-$PWD/reliability-out}"
mkdir -p "$OUT"
BIN="$BUILD_DIR/tests/megamoe_gpu_tests"
[[ -x "$BIN" ]] || { echo "run_reliability.sh: $BIN not built" >&2; exit 2; }
SUMMARY="$OUT/reliability_summary.txt"
: >>"$SUMMARY"
status=0

# Eager module loading: every kernel is loaded up front, so lazy loading cannot show up as
# "device memory growth" in the soak.
export CUDA_MODULE_LOADING=EAGER
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$SUMMARY" 2>&1 || true
# The revision: REVISION (an exported tree, e.g. bench/gpu_session.sh's) or git.
root="$(dirname "$0")/../.."
echo "revision $(cat "$root/REVISION" 2>/dev/null || git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')" >>"$SUMMARY"

# ---- 1. soak: >= 10,000 sm90 layer calls -----------------------------------------------------
if [[ "$PART" == all || "$PART" == soak ]]; then
export MEGAMOE_SOAK_CALLS="${MEGAMOE_SOAK_CALLS:-10000}"
export MEGAMOE_SOAK_MAX_SECONDS="${MEGAMOE_SOAK_MAX_SECONDS:-150}"
start=$(date +%s)
timeout 400 "$BIN" --gtest_filter='ReliabilitySoak.*' >"$OUT/soak.log" 2>&1
rc=$?
line=$(grep -m1 'SOAK SUMMARY' "$OUT/soak.log" || echo "SOAK SUMMARY: missing (exit $rc; skipped without an sm_90 GPU?)")
grep -q 'SOAK SUMMARY' "$OUT/soak.log" || rc=1
echo "soak: exit $rc in $(( $(date +%s) - start )) s; $line" | tee -a "$SUMMARY"
(( rc == 0 )) || { status=1; grep -E 'Failure|error|FAILED' "$OUT/soak.log" | head -20 | tee -a "$SUMMARY"; }
fi

# ---- 2. compute-sanitizer: memcheck, racecheck, synccheck on small shapes ---------------------
if [[ "$PART" == all || "$PART" == sanitizers ]]; then
CS="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
SANITIZER_TIMEOUT="${SANITIZER_TIMEOUT:-110}"
# The reliability driver (small shape, all activations, both math modes, T = 0/1/7/40, an invalid
# id) plus the stage tests of the pipeline; racecheck only the driver (it is the slowest tool).
declare -A FILTER=(
  [memcheck]='ReliabilitySanitize.*:Sm90Stages.*'
  [racecheck]='ReliabilitySanitize.*'
  [synccheck]='ReliabilitySanitize.*:Sm90Stages.*'
)
declare -A EXTRA=( [memcheck]='--leak-check full --padding 32' [racecheck]='--racecheck-report all' [synccheck]='' )
for tool in memcheck racecheck synccheck; do
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$SANITIZER_TIMEOUT" "$CS" --tool "$tool" ${EXTRA[$tool]} --error-exitcode 99 \
    "$BIN" --gtest_filter="${FILTER[$tool]}" >"$OUT/$tool.log" 2>&1
  rc=$?
  errors=$(grep -oE 'ERROR SUMMARY: [0-9]+ error' "$OUT/$tool.log" | tail -1 | grep -oE '[0-9]+' || echo '?')
  # racecheck ends with "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)" instead.
  if [[ "$errors" == "?" ]]; then
    errors=$(grep -oE 'RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ error' "$OUT/$tool.log" | tail -1 |
             grep -oE '[0-9]+ error' | grep -oE '[0-9]+' || echo '?')
  fi
  hazards=$(grep -oE 'RACECHECK SUMMARY: [0-9]+ hazard' "$OUT/$tool.log" | tail -1 || true)
  tests=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$tool.log" | tr '\n' ' ')
  verdict=ok
  (( rc == 124 )) && verdict="TIMEOUT after ${SANITIZER_TIMEOUT} s"
  (( rc != 0 && rc != 124 )) && verdict="FAILED (exit $rc)"
  [[ "$errors" == "0" ]] || verdict="$verdict; errors=$errors"
  grep -q '^\[  SKIPPED \]' "$OUT/$tool.log" && verdict="$verdict; tests SKIPPED (no sm_90 GPU?)"
  echo "compute-sanitizer $tool: $verdict, errors=$errors ${hazards} in $(( $(date +%s) - start )) s; $tests" | tee -a "$SUMMARY"
  [[ "$verdict" == ok ]] || { status=1; grep -E '^=========' "$OUT/$tool.log" | head -30 >>"$SUMMARY"; }
done
fi

echo "run_reliability.sh: exit $status" | tee -a "$SUMMARY"
exit $status
