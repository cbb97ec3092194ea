"""Shared pieces of the peer benchmarks: shapes, synthetic MXFP4 weights, routing, timing, floors.

Everything here runs on the GPU through torch (CPU works too, slowly, for development). The
numbers and formulas follow /work/shared/spec/targets.md and numerics.md; the constants below name
where each comes from.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Optional, Sequence

import torch

# --- targets.md, "Shapes" ----------------------------------------------------------------------
# bench_experts: experts this benchmark gives ONE GPU. kimi-k3 runs the EP8 per-rank work
# (896 / 8 = 112 local experts, the production setting): all 896 experts in BF16 are 59 GB and
# with the FP8 and MXFP4 copies beside them would not leave room on one H200. The other shapes
# keep all experts (EP = 1). Every system (megamoe included) runs the same expert count.
KIMI_K3_EP = 8


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int          # H
    intermediate: int    # I
    num_experts: int     # E (model)
    top_k: int           # K
    activation: str      # 'situ' | 'swiglu' | 'swiglu_oai'
    bench_experts: int   # experts on the benchmarked GPU (see above)
    situ_beta: float = 4.0
    situ_lbeta: float = 25.0
    oai_alpha: float = 1.702
    oai_limit: float = 7.0

    @property
    def has_bias(self) -> bool:
        return self.activation == 'swiglu_oai'


SHAPES = {
    'kimi-k3': Shape('kimi-k3', 3584, 3072, 896, 16, 'situ', 896 // KIMI_K3_EP),
    'deepseek-v3': Shape('deepseek-v3', 7168, 2048, 256, 8, 'swiglu', 256),
    'gpt-oss-120b': Shape('gpt-oss-120b', 2880, 2880, 128, 4, 'swiglu_oai', 128),
    'small': Shape('small', 1024, 512, 32, 4, 'swiglu', 32),
}

TOKEN_COUNTS = (1, 8, 64, 512, 4096, 8192)

# --- numerics.md section 1 ---------------------------------------------------------------------
MX_BLOCK = 32                 # scale granularity along K for weights and activations
E4M3_MAX = 448.0
UE8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# --- targets.md, "Ceilings" and "Lower bounds" -------------------------------------------------
COPY_BYTES_PER_S = 4.27e12    # device-to-device copy, bytes read + written
BF16_FLOPS = 776e12           # BF16 dense GEMM 8192^3
FP8_FLOPS = 1403e12           # FP8 dense GEMM 8192^3
L2_BYTES = 60 * 2**20
ROTATION_MIN_BYTES = 3 * L2_BYTES   # inputs rotated across more than 3 x L2


def e2m1_lut(device, dtype=torch.float32) -> torch.Tensor:
    """The 16 E2M1 code values (bit 3 = sign)."""
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    return torch.cat([pos, -pos]).to(device=device, dtype=dtype)


@dataclasses.dataclass
class MxWeights:
    """Canonical MXFP4 expert weights (weights.md section 2) of the benchmarked experts."""
    w13: torch.Tensor      # uint8 [E, 2I, H/2]  rows [0, I) gate, [I, 2I) up
    w13_sf: torch.Tensor   # uint8 [E, 2I, H/32]
    w2: torch.Tensor       # uint8 [E, H, I/2]
    w2_sf: torch.Tensor    # uint8 [E, H, I/32]
    w13_bias: Optional[torch.Tensor] = None   # bf16 [E, 2I]
    w2_bias: Optional[torch.Tensor] = None    # bf16 [E, H]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w13_sf, self.w2, self.w2_sf))


def _synthetic_matrix(e: int, n: int, k: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen, device=device)
    # NOTES: scales around 2^-round(log2(sqrt(K) * rms(E2M1))) keep each output of unit order for
    # unit-order inputs; a spread of +-1 per block makes neighbouring blocks differ, so a kernel that
    # applies the wrong block's scale is caught.
    rms_e2m1 = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))
    base = UE8M0_BIAS - round(math.log2(math.sqrt(k) * rms_e2m1))
    spread = torch.randint(-1, 2, (e, n, k // MX_BLOCK), generator=gen, device=device)
    sf = (spread + base).to(torch.uint8)
    return codes, sf


def synthetic_weights(shape: Shape, seed: int, device, num_experts: Optional[int] = None) -> MxWeights:
    e = num_experts or shape.bench_experts
    h, i = shape.hidden, shape.intermediate
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    w13, w13_sf = _synthetic_matrix(e, 2 * i, h, gen, device)
    w2, w2_sf = _synthetic_matrix(e, h, i, gen, device)
    w13_bias = w2_bias = None
    if shape.has_bias:
        w13_bias = (torch.randn((e, 2 * i), generator=gen, device=device) * 0.1).to(torch.bfloat16)
        w2_bias = (torch.randn((e, h), generator=gen, device=device) * 0.1).to(torch.bfloat16)
    return MxWeights(w13, w13_sf, w2, w2_sf, w13_bias, w2_bias)


def dequant_mxfp4(codes: torch.Tensor, sf: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """E2M1 pairs (low nibble = even k) x 2^(sf - 127) -> dtype. Exact in BF16 and wider."""
    lut = e2m1_lut(codes.device, torch.float32)
    lo = lut[(codes & 0xF).long()]
    hi = lut[(codes >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)                         # [..., K]
    scale = torch.exp2(sf.to(torch.float32) - UE8M0_BIAS)                     # [..., K/32]
    vals = vals.unflatten(-1, (-1, MX_BLOCK)) * scale.unsqueeze(-1)
    return vals.flatten(-2).to(dtype)


DEQUANT_CHUNK_EXPERTS = 8     # experts dequantized at a time: bounds the FP32 temporaries


def _dequant_chunked(codes: torch.Tensor, sf: torch.Tensor, dtype) -> torch.Tensor:
    out = torch.empty((*codes.shape[:-1], codes.shape[-1] * 2), dtype=dtype, device=codes.device)
    for start in range(0, codes.shape[0], DEQUANT_CHUNK_EXPERTS):
        sl = slice(start, start + DEQUANT_CHUNK_EXPERTS)
        out[sl] = dequant_mxfp4(codes[sl], sf[sl], dtype)
    return out


def dequant_weights(w: MxWeights, dtype=torch.bfloat16, experts: Optional[slice] = None):
    """(w13 [E, 2I, H], w2 [E, H, I]) dequantized, optionally for a slice of experts."""
    sl = experts or slice(None)
    return _dequant_chunked(w.w13[sl], w.w13_sf[sl], dtype), _dequant_chunked(w.w2[sl], w.w2_sf[sl], dtype)


# --- routing (targets.md: uniform random top-k without repeats, seeded) -------------------------
@dataclasses.dataclass
class Inputs:
    x: torch.Tensor            # bf16 [T, H]
    topk_idx: torch.Tensor     # int32 [T, K]
    topk_weights: torch.Tensor # fp32 [T, K]

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.topk_idx, self.topk_weights))


def uniform_routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, device):
    scores = torch.rand((num_tokens, num_experts), generator=gen, device=device)
    idx = scores.topk(top_k, dim=1).indices.to(torch.int32)
    # NOTES: positive weights normalised per token, like a sigmoid/softmax router's output.
    w = torch.rand((num_tokens, top_k), generator=gen, device=device) + 0.5
    w = w / w.sum(dim=1, keepdim=True)
    return idx, w.to(torch.float32)


def make_inputs(shape: Shape, num_tokens: int, seed: int, device, num_experts: Optional[int] = None) -> Inputs:
    e = num_experts or shape.bench_experts
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    x = torch.randn((num_tokens, shape.hidden), generator=gen, device=device).to(torch.bfloat16)
    idx, w = uniform_routing(num_tokens, e, shape.top_k, gen, device)
    return Inputs(x, idx, w)


def rotation_count(per_set_bytes: int, max_sets: int = 8, min_sets: int = 2) -> int:
    """Input sets to rotate so the sets together exceed 3 x L2 (the touched weights already do
    at every T, see README; the rotation also changes which experts are hit between calls)."""
    need = math.ceil(ROTATION_MIN_BYTES / max(per_set_bytes, 1))
    return max(min_sets, min(max_sets, need))


# --- floors (targets.md, "Lower bounds for one layer on one rank") ------------------------------
def expected_experts_hit(shape: Shape, num_tokens: int, ep: int = 1) -> float:
    e_total = shape.bench_experts * ep
    return shape.bench_experts * (1.0 - (1.0 - shape.top_k / e_total) ** (num_tokens * ep))


def floors(shape: Shape, num_tokens: int) -> dict:
    h, i, k = shape.hidden, shape.intermediate, shape.top_k
    a = expected_experts_hit(shape, num_tokens)
    weight_bytes = a * 3 * h * i * (0.5 + 1.0 / MX_BLOCK)
    act_bytes = num_tokens * h * 2 * 2 + num_tokens * k * (4 + 4)   # x in, y out (BF16), routing
    t_mem = (weight_bytes + act_bytes) / COPY_BYTES_PER_S
    flops = 6.0 * num_tokens * k * h * i
    t_bf16 = flops / BF16_FLOPS
    t_fp8 = flops / FP8_FLOPS
    return {
        'experts_hit': a, 'weight_bytes': weight_bytes, 'flops': flops,
        't_mem_us': t_mem * 1e6, 't_math_bf16_us': t_bf16 * 1e6, 't_math_fp8_us': t_fp8 * 1e6,
        'floor_us': max(t_mem, t_bf16) * 1e6, 'floor_fp8_us': max(t_mem, t_fp8) * 1e6,
    }


def effective_tflops(shape: Shape, num_tokens: int, time_us: float) -> float:
    return 6.0 * num_tokens * shape.top_k * shape.hidden * shape.intermediate / (time_us * 1e-6) / 1e12


# --- diff metric (numerics.md section 8) --------------------------------------------------------
def diff_metric(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.to(torch.float64).flatten()
    b = b.to(torch.float64).flatten()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float('nan')
    denom = float((a * a).sum() + (b * b).sum())
    if denom == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((a * b).sum()) / denom


def row_diffs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    denom = (a * a).sum(1) + (b * b).sum(1)
    d = 1.0 - 2.0 * (a * b).sum(1) / torch.where(denom == 0, torch.ones_like(denom), denom)
    d = torch.where(denom == 0, torch.zeros_like(d), d)
    bad = ~(torch.isfinite(a).all(1) & torch.isfinite(b).all(1))
    return torch.where(bad, torch.full_like(d, float('nan')), d)


def compare(y: torch.Tensor, ref: torch.Tensor, topk_idx: torch.Tensor) -> dict:
    """diff over all rows, worst row, worst expert (numerics.md section 8)."""
    rd = row_diffs(y, ref)
    worst_row = int(torch.nan_to_num(rd, nan=float('inf')).argmax()) if rd.numel() else -1
    worst_expert, worst_expert_diff = -1, 0.0
    for e in torch.unique(topk_idx[topk_idx >= 0]).tolist():
        rows = (topk_idx == e).any(1)
        d = diff_metric(y[rows], ref[rows])
        if not (d <= worst_expert_diff):   # NaN counts as worst
            worst_expert, worst_expert_diff = int(e), d
    return {
        'diff': diff_metric(y, ref),
        'worst_row_diff': float(rd[worst_row]) if worst_row >= 0 else 0.0,
        'worst_row': worst_row,
        'worst_expert_diff': worst_expert_diff,
        'worst_expert': worst_expert,
        'max_abs_err': float((y.double() - ref.double()).abs().max()) if y.numel() else 0.0,
        'nan': bool(torch.isnan(y.float()).any()),
    }


# --- timing (targets.md, "Benchmark protocol") --------------------------------------------------
def time_runs(runs: Sequence[Callable[[], object]], warmup: int, iters: int) -> dict:
    """CUDA events around each call; calls rotate over `runs` (one per input set)."""
    for j in range(warmup):
        runs[j % len(runs)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for j in range(iters):
        starts[j].record()
        runs[j % len(runs)]()
        ends[j].record()
    torch.cuda.synchronize()
    times_us = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return {'median_us': statistics.median(times_us), 'min_us': times_us[0],
            'max_us': times_us[-1], 'iters': iters}


def iterations_for(estimate_us: float, budget_s: float, lo: int = 5, hi: int = 50) -> int:
    return int(max(lo, min(hi, budget_s * 1e6 / max(estimate_us, 1.0))))


class GraphRunner:
    """Captures `fn` (which reads and writes only static buffers) into a CUDA graph."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool=None):
        self.fn = fn
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):   # warm-up outside the graph: allocator, JIT, handles
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()
        torch.cuda.synchronize()

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out
