"""How arrays cross into megamoe._megamoe, and how outputs are made in the caller's framework.

Rules (README "Python"):

* numpy arrays and torch tensors cross without a copy through DLPack (nanobind ``nb::ndarray``).
* BF16: numpy has no bfloat16. A numpy ``uint16`` array is taken as raw BF16 bits (the upper half
  of an FP32); ``ml_dtypes.bfloat16`` arrays are viewed as ``uint16`` (no copy); torch tensors use
  ``torch.bfloat16``. A BF16 output follows the representation of the BF16 input it came with, and
  is ``uint16`` (numpy) or ``torch.bfloat16`` (torch) when there is none.
* torch CUDA tensors are exported with ``__dlpack__(stream=-1)`` for stream-ordered calls (no
  synchronisation on the legacy default stream: that would break CUDA-graph capture); the call
  itself is enqueued on the stream given, by default torch's current stream for the tensor's device.
* Nothing is converted: a wrong dtype, device, shape or layout raises the documented error.
"""

import contextlib
import sys

# megamoe dtype names (as the C++ side spells them) -> numpy / torch dtype names.
_NUMPY_DTYPES = {"uint8": "uint8", "int32": "int32", "float32": "float32", "float64": "float64",
                 "bfloat16": "uint16"}
_TORCH_DTYPES = {"uint8": "uint8", "int32": "int32", "float32": "float32", "float64": "float64",
                 "bfloat16": "bfloat16"}

# DLPack's "do not synchronise" stream value (array API standard, 2023.12).
_DLPACK_NO_SYNC = -1


def _torch():
    return sys.modules.get("torch")


def is_torch(a):
    torch = _torch()
    return torch is not None and isinstance(a, torch.Tensor)


def is_numpy(a):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(a, np.ndarray)


def is_ml_bfloat16(a):
    return is_numpy(a) and a.dtype.name == "bfloat16"


def check_array(a, arg):
    """Raises megamoe.DTypeError (a TypeError) naming `arg` unless `a` is an array: something
    with a shape that speaks DLPack or the buffer protocol (numpy, torch, ...)."""
    if hasattr(a, "shape") and (hasattr(a, "__dlpack__") or hasattr(a, "__array_interface__")):
        return
    from ._megamoe import DTypeError

    raise DTypeError(f"{arg}: expected an array (numpy.ndarray, torch.Tensor or another DLPack "
                     f"array), got {type(a).__name__}")


def host_input(a, arg="array"):
    """An array for a host (CPU) function: torch tensors are detached; ml_dtypes BF16 is viewed
    as uint16 bits. No copy."""
    check_array(a, arg)
    if is_torch(a):
        return a.detach() if a.requires_grad else a
    if is_ml_bfloat16(a):
        import numpy as np

        return a.view(np.uint16)
    return a


def stream_input(a, arg="array"):
    """An array for a stream-ordered (device) call: like host_input, and a torch CUDA tensor
    becomes a DLPack capsule exported without stream synchronisation (capture safe)."""
    a = host_input(a, arg)
    if is_torch(a) and a.is_cuda:
        return a.__dlpack__(stream=_DLPACK_NO_SYNC)
    return a


def empty(like, shape, dtype, bf16_like=None):
    """An uninitialised array of megamoe dtype `dtype` and `shape` in the framework and on the
    device of `like`. BF16 follows the representation of `bf16_like` (or `like`) when it is an
    ml_dtypes array."""
    shape = tuple(int(s) for s in shape)
    if is_torch(like):
        torch = _torch()
        return torch.empty(shape, dtype=getattr(torch, _TORCH_DTYPES[dtype]), device=like.device)
    import numpy as np

    if dtype == "bfloat16":
        for ref in (bf16_like, like):
            if ref is not None and is_ml_bfloat16(ref):
                return np.empty(shape, dtype=ref.dtype)
    return np.empty(shape, dtype=_NUMPY_DTYPES[dtype])


def output(out, like, shape, dtype, bf16_like=None):
    """`out` when given (checked by the C++ side), else a new array as empty() makes it."""
    if out is not None:
        return out
    return empty(like, shape, dtype, bf16_like)


def cuda_stream(stream, *arrays):
    """The cudaStream_t (an int) a call runs on: `stream` when given (an int handle or an object
    with .cuda_stream such as torch.cuda.Stream), else torch's current stream of the first CUDA
    tensor among `arrays`, else 0 (the legacy default stream; CPU calls ignore it)."""
    if stream is not None:
        return int(getattr(stream, "cuda_stream", stream))
    for a in arrays:
        if is_torch(a) and a.is_cuda:
            return _torch().cuda.current_stream(a.device).cuda_stream
    return 0


def cuda_device_of(a):
    """A context that makes a's CUDA device current for the call when it is not already (the
    kernels launch on the current device); a no-op otherwise."""
    if is_torch(a) and a.is_cuda:
        torch = _torch()
        if torch.cuda.current_device() != a.device.index:
            return torch.cuda.device(a.device)
    return contextlib.nullcontext()


def shape_of(a):
    return tuple(int(s) for s in a.shape)
