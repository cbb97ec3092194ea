#!/usr/bin/env python3
"""How accurate an FP8 tensor-core mode of the layer would be (issue "FP8 tensor cores"), measured
with the GPU's own FP8 tensor cores (torch._scaled_mm) before any kernel is written.

The mode modelled here ("per-row FP8"):
  * activations: the contract's FP8 codes and per-32 UE8M0 scales (numerics.md section 2 for x,
    section 5 for the intermediate) re-expressed with ONE power-of-two scale per token row, the
    row's largest: code * 2^(s_group - s_max), rounded to E4M3 (exact unless the value falls
    below E4M3's normal range, i.e. more than ~8 binades under the row's largest group);
  * weights: each row's E2M1 values times 2^(s_group - s_max + 6), rounded to E4M3 (exact for
    groups within 14 binades of the row's largest scale), times 2^(s_max - 133) after the MMA;
  * each expert GEMM on the FP8 tensor cores, FP32 out, with cuBLAS's fast accumulation (the
    tensor core's own accumulator over the whole K: no promotion) or without it (promoted), the
    two row factors applied to the FP32 result; the rest (BF16 rounding of L1, activation,
    routing weight, requantization of the intermediate, BF16 output, FP32 combine) as the contract.
Printed per shape and input kind: diff (bench/peers/common.py diff_metric) of the contract and of
each FP8 variant against the unquantized FP64 MoE, and against the contract; the issue's bar is
FP8 diff <= 1.5 x the contract's.

  python3 bench/fp8_mode_accuracy.py [--tokens 512] [--shapes kimi-k3,deepseek-v3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, 'peers'))

from common import SHAPES, diff_metric, dequant_mxfp4, make_inputs, synthetic_weights  # noqa: E402
from reference import (_slots, activation, contract_forward, ideal_forward, quantize_input,  # noqa: E402
                       requantize_intermediate)

E4M3_MAX = 448.0


def rebase_rows(codes: torch.Tensor, sf: torch.Tensor):
    """FP8 codes [R, K] with per-32 scale bytes [R, K/32] -> (E4M3 [R, K], FP32 row factor [R])
    with one scale per row: the row's largest."""
    s_max = sf.to(torch.int32).amax(1, keepdim=True)
    shift = (sf.to(torch.int32) - s_max).repeat_interleave(32, dim=1)
    vals = torch.ldexp(codes.to(torch.float32), shift)
    q = vals.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, torch.ldexp(torch.ones_like(s_max, dtype=torch.float32), s_max - 127).squeeze(1)


def fold_weights(codes: torch.Tensor, sf: torch.Tensor):
    """One expert's MXFP4 [N, K/2] + [N, K/32] -> (E4M3 [N, K], FP32 row factor [N], rows whose
    folding was not exact)."""
    w = dequant_mxfp4(codes, sf, torch.float32)   # E2M1 * 2^(s - 127), exact
    s_max = sf.to(torch.int32).amax(1, keepdim=True)
    folded = torch.ldexp(w, (133 - s_max).expand_as(w))  # top group's values up to 6 * 2^6 = 384
    q = folded.to(torch.float8_e4m3fn)
    inexact = int((q.to(torch.float32) != folded).any(1).sum())
    return q, torch.ldexp(torch.ones_like(s_max, dtype=torch.float32), s_max - 133).squeeze(1), inexact


def fp8_gemm(a_q, a_f, w_q, w_f, fast: bool):
    """(a_q * a_f[:, None]) @ (w_q * w_f[:, None])^T on the FP8 tensor cores, FP32."""
    m = a_q.shape[0]
    pad = (-m) % 16
    if pad:
        a_q = torch.cat([a_q, torch.zeros((pad, a_q.shape[1]), dtype=a_q.dtype, device=a_q.device)])
    one = torch.ones((), dtype=torch.float32, device=a_q.device)
    out = torch._scaled_mm(a_q, w_q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                           use_fast_accum=fast)[:m]
    return out * a_f[:, None] * w_f[None, :]


def fp8_forward(shape, w, x, topk_idx, topk_weights, fast: bool, stats: dict):
    t_count, h = x.shape
    i = shape.intermediate
    xq, xsf, _ = quantize_input(x)
    xq8, x_f = rebase_rows(xq, xsf)
    t_idx, k_idx, experts = _slots(topk_idx)
    route_w = topk_weights[t_idx, k_idx]
    acc = torch.empty((t_idx.numel(), 2 * i), dtype=torch.float32, device=x.device)
    rows_e = {}
    for e in torch.unique(experts).tolist():
        sel = (experts == e).nonzero(as_tuple=True)[0]
        rows_e[e] = sel
        wq, wf, bad = fold_weights(w.w13[e], w.w13_sf[e])
        stats['inexact_rows'] += bad
        acc[sel] = fp8_gemm(xq8[t_idx[sel]], x_f[t_idx[sel]], wq, wf, fast)
    g = acc[:, :i].to(torch.bfloat16).to(torch.float32)
    u = acc[:, i:].to(torch.bfloat16).to(torch.float32)
    v = activation(shape, g, u) * route_w.unsqueeze(1)
    hq, hsf, _ = requantize_intermediate(v)
    hq8, h_f = rebase_rows(hq, hsf)
    o = torch.empty((t_idx.numel(), h), dtype=torch.float32, device=x.device)
    for e, sel in rows_e.items():
        wq, wf, bad = fold_weights(w.w2[e], w.w2_sf[e])
        stats['inexact_rows'] += bad
        o[sel] = fp8_gemm(hq8[sel], h_f[sel], wq, wf, fast)
    o = o.to(torch.bfloat16).to(torch.float32)
    slot_out = torch.zeros((t_count, shape.top_k, h), dtype=torch.float32, device=x.device)
    slot_out[t_idx, k_idx] = o
    y = torch.zeros((t_count, h), dtype=torch.float32, device=x.device)
    for k in range(shape.top_k):
        y = y + slot_out[:, k]
    return y.to(torch.bfloat16)


def widen_scales(w, spread: int, seed: int):
    """Scale bytes moved by a random amount in [-spread, spread] per group (real checkpoints'
    spreads; the contract's values change with them, every path sees the same weights)."""
    g = torch.Generator(device=w.w13.device)
    g.manual_seed(seed)
    for name in ('w13_sf', 'w2_sf'):
        sf = getattr(w, name)
        delta = torch.randint(-spread, spread + 1, sf.shape, generator=g, device=sf.device)
        setattr(w, name, (sf.to(torch.int32) + delta).clamp(1, 254).to(torch.uint8))
    return w


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument('--shapes', default='kimi-k3,deepseek-v3')
    ap.add_argument('--tokens', type=int, default=512)
    ap.add_argument('--json', default='')
    ap.add_argument('--device', default='cuda')
    args = ap.parse_args()
    dev = args.device
    out = []
    for name in args.shapes.split(','):
        shape = SHAPES[name]
        for kind in ('synthetic', 'outlier channels', 'scale spread +-8'):
            w = synthetic_weights(shape, 7, dev)
            inp = make_inputs(shape, args.tokens, 11, dev, num_experts=w.num_experts)
            x = inp.x
            if kind == 'outlier channels':   # 1 % of the channels 2^8 larger
                g = torch.Generator(device=dev)
                g.manual_seed(3)
                ch = torch.randperm(x.shape[1], generator=g, device=dev)[: max(1, x.shape[1] // 100)]
                x = x.clone()
                x[:, ch] = (x[:, ch].float() * 256).to(x.dtype)
            if kind == 'scale spread +-8':
                w = widen_scales(w, 8, 5)
            ideal = ideal_forward(shape, w, x, inp.topk_idx, inp.topk_weights)
            contract = contract_forward(shape, w, x, inp.topk_idx, inp.topk_weights)
            rec = {'shape': name, 'tokens': args.tokens, 'inputs': kind,
                   'contract_vs_ideal': diff_metric(contract, ideal)}
            for fast in (True, False):
                stats = {'inexact_rows': 0}
                y = fp8_forward(shape, w, x, inp.topk_idx, inp.topk_weights, fast, stats)
                tag = 'fast_accum' if fast else 'promoted'
                rec[f'fp8_{tag}_vs_ideal'] = diff_metric(y, ideal)
                rec[f'fp8_{tag}_vs_contract'] = diff_metric(y, contract)
                rec['weight_rows_not_exact'] = stats['inexact_rows']
            rec['ratio_fast_accum'] = rec['fp8_fast_accum_vs_ideal'] / rec['contract_vs_ideal']
            rec['ratio_promoted'] = rec['fp8_promoted_vs_ideal'] / rec['contract_vs_ideal']
            out.append(rec)
            print(f"{name:12} {kind:18} contract {rec['contract_vs_ideal']:.3e}  "
                  f"fp8 fast-accum {rec['fp8_fast_accum_vs_ideal']:.3e} ({rec['ratio_fast_accum']:.3f}x)  "
                  f"promoted {rec['fp8_promoted_vs_ideal']:.3e} ({rec['ratio_promoted']:.3f}x)  "
                  f"vs contract {rec['fp8_fast_accum_vs_contract']:.2e} / {rec['fp8_promoted_vs_contract']:.2e}  "
                  f"weight rows not exact {rec['weight_rows_not_exact']}", flush=True)
            del w, ideal, contract
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, 'w') as f:
            for r in out:
                f.write(json.dumps(r) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
