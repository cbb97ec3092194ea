"""Number formats and quantizers of the numerics contract (docs/numerics.md, spec numerics.md).

All functions run on the host and take numpy arrays or CPU torch tensors (zero copy). Outputs are
new arrays in the input's framework unless ``out=`` is given. BF16 arrays are numpy ``uint16``
(raw bits), ``ml_dtypes.bfloat16`` or ``torch.bfloat16``.

Formats:
    E4M3  (FP8)  1-4-3, bias 7, no inf, 0x7F/0xFF NaN, max 448; encoders saturate to +-448
    E2M1  (FP4)  codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign; packed two per byte,
                 low nibble = even k, high nibble = odd k
    UE8M0        2^(b - 127), 0xFF = NaN; one scale per 32 elements along the last dim
    BF16         round to nearest even from FP32

Row-wise functions treat the last dim as K and every leading dim as rows, so a weight tensor
[E, N, K] quantizes in one call.
"""

from . import _arrays
from . import _megamoe as _C

SCALE_BLOCK = _C.SCALE_BLOCK  # 32 elements per UE8M0 scale, for weights and activations
E4M3_MAX = _C.E4M3_MAX        # 448
E2M1_MAX = _C.E2M1_MAX        # 6

__all__ = [
    "SCALE_BLOCK", "E4M3_MAX", "E2M1_MAX",
    "quantize_input", "requantize", "quantize_mxfp4", "dequantize_fp8", "dequantize_mxfp4",
    "e4m3_from_f32", "e4m3_to_f32", "e2m1_from_f32", "e2m1_to_f32", "e2m1_pack", "e2m1_unpack",
    "bf16_from_f32", "bf16_to_f32", "ue8m0_to_f32",
]


def _last(a):
    # A 0-dim input gets a placeholder extent; the C++ check then names the problem.
    return int(a.shape[-1]) if len(a.shape) else 0


def _rowwise(a, last):
    return _arrays.shape_of(a)[:-1] + (last,) if len(a.shape) else (last,)


# ------------------------------------------------------------------------------------------------
# Quantizers
# ------------------------------------------------------------------------------------------------
def _quantize(fn, src, name, codes, sf, values_per_byte):
    """Row-wise quantizer call: codes uint8 [..., K / values_per_byte], sf uint8 [..., K/32]."""
    src = _arrays.host_input(src, name)
    k = _last(src)
    codes = _arrays.output(codes, src, _rowwise(src, k // values_per_byte), "uint8")
    sf = _arrays.output(sf, src, _rowwise(src, k // SCALE_BLOCK), "uint8")
    fn(src, codes, sf)
    return codes, sf


def quantize_input(x, q=None, sf=None):
    """BF16 activations -> FP8 (numerics.md section 2).

    x: bf16 [..., H], H a multiple of 32. Returns (q, sf): q uint8 [..., H] E4M3 codes and
    sf uint8 [..., H/32] UE8M0 scales, with amax floored at 1e-4 and b clamped to [1, 254].
    """
    return _quantize(_C.quantize_input, x, "x", q, sf, 1)


def requantize(v, q=None, sf=None):
    """FP32 intermediate -> FP8 (numerics.md section 5: no amax floor; amax 0 gives scale 0).

    v: float32 [..., I], I a multiple of 32. Returns (q uint8 [..., I], sf uint8 [..., I/32]).
    """
    return _quantize(_C.requantize, v, "v", q, sf, 1)


def quantize_mxfp4(w, packed=None, sf=None):
    """Weights -> MXFP4 (scale 2^ceil(log2(amax/6)) per 32 along K, E2M1 round to nearest even).

    w: float32 or bf16 [..., K], K a multiple of 32, finite (a NaN/Inf weight raises
    InvalidArgumentError naming row and column). Returns (packed uint8 [..., K/2],
    sf uint8 [..., K/32]).
    """
    return _quantize(_C.quantize_mxfp4, w, "w", packed, sf, 2)


def dequantize_fp8(q, sf, out=None):
    """E4M3 codes q uint8 [..., K] with UE8M0 scales sf uint8 [..., K/32] -> float32 [..., K]
    (exact: code value times 2^(sf - 127))."""
    q, sf = _arrays.host_input(q, "q"), _arrays.host_input(sf, "sf")
    out = _arrays.output(out, q, _rowwise(q, _last(q)), "float32")
    _C.dequantize_fp8(q, sf, out)
    return out


def dequantize_mxfp4(packed, sf, out=None):
    """Packed E2M1 pairs uint8 [..., K/2] with UE8M0 scales uint8 [..., K/32] -> float32 [..., K]
    (exact)."""
    packed, sf = _arrays.host_input(packed, "packed"), _arrays.host_input(sf, "sf")
    out = _arrays.output(out, packed, _rowwise(packed, 2 * _last(packed)), "float32")
    _C.dequantize_mxfp4(packed, sf, out)
    return out


# ------------------------------------------------------------------------------------------------
# Elementwise codecs (same shape in and out)
# ------------------------------------------------------------------------------------------------
def _map(fn, src, dtype, out, bf16_like=None):
    src = _arrays.host_input(src, "src")
    out = _arrays.output(out, src, _arrays.shape_of(src), dtype, bf16_like)
    fn(src, out)
    return out


def e4m3_from_f32(x, out=None):
    """float32 [...] -> uint8 [...] E4M3 codes (round to nearest even, saturating to +-448;
    NaN -> 0x7F | sign)."""
    return _map(_C.e4m3_encode, x, "uint8", out)


def e4m3_to_f32(codes, out=None):
    """uint8 [...] E4M3 codes -> float32 [...] (0x7F/0xFF -> NaN)."""
    return _map(_C.e4m3_decode, codes, "float32", out)


def e2m1_from_f32(x, out=None):
    """float32 [...] -> uint8 [...] E2M1 codes 0..15, one per byte (unpacked; round to nearest,
    ties to the even code, saturating to +-6; NaN -> 0)."""
    return _map(_C.e2m1_encode, x, "uint8", out)


def e2m1_to_f32(codes, out=None):
    """uint8 [...] E2M1 codes 0..15 (unpacked) -> float32 [...]; a code above 15 is an
    InvalidArgumentError."""
    return _map(_C.e2m1_decode, codes, "float32", out)


def e2m1_pack(codes, out=None):
    """uint8 [..., 2n] E2M1 codes -> uint8 [..., n] bytes (even k low nibble, odd k high)."""
    codes = _arrays.host_input(codes, "codes")
    out = _arrays.output(out, codes, _rowwise(codes, _last(codes) // 2), "uint8")
    _C.e2m1_pack(codes, out)
    return out


def e2m1_unpack(packed, out=None):
    """uint8 [..., n] packed bytes -> uint8 [..., 2n] E2M1 codes."""
    packed = _arrays.host_input(packed, "packed")
    out = _arrays.output(out, packed, _rowwise(packed, 2 * _last(packed)), "uint8")
    _C.e2m1_unpack(packed, out)
    return out


def bf16_from_f32(x, out=None):
    """float32 [...] -> bf16 [...] (round to nearest even; NaN stays a quiet NaN). numpy: uint16
    bits."""
    return _map(_C.bf16_encode, x, "bfloat16", out)


def bf16_to_f32(x, out=None):
    """bf16 [...] (uint16 bits, ml_dtypes.bfloat16 or torch.bfloat16) -> float32 [...] (exact)."""
    return _map(_C.bf16_decode, x, "float32", out)


def ue8m0_to_f32(sf, out=None):
    """uint8 [...] UE8M0 scale bytes -> float32 [...] 2^(b - 127) (0xFF -> NaN)."""
    return _map(_C.ue8m0_decode, sf, "float32", out)
