"""The MoE layer as a PyTorch custom op, for torch.compile (fullgraph) and CUDA graphs.

    import megamoe, megamoe.torch_ops

    layer = megamoe.MoELayer(config, weights)              # as usual
    moe = megamoe.torch_ops.MoEModule(layer)                # an nn.Module; registers the layer
    y = moe(x, topk_idx, topk_weights)                      # torch.ops.megamoe.moe_forward
    model = torch.compile(model, fullgraph=True)            # traces through it

    # or directly: the op takes the layer's integer handle
    handle = megamoe.torch_ops.register_layer(layer)
    y = torch.ops.megamoe.moe_forward(x, topk_idx, topk_weights, handle)

The op, ``megamoe::moe_forward(Tensor x, Tensor topk_idx, Tensor topk_weights, int layer) ->
Tensor``, is MoELayer.forward as a torch.library custom op:

    x            bf16  [T, H]   on the layer's device
    topk_idx     int32 or int64 [T, K]   global expert ids in [0, E) or -1; int64 ids (what
                 torch.topk returns) are converted on the device, an id outside [-1, E) becoming
                 E so that the layer reports it as out of range
    topk_weights float32 [T, K]
    layer        the handle register_layer() gave
    returns      a new bf16 [T, H] tensor

Its fake (meta) implementation returns an empty bf16 [T, H] tensor, so torch.compile traces it
without running it (also with a symbolic T), and AOT graphs keep it as one opaque call. At run
time it calls the layer on torch's current stream (GPU layers only enqueue work there, with no
host synchronisation), so a captured CUDA graph replays it, and calls of expert-parallel ranks
on their own streams work as with MoELayer itself.

Why an integer handle: a custom op's arguments are tensors and scalars, never arbitrary Python
objects, so the layer is named by a number that this module maps back to it. The map holds the
layer weakly: the caller keeps the layer alive (MoEModule does), and a call after the layer is
gone raises InvalidArgumentError naming the handle. Register a layer before compiling code that
uses it (MoEModule registers at construction); registration inside traced code is a side effect
torch.compile cannot trace.

The handle is a constant of a compiled graph. Compile the whole model (one graph, each layer's
call with its own handle: examples/kimi_mini/engine_swap.py --compile), not each MoE block's
forward on its own: the blocks share one code object, and every layer's handle would recompile
it (torch.compile stops at 8 recompilations; fullgraph=True makes that an error). Where blocks
must be compiled one by one, torch._dynamo.config.allow_unspec_int_on_nn_module = True passes
MoEModule's handle as a graph input instead.

Importing this module imports torch (the rest of the package never does) and registers the ops.
"""

import itertools
import weakref

import torch

from . import _megamoe as _C
from .layer import MoELayer

__all__ = ["MoEModule", "register_layer", "lookup_layer", "moe_forward", "ids_as_int32"]

_LAYERS = weakref.WeakValueDictionary()  # handle -> MoELayer
_NEXT_HANDLE = itertools.count(1)
_HANDLE_ATTR = "_megamoe_op_handle"


def register_layer(layer):
    """The op handle (an int) of `layer`, registering it on first use. The registry holds the
    layer weakly: keep a reference to it for as long as the handle is used."""
    if not isinstance(layer, MoELayer):
        raise _C.InvalidArgumentError(
            f"layer: expected a megamoe.MoELayer, got {type(layer).__name__}")
    handle = layer.__dict__.get(_HANDLE_ATTR)
    if handle is None or _LAYERS.get(handle) is not layer:
        handle = next(_NEXT_HANDLE)
        _LAYERS[handle] = layer
        layer.__dict__[_HANDLE_ATTR] = handle
    return handle


def lookup_layer(handle):
    """The MoELayer registered under `handle`; InvalidArgumentError when there is none (never
    registered, or the layer has been released since)."""
    layer = _LAYERS.get(int(handle))
    if layer is None:
        raise _C.InvalidArgumentError(
            f"layer: no megamoe layer is registered under handle {int(handle)} (never registered "
            f"with megamoe.torch_ops.register_layer, or the MoELayer was released since)")
    return layer


def ids_as_int32(topk_idx, num_experts):
    """topk_idx as int32 for the layer: int32 as it is; int64 (torch.topk's dtype) converted on
    its device, an id outside [-1, E) replaced by E so that the layer reports it out of range
    instead of the int32 conversion wrapping it into a valid id. Other dtypes are left for the
    layer to reject (DTypeError). Capture safe: no host synchronisation."""
    if topk_idx.dtype != torch.int64:
        return topk_idx
    valid = (topk_idx >= -1) & (topk_idx < num_experts)
    return torch.where(valid, topk_idx, num_experts).to(torch.int32)


def moe_forward(layer, x, topk_idx, topk_weights):
    """torch.ops.megamoe.moe_forward on `layer` (registered on first use; see the module
    docstring about torch.compile). Returns y bf16 [T, H]."""
    return torch.ops.megamoe.moe_forward(x, topk_idx, topk_weights, register_layer(layer))


class MoEModule(torch.nn.Module):
    """An nn.Module around a MoELayer: forward(x, topk_idx, topk_weights) -> y bf16 [T, H] through
    torch.ops.megamoe.moe_forward, so that a model holding it compiles with fullgraph=True and
    can be captured in a CUDA graph. The module keeps the layer (and so its registration) alive;
    the layer's weights stay in megamoe's memory, not in the module's parameters or buffers."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.handle = register_layer(layer)

    def forward(self, x, topk_idx, topk_weights):
        return torch.ops.megamoe.moe_forward(x, topk_idx, topk_weights, self.handle)

    def extra_repr(self):
        return f"handle={self.handle}, layer={self.layer!r}"


@torch.library.custom_op("megamoe::moe_forward", mutates_args=())
def _moe_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 layer: int) -> torch.Tensor:
    moe = lookup_layer(layer)
    idx = ids_as_int32(topk_idx, moe.config.shape.num_experts)
    # NOTES: compiled graphs may hand over inputs with other strides than eager; contiguous() is
    # free when they already are, and the layer needs row-major arrays.
    return moe.forward(x.contiguous(), idx.contiguous(), topk_weights.contiguous())


@_moe_forward.register_fake
def _moe_forward_fake(x, topk_idx, topk_weights, layer):
    return x.new_empty((x.shape[0], x.shape[1]), dtype=torch.bfloat16)
