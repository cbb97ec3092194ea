"""The megamoe contract (numerics.md) in torch, for checking the peers on the GPU.

Two functions of the same inputs:
  contract_forward: FP8 per-32 UE8M0 input quantization, exact products with FP32-rounded
                    accumulation (computed in FP64, then rounded to FP32), BF16 rounding of the L1
                    outputs, the activation in FP32, routing weight, per-32 requantization of the
                    intermediate, L2, BF16 per-slot outputs, FP32 combine in ascending k.
  ideal_forward:    the unquantized FP64 MoE (BF16 x, dequantized weights, no intermediate
                    quantization), the yardstick of numerics.md section 8.

The megamoe CPU reference (reference/) checks megamoe itself; this file only checks the peers, so it
is written for clarity over speed and runs on the rows the benchmark checks (a few hundred tokens).
"""
from __future__ import annotations

import torch

from common import E4M3_MAX, MX_BLOCK, UE8M0_BIAS, MxWeights, Shape, dequant_mxfp4

X_AMAX_FLOOR = 1e-4            # numerics.md section 2
X_SCALE_MIN, X_SCALE_MAX = 1, 254


def ue8m0_ceil_exponent(v: torch.Tensor) -> torch.Tensor:
    """Biased exponent of 2^ceil(log2(v)) for FP32 v >= 0 (bit form of numerics.md section 2)."""
    bits = v.to(torch.float32).contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent exactly, in FP64."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float64), exponent.to(torch.int32))


def _quantize_blocks(v: torch.Tensor, sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3(v * 2^(127 - sf)) saturating to +-448 (NaN stays NaN); returns codes and dequantized FP32."""
    blocks = v.to(torch.float64).unflatten(-1, (-1, MX_BLOCK))
    scaled = (blocks * _pow2(UE8M0_BIAS - sf).unsqueeze(-1)).to(torch.float32)  # exact: x * 2^n
    scaled = scaled.clamp(-E4M3_MAX, E4M3_MAX)
    q = scaled.to(torch.float8_e4m3fn)
    deq = (q.to(torch.float64) * _pow2(sf - UE8M0_BIAS).unsqueeze(-1)).to(torch.float32)
    return q.flatten(-2), deq.flatten(-2)


def quantize_input(x: torch.Tensor):
    """numerics.md section 2: BF16 [T, H] -> (e4m3 [T, H], ue8m0 uint8 [T, H/32], dequantized FP32)."""
    blocks = x.to(torch.float32).unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(-1).clamp_min(X_AMAX_FLOOR)
    sf = ue8m0_ceil_exponent(amax / E4M3_MAX).clamp(X_SCALE_MIN, X_SCALE_MAX)
    q, deq = _quantize_blocks(x, sf)
    return q, sf.to(torch.uint8), deq


def requantize_intermediate(v: torch.Tensor):
    """numerics.md section 5: no amax floor; amax = 0 gives scale byte 0 and zero codes."""
    amax = v.unflatten(-1, (-1, MX_BLOCK)).abs().amax(-1)
    sf = ue8m0_ceil_exponent(amax / E4M3_MAX)
    q, deq = _quantize_blocks(v, sf)
    return q, sf.to(torch.uint8), deq


def activation(shape: Shape, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """numerics.md section 4 with fast_math = false, in the dtype of g and u."""
    if shape.activation == 'swiglu':
        return g / (1.0 + torch.exp(-g)) * u
    if shape.activation == 'situ':
        b, lb = shape.situ_beta, shape.situ_lbeta
        return (b * torch.tanh(g / b) * (1.0 / (1.0 + torch.exp(-g)))) * (lb * torch.tanh(u / lb))
    if shape.activation == 'swiglu_oai':
        lim, alpha = shape.oai_limit, shape.oai_alpha
        g = g.clamp(max=lim)
        u = u.clamp(-lim, lim)
        return g * (1.0 / (1.0 + torch.exp(-alpha * g))) * (u + 1.0)
    raise ValueError(f'activation: expected swiglu, situ or swiglu_oai, got {shape.activation!r}')


def _slots(topk_idx: torch.Tensor):
    """Valid (token, k, expert) slots, grouped by expert."""
    t_idx, k_idx = torch.nonzero(topk_idx >= 0, as_tuple=True)
    experts = topk_idx[t_idx, k_idx].long()
    return t_idx, k_idx, experts


def _per_expert_matmul(rows: torch.Tensor, experts: torch.Tensor, codes: torch.Tensor,
                       sf: torch.Tensor, bias, out_dtype, bias_scale=None) -> torch.Tensor:
    """out[s] = rows[s] @ W[experts[s]]^T (+ bias[experts[s]] * bias_scale[s]) with W dequantized
    in FP64, accumulated in FP64."""
    out = torch.empty((rows.shape[0], codes.shape[1]), dtype=torch.float64, device=rows.device)
    for e in torch.unique(experts).tolist():
        sel = (experts == e).nonzero(as_tuple=True)[0]
        w = dequant_mxfp4(codes[e], sf[e], torch.float64)
        acc = rows[sel].to(torch.float64) @ w.T
        if bias is not None:
            b = bias[e].to(torch.float64).unsqueeze(0)
            if bias_scale is not None:
                b = b * bias_scale[sel].to(torch.float64).unsqueeze(1)
            acc = acc + b
        out[sel] = acc
    return out.to(out_dtype)


def contract_forward(shape: Shape, w: MxWeights, x: torch.Tensor, topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
    """The megamoe function (exact mode, fast_math = false). Returns BF16 [T, H]."""
    t_count, h = x.shape
    i = shape.intermediate
    _, _, x_deq = quantize_input(x)
    t_idx, k_idx, experts = _slots(topk_idx)
    # L1: exact products, accumulation modelled as exact-then-rounded-to-FP32 (section 3).
    acc = _per_expert_matmul(x_deq[t_idx], experts, w.w13, w.w13_sf, w.w13_bias, torch.float32)
    g = acc[:, :i].to(torch.bfloat16).to(torch.float32)
    u = acc[:, i:].to(torch.bfloat16).to(torch.float32)
    route_w = topk_weights[t_idx, k_idx]
    v = activation(shape, g, u) * route_w.unsqueeze(1)
    _, _, h_deq = requantize_intermediate(v)
    # L2 bias (GPT-OSS) is scaled by the routing weight, as the weight scales the expert's output.
    o = _per_expert_matmul(h_deq, experts, w.w2, w.w2_sf, w.w2_bias, torch.float32, route_w).to(torch.bfloat16)
    # Combine: FP32 sum over k ascending, starting from 0, one rounding (section 6).
    slot_out = torch.zeros((t_count, shape.top_k, h), dtype=torch.float32, device=x.device)
    slot_out[t_idx, k_idx] = o.to(torch.float32)
    y = torch.zeros((t_count, h), dtype=torch.float32, device=x.device)
    for k in range(shape.top_k):
        y = y + slot_out[:, k]
    return y.to(torch.bfloat16)


def ideal_forward(shape: Shape, w: MxWeights, x: torch.Tensor, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """Unquantized FP64 MoE (numerics.md section 8). Returns FP64 [T, H]."""
    t_count, h = x.shape
    i = shape.intermediate
    t_idx, k_idx, experts = _slots(topk_idx)
    acc = _per_expert_matmul(x.to(torch.float64)[t_idx], experts, w.w13, w.w13_sf, w.w13_bias,
                             torch.float64)
    route_w = topk_weights[t_idx, k_idx].to(torch.float64)
    v = activation(shape, acc[:, :i], acc[:, i:]) * route_w.unsqueeze(1)
    o = _per_expert_matmul(v, experts, w.w2, w.w2_sf, w.w2_bias, torch.float64, route_w)
    y = torch.zeros((t_count, h), dtype=torch.float64, device=x.device)
    y.index_add_(0, t_idx, o)
    return y
