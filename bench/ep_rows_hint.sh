#!/usr/bin/env bash
# The tile policy's choice for the rows a rank gets (docs/tuning-log.md v11): `megamoe bench` on
# rank 0 of EP 8 and on one GPU with each row estimate (--rows-hint, below), uniform, skewed and
# adversarial routing; then the 128 x 8 and 128 x 16 decode tiles forced (--tile) at decode token
# counts, with and without expert parallelism.
#   bench/ep_rows_hint.sh path/to/megamoe OUT_DIR
set -uo pipefail
CLI=${1:?usage: ep_rows_hint.sh MEGAMOE_BIN OUT_DIR}
OUT=${2:?usage: ep_rows_hint.sh MEGAMOE_BIN OUT_DIR}
mkdir -p "$OUT"
run() {  # label, bench args...
  local label=$1; shift
  echo "== $label: $*"
  timeout 170 "$CLI" bench --replays 5 --no-ceilings --json "$OUT/ep_rows_hint.jsonl" \
    --git-rev "$(cat REVISION 2>/dev/null || echo unknown)-$label" "$@" 2>&1 | grep -E "^ +[0-9]+ |^== "
}
# The row estimates (src/moe/sm90_layer.cu, rows_hint): gated (the default: the expected share as
# the estimate, gated launches up to T rows per expert), bound (T*K, no gate), expected (the
# share, no gate).
for routing in uniform skewed adversarial; do
  toks=1,8,64,128,256,512,1024,4096
  [ "$routing" = uniform ] || toks=64,256,1024,4096
  for hint in gated bound expected; do
    run "ep8-$routing-$hint" --rows-hint "$hint" --shape kimi-k3,deepseek-v3 --ep-size 8 \
      --routing "$routing" --tokens "$toks"
  done
done
# One GPU: the gate's cost where the estimate is right (uniform) and its gain where it is not.
for routing in uniform adversarial; do
  for hint in gated bound; do
    run "ep1-$routing-$hint" --rows-hint "$hint" --shape kimi-k3,deepseek-v3 \
      --routing "$routing" --tokens 1,8,16,64,512
  done
done
for tile in decode_128x8_k2_warp decode_128x16_k2_warp; do
  run "$tile-ep8" --tile "$tile" --shape kimi-k3,deepseek-v3 --ep-size 8 --tokens 8,64,128,256
  run "$tile-ep1" --tile "$tile" --shape kimi-k3,deepseek-v3 --tokens 1,8,16,32,64
done
