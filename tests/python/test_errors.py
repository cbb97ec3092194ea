"""Bad input raises the documented exception with a message naming the argument; never a crash.

    megamoe.InvalidArgumentError  ValueError    shape, device, stride, value, option
    megamoe.DTypeError            TypeError     wrong dtype
    megamoe.OutOfRangeError       ValueError    expert id, token count
    megamoe.FormatError           ValueError    malformed file
    megamoe.IoError               OSError       unreadable file
    megamoe.UnsupportedError      RuntimeError  not possible in this build / on this machine
    megamoe.TimeoutError          TimeoutError  a rank of an EP group did not arrive in time
"""

import numpy as np
import pytest

import megamoe
from conftest import make_inputs, tiny_config

EXPECTED_BASES = {
    "InvalidArgumentError": ValueError,
    "DTypeError": TypeError,
    "OutOfRangeError": ValueError,
    "FormatError": ValueError,
    "IoError": OSError,
    "UnsupportedError": RuntimeError,
    "CudaError": RuntimeError,
    "InternalError": RuntimeError,
    "TimeoutError": TimeoutError,
}


@pytest.mark.parametrize("name,builtin", sorted(EXPECTED_BASES.items()))
def test_exception_hierarchy(name, builtin):
    cls = getattr(megamoe, name)
    assert issubclass(cls, megamoe.Error) and issubclass(cls, builtin)
    assert cls.__module__ == "megamoe" and isinstance(cls.code, str)


@pytest.fixture
def layer_and_inputs():
    cfg = tiny_config()
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), "cpu")
    return layer, make_inputs(cfg, 6, seed=1)


@pytest.mark.parametrize("arg,bad,expected", [
    ("x", lambda x, i, w: (x.view(np.int16), i, w), "x: unsupported dtype int16"),
    ("x", lambda x, i, w: (x.astype(np.float32), i, w), "x: expected dtype bfloat16"),
    ("topk_idx", lambda x, i, w: (x, i.astype(np.int64), w), "topk_idx: unsupported dtype int64"),
    ("topk_idx", lambda x, i, w: (x, i.astype(np.uint8), w), "topk_idx: expected dtype int32"),
    ("topk_weights", lambda x, i, w: (x, i, w.astype(np.float64)),
     "topk_weights: expected dtype float32"),
    ("topk_weights", lambda x, i, w: (x, i, w.astype(np.float16)),
     "topk_weights: unsupported dtype float16"),
    ("topk_weights", lambda x, i, w: (x, i, w.astype(np.complex64)), "unsupported dtype complex64"),
    ("topk_idx", lambda x, i, w: (x, i.astype(bool), w), "unsupported dtype bool"),
])
def test_forward_dtype_errors_are_type_errors(layer_and_inputs, arg, bad, expected):
    layer, inputs = layer_and_inputs
    with pytest.raises(megamoe.DTypeError, match=expected) as info:
        layer.forward(*bad(*inputs))
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("bad,expected", [
    (lambda x, i, w: (x[:, :64].copy(), i, w), r"x: expected shape \[\*, 128\]"),
    (lambda x, i, w: (x, i[:, :2].copy(), w), r"topk_idx: expected shape \[6, 3\]"),
    (lambda x, i, w: (x, i, w[:5].copy()), r"topk_weights: expected shape \[6, 3\]"),
    (lambda x, i, w: (x.reshape(2, 3, 128), i, w), "x: expected shape"),
    (lambda x, i, w: (x[:, ::2], i, w), "x: expected"),
    (lambda x, i, w: (np.asfortranarray(x), i, w), "x: expected a contiguous"),
    (lambda x, i, w: (x, np.asfortranarray(i), w), "topk_idx: expected a contiguous"),
])
def test_forward_shape_and_layout_errors_are_value_errors(layer_and_inputs, bad, expected):
    layer, inputs = layer_and_inputs
    with pytest.raises(megamoe.InvalidArgumentError, match=expected) as info:
        layer.forward(*bad(*inputs))
    assert isinstance(info.value, ValueError)


def test_wrong_out_shape(layer_and_inputs):
    layer, (x, idx, w) = layer_and_inputs
    with pytest.raises(ValueError, match="y: expected shape"):
        layer.forward(x, idx, w, out=np.empty((5, 128), np.uint16))
    with pytest.raises(TypeError, match="y: expected dtype bfloat16"):
        layer.forward(x, idx, w, out=np.empty((6, 128), np.float32))


def test_read_only_out_is_rejected(layer_and_inputs):
    layer, (x, idx, w) = layer_and_inputs
    out = np.empty((6, 128), np.uint16)
    out.setflags(write=False)
    with pytest.raises(TypeError):
        layer.forward(x, idx, w, out=out)


def test_non_arrays_are_type_errors(layer_and_inputs):
    layer, (x, idx, w) = layer_and_inputs
    with pytest.raises(TypeError):
        layer.forward(x.tolist(), idx, w)
    with pytest.raises(TypeError):
        megamoe.e4m3_from_f32([1.0, 2.0])


def test_too_many_dims():
    with pytest.raises(megamoe.InvalidArgumentError, match="at most 4 dims"):
        megamoe.e4m3_from_f32(np.zeros((1, 1, 1, 1, 2), np.float32))


def test_format_function_errors():
    with pytest.raises(megamoe.DTypeError, match="v: expected dtype float32"):
        megamoe.requantize(np.zeros((2, 32), np.float64))
    with pytest.raises(megamoe.InvalidArgumentError, match="multiple of 32"):
        megamoe.quantize_input(np.zeros((2, 48), np.uint16))
    with pytest.raises(megamoe.InvalidArgumentError, match="at least 1 dim"):
        megamoe.quantize_input(np.zeros((), np.uint16))
    with pytest.raises(megamoe.InvalidArgumentError, match=r"sf: expected shape \[2, 1\]"):
        megamoe.dequantize_fp8(np.zeros((2, 32), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(megamoe.InvalidArgumentError, match=r"dst: expected shape \[3\]"):
        megamoe.e4m3_to_f32(np.zeros(3, np.uint8), out=np.zeros(4, np.float32))


def test_reference_rejects_bad_routing():
    cfg = tiny_config()
    weights = megamoe.synthetic_weights(cfg, 1)
    x, idx, w = make_inputs(cfg, 4, seed=2, empty_slots=False)
    idx[2, 0] = cfg.shape.num_experts
    with pytest.raises(megamoe.OutOfRangeError):
        megamoe.reference_forward(cfg, weights, x, idx, w)
    with pytest.raises(TypeError):
        megamoe.reference_forward(cfg, weights, x, idx.astype(np.int64), w)


def test_torch_cpu_errors():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    cfg = tiny_config()
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), "cpu")
    x, idx, w = make_inputs(cfg, 4, seed=2)
    xt = torch.from_numpy(megamoe.bf16_to_f32(x)).to(torch.bfloat16)
    it, wt = torch.from_numpy(idx), torch.from_numpy(w)
    y = layer.forward(xt, it, wt)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    np.testing.assert_array_equal(y.view(torch.int16).numpy().view(np.uint16),
                                  layer.forward(x, idx, w))
    with pytest.raises(megamoe.DTypeError, match="topk_idx: unsupported dtype int64"):
        layer.forward(xt, it.long(), wt)
    with pytest.raises(megamoe.DTypeError, match="x: unsupported dtype float16"):
        layer.forward(xt.half(), it, wt)
    with pytest.raises(megamoe.InvalidArgumentError, match="x: expected a contiguous"):
        layer.forward(xt.t().contiguous().t(), it, wt)
    # Tensors that require grad are read through a detached view (no copy).
    y2 = layer.forward(xt.float().requires_grad_().bfloat16(), it, wt)
    assert torch.equal(y2.view(torch.int16), y.view(torch.int16))
