"""megamoe itself through its Python package (`import megamoe`, sm90 backend), on exactly the
inputs the peers get.

`megamoe bench` (C++) draws its own synthetic weights and routing; this adapter instead hands the
peers' MXFP4 weights, x and routing to megamoe.MoELayer, so its time sits beside the peers' on
bit-identical inputs and its output is checked by the same torch reference (it should match the
contract far more closely than any peer: same quantization). It needs the package built with CUDA
and importable (PYTHONPATH); otherwise it is listed as unsupported with the import error.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from common import Inputs, MxWeights, Shape


class MegamoePython:
    name = 'megamoe-py'
    description = 'megamoe.MoELayer (sm90 backend) via import megamoe, on the peers\' exact inputs'
    graphable = True
    capacity = 8192
    backend = 'sm90'      # selftest.py runs the same adapter on megamoe's 'cpu' backend
    precision = 'exact'

    def __init__(self, shape: Shape, weights: MxWeights):
        import megamoe
        ep_size = shape.num_experts // shape.bench_experts
        config = megamoe.LayerConfig(shape.name, ep_size=ep_size, ep_rank=0,
                                     max_tokens_per_rank=self.capacity, precision=self.precision)
        mw = megamoe.MoeWeights.from_arrays(weights.w13, weights.w13_sf, weights.w2, weights.w2_sf, 0,
                                            weights.w13_bias, weights.w2_bias)
        # The peers' inputs route every token to the bench's experts (EP8 per-rank work for
        # kimi-k3: a rank whose group holds T x ep_size tokens); the layer's FP8 rule estimates
        # rows per expert as T * K / E over all E experts, so its threshold is scaled by the ranks
        # to see the same rows per local expert as it would under that group (forward_ep: T x R).
        config.fp8_min_rows_per_expert = -(-config.fp8_min_rows_per_expert // ep_size)
        self.layer = megamoe.MoELayer(config, mw, backend=self.backend)
        self.fast_math = bool(config.fast_math)
        self.hidden = shape.hidden
        self._bytes = int(self.layer.weights_bytes)

    @staticmethod
    def unsupported(shape: Shape) -> Optional[str]:
        try:
            import megamoe
        except Exception as exc:
            return f'import megamoe failed: {type(exc).__name__}: {exc}'
        if 'sm90' not in megamoe.available_backends():
            return f'megamoe backends here: {megamoe.available_backends()} (no sm90: not built with CUDA?)'
        if shape.num_experts % shape.bench_experts:
            return f'{shape.bench_experts} benchmarked experts do not divide {shape.num_experts}'
        return None

    def weight_bytes(self) -> int:
        return self._bytes

    def build(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        # NOTES: NaN-poisoned, so rows the kernel never writes fail the check.
        y = torch.full((inp.num_tokens, self.hidden), float('nan'), dtype=torch.bfloat16, device=inp.x.device)

        def run() -> torch.Tensor:
            self.layer.forward(inp.x, inp.topk_idx, inp.topk_weights, out=y)
            return y

        return run


class MegamoePythonFp8(MegamoePython):
    """The same with precision='fp8' (docs/numerics.md "FP8 mode"), applied by the layer's own rule
    (LayerConfig.fp8_min_rows_per_expert, default 128 routed rows per expert; the exact mode below)."""
    name = 'megamoe-py-fp8'
    description = "megamoe.MoELayer (sm90 backend), precision='fp8', on the peers' exact inputs"
    precision = 'fp8'
