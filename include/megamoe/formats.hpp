// megamoe/formats.hpp: the number formats of the numerics contract (numerics.md section 1).
//
// Every codec here is a pure function on bits, callable from host and device code, so the CPU
// reference and the kernels share one definition. Encoders round to nearest, ties to even.
//
//   E4M3  1-4-3, bias 7, no inf, 0x7F/0xFF = NaN, max 448        (activations)
//   E2M1  1-2-1, codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 sign (weights)
//   UE8M0 2^(b - 127), 0xFF = NaN                                 (per-32 block scales)
//   BF16  upper half of an FP32, round to nearest even from FP32   (inputs, outputs)
//
// Packing: two E2M1 codes per byte, low nibble = even k, high nibble = odd k.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MEGAMOE_HD __host__ __device__ __forceinline__
#else
#define MEGAMOE_HD inline
#endif

namespace megamoe {

constexpr int kScaleBlock = 32;       // scale granularity along K, for weights and activations
constexpr float kE4M3Max = 448.0f;
constexpr float kE2M1Max = 6.0f;
constexpr int kUe8m0Bias = 127;
constexpr uint8_t kUe8m0NaN = 0xFF;
constexpr uint8_t kE4M3NaN = 0x7F;

MEGAMOE_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

MEGAMOE_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Shift right by `shift` (1..31) rounding to nearest, ties to even.
MEGAMOE_HD uint32_t shift_right_rne(uint32_t v, int shift) {
  const uint32_t q = v >> shift;
  const uint32_t rem = v & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// 2^k as an FP32, exact for k in [-149, 127].
MEGAMOE_HD float exp2i(int k) {
  if (k >= -126) return f32_from_bits(static_cast<uint32_t>(k + 127) << 23);
  return f32_from_bits(1u << (k + 149));
}

// ---------------------------------------------------------------------------------------------
// BF16
// ---------------------------------------------------------------------------------------------
MEGAMOE_HD uint16_t bf16_from_f32(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

MEGAMOE_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// FP32 -> BF16 -> FP32 (the "bf16_rn" of the contract).
MEGAMOE_HD float bf16_round(float f) { return bf16_to_f32(bf16_from_f32(f)); }

// ---------------------------------------------------------------------------------------------
// E4M3 (OCP FP8 "E4M3FN": no infinities, only 0x7F/0xFF are NaN)
// ---------------------------------------------------------------------------------------------
// Saturating encoder: finite values beyond 448 and +-Inf become +-448; NaN becomes 0x7F | sign.
MEGAMOE_HD uint8_t e4m3_from_f32(float f) {
  const uint32_t u = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | kE4M3NaN;
  if (a >= 0x43E00000u) return sign | 0x7E;  // |f| >= 448 (Inf too): saturate to 448
  const int exp = static_cast<int>(a >> 23);
  if (exp < 121) {
    // |f| < 2^-6: E4M3 subnormal, integer multiples of 2^-9 (code 8 is the smallest normal).
    const uint32_t mant = (a & 0x7FFFFFu) | (exp > 0 ? 0x800000u : 0u);
    const int shift = 141 - (exp > 0 ? exp : 1);  // |f| = mant * 2^(max(exp,1) - 150)
    if (shift >= 25) return sign;                 // mant < 2^24: below half of 2^-9
    return sign | static_cast<uint8_t>(shift_right_rne(mant, shift));
  }
  // Normal: rebias 127 -> 7 and round the 23-bit mantissa to 3 bits; a carry bumps the exponent.
  const uint32_t v = (static_cast<uint32_t>(exp - 120) << 23) | (a & 0x7FFFFFu);
  return sign | static_cast<uint8_t>(shift_right_rne(v, 20));
}

MEGAMOE_HD float e4m3_to_f32(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xFu;
  const uint32_t man = c & 0x7u;
  if ((c & 0x7Fu) == kE4M3NaN) return f32_from_bits(sign | 0x7FC00000u);
  if (exp == 0) {
    // subnormal m * 2^-9: exact in FP32
    const float mag = static_cast<float>(man) * (1.0f / 512.0f);
    return sign ? -mag : mag;
  }
  return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

// ---------------------------------------------------------------------------------------------
// E2M1 (4-bit; codes 0..15, bit 3 = sign, no NaN/Inf)
// ---------------------------------------------------------------------------------------------
MEGAMOE_HD float e2m1_to_f32(uint8_t code) {
  // magnitude = code 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6
  const uint32_t m = code & 0x7u;
  float mag;
  if (m < 2) {
    mag = 0.5f * static_cast<float>(m);
  } else {
    const uint32_t e = m >> 1;          // 1..3
    const uint32_t frac = m & 1u;       // 0 or 1
    mag = exp2i(static_cast<int>(e) - 1) * (1.0f + 0.5f * static_cast<float>(frac));
  }
  return (code & 0x8u) ? -mag : mag;
}

// Saturating encoder (|x| > 6 -> 6), round to nearest, ties to the even code. NaN -> +0
// (callers that may see NaN must reject it first; the weight quantizer does).
MEGAMOE_HD uint8_t e2m1_from_f32(float f) {
  const uint32_t u = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  const float a = f32_from_bits(u & 0x7FFFFFFFu);
  if (!(a == a)) return 0;
  uint8_t m;
  if (a <= 0.25f) m = 0;        // tie at 0.25 -> even code 0
  else if (a < 0.75f) m = 1;
  else if (a <= 1.25f) m = 2;   // ties 0.75, 1.25 -> even code 2 (1.0)
  else if (a < 1.75f) m = 3;
  else if (a <= 2.5f) m = 4;    // ties 1.75, 2.5 -> even code 4 (2.0)
  else if (a < 3.5f) m = 5;
  else if (a <= 5.0f) m = 6;    // ties 3.5, 5 -> even code 6 (4.0)
  else m = 7;
  return sign | m;
}

// Packed pair access: byte k/2 holds k even in the low nibble, k odd in the high nibble.
MEGAMOE_HD uint8_t e2m1_unpack(const uint8_t* packed, int64_t k) {
  return static_cast<uint8_t>((packed[k >> 1] >> ((k & 1) * 4)) & 0xFu);
}
MEGAMOE_HD uint8_t e2m1_pack(uint8_t even_code, uint8_t odd_code) {
  return static_cast<uint8_t>((even_code & 0xFu) | ((odd_code & 0xFu) << 4));
}

// ---------------------------------------------------------------------------------------------
// UE8M0 block scales
// ---------------------------------------------------------------------------------------------
MEGAMOE_HD float ue8m0_to_f32(uint8_t b) {
  if (b == kUe8m0NaN) return f32_from_bits(0x7FC00000u);
  return exp2i(static_cast<int>(b) - kUe8m0Bias);
}

// Biased exponent of 2^ceil(log2(r)) for r >= 0, in bit form (numerics.md section 2):
//   e = bits(r); b = ((e >> 23) & 0xFF) + (mantissa != 0)
// r = 0 gives 0; r = +Inf gives 255 (callers clamp). For subnormal r this returns 1, an upper
// bound that is exact enough: every caller divides by 2^(b-127) >= r.
MEGAMOE_HD int ue8m0_ceil_exponent(float r) {
  const uint32_t e = f32_bits(r);
  return static_cast<int>((e >> 23) & 0xFFu) + ((e & 0x7FFFFFu) != 0 ? 1 : 0);
}

MEGAMOE_HD int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

}  // namespace megamoe
