"""Peer: OpenAI's triton_kernels matmul_ogs with MXFP4 weights on Hopper (the kernel vLLM runs
gpt-oss with on H100/H200).

Where it comes from: triton_kernels is not published on PyPI for triton 3.6 (the PyPI project
`triton-kernels` is an unrelated package). vLLM's wheel vendors a copy under
vllm/third_party/triton_kernels, the copy vLLM falls back on; bench/peers/fetch_wheels.sh extracts
that folder (only it) into .whl/pylib, which compare.py puts on sys.path.

The weights are our canonical MXFP4 bytes and UE8M0 scales, unchanged in value: only swizzled into
the Hopper value/scale layouts triton_kernels reads. Activations stay BF16 (W4A16: the kernel
upcasts the weights in registers). L1 gathers the rows of each expert (gather index), the
activation and routing weight run in torch on the expert-sorted rows (triton_kernels fuses only
gpt-oss's swiglu variant), and L2 scatters and sums the K slots of each token (its reduction).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from common import Inputs, MxWeights, Shape
from reference import activation

HOPPER_NUM_WARPS = 8          # the num_warps the Hopper scale swizzle is laid out for (vLLM's choice)
SCALE_K_MULTIPLE = 4          # Hopper scale layout needs the scale-group count padded to 4


def _imports():
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig, matmul_ogs
    from triton_kernels.matmul_ogs_details import opt_flags
    from triton_kernels.numerics import InFlexData
    from triton_kernels.routing import GatherIndx, RoutingData, ScatterIndx, compute_expt_data
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout
    return locals()


class TritonMatmulOgs:
    name = 'triton-mxfp4'
    description = 'OpenAI triton_kernels matmul_ogs, MXFP4 weights x BF16 activations (vLLM-vendored copy)'
    graphable = True

    def __init__(self, shape: Shape, weights: MxWeights):
        self.k = _imports()
        self.shape = shape
        self.num_experts = weights.num_experts
        if torch.cuda.get_device_capability()[0] == 9:
            # NOTES: vLLM pins split_k = 1 on Hopper for MXFP4 weights (the split-k reduction does not
            # support the fused scatter / MX scales there).
            self.k['opt_flags'].update_opt_flags_constraints({'split_k': 1})
        self.w13, self.w13_sf = self._swizzle(weights.w13, weights.w13_sf)
        self.w2, self.w2_sf = self._swizzle(weights.w2, weights.w2_sf)
        self.b13 = weights.w13_bias.float() if weights.w13_bias is not None else None
        self.b2 = weights.w2_bias.float() if weights.w2_bias is not None else None
        k = self.k
        self.pc13 = k['PrecisionConfig'](weight_scale=self.w13_sf, flex_ctx=k['FlexCtx'](rhs_data=k['InFlexData']()))
        self.pc2 = k['PrecisionConfig'](weight_scale=self.w2_sf, flex_ctx=k['FlexCtx'](rhs_data=k['InFlexData']()))
        self._bytes = sum(t.numel() * t.element_size() for t in (weights.w13, weights.w13_sf, weights.w2, weights.w2_sf))

    def _swizzle(self, codes: torch.Tensor, sf: torch.Tensor):
        k = self.k
        lay = k['layout']
        value_layout, value_opts = lay.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = lay.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=HOPPER_NUM_WARPS)
        pad = -sf.shape[-1] % SCALE_K_MULTIPLE
        if pad:
            sf = torch.nn.functional.pad(sf, (0, pad))
        # [E, N, K/2] -> the [E, K, N] operand triton_kernels multiplies x by (x @ W).
        w = k['convert_layout'](k['wrap_torch_tensor'](codes.transpose(-2, -1), dtype=k['FP4']), value_layout, **value_opts)
        s = k['convert_layout'](k['wrap_torch_tensor'](sf.transpose(-2, -1)), scale_layout, **scale_opts)
        return w, s

    @staticmethod
    def unsupported(shape: Shape) -> Optional[str]:
        try:
            _imports()
        except Exception as exc:
            return f'import triton_kernels failed: {type(exc).__name__}: {exc}'
        return None

    def weight_bytes(self) -> int:
        return self._bytes

    def build(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        k = self.k
        shape = self.shape
        t_count, top_k = inp.topk_idx.shape
        s_count = t_count * top_k
        i = shape.intermediate
        dev = inp.x.device
        ones = torch.ones(s_count, dtype=torch.int32, device=dev)

        state = {}

        def run() -> torch.Tensor:
            flat = inp.topk_idx.flatten()
            topk_indx = torch.argsort(flat, stable=True).to(torch.int32)     # sorted row -> slot
            gate_indx = torch.empty_like(topk_indx)                           # slot -> sorted row
            gate_indx.scatter_(0, topk_indx.long(), torch.arange(s_count, dtype=torch.int32, device=dev))
            hist = torch.zeros(self.num_experts, dtype=torch.int32, device=dev)
            hist.scatter_add_(0, flat.long(), ones)
            gate_scal = inp.topk_weights.flatten()[topk_indx.long()]
            expt_data = k['compute_expt_data'](hist, self.num_experts, s_count)
            routing = k['RoutingData'](gate_scal, hist, self.num_experts, top_k, expt_data)
            gather = k['GatherIndx'](src_indx=topk_indx, dst_indx=gate_indx)
            scatter = k['ScatterIndx'](src_indx=gate_indx, dst_indx=topk_indx)
            l1 = k['matmul_ogs'](inp.x, self.w13, self.b13, routing, gather_indx=gather,
                                 precision_config=self.pc13)
            l1 = l1.view(s_count, 2 * i)
            v = activation(shape, l1[:, :i].float(), l1[:, i:].float()) * gate_scal.unsqueeze(1)
            v = v.to(torch.bfloat16)
            state.update(routing=routing, gather=gather, scatter=scatter, gate_scal=gate_scal, v=v)
            return l2(v, routing, scatter, gate_scal)

        def l2(v, routing, scatter, gate_scal) -> torch.Tensor:
            # betas scale the bias per row: the L2 bias is weighted like the rest of the output.
            y = k['matmul_ogs'](v, self.w2, self.b2, routing, scatter_indx=scatter,
                                precision_config=self.pc2, betas=None if self.b2 is None else gate_scal)
            return y.view(t_count, shape.hidden)

        def gemms_only() -> torch.Tensor:
            """The two matmul_ogs calls alone, on the routing and intermediate of the last eager
            run(): the chain with free glue (a lower bound, not a layer)."""
            k['matmul_ogs'](inp.x, self.w13, self.b13, state['routing'], gather_indx=state['gather'],
                            precision_config=self.pc13)
            return l2(state['v'], state['routing'], state['scatter'], state['gate_scal'])

        run.gemms_only = gemms_only
        return run
