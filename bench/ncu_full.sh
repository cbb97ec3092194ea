# Sourced by the device-call scripts (gpu_session.sh, fp8_gpu_check.sh) for their Nsight Compute
# steps:
#   ncu_full TAG OUT_DIR RUN_LOG TIMEOUT_S CMD...
# profiles the first NCU_COUNT (default 2: L1 and L2) grouped-GEMM launches of CMD with the full
# section set and per-instruction samples; CMD's output goes to RUN_LOG; writes
# OUT_DIR/ncu_TAG.txt (every section), OUT_DIR/ncu_TAG_sass_summary.txt (bench/ncu_sass_summary.py)
# and OUT_DIR/ncu_TAG_sass.csv.gz (the source page).
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
ncu_full() {
  local tag=$1 out=$2 run_log=$3 seconds=$4
  shift 4
  timeout "$seconds" "$NCU" -k regex:grouped_gemm --launch-count "${NCU_COUNT:-2}" --set full \
    --import-source no -f -o "/tmp/ncu_$tag" "$@" >"$run_log" 2>&1
  echo "exit $?" >>"$run_log"
  "$NCU" --import "/tmp/ncu_$tag.ncu-rep" --print-details all >"$out/ncu_$tag.txt" 2>&1
  "$NCU" --import "/tmp/ncu_$tag.ncu-rep" --page source --print-source sass --csv \
    >"/tmp/ncu_${tag}_sass.csv" 2>&1
  python3 "$(dirname "${BASH_SOURCE[0]}")/ncu_sass_summary.py" "/tmp/ncu_${tag}_sass.csv" 80 \
    >"$out/ncu_${tag}_sass_summary.txt" 2>&1
  gzip -c "/tmp/ncu_${tag}_sass.csv" >"$out/ncu_${tag}_sass.csv.gz"
}
