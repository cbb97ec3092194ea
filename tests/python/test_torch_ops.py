"""torch.ops.megamoe.moe_forward on the CPU backend: the op, its fake implementation, and
torch.compile(fullgraph=True) giving the eager bits. Skipped where torch is missing.

The GPU side (sm90: eager == compiled == CUDA-graph replay, virtual EP ranks on their own
streams) is tests/python/test_torch_gpu.py.
"""

import gc

import numpy as np
import pytest

import megamoe
from conftest import make_inputs, routed_block, tiny_config

torch = pytest.importorskip("torch", reason="megamoe.torch_ops needs torch")
ops = pytest.importorskip("megamoe.torch_ops")

SEED = 3


def _layer(activation="situ", capacity=64):
    cfg = tiny_config(activation, max_tokens=capacity)
    return cfg, megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="cpu")


def _torch_inputs(cfg, t, seed):
    x, idx, w = make_inputs(cfg, t, seed)
    return (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), torch.from_numpy(idx),
            torch.from_numpy(w))


def _bits(y):
    return y.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


def test_op_equals_layer_forward():
    cfg, layer = _layer()
    handle = ops.register_layer(layer)
    assert ops.register_layer(layer) == handle and ops.lookup_layer(handle) is layer
    x, idx, w = _torch_inputs(cfg, 17, 1)
    want = _bits(layer.forward(x, idx, w))
    y = torch.ops.megamoe.moe_forward(x, idx, w, handle)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (17, cfg.shape.hidden)
    np.testing.assert_array_equal(_bits(y), want)
    # int64 ids (torch.topk's dtype), the helper and the module give the same
    np.testing.assert_array_equal(_bits(torch.ops.megamoe.moe_forward(x, idx.long(), w, handle)),
                                  want)
    np.testing.assert_array_equal(_bits(ops.moe_forward(layer, x, idx, w)), want)
    module = ops.MoEModule(layer)
    assert module.handle == handle and "handle=" in repr(module)
    np.testing.assert_array_equal(_bits(module(x, idx.long(), w)), want)
    # non-contiguous inputs are made contiguous
    xt = torch.cat([x, x], dim=1)[:, ::2]
    assert not xt.is_contiguous()
    np.testing.assert_array_equal(_bits(module(xt, idx, w)), _bits(layer.forward(xt.contiguous(),
                                                                                 idx, w)))


def test_int64_ids_outside_int32_are_reported_not_wrapped():
    cfg, layer = _layer()
    x, idx, w = _torch_inputs(cfg, 4, 2)
    big = idx.long()
    big[2, 1] = 2 ** 32 + 1  # would wrap to expert 1
    with pytest.raises(megamoe.OutOfRangeError, match=r"topk_idx\[2, 1\] = 8 "):
        ops.moe_forward(layer, x, big, w)
    big[2, 1] = -3
    with pytest.raises(megamoe.OutOfRangeError):
        ops.moe_forward(layer, x, big, w)


def test_opcheck():
    """torch.library.opcheck: schema, fake (meta) implementation against the real one, and AOT
    dispatch with static and dynamic shapes."""
    cfg, layer = _layer()
    handle = ops.register_layer(layer)
    x, idx, w = _torch_inputs(cfg, 9, 4)
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, (x, idx, w, handle))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg, layer = _layer()
    handle = ops.register_layer(layer)
    with FakeTensorMode():
        x = torch.empty((11, cfg.shape.hidden), dtype=torch.bfloat16)
        y = torch.ops.megamoe.moe_forward(x, torch.empty((11, 3), dtype=torch.int64),
                                          torch.empty((11, 3)), handle)
        assert tuple(y.shape) == (11, cfg.shape.hidden) and y.dtype == torch.bfloat16


def test_compile_fullgraph_equals_eager():
    cfg, layer = _layer("swiglu:clamp=7")
    block = routed_block(layer, cfg, seed=7, scale=0.1, device="cpu")
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for t, seed in ((64, 5), (13, 6), (0, 7)):
        x = _torch_inputs(cfg, max(t, 1), seed)[0][:t]
        np.testing.assert_array_equal(_bits(compiled(x)), _bits(block(x)), err_msg=f"T = {t}")


def test_handle_errors():
    cfg, layer = _layer()
    handle = ops.register_layer(layer)
    x, idx, w = _torch_inputs(cfg, 2, 8)
    with pytest.raises(megamoe.InvalidArgumentError, match="expected a megamoe.MoELayer"):
        ops.register_layer(object())
    with pytest.raises(megamoe.InvalidArgumentError, match="no megamoe layer.*handle 999999"):
        torch.ops.megamoe.moe_forward(x, idx, w, 999999)
    del layer
    gc.collect()
    with pytest.raises(megamoe.InvalidArgumentError, match=f"handle {handle}.*released"):
        torch.ops.megamoe.moe_forward(x, idx, w, handle)
    # the layer's own checks come through the op
    cfg, layer = _layer()
    with pytest.raises(megamoe.DTypeError):
        ops.moe_forward(layer, x.float(), idx, w)
    with pytest.raises(megamoe.OutOfRangeError):
        ops.moe_forward(layer, torch.cat([x] * 40), torch.cat([idx] * 40), torch.cat([w] * 40))
