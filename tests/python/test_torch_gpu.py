"""The custom ops on the sm90 backend: eager == torch.compile(fullgraph=True) == CUDA-graph replay,
bit for bit, on one GPU and with 2 virtual EP ranks (each rank's op on its own stream).

Skipped, with the reason printed by `pytest -rs`, where torch, a CUDA device or the sm90 backend
is missing. Checks:

* torch.ops.megamoe.moe_forward inside an engine-style block (router, experts, residual):
  eager, compiled with fullgraph=True, and CUDA graphs captured from both, replayed on new
  inputs, give the same bits.
* megamoe.deep_gemm_compat.fp8_fp4_mega_moe (torch.ops.megamoe.fp8_fp4_mega_moe): the same
  three ways, equal to an sm90 MoELayer on the dequantized BF16 input, receive statistics equal
  to the host count.
* 2 virtual ranks, through the op and through the compat API (get_symm_buffers_for_virtual_ranks):
  eager, compiled and one CUDA graph holding both ranks' calls (a fork/join over their streams)
  give the same bits, which are those of one EP = 1 layer on all tokens (a fixed GEMM tile, as in
  test_ep_gpu.py, so that the summation order is the same).
"""

import numpy as np
import pytest

import megamoe

from conftest import routed_block, sm90_torch_skip_reason, torch

SKIP_REASON = sm90_torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

if SKIP_REASON is None:
    import megamoe.deep_gemm_compat as mega
    import megamoe.torch_ops as ops

CAP = 64          # max tokens per rank
SEED = 7
TILE = "decode_128x16_k2_warp"  # a fixed tile (test_ep_gpu.py): EP = R is EP = 1 bit for bit
TIMEOUT_S = 300.0  # the first compiled call of a rank compiles while the other rank waits
RANK_TOKENS = (CAP, 23)


def _config(ep_size=1, ep_rank=0, capacity=CAP, tile="auto", activation=None):
    return megamoe.LayerConfig("small", activation=activation, max_tokens_per_rank=capacity,
                               ep_size=ep_size, ep_rank=ep_rank, gemm_tile=tile)


def _bits(t):
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _workload(cfg, tokens, seed):
    """Host arrays: x bf16 bits, idx int32, w float32 (uniform routing, one empty slot)."""
    x = megamoe.synthetic_activations(tokens, cfg.shape.hidden, seed)
    idx, w = megamoe.make_routing("uniform", tokens, cfg.shape.num_experts, cfg.shape.top_k, seed)
    if tokens > 2:
        idx[1, -1] = -1
    return x, idx, w


def _cuda(x, idx, w):
    xt = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).cuda()
    return xt, torch.from_numpy(idx).cuda(), torch.from_numpy(w).cuda()


def _capture(fn):
    """A CUDA graph of fn() (after one warm-up call on a side stream) and its captured result."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# ------------------------------------------------------------------------------------------------
# One GPU
# ------------------------------------------------------------------------------------------------
def test_op_eager_compiled_and_graph_replay_are_bitwise_equal():
    cfg = _config()
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="sm90")
    block = routed_block(layer, cfg, seed=11, scale=0.05, device="cuda")
    compiled = torch.compile(block, fullgraph=True)
    x_static = _cuda(*_workload(cfg, CAP, 1))[0]
    np.testing.assert_array_equal(_bits(compiled(x_static)), _bits(block(x_static)))
    eager_graph, eager_out = _capture(lambda: block(x_static))
    compiled_graph, compiled_out = _capture(lambda: compiled(x_static))
    for seed in (2, 3):
        x_new = _cuda(*_workload(cfg, CAP, seed))[0]
        want = _bits(block(x_new))
        np.testing.assert_array_equal(_bits(compiled(x_new)), want, err_msg=f"compiled {seed}")
        x_static.copy_(x_new)
        eager_graph.replay()
        compiled_graph.replay()
        torch.cuda.synchronize()
        layer.check_errors()
        np.testing.assert_array_equal(_bits(eager_out), want, err_msg=f"eager graph {seed}")
        np.testing.assert_array_equal(_bits(compiled_out), want, err_msg=f"compiled graph {seed}")


def _deepgemm_weights(cfg, device="cuda"):
    """This rank's synthetic experts as an engine hands them to DeepGEMM: int8 packed E2M1 and
    float32 UE8M0 scales through transform_sf_into_required_layout (packed int32, MN-major)."""
    host = megamoe.synthetic_weights(cfg, SEED)
    w13, s13, w2, s2 = (torch.from_numpy(host.array(n)).to(device)
                        for n in ("w13", "w13_sf", "w2", "w2_sf"))
    h, i = cfg.shape.hidden, cfg.shape.intermediate
    e = cfg.num_local_experts

    def scales(b, mn, k):
        f = torch.ldexp(torch.ones(b.shape, device=device), b.long() - 127).float()
        return mega.transform_sf_into_required_layout(f, mn, k, (1, 32), e)

    return ((w13.view(torch.int8), scales(s13, 2 * i, h)),
            (w2.view(torch.int8), scales(s2, h, i)))


def _fp8_inputs(x, idx, w):
    """An engine's inputs of host arrays x (bf16 bits), idx, w: (codes float8 [T, H], packed
    scales int32 [T, H/128], idx int64, w float32) on the GPU from the contract's quantizer, and
    the BF16 (x, idx, w) they dequantize to."""
    q, sf = megamoe.quantize_input(x)
    t, g = sf.shape
    padded = np.zeros((t, (g + 3) // 4 * 4), np.uint8)
    padded[:, :g] = sf
    packed = torch.from_numpy(padded.view("<i4").copy()).cuda()
    xb = megamoe.bf16_from_f32(megamoe.dequantize_fp8(q, sf))
    return ((torch.from_numpy(q).cuda().view(torch.float8_e4m3fn), packed,
             torch.from_numpy(idx).long().cuda(), torch.from_numpy(w).cuda()),
            _cuda(xb, idx, w))


def _load(buf, fp8):
    """Copies an engine's inputs into the first T rows of the buffer's views."""
    t = fp8[0].shape[0]
    for view, value in zip((buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights), fp8):
        view[:t].copy_(value)


def test_compat_eager_compiled_and_graph_replay_are_bitwise_equal():
    cfg = _config(activation="situ")
    l1, l2 = mega.transform_weights_for_mega_moe(*_deepgemm_weights(cfg), activation="situ")
    h, e, k = cfg.shape.hidden, cfg.shape.num_experts, cfg.shape.top_k
    buf = mega.get_symm_buffer_for_mega_moe(None, e, CAP, k, h, cfg.shape.intermediate,
                                            activation="situ")
    assert buf.backend == "sm90" and buf.x.is_cuda
    stats = torch.zeros(e, dtype=torch.int32, device="cuda")
    y_static = torch.empty((CAP, h), dtype=torch.bfloat16, device="cuda")

    def step(y):
        mega.fp8_fp4_mega_moe(y, l1, l2, buf, cumulative_local_expert_recv_stats=stats,
                              activation="situ", situ_beta=4.0, situ_linear_beta=25.0)
        return y

    compiled = torch.compile(step, fullgraph=True)
    plain = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="sm90")
    graphs = None
    for seed in (1, 2, 3):
        fp8, bf16 = _fp8_inputs(*_workload(cfg, CAP, seed))
        _load(buf, fp8)
        want = _bits(plain.forward(bf16[0], bf16[1], bf16[2]))
        before = stats.clone()
        np.testing.assert_array_equal(_bits(step(torch.empty_like(y_static))), want,
                                      err_msg=f"eager {seed}")
        counts = torch.bincount(fp8[2][fp8[2] >= 0], minlength=e).int()
        assert torch.equal(stats - before, counts), f"recv stats {seed}"
        np.testing.assert_array_equal(_bits(compiled(torch.empty_like(y_static))), want,
                                      err_msg=f"compiled {seed}")
        if graphs is None:  # bound by now: capture both paths
            graphs = (_capture(lambda: step(y_static))[0],
                      _capture(lambda: compiled(y_static))[0])
            continue
        for name, graph in zip(("eager", "compiled"), graphs):
            y_static.fill_(0)
            graph.replay()
            torch.cuda.synchronize()
            np.testing.assert_array_equal(_bits(y_static), want, err_msg=f"{name} graph {seed}")
    mega.get_layer(l1).check_errors()


# ------------------------------------------------------------------------------------------------
# Two virtual EP ranks, each on its own stream
# ------------------------------------------------------------------------------------------------
def _split(arrays, counts):
    bounds = np.cumsum((0,) + counts)
    return [tuple(a[lo:hi] for a in arrays) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _on_streams(streams, calls):
    """calls[r]() on streams[r], all enqueued before anything waits; joined back into the
    current stream (also inside a CUDA-graph capture: a fork/join)."""
    current = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(current)
    outs = []
    for s, call in zip(streams, calls):
        with torch.cuda.stream(s):
            outs.append(call())
    for s in streams:
        current.wait_stream(s)
    return outs


_STREAMS = []


def streams_for(ranks):
    """One stream per rank, the same ones for every call of a test (a rank's calls stay in one
    stream order)."""
    while len(_STREAMS) < ranks:
        _STREAMS.append(torch.cuda.Stream())
    return _STREAMS[:ranks]


def _one_layer_reference(tokens, seed):
    """EP = 1 on all ranks' tokens, the same fixed tile: the bits every EP path must give."""
    cfg = _config(capacity=sum(RANK_TOKENS), tile=TILE)
    layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="sm90")
    host = _workload(cfg, sum(RANK_TOKENS), seed)
    return _bits(layer.forward(*_cuda(*host))), host


def test_virtual_ranks_through_the_op():
    ranks = len(RANK_TOKENS)
    groups = megamoe.ep.virtual_group(ranks, _config(tile=TILE), timeout_s=TIMEOUT_S)
    modules, streams = [], [torch.cuda.Stream() for _ in range(ranks)]
    for r, g in enumerate(groups):
        cfg = _config(ranks, r, tile=TILE)
        layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="sm90",
                                 group=g)
        modules.append(ops.MoEModule(layer))
    compiled = [torch.compile(m, fullgraph=True) for m in modules]
    statics = None
    graph = None
    for seed in (1, 2, 3):
        want, host = _one_layer_reference(RANK_TOKENS, seed)
        parts = [_cuda(*p) for p in _split(host, RANK_TOKENS)]
        calls = [lambda m=m, p=p: m(*p) for m, p in zip(modules, parts)]
        eager = _on_streams(streams, calls)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(np.concatenate([_bits(y) for y in eager]), want,
                                      err_msg=f"eager {seed}")
        calls = [lambda c=c, p=p: c(*p) for c, p in zip(compiled, parts)]
        got = _on_streams(streams, calls)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(np.concatenate([_bits(y) for y in got]), want,
                                      err_msg=f"compiled {seed}")
        if graph is None:
            statics = [tuple(t.clone() for t in p) for p in parts]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_out = _on_streams(streams, [lambda m=m, p=p: m(*p)
                                                  for m, p in zip(modules, statics)])
            continue
        for static, p in zip(statics, parts):
            for dst, src in zip(static, p):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for m, s in zip(modules, streams):
            m.layer.check_errors(s)
        np.testing.assert_array_equal(np.concatenate([_bits(y) for y in graph_out]), want,
                                      err_msg=f"graph {seed}")


def test_virtual_ranks_through_the_compat_api():
    ranks = len(RANK_TOKENS)
    base = _config(tile=TILE)
    h, i = base.shape.hidden, base.shape.intermediate
    e, k = base.shape.num_experts, base.shape.top_k
    bufs = mega.get_symm_buffers_for_virtual_ranks(ranks, e, CAP, k, h, i, timeout_s=TIMEOUT_S,
                                                   layer_options={"gemm_tile": TILE})
    assert [(b.rank, b.num_ranks) for b in bufs] == [(0, 2), (1, 2)]
    pairs = [mega.transform_weights_for_mega_moe(*_deepgemm_weights(_config(ranks, r, tile=TILE)))
             for r in range(ranks)]
    ys = [torch.empty((t, h), dtype=torch.bfloat16, device="cuda") for t in RANK_TOKENS]
    with pytest.raises(megamoe.InvalidArgumentError, match="prepare_mega_moe_layer"):
        mega.fp8_fp4_mega_moe(ys[0], *pairs[0], bufs[0])  # unbound virtual rank: refused
    for (l1, l2), b in zip(pairs, bufs):
        mega.prepare_mega_moe_layer(l1, l2, b)

    def call(r):
        mega.fp8_fp4_mega_moe(ys[r], *pairs[r], bufs[r])
        return ys[r]

    compiled = torch.compile(call, fullgraph=True)
    graph = None
    for seed in (1, 2, 3):
        want, host = _one_layer_reference(RANK_TOKENS, seed)
        for b, part in zip(bufs, _split(host, RANK_TOKENS)):
            _load(b, _fp8_inputs(*part)[0])
        for name, fn in (("eager", call), ("compiled", compiled)):
            for y in ys:
                y.fill_(0)
            _on_streams(streams_for(ranks), [lambda r=r: fn(r) for r in range(ranks)])
            torch.cuda.synchronize()
            np.testing.assert_array_equal(np.concatenate([_bits(y) for y in ys]), want,
                                          err_msg=f"{name} {seed}")
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _on_streams(streams_for(ranks), [lambda r=r: call(r) for r in range(ranks)])
            continue
        for y in ys:
            y.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        for (l1, _), s in zip(pairs, streams_for(ranks)):
            mega.get_layer(l1).check_errors(s)
        np.testing.assert_array_equal(np.concatenate([_bits(y) for y in ys]), want,
                                      err_msg=f"graph {seed}")

