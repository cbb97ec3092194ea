#!/usr/bin/env python3
"""Expert parallelism across R GPUs (2 or 8 H200s), one process per GPU, megamoe's NCCL group:
the correctness checks and the performance table of issue 30 in one command.

Device command (one call, carry [".carry/deps"]; kind nvidia-h200-x2 or nvidia-h200-x8):

    cmake -S . -B /tmp/build-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_BUILD_PYTHON=ON \
      -DMEGAMOE_BUILD_TESTS=OFF -DMEGAMOE_BUILD_TOOLS=OFF -DMEGAMOE_DEPS_DIR=$PWD/.carry/deps \
      -DMEGAMOE_NCCL_INCLUDE_DIR=$PWD/.carry/deps/nccl/include >$OUT/build.log 2>&1 &&
    ninja -C /tmp/build-py -j$(nproc) >>$OUT/build.log 2>&1 &&
    PYTHONPATH=/tmp/build-py/python python3 bench/ep_multi_gpu.py --out $OUT/ep_multi --deadline-s 420

(the extension build took < 90 s with -j10 in bench/ep_gpu_check.sh; the run itself stops at
--deadline-s, so the call stays under 9 minutes). On the CPU machine,
tests/python/test_ep_multi_gpu_harness.py checks the host-side parts.

(the extension must be compiled there with the carried NCCL 2.28.9 headers: docs/design.md,
"Expert parallelism"). The script puts the lib folder of torch's nvidia-nccl wheel first on
LD_LIBRARY_PATH and sets NCCL_NVLS_ENABLE=0 for its children (never NVLink multicast) before
starting them; the parent itself never loads NCCL.

What it runs (--steps correctness,perf; --shapes kimi-k3,deepseek-v3; --precision exact|fp8 for
every layer, the FP8 mode by the layer's own rule; --mega: every layer with the MegaMoE kernel):

correctness, per shape, capacity --check-tokens (64) per rank. Global inputs are made identically
  on every rank (synthetic_activations / make_routing of the whole R * T rows); rank r takes rows
  [offsets[r], offsets[r+1]). Cases: uniform, skewed, adversarial with every rank at capacity,
  and an uneven case (one rank T = 0, empty slots). Each rank runs a forced-tile layer
  (--tile, default decode_128x16_k2_warp as tests/python/test_ep_gpu.py) and an automatic-policy
  layer on one group; rank 0 runs the EP = 1 layer (all experts, sm90) with the forced tile, rank
  1 (rank 0 when R = 1) the automatic one, on all rows. The parent compares: forced tile bit for
  bit, automatic by megamoe.compare_output's diff (< 1e-4), expert_rows of rank r = the EP = 1
  layer's rows of experts [r E/R, (r+1) E/R). Then, on the forced-tile layer: CUDA-graph replay
  (torch.cuda.graph of forward(out=)) equals eager on every rank; a rank above capacity raises
  OutOfRangeError at once and every other rank at check_errors naming it, and the next call is
  clean. Last (the group is broken after): a fresh 'small' group with --timeout-check-s; rank R-1
  never calls, every other rank raises megamoe.TimeoutError within that time (+ 2 s slack).

perf, per shape and T per rank in --tokens: the EP layer (automatic policy, uniform routing over
  all E experts, every rank its own T tokens) and the same per-rank work at EP = 1 on the same GPU
  (a layer of E_l = E / R experts, same H, I, K and activation, T tokens routed uniformly over
  them), both timed as the median of --reps CUDA-graph replays bracketed by CUDA events (eager
  calls with --timing eager or where capture fails; the number of calls is the same either way, so
  the ranks stay in step). Columns: EP us, EP = 1 us, overhead, the bytes each rank sends to and
  receives from its peers per call (dispatch: K ids + K weights, 8 B each pair, to every peer per
  token; the FP8 row + UE8M0 scales, H + H/32 B, once per peer owning one of the token's experts;
  return: one BF16 row, 2H B, per (token, slot) owned by a peer), the communication time at the
  one-way copy ceiling (max(sent, received) / ceiling), the hidden fraction
  1 - overhead / communication time (targets.md: decode overhead <= 10 us; prefill >= 0.9
  hidden), and TFLOP/s per rank (6 T K H I per call). The ceiling is a torch copy of 1 GiB from
  cuda:0 to cuda:1 in rank 0's process (and back), measured in the same run.

Output in --out (default /tmp/ep_multi): rank<r>.jsonl (each child's records, flushed as they
come), cases/*.npy (outputs compared by the parent), results.jsonl (the checks and perf rows),
table.md; one PASS/FAIL line per check on stdout; exit code 1 when a check fails or a child did not
finish. Every child runs under the parent's --deadline-s; on expiry the parent kills them (by
their pids) and reports what it has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

DEFAULT_SHAPES = ("kimi-k3", "deepseek-v3")
DEFAULT_TOKENS = (1, 8, 64, 512, 4096, 8192)
DEFAULT_TILE = "decode_128x16_k2_warp"
ROUTINGS = ("uniform", "skewed", "adversarial")
SEED = 9
AUTO_DIFF_LIMIT = 1e-4   # the bound of test_ep_gpu.py for the automatic tiles (FP32 sum order)
DEEPGEMM_X8 = ("DeepGEMM SM90 Mega MoE, 8 x H200, FP8 x FP8 (published): 404 us at 8 tokens/rank "
               "(kimi-k3), ~768 TFLOP/s at 8192 tokens/rank (deepseek-v3)")


# ------------------------------------------------------------------------------------------------
# Pure parts (numpy only; tests/python/test_ep_multi_gpu_harness.py runs them on the CPU)
# ------------------------------------------------------------------------------------------------
def row_offsets(counts):
    """Row offsets [0, c0, c0+c1, ...] of the ranks' slices of the global rows."""
    return [0] + [int(x) for x in np.cumsum(counts)]


def split_rows(arrays, counts):
    """Per rank r, the rows [offsets[r], offsets[r+1]) of every array: list of tuples."""
    off = row_offsets(counts)
    if off[-1] != arrays[0].shape[0]:
        raise ValueError(f"counts sum to {off[-1]}, arrays have {arrays[0].shape[0]} rows")
    return [tuple(a[off[r]:off[r + 1]] for a in arrays) for r in range(len(counts))]


def assemble_rows(parts):
    """Inverse of split_rows: the ranks' slices concatenated in rank order."""
    return tuple(np.concatenate(cols, axis=0) for cols in zip(*parts))


def case_list(ranks, capacity):
    """The correctness cases: (name, routing, tokens per rank, empty_slots)."""
    full = [capacity] * ranks
    cases = [(f"{kind}_at_capacity", kind, full, False) for kind in ROUTINGS]
    uneven = [capacity] + [0] + [(23 + 17 * r) % capacity + 1 for r in range(2, ranks)]
    cases.append(("uniform_uneven_zero_rank", "uniform", uneven[:ranks] if ranks > 1 else [0],
                  True))
    return cases


def make_empty_slots(idx):
    """Marks some slots empty (-1) in place, as test_ep_gpu.py does: token 1's last slot and
    every slot of token 3 (a token without a valid slot)."""
    if idx.shape[0] > 3:
        idx[1, -1] = -1
        idx[3, :] = -1
    return idx


def global_inputs(megamoe, hidden, num_experts, top_k, counts, routing, seed=SEED,
                  empty_slots=False):
    """The same global inputs on every rank: x bf16 bits uint16 [sum(counts), H], topk_idx int32
    and topk_weights float32 [sum(counts), K] over all E experts."""
    total = int(sum(counts))
    x = megamoe.synthetic_activations(total, hidden, seed)
    idx, w = megamoe.make_routing(routing, total, num_experts, top_k, seed)
    if empty_slots:
        make_empty_slots(idx)
    return x, idx, w


def exchange_bytes(idx_per_rank, num_experts, hidden, top_k):
    """Bytes each rank moves to and from its peers per call (self excluded), from the routing of
    every rank (idx_per_rank[r]: int [T_r, K], -1 = empty slot), following the protocol of
    docs/design.md: ep_send writes every token's K ids and K weights (4 + 4 B each) to every rank
    and its FP8 row + scales (H + H/32 B) once to each rank owning one of its experts; ep_return
    writes each (token, slot) row, BF16 (2H B), from the expert's owner into the source's combine
    slot. Signal words (8 B per rank pair) are left out. Returns a list of dicts per rank:
    sent/recv x dispatch/return, their totals, and the same-rank (local) bytes."""
    ranks = len(idx_per_rank)
    e_local = num_experts // ranks
    row = hidden + hidden // 32
    meta = top_k * 8
    # tok_dst[s]: bool [T_s, R], token t of rank s sends its row to rank d
    # slot_owner_counts[s]: int [R], valid slots of rank s's tokens owned by rank d
    tok_dst, slot_counts, tokens = [], [], []
    for idx in idx_per_rank:
        idx = np.asarray(idx).reshape(-1, top_k)
        t = idx.shape[0]
        valid = idx >= 0
        owner = np.where(valid, idx // e_local, 0)
        dst = np.zeros((t, ranks), dtype=bool)
        rows = np.repeat(np.arange(t), top_k).reshape(t, top_k)
        dst[rows[valid], owner[valid]] = True
        tok_dst.append(dst)
        slot_counts.append(np.bincount(owner[valid], minlength=ranks))
        tokens.append(t)
    out = []
    for r in range(ranks):
        peers = [d for d in range(ranks) if d != r]
        sent_dispatch = int(tok_dst[r][:, peers].sum()) * row + tokens[r] * meta * (ranks - 1)
        recv_dispatch = sum(int(tok_dst[s][:, r].sum()) * row + tokens[s] * meta for s in peers)
        sent_return = sum(int(slot_counts[s][r]) for s in peers) * 2 * hidden
        recv_return = int(slot_counts[r][peers].sum()) * 2 * hidden
        local = (int(tok_dst[r][:, r].sum()) * row + tokens[r] * meta
                 + int(slot_counts[r][r]) * 2 * hidden)
        out.append({"sent_dispatch": sent_dispatch, "sent_return": sent_return,
                    "recv_dispatch": recv_dispatch, "recv_return": recv_return,
                    "sent": sent_dispatch + sent_return, "recv": recv_dispatch + recv_return,
                    "local": local})
    return out


def bits_mismatch(want, got):
    """Number of differing BF16 values (uint16 bit arrays of one shape)."""
    want, got = np.asarray(want), np.asarray(got)
    if want.shape != got.shape:
        raise ValueError(f"shape {got.shape} != {want.shape}")
    return int(np.count_nonzero(want != got))


def bf16_bits_to_f64(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(
        np.float64)


def diff_metric(a, b):
    """1 - 2<a,b> / (<a,a> + <b,b>) in FP64 (numerics.md section 8; 0 when both are zero)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    den = float(a @ a + b @ b)
    return 0.0 if den == 0.0 else 1.0 - 2.0 * float(a @ b) / den


def layer_flops(tokens, top_k, hidden, inter):
    """FLOPs of one rank's call: T K rows through L1 (2I x H) and L2 (H x I)."""
    return 6.0 * tokens * top_k * hidden * inter


def perf_derived(ep_us, base_us, sent, recv, ceiling_gbs, tokens, top_k, hidden, inter):
    """The derived columns of a perf row."""
    comm_us = max(sent, recv) / (ceiling_gbs * 1e3) if ceiling_gbs else None
    overhead = ep_us - base_us
    hidden_frac = None
    if comm_us:
        hidden_frac = max(0.0, 1.0 - max(overhead, 0.0) / comm_us)
    return {"overhead_us": overhead, "comm_us_at_ceiling": comm_us, "hidden": hidden_frac,
            "ep_tflops": layer_flops(tokens, top_k, hidden, inter) / (ep_us * 1e6) if ep_us else None,
            "link_gbs": max(sent, recv) / (ep_us * 1e3) if ep_us else None}


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_table(perf_rows, ranks, ceiling_gbs=None):
    """Markdown table of the perf rows (dicts as written to results.jsonl), one line per (shape,
    T), rank 0's bytes and the slowest rank's times."""
    lines = []
    if ceiling_gbs:
        lines.append(f"One-way peer copy ceiling (cuda:0 -> cuda:1, same run): {ceiling_gbs:.1f} GB/s")
        lines.append("")
    lines.append(f"EP = {ranks}, one process per GPU (times: slowest rank's median)")
    lines.append("")
    lines.append("| shape | T per rank | EP us | EP=1 (E/R experts) us | overhead us | sent MB | "
                 "recv MB | comm us at ceiling | hidden | link GB/s | TFLOP/s per rank |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in perf_rows:
        lines.append(
            f"| {p['shape']} | {p['tokens']} | {_fmt(p.get('ep_us'), '.1f')} | "
            f"{_fmt(p.get('base_us'), '.1f')} | {_fmt(p.get('overhead_us'), '.1f')} | "
            f"{_fmt(p['sent'] / 1e6, '.2f')} | {_fmt(p['recv'] / 1e6, '.2f')} | "
            f"{_fmt(p.get('comm_us_at_ceiling'), '.1f')} | {_fmt(p.get('hidden'), '.2f')} | "
            f"{_fmt(p.get('link_gbs'), '.1f')} | {_fmt(p.get('ep_tflops'), '.1f')} |")
    if ranks == 8:
        lines += ["", DEEPGEMM_X8]
    return "\n".join(lines) + "\n"


def merge_perf(records, ranks):
    """Per (shape, T): the slowest rank's EP and EP = 1 medians, rank 0's bytes (all ranks' bytes
    kept), and the derived columns."""
    by_key = {}
    for rec in records:
        if rec.get("kind") == "perf":
            by_key.setdefault((rec["shape"], rec["tokens"]), []).append(rec)
    ceiling = next((r["gbs"] for r in records if r.get("kind") == "copy_ceiling"), None)
    rows = []
    for (shape, tokens), recs in by_key.items():
        recs = sorted(recs, key=lambda r: r["rank"])
        ep_us = max(r["ep_us"] for r in recs)
        base_us = max(r["base_us"] for r in recs)
        r0 = recs[0]
        row = {"kind": "perf_row", "shape": shape, "tokens": tokens, "ranks_reported": len(recs),
               "ep_us": ep_us, "base_us": base_us, "ep_us_per_rank": [r["ep_us"] for r in recs],
               "base_us_per_rank": [r["base_us"] for r in recs], "sent": r0["bytes"]["sent"],
               "recv": r0["bytes"]["recv"], "bytes_per_rank": [r["bytes"] for r in recs],
               "timing": sorted({r["timing"] for r in recs})}
        row.update(perf_derived(ep_us, base_us, row["sent"], row["recv"], ceiling, tokens,
                                r0["top_k"], r0["hidden"], r0["inter"]))
        rows.append(row)
    order = {s: i for i, s in enumerate(DEFAULT_SHAPES)}
    rows.sort(key=lambda r: (order.get(r["shape"], 99), r["shape"], r["tokens"]))
    return rows, ceiling


def evaluate_cases(megamoe, case_dir, case_records, ranks):
    """The parent's comparisons of the correctness cases: list of check dicts."""
    checks = []
    for rec in case_records:
        name, shape = rec["case"], rec["shape"]
        counts = rec["counts"]
        for policy, ref_rank in (("tile", 0), ("auto", 1 if ranks > 1 else 0)):
            check = {"check": f"ep_equals_ep1/{shape}/{name}/{policy}", "ok": False}
            try:
                want = np.load(os.path.join(case_dir, f"{shape}_{name}_{policy}_ref.npy"))
                parts = [np.load(os.path.join(case_dir, f"{shape}_{name}_{policy}_r{r}.npy"))
                         for r in range(ranks)]
                for r, (p, t) in enumerate(zip(parts, counts)):
                    if p.shape[0] != t:
                        raise AssertionError(f"rank {r} returned {p.shape[0]} rows, not {t}")
                got = np.concatenate(parts) if parts else want[:0]
                if policy == "tile":
                    bad = bits_mismatch(want, got)
                    check.update(ok=bad == 0, mismatches=bad, values=int(want.size))
                    rows_ref = np.load(os.path.join(case_dir, f"{shape}_{name}_rows_ref.npy"))
                    e_local = rows_ref.size // ranks
                    bad_rows = [r for r in range(ranks) if not np.array_equal(
                        np.load(os.path.join(case_dir, f"{shape}_{name}_rows_r{r}.npy")),
                        rows_ref[r * e_local:(r + 1) * e_local])]
                    check["expert_rows_differ_on_ranks"] = bad_rows
                    check["ok"] = check["ok"] and not bad_rows
                else:
                    d = diff_metric(bf16_bits_to_f64(got), bf16_bits_to_f64(want))
                    check["diff"] = d
                    if megamoe is not None and rec.get("idx_file"):
                        try:
                            cfg = megamoe.LayerConfig(shape)
                            idx = np.load(os.path.join(case_dir, rec["idx_file"]))
                            c = megamoe.compare_output(cfg, got, bf16_bits_to_f64(want), idx)
                            check["compare_output"] = {k: (float(v) if isinstance(v, float) else v)
                                                       for k, v in c.items()}
                            d = max(d, float(c["diff"]))
                        except Exception as e:  # the numpy diff above still decides
                            check["compare_output_error"] = repr(e)
                    check["ok"] = d < AUTO_DIFF_LIMIT
            except Exception as e:
                check["error"] = repr(e)
            checks.append(check)
    return checks


def summarize_checks(child_records, parent_checks, ranks, finished):
    """One verdict per check name: ok when every record of it is ok (and, for per-rank checks,
    every rank reported)."""
    verdicts = {}
    for rec in child_records:
        if rec.get("kind") != "check":
            continue
        v = verdicts.setdefault(rec["check"], {"check": rec["check"], "ok": True, "ranks": [],
                                               "details": []})
        v["ok"] = v["ok"] and bool(rec["ok"])
        v["ranks"].append(rec["rank"])
        if not rec["ok"] or rec.get("detail"):
            v["details"].append({"rank": rec["rank"], "detail": rec.get("detail"),
                                 "ok": rec["ok"]})
    for v in verdicts.values():
        if not v["check"].startswith("child_error/") and sorted(set(v["ranks"])) != list(range(ranks)):
            missing = sorted(set(range(ranks)) - set(v["ranks"]))
            v["ok"] = False
            v["details"].append({"missing_ranks": missing})
    for c in parent_checks:
        verdicts[c["check"]] = c
    for r in range(ranks):
        if not finished.get(r, False):
            errors = [rec["error"].strip().splitlines()[-1] for rec in child_records
                      if rec.get("kind") == "error" and rec.get("rank") == r and rec.get("error")]
            verdicts[f"child/rank{r}"] = {"check": f"child/rank{r}", "ok": False,
                                          "details": ["did not finish (crashed or killed)"]
                                          + errors}
    return list(verdicts.values())


def nccl_lib_dir():
    """The lib folder of torch's nvidia-nccl wheel, or None."""
    try:
        import nvidia.nccl as nn
    except ImportError:
        return None
    for p in list(getattr(nn, "__path__", [])):
        d = os.path.join(p, "lib")
        if os.path.isdir(d):
            return d
    return None


def child_env(base):
    """The environment of the children: torch's libnccl first, no NVLink SHARP."""
    env = dict(base)
    env["NCCL_NVLS_ENABLE"] = "0"
    lib = nccl_lib_dir()
    if lib:
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"]
                                        if env.get("LD_LIBRARY_PATH") else "")
    return env


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=0, help="ranks = GPUs used (default: all visible)")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                    help="perf: tokens per rank")
    ap.add_argument("--steps", default="correctness,perf")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="the EP groups' timeout_s")
    ap.add_argument("--timeout-check-s", type=float, default=1.0,
                    help="timeout_s of the group of the timeout check")
    ap.add_argument("--check-tokens", type=int, default=64, help="correctness: T per rank")
    ap.add_argument("--tile", default=DEFAULT_TILE, help="forced GEMM tile of the bitwise check")
    ap.add_argument("--reps", type=int, default=0, help="timed calls (0: 50 for T <= 512, else 15)")
    ap.add_argument("--timing", choices=("graph", "eager"), default="graph")
    ap.add_argument("--deadline-s", type=float, default=420.0,
                    help="the children are killed after this long")
    ap.add_argument("--precision", choices=("exact", "fp8"), default="exact",
                    help="every layer's precision (fp8: the FP8 mode by the layer's rule, "
                         "docs/numerics.md; run the command once per precision)")
    ap.add_argument("--mega", action="store_true",
                    help="every layer with the MegaMoE kernel (LayerConfig(mega_kernel=True): "
                         "both GEMMs of decode calls in one launch; run the command with and "
                         "without it)")
    ap.add_argument("--mega-dispatch", action="store_true",
                    help="with --mega: the dispatch inside the MegaMoE kernel "
                         "(LayerConfig(mega_dispatch=True): each received row gathered as it "
                         "arrives; run the command with --mega alone and with both)")
    ap.add_argument("--mega-combine", action="store_true",
                    help="with --mega: the combine inside the MegaMoE kernel "
                         "(LayerConfig(mega_combine=True): the kernel returns its rows' signal "
                         "and sums y of calls up to 16384 items, T * H / 8; run the command with "
                         "--mega alone and with both)")
    ap.add_argument("--out", default="/tmp/ep_multi")
    args = ap.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.steps = [s for s in args.steps.split(",") if s]
    bad = set(args.steps) - {"correctness", "perf"}
    if bad:
        ap.error(f"unknown steps {sorted(bad)}")
    if args.mega_dispatch and not args.mega:
        ap.error("--mega-dispatch needs --mega")
    if args.mega_combine and not args.mega:
        ap.error("--mega-combine needs --mega")
    return args


# ------------------------------------------------------------------------------------------------
# The child: one process per GPU
# ------------------------------------------------------------------------------------------------
class Child:
    def __init__(self, rank, ranks, args, barrier):
        import torch
        import megamoe
        import megamoe.ep

        self.torch, self.mm = torch, megamoe
        self.rank, self.ranks, self.args, self.barrier = rank, ranks, args, barrier
        torch.cuda.set_device(rank)
        self.dev = torch.device("cuda", rank)
        self.log = open(os.path.join(args.out, f"rank{rank}.jsonl"), "a", buffering=1)
        self.uid_dir = os.path.join(args.out, "uids")
        self.case_dir = os.path.join(args.out, "cases")

    # -- plumbing
    def emit(self, **rec):
        rec.setdefault("rank", self.rank)
        rec["t"] = round(time.time(), 3)
        self.log.write(json.dumps(rec, default=str) + "\n")

    def check(self, name, ok, detail=None):
        self.emit(kind="check", check=name, ok=bool(ok), detail=detail)

    def sync(self, timeout=None):
        self.torch.cuda.synchronize()
        self.barrier.wait(timeout or max(180.0, 6 * self.args.timeout_s))

    def unique_id(self, name):
        """Rank 0 makes the id and writes it (atomically); the others wait for the file."""
        path = os.path.join(self.uid_dir, name + ".bin")
        if self.rank == 0:
            uid = self.mm.ep.nccl_unique_id()
            with open(path + ".tmp", "wb") as f:
                f.write(uid)
            os.replace(path + ".tmp", path)
            return uid
        t0 = time.time()
        while not os.path.exists(path):
            if time.time() - t0 > 120:
                raise TimeoutError(f"no unique id {name} from rank 0 after 120 s")
            time.sleep(0.05)
        with open(path, "rb") as f:
            return f.read()

    def group(self, name, cfg, timeout_s, max_recv_rows=0):
        return self.mm.ep.nccl_group(cfg, self.unique_id(name), self.ranks, self.rank,
                                     timeout_s=timeout_s, max_recv_rows=max_recv_rows)

    def to_dev(self, x, idx, w):
        t = self.torch
        xs = t.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(t.bfloat16).to(self.dev)
        return xs, t.from_numpy(np.ascontiguousarray(idx)).to(self.dev), \
            t.from_numpy(np.ascontiguousarray(w)).to(self.dev)

    def bits(self, y):
        return y.detach().cpu().view(self.torch.int16).numpy().view(np.uint16)

    def cfg(self, shape, cap, tile="auto", ep=True):
        if ep:
            return self.mm.LayerConfig(shape, ep_size=self.ranks, ep_rank=self.rank,
                                       max_tokens_per_rank=cap, gemm_tile=tile,
                                       precision=self.args.precision, mega_kernel=self.args.mega,
                                       mega_dispatch=self.args.mega_dispatch,
                                       mega_combine=self.args.mega_combine)
        return self.mm.LayerConfig(shape, max_tokens_per_rank=cap, gemm_tile=tile,
                                   precision=self.args.precision, mega_kernel=self.args.mega,
                                   mega_dispatch=self.args.mega_dispatch,
                                   mega_combine=self.args.mega_combine)

    # -- correctness
    def correctness(self, shape):
        mm, torch, R, r = self.mm, self.torch, self.ranks, self.rank
        cap, tile = self.args.check_tokens, self.args.tile
        group = self.group(f"check_{shape}", self.cfg(shape, cap), self.args.timeout_s)
        layers = {}
        for policy, t in (("tile", tile), ("auto", "auto")):
            c = self.cfg(shape, cap, t)
            layers[policy] = mm.MoELayer(c, mm.synthetic_weights(c, SEED), backend="sm90",
                                         group=group)
        refs = {}
        if r == 0:
            c = self.cfg(shape, R * cap, tile, ep=False)
            refs["tile"] = mm.MoELayer(c, mm.synthetic_weights(c, SEED), backend="sm90")
        if r == (1 if R > 1 else 0):
            c = self.cfg(shape, R * cap, "auto", ep=False)
            refs["auto"] = mm.MoELayer(c, mm.synthetic_weights(c, SEED), backend="sm90")
        sh = layers["tile"].config.shape
        self.emit(kind="built", shape=shape, step="correctness")
        for name, routing, counts, empty in case_list(R, cap):
            x, idx, w = global_inputs(mm, sh.hidden, sh.num_experts, sh.top_k, counts, routing,
                                      empty_slots=empty)
            mine = split_rows((x, idx, w), counts)[r]
            dev_in = self.to_dev(*mine)
            self.sync()
            ys = {p: layers[p].forward(*dev_in) for p in ("tile", "auto")}
            for p in ("tile", "auto"):
                layers[p].check_errors()
                np.save(os.path.join(self.case_dir, f"{shape}_{name}_{p}_r{r}.npy"), self.bits(ys[p]))
            np.save(os.path.join(self.case_dir, f"{shape}_{name}_rows_r{r}.npy"),
                    np.asarray(layers["tile"].expert_rows(), np.int64))
            full = self.to_dev(x, idx, w) if refs else None
            for p, layer in refs.items():
                y = layer.forward(*full)
                layer.check_errors()
                np.save(os.path.join(self.case_dir, f"{shape}_{name}_{p}_ref.npy"), self.bits(y))
                if p == "tile":
                    np.save(os.path.join(self.case_dir, f"{shape}_{name}_rows_ref.npy"),
                            np.asarray(layer.expert_rows(), np.int64))
            if r == 0:
                np.save(os.path.join(self.case_dir, f"{shape}_{name}_idx.npy"), idx)
                self.emit(kind="case", shape=shape, case=name, routing=routing, counts=counts,
                          idx_file=f"{shape}_{name}_idx.npy")
        del refs
        self.sync()
        self.graph_check(shape, layers["tile"], cap)
        self.sync()
        self.capacity_check(shape, layers["tile"], cap)
        self.sync()
        del layers, group
        torch.cuda.synchronize()
        self.barrier.wait(120)

    def graph_check(self, shape, layer, cap):
        mm, torch = self.mm, self.torch
        sh = layer.config.shape
        name = f"graph_replay_equals_eager/{shape}"
        try:
            counts = [cap] * self.ranks

            def inputs(seed):
                x, idx, w = global_inputs(mm, sh.hidden, sh.num_experts, sh.top_k, counts,
                                          "uniform", seed=seed)
                return self.to_dev(*split_rows((x, idx, w), counts)[self.rank])

            sx, si, sw = inputs(21)
            sy = torch.empty((cap, sh.hidden), dtype=torch.bfloat16, device=self.dev)
            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):
                layer.forward(sx, si, sw, out=sy)  # one call on every rank
            torch.cuda.current_stream().wait_stream(warm)
            layer.check_errors(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer.forward(sx, si, sw, out=sy)
            bad = []
            for seed in (22, 23):
                nx, ni, nw = inputs(seed)
                sx.copy_(nx), si.copy_(ni), sw.copy_(nw)
                graph.replay()
                eager = layer.forward(nx, ni, nw)
                layer.check_errors()
                n = bits_mismatch(self.bits(sy), self.bits(eager))
                if n:
                    bad.append({"seed": seed, "mismatches": n})
            self.check(name, not bad, bad or None)
        except Exception as e:
            self.check(name, False, repr(e))
            raise

    def capacity_check(self, shape, layer, cap):
        mm = self.mm
        sh = layer.config.shape
        name = f"capacity_overflow_reported/{shape}"
        over, fine = cap + 1, max(cap // 2, 1)
        counts = [over] + [fine] * (self.ranks - 1)
        x, idx, w = global_inputs(mm, sh.hidden, sh.num_experts, sh.top_k, counts, "uniform",
                                  seed=31)
        mine = self.to_dev(*split_rows((x, idx, w), counts)[self.rank])
        detail = None
        try:
            if self.rank == 0:
                try:
                    layer.forward(*mine)
                    ok, detail = False, "forward above capacity did not raise"
                except mm.OutOfRangeError as e:
                    ok = f"exceeds the layer capacity max_tokens_per_rank = {cap}" in str(e)
                    detail = str(e)[:300]
                layer.check_errors()  # raised already: not a second time
            else:
                layer.forward(*mine)
                try:
                    layer.check_errors()
                    ok, detail = False, "check_errors did not raise"
                except mm.OutOfRangeError as e:
                    want = (f"rank 0 called the layer with T = {over} tokens, above "
                            f"max_tokens_per_rank = {cap}")
                    ok, detail = want in str(e), str(e)[:300]
            # not a timeout: the next call is clean on every rank
            self.sync()
            counts = [cap] * self.ranks
            x, idx, w = global_inputs(mm, sh.hidden, sh.num_experts, sh.top_k, counts,
                                      "skewed", seed=32)
            layer.forward(*self.to_dev(*split_rows((x, idx, w), counts)[self.rank]))
            layer.check_errors()
            ok = ok and not layer.group.broken
        except Exception as e:
            ok, detail = False, repr(e)
            raise
        finally:
            self.check(name, ok, detail)

    def timeout_check(self):
        """Last: rank R-1 never calls; the others raise TimeoutError within timeout_s."""
        mm, torch = self.mm, self.torch
        limit = self.args.timeout_check_s
        name = "peer_that_skips_times_out"
        cfg = mm.LayerConfig("small", ep_size=self.ranks, ep_rank=self.rank,
                             max_tokens_per_rank=16, gemm_tile=self.args.tile)
        group = self.group("timeout", cfg, limit)
        layer = mm.MoELayer(cfg, mm.synthetic_weights(cfg, SEED), backend="sm90", group=group)
        sh = cfg.shape
        x, idx, w = global_inputs(mm, sh.hidden, sh.num_experts, sh.top_k, [8], "uniform")
        dev_in = self.to_dev(x, idx, w)
        self.sync()
        if self.rank == self.ranks - 1:
            self.check(name, True, "this rank skipped the call")
        else:
            t0 = time.time()
            layer.forward(*dev_in)
            try:
                layer.check_errors()
                self.check(name, False, "no error")
            except mm.TimeoutError as e:
                elapsed = time.time() - t0
                ok = (elapsed <= limit + 2.0 and f"waiting for rank {self.ranks - 1}" in str(e)
                      and group.broken)
                self.check(name, ok, {"elapsed_s": round(elapsed, 3), "message": str(e)[:300],
                                      "broken": group.broken})
        # The group is broken (or skipped): never destroy it; the process ends with os._exit.
        self._keep = (group, layer)
        torch.cuda.synchronize()

    # -- perf
    def copy_ceiling(self):
        torch = self.torch
        if self.rank == 0 and torch.cuda.device_count() > 1:
            n = 1 << 30
            res = {}
            for a, b in ((0, 1), (1, 0)):
                src = torch.empty(n, dtype=torch.uint8, device=f"cuda:{a}")
                dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{b}")
                for _ in range(2):
                    dst.copy_(src)
                torch.cuda.synchronize(a), torch.cuda.synchronize(b)
                reps, times = 5, []
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        dst.copy_(src, non_blocking=True)
                    torch.cuda.synchronize(a), torch.cuda.synchronize(b)
                    times.append((time.perf_counter() - t0) / reps)
                res[f"{a}->{b}"] = n / min(times) / 1e9
                del src, dst
            torch.cuda.empty_cache()
            self.emit(kind="copy_ceiling", gbs=res["0->1"], both=res, bytes=n)
        self.sync()

    def time_calls(self, fn, static, reps):
        """Median us of `reps` calls of fn (a CUDA graph of it when --timing graph and capture
        works; the number of calls is the same either way)."""
        torch = self.torch
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        mode, graph = self.args.timing, None
        if mode == "graph":
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
            except Exception as e:
                self.emit(kind="note", note=f"graph capture failed, eager: {e!r}")
                graph, mode = None, "eager"
        run = graph.replay if graph is not None else fn
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
        self.sync()
        for a, b in ev:
            a.record()
            run()
            b.record()
        torch.cuda.synchronize()
        us = sorted(a.elapsed_time(b) * 1e3 for a, b in ev)
        return us[len(us) // 2], mode

    def perf(self, shape):
        mm, torch, R, r = self.mm, self.torch, self.ranks, self.rank
        tmax = max(self.args.tokens)
        base_cfg = self.cfg(shape, tmax)
        sh = base_cfg.shape
        e_local = sh.num_experts // R
        rows = min(R * tmax * min(sh.top_k, e_local), 2 * tmax * sh.top_k + 4096)
        group = self.group(f"perf_{shape}", base_cfg, self.args.timeout_s, max_recv_rows=rows)
        ep = mm.MoELayer(base_cfg, mm.synthetic_weights(base_cfg, SEED), backend="sm90",
                         group=group)
        # (its rule sees T*K/E_l rows per expert, as the EP layer's T x R does)
        one_cfg = mm.LayerConfig(mm.LayerShape(sh.hidden, sh.intermediate, e_local, sh.top_k),
                                 activation=base_cfg.activation, max_tokens_per_rank=tmax,
                                 precision=self.args.precision, mega_kernel=self.args.mega,
                                 mega_dispatch=self.args.mega_dispatch,
                                 mega_combine=self.args.mega_combine)
        one = mm.MoELayer(one_cfg, mm.synthetic_weights(one_cfg, SEED), backend="sm90")
        self.emit(kind="built", shape=shape, step="perf", max_recv_rows=rows)
        for t in self.args.tokens:
            reps = self.args.reps or (50 if t <= 512 else 15)
            seeds = [1000 + 7 * s + t for s in range(R)]
            idx_all = [mm.make_routing("uniform", t, sh.num_experts, sh.top_k, s)[0] for s in seeds]
            nbytes = exchange_bytes(idx_all, sh.num_experts, sh.hidden, sh.top_k)[r]
            g = torch.Generator(device="cpu").manual_seed(seeds[r])
            x = torch.randn((t, sh.hidden), generator=g).to(torch.bfloat16).to(self.dev)
            idx, w = mm.make_routing("uniform", t, sh.num_experts, sh.top_k, seeds[r])
            idx, w = torch.from_numpy(idx).to(self.dev), torch.from_numpy(w).to(self.dev)
            y = torch.empty_like(x)
            self.sync()
            ep_us, ep_mode = self.time_calls(lambda: ep.forward(x, idx, w, out=y), None, reps)
            ep.check_errors()
            lidx, lw = mm.make_routing("uniform", t, e_local, sh.top_k, seeds[r])
            lidx, lw = torch.from_numpy(lidx).to(self.dev), torch.from_numpy(lw).to(self.dev)
            y1 = torch.empty_like(x)
            base_us, _ = self.time_calls(lambda: one.forward(x, lidx, lw, out=y1), None, reps)
            one.check_errors()
            self.emit(kind="perf", shape=shape, tokens=t, ep_us=ep_us, base_us=base_us,
                      timing=ep_mode, reps=reps, bytes=nbytes, top_k=sh.top_k, hidden=sh.hidden,
                      inter=sh.intermediate, e_local=e_local, rows_received=sum(ep.expert_rows()))
        self.sync()
        del ep, one, group
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.barrier.wait(120)


def child_main(rank, ranks, args, barrier):
    child = None
    try:
        child = Child(rank, ranks, args, barrier)
        child.emit(kind="start", device=child.torch.cuda.get_device_name(rank),
                   nccl_version=child.mm.ep.nccl_version(),
                   ld_library_path=os.environ.get("LD_LIBRARY_PATH", ""),
                   nvls=os.environ.get("NCCL_NVLS_ENABLE"))
        if "correctness" in args.steps:
            for shape in args.shapes:
                child.correctness(shape)
        if "perf" in args.steps:
            child.copy_ceiling()
            for shape in args.shapes:
                child.perf(shape)
        if "correctness" in args.steps:
            child.timeout_check()  # last: its group is broken afterwards
        child.emit(kind="done")
    except BaseException:
        tb = traceback.format_exc()
        if child is not None:
            child.emit(kind="error", error=tb)
            child.check(f"child_error/rank{rank}", False, tb[-2000:])
        else:
            print(f"rank {rank}: {tb}", file=sys.stderr, flush=True)
            with open(os.path.join(args.out, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps({"kind": "error", "rank": rank, "error": tb}) + "\n")
        try:
            barrier.abort()  # the others stop waiting at their next barrier
        except Exception:
            pass
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)  # no destructors: a broken group's teardown must not hang the process


# ------------------------------------------------------------------------------------------------
# The parent
# ------------------------------------------------------------------------------------------------
def read_jsonl(path):
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    return out


def visible_gpus():
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def main(argv=None):
    args = parse_args(argv)
    ranks = args.gpus or visible_gpus()
    if ranks < 1:
        print("FAIL setup: no CUDA device visible", flush=True)
        return 2
    os.makedirs(os.path.join(args.out, "uids"), exist_ok=True)
    os.makedirs(os.path.join(args.out, "cases"), exist_ok=True)
    for r in range(64):
        p = os.path.join(args.out, f"rank{r}.jsonl")
        if os.path.exists(p):
            os.remove(p)
    for d in ("uids", "cases"):
        for f in os.listdir(os.path.join(args.out, d)):
            os.remove(os.path.join(args.out, d, f))

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    env = child_env(os.environ)
    saved = dict(os.environ)
    os.environ.clear(), os.environ.update(env)  # spawn children inherit os.environ
    barrier = ctx.Barrier(ranks)
    procs = [ctx.Process(target=child_main, args=(r, ranks, args, barrier), name=f"ep-rank{r}")
             for r in range(ranks)]
    t0 = time.time()
    for p in procs:
        p.start()
    os.environ.clear(), os.environ.update(saved)
    print(f"ep_multi_gpu: {ranks} ranks, pids {[p.pid for p in procs]}, NCCL lib "
          f"{nccl_lib_dir()}, out {args.out}", flush=True)
    for p in procs:
        p.join(max(0.0, args.deadline_s - (time.time() - t0)))
    killed = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()  # our own child, by its Process handle
            p.join(10)
            killed.append(r)
    wall = time.time() - t0

    records = []
    for r in range(ranks):
        records += read_jsonl(os.path.join(args.out, f"rank{r}.jsonl"))
    finished = {r: any(x.get("kind") == "done" and x["rank"] == r for x in records)
                for r in range(ranks)}
    try:
        import megamoe
    except ImportError:
        megamoe = None
    parent_checks = []
    if "correctness" in args.steps:
        cases = [x for x in records if x.get("kind") == "case"]
        parent_checks = evaluate_cases(megamoe, os.path.join(args.out, "cases"), cases, ranks)
    verdicts = summarize_checks(records, parent_checks, ranks, finished)
    perf_rows, ceiling = merge_perf(records, ranks)
    with open(os.path.join(args.out, "results.jsonl"), "w") as f:
        f.write(json.dumps({"kind": "run", "ranks": ranks, "wall_s": round(wall, 1),
                            "killed_ranks": killed, "args": vars(args)}) + "\n")
        for v in verdicts:
            f.write(json.dumps(dict(v, kind="verdict"), default=str) + "\n")
        for row in perf_rows:
            f.write(json.dumps(row, default=str) + "\n")
    table = format_table(perf_rows, ranks, ceiling) if perf_rows else ""
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("| check | result |\n|---|---|\n")
        for v in verdicts:
            f.write(f"| {v['check']} | {'PASS' if v['ok'] else 'FAIL'} |\n")
        f.write("\n" + table)
    for v in verdicts:
        extra = ""
        if not v["ok"]:
            extra = " " + json.dumps({k: v[k] for k in v if k not in ("check", "ok")},
                                     default=str)[:400]
        print(f"{'PASS' if v['ok'] else 'FAIL'} {v['check']}{extra}", flush=True)
    if table:
        print(table, flush=True)
    failed = [v for v in verdicts if not v["ok"]]
    print(f"ep_multi_gpu: {len(verdicts) - len(failed)} of {len(verdicts)} checks passed, "
          f"{wall:.0f} s, killed ranks {killed or 'none'}", flush=True)
    return 1 if failed or killed else 0


if __name__ == "__main__":
    sys.exit(main())
