"""megamoe.deep_gemm_compat on the CPU backend: DeepGEMM's Mega MoE call shapes, served by megamoe.

Skipped where torch is missing (the module is torch-only). Checks:

* transform_sf_into_required_layout packs float32 UE8M0 scales exactly as DeepGEMM documents
  its SM100 layout (4 groups per int32, group 4j lowest, MN-major strides aligned to 4 rows),
  written out here by hand, and refuses what megamoe cannot represent.
* transform_weights_for_mega_moe recovers megamoe's canonical weights from every scale form it
  takes (packed int32, float32, uint8) and from DeepGEMM's transformed tensors; the transformed
  tensors, built here by DeepGEMM's documented rules (gate/up interleave by 8, scale rows
  transposed within 128-row blocks), are byte for byte megamoe's "blackwell-interop" layout.
* fp8_fp4_mega_moe on FP8 codes + packed scales equals the CPU reference fed those codes and
  scales directly, bit for bit, for swiglu, clamped swiglu and SiTU, also when the codes do not
  reach the top binade (megamoe requantizes the dequantized values with another scale: the same
  values), and when called through torch.compile(fullgraph=True).
* cumulative_local_expert_recv_stats, a one-rank torch.distributed group (gloo), the binding
  rules and every documented error.
"""

import gc
import socket

import numpy as np
import pytest

import megamoe
from conftest import make_inputs

torch = pytest.importorskip("torch", reason="megamoe.deep_gemm_compat needs torch")
mega = pytest.importorskip("megamoe.deep_gemm_compat")

H, I, E, K = 128, 64, 8, 3
SEED = 5
CAP = 16


def _config(activation="swiglu", fast_math=False, shape=(H, I, E, K), capacity=CAP):
    return megamoe.LayerConfig(megamoe.LayerShape(*shape), activation=activation,
                               fast_math=fast_math, max_tokens_per_rank=capacity)


def _cpu_buffer(*args, **kwargs):
    """A SymmBuffer on the CPU backend: these tests hand CPU tensors over, also on a GPU machine
    (test_torch_gpu.py runs the same calls on the sm90 backend)."""
    kwargs.setdefault("backend", "cpu")
    return mega.get_symm_buffer_for_mega_moe(*args, **kwargs)


def _canonical(shape=(H, I, E, K), seed=SEED):
    """numpy canonical arrays (w13, w13_sf, w2, w2_sf) of synthetic weights."""
    w = megamoe.synthetic_weights(_config(shape=shape), seed)
    return tuple(w.array(n) for n in ("w13", "w13_sf", "w2", "w2_sf"))


# ------------------------------------------------------------------------------------------------
# DeepGEMM's documented conventions, written out independently of megamoe.deep_gemm_compat
# ------------------------------------------------------------------------------------------------
def dg_pack(sf_bytes):
    """uint8 [E, N, G] -> DeepGEMM's SM100 weight scale layout: int32 [E, N, ceil(G/4)] whose
    word (e, n, j) holds groups 4j..4j+3 (4j in the low byte), stored MN-major with the row
    stride aligned to 4."""
    e, n, g = sf_bytes.shape
    words = (g + 3) // 4
    n_al = (n + 3) // 4 * 4
    store = np.zeros((e, words, n_al), dtype=np.int64)
    for j in range(words):
        for byte in range(4):
            col = 4 * j + byte
            if col < g:
                store[:, j, :n] |= sf_bytes[:, :, col].astype(np.int64) << (8 * byte)
    store = torch.from_numpy(store.astype(np.uint32).view(np.int32))
    return store.transpose(1, 2)[:, :n]  # [E, N, words], strides (words * n_al, 1, n_al)


def dg_interleave(t):
    """[E, 2I, ...] gate rows then up rows -> gate 0-7, up 0-7, gate 8-15, up 8-15, ..."""
    e, n = t.shape[:2]
    rest = tuple(t.shape[2:])
    gate = t[:, : n // 2].reshape(e, n // 16, 8, *rest)
    up = t[:, n // 2:].reshape(e, n // 16, 8, *rest)
    return torch.stack([gate, up], dim=2).reshape(e, n, *rest)


def dg_utccp(sf):
    """Within each 128-row block, row 32a + b moves to row 4b + a."""
    e, n, p = sf.shape
    return sf.reshape(e, n // 128, 4, 32, p).transpose(2, 3).reshape(e, n, p)


def _packed_x_sf(sf_bytes):
    """uint8 [T, G] -> int32 [T, ceil(G/4)] packed per token (x_sf of DeepGEMM's buffer)."""
    t, g = sf_bytes.shape
    padded = np.zeros((t, (g + 3) // 4 * 4), dtype=np.uint8)
    padded[:, :g] = sf_bytes
    return torch.from_numpy(padded.view("<i4").copy())


def _bits(y):
    return y.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _transform(canon, activation="swiglu", form="int32"):
    w13, w13_sf, w2, w2_sf = (torch.from_numpy(a) for a in canon)
    if form == "int32":
        s13, s2 = dg_pack(canon[1]), dg_pack(canon[3])
    elif form == "float32":
        s13 = torch.ldexp(torch.ones(w13_sf.shape), w13_sf.long() - 127).float()
        s2 = torch.ldexp(torch.ones(w2_sf.shape), w2_sf.long() - 127).float()
    else:
        s13, s2 = w13_sf, w2_sf
    return mega.transform_weights_for_mega_moe((w13.view(torch.int8), s13),
                                               (w2.view(torch.int8), s2), activation)


def _inputs(t, seed):
    """make_inputs(), also for T = 0."""
    if t == 0:
        return (np.zeros((0, H), np.uint16), np.zeros((0, K), np.int32),
                np.zeros((0, K), np.float32))
    return make_inputs(_config(), t, seed)


def _load_inputs(buf, q, sf, idx, w):
    t = q.shape[0]
    buf.x[:t].copy_(torch.from_numpy(q).view(torch.float8_e4m3fn))
    buf.x_sf[:t].copy_(_packed_x_sf(sf))
    buf.topk_idx[:t].copy_(torch.from_numpy(idx).long())
    buf.topk_weights[:t].copy_(torch.from_numpy(w))


def _reference(spec, fast_math, q, sf, idx, w):
    cfg = _config(spec, fast_math)
    return megamoe.reference_forward_quantized(cfg, megamoe.synthetic_weights(cfg, SEED), q, sf,
                                               idx, w)


# ------------------------------------------------------------------------------------------------
# Scale factors and weights
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [128, 96, 352])  # 4 groups, 3 (one padded), 11 (a padded word)
def test_sf_layout_is_deepgemm_sm100_packing(k):
    rng = np.random.default_rng(1)
    n, e = 30, 2  # rows not a multiple of 4: the MN stride is aligned to 32
    b = rng.integers(90, 150, (e, n, k // 32)).astype(np.uint8)
    sf = torch.ldexp(torch.ones(b.shape), torch.from_numpy(b).long() - 127).float()
    got = mega.transform_sf_into_required_layout(sf, n, k, (1, 32), e)
    want = dg_pack(b)
    assert got.dtype == torch.int32 and tuple(got.shape) == tuple(want.shape)
    assert got.stride() == want.stride() == (want.shape[2] * 32, 1, 32)
    assert torch.equal(got, want)
    # 2-D input (one group), the 3-element recipe, int32 input returned as it is
    two_d = mega.transform_sf_into_required_layout(sf[1], n, k, (1, 1, 32), is_sfa=False)
    assert torch.equal(two_d, want[1])
    assert mega.transform_sf_into_required_layout(got, n, k, (1, 32), e) is got


def test_sf_layout_errors():
    sf = torch.ones((2, 8, 4))
    with pytest.raises(megamoe.UnsupportedError, match="recipe"):
        mega.transform_sf_into_required_layout(sf, 8, 128, (1, 128), 2)
    with pytest.raises(megamoe.UnsupportedError, match="recipe"):
        mega.transform_sf_into_required_layout(sf, 8, 128, (1, 32), 2, disable_ue8m0_cast=True)
    with pytest.raises(megamoe.InvalidArgumentError, match="is_sfa"):
        mega.transform_sf_into_required_layout(sf, 8, 128, (1, 1, 32), 2)
    bad = sf.clone()
    bad[1, 3, 2] = 0.75
    with pytest.raises(megamoe.InvalidArgumentError, match=r"powers of two.*0\.75.*\(1, 3, 2\)"):
        mega.transform_sf_into_required_layout(bad, 8, 128, (1, 32), 2)
    bad[1, 3, 2] = -1.0
    with pytest.raises(megamoe.InvalidArgumentError, match="powers of two"):
        mega.transform_sf_into_required_layout(bad, 8, 128, (1, 32), 2)
    with pytest.raises(megamoe.InvalidArgumentError, match="sf: expected shape"):
        mega.transform_sf_into_required_layout(sf, 8, 96, (1, 32), 2)


@pytest.mark.parametrize("form", ["int32", "float32", "uint8"])
def test_transform_recovers_canonical_weights(form):
    canon = _canonical()
    l1, l2 = _transform(canon, form=form)
    assert [r.name for r in l1 + l2] == ["w13", "w13_sf", "w2", "w2_sf"]
    got = l1[0].owner.arrays
    for name, a, b in zip(("w13", "w13_sf", "w2", "w2_sf"), got, canon):
        np.testing.assert_array_equal(a.numpy(), b, err_msg=name)


def test_float_scale_byte_zero_is_two_to_minus_127():
    canon = list(_canonical())
    canon[3] = canon[3].copy()
    canon[3][0, 0, 0] = 0
    l1, _ = _transform(tuple(canon), form="float32")
    assert l1[0].owner.arrays[3][0, 0, 0].item() == 0


def test_deepgemm_transformed_tensors_are_blackwell_interop_and_convert_back():
    canon = _canonical()
    w13, w13_sf, w2, w2_sf = (torch.from_numpy(a) for a in canon)
    # DeepGEMM's transform of the Blackwell inputs, by its documented rules
    t13 = dg_interleave(w13.view(torch.int8))
    t13_sf = torch.empty_like(dg_pack(canon[1])).copy_(dg_utccp(dg_interleave(dg_pack(canon[1]))))
    t2_sf = torch.empty_like(dg_pack(canon[3])).copy_(dg_utccp(dg_pack(canon[3])))
    # ... is megamoe's blackwell-interop layout, byte for byte
    prepared = megamoe.synthetic_weights(_config(), SEED)
    megamoe.prepare(prepared, "blackwell-interop")
    raw = {n: prepared.array(n) for n in ("w13", "w13_sf", "w2", "w2_sf")}

    def storage_bytes(sf):  # MN-major int32 [E, N, P] -> its bytes in memory order
        return sf.transpose(1, 2).contiguous().view(torch.uint8).numpy().reshape(-1)

    np.testing.assert_array_equal(t13.contiguous().view(torch.uint8).numpy().reshape(-1),
                                  raw["w13"])
    np.testing.assert_array_equal(storage_bytes(t13_sf), raw["w13_sf"])
    np.testing.assert_array_equal(w2.numpy().reshape(-1), raw["w2"])
    np.testing.assert_array_equal(storage_bytes(t2_sf), raw["w2_sf"])
    # and transformed=True takes them back to canonical
    l1, l2 = mega.transform_weights_for_mega_moe((t13, t13_sf), (w2.view(torch.int8), t2_sf),
                                                 transformed=True)
    for name, a, b in zip(("w13", "w13_sf", "w2", "w2_sf"), l1[0].owner.arrays, canon):
        np.testing.assert_array_equal(a.numpy(), b, err_msg=name)


def test_transform_errors():
    w13, w13_sf, w2, w2_sf = (torch.from_numpy(a) for a in _canonical())
    s13, s2 = dg_pack(w13_sf.numpy()), dg_pack(w2_sf.numpy())
    t = mega.transform_weights_for_mega_moe
    with pytest.raises(megamoe.UnsupportedError, match="BF16 expert weights"):
        t(torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I))
    with pytest.raises(megamoe.DTypeError, match=r"l1_weights\[0\].*int8 or uint8"):
        t((w13.float(), s13), (w2, s2))
    with pytest.raises(megamoe.InvalidArgumentError,
                       match=r"l2_weights\[0\]: expected \[8, 128, 32\]"):
        t((w13, s13), (w2[:, :64], s2))
    with pytest.raises(megamoe.InvalidArgumentError, match=r"l1_weights\[1\]: expected shape"):
        t((w13, s13[:, :64]), (w2, s2))
    with pytest.raises(megamoe.DTypeError, match=r"l2_weights\[1\].*scale factors"):
        t((w13, s13), (w2, s2.to(torch.int64)))
    with pytest.raises(megamoe.UnsupportedError, match="activation.*gelu"):
        t((w13, s13), (w2, s2), "gelu")
    with pytest.raises(megamoe.DTypeError, match="transformed scale factors are packed int32"):
        t((w13, w13_sf), (w2, w2_sf), transformed=True)
    canon96 = _canonical(shape=(H, 96, E, K))  # 2I = 192 rows: not whole 128-row blocks
    a, b, c, d = (torch.from_numpy(x) for x in canon96)
    with pytest.raises(megamoe.InvalidArgumentError, match="N % 128"):
        t((a, dg_pack(canon96[1])), (c, dg_pack(canon96[3])), transformed=True)


# ------------------------------------------------------------------------------------------------
# The layer call
# ------------------------------------------------------------------------------------------------
ACTIVATIONS = [
    # (DeepGEMM keywords, megamoe spec, fast_math)
    (dict(activation="swiglu"), "swiglu", False),
    (dict(activation="swiglu", activation_clamp=7.3), "swiglu:clamp=7.3", True),
    (dict(activation="swiglu", activation_clamp=float("inf")), "swiglu", False),
    (dict(activation="situ", situ_beta=4.0, situ_linear_beta=25.0), "situ", False),
    (dict(activation="situ", situ_beta=0.5, situ_linear_beta=2.0),
     "situ:beta=0.5,linear_beta=2", True),
    (dict(activation="situ"), "situ:beta=4,linear_beta=25", False),  # Kimi-K3's defaults
]


@pytest.mark.parametrize("kwargs,spec,fast_math", ACTIVATIONS)
def test_call_equals_reference_on_the_fp8_inputs(kwargs, spec, fast_math):
    l1, l2 = _transform(_canonical(), kwargs["activation"])
    buf = _cpu_buffer(None, E, CAP, K, H, I,
                                            activation=kwargs["activation"])
    for t, seed in ((CAP, 11), (5, 12), (0, 13)):
        x, idx, w = _inputs(t, seed)
        q, sf = megamoe.quantize_input(x)
        _load_inputs(buf, q, sf, idx, w)
        y = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
        mega.fp8_fp4_mega_moe(y, l1, l2, buf, fast_math=fast_math, **kwargs)
        np.testing.assert_array_equal(_bits(y), _reference(spec, fast_math, q, sf, idx, w),
                                      err_msg=f"{spec}, T = {t}")
    layer = mega.get_layer(l1)
    assert isinstance(layer, megamoe.MoELayer) and layer.backend == "cpu"
    assert str(layer.config.activation) == str(megamoe.Activation.parse(spec))


def test_codes_below_the_top_binade_give_the_same_values():
    """Codes of at most 224 with scale bytes in [105, 246]: megamoe's quantizer picks a smaller
    scale for such groups, the values (and so y) stay those of the given codes and scales."""
    rng = np.random.default_rng(3)
    t = 12
    x, idx, w = make_inputs(_config(), t, 14)
    magnitudes = np.array([0x00, 0x01, 0x07, 0x20, 0x33, 0x48, 0x5F, 0x6E], dtype=np.uint8)
    q = rng.choice(magnitudes, (t, H)) | (rng.integers(0, 2, (t, H)) << 7).astype(np.uint8)
    sf = rng.integers(105, 135, (t, H // 32)).astype(np.uint8)
    sf[0, 0], sf[0, 1] = 105, 127
    sf[1, :] = 246  # the largest byte whose values fit BF16: outputs are Inf/NaN, as the reference
    l1, l2 = _transform(_canonical())
    buf = _cpu_buffer(None, E, CAP, K, H, I)
    _load_inputs(buf, q, sf, idx, w)
    y = torch.empty((t, H), dtype=torch.bfloat16)
    mega.fp8_fp4_mega_moe(y, l1, l2, buf, fast_math=False)
    np.testing.assert_array_equal(_bits(y), _reference("swiglu", False, q, sf, idx, w))
    # the dequantized input itself is exact
    xb = mega.dequantize_x(buf.x[:t], buf.x_sf[:t], H).float().numpy()
    want = megamoe.dequantize_fp8(q, sf)
    np.testing.assert_array_equal(xb, want)


def test_cumulative_recv_stats_add_rows_per_expert():
    l1, l2 = _transform(_canonical())
    buf = _cpu_buffer(None, E, CAP, K, H, I)
    stats = torch.arange(E, dtype=torch.int32)
    want = stats.clone()
    for t, seed in ((9, 1), (CAP, 2)):
        x, idx, w = make_inputs(_config(), t, seed)
        q, sf = megamoe.quantize_input(x)
        _load_inputs(buf, q, sf, idx, w)
        mega.fp8_fp4_mega_moe(torch.empty((t, H), dtype=torch.bfloat16), l1, l2, buf,
                              cumulative_local_expert_recv_stats=stats)
        valid = idx[idx >= 0]
        want += torch.from_numpy(np.bincount(valid, minlength=E).astype(np.int32))
        assert torch.equal(stats, want)


def test_compiled_call_equals_eager():
    """torch.compile(fullgraph=True) of an engine-style step: copy the FP8 inputs into the
    buffer, call fp8_fp4_mega_moe into a preallocated y; bit for bit the eager result, at two
    token counts."""
    l1, l2 = _transform(_canonical(), "situ")
    buf = _cpu_buffer(None, E, CAP, K, H, I, activation="situ")
    stats = torch.zeros(E, dtype=torch.int32)

    def step(x_q, x_sf, idx, w, y):
        t = y.shape[0]
        buf.x[:t].copy_(x_q)
        buf.x_sf[:t].copy_(x_sf)
        buf.topk_idx[:t].copy_(idx)
        buf.topk_weights[:t].copy_(w)
        mega.fp8_fp4_mega_moe(y, l1, l2, buf, cumulative_local_expert_recv_stats=stats,
                              activation="situ", situ_beta=4.0, situ_linear_beta=25.0)
        return y * 1  # something after the op, so the graph reads its result

    compiled = torch.compile(step, fullgraph=True)
    for t, seed in ((CAP, 21), (7, 22)):
        x, idx, w = make_inputs(_config(), t, seed)
        q, sf = megamoe.quantize_input(x)
        args = (torch.from_numpy(q).view(torch.float8_e4m3fn), _packed_x_sf(sf),
                torch.from_numpy(idx).long(), torch.from_numpy(w))
        before = stats.clone()
        eager = step(*args, torch.empty((t, H), dtype=torch.bfloat16))
        counted = stats - before
        y = torch.empty((t, H), dtype=torch.bfloat16)
        got = compiled(*args, y)
        np.testing.assert_array_equal(_bits(got), _bits(eager), err_msg=f"T = {t}")
        np.testing.assert_array_equal(_bits(y), _bits(eager), err_msg=f"y, T = {t}")
        assert torch.equal(stats - before, 2 * counted)  # the compiled call counted too


def test_one_rank_torch_distributed_group():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        buf = _cpu_buffer(dist.group.WORLD, E, CAP, K, H, I)
        assert (buf.rank, buf.num_ranks, buf.ep_group) == (0, 1, None)
        l1, l2 = _transform(_canonical())
        x, idx, w = make_inputs(_config(), 6, 31)
        q, sf = megamoe.quantize_input(x)
        _load_inputs(buf, q, sf, idx, w)
        y = torch.empty((6, H), dtype=torch.bfloat16)
        mega.fp8_fp4_mega_moe(y, l1, l2, buf)
        np.testing.assert_array_equal(_bits(y), _reference("swiglu", True, q, sf, idx, w))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Binding and errors
# ------------------------------------------------------------------------------------------------
def _bound():
    l1, l2 = _transform(_canonical())
    buf = _cpu_buffer(None, E, CAP, K, H, I)
    x, idx, w = make_inputs(_config(), 4, 41)
    q, sf = megamoe.quantize_input(x)
    _load_inputs(buf, q, sf, idx, w)
    return l1, l2, buf


def test_first_call_fixes_activation_and_fast_math():
    l1, l2, buf = _bound()
    y = torch.empty((4, H), dtype=torch.bfloat16)
    layer = mega.prepare_mega_moe_layer(l1, l2, buf, activation_clamp=10.0, fast_math=True)
    assert mega.get_layer(l1) is layer and l1[0].owner.arrays is None  # moved into the layer
    mega.fp8_fp4_mega_moe(y, l1, l2, buf, activation_clamp=10.0)
    with pytest.raises(megamoe.InvalidArgumentError, match="swiglu:clamp=10.*fast_math"):
        mega.fp8_fp4_mega_moe(y, l1, l2, buf, activation_clamp=7.0)
    with pytest.raises(megamoe.InvalidArgumentError, match="fast_math=False"):
        mega.fp8_fp4_mega_moe(y, l1, l2, buf, activation_clamp=10.0, fast_math=False)
    other = _cpu_buffer(None, E, CAP, K, H, I)
    with pytest.raises(megamoe.InvalidArgumentError, match="another SymmBuffer"):
        mega.fp8_fp4_mega_moe(y, l1, l2, other, activation_clamp=10.0)


def test_call_errors():
    l1, l2, buf = _bound()
    y = torch.empty((4, H), dtype=torch.bfloat16)
    call = mega.fp8_fp4_mega_moe
    with pytest.raises(megamoe.UnsupportedError, match="recipe"):
        call(y, l1, l2, buf, recipe=(1, 1, 128))
    with pytest.raises(megamoe.UnsupportedError, match="shared experts"):
        call(y, l1, l2, buf, shared_l1_weights=(y, y), shared_l2_weights=(y, y))
    with pytest.raises(megamoe.InvalidArgumentError, match="l1_weights: expected the pair"):
        call(y, (torch.zeros(1), torch.zeros(1)), l2, buf)
    with pytest.raises(megamoe.UnsupportedError, match="BF16 expert weights"):
        call(y, torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), l2, buf)
    with pytest.raises(megamoe.InvalidArgumentError, match="l1_weights: expected the \\(w13"):
        call(y, l2, l1, buf)
    other_l1, other_l2 = _transform(_canonical())
    with pytest.raises(megamoe.InvalidArgumentError, match="l2_weights: from another"):
        call(y, l1, other_l2, buf)
    with pytest.raises(megamoe.InvalidArgumentError, match="sym_buffer"):
        call(y, l1, l2, object())
    with pytest.raises(megamoe.DTypeError, match="y: expected bfloat16"):
        call(y.float(), l1, l2, buf)
    with pytest.raises(megamoe.InvalidArgumentError, match=r"y: expected \[T, 128\]"):
        call(y[:, :64], l1, l2, buf)
    with pytest.raises(megamoe.OutOfRangeError, match="17 tokens exceed"):
        call(torch.empty((CAP + 1, H), dtype=torch.bfloat16), l1, l2, buf)
    with pytest.raises(megamoe.DTypeError, match="recv_stats: expected int32"):
        call(y, l1, l2, buf, cumulative_local_expert_recv_stats=torch.zeros(E))
    with pytest.raises(megamoe.InvalidArgumentError, match="recv_stats: expected a contiguous"):
        call(y, l1, l2, buf, cumulative_local_expert_recv_stats=torch.zeros(E - 1,
                                                                            dtype=torch.int32))
    with pytest.raises(megamoe.InvalidArgumentError, match="activation_clamp: SiTU takes no"):
        call(y, l1, l2, buf, activation="situ", activation_clamp=7.0)
    with pytest.raises(megamoe.InvalidArgumentError, match="situ_beta: only for"):
        call(y, l1, l2, buf, situ_beta=1.0)
    with pytest.raises(megamoe.InvalidArgumentError, match="activation_clamp: expected a value"):
        call(y, l1, l2, buf, activation_clamp=-1.0)
    with pytest.raises(megamoe.UnsupportedError, match="'gelu'"):
        call(y, l1, l2, buf, activation="gelu")
    # the weights were transformed for swiglu
    with pytest.raises(megamoe.InvalidArgumentError, match="transformed for 'swiglu'"):
        call(y, l1, l2, buf, activation="situ")
    # the buffer was made for swiglu too
    s1, s2 = _transform(_canonical(), "situ")
    with pytest.raises(megamoe.InvalidArgumentError, match="the buffer was made for 'swiglu'"):
        call(y, s1, s2, buf, activation="situ")
    # a bad SiTU parameter is megamoe's own activation check
    situ_buf = _cpu_buffer(None, E, CAP, K, H, I, activation="situ")
    with pytest.raises(megamoe.InvalidArgumentError, match="beta"):
        call(y, s1, s2, situ_buf, activation="situ", situ_beta=-1.0)
    with pytest.raises(megamoe.UnsupportedError, match="bf16_mega_moe"):
        mega.bf16_mega_moe(y, l1, l2, buf)
    # nothing above bound the weights
    assert mega.get_layer(l1) is None


def test_buffer_errors():
    b = mega.get_symm_buffer_for_mega_moe
    with pytest.raises(megamoe.UnsupportedError, match="mma_type"):
        b(None, E, CAP, K, H, I, mma_type="bf16xbf16")
    with pytest.raises(megamoe.UnsupportedError, match="use_fp8_dispatch"):
        b(None, E, CAP, K, H, I, use_fp8_dispatch=False)
    with pytest.raises(megamoe.UnsupportedError, match="num_shared_experts"):
        b(None, E, CAP, K, H, I, num_shared_experts=1)
    with pytest.raises(megamoe.InvalidArgumentError, match="num_max_tokens_per_rank"):
        b(None, E, 0, K, H, I)
    with pytest.raises(megamoe.InvalidArgumentError, match="hidden"):
        b(None, E, CAP, K, 100, I)
    with pytest.raises(megamoe.InvalidArgumentError, match="group"):
        b("world", E, CAP, K, H, I)
    with pytest.raises(megamoe.InvalidArgumentError, match="backend"):
        b(None, E, CAP, K, H, I, backend="sm100")

    class TwoRanks:
        def rank(self):
            return 0

        def size(self):
            return 2

    with pytest.raises(megamoe.InvalidArgumentError, match="do not divide"):
        b(TwoRanks(), 7, CAP, K, H, I)
    if "sm90" not in megamoe.available_backends():
        with pytest.raises(megamoe.UnsupportedError, match="expert parallelism"):
            b(TwoRanks(), E, CAP, K, H, I)
        with pytest.raises(megamoe.UnsupportedError, match="sm90"):
            mega.get_symm_buffers_for_virtual_ranks(2, E, CAP, K, H, I)
    buf = b(None, E, CAP, K, H, I)
    assert buf.x.dtype == torch.float8_e4m3fn and tuple(buf.x.shape) == (CAP, H)
    assert buf.x_sf.dtype == torch.int32 and tuple(buf.x_sf.shape) == (CAP, H // 128)
    assert buf.topk_idx.dtype == torch.int64 and tuple(buf.topk_idx.shape) == (CAP, K)
    assert buf.topk_weights.dtype == torch.float32 and tuple(buf.topk_weights.shape) == (CAP, K)


def test_weights_of_another_shape_are_refused_at_binding():
    l1, l2 = _transform(_canonical(shape=(H, 96, E, K)))
    buf = _cpu_buffer(None, E, CAP, K, H, I)
    with pytest.raises(megamoe.InvalidArgumentError, match="intermediate 96"):
        mega.fp8_fp4_mega_moe(torch.empty((1, H), dtype=torch.bfloat16), l1, l2, buf)
    l1, l2 = _transform(_canonical())
    buf = _cpu_buffer(None, 2 * E, CAP, K, H, I)
    with pytest.raises(megamoe.InvalidArgumentError, match="8 local experts.*holds 16"):
        mega.fp8_fp4_mega_moe(torch.empty((1, H), dtype=torch.bfloat16), l1, l2, buf)


def test_released_weights_and_destroyed_buffers():
    l1, l2, buf = _bound()
    y = torch.empty((4, H), dtype=torch.bfloat16)
    mega.fp8_fp4_mega_moe(y, l1, l2, buf)
    handle = l1[0].handle
    del l1, l2
    gc.collect()
    with pytest.raises(megamoe.InvalidArgumentError, match=f"handle {handle} refers to nothing"):
        torch.ops.megamoe.fp8_fp4_mega_moe(y, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights,
                                           None, handle, buf.handle, "swiglu", None, None, None,
                                           True)
    l1, l2 = _transform(_canonical())
    buf.destroy()
    with pytest.raises(megamoe.InvalidArgumentError, match="sym_buffer: destroyed"):
        mega.fp8_fp4_mega_moe(y, l1, l2, buf)
