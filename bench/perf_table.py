#!/usr/bin/env python3
"""Markdown tables for docs/perf.md from `megamoe bench --json` lines.

    python3 bench/perf_table.py bench/results/<run>.jsonl
"""
import json
import sys

STAGES = ["quantize", "dispatch", "gather", "l1", "l2", "combine"]
# Runs recorded before issue 27 call the dispatch stage "route".
OLD_STAGE_NAMES = {"route": "dispatch"}


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    ceil = next(r for r in rows if r["record"] == "ceilings")
    print(f"GPU {ceil['gpu']} ({ceil['sm_count']} SMs), driver {ceil.get('driver', '?')}, "
          f"CUDA runtime {ceil['cuda_runtime_version']}, clocks at start (SM, mem, max SM, power, temp): "
          f"{ceil['clocks_now']}, git {ceil['git_rev']}.")
    print(f"Ceilings measured in the same run: copy {ceil['copy_tbs']:.2f} TB/s (read + written), "
          f"BF16 GEMM 8192^3 (cuBLAS) {ceil['bf16_gemm_tflops']:.0f} TFLOP/s.")
    layers = [r for r in rows if r["record"] == "layer"]
    keys = []
    for r in layers:
        k = (r["shape"], r["routing"], r["activation"], r["fast_math"])
        if k not in keys:
            keys.append(k)
    for shape, routing, act, fast in keys:
        print(f"\n### {shape}, {routing} routing, {act}, {'fast_math' if fast else 'exact math'}\n")
        print("| T | median us | min us | TFLOP/s | weight GB/s | floor us (t_mem / t_bf16) "
              "| fraction of floor | " + " | ".join(STAGES) + " |")
        print("|---:" * (7 + len(STAGES)) + "|")
        for r in layers:
            if (r["shape"], r["routing"], r["activation"], r["fast_math"]) != (shape, routing, act, fast):
                continue
            m = r["median_us"]
            st = {OLD_STAGE_NAMES.get(k, k): v for k, v in r.get("stages_us", {}).items()}
            cells = [f"{st[s]:.0f} ({100 * st[s] / m:.0f}%)" if s in st else "-" for s in STAGES]
            print(f"| {r['tokens']} | {m:.1f} | {r['min_us']:.1f} | {r['tflops']:.1f} | "
                  f"{r['weight_gbs']:.0f} | {r['floor_us']:.1f} ({r['t_mem_us']:.0f} / "
                  f"{r['t_math_bf16_us']:.0f}) | {r['fraction_of_floor']:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
