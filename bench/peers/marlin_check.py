#!/usr/bin/env python3
"""GPU check of the Marlin MoE peer (marlin-mxfp4-w4a16, peer_marlin.py), one short device call:

    python3 bench/peers/marlin_check.py [--points small:1,small:37,...] [--time]

For each point (shape:T; default the small shape at T = 1, 100, 200, 300, 2000, which take the
moe block sizes 8, 16, 32, 48, 64, deepseek-v3 at T = 8 and 512, kimi-k3 (situ, 112 experts) at
T = 64) on the same seeded weights and inputs as worker.py:
  - library load and build info;
  - routing layout: the GPU moe_align_block_size equals the CPU one;
  - L1 alone: the Marlin L1 output of every slot against x @ dequant(W13[e])^T in FP32 (diff and
    max |err| relative to the largest output), once with the real scales and once with every
    scale byte 127, so a wrong weight repack and a wrong scale permutation tell themselves apart;
  - the layer: worker.check_point, i.e. numerics.md section 8's metric against the FP64 ideal (the
    pass/FAIL of the comparison) and the diff against reference.py's contract;
  - CUDA graph replay bitwise equal to the eager call; with --time, the median of 20 replays.
Prints one line per check and `marlin_check: PASS` or `marlin_check: FAIL (n)`; exit code 0 / 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import common  # noqa: E402
import peer_marlin as pm  # noqa: E402
import worker  # noqa: E402

DEFAULT_POINTS = 'small:1,small:100,small:200,small:300,small:2000,deepseek-v3:8,deepseek-v3:512,kimi-k3:64'
L1_MAX_DIFF = 1e-4          # BF16 output rounding of an FP32-accumulated product: diff ~1e-6
FAILED = []


def report(ok: bool, what: str):
    print(('PASS ' if ok else 'FAIL ') + what, flush=True)
    if not ok:
        FAILED.append(what)


def l1_check(peer, weights, inp, c1, label: str):
    """Marlin's L1 rows against x @ dequant(W13)^T (FP32), for the slots of the first 256 tokens."""
    t_count, top_k = inp.topk_idx.shape
    rows = min(t_count, 256)
    idx = inp.topk_idx[:rows].long()
    got = c1.view(t_count, top_k, -1)[:rows].float()
    want = torch.empty_like(got)
    for e in torch.unique(idx).tolist():
        t_sel, k_sel = (idx == e).nonzero(as_tuple=True)
        w = common.dequant_mxfp4(weights.w13[e], weights.w13_sf[e], torch.float32)
        want[t_sel, k_sel] = inp.x[t_sel].float() @ w.T
    d = common.diff_metric(got, want)
    rel = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    nan = bool(torch.isnan(got).any())
    report(not nan and d < L1_MAX_DIFF, f'{label}: L1 diff {d:.2e}, max|err|/max|ref| {rel:.2e}'
                                        f'{", NaN rows" if nan else ""}')


def check_point(shape_name: str, t_count: int, peers: dict, args):
    shape = common.SHAPES[shape_name]
    label = f'{shape_name} T={t_count}'
    if shape_name not in peers:
        t0 = time.time()
        weights = common.synthetic_weights(shape, worker.SEED_WEIGHTS, 'cuda')
        peers[shape_name] = (weights, pm.MarlinMxfp4W4A16(shape, weights))
        torch.cuda.synchronize()
        print(f'{shape_name}: weights + Marlin repack in {time.time() - t0:.1f} s '
              f'({peers[shape_name][1].weight_bytes() / 1e9:.2f} GB)', flush=True)
    weights, peer = peers[shape_name]
    inp = common.make_inputs(shape, t_count, worker.input_seed(t_count, 0), 'cuda')
    block = pm.block_size_for(t_count, shape.top_k, weights.num_experts)
    gpu = pm.align_block_size(inp.topk_idx, block, weights.num_experts)
    cpu = pm.align_block_size(inp.topk_idx.cpu(), block, weights.num_experts)
    n = int(cpu[2][0])
    same = (int(gpu[2][0]) == n and torch.equal(gpu[0].cpu(), cpu[0])
            and torch.equal(gpu[1].cpu()[:n // block], cpu[1][:n // block]))
    report(same, f'{label}: routing layout (moe block {block}, {n} padded rows) GPU == CPU')

    run = peer.build(inp)
    y = run().clone()
    torch.cuda.synchronize()
    l1_check(peer, weights, inp, run.buffers['l1'], label)
    if args.unit_scales:
        w127 = dataclasses.replace(weights, w13_sf=torch.full_like(weights.w13_sf, 127),
                                   w2_sf=torch.full_like(weights.w2_sf, 127))
        p127 = pm.MarlinMxfp4W4A16.__new__(pm.MarlinMxfp4W4A16)
        p127.__dict__.update(peer.__dict__)
        p127.s13 = pm.marlin_mxfp4_scales(w127.w13_sf)
        p127.s2 = pm.marlin_mxfp4_scales(w127.w2_sf)
        r127 = p127.build(inp)
        r127()
        torch.cuda.synchronize()
        l1_check(p127, w127, inp, r127.buffers['l1'], label + ' (all scale bytes 127)')
        del p127, r127
    rec = worker.check_point(shape, weights, inp, y, min(t_count, worker.CHECK_ROWS))
    report(rec['check'] == 'pass',
           f'{label}: layer vs FP64 ideal diff {rec["diff_vs_ideal"]:.2e} (worst row '
           f'{rec["worst_row_diff_vs_ideal"]:.2e}, worst expert {rec["worst_expert_diff_vs_ideal"]:.2e}, '
           f'max|err| {rec["max_abs_err_vs_ideal"]:.2e}); vs contract {rec["diff_vs_contract"]:.2e} '
           f'(contract vs ideal {rec["contract_diff_vs_ideal"]:.2e}); NaN {rec["output_nan"]}')
    try:
        g = common.GraphRunner(run)
        y_graph = g().clone()
        torch.cuda.synchronize()
        report(torch.equal(y_graph, y), f'{label}: CUDA graph replay == eager')
        if args.time:
            t = common.time_runs([g], warmup=3, iters=20)
            print(f'     {label}: {t["median_us"]:.1f} us median of 20 graph replays (one input set: L2-warm, '
                  f'indicative only; floor {common.floors(shape, t_count)["floor_us"]:.1f} us)', flush=True)
    except Exception as exc:
        report(False, f'{label}: CUDA graph capture: {type(exc).__name__}: {exc}'[:400])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--points', default=DEFAULT_POINTS, help='shape:T,...')
    ap.add_argument('--time', action='store_true', help='also time 20 graph replays per point')
    ap.add_argument('--no-unit-scales', dest='unit_scales', action='store_false',
                    help='skip the L1 check with every scale byte 127')
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print('marlin_check: no CUDA device', file=sys.stderr)
        return 2
    print(f'device: {torch.cuda.get_device_name()} (sm_{"".join(map(str, torch.cuda.get_device_capability()))}), '
          f'torch {torch.__version__}, CUDA {torch.version.cuda}', flush=True)
    print(f'library: {pm.LIB_PATH}', flush=True)
    try:
        lib = pm.load_library()
        print(f'library: {lib.mmp_build_info().decode()}; locks {lib.mmp_moe_workspace_ints()}', flush=True)
    except Exception as exc:
        report(False, f'library load: {type(exc).__name__}: {exc}')
        print(f'marlin_check: FAIL ({len(FAILED)})')
        return 1
    peers = {}
    for point in args.points.split(','):
        shape_name, t = point.split(':')
        reason = pm.MarlinMxfp4W4A16.unsupported(common.SHAPES[shape_name])
        if reason:
            report(False, f'{point}: unsupported: {reason}')
            continue
        try:
            check_point(shape_name, int(t), peers, args)
        except Exception as exc:
            traceback.print_exc()
            report(False, f'{point}: {type(exc).__name__}: {exc}'[:600])
            torch.cuda.synchronize()
    print(f'marlin_check: PASS' if not FAILED else f'marlin_check: FAIL ({len(FAILED)})', flush=True)
    return 1 if FAILED else 0


if __name__ == '__main__':
    sys.exit(main())
