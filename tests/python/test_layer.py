"""MoELayer on the CPU (numpy arrays) against the C++ CPU reference, the `megamoe run` program,
and a stage-by-stage numpy model of numerics.md."""

import json
import subprocess

import numpy as np
import pytest

import megamoe
import npref
from conftest import find_cli, make_inputs, tiny_config

FP32_UNIT_ROUNDOFF = 2.0 ** -24

ACTIVATIONS = ["swiglu", "swiglu:clamp=1.5", "situ", "situ:beta=2,linear_beta=3"]


def _bits_equal(a, b):
    return np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


# ------------------------------------------------------------------------------------------------
# Bit-exact equality with the C++ reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ACTIVATIONS + ["swiglu_oai"])
@pytest.mark.parametrize("fast_math", [False, True])
def test_layer_equals_reference_bit_for_bit(activation, fast_math):
    cfg = tiny_config(activation, fast_math=fast_math)
    with_bias = activation.startswith("swiglu_oai")
    x, idx, w = make_inputs(cfg, 19, seed=3)
    y_ref = megamoe.reference_forward(cfg, megamoe.synthetic_weights(cfg, 11, with_bias), x, idx, w)
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 11, with_bias), backend="cpu")
    y = layer.forward(x, idx, w)
    assert y.dtype == np.uint16 and y.shape == (19, cfg.shape.hidden)
    assert _bits_equal(y, y_ref), f"activation {activation}, fast_math {fast_math}"
    assert np.any(y != 0)
    assert not y[2].any(), "a token without a valid slot must give a zero row"
    assert _bits_equal(layer(x, idx, w), y), "a second call must give the same bits"


def test_layer_matches_cli_run_json():
    """The same workload through `megamoe run --json` (C++ only) and through Python must give the
    same accuracy report to the last bit: every number there is a function of y."""
    cli = find_cli()
    if cli is None:
        pytest.skip("megamoe program not found (set MEGAMOE_CLI, put it on PATH, or build it in "
                    "build*/ of the repository)")
    tokens, seed = 24, 5
    out = subprocess.run([cli, "run", "--shape", "small", "--tokens", str(tokens), "--backend",
                          "cpu", "--seed", str(seed), "--routing", "skewed", "--iters", "1",
                          "--warmup", "0", "--json"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, f"{cli} run failed:\n{out.stdout}\n{out.stderr}"
    report = json.loads(out.stdout)
    cfg = megamoe.LayerConfig("small", max_tokens_per_rank=tokens)
    x = megamoe.synthetic_activations(tokens, cfg.shape.hidden, seed)
    idx, w = megamoe.make_routing("skewed", tokens, cfg.shape.num_experts, cfg.shape.top_k, seed)
    ideal = megamoe.ideal_forward(cfg, megamoe.synthetic_weights(cfg, seed), x, idx, w)
    y = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, seed), "cpu").forward(x, idx, w)
    rep = megamoe.compare_output(cfg, y, ideal, idx)
    check = report["check"]
    assert report["backend"] == "cpu" and report["tokens"] == tokens
    for key in ("diff", "worst_row", "worst_row_diff", "worst_expert", "worst_expert_diff",
                "max_abs_err"):
        assert rep[key] == check[key], f"{key}: python {rep[key]!r}, cli {check[key]!r}"


# ------------------------------------------------------------------------------------------------
# Stage by stage against the numpy model (exact mode)
# ------------------------------------------------------------------------------------------------
def _np_activation(act, g, u):
    """numerics.md section 4 in FP64 from BF16-rounded g, u."""
    g = g.astype(np.float64)
    u = u.astype(np.float64)
    if act.kind == "swiglu":
        if act.clamp is not None:
            lim = float(npref.bf16_decode(npref.bf16_encode(np.float32(act.clamp))))
            g = np.minimum(g, lim)
            u = np.clip(u, -lim, lim)
        return g / (1 + np.exp(-g)) * u
    assert act.kind == "situ"
    b, lb = float(act.beta), float(act.linear_beta)
    return (b * np.tanh(g / b) / (1 + np.exp(-g))) * (lb * np.tanh(u / lb))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_stages_match_numpy_model(activation):
    cfg = tiny_config(activation, fast_math=False)
    T, H, I, K = 16, cfg.shape.hidden, cfg.shape.intermediate, cfg.shape.top_k
    weights = megamoe.synthetic_weights(cfg, 7)
    x, idx, w = make_inputs(cfg, T, seed=9)
    y, tr = megamoe.reference_forward(cfg, weights, x, idx, w, trace=True)
    valid = (idx >= 0).reshape(T * K)
    experts = np.where(idx >= 0, idx, 0).reshape(T * K)

    # Section 2: input quantization, bit exact.
    xq_ref, xsf_ref = npref.quantize_input(x)
    np.testing.assert_array_equal(tr["x_q"], xq_ref)
    np.testing.assert_array_equal(tr["x_sf"], xsf_ref)

    # Section 3: L1 with exact products, FP32 accumulation within the summation bound.
    w13 = npref.dequantize_mxfp4(weights.array("w13"), weights.array("w13_sf"))  # [E, 2I, H]
    xd = npref.dequantize_fp8(xq_ref, xsf_ref)[np.arange(T * K) // K]           # [T*K, H]
    terms = xd[:, None, :] * w13[experts]                                        # [T*K, 2I, H]
    acc_ref = terms.sum(-1)
    bound = H * FP32_UNIT_ROUNDOFF * np.abs(terms).sum(-1)
    err = np.abs(tr["l1_acc"] - acc_ref)
    used = np.max(err[valid] / np.maximum(bound[valid], 1e-300))
    assert used <= 1.0, f"L1 accumulation error uses {used:.3f} of the FP32 summation bound"
    assert not tr["l1_acc"][~valid].any(), "rows of invalid slots are zero"

    # Sections 4-5: activation on BF16 g/u of the reference's own accumulators, routing weight,
    # requantization. FP64 vs FP32 math may flip a code at a rounding boundary: at most one
    # step, and rarely.
    l1 = tr["l1_acc"].astype(np.float32)
    g = npref.bf16_decode(npref.bf16_encode(l1[:, :I]))
    u = npref.bf16_decode(npref.bf16_encode(l1[:, I:]))
    v = (_np_activation(cfg.activation, g, u) * w.reshape(T * K, 1)).astype(np.float32)
    hq_ref, hsf_ref = npref.requantize(v)
    hq_ref[~valid] = 0
    hsf_ref[~valid] = 0
    np.testing.assert_array_equal(tr["h_sf"], hsf_ref)
    flipped = tr["h_q"] != hq_ref
    assert flipped.sum() <= 2, f"{flipped.sum()} intermediate codes differ from the FP64 model"
    step = np.abs(npref.E4M3_TABLE[tr["h_q"][flipped]] - npref.E4M3_TABLE[hq_ref[flipped]])
    top = np.maximum(np.abs(npref.E4M3_TABLE[tr["h_q"][flipped]]), 2.0 ** -9)
    assert np.all(step <= top / 8 + 1e-30), "a differing code is more than one E4M3 step away"

    # Section 6: L2 from the reference's own intermediate, then BF16.
    w2 = npref.dequantize_mxfp4(weights.array("w2"), weights.array("w2_sf"))    # [E, H, I]
    hd = npref.dequantize_fp8(tr["h_q"], tr["h_sf"])                            # [T*K, I]
    terms2 = hd[:, None, :] * w2[experts]
    o_ref = terms2.sum(-1)
    o = npref.bf16_decode(tr["o"]).astype(np.float64)
    ulp = np.ldexp(1.0, np.frexp(np.abs(o_ref))[1] - 8)  # one BF16 ulp of o_ref
    bound2 = ulp + I * FP32_UNIT_ROUNDOFF * np.abs(terms2).sum(-1)
    assert np.all(np.abs(o - o_ref)[valid] <= bound2[valid])

    # Combine: ascending k in FP32 over valid slots, one rounding: bit exact.
    o32 = npref.bf16_decode(tr["o"]).reshape(T, K, H)
    acc = np.zeros((T, H), dtype=np.float32)
    for k in range(K):
        acc = np.where((idx[:, k] >= 0)[:, None], (acc + o32[:, k]).astype(np.float32), acc)
    np.testing.assert_array_equal(y, npref.bf16_encode(acc))


def test_reference_paths_agree(rng):
    cfg = tiny_config("situ")
    weights = megamoe.synthetic_weights(cfg, 2)
    x, idx, w = make_inputs(cfg, 9, seed=4)
    y, tr = megamoe.reference_forward(cfg, weights, x, idx, w, trace=True)
    q, sf = megamoe.quantize_input(x)
    assert _bits_equal(megamoe.reference_forward_quantized(cfg, weights, q, sf, idx, w), y)
    assert _bits_equal(megamoe.reference_l2_combine(cfg, weights, tr["h_q"], tr["h_sf"], idx), y)
    ideal = megamoe.ideal_forward(cfg, weights, x, idx, w)
    assert ideal.dtype == np.float64 and ideal.shape == y.shape
    d = megamoe.diff_metric(megamoe.bf16_to_f32(y).astype(np.float64), ideal)
    assert 0 < d < 1e-2, f"FP8 x MXFP4 vs FP64 ideal diff {d}"
    rep = megamoe.compare_output(cfg, y, ideal, idx)
    assert rep["diff"] == pytest.approx(d, rel=1e-12)
    assert rep["worst_row_diff"] >= rep["diff"] and 0 <= rep["worst_row"] < 9


# ------------------------------------------------------------------------------------------------
# Layer semantics
# ------------------------------------------------------------------------------------------------
def test_zero_tokens():
    cfg = tiny_config()
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), "cpu")
    y = layer.forward(np.zeros((0, cfg.shape.hidden), np.uint16), np.zeros((0, 3), np.int32),
                      np.zeros((0, 3), np.float32))
    assert y.shape == (0, cfg.shape.hidden)


def test_out_is_written_in_place_without_copy():
    cfg = tiny_config()
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), "cpu")
    x, idx, w = make_inputs(cfg, 5, seed=1)
    out = np.full((5, cfg.shape.hidden), 0xFFFF, dtype=np.uint16)
    y = layer.forward(x, idx, w, out=out)
    assert y is out
    assert _bits_equal(out, megamoe.reference_forward(cfg, megamoe.synthetic_weights(cfg, 1),
                                                      x, idx, w))


def test_ml_dtypes_bfloat16_in_and_out():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    cfg = tiny_config()
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), "cpu")
    x, idx, w = make_inputs(cfg, 4, seed=2)
    y = layer.forward(x.view(ml_dtypes.bfloat16), idx, w)
    assert y.dtype == ml_dtypes.bfloat16
    assert _bits_equal(y, layer.forward(x, idx, w))


def test_capacity_is_enforced():
    cfg = tiny_config(max_tokens=4)
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), "cpu")
    x, idx, w = make_inputs(cfg, 5, seed=1)
    with pytest.raises(megamoe.OutOfRangeError, match="max_tokens_per_rank"):
        layer.forward(x, idx, w)
    with pytest.raises(ValueError):
        layer.forward(x, idx, w)


@pytest.mark.parametrize("bad_id", [8, 1000, -2])
def test_invalid_expert_id_is_reported(bad_id):
    cfg = tiny_config()
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), "cpu")
    x, idx, w = make_inputs(cfg, 4, seed=1, empty_slots=False)
    idx[3, 1] = bad_id
    with pytest.raises(megamoe.OutOfRangeError) as info:
        layer.forward(x, idx, w)
    assert isinstance(info.value, ValueError)
    assert str(bad_id) in str(info.value)


def test_layer_takes_the_weights():
    cfg = tiny_config()
    weights = megamoe.synthetic_weights(cfg, 1)
    layer = megamoe.MoELayer(cfg, weights, "cpu")
    assert weights.consumed and "moved into a MoELayer" in repr(weights)
    with pytest.raises(megamoe.InvalidArgumentError, match="moved into a MoELayer"):
        weights.hidden
    with pytest.raises(ValueError, match="moved into a MoELayer"):
        megamoe.MoELayer(cfg, weights, "cpu")
    assert layer.backend == "cpu" and layer.device == "cpu"
    assert layer.weights_layout == "canonical" and layer.weights_bytes > 0
    assert layer.config.shape == cfg.shape


def test_rejected_layer_leaves_weights_intact():
    cfg = tiny_config()
    weights = megamoe.synthetic_weights(cfg, 1)
    other = megamoe.LayerConfig(megamoe.LayerShape(256, 64, 8, 3))
    with pytest.raises(ValueError):
        megamoe.MoELayer(other, weights, "cpu")
    with pytest.raises(megamoe.InvalidArgumentError, match="unknown"):
        megamoe.MoELayer(cfg, weights, "tpu")
    assert not weights.consumed
    megamoe.MoELayer(cfg, weights, "cpu")
    assert weights.consumed


def test_sm90_backend_without_gpu_is_unsupported():
    if "sm90" in megamoe.available_backends():
        pytest.skip("sm90 is available here: the unsupported path cannot be exercised")
    cfg = tiny_config()
    weights = megamoe.synthetic_weights(cfg, 1)
    with pytest.raises(megamoe.UnsupportedError) as info:
        megamoe.MoELayer(cfg, weights, "sm90")
    assert isinstance(info.value, RuntimeError)
    assert not weights.consumed
    assert megamoe.available_backends()[-1] == "cpu"


def test_weights_from_arrays_round_trip():
    cfg = tiny_config("situ")
    src = megamoe.synthetic_weights(cfg, 5)
    arrays = {n: src.array(n) for n in ("w13", "w13_sf", "w2", "w2_sf")}
    assert arrays["w13"].shape == (8, 128, 64) and arrays["w13_sf"].shape == (8, 128, 4)
    assert arrays["w2"].shape == (8, 128, 32) and arrays["w2_sf"].shape == (8, 128, 2)
    copy = megamoe.MoeWeights.from_arrays(**arrays)
    assert copy.num_local_experts == 8 and copy.hidden == 128 and copy.intermediate == 64
    x, idx, w = make_inputs(cfg, 6, seed=3)
    assert _bits_equal(megamoe.MoELayer(cfg, copy, "cpu")(x, idx, w),
                       megamoe.MoELayer(cfg, src, "cpu")(x, idx, w))
    with pytest.raises(megamoe.InvalidArgumentError, match="w2"):
        megamoe.MoeWeights.from_arrays(arrays["w13"], arrays["w13_sf"], arrays["w2"][:, :64],
                                       arrays["w2_sf"])


def test_expert_parallel_ranks_reproduce_the_slots_of_their_experts():
    """With ep_size = 2 each rank computes the slots of its own experts; their per-slot outputs
    equal the single-rank run's bit for bit."""
    full_cfg = tiny_config("situ")
    full = megamoe.synthetic_weights(full_cfg, 8)
    arrays = {n: full.array(n) for n in ("w13", "w13_sf", "w2", "w2_sf")}
    x, idx, w = make_inputs(full_cfg, 12, seed=6)
    _, tr_full = megamoe.reference_forward(full_cfg, full, x, idx, w, trace=True)
    slot_expert = idx.reshape(-1)
    for rank in range(2):
        cfg = tiny_config("situ", ep_size=2, ep_rank=rank)
        lo, hi = cfg.first_local_expert, cfg.first_local_expert + cfg.num_local_experts
        local = megamoe.MoeWeights.from_arrays(*(arrays[n][lo:hi] for n in
                                                 ("w13", "w13_sf", "w2", "w2_sf")),
                                               first_expert=lo)
        _, tr = megamoe.reference_forward(cfg, local, x, idx, w, trace=True)
        mine = (slot_expert >= lo) & (slot_expert < hi)
        assert mine.any()
        np.testing.assert_array_equal(tr["o"][mine], tr_full["o"][mine])
        assert not tr["o"][~mine].any()


def test_memory_stats_track_weights():
    cfg = tiny_config()
    before = megamoe.memory_stats()
    weights = megamoe.synthetic_weights(cfg, 1)
    during = megamoe.memory_stats()
    assert during["host_bytes"] - before["host_bytes"] >= weights.total_bytes
    assert during["allocations"] > before["allocations"]
    del weights
    assert megamoe.memory_stats()["host_bytes"] == before["host_bytes"]
    megamoe.reset_memory_peak()
    s = megamoe.memory_stats()
    assert s["host_peak_bytes"] == s["host_bytes"]


# ------------------------------------------------------------------------------------------------
# Config objects
# ------------------------------------------------------------------------------------------------
def test_presets_and_activations():
    assert set(megamoe.shape_preset_names()) >= {"kimi-k3", "deepseek-v3", "gpt-oss-120b", "small"}
    k3 = megamoe.LayerConfig("kimi-k3")
    assert (k3.shape.hidden, k3.shape.intermediate, k3.shape.num_experts, k3.shape.top_k) == \
        (3584, 3072, 896, 16)
    assert k3.activation.kind == "situ" and k3.activation.clamp is None
    assert megamoe.Activation.parse("situ") == megamoe.Activation.situ()
    a = megamoe.Activation.parse("swiglu:clamp=7")
    assert a.kind == "swiglu" and a.clamp == 7.0
    assert megamoe.Activation.parse(str(a)) == a
    assert megamoe.LayerConfig("small", activation="situ").activation.kind == "situ"
    cfg = megamoe.LayerConfig("kimi-k3", ep_size=8, ep_rank=3)
    assert cfg.num_local_experts == 112 and cfg.first_local_expert == 336


@pytest.mark.parametrize("spec", ["situ:clamp=3", "swiglu:clamp=-1", "relu", "situ:beta=0",
                                  "swiglu:clamp=nan"])
def test_invalid_activation_specs(spec):
    with pytest.raises(megamoe.InvalidArgumentError):
        megamoe.Activation.parse(spec)


def test_invalid_configs():
    with pytest.raises(ValueError, match="unknown preset"):
        megamoe.LayerConfig("nope")
    with pytest.raises(ValueError):
        megamoe.LayerShape(hidden=100, intermediate=64, num_experts=8, top_k=2)
    with pytest.raises(ValueError):
        megamoe.LayerConfig("small", ep_size=3)  # 3 does not divide E = 32


def test_hopper_options_are_layer_options():
    cfg = megamoe.LayerConfig("small")
    assert (cfg.gemm_tile, cfg.programmatic_launch, cfg.rows_hint, cfg.sync_error_check) == (
        "auto", True, "gated", False)
    cfg = megamoe.LayerConfig("small", gemm_tile="serial", programmatic_launch=False,
                              rows_hint="expected", sync_error_check=True)
    assert (cfg.gemm_tile, cfg.programmatic_launch, cfg.rows_hint, cfg.sync_error_check) == (
        "serial", False, "expected", True)
    assert "gemm_tile='serial'" in repr(cfg)
    assert not cfg.mega_kernel and "mega_kernel" not in repr(cfg)
    cfg.mega_kernel = True
    assert megamoe.LayerConfig("small", mega_kernel=True).mega_kernel
    assert "mega_kernel=True" in repr(cfg)
    assert cfg.decode_front and "decode_front" not in repr(cfg)
    cfg.decode_front = False
    assert "decode_front=False" in repr(cfg)
    assert not megamoe.LayerConfig("small", decode_front=False).decode_front
    assert not cfg.mega_dispatch and "mega_dispatch" not in repr(cfg)
    both = megamoe.LayerConfig("small", mega_kernel=True, mega_dispatch=True)
    assert both.mega_dispatch and "mega_dispatch=True" in repr(both)
    with pytest.raises(megamoe.InvalidArgumentError, match="needs sm90.mega_kernel"):
        megamoe.LayerConfig("small", mega_dispatch=True)  # the dispatch inside needs the kernel
    assert not cfg.mega_combine and "mega_combine" not in repr(cfg)  # off by default
    inside = megamoe.LayerConfig("small", mega_kernel=True, mega_combine=True)
    assert inside.mega_combine and "mega_combine=True" in repr(inside)
    with pytest.raises(megamoe.InvalidArgumentError, match="sm90.mega_combine"):
        megamoe.LayerConfig("small", mega_combine=True)  # the combine inside needs the kernel
    with pytest.raises(megamoe.InvalidArgumentError, match="decode_128x16_k2_warp"):
        megamoe.LayerConfig("small", gemm_tile="decode")  # names the tiles it accepts
    with pytest.raises(megamoe.InvalidArgumentError, match="gated, bound or expected"):
        megamoe.LayerConfig("small", rows_hint="upper")
    # An FP8-mode tile names the tile of the FP8 mode's calls: with precision fp8 only.
    with pytest.raises(megamoe.InvalidArgumentError, match="FP8-mode tile"):
        megamoe.LayerConfig("small", gemm_tile="fp8_128x192_k2_async")
    fp8 = megamoe.LayerConfig("small", gemm_tile="fp8_128x192_k2_async", precision="fp8",
                              mega_kernel=True)
    assert (fp8.gemm_tile, fp8.precision, fp8.mega_kernel) == ("fp8_128x192_k2_async", "fp8", True)
    # A CPU layer takes them (they only concern the Hopper backend) and has nothing to check.
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), backend="cpu")
    layer.check_errors()


# ------------------------------------------------------------------------------------------------
# The FP8 mode (docs/numerics.md "FP8 mode") on the cpu backend
# ------------------------------------------------------------------------------------------------
def test_fp8_precision_on_the_cpu_backend():
    cfg = tiny_config("swiglu")
    assert cfg.precision == "exact" and "precision='exact'" in repr(cfg)
    fp8 = tiny_config("swiglu")
    fp8.precision = "fp8"
    assert "precision='fp8'" in repr(fp8)
    assert fp8.fp8_min_rows_per_expert == 128 and not fp8.fp8_for_tokens(19)
    fp8.fp8_min_rows_per_expert = 0  # every call (19 tokens give 7 rows per expert)
    assert fp8.fp8_for_tokens(19)
    x, idx, w = make_inputs(cfg, 19, seed=4)
    weights = megamoe.synthetic_weights(cfg, 12)
    y_exact = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 12), "cpu").forward(x, idx, w)
    y_fp8 = megamoe.MoELayer(fp8, weights, "cpu").forward(x, idx, w)
    assert _bits_equal(megamoe.reference_forward(fp8, megamoe.synthetic_weights(cfg, 12), x, idx, w),
                       y_fp8), "the layer is the reference in either precision"
    ideal = megamoe.ideal_forward(cfg, megamoe.synthetic_weights(cfg, 12), x, idx, w)
    d_exact = megamoe.compare_output(cfg, y_exact, ideal, idx)["diff"]
    d_fp8 = megamoe.compare_output(fp8, y_fp8, ideal, idx)["diff"]
    assert d_fp8 <= 1.5 * d_exact, (d_fp8, d_exact)
    with pytest.raises(megamoe.InvalidArgumentError, match="expected exact or fp8"):
        megamoe.LayerConfig("small", precision="bf16")
    with pytest.raises(megamoe.InvalidArgumentError, match="expected exact or fp8"):
        fp8.precision = "int4"


def test_fp8_precision_on_sm90_names_what_it_cannot_run():
    if "sm90" not in megamoe.available_backends():
        pytest.skip("no sm90 backend here: its refusals of the FP8 mode need one")
    cfg = tiny_config("swiglu")  # I = 64: the FP8 tiles read two 64-channel k-blocks per stage
    cfg.precision = "fp8"
    with pytest.raises(megamoe.UnsupportedError, match="multiples of 128"):
        megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), "sm90")