"""Bad inputs to the Python package (docs/reliability.md, rows P*).

Each test asserts the specific exception class (a megamoe.Error subclass that is also the builtin
ValueError/TypeError/RuntimeError), a message fragment, and that nothing was written outside the
output: outputs are slices of a larger array whose guard rows must keep their poison, and a
rejected call leaves the whole output untouched.

Runs on the CPU (numpy) in CI; the device-mismatch tests run where torch and an sm_90 GPU exist.
"""

import math

import numpy as np
import pytest

import megamoe as mm

H, I, E, K = 128, 64, 8, 4
T = 6
CAPACITY = 16
POISON = 0x5B5B  # a finite BF16, never produced by a zero-slot row
GUARD = 0xA5A5


def tiny_config(activation="swiglu", capacity=CAPACITY):
    return mm.LayerConfig(mm.LayerShape(H, I, E, K), activation=activation,
                          max_tokens_per_rank=capacity)


def tiny_layer(activation="swiglu", backend="cpu"):
    cfg = tiny_config(activation)
    return mm.MoELayer(cfg, mm.synthetic_weights(cfg, 7), backend=backend)


def inputs(t=T, seed=3):
    rng = np.random.default_rng(seed)
    x = mm.bf16_from_f32(rng.standard_normal((t, H), dtype=np.float32))
    idx = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32).reshape(t, K)
    w = rng.uniform(0.1, 1.0, (t, K)).astype(np.float32)
    return x, idx, w


class GuardedOut:
    """y = rows [1, 1 + t) of a [t + 2, H] uint16 array; rows 0 and t + 1 are guards."""

    def __init__(self, t=T):
        self.t = t
        self.full = np.full((t + 2, H), POISON, np.uint16)
        self.full[0] = GUARD
        self.full[-1] = GUARD

    @property
    def y(self):
        return self.full[1:1 + self.t]

    def guards_intact(self):
        return bool((self.full[0] == GUARD).all() and (self.full[-1] == GUARD).all())

    def untouched(self):
        return self.guards_intact() and bool((self.y == POISON).all())


def expect_rejected(fn, exc, fragment, out=None):
    with pytest.raises(exc) as info:
        fn()
    assert isinstance(info.value, mm.Error), type(info.value)
    assert fragment in str(info.value), str(info.value)
    if out is not None:
        assert out.untouched(), "a rejected call wrote into (or around) the output"


# ------------------------------------------------------------------------------------------------
# P1-P11: arrays given to MoELayer.forward
# ------------------------------------------------------------------------------------------------
def test_forward_accepts_good_arrays_and_writes_only_y():
    layer = tiny_layer()
    x, idx, w = inputs()
    out = GuardedOut()
    y = layer.forward(x, idx, w, out=out.y)
    assert y is out.y or np.shares_memory(y, out.full)
    assert out.guards_intact()
    assert not (out.y == POISON).all()
    np.testing.assert_array_equal(layer.forward(x, idx, w), out.y)


@pytest.mark.parametrize("case", [
    "x_float32", "idx_int64", "idx_float32", "w_float64", "w_bf16", "out_float32",
])
def test_forward_rejects_wrong_dtypes(case):
    layer = tiny_layer()
    x, idx, w = inputs()
    out = GuardedOut()
    args = {"x": x, "topk_idx": idx, "topk_weights": w}
    fragment = {
        "x_float32": "x: expected dtype bfloat16 (or uint16 raw BF16 bits), got float32",
        "idx_int64": "topk_idx: unsupported dtype int64",
        "idx_float32": "topk_idx: expected dtype int32, got float32",
        "w_float64": "topk_weights: expected dtype float32, got float64",
        "w_bf16": "topk_weights: expected dtype float32, got bfloat16",
        "out_float32": "y: expected dtype bfloat16 (or uint16 raw BF16 bits), got float32",
    }[case]
    if case == "x_float32":
        args["x"] = mm.bf16_to_f32(x)
    elif case == "idx_int64":
        args["topk_idx"] = idx.astype(np.int64)
    elif case == "idx_float32":
        args["topk_idx"] = idx.astype(np.float32)
    elif case == "w_float64":
        args["topk_weights"] = w.astype(np.float64)
    elif case == "w_bf16":
        args["topk_weights"] = mm.bf16_from_f32(w)
    if case == "out_float32":
        bad_out = np.full((T, H), 7.0, np.float32)
        expect_rejected(lambda: layer.forward(x, idx, w, out=bad_out), mm.DTypeError, fragment)
        assert (bad_out == 7.0).all()
        return
    expect_rejected(lambda: layer.forward(out=out.y, **args), mm.DTypeError, fragment, out)
    assert issubclass(mm.DTypeError, TypeError)


@pytest.mark.parametrize("case,fragment", [
    ("x_width", "x: expected shape [*, 128], got [6, 64]"),
    ("x_3d", "x: expected shape [*, 128], got [1, 6, 128]"),
    ("x_1d", "x: expected shape [*, 128], got [768]"),
    ("idx_tokens", "topk_idx: expected shape [6, 4], got [5, 4]"),
    ("idx_k", "topk_idx: expected shape [6, 4], got [6, 3]"),
    ("w_tokens", "topk_weights: expected shape [6, 4], got [7, 4]"),
    ("out_short", "y: expected shape [6, 128], got [5, 128]"),
])
def test_forward_rejects_wrong_shapes(case, fragment):
    layer = tiny_layer()
    x, idx, w = inputs()
    out = GuardedOut()
    y = out.y
    if case == "x_width":
        x = np.ascontiguousarray(x[:, :64])
    elif case == "x_3d":
        x = x[None]
    elif case == "x_1d":
        x = x.reshape(-1)
    elif case == "idx_tokens":
        idx = np.ascontiguousarray(idx[:5])
    elif case == "idx_k":
        idx = np.ascontiguousarray(idx[:, :3])
    elif case == "w_tokens":
        w = np.concatenate([w, w[:1]])
    elif case == "out_short":
        y = out.full[1:T]
    expect_rejected(lambda: layer.forward(x, idx, w, out=y), mm.InvalidArgumentError, fragment, out)
    assert issubclass(mm.InvalidArgumentError, ValueError)


def test_forward_rejects_non_contiguous_arrays():
    layer = tiny_layer()
    x, idx, w = inputs()
    out = GuardedOut()
    wide = np.zeros((T, 2 * H), np.uint16)
    wide[:, ::2] = x
    expect_rejected(lambda: layer.forward(wide[:, ::2], idx, w, out=out.y),
                    mm.InvalidArgumentError,
                    "x: expected a contiguous (row-major) tensor, got strides [256, 2]", out)
    expect_rejected(lambda: layer.forward(np.asfortranarray(x), idx, w, out=out.y),
                    mm.InvalidArgumentError,
                    "x: expected a contiguous (row-major) tensor, got strides [1, 6]", out)
    expect_rejected(lambda: layer.forward(x, np.asfortranarray(idx), w, out=out.y),
                    mm.InvalidArgumentError, "topk_idx: expected a contiguous", out)
    # A non-contiguous output: every other row of a bigger array. Nothing may be written.
    big = np.full((2 * T, H), POISON, np.uint16)
    expect_rejected(lambda: layer.forward(x, idx, w, out=big[::2]), mm.InvalidArgumentError,
                    "y: expected a contiguous (row-major) tensor")
    assert (big == POISON).all()
    # Broadcast weights (stride 0) are not silently read.
    wb = np.broadcast_to(w[:1], (T, K))
    expect_rejected(lambda: layer.forward(x, idx, wb, out=out.y), mm.InvalidArgumentError,
                    "topk_weights: expected a contiguous (row-major) tensor, got strides [0, 1]",
                    out)


@pytest.mark.parametrize("bad", [E, E + 1, 2**31 - 1, -2, -(2**31)])
def test_expert_ids_out_of_range(bad):
    layer = tiny_layer()
    x, idx, w = inputs()
    idx[4, 2] = bad
    out = GuardedOut()
    expect_rejected(lambda: layer.forward(x, idx, w, out=out.y), mm.OutOfRangeError,
                    f"topk_idx[4, 2] = {bad} is not an expert id in [0, 8)", out)
    assert issubclass(mm.OutOfRangeError, ValueError)


def test_capacity_overflow_and_zero_tokens():
    layer = tiny_layer()
    x, idx, w = inputs(CAPACITY + 1)
    out = GuardedOut(CAPACITY + 1)
    expect_rejected(lambda: layer.forward(x, idx, w, out=out.y), mm.OutOfRangeError,
                    "num_tokens 17 exceeds the layer capacity max_tokens_per_rank = 16", out)
    # T == capacity works; T = 0 (empty numpy arrays, whatever strides numpy gives them) too.
    x, idx, w = inputs(CAPACITY)
    assert layer.forward(x, idx, w).shape == (CAPACITY, H)
    y0 = layer.forward(np.zeros((0, H), np.uint16), np.zeros((0, K), np.int32),
                       np.zeros((0, K), np.float32))
    assert y0.shape == (0, H)


def test_non_finite_inputs_stay_in_their_token():
    layer = tiny_layer("situ")
    x, idx, w = inputs()
    clean = layer.forward(x, idx, w)
    nan_x = x.copy()
    nan_x[1, 37] = 0x7FC0  # BF16 NaN
    inf_w = w.copy()
    inf_w[4, 1] = np.inf
    for xs, ws, token in ((nan_x, w, 1), (x, inf_w, 4)):
        out = GuardedOut()
        y = layer.forward(xs, idx, ws, out=out.y)
        assert out.guards_intact()
        f = mm.bf16_to_f32(y)
        assert not np.isfinite(f[token]).any()
        others = [t for t in range(T) if t != token]
        np.testing.assert_array_equal(y[others], clean[others])
    # A token whose slots are all empty gives zeros, whatever its (ignored) weights are.
    idx2, w2 = idx.copy(), w.copy()
    idx2[2] = -1
    w2[2] = np.nan
    y = layer.forward(x, idx2, w2)
    assert (y[2] == 0).all()


# ------------------------------------------------------------------------------------------------
# P12-P20: construction, weights, configuration
# ------------------------------------------------------------------------------------------------
def test_backend_names():
    cfg = tiny_config()
    weights = mm.synthetic_weights(cfg, 7)
    expect_rejected(lambda: mm.MoELayer(cfg, weights, backend="tpu"), mm.InvalidArgumentError,
                    "backend: 'tpu' is unknown")
    assert not weights.consumed  # a rejected construction leaves the weights usable
    if "sm90" not in mm.available_backends():
        expect_rejected(lambda: mm.MoELayer(cfg, weights, backend="sm90"), mm.UnsupportedError,
                        "backend: 'sm90' is not available in this build or on this machine")
        assert issubclass(mm.UnsupportedError, RuntimeError)
        assert not weights.consumed
    layer = mm.MoELayer(cfg, weights, backend="cpu")
    assert weights.consumed
    # The consumed weights cannot be used again.
    expect_rejected(lambda: mm.MoELayer(cfg, weights, backend="cpu"), mm.InvalidArgumentError,
                    "these weights were moved into a MoELayer")
    assert layer.backend == "cpu"


def test_weights_for_another_config():
    cfg = tiny_config()
    other = mm.LayerConfig(mm.LayerShape(H, 2 * I, E, K))
    weights = mm.synthetic_weights(other, 7)
    expect_rejected(lambda: mm.MoELayer(cfg, weights, backend="cpu"), mm.InvalidArgumentError,
                    "weights: intermediate 128 does not match the config's I=64")
    assert not weights.consumed
    rank1 = mm.LayerConfig(mm.LayerShape(H, I, E, K), ep_size=2, ep_rank=1)
    rank0 = mm.LayerConfig(mm.LayerShape(H, I, E, K), ep_size=2, ep_rank=0)
    expect_rejected(lambda: mm.MoELayer(rank0, mm.synthetic_weights(rank1, 7), backend="cpu"),
                    mm.InvalidArgumentError, "weights: first_expert 4 does not match")


def test_weights_from_bad_arrays():
    el = 2
    w13 = np.zeros((el, 2 * I, H // 2), np.uint8)
    w13_sf = np.full((el, 2 * I, H // 32), 127, np.uint8)
    w2 = np.zeros((el, H, I // 2), np.uint8)
    w2_sf = np.full((el, H, I // 32), 127, np.uint8)
    ok = mm.MoeWeights.from_arrays(w13, w13_sf, w2, w2_sf)
    assert ok.num_local_experts == el
    with pytest.raises(mm.Error) as info:
        mm.MoeWeights.from_arrays(w13, w13_sf[:, :, :-1].copy(), w2, w2_sf)
    assert isinstance(info.value, (ValueError, TypeError))
    assert "w13_sf" in str(info.value), str(info.value)
    with pytest.raises(mm.DTypeError):
        mm.MoeWeights.from_arrays(w13.astype(np.int32), w13_sf, w2, w2_sf)


@pytest.mark.parametrize("spec,fragment", [
    ("gelu", "unknown name 'gelu'"),
    ("situ:clamp=7", "situ takes no clamp"),
    ("situ:beta=0", "beta must be finite and > 0, got 0"),
    ("situ:linear_beta=nan", "linear_beta must be finite and > 0, got nan"),
    ("swiglu:clamp=-1", "clamp must be finite and >= 0, got -1"),
    ("swiglu:clamp=inf", "clamp must be finite and >= 0, got inf"),
    ("swiglu:limit=1,clamp=2", "parameter 'clamp' given twice"),
    ("situ:beta=four", "parameter 'beta' expected a number, got 'four'"),
])
def test_activation_specs(spec, fragment):
    expect_rejected(lambda: mm.Activation.parse(spec), mm.InvalidArgumentError, fragment)
    # The same spec given to a LayerConfig is rejected the same way.
    expect_rejected(lambda: tiny_config(activation=spec), mm.InvalidArgumentError, fragment)
    expect_rejected(lambda: mm.Activation.situ(beta=-1.0), mm.InvalidArgumentError,
                    "beta must be finite and > 0, got -1")
    expect_rejected(lambda: mm.Activation.swiglu_clamped(math.nan), mm.InvalidArgumentError,
                    "clamp must be finite and >= 0, got nan")


@pytest.mark.parametrize("make,fragment", [
    (lambda: mm.LayerShape(100, I, E, K), "hidden (H) must be a positive multiple of 32, got 100"),
    (lambda: mm.LayerShape(H, 48, E, K), "intermediate (I) must be a positive multiple of 32, got 48"),
    (lambda: mm.LayerShape(H, I, 0, K), "num_experts (E) must be > 0, got 0"),
    (lambda: mm.LayerShape(H, I, E, 9), "top_k (K) must be in [1, E=8], got 9"),
    (lambda: mm.LayerConfig("kimi-k2"), "shape: unknown preset 'kimi-k2'"),
    (lambda: mm.LayerConfig(mm.LayerShape(H, I, E, K), ep_size=3), "ep_size 3 must divide num_experts 8"),
    (lambda: mm.LayerConfig(mm.LayerShape(H, I, E, K), ep_size=2, ep_rank=2), "ep_rank must be in [0, ep_size=2), got 2"),
    (lambda: mm.LayerConfig(mm.LayerShape(H, I, E, K), max_tokens_per_rank=-1), "max_tokens_per_rank must be >= 0, got -1"),
])
def test_config_values(make, fragment):
    expect_rejected(make, mm.InvalidArgumentError, fragment)


def test_fields_edited_after_construction_are_checked_by_the_layer():
    cfg = tiny_config()
    cfg.shape = mm.LayerShape(H, I, E, K)
    cfg.ep_size = 3  # the field is writable; the layer validates the whole config again
    expect_rejected(lambda: mm.MoELayer(cfg, mm.synthetic_weights(tiny_config(), 7), backend="cpu"),
                    mm.InvalidArgumentError, "ep_size 3 must divide num_experts 8")


def test_wrong_python_types():
    layer = tiny_layer()
    x, idx, w = inputs()
    with pytest.raises(TypeError):
        mm.LayerConfig(5)
    with pytest.raises(TypeError):
        mm.MoELayer(tiny_config(), "weights.safetensors", backend="cpu")
    with pytest.raises(TypeError):
        layer.forward(x, idx, w, out="y")


def test_plain_lists_raise_type_error():
    layer = tiny_layer()
    x, idx, w = inputs()
    expect_rejected(lambda: layer.forward(x.tolist(), idx, w), mm.DTypeError,
                    "x: expected an array (numpy.ndarray, torch.Tensor or another DLPack array), "
                    "got list")
    assert issubclass(mm.DTypeError, TypeError)


def test_quantizer_inputs():
    expect_rejected(lambda: mm.quantize_input(np.zeros((2, 40), np.uint16)),
                    mm.InvalidArgumentError, "multiple of 32")
    bad = np.ones((2, 64), np.float32)
    bad[1, 40] = np.inf
    expect_rejected(lambda: mm.quantize_mxfp4(bad), mm.InvalidArgumentError,
                    "quantize_mxfp4: weight [1, 40] is not finite (inf)")


# ------------------------------------------------------------------------------------------------
# P21-P22: devices (only where torch and an sm_90 GPU are present: the GPU machine)
# ------------------------------------------------------------------------------------------------
def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@pytest.mark.skipif(_torch_cuda() is None or "sm90" not in mm.available_backends(),
                    reason="needs torch with CUDA and the sm90 backend (the GPU machine)")
def test_device_mismatch_both_ways():
    torch = _torch_cuda()
    x, idx, w = inputs()
    gpu = tiny_layer(backend="sm90")
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    ti, tw = torch.from_numpy(idx), torch.from_numpy(w)
    # Host arrays to a GPU layer.
    expect_rejected(lambda: gpu.forward(tx, ti.cuda(), tw.cuda()), mm.InvalidArgumentError,
                    "x: expected a tensor on cuda:0, got one on cpu")
    expect_rejected(lambda: gpu.forward(x, idx, w), mm.InvalidArgumentError,
                    "expected a tensor on cuda:0, got one on cpu")
    y = torch.full((T, H), 1.0, dtype=torch.bfloat16, device="cuda")
    expect_rejected(lambda: gpu.forward(tx.cuda(), ti.cuda(), tw, out=y), mm.InvalidArgumentError,
                    "topk_weights: expected a tensor on cuda:0, got one on cpu")
    assert (y == 1.0).all().item()
    # Device tensors to a CPU layer.
    cpu = tiny_layer(backend="cpu")
    expect_rejected(lambda: cpu.forward(tx.cuda(), ti.cuda(), tw.cuda()), mm.InvalidArgumentError,
                    "x: expected a tensor on cpu, got one on cuda:0")
