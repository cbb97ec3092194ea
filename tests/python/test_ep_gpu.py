"""Expert parallelism with virtual ranks (R ranks on one GPU) through Python and torch streams.

Skipped, with the reason printed by `pytest -rs`, where torch, a CUDA device or the sm90 backend
is missing. Checks:

* R = 1, 2, 4 ranks, each with its slice of the experts and its own tokens, give the EP = 1
  layer's output on the concatenation of all ranks' tokens: bit for bit on a forced GEMM tile,
  within the summation-order tolerance on the automatic policy (which may pick another tile for
  a rank's row counts than for all rows at once; "serial" is not one tile either, it picks among
  the serial tiles by rows). Each rank's call goes on its own torch stream, all in flight before
  anything waits; uniform, skewed and adversarial routing, empty slots, ranks with T = 0.
* expert_rows() of rank r is the EP = 1 layer's row counts of experts [r E/R, (r+1) E/R).
* A rank called above its capacity raises OutOfRangeError at once; the others raise it naming
  that rank at check_errors().
* A rank that never calls: the others raise megamoe.TimeoutError at check_errors(), the group is
  broken and every later forward() raises TimeoutError.

Why a forced tile gives the same bits: every output row of a tile is its own dot products over K
in the tile's K order (no split-K on a forced tile), quantization is per token and the combine
adds a token's slots in ascending k on every path, so which rows share a launch does not matter.
"""

import numpy as np
import pytest

import megamoe

from conftest import sm90_torch_skip_reason, torch

SKIP_REASON = sm90_torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

CAPACITY = 64  # max_tokens_per_rank of every rank
SEED = 9
# Tokens per rank for each R: a full rank, uneven ones and one with T = 0.
TOKENS = {1: [CAPACITY], 2: [CAPACITY, 37], 4: [CAPACITY, 0, 23, 50]}
# The tiles test_sm90_layer.cu forces: one of each kind (decode on warp MMAs, prefill staged).
FIXED_TILES = ("decode_128x16_k2_warp", "prefill_256x128_k2_staged")


def _bits(t):
    """bf16 torch tensor (any device) -> numpy uint16 bits."""
    return t.detach().cpu().view(torch.int16).numpy().view(np.uint16)


def _to_torch_bf16(x_bits):
    return torch.from_numpy(np.ascontiguousarray(x_bits).view(np.int16)).view(torch.bfloat16).cuda()


def _config(tile, ep_size=1, ep_rank=0, capacity=CAPACITY):
    return megamoe.LayerConfig("small", max_tokens_per_rank=capacity, gemm_tile=tile,
                               ep_size=ep_size, ep_rank=ep_rank)


def _workload(cfg, tokens, routing, seed=SEED, empty_slots=False):
    x = megamoe.synthetic_activations(tokens, cfg.shape.hidden, seed)
    idx, w = megamoe.make_routing(routing, tokens, cfg.shape.num_experts, cfg.shape.top_k, seed)
    if empty_slots and tokens > 3:
        idx[1, -1] = -1
        idx[3, :] = -1  # a token without a valid slot: a zero row
    return _to_torch_bf16(x), torch.from_numpy(idx).cuda(), torch.from_numpy(w).cuda()


class EpRanks:
    """R virtual ranks of one layer: groups, per-rank layers (rank r's synthetic slice) and
    streams."""

    def __init__(self, size, tile, capacity=CAPACITY, timeout_s=10.0):
        self.size = size
        self.groups = megamoe.ep.virtual_group(size, _config(tile, capacity=capacity),
                                               timeout_s=timeout_s)
        self.layers = []
        for r, g in enumerate(self.groups):
            cfg = _config(tile, size, r, capacity)
            self.layers.append(megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED),
                                                backend="sm90", group=g))
        self.streams = [torch.cuda.Stream() for _ in range(size)]

    def forward(self, xs, idxs, ws):
        """Every rank's call on its own stream, all enqueued before anything waits; returns the
        outputs once every stream is done and checked."""
        current = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(current)  # the inputs were made on the current stream
        ys = []
        for r in range(self.size):
            with torch.cuda.stream(self.streams[r]):
                ys.append(self.layers[r].forward(xs[r], idxs[r], ws[r]))
        torch.cuda.synchronize()
        for r in range(self.size):
            self.layers[r].check_errors(self.streams[r])
        return ys


def _split(tensors, counts):
    x, idx, w = tensors
    bounds = np.cumsum([0] + counts)
    parts = [(x[a:b], idx[a:b], w[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return [list(p) for p in zip(*parts)]


_CACHE = {}


@pytest.fixture(scope="module", autouse=True)
def _release_cached_layers():
    """Frees the cached groups and layers at the end of this module, while CUDA is still up."""
    yield
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
    _CACHE.clear()


def _ranks(size, tile):
    """EpRanks per (R, tile), built once: the layers are reused across routings (every call is
    made on every rank, so their groups stay in step)."""
    key = (size, tile)
    if key not in _CACHE:
        _CACHE[key] = EpRanks(size, tile)
    return _CACHE[key]


def _single(tile):
    """The EP = 1 layer without a group, sized for all ranks' tokens of the largest R."""
    key = ("single", tile)
    if key not in _CACHE:
        cfg = _config(tile, capacity=max(sum(c) for c in TOKENS.values()))
        _CACHE[key] = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, SEED), backend="sm90")
    return _CACHE[key]


def _run_both(size, tile, routing, empty_slots):
    counts = TOKENS[size]
    single = _single(tile)
    inputs = _workload(single.config, sum(counts), routing, empty_slots=empty_slots)
    want = single.forward(*inputs)
    want_rows = single.expert_rows()
    ranks = _ranks(size, tile)
    ys = ranks.forward(*_split(inputs, counts))
    for r, (y, t) in enumerate(zip(ys, counts)):
        assert tuple(y.shape) == (t, single.config.shape.hidden), f"rank {r}"
    return _bits(want), _bits(torch.cat(ys)), want_rows, ranks


@pytest.mark.parametrize("empty_slots", [False, True])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "adversarial"])
@pytest.mark.parametrize("tile", FIXED_TILES)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_ranks_equal_one_layer_bitwise_on_a_fixed_tile(size, tile, routing, empty_slots):
    want, got, want_rows, ranks = _run_both(size, tile, routing, empty_slots)
    mismatches = int(np.count_nonzero(want != got))
    assert mismatches == 0, (f"R={size} tile={tile} routing={routing}: {mismatches} of "
                             f"{want.size} output values differ from the EP = 1 layer")
    e_local = len(want_rows) // size
    for r, layer in enumerate(ranks.layers):
        assert layer.expert_rows(ranks.streams[r]) == want_rows[r * e_local:(r + 1) * e_local], \
            f"expert_rows of rank {r}"


@pytest.mark.parametrize("routing", ["uniform", "adversarial"])
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_equal_one_layer_closely_on_the_automatic_tiles(size, routing):
    want, got, _, _ = _run_both(size, "auto", routing, empty_slots=True)
    d = megamoe.diff_metric(megamoe.bf16_to_f32(got).astype(np.float64),
                            megamoe.bf16_to_f32(want).astype(np.float64))
    assert d < 1e-4, f"R={size} routing={routing}: diff {d} (FP32 summation order only)"


def test_every_rank_with_no_tokens():
    ranks = _ranks(4, FIXED_TILES[0])
    h, k = ranks.layers[0].config.shape.hidden, ranks.layers[0].config.shape.top_k
    empty = [(torch.empty((0, h), dtype=torch.bfloat16, device="cuda"),
              torch.empty((0, k), dtype=torch.int32, device="cuda"),
              torch.empty((0, k), dtype=torch.float32, device="cuda")) for _ in range(4)]
    ys = ranks.forward(*[list(p) for p in zip(*empty)])
    assert all(tuple(y.shape) == (0, h) for y in ys)
    assert all(sum(layer.expert_rows(s)) == 0 for layer, s in zip(ranks.layers, ranks.streams))


def test_a_rank_above_capacity():
    tile = FIXED_TILES[0]
    ranks = EpRanks(2, tile, capacity=16)
    cfg = ranks.layers[0].config
    over = _workload(cfg, 17, "uniform", seed=1)
    fine = _workload(cfg, 8, "uniform", seed=2)
    for s in ranks.streams:
        s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ranks.streams[1]):
        ranks.layers[1].forward(*fine)
    with torch.cuda.stream(ranks.streams[0]):
        with pytest.raises(megamoe.OutOfRangeError, match="num_tokens 17 exceeds the layer "
                           "capacity max_tokens_per_rank = 16"):
            ranks.layers[0].forward(*over)  # raises at once, after taking part with T = 0
    torch.cuda.synchronize()
    with pytest.raises(megamoe.OutOfRangeError, match="rank 0 called the layer with T = 17 "
                       "tokens, above max_tokens_per_rank = 16"):
        ranks.layers[1].check_errors(ranks.streams[1])
    ranks.layers[0].check_errors(ranks.streams[0])  # rank 0 raised already: not a second time
    # Not a timeout: the group stays usable, and the next call is right on both ranks.
    assert not any(g.broken for g in ranks.groups)
    x, idx, w = _workload(cfg, 24, "skewed", seed=3)
    ys = ranks.forward([x[:16], x[16:]], [idx[:16], idx[16:]], [w[:16], w[16:]])
    single_cfg = _config(tile, capacity=24)
    single = megamoe.MoELayer(single_cfg, megamoe.synthetic_weights(single_cfg, SEED),
                              backend="sm90")
    np.testing.assert_array_equal(_bits(torch.cat(ys)), _bits(single.forward(x, idx, w)))


def test_a_rank_that_never_calls_times_out():
    ranks = EpRanks(2, FIXED_TILES[0], capacity=16, timeout_s=0.2)
    cfg = ranks.layers[0].config
    inputs = _workload(cfg, 8, "uniform")
    s0 = ranks.streams[0]
    s0.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s0):
        ranks.layers[0].forward(*inputs)  # rank 1 never calls; this does not wait
    with pytest.raises(megamoe.TimeoutError, match=r"EP rank 0 of 2: timed out after 0\.2 s .*"
                       r"waiting for rank 1") as info:
        ranks.layers[0].check_errors(s0)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, megamoe.Error)
    assert ranks.groups[0].broken
    with torch.cuda.stream(s0):
        with pytest.raises(megamoe.TimeoutError, match="unusable"):
            ranks.layers[0].forward(*inputs)
    # A new layer on the broken group is refused before it takes the weights.
    w = megamoe.synthetic_weights(cfg, SEED)
    with pytest.raises(megamoe.TimeoutError, match="make a new group"):
        megamoe.MoELayer(cfg, w, group=ranks.groups[0])
    assert not w.consumed
