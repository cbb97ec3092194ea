#!/usr/bin/env bash
# A/B of `megamoe` builds in one device call: `megamoe bench` of each binary on the same shapes and
# token counts, in the given order and then in the reverse order (a later run in a call reads a
# few percent slower: docs/perf.md), so each build has one early and one late reading; then the
# ratio of the means per point (time of the first build over the others').
#
#   [LAYER_AB_ARGS="--shape kimi-k3,deepseek-v3 --tokens 1,8,64,512,4096,8192"] \
#     bench/layer_ab.sh NAME=PATH [NAME=PATH ...]
#
# Writes $OUT/layer_ab_NAME_{1,2}.jsonl and .txt, and the table in $OUT/layer_ab.txt.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
ARGS=${LAYER_AB_ARGS:---shape kimi-k3,deepseek-v3 --tokens 1,8,64,512,4096,8192}
. "$(dirname "$0")/ab_builds.sh"
ab_builds layer_ab.sh "$@"
pass=1
for order in "${names[*]}" "${reversed[*]}"; do
  for name in $order; do
    echo "== $(date +%T) bench $name (pass $pass)"
    # shellcheck disable=SC2086
    timeout 280 "${BIN[$name]}" bench $ARGS --replays 5 --no-stages --git-rev "$name" \
      --json "$OUT/layer_ab_${name}_$pass.jsonl" >"$OUT/layer_ab_${name}_$pass.txt" 2>&1
    echo "exit $?" >>"$OUT/layer_ab_${name}_$pass.txt"
    tail -1 "$OUT/layer_ab_${name}_$pass.txt"
  done
  pass=$((pass + 1))
done
python3 - "$OUT" "${names[@]}" <<'EOF' | tee "$OUT/layer_ab.txt"
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
mean = {}
for n in names:
    # The exact names: a glob such as layer_ab_mega_* would also take mega_old's runs.
    for f in [f"{out}/layer_ab_{n}_{p}.jsonl" for p in (1, 2)]:
        if not os.path.exists(f):
            continue
        for line in open(f):
            r = json.loads(line)
            if r.get("record") != "layer":
                continue
            mean.setdefault((n, r["shape"], r["tokens"]), []).append(r["median_us"])
points = sorted({(s, t) for (_, s, t) in mean}, key=lambda p: (p[0], p[1]))
print("| shape | T | " + " | ".join(f"{n} us (runs)" for n in names) + " | " +
      " | ".join(f"{names[0]} / {n}" for n in names[1:]) + " |")
print("|---|---:|" + "---:|" * (2 * len(names) - 1))
for s, t in points:
    cells, ms = [], []
    for n in names:
        v = mean.get((n, s, t), [])
        m = sum(v) / len(v) if v else float("nan")
        ms.append(m)
        cells.append(f"{m:.1f} ({', '.join(f'{x:.1f}' for x in v)})")
    ratios = [f"{ms[0] / m:.3f}" for m in ms[1:]]
    print(f"| {s} | {t} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
EOF
