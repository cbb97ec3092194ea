"""Routing helpers, synthetic workloads, checkpoints and weight preparation from Python."""

import numpy as np
import pytest

import megamoe
from conftest import make_inputs, tiny_config


# ------------------------------------------------------------------------------------------------
# Router and synthetic workloads
# ------------------------------------------------------------------------------------------------
def _np_router(logits, bias, top_k, scale):
    """numerics.md section 7 in FP64: top-k of sigmoid(logits) + bias, ties to the lower id."""
    s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    choice = s + (0.0 if bias is None else bias.astype(np.float64))
    order = np.lexsort((np.broadcast_to(np.arange(logits.shape[1]), logits.shape), -choice),
                       axis=1)[:, :top_k]
    picked = np.take_along_axis(s, order, axis=1)
    return order.astype(np.int32), picked / picked.sum(1, keepdims=True) * scale


def test_route_sigmoid_topk_matches_model(rng):
    logits = rng.standard_normal((33, 16)).astype(np.float32)
    bias = (rng.standard_normal(16) * 0.1).astype(np.float32)
    idx, w = megamoe.route_sigmoid_topk(logits, 4, correction_bias=bias, routed_scaling_factor=2.5)
    assert idx.dtype == np.int32 and w.dtype == np.float32 and idx.shape == w.shape == (33, 4)
    idx_ref, w_ref = _np_router(logits, bias, 4, 2.5)
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_allclose(w, w_ref, rtol=2e-6)


def test_router_ties_pick_the_lower_expert_id():
    logits = np.zeros((2, 6), np.float32)
    idx, w = megamoe.route_sigmoid_topk(logits, 3)
    np.testing.assert_array_equal(idx, [[0, 1, 2], [0, 1, 2]])
    np.testing.assert_allclose(w, 1.0 / 3, rtol=1e-6)


def test_router_rejects_bad_input():
    bad = np.zeros((2, 6), np.float32)
    bad[1, 4] = np.nan
    with pytest.raises(megamoe.InvalidArgumentError):
        megamoe.route_sigmoid_topk(bad, 2)
    with pytest.raises(megamoe.DTypeError, match="logits: expected dtype float32"):
        megamoe.route_sigmoid_topk(np.zeros((2, 6), np.float64), 2)
    with pytest.raises(megamoe.InvalidArgumentError, match=r"correction_bias: expected shape \[6\]"):
        megamoe.route_sigmoid_topk(np.zeros((2, 6), np.float32), 2,
                                   correction_bias=np.zeros(5, np.float32))


def test_router_output_feeds_the_layer(rng):
    cfg = tiny_config("situ")
    x, _, _ = make_inputs(cfg, 10, seed=3)
    idx, w = megamoe.route_sigmoid_topk(rng.standard_normal((10, 8)).astype(np.float32), 3)
    y = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 3), "cpu")(x, idx, w)
    ref = megamoe.reference_forward(cfg, megamoe.synthetic_weights(cfg, 3), x, idx, w)
    np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("kind", megamoe.ROUTING_KINDS)
def test_make_routing(kind):
    idx, w = megamoe.make_routing(kind, 50, 16, 4, seed=9)
    assert idx.shape == w.shape == (50, 4) and idx.dtype == np.int32 and w.dtype == np.float32
    assert ((idx >= 0) & (idx < 16)).all()
    assert all(len(set(row)) == 4 for row in idx.tolist()), "no expert twice in a token"
    assert (w > 0).all()
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-5)
    idx2, w2 = megamoe.make_routing(kind, 50, 16, 4, seed=9)
    np.testing.assert_array_equal(idx, idx2)
    np.testing.assert_array_equal(w, w2)
    if kind == "adversarial":
        assert (idx == idx[0]).all()
    with pytest.raises(megamoe.InvalidArgumentError):
        megamoe.make_routing(kind, 5, 4, 5, seed=1)


def test_unknown_routing_kind():
    with pytest.raises(megamoe.InvalidArgumentError, match="unknown kind 'zipf'"):
        megamoe.make_routing("zipf", 5, 8, 2, seed=1)


def test_synthetic_activations_are_prefix_stable():
    a = megamoe.synthetic_activations(7, 64, seed=4)
    assert a.dtype == np.uint16 and a.shape == (7, 64)
    np.testing.assert_array_equal(megamoe.synthetic_activations(3, 64, seed=4), a[:3])
    v = megamoe.bf16_to_f32(a)
    assert np.isfinite(v).all() and 0.5 < v.std() < 2.0


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------
NAMES = ("w13", "w13_sf", "w2", "w2_sf")


def _arrays(weights, names=NAMES):
    return {n: weights.array(n) for n in names}


@pytest.mark.parametrize("convention,bias", [("kimi-k3", False), ("gpt-oss", True),
                                             ("gpt-oss", False)])
def test_checkpoint_round_trip(tmp_path, convention, bias):
    cfg = tiny_config("swiglu_oai" if bias else "situ")
    weights = megamoe.synthetic_weights(cfg, 4, with_bias=bias)
    path = tmp_path / "model.safetensors"
    megamoe.write_moe_checkpoint(path, {"model.layers.7.mlp": weights}, convention=convention)
    ckpt = megamoe.Checkpoint.open(path)
    assert ckpt.num_tensors > 0 and ckpt.total_bytes == path.stat().st_size
    (info,) = ckpt.moe_layers()
    assert (info.prefix, info.layer_index, info.convention) == ("model.layers.7.mlp", 7, convention)
    assert (info.num_experts, info.hidden, info.intermediate, info.has_bias) == (8, 128, 64, bias)
    loaded = megamoe.load_moe_layer(ckpt, 7)
    names = NAMES + (("w13_bias", "w2_bias") if bias else ())
    for n in names:
        np.testing.assert_array_equal(loaded.array(n), weights.array(n), err_msg=n)
    by_prefix = megamoe.load_moe_layer(str(path), "model.layers.7.mlp")
    np.testing.assert_array_equal(by_prefix.array("w2"), weights.array("w2"))


def test_checkpoint_expert_parallel_load(tmp_path):
    cfg = tiny_config()
    weights = megamoe.synthetic_weights(cfg, 4)
    path = tmp_path / "m.safetensors"
    megamoe.write_moe_checkpoint(path, {"layers.0.moe": weights})
    full = _arrays(weights)
    for rank in range(4):
        part = megamoe.load_moe_layer(path, 0, ep_rank=rank, ep_size=4)
        assert part.num_local_experts == 2 and part.first_expert == 2 * rank
        for n in NAMES:
            np.testing.assert_array_equal(part.array(n), full[n][2 * rank:2 * rank + 2])
    with pytest.raises(megamoe.InvalidArgumentError):
        megamoe.load_moe_layer(path, 0, ep_rank=0, ep_size=3)


def test_checkpoint_nan_scale_needs_allow_nan_scales(tmp_path):
    # A UE8M0 byte 0xFF (NaN) would make every token of expert 5 NaN: loading names it.
    arrays = _arrays(megamoe.synthetic_weights(tiny_config(), 4))
    arrays["w2_sf"][5, 3, 1] = 0xFF
    path = tmp_path / "nan.safetensors"
    megamoe.write_moe_checkpoint(path, {"layers.0.moe": megamoe.MoeWeights.from_arrays(**arrays)})
    with pytest.raises(megamoe.FormatError,
                       match=r"experts\.5\.w2\.weight_scale'.*NaN\) in expert 5, row 3, block 1"):
        megamoe.load_moe_layer(path, 0)
    megamoe.load_moe_layer(path, 0, ep_rank=0, ep_size=2)  # experts 0..3: not this rank's
    loaded = megamoe.load_moe_layer(path, 0, allow_nan_scales=True)
    np.testing.assert_array_equal(loaded.array("w2_sf"), arrays["w2_sf"])


def test_checkpoint_errors(tmp_path):
    with pytest.raises(megamoe.IoError) as info:
        megamoe.Checkpoint.open(tmp_path / "missing.safetensors")
    assert isinstance(info.value, OSError)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(megamoe.FormatError) as info:
        megamoe.Checkpoint.open(bad)
    assert isinstance(info.value, ValueError) and "bad.safetensors" in str(info.value)
    cfg = tiny_config()
    good = tmp_path / "good.safetensors"
    megamoe.write_moe_checkpoint(good, {"layers.1.moe": megamoe.synthetic_weights(cfg, 1)})
    with pytest.raises(megamoe.InvalidArgumentError, match="no MoE layer 5"):
        megamoe.load_moe_layer(good, 5)


# ------------------------------------------------------------------------------------------------
# Preparation
# ------------------------------------------------------------------------------------------------
def test_prepare_round_trip_and_idempotence():
    cfg = tiny_config()
    weights = megamoe.synthetic_weights(cfg, 6)
    canonical = {n: weights.array(n) for n in NAMES}
    assert "canonical" in megamoe.layout_names() and "blackwell-interop" in megamoe.layout_names()
    assert megamoe.layout_for_backend("cpu") == "canonical"
    r = megamoe.prepare(weights, "blackwell-interop")
    assert r["from_layout"] == "canonical" and r["to_layout"] == "blackwell-interop"
    assert not r["no_op"] and r["bytes_transformed"] > 0
    assert weights.layout == "blackwell-interop"
    assert weights.array_spec("w13_sf")[0] == [weights.array("w13_sf").size]  # raw bytes now
    assert megamoe.prepare(weights, "blackwell-interop")["no_op"]
    with pytest.raises(megamoe.InvalidArgumentError, match="canonical"):
        megamoe.MoELayer(cfg, weights, "cpu")  # the cpu backend reads canonical weights only
    r = megamoe.unprepare(weights)
    assert r["to_layout"] == "canonical" and weights.layout == "canonical"
    for n in NAMES:
        np.testing.assert_array_equal(weights.array(n), canonical[n], err_msg=n)
    with pytest.raises(megamoe.InvalidArgumentError, match="unknown backend"):
        megamoe.prepare(weights, "tpu")


def test_prepare_for_fused_blackwell():
    cfg = tiny_config()
    weights = megamoe.synthetic_weights(cfg, 6)
    assert megamoe.prepare_for_fused(weights, 100)["to_layout"] == "blackwell-interop"
    with pytest.raises(megamoe.UnsupportedError):
        megamoe.prepare_for_fused(weights, 75)
