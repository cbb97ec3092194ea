#!/usr/bin/env bash
# kAuto's tile choice for the rows a rank gets (docs/perf.md tuning log v11): `megamoe bench` on
# rank 0 of EP 8 and on one GPU with the row estimates of MEGAMOE_SM90_ROWS_HINT (below), uniform,
# skewed and adversarial routing; then the 128 x 8 and 128 x 16 decode tiles forced
# (MEGAMOE_SM90_GEMM_TILE=30 / 17) at decode token counts, with and without expert parallelism.
#   bench/ep_rows_hint.sh path/to/megamoe OUT_DIR
set -uo pipefail
CLI=${1:?usage: ep_rows_hint.sh MEGAMOE_BIN OUT_DIR}
OUT=${2:?usage: ep_rows_hint.sh MEGAMOE_BIN OUT_DIR}
mkdir -p "$OUT"
run() {  # label, env..., -- bench args...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "== $label: $*"
  env "${envs[@]}" timeout 170 "$CLI" bench --replays 5 --no-ceilings --json "$OUT/ep_rows_hint.jsonl" \
    --git-rev "$(cat REVISION 2>/dev/null || echo unknown)-$label" "$@" 2>&1 | grep -E "^ +[0-9]+ |^== "
}
# kAuto's row estimates (src/moe/sm90_layer.cu, rows_hint): as built (gated: the expected share
# as the estimate, gated launches up to T rows per expert), bound (T*K, no gate: the former
# choice), expected (the share, no gate).
for routing in uniform skewed adversarial; do
  toks=1,8,64,128,256,512,1024,4096
  [ "$routing" = uniform ] || toks=64,256,1024,4096
  for hint in gated bound expected; do
    run "ep8-$routing-$hint" MEGAMOE_SM90_ROWS_HINT=$hint -- --shape kimi-k3,deepseek-v3 --ep-size 8 \
      --routing "$routing" --tokens "$toks"
  done
done
# One GPU: the gate's cost where the estimate is right (uniform) and its gain where it is not.
for routing in uniform adversarial; do
  for hint in gated bound; do
    run "ep1-$routing-$hint" MEGAMOE_SM90_ROWS_HINT=$hint -- --shape kimi-k3,deepseek-v3 \
      --routing "$routing" --tokens 1,8,16,64,512
  done
done
for tile in 30 17; do
  run "tile$tile-ep8" MEGAMOE_SM90_GEMM_TILE=$tile -- --shape kimi-k3,deepseek-v3 --ep-size 8 --tokens 8,64,128,256
  run "tile$tile-ep1" MEGAMOE_SM90_GEMM_TILE=$tile -- --shape kimi-k3,deepseek-v3 --tokens 1,8,16,32,64
done
