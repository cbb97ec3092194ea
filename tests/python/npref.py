"""An independent numpy model of the number formats and quantizers of numerics.md.

Written from the spec, not from megamoe's C++: encoders pick the nearest value of an explicit
table of the format (ties to the even code) instead of manipulating bits, and scale exponents come
from np.frexp instead of the exponent field. Used to check megamoe's codecs and quantizers.
"""

import numpy as np

SCALE_BLOCK = 32
E4M3_MAX = 448.0


# ------------------------------------------------------------------------------------------------
# Value tables
# ------------------------------------------------------------------------------------------------
def e4m3_value(code):
    """Value of an E4M3 code by the format's definition (1-4-3, bias 7, 0x7F/0xFF NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if (code & 0x7F) == 0x7F:
        return np.nan
    if e == 0:
        return sign * m * 2.0 ** -9  # subnormal: m/8 * 2^(1-7)
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


E4M3_TABLE = np.array([e4m3_value(c) for c in range(256)])
# Non-negative finite codes 0..0x7E in increasing value order (the table is monotonic there).
_E4M3_POS = E4M3_TABLE[:0x7F]
assert np.all(np.diff(_E4M3_POS) > 0)

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_TABLE = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])


def _nearest_code(mag, table):
    """Index of the nearest entry of the increasing `table` to each mag (float64, finite,
    >= 0, <= table[-1]), ties to the even index."""
    hi = np.searchsorted(table, mag, side="left")
    hi = np.clip(hi, 1, len(table) - 1)
    lo = hi - 1
    d_lo = mag - table[lo]
    d_hi = table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo)


# ------------------------------------------------------------------------------------------------
# Codecs
# ------------------------------------------------------------------------------------------------
def e4m3_encode(x):
    """float32 array -> E4M3 codes: nearest, ties to even, saturating to +-448, NaN -> 0x7F|s."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    sign = np.signbit(x).astype(np.uint8) << 7
    mag = np.abs(x)
    nan = np.isnan(mag)
    sat = ~nan & (mag >= E4M3_MAX)
    safe = np.where(nan | sat, 0.0, mag)
    code = _nearest_code(safe, _E4M3_POS).astype(np.uint8)
    code = np.where(sat, 0x7E, code)
    code = np.where(nan, 0x7F, code)
    return (code | sign).astype(np.uint8)


def e2m1_encode(x):
    """float32 array -> E2M1 codes 0..15: nearest, ties to even code, saturating to +-6;
    NaN -> 0."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    nan = np.isnan(x)
    mag = np.minimum(np.abs(np.where(nan, 0.0, x)), 6.0)
    code = _nearest_code(mag, E2M1_MAGNITUDES).astype(np.uint8)
    code = code | (np.signbit(x).astype(np.uint8) << 3)
    return np.where(nan, 0, code).astype(np.uint8)


def bf16_encode(x):
    """float32 array -> BF16 bits (uint16): round to nearest even via np.round on the value
    grid; overflow past the largest BF16 goes to inf; NaN -> quiet NaN of the same sign."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    with np.errstate(invalid="ignore"):
        xd = x.astype(np.float64)
    finite = np.isfinite(xd)
    mag = np.abs(np.where(finite, xd, 0.0))
    # Exponent of the binade (normal) or the subnormal range: the BF16 ulp is 2^(e - 7).
    _, e = np.frexp(mag)             # mag = f * 2^e, f in [0.5, 1)
    e = np.maximum(e - 1, -126)      # binade exponent, subnormals share -126
    ulp = np.ldexp(1.0, e - 7)
    rounded = np.round(np.where(finite, xd, 0.0) / ulp) * ulp   # np.round: half to even
    with np.errstate(over="ignore"):
        out = rounded.astype(np.float32)  # exact except overflow to inf (what BF16 RNE does)
    out_bits = (out.view(np.uint32) >> 16).astype(np.uint16)
    inf_bits = (bits >> 16).astype(np.uint16)
    nan_bits = ((bits >> 16) | 0x40).astype(np.uint16)
    res = np.where(finite, out_bits, np.where(np.isnan(x), nan_bits, inf_bits))
    return res.astype(np.uint16)


def bf16_decode(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def ue8m0_decode(b):
    b = np.asarray(b, dtype=np.uint8)
    return np.where(b == 0xFF, np.nan, np.ldexp(1.0, b.astype(np.int64) - 127)).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Quantizers
# ------------------------------------------------------------------------------------------------
def ceil_exponent(r):
    """Biased exponent b of 2^ceil(log2 r) for FP32 r > 0 (normal), via frexp."""
    r = np.asarray(r, dtype=np.float64)
    f, e = np.frexp(np.where(np.isinf(r), 1.0, r))  # r = f * 2^e, f in [0.5, 1)
    b = np.where(f == 0.5, e - 1, e) + 127          # exact power of two: 2^(e-1)
    return np.where(np.isinf(r), 255, b)            # +Inf: the all-ones exponent field


def _groups(a):
    return a.reshape(a.shape[:-1] + (a.shape[-1] // SCALE_BLOCK, SCALE_BLOCK))


def _group_amax(a):
    g = np.abs(_groups(a.astype(np.float32)))
    with np.errstate(invalid="ignore"):
        return np.nanmax(np.where(np.isnan(g), -1.0, g), axis=-1).astype(np.float32)


def _scaled_e4m3(a, b):
    scale = np.ldexp(1.0, 127 - b.astype(np.int64))[..., None]
    v = _groups(a.astype(np.float64)) * scale
    return e4m3_encode(v.astype(np.float32)).reshape(a.shape)


def quantize_input(x_bits):
    """BF16 bits [..., H] -> (q, sf) per numerics.md section 2."""
    x = bf16_decode(x_bits)
    amax = np.maximum(_group_amax(x), np.float32(1e-4))
    r = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    b = np.clip(ceil_exponent(r), 1, 254)
    return _scaled_e4m3(x, b), b.astype(np.uint8)


def requantize(v):
    """FP32 [..., I] -> (q, sf) per numerics.md section 5 (no floor; amax 0 -> b 0)."""
    v = np.asarray(v, dtype=np.float32)
    amax = np.maximum(_group_amax(v), 0)
    r = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    b = np.where(r == 0, 0, np.clip(ceil_exponent(np.where(r == 0, 1, r)), 0, 254))
    return _scaled_e4m3(v, b), b.astype(np.uint8)


def quantize_mxfp4(w):
    """FP32 [..., K] -> (packed [..., K/2], sf [..., K/32]): b = ceil exponent of amax/6."""
    w = np.asarray(w, dtype=np.float32)
    amax = _group_amax(w)
    r = (amax / np.float32(6.0)).astype(np.float32)
    b = np.where(r == 0, 0, np.clip(ceil_exponent(np.where(r == 0, 1, r)), 0, 254))
    scale = np.ldexp(1.0, 127 - b.astype(np.int64))[..., None]
    codes = e2m1_encode((_groups(w.astype(np.float64)) * scale).astype(np.float32)).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), b.astype(np.uint8)


def unpack_e2m1(packed):
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    return codes


def dequantize_mxfp4(packed, sf):
    codes = unpack_e2m1(packed)
    vals = E2M1_TABLE[codes]
    scale = np.ldexp(1.0, sf.astype(np.int64) - 127)
    return (_groups(vals) * scale[..., None]).reshape(codes.shape)


def dequantize_fp8(q, sf):
    vals = E4M3_TABLE[np.asarray(q, dtype=np.uint8)]
    scale = np.ldexp(1.0, sf.astype(np.int64) - 127)
    return (_groups(vals) * scale[..., None]).reshape(vals.shape)
