#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/fuzz_*.cpp) with clang + ASan/UBSan and runs each for
# a bounded time (docs/reliability.md, "Fuzzing").
#
#   tests/fuzz/run.sh                 CI: about 60 s in total, split evenly over the targets
#   TOTAL_SECONDS=1800 tests/fuzz/run.sh      a long run (the figures in docs/reliability.md)
#   tests/fuzz/run.sh fuzz_activation         only the named targets
#   BUILD_DIR=... JOBS=...            build folder (default build-fuzz) and parallelism
#
# Seeds: tests/fuzz/corpus/<target>/ when present (copied into the working corpus). The working
# corpus lives in $BUILD_DIR/corpus/<target>, so repeated runs continue where the last stopped.
# A crash leaves its input as $BUILD_DIR/artifacts/<target>/crash-*; turn it into a regression
# test (tests/cpp/test_reliability*.cpp) and add it to tests/fuzz/corpus/<target>/.
# Exit status: non-zero when any target found a crash, leak or sanitizer report.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-fuzz}"
JOBS="${JOBS:-$(nproc)}"
TOTAL_SECONDS="${TOTAL_SECONDS:-60}"
# clang with its libFuzzer runtime (Debian: clang + libclang-rt-dev), installed when missing.
if ! command -v clang++ >/dev/null 2>&1 || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [[ "$(id -u)" -eq 0 ]] || SUDO="sudo"
    echo "fuzz/run.sh: installing clang and libclang-rt-dev (libFuzzer)"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends clang libclang-rt-dev </dev/null >/dev/null ||
      { $SUDO apt-get update -qq </dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends clang libclang-rt-dev </dev/null >/dev/null; }
  fi
fi
CLANGXX="${CLANGXX:-$(command -v clang++ || command -v clang++-14 || true)}"
[[ -n "$CLANGXX" ]] || { echo "fuzz/run.sh: clang++ not found (Debian: apt-get install clang)" >&2; exit 2; }

cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja \
  -DCMAKE_CXX_COMPILER="$CLANGXX" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DMEGAMOE_ENABLE_CUDA=OFF -DMEGAMOE_BUILD_FUZZERS=ON -DMEGAMOE_SANITIZE=address,undefined \
  -DMEGAMOE_BUILD_TESTS=OFF -DMEGAMOE_BUILD_TOOLS=OFF >/dev/null

# Targets: every tests/fuzz/fuzz_*.cpp that defines LLVMFuzzerTestOneInput (fuzz_make_seeds is a
# helper program that writes fuzz_safetensors' seed corpus).
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  for src in "$ROOT"/tests/fuzz/fuzz_*.cpp; do
    grep -q LLVMFuzzerTestOneInput "$src" && targets+=("$(basename "$src" .cpp)")
  done
fi
helpers=()
[[ -f "$ROOT/tests/fuzz/fuzz_make_seeds.cpp" ]] && helpers+=(fuzz_make_seeds)
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}" "${helpers[@]}"

BIN_DIR="$BUILD_DIR/tests/fuzz"
per_target=$(( TOTAL_SECONDS / ${#targets[@]} ))
(( per_target >= 1 )) || per_target=1
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
status=0
for t in "${targets[@]}"; do
  corpus="$BUILD_DIR/corpus/$t"
  artifacts="$BUILD_DIR/artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  [[ -d "$ROOT/tests/fuzz/corpus/$t" ]] && cp -n "$ROOT/tests/fuzz/corpus/$t"/* "$corpus"/ 2>/dev/null || true
  # fuzz_safetensors starts from small valid checkpoints (fuzz_make_seeds) and a dictionary.
  extra=()
  if [[ "$t" == fuzz_safetensors && -x "$BIN_DIR/fuzz_make_seeds" && -z "$(ls -A "$corpus")" ]]; then
    "$BIN_DIR/fuzz_make_seeds" "$corpus" >/dev/null
  fi
  dict="$ROOT/tests/fuzz/${t#fuzz_}.dict"
  [[ -f "$dict" ]] && extra+=(-dict="$dict")
  # Input size bounds as in the recorded runs (docs/reliability.md).
  case "$t" in
    fuzz_safetensors) extra+=(-max_len=16384) ;;
    fuzz_prepare) extra+=(-max_len=4096) ;;
  esac
  log="$BUILD_DIR/$t.log"
  rc=0
  "$BIN_DIR/$t" "$corpus" -max_total_time="$per_target" -print_final_stats=1 \
    -artifact_prefix="$artifacts/" -rss_limit_mb=2048 -timeout=10 "${extra[@]}" >"$log" 2>&1 || rc=$?
  execs=$(grep -m1 'stat::number_of_executed_units' "$log" | awk '{print $2}')
  cov=$(grep -E '^#[0-9]+' "$log" | tail -1 | grep -oE 'cov: [0-9]+' || true)
  units=$(ls "$corpus" | wc -l)
  if (( rc == 0 )); then
    echo "fuzz: $t ok: ${execs:-?} executions in ${per_target} s, ${cov:-cov: ?}, corpus $units inputs"
  else
    status=1
    echo "fuzz: $t FAILED (exit $rc) after ${execs:-?} executions; log $log, inputs in $artifacts:"
    grep -E 'ERROR|SUMMARY|==[0-9]+==|fuzz_' "$log" | head -20 || true
  fi
done
exit $status
