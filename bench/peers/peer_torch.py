"""Peer: the torch BF16 chain (targets.md, "Peers"): what a user without FP4 kernels runs.

MXFP4 weights dequantized to BF16 (exactly), expert-sorted tokens, torch._grouped_mm for L1 and L2,
the shape's activation in FP32 with the routing weight applied before L2 (as the contract does),
per-slot outputs summed in FP32 over k and rounded once. No host synchronization, so the whole layer
is captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from common import Inputs, MxWeights, Shape, dequant_weights
from reference import activation


class TorchBf16Chain:
    name = 'torch-bf16'
    description = 'dequantized BF16 weights, torch._grouped_mm L1/L2, CUDA graph'
    graphable = True

    def __init__(self, shape: Shape, weights: MxWeights):
        self.shape = shape
        self.num_experts = weights.num_experts
        w13, w2 = dequant_weights(weights, torch.bfloat16)
        # NOTES: _grouped_mm takes B as [G, K, N]; the transposed views of the row-major [G, N, K]
        # weights are column-major B, the layout its Hopper kernel reads without a copy.
        self.w13_t = w13.transpose(-2, -1)
        self.w2_t = w2.transpose(-2, -1)
        self.b13 = weights.w13_bias
        self.b2 = weights.w2_bias

    @staticmethod
    def unsupported(shape: Shape) -> Optional[str]:
        if not hasattr(torch, '_grouped_mm'):
            return f'torch {torch.__version__} has no torch._grouped_mm'
        return None

    def weight_bytes(self) -> int:
        return 2 * (self.w13_t.numel() + self.w2_t.numel())

    def build(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        shape = self.shape
        t_count, k = inp.topk_idx.shape
        i, h = shape.intermediate, shape.hidden
        ones = torch.ones(t_count * k, dtype=torch.int32, device=inp.x.device)

        def run() -> torch.Tensor:
            flat = inp.topk_idx.flatten()
            order = torch.argsort(flat, stable=True)
            expert_sorted = flat[order].long()
            counts = torch.zeros(self.num_experts, dtype=torch.int32, device=flat.device)
            counts.scatter_add_(0, flat.long(), ones)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            xs = inp.x.index_select(0, order // k)
            l1 = torch._grouped_mm(xs, self.w13_t, offs=offs)            # [S, 2I] bf16
            if self.b13 is not None:
                l1 = l1 + self.b13[expert_sorted]
            g = l1[:, :i].float()
            u = l1[:, i:].float()
            route_w = inp.topk_weights.flatten()[order].unsqueeze(1)
            v = activation(shape, g, u) * route_w
            o = torch._grouped_mm(v.to(torch.bfloat16), self.w2_t, offs=offs)   # [S, H] bf16
            if self.b2 is not None:   # the routing weight scales the whole expert output
                o = (o.float() + self.b2[expert_sorted].float() * route_w).to(torch.bfloat16)
            slots = torch.empty_like(o)
            slots.index_copy_(0, order, o)
            return slots.view(t_count, k, h).float().sum(1).to(torch.bfloat16)

        return run
