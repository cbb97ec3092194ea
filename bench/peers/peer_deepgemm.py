"""DeepGEMM peers (JIT-compiled with nvcc on first use). The package used is the DeepGEMM that vLLM
vendors (fetch_wheels.sh: its extension loads with the GPU image's torch 2.11); the SM90 Mega MoE
adapters use the source-built one (below).

deepgemm-fp8: the FP8 x FP8 grouped-GEMM chain a serving stack builds from DeepGEMM on Hopper:
  weights: MXFP4 dequantized (exactly) and requantized to E4M3 with FP32 scales per 128 x 128
           block (DeepGEMM's SM90 recipe; per-32 UE8M0 weight scales are not an SM90 option);
  x and the intermediate: E4M3 with FP32 scales per token and 128 channels;
  decode (T <= MASKED_MAX_TOKENS): masked layout [E, max_m, .], m_grouped_fp8_gemm_nt_masked;
  prefill: contiguous expert-sorted rows padded per expert to DeepGEMM's M alignment,
           m_grouped_fp8_gemm_nt_contiguous;
  the dispatch, activation, requantization and combine between them are torch ops, all in the
  same CUDA graph.
deepgemm-mega / deepgemm-mega-fp4: DeepGEMM's SM90 FP8 x FP8 and FP8 x MXFP4 Mega MoE (one fused
  kernel, swiglu only) on one rank, from a deep_gemm built from source on the GPU machine by
  build_peers.sh (deepseek-ai/DeepGEMM PR #323 head 8ddf7f9: no PyPI wheel of it loads with torch 2.11).
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


BUILD_ROOT = '/tmp/megamoe_peers_build'          # bench/peers/build_peers.sh builds here
DG_MEGA_ROOT = os.environ.get('DG_MEGA_ROOT', os.path.join(BUILD_ROOT, 'deepgemm', 'pkg'))
DG_MEGA_SITE = os.path.join(BUILD_ROOT, 'site')     # apache-tvm-ffi (its binding)
MEGA_CAPACITY = 8192


def _build_line(name: str) -> str:
    try:
        with open(os.path.join(BUILD_ROOT, name)) as f:
            return f.read().strip()[-500:]
    except OSError:
        return 'bench/peers/build_peers.sh did not run in this call'


def _import_mega_deep_gemm():
    """The DeepGEMM with the SM90 Mega MoE, built from source by build_peers.sh (deepseek-ai/DeepGEMM
    PR #323 head, the sgl-deep-gemm layout, its tvm-ffi binding compiled against the image's torch).
    It shadows the vLLM-vendored deep_gemm the FP8 chain uses: each peer runs in its own process."""
    import sys
    if not os.path.isfile(os.path.join(DG_MEGA_ROOT, 'deep_gemm', '_C.so')):
        raise ImportError(f'no source-built deep_gemm at {DG_MEGA_ROOT} ({_build_line("deepgemm.line")})')
    if 'deep_gemm' in sys.modules and not sys.modules['deep_gemm'].__file__.startswith(DG_MEGA_ROOT):
        raise ImportError(f'another deep_gemm was imported first: {sys.modules["deep_gemm"].__file__}')
    for path in (DG_MEGA_SITE, DG_MEGA_ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)
    import deep_gemm
    return deep_gemm


def _as_torch(t, dtype=None) -> torch.Tensor:
    """tvm-ffi returns DLPack tensors; the views of the buffer must stay torch tensors."""
    if not isinstance(t, torch.Tensor):
        t = torch.utils.dlpack.from_dlpack(t)
    return t.view(dtype) if dtype is not None and t.dtype != dtype else t


class DeepGemmMegaMoe:
    """DeepGEMM's SM90 FP8 x FP8 Mega MoE (one persistent kernel: dispatch, L1, SwiGLU, FP8 requant,
    L2, combine) on one rank, after its SM90 pre-dispatch kernel (BF16 x -> E4M3 per 128 channels).

    EP = 1: the buffer is one plain allocation of the size DeepGEMM asks for
    (`get_symm_buffer_size_for_sm90_mega_moe` with one rank), its own pointer as the one peer
    pointer: a one-rank group needs no symmetric memory or process group."""
    name = 'deepgemm-mega'
    description = ('DeepGEMM SM90 FP8xFP8 Mega MoE (deepseek-ai/DeepGEMM PR #323, built from source), '
                   'pre-dispatch + fused kernel, one rank, capacity 8192, fast_math default')
    graphable = True
    mma = 'fp8'

    def __init__(self, shape: Shape, weights: MxWeights):
        self.dg = _import_mega_deep_gemm()
        self.shape = shape
        self.num_experts = weights.num_experts
        self.l1, self.l2 = self._prepare_weights(weights)
        self.sym = self._plain_buffer()
        self.buffer_mode = 'plain one-rank buffer (no symmetric memory), capacity %d' % self.sym.num_max_tokens_per_rank

    def _prepare_weights(self, weights: MxWeights):
        # MXFP4 -> BF16 (exact) -> E4M3 per 128 x 128 block, FP32 scales: DeepGEMM's SM90 recipe.
        l1, l2 = requantize_weights(weights)
        out = self.dg.transform_weights_for_mega_moe_sm90(l1, l2)
        del l1, l2
        return out

    def _plain_buffer(self):
        C = self.dg._C
        align = int(C.get_token_alignment_for_mega_moe())
        cap = -(-MEGA_CAPACITY // align) * align
        num_bytes, slicer = C.get_symm_buffer_size_for_sm90_mega_moe(
            1, self.num_experts, cap, self.shape.top_k, self.shape.hidden, self.shape.intermediate, True, 'swiglu')
        buffer = torch.zeros(int(num_bytes), dtype=torch.int8, device='cuda')
        x, x_sf, topk_idx, topk_weights, *_rest = slicer(buffer)
        return types.SimpleNamespace(
            buffer=buffer, handle=types.SimpleNamespace(buffer_ptrs=[buffer.data_ptr()]),
            group=types.SimpleNamespace(rank=lambda: 0, size=lambda: 1),
            num_max_tokens_per_rank=cap, num_experts=self.num_experts, num_topk=self.shape.top_k,
            x=_as_torch(x, torch.float8_e4m3fn), x_sf=_as_torch(x_sf), topk_idx=_as_torch(topk_idx),
            topk_weights=_as_torch(topk_weights))

    @classmethod
    def unsupported(cls, shape: Shape) -> Optional[str]:
        reason = _shape_reason(shape)
        if reason:
            return reason
        if shape.activation != 'swiglu':
            return f'the SM90 Mega MoE implements swiglu only (this shape uses {shape.activation})'
        if shape.intermediate // 64 > 64:
            return f'intermediate = {shape.intermediate}: the SM90 Mega MoE asserts I / 64 <= 64'
        try:
            dg = _import_mega_deep_gemm()
        except Exception as exc:
            return f'import of the source-built deep_gemm failed: {type(exc).__name__}: {exc}'[:600]
        if torch.cuda.get_device_capability()[0] != 9:
            return 'the DeepGEMM SM90 Mega MoE needs a Hopper GPU'
        need = ('fp8_mega_moe', 'fp8_fp4_mega_moe', 'transform_weights_for_mega_moe_sm90',
                'mega_moe_pre_dispatch_sm90')
        missing = [n for n in need if not hasattr(dg, n)]
        if missing:
            return f'the deep_gemm at {dg.__file__} lacks {missing}'
        return None

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.l1, *self.l2))

    def _kernel(self, y):
        self.dg.fp8_mega_moe(y, self.l1, self.l2, self.sym)

    def build(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        t_count = inp.num_tokens
        sym = self.sym
        if t_count > sym.num_max_tokens_per_rank:
            raise ValueError(f'num_tokens {t_count} above the Mega MoE capacity {sym.num_max_tokens_per_rank}')
        # NOTES: NaN-poisoned, so rows the kernel never writes fail the check.
        y = torch.full((t_count, self.shape.hidden), float('nan'), dtype=torch.bfloat16, device=inp.x.device)
        x = inp.x.contiguous()
        idx = inp.topk_idx.to(torch.int32).contiguous()
        w = inp.topk_weights.to(torch.float32).contiguous()

        def run() -> torch.Tensor:
            # The pre-dispatch kernel (BF16 -> E4M3, per-128 FP32 scales, int64 top-k) is part of the
            # layer's cost, as in DeepGEMM's own SM90 benchmark and SGLang's integration.
            self.dg.mega_moe_pre_dispatch_sm90(x, idx, w, sym.x, sym.x_sf, sym.topk_idx, sym.topk_weights, t_count)
            self._kernel(y)
            return y

        return run


class DeepGemmMegaMoeFp4(DeepGemmMegaMoe):
    """DeepGEMM's SM90 FP8 x FP4 Mega MoE (PR #323 head: sgl-project/DeepGEMM PR #53 merged into it):
    our MXFP4 weights as they are (E2M1 bytes, the UE8M0 scales packed by its transform), FP8
    activations per 128 channels, the same buffer and pre-dispatch as the FP8 x FP8 kernel."""
    name = 'deepgemm-mega-fp4'
    description = ('DeepGEMM SM90 FP8xMXFP4 Mega MoE (deepseek-ai/DeepGEMM PR #323, built from source), '
                   'MXFP4 weights unchanged, one rank, capacity 8192')
    mma = 'fp8xfp4'

    def _prepare_weights(self, weights: MxWeights):
        sf32 = lambda sf: torch.exp2(sf.to(torch.float32) - 127.0)   # UE8M0 -> FP32, exact
        return self.dg.transform_weights_for_mega_moe_sm90_fp4(
            (weights.w13.contiguous(), sf32(weights.w13_sf)), (weights.w2.contiguous(), sf32(weights.w2_sf)))

    @classmethod
    def unsupported(cls, shape: Shape) -> Optional[str]:
        reason = super().unsupported(shape)
        if reason:
            return reason
        if not hasattr(_import_mega_deep_gemm(), 'transform_weights_for_mega_moe_sm90_fp4'):
            return 'the source-built deep_gemm lacks transform_weights_for_mega_moe_sm90_fp4'
        for var in ('DG_USE_FP4_ACTS', 'DG_USE_FP8_COMBINE'):
            if os.environ.get(var, '0') not in ('', '0'):
                return f'{var} is set: the SM90 FP8xFP4 Mega MoE asserts it is 0'
        return None

    def _kernel(self, y):
        self.dg.fp8_fp4_mega_moe(y, self.l1, self.l2, self.sym)
