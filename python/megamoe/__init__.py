"""megamoe: MXFP4-weight, FP8-activation Mixture-of-Experts layers (CPU reference + Hopper).

    import numpy as np, megamoe

    config = megamoe.LayerConfig("small")                  # shape preset + its activation
    layer = megamoe.MoELayer(config, megamoe.synthetic_weights(config, seed=1), backend="cpu")
    x = megamoe.bf16_from_f32(np.random.randn(8, config.shape.hidden).astype(np.float32))
    idx = np.tile(np.arange(config.shape.top_k, dtype=np.int32), (8, 1))  # int32 [T, K], -1 = none
    w = np.full((8, config.shape.top_k), 0.5, np.float32)  # float32 [T, K]
    y = layer.forward(x, idx, w)                           # bf16 [T, H] (numpy: uint16 bits)

Arrays cross without copies through DLPack: numpy arrays and torch tensors on the CPU, torch
CUDA tensors on the GPU (calls run on torch's current stream and can be captured in CUDA graphs).
BF16 is numpy uint16 (raw bits), ml_dtypes.bfloat16 or torch.bfloat16.

Expert parallelism (R ranks, each owning E / R experts, one process per GPU over NCCL or R
virtual ranks on one GPU): megamoe.ep, and MoELayer(..., group=...).

With torch (imported on request, never by this package itself): megamoe.torch_ops (the layer as
the custom op torch.ops.megamoe.moe_forward, for torch.compile and CUDA graphs) and
megamoe.deep_gemm_compat (DeepGEMM's Mega MoE Python API served by megamoe).

Errors are megamoe.Error subclasses that are also the matching builtin exception:
InvalidArgumentError (ValueError), DTypeError (TypeError), OutOfRangeError (ValueError),
FormatError (ValueError), IoError (OSError), UnsupportedError / CudaError / InternalError
(RuntimeError), TimeoutError (TimeoutError: a rank of an EP group did not arrive in time).
"""

from . import _megamoe as _C
from ._megamoe import (
    Activation,
    CudaError,
    DTypeError,
    Error,
    FormatError,
    InternalError,
    InvalidArgumentError,
    IoError,
    LayerConfig,
    LayerShape,
    OutOfRangeError,
    TimeoutError,
    UnsupportedError,
    activation_preset,
    memory_stats,
    reset_memory_peak,
    shape_preset,
    shape_preset_names,
)
from .formats import (
    E2M1_MAX,
    E4M3_MAX,
    SCALE_BLOCK,
    bf16_from_f32,
    bf16_to_f32,
    dequantize_fp8,
    dequantize_mxfp4,
    e2m1_from_f32,
    e2m1_pack,
    e2m1_to_f32,
    e2m1_unpack,
    e4m3_from_f32,
    e4m3_to_f32,
    quantize_input,
    quantize_mxfp4,
    requantize,
    ue8m0_to_f32,
)
from .checkpoint import (
    DEFAULT_PREPARE_SCRATCH_BYTES,
    Checkpoint,
    MoeLayerInfo,
    layout_for_backend,
    layout_names,
    load_moe_layer,
    prepare,
    prepare_for_fused,
    unprepare,
    write_moe_checkpoint,
)
from .layer import (
    MoELayer,
    MoeWeights,
    available_backends,
    compare_output,
    diff_metric,
    ideal_forward,
    reference_forward,
    reference_forward_quantized,
    reference_l2_combine,
    synthetic_weights,
)

from .routing import ROUTING_KINDS, make_routing, route_sigmoid_topk, synthetic_activations
from . import ep
from .ep import EpGroup, EpOptions

__version__ = "0.1.0"

WITH_CUDA = _C.WITH_CUDA
"""True when this build of the extension includes the CUDA (sm_90a) backends."""
