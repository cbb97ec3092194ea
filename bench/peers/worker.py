"""Runs ONE peer on ONE shape over a list of token counts; one JSON line per point, flushed as it
goes, so a crash or a time-out of this process (compare.py runs it as a child with a limit) loses
only the point in flight.

Per point: build the peer on R input sets (same seeds for every peer, so every peer sees the same
x, routing and weights), run set 0 eagerly, check it against reference.py (FP64 ideal and the
contract) on the first --check-rows tokens, capture one CUDA graph per set (checked bitwise against
the eager output), then time with CUDA events, rotating over the sets.

Also `--ceilings`: re-measures the copy / BF16 / FP8 ceilings of targets.md in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import common  # noqa: E402
from common import SHAPES, Inputs, compare, diff_metric, floors, effective_tflops  # noqa: E402
import reference  # noqa: E402

# numerics.md section 8: FP8 x MXFP4 lands at 1e-3..1e-2 against the FP64 ideal; the worst row
# and the worst expert (its rows together) get 3x that.
MAX_DIFF = 1e-2
MAX_WORST_ROW_DIFF = 3e-2
CHECK_ROWS = 256
SEED_WEIGHTS = 1234
MAX_ROTATION_SETS = 4


def peer_classes():
    from peer_torch import TorchBf16Chain
    from peer_deepgemm import DeepGemmFp8Chain, DeepGemmMegaMoe, DeepGemmMegaMoeFp4
    from peer_triton import TritonMatmulOgs
    from peer_megamoe import MegamoePython, MegamoePythonFp8
    from peer_flashinfer import FlashInferSm90Mxfp4
    from peer_marlin import MarlinMxfp4W4A16
    return {c.name: c for c in (TorchBf16Chain, DeepGemmFp8Chain, DeepGemmMegaMoe, DeepGemmMegaMoeFp4,
                                TritonMatmulOgs, FlashInferSm90Mxfp4, MarlinMxfp4W4A16, MegamoePython,
                                MegamoePythonFp8)}


def input_seed(num_tokens: int, set_index: int) -> int:
    return 1_000_003 * num_tokens + 7919 * set_index + 17


def emit(out, rec: dict):
    line = json.dumps(rec, sort_keys=True)
    print(line, flush=True)
    if out:
        out.write(line + '\n')
        out.flush()


def check_point(shape, weights, inp: Inputs, y: torch.Tensor, rows: int) -> dict:
    sl = slice(0, rows)
    x, idx, w = inp.x[sl], inp.topk_idx[sl], inp.topk_weights[sl]
    ideal = reference.ideal_forward(shape, weights, x, idx, w)
    contract = reference.contract_forward(shape, weights, x, idx, w)
    vs_ideal = compare(y[sl], ideal, idx)
    res = {
        'check_rows': rows,
        'diff_vs_ideal': vs_ideal['diff'],
        'worst_row_diff_vs_ideal': vs_ideal['worst_row_diff'],
        'worst_expert_diff_vs_ideal': vs_ideal['worst_expert_diff'],
        'max_abs_err_vs_ideal': vs_ideal['max_abs_err'],
        'diff_vs_contract': diff_metric(y[sl], contract),
        'contract_diff_vs_ideal': diff_metric(contract, ideal),
        'output_nan': vs_ideal['nan'],
    }
    ok = (not vs_ideal['nan'] and vs_ideal['diff'] < MAX_DIFF
          and vs_ideal['worst_row_diff'] < MAX_WORST_ROW_DIFF
          and vs_ideal['worst_expert_diff'] < MAX_WORST_ROW_DIFF)
    res['check'] = 'pass' if ok else 'FAIL'
    return res


def run_point(peer, shape, weights, num_tokens: int, point_budget_s: float, check_rows: int) -> dict:
    dev = 'cuda'
    probe = common.make_inputs(shape, num_tokens, input_seed(num_tokens, 0), dev)
    n_sets = min(MAX_ROTATION_SETS, common.rotation_count(probe.nbytes()))
    inputs = [probe] + [common.make_inputs(shape, num_tokens, input_seed(num_tokens, j), dev)
                        for j in range(1, n_sets)]
    rec = {'rotation_sets': n_sets}
    if hasattr(peer, 'layout_for'):
        rec['layout'] = peer.layout_for(num_tokens)
    runs = [peer.build(inp) for inp in inputs]
    eager_runs = list(runs)
    t0 = time.time()
    y = runs[0]().clone()          # first call: JIT compiles happen here
    torch.cuda.synchronize()
    rec['first_call_s'] = round(time.time() - t0, 3)
    rec.update(check_point(shape, weights, inputs[0], y, min(num_tokens, check_rows)))
    mode = 'eager'
    if peer.graphable:
        try:
            pool = torch.cuda.graph_pool_handle()
            graphs = [common.GraphRunner(r, pool=pool) for r in runs]
            y_graph = graphs[0]().clone()
            torch.cuda.synchronize()
            rec['graph_equals_eager'] = bool(torch.equal(y_graph, y))
            runs = graphs
            mode = 'cuda_graph'
        except Exception as exc:
            rec['graph_error'] = f'{type(exc).__name__}: {exc}'[:300]
            torch.cuda.synchronize()
    rec['mode'] = mode
    est = common.time_runs(runs, warmup=1, iters=2)['median_us']
    iters = common.iterations_for(est, point_budget_s)
    rec.update(common.time_runs(runs, warmup=3, iters=iters))
    if all(hasattr(r, 'gemms_only') for r in eager_runs):
        # The peer's GEMM kernels alone (glue left out): a lower bound for a stack built on them.
        try:
            parts = []
            for r in eager_runs:
                r()                      # eager: leaves the buffers / routing the GEMMs read
                parts.append(common.GraphRunner(r.gemms_only) if mode == 'cuda_graph' else r.gemms_only)
            g = common.time_runs(parts, warmup=3, iters=iters)
            rec['gemms_only_median_us'] = g['median_us']
            rec['gemms_only_min_us'] = g['min_us']
        except Exception as exc:
            rec['gemms_only_error'] = f'{type(exc).__name__}: {exc}'[:300]
            torch.cuda.synchronize()
    rec['tflops'] = effective_tflops(shape, num_tokens, rec['median_us'])
    fl = floors(shape, num_tokens)
    rec['floor_us'] = fl['floor_us']
    rec['fraction_of_floor'] = fl['floor_us'] / rec['median_us']
    rec['gbps_weights'] = fl['weight_bytes'] / (rec['median_us'] * 1e-6) / 1e9
    return rec


def run_peer(args) -> int:
    shape = SHAPES[args.shape]
    classes = peer_classes()
    cls = classes[args.peer]
    base = {'system': args.peer, 'shape': shape.name, 'routing': 'uniform',
            'experts': shape.bench_experts, 'top_k': shape.top_k, 'activation': shape.activation,
            'description': cls.description}
    tokens = [int(t) for t in args.tokens.split(',')]
    out = open(args.out, 'a') if args.out else None
    reason = cls.unsupported(shape)
    if reason:
        for t in tokens:
            emit(out, {**base, 'tokens': t, 'status': 'unsupported', 'reason': reason})
        return 0
    start = time.time()
    try:
        weights = common.synthetic_weights(shape, SEED_WEIGHTS, 'cuda')
        peer = cls(shape, weights)
        torch.cuda.synchronize()
    except Exception as exc:
        msg = f'setup failed: {type(exc).__name__}: {exc}'[:600]
        traceback.print_exc()
        for t in tokens:
            emit(out, {**base, 'tokens': t, 'status': 'error', 'reason': msg})
        return 0
    base['setup_s'] = round(time.time() - start, 2)
    base['peer_weight_bytes'] = peer.weight_bytes()
    if getattr(peer, 'buffer_mode', None):
        base['buffer_mode'] = peer.buffer_mode
    if args.warm_only:
        # Compile-cache warm-up (compare.py --warm-parallel): one call per T, nothing checked or timed.
        for t in tokens:
            try:
                t0 = time.time()
                peer.build(common.make_inputs(shape, t, input_seed(t, 0), 'cuda'))()
                torch.cuda.synchronize()
                print(f'warm {args.peer} {shape.name} T={t}: {time.time() - t0:.1f} s', flush=True)
            except Exception as exc:
                print(f'warm {args.peer} {shape.name} T={t}: {type(exc).__name__}: {exc}', flush=True)
            torch.cuda.empty_cache()
        return 0
    for t in tokens:
        if time.time() - start > args.budget_s:
            emit(out, {**base, 'tokens': t, 'status': 'skipped',
                       'reason': f'peer time budget of {args.budget_s:.0f} s spent'})
            continue
        try:
            rec = run_point(peer, shape, weights, t, args.point_budget_s, args.check_rows)
            emit(out, {**base, 'tokens': t, 'status': 'ok', **rec})
        except Exception as exc:
            traceback.print_exc()
            emit(out, {**base, 'tokens': t, 'status': 'error',
                       'reason': f'{type(exc).__name__}: {exc}'[:600]})
            torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return 0


def measure_ceilings(args) -> int:
    """targets.md asks for the ceilings re-measured in the same run."""
    res = {'system': 'ceilings'}
    dev = 'cuda'
    n_bytes = 2 * 2**30
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    t = common.time_runs([lambda: dst.copy_(src)], warmup=3, iters=10)
    res['copy_tbps'] = 2 * n_bytes / (t['median_us'] * 1e-6) / 1e12
    del src, dst
    n = 8192
    a = torch.randn((n, n), device=dev, dtype=torch.bfloat16)
    b = torch.randn((n, n), device=dev, dtype=torch.bfloat16)
    t = common.time_runs([lambda: a @ b], warmup=3, iters=10)
    res['bf16_tflops'] = 2 * n**3 / (t['median_us'] * 1e-6) / 1e12
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).T.contiguous().T
        one = torch.ones((), device=dev)
        t = common.time_runs([lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)], 3, 10)
        res['fp8_tflops'] = 2 * n**3 / (t['median_us'] * 1e-6) / 1e12
    except Exception as exc:
        res['fp8_error'] = f'{type(exc).__name__}: {exc}'[:300]
    res['gpu'] = torch.cuda.get_device_name()
    res['torch'] = torch.__version__
    res['cuda'] = torch.version.cuda
    out = open(args.out, 'a') if args.out else None
    emit(out, res)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--peer', help='one of: torch-bf16, deepgemm-fp8, deepgemm-mega, deepgemm-mega-fp4, triton-mxfp4, flashinfer-sm90-mxfp4, marlin-mxfp4-w4a16, megamoe-py, megamoe-py-fp8')
    ap.add_argument('--shape', choices=sorted(SHAPES))
    ap.add_argument('--tokens', default=','.join(map(str, common.TOKEN_COUNTS)))
    ap.add_argument('--out', help='JSON lines file to append to')
    ap.add_argument('--budget-s', type=float, default=150.0, help='stop starting new points after this')
    ap.add_argument('--point-budget-s', type=float, default=0.25, help='timed seconds per point (iterations follow)')
    ap.add_argument('--check-rows', type=int, default=CHECK_ROWS)
    ap.add_argument('--ceilings', action='store_true')
    ap.add_argument('--warm-only', action='store_true', help='one untimed call per T (fills JIT caches)')
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print('worker: no CUDA device; the peers run on the GPU machine', file=sys.stderr)
        return 2
    if args.ceilings:
        return measure_ceilings(args)
    if args.peer not in peer_classes():
        ap.error(f'--peer: expected one of {sorted(peer_classes())}, got {args.peer!r}')
    if not args.shape:
        ap.error('--shape is required')
    return run_peer(args)


if __name__ == '__main__':
    sys.exit(main())
