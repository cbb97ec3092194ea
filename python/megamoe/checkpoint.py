"""Checkpoints and weight preparation.

    ckpt = megamoe.Checkpoint.open("/models/kimi-k3")        # file, index.json or folder
    layers = ckpt.moe_layers()                                # [MoeLayerInfo], validated
    w = megamoe.load_moe_layer(ckpt, layers[0], ep_rank=0, ep_size=8)   # canonical, host
    megamoe.prepare(w, "blackwell-interop")                   # in place; unprepare() inverts

Conventions (weights.md section 1): "kimi-k3" (one tensor per expert and matrix,
{prefix}.experts.{e}.w{1,2,3}.weight_packed/.weight_scale) and "gpt-oss" (all experts of a
layer in one tensor, gate/up rows interleaved, with biases). Errors: FormatError (ValueError)
for malformed files naming file and tensor, IoError (OSError) for open/mmap failures,
InvalidArgumentError for a bad request (an EP size that does not divide E).
"""

import os

from . import _arrays
from . import _megamoe as _C

Checkpoint = _C.Checkpoint
MoeLayerInfo = _C.MoeLayerInfo
DEFAULT_PREPARE_SCRATCH_BYTES = _C.DEFAULT_PREPARE_SCRATCH_BYTES



def _open_checkpoint(path):
    """Opens a checkpoint: a .safetensors file, a *.safetensors.index.json, or a folder holding
    model.safetensors.index.json or *.safetensors shards (str or os.PathLike). Every file is
    memory-mapped and validated (FormatError naming file and tensor; IoError when unreadable)."""
    return _C.Checkpoint._open(os.fspath(path))


# NOTES: attached here so paths may be os.PathLike (the binding takes a str).
Checkpoint.open = staticmethod(_open_checkpoint)

__all__ = [
    "Checkpoint", "MoeLayerInfo", "load_moe_layer", "write_moe_checkpoint", "prepare",
    "unprepare", "prepare_for_fused", "layout_names", "layout_for_backend",
    "DEFAULT_PREPARE_SCRATCH_BYTES",
]


def _find_layer(checkpoint, layer):
    if isinstance(layer, MoeLayerInfo):
        return layer
    layers = checkpoint.moe_layers()
    for info in layers:
        if (isinstance(layer, str) and info.prefix == layer) or \
           (isinstance(layer, int) and not isinstance(layer, bool) and info.layer_index == layer):
            return info
    known = ", ".join(f"{i.layer_index}:'{i.prefix}'" for i in layers) or "none"
    raise _C.InvalidArgumentError(
        f"layer: no MoE layer {layer!r} in {checkpoint.path} (layers: {known})")


def load_moe_layer(checkpoint, layer, ep_rank=0, ep_size=1, allow_nan_scales=False):
    """Canonical host MoeWeights of one layer for EP rank `ep_rank` of `ep_size` (global experts
    [r*E_l, (r+1)*E_l)); only that rank's experts are read.

    checkpoint: a Checkpoint or a path; layer: a MoeLayerInfo, a layer index (int) or a prefix
    (str). GPT-OSS gate/up rows are de-interleaved (gate rows first). A UE8M0 scale byte 0xFF
    (NaN) raises FormatError naming the tensor and the expert unless allow_nan_scales is True.
    """
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint.open(checkpoint)
    return _C.load_moe_layer(checkpoint, _find_layer(checkpoint, layer), ep_rank, ep_size,
                             allow_nan_scales)


def write_moe_checkpoint(path, layers, convention="kimi-k3"):
    """Writes canonical host weights to one .safetensors file.

    layers: {prefix: MoeWeights}, e.g. {"model.layers.3.mlp": w}; all E_l experts of each are
    written numbered from 0. convention: "kimi-k3" or "gpt-oss" (interleaves gate/up rows).
    """
    _C.write_moe_checkpoint(os.fspath(path), dict(layers), convention)


def prepare(weights, backend, scratch_bytes=DEFAULT_PREPARE_SCRATCH_BYTES, stream=None):
    """Prepares `weights` in place for `backend` ("cpu"/"canonical", "sm90",
    "blackwell-interop", see layout_names()). Already prepared for it: a no-op; prepared for
    another layout: converted through canonical (lossless). Peak extra memory is one scratch
    buffer of at most `scratch_bytes` (at least one expert). Device weights run on `stream`
    (default: torch's current stream when torch is loaded, else 0).

    Returns a dict: from_layout, to_layout, no_op, converted, bytes_transformed, scratch_bytes,
    peak_extra_bytes, summary.
    """
    return _C.prepare(weights, backend, scratch_bytes, _stream_for(weights, stream))


def unprepare(weights, scratch_bytes=DEFAULT_PREPARE_SCRATCH_BYTES, stream=None):
    """Back to the canonical layout, bit for bit (a no-op for canonical weights)."""
    return _C.unprepare(weights, scratch_bytes, _stream_for(weights, stream))


def prepare_for_fused(weights, sm_version, scratch_bytes=DEFAULT_PREPARE_SCRATCH_BYTES,
                      stream=None):
    """Prepares for the fused MegaMoE kernel of a GPU of compute capability `sm_version`
    (major * 10 + minor: 90 -> "sm90", 100/103 -> "blackwell-interop"), whatever layout the
    weights are in now."""
    return _C.prepare_for_fused(weights, sm_version, scratch_bytes, _stream_for(weights, stream))


def layout_names():
    """Registered weight layouts ("canonical", "blackwell-interop", and "sm90" in CUDA builds)."""
    return _C.layout_names()


def layout_for_backend(backend):
    """The layout a backend reads ("cpu" -> "canonical")."""
    return _C.layout_for_backend(backend)


def _stream_for(weights, stream):
    if stream is not None:
        return _arrays.cuda_stream(stream)
    torch = _arrays._torch()
    if weights.device != "cpu" and torch is not None:
        return torch.cuda.current_stream(weights.device).cuda_stream
    return 0
