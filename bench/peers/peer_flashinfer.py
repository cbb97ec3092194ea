"""FlashInfer's SM90 CUTLASS MXFP4 MoE (what SGLang and vLLM run for MXFP4 MoE models on Hopper).

flashinfer-sm90-mxfp4: `flashinfer.fused_moe.cutlass_fused_moe` with BF16 activations and MXFP4
  weights (W4A16, `use_w4_group_scaling=True`): our E2M1 bytes and UE8M0 scales unchanged in value,
  gate/up swapped to its [up; gate] L1 order and byte-interleaved by its own helpers
  (`interleave_moe_weights_for_sm90_mixed_gemm(.., 'fp4')`, `interleave_moe_scales_for_sm90_mixed_gemm`),
  routing (top-k ids and weights), dispatch, SwiGLU, L2 and the fused finalize (combine) inside.

The package is flashinfer-python 0.7.2.post1 reduced to what its SM90 fused-MoE JIT module needs
(prepare_sources.sh), unpacked and JIT-built on the GPU machine by build_peers.sh under
/tmp/megamoe_peers_build/flashinfer; a build that did not finish is reported with its reason.
The W4A8 variant (MXFP4 x FP8, `use_wfp4afp8_humming=True`) uses the same module but needs its
Humming weight preprocessing: not wired yet (README.md).
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import torch

from common import Inputs, MxWeights, Shape

BUILD_ROOT = '/tmp/megamoe_peers_build'
FI_ROOT = os.environ.get('FI_ROOT', os.path.join(BUILD_ROOT, 'flashinfer', 'pkg'))
FI_WORKSPACE = os.path.join(BUILD_ROOT, 'flashinfer', 'ws')
SITE = os.path.join(BUILD_ROOT, 'site')
MX_GROUP = 32


def _build_line() -> str:
    try:
        with open(os.path.join(BUILD_ROOT, 'flashinfer.line')) as f:
            return f.read().strip()[-500:]
    except OSError:
        return 'bench/peers/build_peers.sh did not run in this call'


def _import_fused_moe():
    if not os.path.isdir(os.path.join(FI_ROOT, 'flashinfer')):
        raise ImportError(f'no flashinfer under {FI_ROOT} ({_build_line()})')
    # The JIT module is looked up (and, missing, compiled) under the workspace build_peers.sh used.
    os.environ.setdefault('FLASHINFER_WORKSPACE_BASE', FI_WORKSPACE)
    for path in (SITE, FI_ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)
    import flashinfer.fused_moe as fm
    return fm


class FlashInferSm90Mxfp4:
    name = 'flashinfer-sm90-mxfp4'
    description = ('FlashInfer 0.7.2.post1 cutlass_fused_moe, SM90 W4A16 (BF16 x MXFP4, use_w4_group_scaling), '
                   'fused routing/dispatch/SwiGLU/finalize')
    graphable = True

    def __init__(self, shape: Shape, weights: MxWeights):
        self.fm = _import_fused_moe()
        self.shape = shape
        i = shape.intermediate
        fm = self.fm
        # L1 rows [gate; up] -> FlashInfer's [up (w3); gate (w1)]
        w13 = torch.cat([weights.w13[:, i:], weights.w13[:, :i]], dim=1).contiguous()
        s13 = torch.cat([weights.w13_sf[:, i:], weights.w13_sf[:, :i]], dim=1).contiguous()
        self.w1 = fm.interleave_moe_weights_for_sm90_mixed_gemm(w13.view(torch.uint8), 'fp4')
        self.w2 = fm.interleave_moe_weights_for_sm90_mixed_gemm(weights.w2.contiguous().view(torch.uint8), 'fp4')
        self.s1 = fm.interleave_moe_scales_for_sm90_mixed_gemm(s13)
        self.s2 = fm.interleave_moe_scales_for_sm90_mixed_gemm(weights.w2_sf.contiguous())
        del w13, s13
        self.quant_scales = [self.s1.view(torch.int32), self.s2.view(torch.int32)]

    @staticmethod
    def unsupported(shape: Shape) -> Optional[str]:
        if shape.activation != 'swiglu':
            return f'only the plain swiglu path is wired (this shape uses {shape.activation})'
        for name, dim in (('hidden', shape.hidden), ('intermediate', shape.intermediate)):
            if dim % (4 * MX_GROUP):
                return f'{name} = {dim}: its E8M0 scales are read as int32 along K (K / 32 a multiple of 4)'
        line = _build_line()
        if 'built' not in line:
            return f'FlashInfer SM90 fused MoE module not built: {line}'
        try:
            fm = _import_fused_moe()
        except Exception as exc:
            return f'import flashinfer.fused_moe failed: {type(exc).__name__}: {exc}'[:600]
        missing = [n for n in ('cutlass_fused_moe', 'interleave_moe_weights_for_sm90_mixed_gemm',
                               'interleave_moe_scales_for_sm90_mixed_gemm') if not hasattr(fm, n)]
        if missing:
            return f'flashinfer.fused_moe lacks {missing}'
        if torch.cuda.get_device_capability()[0] != 9:
            return 'the BF16 x MXFP4 CUTLASS MoE is SM90-only'
        return None

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w1, self.w2, self.s1, self.s2))

    def build(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        fm = self.fm
        out = torch.full((inp.num_tokens, self.shape.hidden), float('nan'), dtype=torch.bfloat16,
                         device=inp.x.device)
        x = inp.x.contiguous()
        idx = inp.topk_idx.to(torch.int32).contiguous()
        w = inp.topk_weights.to(torch.float32).contiguous()

        def run() -> torch.Tensor:
            fm.cutlass_fused_moe(x, idx, w, self.w1, self.w2, torch.bfloat16,
                                 quant_scales=self.quant_scales, use_w4_group_scaling=True, output=out)
            return out

        return run
