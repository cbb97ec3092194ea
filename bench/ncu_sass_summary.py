#!/usr/bin/env python3
"""Summarize the per-instruction (SASS) page of an Nsight Compute report.

Input: the CSV of `ncu --import R.ncu-rep --page source --print-source sass --csv` (one block per
kernel: a "Kernel Name" row, then a header row starting with "Address", then one row per
instruction). Output (stdout), per kernel: stall samples and executed instructions by opcode with
the top stall reasons, then the TOP instructions by samples (address, execution count, source,
top stall reasons).

    python3 bench/ncu_sass_summary.py report_sass.csv [TOP]
"""
import collections
import csv
import sys


def as_int(v):
    try:
        return int(float(v or 0))
    except ValueError:
        return 0


def read_kernels(path):
    kernels = []
    hdr = None
    with open(path, newline="") as fh:
        for row in csv.reader(fh):
            if row and row[0] == "Kernel Name":
                kernels.append((row[1], []))
                hdr = None
            elif row and row[0] == "Address":
                hdr = row
            elif hdr and kernels:
                kernels[-1][1].append(dict(zip(hdr, row)))
    return kernels


def opcode(source):
    ops = [o for o in source.split() if not o.startswith("@")]
    return ops[0].split(".")[0] if ops else "?"


def main():
    path = sys.argv[1]
    top_n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    samples_col = "Warp Stall Sampling (All Samples)"
    for name, rows in read_kernels(path):
        if not rows or samples_col not in rows[0]:
            continue
        stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
        tot_s = sum(as_int(x[samples_col]) for x in rows)
        tot_e = sum(as_int(x.get("Instructions Executed")) for x in rows)
        print("=== " + name[:200])
        print("samples %d executed %d" % (tot_s, tot_e))
        by_op, ex_op = collections.Counter(), collections.Counter()
        st = collections.defaultdict(collections.Counter)
        tot_stall = collections.Counter()
        for x in rows:
            op = opcode(x["Source"])
            by_op[op] += as_int(x[samples_col])
            ex_op[op] += as_int(x.get("Instructions Executed"))
            for k in stalls:
                st[op][k] += as_int(x[k])
                tot_stall[k] += as_int(x[k])
        s_all = max(1, sum(tot_stall.values()))
        print("stall reasons: " + ", ".join("%s %.0f%%" % (k[6:], 100.0 * v / s_all)
                                            for k, v in tot_stall.most_common(10)))
        print("%-12s %8s %6s %12s %6s  top stalls" % ("op", "samples", "%", "executed", "%"))
        for op, s in by_op.most_common(25):
            top = ", ".join("%s %d%%" % (k[6:], 100 * v / max(1, s)) for k, v in st[op].most_common(3))
            print("%-12s %8d %5.1f%% %12d %5.1f%%  %s" % (op, s, 100.0 * s / max(1, tot_s), ex_op[op],
                                                        100.0 * ex_op[op] / max(1, tot_e), top))
        print("-- top %d instructions by samples (address, executed, samples, source, stalls)" % top_n)
        for x in sorted(rows, key=lambda x: -as_int(x[samples_col]))[:top_n]:
            top = sorted(((as_int(x[k]), k[6:]) for k in stalls), reverse=True)[:3]
            print("%8s %10s %6d  %-64s %s" % (x["Address"], x.get("Instructions Executed", ""),
                                               as_int(x[samples_col]), x["Source"].strip()[:64],
                                               " ".join("%s=%d" % (n, v) for v, n in top if v)))
        print()


if __name__ == "__main__":
    main()
