"""DeepGEMM peers (JIT-compiled with nvcc on first use). The package used is the DeepGEMM that vLLM
vendors (fetch_wheels.sh: its extension loads with the GPU image's torch 2.11); the SM90 Mega MoE
adapter also works with an `sgl-deep-gemm` build when one loads there.

deepgemm-fp8: the FP8 x FP8 grouped-GEMM chain a serving stack builds from DeepGEMM on Hopper:
  weights: MXFP4 dequantized (exactly) and requantized to E4M3 with FP32 scales per 128 x 128
           block (DeepGEMM's SM90 recipe; per-32 UE8M0 weight scales are not an SM90 option);
  x and the intermediate: E4M3 with FP32 scales per token and 128 channels;
  decode (T <= MASKED_MAX_TOKENS): masked layout [E, max_m, .], m_grouped_fp8_gemm_nt_masked;
  prefill: contiguous expert-sorted rows padded per expert to DeepGEMM's M alignment,
           m_grouped_fp8_gemm_nt_contiguous;
  the dispatch, activation, requantization and combine between them are torch ops, all in the
  same CUDA graph.
deepgemm-mega: DeepGEMM's SM90 FP8 x FP8 Mega MoE (one fused kernel, swiglu only), run on one rank.
"""
from __future__ import annotations

import os
import types
from typing import Callable, Optional

import torch

from common import Inputs, MxWeights, Shape, dequant_weights
from reference import activation

DG_BLOCK = 128                 # DeepGEMM SM90 scale block (1 x 128 activations, 128 x 128 weights)
MASKED_MAX_TOKENS = 64         # decode regime of targets.md: T <= 64 per rank
WEIGHT_CHUNK_EXPERTS = 16      # experts requantized at a time (bounds the FP32 temporaries)
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4


def _import_deep_gemm():
    import deep_gemm  # noqa: F401  (JIT init needs CUDA_HOME / nvcc; errors name what is missing)
    return deep_gemm


def unsupported_common() -> Optional[str]:
    try:
        _import_deep_gemm()
    except Exception as exc:  # the reason is recorded in the results, never hidden
        return f'import deep_gemm failed: {type(exc).__name__}: {exc}'
    if torch.cuda.get_device_capability()[0] != 9:
        return 'deep_gemm SM90 paths need a Hopper GPU'
    return None


def block_quant_fp8(w: torch.Tensor):
    """[E, N, K] -> E4M3 [E, N, K] and FP32 scales [E, N/128, K/128] (amax / 448 per block)."""
    e, n, k = w.shape
    blocks = w.float().view(e, n // DG_BLOCK, DG_BLOCK, k // DG_BLOCK, DG_BLOCK)
    sf = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp_min(SCALE_FLOOR) / FP8_MAX
    q = (blocks / sf).to(torch.float8_e4m3fn).view(e, n, k)
    return q, sf.view(e, n // DG_BLOCK, k // DG_BLOCK).contiguous()


def token_quant_fp8(x: torch.Tensor):
    """[M, K] -> E4M3 [M, K] and FP32 scales [M, K/128] (amax / 448 per token and 128 channels)."""
    m, k = x.shape
    blocks = x.float().view(m, k // DG_BLOCK, DG_BLOCK)
    sf = blocks.abs().amax(-1, keepdim=True).clamp_min(SCALE_FLOOR) / FP8_MAX
    return (blocks / sf).to(torch.float8_e4m3fn).view(m, k), sf.view(m, k // DG_BLOCK)


def requantize_weights(weights: MxWeights):
    """MXFP4 -> BF16 (exact) -> FP8 128x128 blocks, a few experts at a time."""
    parts13, parts2 = [], []
    for start in range(0, weights.num_experts, WEIGHT_CHUNK_EXPERTS):
        sl = slice(start, min(start + WEIGHT_CHUNK_EXPERTS, weights.num_experts))
        w13, w2 = dequant_weights(weights, torch.bfloat16, sl)
        parts13.append(block_quant_fp8(w13))
        parts2.append(block_quant_fp8(w2))
    cat = lambda parts, j: torch.cat([p[j] for p in parts])
    return (cat(parts13, 0), cat(parts13, 1)), (cat(parts2, 0), cat(parts2, 1))


def _shape_reason(shape: Shape) -> Optional[str]:
    for name, dim in (('hidden', shape.hidden), ('intermediate', shape.intermediate)):
        if dim % DG_BLOCK:
            return f'{name} = {dim} is not a multiple of {DG_BLOCK} (DeepGEMM SM90 FP8 block)'
    if shape.has_bias:
        return 'expert biases (swiglu_oai) are not part of the DeepGEMM grouped GEMMs'
    return None


class DeepGemmFp8Chain:
    name = 'deepgemm-fp8'
    description = 'DeepGEMM FP8xFP8 grouped GEMMs (masked T<=64, contiguous above), torch glue, CUDA graph'
    graphable = True

    def __init__(self, shape: Shape, weights: MxWeights):
        self.dg = _import_deep_gemm()
        self.shape = shape
        self.num_experts = weights.num_experts
        self.l1, self.l2 = requantize_weights(weights)
        self.align = int(self.dg.get_mk_alignment_for_contiguous_layout())

    @staticmethod
    def unsupported(shape: Shape) -> Optional[str]:
        return _shape_reason(shape) or unsupported_common()

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.l1, *self.l2))

    def layout_for(self, num_tokens: int) -> str:
        return 'masked' if num_tokens <= MASKED_MAX_TOKENS else 'contiguous'

    def build(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        shape, dg = self.shape, self.dg
        t_count, k = inp.topk_idx.shape
        s_count = t_count * k
        e_count = self.num_experts
        h, i = shape.hidden, shape.intermediate
        dev = inp.x.device
        masked = self.layout_for(t_count) == 'masked'
        ones = torch.ones(s_count, dtype=torch.int32, device=dev)
        arange_s = torch.arange(s_count, dtype=torch.int64, device=dev)
        if masked:
            # NOTES: no token picks an expert twice, so an expert gets at most T rows.
            max_m = -(-t_count // self.align) * self.align
            rows = e_count * max_m
        else:
            rows = -(-(s_count + e_count * (self.align - 1)) // self.align) * self.align
        a = torch.zeros((rows, h), dtype=torch.float8_e4m3fn, device=dev)
        a_sf = torch.ones((rows, h // DG_BLOCK), dtype=torch.float32, device=dev)
        d1 = torch.zeros((rows, 2 * i), dtype=torch.bfloat16, device=dev)
        hq = torch.zeros((rows, i), dtype=torch.float8_e4m3fn, device=dev)
        hq_sf = torch.ones((rows, i // DG_BLOCK), dtype=torch.float32, device=dev)
        d2 = torch.zeros((rows, h), dtype=torch.bfloat16, device=dev)
        layout = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        counts = torch.zeros(e_count, dtype=torch.int32, device=dev)
        expected_m = max(1, -(-s_count // e_count))

        def gemm1():
            if masked:
                dg.m_grouped_fp8_gemm_nt_masked((a.view(e_count, max_m, h), a_sf.view(e_count, max_m, -1)),
                                                self.l1, d1.view(e_count, max_m, 2 * i), counts, expected_m)
            else:
                dg.m_grouped_fp8_gemm_nt_contiguous((a, a_sf), self.l1, d1, layout)

        def gemm2():
            if masked:
                dg.m_grouped_fp8_gemm_nt_masked((hq.view(e_count, max_m, i), hq_sf.view(e_count, max_m, -1)),
                                                self.l2, d2.view(e_count, max_m, h), counts, expected_m)
            else:
                dg.m_grouped_fp8_gemm_nt_contiguous((hq, hq_sf), self.l2, d2, layout)

        def run() -> torch.Tensor:
            flat = inp.topk_idx.flatten()
            order = torch.argsort(flat, stable=True)
            e_sorted = flat[order].long()
            counts.zero_()
            counts.scatter_add_(0, flat.long(), ones)
            starts = torch.cumsum(counts, 0) - counts
            pos = arange_s - starts[e_sorted]
            if masked:
                dest = e_sorted * max_m + pos
            else:
                padded = (counts + self.align - 1) // self.align * self.align
                dest = (torch.cumsum(padded, 0) - padded)[e_sorted] + pos
                layout.fill_(-1)
                layout.index_copy_(0, dest, e_sorted.to(torch.int32))
            xq, xsf = token_quant_fp8(inp.x)
            tok = order // k
            a.view(torch.uint8).index_copy_(0, dest, xq.view(torch.uint8).index_select(0, tok))
            a_sf.index_copy_(0, dest, xsf.index_select(0, tok))
            gemm1()
            l1 = d1.index_select(0, dest)
            v = activation(shape, l1[:, :i].float(), l1[:, i:].float())
            v = v * inp.topk_weights.flatten()[order].unsqueeze(1)
            vq, vsf = token_quant_fp8(v)
            hq.view(torch.uint8).index_copy_(0, dest, vq.view(torch.uint8))
            hq_sf.index_copy_(0, dest, vsf)
            gemm2()
            slots = torch.empty((s_count, h), dtype=torch.bfloat16, device=dev)
            slots.index_copy_(0, order, d2.index_select(0, dest))
            return slots.view(t_count, k, h).float().sum(1).to(torch.bfloat16)

        def gemms_only() -> torch.Tensor:
            """The two grouped GEMMs alone, on the buffers the last run() filled: what the chain
            would cost with free glue (a lower bound for a DeepGEMM-based stack, not a layer)."""
            gemm1()
            gemm2()
            return d2

        run.gemms_only = gemms_only
        return run


class DeepGemmMegaMoe:
    """DeepGEMM's SM90 FP8 x FP8 Mega MoE on one rank.

    The buffer comes from a one-rank NCCL process group with symmetric memory (the usage DeepGEMM's
    own SM90 examples follow); where that cannot be set up, from a plain one-rank allocation (the
    layout DeepGEMM's SM100 path uses for one rank). `buffer_mode` records which one ran."""
    name = 'deepgemm-mega'
    description = 'DeepGEMM SM90 FP8xFP8 Mega MoE (fused dispatch/L1/act/L2/combine), one rank'
    graphable = True
    # NOTES: the kernel is a template of the token capacity; one capacity for every T keeps it to
    # one JIT compile per shape; num_tokens_bound lets each call choose its schedule by its own T.
    capacity = 8192

    def __init__(self, shape: Shape, weights: MxWeights):
        self.dg = _import_deep_gemm()
        self.shape = shape
        self.num_experts = weights.num_experts
        l1, l2 = requantize_weights(weights)
        self.l1, self.l2 = self.dg.transform_weights_for_mega_moe_sm90(l1, l2)
        del l1, l2
        try:
            self.sym = self._dist_buffer()
            self.buffer_mode = 'nccl one-rank group, symmetric memory'
        except Exception as exc:
            self.buffer_mode = f'plain one-rank buffer (process group failed: {type(exc).__name__}: {exc})'[:300]
            self.sym = self._plain_buffer()

    def _dist_buffer(self):
        import torch.distributed as dist
        if not dist.is_initialized():
            # NOTES: a port per process: children run one after another and a closed store's port
            # can linger in TIME_WAIT.
            port = 20000 + os.getpid() % 20000
            dist.init_process_group(backend='nccl', init_method=f'tcp://127.0.0.1:{port}',
                                    rank=0, world_size=1, device_id=torch.device('cuda:0'))
        group = dist.new_group([0])
        return self.dg.get_symm_buffer_for_sm90_mega_moe(
            group, self.num_experts, self.capacity, self.shape.top_k, self.shape.hidden,
            self.shape.intermediate, use_fp8_dispatch=True, activation='swiglu')

    def _plain_buffer(self):
        C = self.dg._C
        align = int(C.get_token_alignment_for_sm90_mega_moe())
        cap = -(-self.capacity // align) * align
        args = (1, self.num_experts, cap, self.shape.top_k, self.shape.hidden, self.shape.intermediate,
                True, 'swiglu')
        buffer = torch.zeros(int(C.get_symm_buffer_size_for_sm90_mega_moe(*args)), dtype=torch.int8, device='cuda')
        (x, x_sf, topk_idx, topk_weights, *_rest) = C.slice_symm_buffer_for_sm90_mega_moe(buffer, *args)
        return types.SimpleNamespace(
            buffer=buffer, handle=types.SimpleNamespace(buffer_ptrs=[buffer.data_ptr()]),
            group=types.SimpleNamespace(rank=lambda: 0, size=lambda: 1),
            num_max_tokens_per_rank=cap, num_experts=self.num_experts, num_topk=self.shape.top_k,
            x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights)

    @staticmethod
    def unsupported(shape: Shape) -> Optional[str]:
        reason = _shape_reason(shape) or unsupported_common()
        if reason:
            return reason
        if shape.activation != 'swiglu':
            return f'the SM90 Mega MoE implements swiglu only (this shape uses {shape.activation})'
        import deep_gemm
        if not (hasattr(deep_gemm, 'fp8_mega_moe') and hasattr(deep_gemm, 'mega_moe_pre_dispatch_sm90')):
            return (f'the deep_gemm found ({getattr(deep_gemm, "__file__", "?")}) has no SM90 fp8_mega_moe: '
                    'vLLM\'s vendored DeepGEMM has only the SM100 Mega MoE, and the sgl-deep-gemm wheels '
                    '(0.1.7..0.2.5), which have the SM90 one, do not load with torch 2.11 (built for a newer torch)')
        return None

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.l1, *self.l2))

    def build(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        t_count = inp.num_tokens
        sym = self.sym
        if t_count > sym.num_max_tokens_per_rank:
            raise ValueError(f'num_tokens {t_count} above the Mega MoE capacity {sym.num_max_tokens_per_rank}')
        # NOTES: NaN-poisoned, so rows the kernel never writes fail the check.
        y = torch.full((t_count, self.shape.hidden), float('nan'), dtype=torch.bfloat16, device=inp.x.device)

        def run() -> torch.Tensor:
            self.dg.mega_moe_pre_dispatch_sm90(inp.x, inp.topk_idx, inp.topk_weights, sym.x, sym.x_sf,
                                               sym.topk_idx, sym.topk_weights, t_count)
            self.dg.fp8_mega_moe(y, self.l1, self.l2, sym, num_tokens_bound=t_count)
            return y

        return run
