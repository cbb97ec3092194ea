#!/usr/bin/env bash
# Expert-parallel tile choice (docs/perf.md tuning log v11): `megamoe bench` on rank 0 of EP 8
# with kAuto's row estimate as built (the rank's expected share, T*K*E_l/E) and with the former
# one (MEGAMOE_SM90_ROWS_HINT=bound: T*K), uniform, skewed and adversarial routing; then the
# 128 x 8 and 128 x 16 decode tiles forced (MEGAMOE_SM90_GEMM_TILE=30 / 17) at decode token
# counts, with and without expert parallelism.
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
for routing in uniform skewed adversarial; do
  toks=1,8,64,128,256,512,1024,4096
  [ "$routing" = uniform ] || toks=64,256,1024,4096
  for hint in expected bound; do
    e=(MEGAMOE_SM90_ROWS_HINT=$([ $hint = bound ] && echo bound || echo default))
    run "ep8-$routing-$hint" "${e[@]}" -- --shape kimi-k3,deepseek-v3 --ep-size 8 --routing "$routing" --tokens "$toks"
  done
done
for tile in 30 17; do
  run "tile$tile-ep8" MEGAMOE_SM90_GEMM_TILE=$tile -- --shape kimi-k3,deepseek-v3 --ep-size 8 --tokens 8,64,128,256
  run "tile$tile-ep1" MEGAMOE_SM90_GEMM_TILE=$tile -- --shape kimi-k3,deepseek-v3 --tokens 1,8,16,32,64
done
