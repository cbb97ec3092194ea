"""MoELayer with torch CUDA tensors on the sm90 backend (the GPU machine).

Skipped, with the reason printed by `pytest -rs`, where torch, a CUDA device or the sm90 backend
is missing. Checks: the Python path gives the same bits as the C++ path (`megamoe run` on the
same workload), calls are ordered on the caller's current stream, a captured CUDA graph replays
to the same bits as eager calls, torch tensors cross without copies, and wrong dtype / device /
shape raise the documented errors.
"""

import json
import subprocess

import numpy as np
import pytest

import megamoe
from conftest import find_cli, sm90_torch_skip_reason, torch

SKIP_REASON = sm90_torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

TOKENS = 64
SEED = 5


def _to_torch_bf16(x_bits, device="cuda"):
    bits = torch.from_numpy(np.ascontiguousarray(x_bits).view(np.int16))
    return bits.view(torch.bfloat16).to(device)


def _bits(t):
    """bf16 torch tensor (any device) -> numpy uint16 bits."""
    return t.detach().cpu().view(torch.int16).numpy().view(np.uint16)


def _workload(cfg, tokens=TOKENS, seed=SEED, routing="uniform"):
    x = megamoe.synthetic_activations(tokens, cfg.shape.hidden, seed)
    idx, w = megamoe.make_routing(routing, tokens, cfg.shape.num_experts, cfg.shape.top_k, seed)
    return x, idx, w


def _cuda_inputs(x, idx, w):
    return _to_torch_bf16(x), torch.from_numpy(idx).cuda(), torch.from_numpy(w).cuda()


@pytest.fixture(scope="module")
def small():
    cfg = megamoe.LayerConfig("small", max_tokens_per_rank=TOKENS)
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="sm90")
    return cfg, layer


def test_layer_lives_on_the_gpu(small):
    cfg, layer = small
    assert layer.backend == "sm90" and layer.device.startswith("cuda:")
    assert megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1)).backend == "sm90"  # auto


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_python_path_equals_cpp_path(small, routing):
    """`megamoe run --backend sm90 --json` (C++ only) and this process run the same workload on
    the same kernels: every number of their reports (functions of y) must agree exactly."""
    cli = find_cli()
    if cli is None:
        pytest.skip("megamoe program not found (set MEGAMOE_CLI or build it in build*/)")
    cfg, layer = small
    out = subprocess.run([cli, "run", "--shape", "small", "--tokens", str(TOKENS), "--backend",
                          "sm90", "--seed", str(SEED), "--routing", routing, "--iters", "1",
                          "--warmup", "0", "--json"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, f"{cli} run failed:\n{out.stdout}\n{out.stderr}"
    check = json.loads(out.stdout)["check"]
    x, idx, w = _workload(cfg, routing=routing)
    y = _bits(layer.forward(*_cuda_inputs(x, idx, w)))
    weights = megamoe.synthetic_weights(cfg, SEED)
    ideal = megamoe.ideal_forward(cfg, weights, x, idx, w)
    rep = megamoe.compare_output(cfg, y, ideal, idx)
    for key in ("diff", "worst_row", "worst_row_diff", "worst_expert", "worst_expert_diff",
                "max_abs_err"):
        assert rep[key] == check[key], f"{key}: python {rep[key]!r}, cli {check[key]!r}"
    y_cpu = megamoe.reference_forward(cfg, weights, x, idx, w)
    assert int(np.count_nonzero(y != y_cpu)) == check["vs_cpu_reference"]["mismatches"]
    assert rep["worst_row_diff"] < 1e-2 and rep["worst_expert_diff"] < 1e-2


def test_gpu_matches_cpu_reference_closely(small):
    cfg, layer = small
    x, idx, w = _workload(cfg, seed=11)
    y = _bits(layer.forward(*_cuda_inputs(x, idx, w)))
    y_cpu = megamoe.reference_forward(cfg, megamoe.synthetic_weights(cfg, SEED), x, idx, w)
    d = megamoe.diff_metric(megamoe.bf16_to_f32(y).astype(np.float64),
                            megamoe.bf16_to_f32(y_cpu).astype(np.float64))
    assert d < 1e-4, f"sm90 vs CPU reference diff {d} (summation order and fast-math only)"


def test_output_is_a_torch_tensor_written_in_place(small):
    cfg, layer = small
    xt, it, wt = _cuda_inputs(*_workload(cfg))
    y = layer.forward(xt, it, wt)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.is_cuda
    assert tuple(y.shape) == (TOKENS, cfg.shape.hidden)
    out = torch.full_like(y, float("nan"))
    ptr = out.data_ptr()
    assert layer.forward(xt, it, wt, out=out) is out and out.data_ptr() == ptr
    assert torch.equal(out.view(torch.int16), y.view(torch.int16))
    assert torch.equal(layer(xt, it, wt).view(torch.int16), y.view(torch.int16)), "deterministic"


def test_calls_are_ordered_on_the_current_stream(small):
    """Inputs written on a side stream right before the call (behind a long sleep) must be seen:
    the layer runs on torch's current stream, not on the legacy default stream."""
    cfg, layer = small
    x1, idx, w = _workload(cfg, seed=1)
    x2, _, _ = _workload(cfg, seed=2)
    _, it, wt = _cuda_inputs(x1, idx, w)
    want = _bits(layer.forward(_to_torch_bf16(x2), it, wt))
    xs = _to_torch_bf16(x1)
    x2_dev = _to_torch_bf16(x2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the copy lands
        xs.copy_(x2_dev)
        y = layer.forward(xs, it, wt)
        y_explicit = layer.forward(xs, it, wt, stream=side)
    side.synchronize()
    np.testing.assert_array_equal(_bits(y), want)
    np.testing.assert_array_equal(_bits(y_explicit), want)


def test_cuda_graph_replay_equals_eager(small):
    cfg, layer = small
    x, idx, w = _workload(cfg, seed=21)
    sx, si, sw = _cuda_inputs(x, idx, w)
    sy = torch.empty((TOKENS, cfg.shape.hidden), dtype=torch.bfloat16, device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        layer.forward(sx, si, sw, out=sy)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.forward(sx, si, sw, out=sy)
    for seed in (22, 23):
        x_new, idx_new, w_new = _workload(cfg, seed=seed)
        nx, ni, nw = _cuda_inputs(x_new, idx_new, w_new)
        sx.copy_(nx)
        si.copy_(ni)
        sw.copy_(nw)
        graph.replay()
        eager = layer.forward(nx, ni, nw)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(_bits(sy), _bits(eager), err_msg=f"graph replay, seed {seed}")


def test_zero_tokens_on_gpu(small):
    cfg, layer = small
    empty = torch.empty((0, cfg.shape.hidden), dtype=torch.bfloat16, device="cuda")
    y = layer.forward(empty, torch.empty((0, cfg.shape.top_k), dtype=torch.int32, device="cuda"),
                      torch.empty((0, cfg.shape.top_k), dtype=torch.float32, device="cuda"))
    assert tuple(y.shape) == (0, cfg.shape.hidden)


def test_weights_from_cuda_tensors(small):
    cfg, layer = small
    host = megamoe.synthetic_weights(cfg, SEED)
    names = ("w13", "w13_sf", "w2", "w2_sf")
    dev = megamoe.MoeWeights.from_arrays(*(torch.from_numpy(host.array(n)).cuda() for n in names))
    assert dev.device.startswith("cuda:")
    back = dev.array("w13")
    assert isinstance(back, torch.Tensor) and back.is_cuda
    np.testing.assert_array_equal(back.cpu().numpy(), host.array("w13"))
    xt, it, wt = _cuda_inputs(*_workload(cfg, seed=31))
    from_dev = megamoe.MoELayer(cfg, dev, backend="sm90")
    assert torch.equal(from_dev(xt, it, wt).view(torch.int16), layer(xt, it, wt).view(torch.int16))


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
def test_wrong_dtypes_on_gpu(small):
    cfg, layer = small
    xt, it, wt = _cuda_inputs(*_workload(cfg))
    with pytest.raises(megamoe.DTypeError, match="x: unsupported dtype float16"):
        layer.forward(xt.half(), it, wt)
    with pytest.raises(megamoe.DTypeError, match="topk_idx: unsupported dtype int64"):
        layer.forward(xt, it.long(), wt)
    with pytest.raises(TypeError, match="topk_weights: expected dtype float32"):
        layer.forward(xt, it, wt.double())
    with pytest.raises(TypeError, match="y: expected dtype bfloat16"):
        layer.forward(xt, it, wt, out=torch.empty_like(xt, dtype=torch.float32))


def test_wrong_shapes_and_layouts_on_gpu(small):
    cfg, layer = small
    xt, it, wt = _cuda_inputs(*_workload(cfg))
    with pytest.raises(megamoe.InvalidArgumentError, match="x: expected shape"):
        layer.forward(xt[:, :512].contiguous(), it, wt)
    with pytest.raises(ValueError, match="topk_idx: expected shape"):
        layer.forward(xt, it[:, :2].contiguous(), wt)
    with pytest.raises(ValueError, match="x: expected"):
        layer.forward(xt[:, ::2], it, wt)
    big = torch.zeros((TOKENS + 1, cfg.shape.hidden), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(megamoe.OutOfRangeError, match="max_tokens_per_rank"):
        layer.forward(big, torch.zeros((TOKENS + 1, cfg.shape.top_k), dtype=torch.int32,
                                       device="cuda"),
                      torch.zeros((TOKENS + 1, cfg.shape.top_k), dtype=torch.float32,
                                  device="cuda"))


def test_wrong_devices(small):
    cfg, layer = small
    x, idx, w = _workload(cfg)
    xt, it, wt = _cuda_inputs(x, idx, w)
    with pytest.raises(megamoe.InvalidArgumentError, match="expected a tensor on cuda:0, got one "
                       "on cpu"):
        layer.forward(x, idx, w)  # numpy arrays to a GPU layer
    with pytest.raises(ValueError, match="topk_weights: expected a tensor on cuda"):
        layer.forward(xt, it, wt.cpu())
    cpu_cfg = megamoe.LayerConfig("small", max_tokens_per_rank=TOKENS)
    cpu_layer = megamoe.MoELayer(cpu_cfg, megamoe.synthetic_weights(cpu_cfg, 1), backend="cpu")
    with pytest.raises(ValueError, match="x: expected a tensor on cpu, got one on cuda:0"):
        cpu_layer.forward(xt, it, wt)
    with pytest.raises(ValueError, match="expected a cpu array"):
        megamoe.quantize_input(xt)  # the codecs run on the host


def test_invalid_ids_raise_at_next_call_and_check_errors():
    cfg = megamoe.LayerConfig("small", max_tokens_per_rank=TOKENS)
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="sm90")
    x, idx, w = _workload(cfg)
    xt, it, wt = _cuda_inputs(x, idx, w)
    bad = it.clone()
    bad[3, 1] = cfg.shape.num_experts  # one past the end
    layer(xt, bad, wt)  # returns without waiting
    with pytest.raises(megamoe.OutOfRangeError, match="token 3 slot 1"):
        layer.check_errors()
    layer.check_errors()  # cleared
    layer(xt, bad, wt)
    torch.cuda.synchronize()
    with pytest.raises(megamoe.OutOfRangeError, match="token 3 slot 1"):
        layer(xt, it, wt)  # the next call reports the earlier one
    layer(xt, it, wt)
    layer.check_errors()
    # Opt-in synchronous checking: the bad call raises itself.
    sync_cfg = megamoe.LayerConfig("small", max_tokens_per_rank=TOKENS, sync_error_check=True)
    assert sync_cfg.sync_error_check
    sync_layer = megamoe.MoELayer(sync_cfg, megamoe.synthetic_weights(sync_cfg, SEED), backend="sm90")
    sync_layer(xt, it, wt)
    with pytest.raises(megamoe.OutOfRangeError, match="token 3 slot 1"):
        sync_layer(xt, bad, wt)


def test_tile_options_change_nothing_but_speed():
    """LayerConfig's Hopper options in one process: the serial tiles, a forced tile and plain
    launches give the reference's function (bits may differ with the tile: FP32 summation order)."""
    base = megamoe.LayerConfig("small", max_tokens_per_rank=TOKENS)
    x, idx, w = _workload(base, seed=41)
    xt, it, wt = _cuda_inputs(x, idx, w)
    ref = _bits(megamoe.MoELayer(base, megamoe.synthetic_weights(base, SEED), backend="sm90")(xt, it, wt))
    for kwargs in ({"gemm_tile": "serial"}, {"gemm_tile": "decode_128x16_k2_warp"},
                   {"gemm_tile": "decode_128x16_k2_warp", "mega_kernel": True},
                   {"programmatic_launch": False}, {"rows_hint": "bound"}):
        cfg = megamoe.LayerConfig("small", max_tokens_per_rank=TOKENS, **kwargs)
        layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="sm90")
        y = _bits(layer(xt, it, wt))
        # a forced tile the MegaMoE kernel is built for runs fused; the rest chains
        assert layer.last_call_kernels == ("mega" if kwargs.get("mega_kernel") else "chain"), kwargs
        if "gemm_tile" in kwargs:
            d = megamoe.diff_metric(megamoe.bf16_to_f32(y).astype(np.float64),
                                    megamoe.bf16_to_f32(ref).astype(np.float64))
            assert d < 1e-4, (kwargs, d)  # FP32 summation order only
        else:
            np.testing.assert_array_equal(y, ref, err_msg=str(kwargs))
    with pytest.raises(megamoe.InvalidArgumentError, match="prefill_256x128_k2_staged"):
        megamoe.LayerConfig("small", gemm_tile="prefill_256x128")


def test_fp8_mode_against_the_exact_mode_and_the_cpu_fp8_mode():
    """precision='fp8' on sm90 (docs/numerics.md "FP8 mode"): as close to the FP64 ideal as the
    exact mode (<= 1.5x its diff) and close to the cpu backend's FP8 mode."""
    exact = megamoe.LayerConfig("small", max_tokens_per_rank=TOKENS)
    fp8 = megamoe.LayerConfig("small", max_tokens_per_rank=TOKENS, precision="fp8")
    fp8.fp8_min_rows_per_expert = 0  # 64 tokens give 8 rows per expert
    x, idx, w = _workload(exact)
    y = {}
    for name, cfg in (("exact", exact), ("fp8", fp8)):
        layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="sm90")
        y[name] = _bits(layer.forward(*_cuda_inputs(x, idx, w)))
    y["cpu_fp8"] = megamoe.MoELayer(fp8, megamoe.synthetic_weights(fp8, SEED), "cpu").forward(x, idx, w)
    ideal = megamoe.ideal_forward(exact, megamoe.synthetic_weights(exact, SEED), x, idx, w)
    diff = {n: megamoe.compare_output(exact, v, ideal, idx)["diff"] for n, v in y.items()}
    assert diff["fp8"] <= 1.5 * diff["exact"], diff
    assert abs(diff["fp8"] - diff["cpu_fp8"]) <= 0.1 * diff["cpu_fp8"], diff
    assert not np.array_equal(y["fp8"], y["exact"]), "the FP8 mode ran"
