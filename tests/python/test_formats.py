"""Codecs and quantizers of megamoe.formats against the independent numpy model (npref.py).

Codecs are checked exhaustively where the domain is small (all 256 E4M3 / UE8M0 codes, all 16
E2M1 codes, all 65536 BF16 patterns) and on every tie and neighbour of a tie otherwise.
"""

import numpy as np
import pytest

import megamoe
import npref


def _f32_from_bits(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _same_bits_f32(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                          np.asarray(b, np.float32).view(np.uint32))


def _neighbours(values):
    """values, and the FP32 numbers just below and above each."""
    v = np.asarray(values, dtype=np.float32)
    return np.concatenate([v, np.nextafter(v, np.float32(-np.inf)),
                           np.nextafter(v, np.float32(np.inf))])


# ------------------------------------------------------------------------------------------------
# E4M3
# ------------------------------------------------------------------------------------------------
def test_e4m3_decode_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = megamoe.e4m3_to_f32(codes)
    assert got.dtype == np.float32 and got.shape == (256,)
    np.testing.assert_array_equal(got, npref.E4M3_TABLE.astype(np.float32))
    assert np.isnan(got[0x7F]) and np.isnan(got[0xFF])
    assert got[0x7E] == 448.0 and got[0x01] == 2.0 ** -9


def test_e4m3_encode_matches_table_model_on_ties_and_neighbours(rng):
    finite = npref.E4M3_TABLE[np.isfinite(npref.E4M3_TABLE)]
    pos = np.unique(np.abs(finite))
    midpoints = (pos[:-1] + pos[1:]) / 2  # exact in FP32: every tie of the format
    special = [0.0, -0.0, 448.0, 449.0, 464.0, 1e30, np.inf, -np.inf, np.nan, -np.nan,
               2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 1e-45, -1e-45]
    wide = rng.standard_normal(20000) * np.exp2(rng.uniform(-14, 10, 20000))
    x = np.concatenate([_neighbours(finite), _neighbours(midpoints), _neighbours(-midpoints),
                        np.array(special, dtype=np.float32), wide.astype(np.float32)])
    got = megamoe.e4m3_from_f32(x)
    want = npref.e4m3_encode(x)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (f"first mismatches: x={x[bad[:5]]} got={got[bad[:5]]} "
                           f"want={want[bad[:5]]}")


def test_e4m3_round_trip_of_every_code():
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)
    np.testing.assert_array_equal(megamoe.e4m3_from_f32(megamoe.e4m3_to_f32(codes)), codes)


# ------------------------------------------------------------------------------------------------
# E2M1
# ------------------------------------------------------------------------------------------------
def test_e2m1_decode_all_codes():
    got = megamoe.e2m1_to_f32(np.arange(16, dtype=np.uint8))
    np.testing.assert_array_equal(got, npref.E2M1_TABLE.astype(np.float32))


def test_e2m1_encode_matches_model(rng):
    mags = npref.E2M1_MAGNITUDES
    ties = (mags[:-1] + mags[1:]) / 2
    x = np.concatenate([_neighbours(mags), _neighbours(-mags), _neighbours(ties),
                        _neighbours(-ties), np.array([7.0, -100.0, np.inf, -np.inf, np.nan],
                                                     dtype=np.float32),
                        (rng.standard_normal(5000) * 3).astype(np.float32)])
    np.testing.assert_array_equal(megamoe.e2m1_from_f32(x), npref.e2m1_encode(x))


def test_e2m1_decode_rejects_codes_above_15():
    with pytest.raises(megamoe.InvalidArgumentError, match="codes: E2M1 codes are 4-bit"):
        megamoe.e2m1_to_f32(np.array([3, 16], dtype=np.uint8))


def test_e2m1_pack_nibble_order_and_round_trip(rng):
    packed = megamoe.e2m1_pack(np.array([[1, 2, 15, 0]], dtype=np.uint8))
    np.testing.assert_array_equal(packed, np.array([[0x21, 0x0F]], dtype=np.uint8))
    codes = rng.integers(0, 16, (3, 5, 64), dtype=np.uint8)
    p = megamoe.e2m1_pack(codes)
    assert p.shape == (3, 5, 32)
    np.testing.assert_array_equal(megamoe.e2m1_unpack(p), codes)
    np.testing.assert_array_equal(npref.unpack_e2m1(p), codes)


# ------------------------------------------------------------------------------------------------
# BF16 and UE8M0
# ------------------------------------------------------------------------------------------------
def test_bf16_decode_all_patterns():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = megamoe.bf16_to_f32(bits)
    assert _same_bits_f32(got, npref.bf16_decode(bits))


def test_bf16_encode_matches_model(rng):
    random_bits = rng.integers(0, 1 << 32, 200000, dtype=np.uint64).astype(np.uint32)
    upper = rng.integers(0, 1 << 16, 20000, dtype=np.uint64).astype(np.uint32) << 16
    ties = upper | 0x8000  # exactly halfway: ties to even upper half
    edges = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000, 0x80000000,
                      0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF], dtype=np.uint32)
    x = _f32_from_bits(np.concatenate([random_bits, ties, ties - 1, ties + 1, edges]))
    got = megamoe.bf16_from_f32(x)
    assert got.dtype == np.uint16
    want = npref.bf16_encode(x)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (f"x bits {x.view(np.uint32)[bad[:5]]}: got {got[bad[:5]]}, "
                           f"want {want[bad[:5]]}")


def test_ue8m0_decode_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    assert _same_bits_f32(megamoe.ue8m0_to_f32(codes), npref.ue8m0_decode(codes))


# ------------------------------------------------------------------------------------------------
# Quantizers
# ------------------------------------------------------------------------------------------------
def _activation_rows(rng, rows, cols):
    """BF16 bits with row magnitudes over 24 binades, a zero row, tiny rows, NaN and Inf."""
    x = rng.standard_normal((rows, cols)) * np.exp2(rng.uniform(-20, 12, (rows, 1)))
    x[0] = 0.0
    x[1] *= 1e-12
    x[2, 5] = np.nan
    x[3, 40] = np.inf
    x[4, 7] = 1e6  # saturates to 448 * 2^(127-b)
    return megamoe.bf16_from_f32(x.astype(np.float32))


def test_quantize_input_matches_model(rng):
    x = _activation_rows(rng, 37, 256)
    q, sf = megamoe.quantize_input(x)
    assert q.shape == (37, 256) and sf.shape == (37, 8) and q.dtype == sf.dtype == np.uint8
    q_ref, sf_ref = npref.quantize_input(x)
    np.testing.assert_array_equal(sf, sf_ref)
    np.testing.assert_array_equal(q, q_ref)
    assert sf[0, 0] == npref.ceil_exponent(np.float32(1e-4) / np.float32(448))  # amax floor


def test_quantize_input_leading_dims(rng):
    x = _activation_rows(rng, 12, 64).reshape(3, 4, 64)
    q, sf = megamoe.quantize_input(x)
    assert q.shape == (3, 4, 64) and sf.shape == (3, 4, 2)
    q2, sf2 = megamoe.quantize_input(x.reshape(12, 64))
    np.testing.assert_array_equal(q.reshape(12, 64), q2)
    np.testing.assert_array_equal(sf.reshape(12, 2), sf2)


def test_requantize_matches_model(rng):
    v = (rng.standard_normal((29, 128)) * np.exp2(rng.uniform(-30, 20, (29, 1)))).astype(np.float32)
    v[0, :32] = 0.0  # amax 0: scale byte 0, zero codes
    v[1, 3] = np.nan
    q, sf = megamoe.requantize(v)
    q_ref, sf_ref = npref.requantize(v)
    np.testing.assert_array_equal(sf, sf_ref)
    np.testing.assert_array_equal(q, q_ref)
    assert sf[0, 0] == 0 and not q[0, :32].any()


def test_quantize_mxfp4_matches_model_fp32_and_bf16(rng):
    scale = np.exp2(rng.uniform(-12, 6, (3, 5, 1)))
    w = (rng.standard_normal((3, 5, 128)) * scale).astype(np.float32)
    w[0, 0, :32] = 0.0
    packed, sf = megamoe.quantize_mxfp4(w)
    assert packed.shape == (3, 5, 64) and sf.shape == (3, 5, 4)
    p_ref, sf_ref = npref.quantize_mxfp4(w)
    np.testing.assert_array_equal(sf, sf_ref)
    np.testing.assert_array_equal(packed, p_ref)
    w_bf16 = megamoe.bf16_from_f32(w)
    p16, sf16 = megamoe.quantize_mxfp4(w_bf16)
    p16_ref, sf16_ref = npref.quantize_mxfp4(npref.bf16_decode(w_bf16))
    np.testing.assert_array_equal(sf16, sf16_ref)
    np.testing.assert_array_equal(p16, p16_ref)


def test_quantize_mxfp4_rejects_non_finite_weights():
    w = np.ones((2, 64), dtype=np.float32)
    w[1, 33] = np.inf
    with pytest.raises(megamoe.InvalidArgumentError):
        megamoe.quantize_mxfp4(w)


def test_dequantizers_match_model(rng):
    q = rng.integers(0, 256, (7, 96), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0  # no NaN codes: compare values
    sf = rng.integers(100, 150, (7, 3), dtype=np.uint8)
    np.testing.assert_array_equal(megamoe.dequantize_fp8(q, sf), npref.dequantize_fp8(q, sf))
    packed = rng.integers(0, 256, (7, 48), dtype=np.uint8)
    got = megamoe.dequantize_mxfp4(packed, sf)
    assert got.shape == (7, 96) and got.dtype == np.float32
    np.testing.assert_array_equal(got, npref.dequantize_mxfp4(packed, sf))


def test_mxfp4_round_trip_is_exact_for_representable_weights(rng):
    codes = rng.integers(0, 16, (4, 64), dtype=np.uint8)
    sf = rng.integers(120, 130, (4, 2), dtype=np.uint8)
    w = megamoe.dequantize_mxfp4(megamoe.e2m1_pack(codes), sf)
    packed, sf2 = megamoe.quantize_mxfp4(w)
    np.testing.assert_array_equal(megamoe.dequantize_mxfp4(packed, sf2), w)


# ------------------------------------------------------------------------------------------------
# Array plumbing: out=, zero copy, frameworks
# ------------------------------------------------------------------------------------------------
def test_out_arrays_are_written_in_place(rng):
    x = megamoe.bf16_from_f32(rng.standard_normal((4, 64)).astype(np.float32))
    q = np.full((4, 64), 0xAB, dtype=np.uint8)
    sf = np.zeros((4, 2), dtype=np.uint8)
    q2, sf2 = megamoe.quantize_input(x, q=q, sf=sf)
    assert q2 is q and sf2 is sf
    q_ref, sf_ref = npref.quantize_input(x)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(sf, sf_ref)


def test_read_only_inputs_are_accepted(rng):
    x = rng.standard_normal(64).astype(np.float32)
    x.setflags(write=False)
    np.testing.assert_array_equal(megamoe.e4m3_from_f32(x), npref.e4m3_encode(x))


def test_ml_dtypes_bfloat16_arrays():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    xb = x.astype(ml_dtypes.bfloat16)
    q, sf = megamoe.quantize_input(xb)
    q_ref, sf_ref = megamoe.quantize_input(xb.view(np.uint16))
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(sf, sf_ref)
    np.testing.assert_array_equal(megamoe.bf16_to_f32(xb), xb.astype(np.float32))


def test_torch_cpu_tensors_match_numpy(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    x = rng.standard_normal((6, 64)).astype(np.float32)
    xt = torch.from_numpy(x).to(torch.bfloat16)
    q, sf = megamoe.quantize_input(xt)
    assert isinstance(q, torch.Tensor) and q.dtype == torch.uint8 and q.shape == (6, 64)
    q_ref, sf_ref = megamoe.quantize_input(xt.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(q.numpy(), q_ref)
    np.testing.assert_array_equal(sf.numpy(), sf_ref)
    b = megamoe.bf16_from_f32(torch.from_numpy(x))
    assert b.dtype == torch.bfloat16
    np.testing.assert_array_equal(b.view(torch.int16).numpy().view(np.uint16),
                                  megamoe.bf16_from_f32(x))
