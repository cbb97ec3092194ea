// megamoe/quantize.hpp: the quantizers of the numerics contract and their inverses.
//
//   quantize_input          BF16 -> E4M3 + UE8M0 per 32 channels, amax floor 1e-4 (section 2)
//   requantize_intermediate FP32 -> E4M3 + UE8M0 per 32, no floor (section 5)
//   quantize_mxfp4          FP32/BF16 weights -> E2M1 pairs + UE8M0 per 32, scale 2^ceil(log2(amax/6))
//   dequantize_*            the exact inverses (codes times scales, in FP32)
//
// The per-group scale rules are MEGAMOE_HD functions so kernels use the same definition.
#pragma once

#include <cmath>
#include <cstdint>

#include "megamoe/formats.hpp"

namespace megamoe {

constexpr float kInputAmaxFloor = 1e-4f;

// Section 2: biased scale exponent of an input group from its amax (the floor and the [1, 254]
// clamp included). amax must be the max of |x| ignoring NaN (fmaxf semantics).
MEGAMOE_HD int input_scale_exponent(float amax) {
  amax = fmaxf(amax, kInputAmaxFloor);
  return clamp_int(ue8m0_ceil_exponent(amax / kE4M3Max), 1, 254);
}

// Section 5: no floor; amax = 0 gives 0 (and all-zero codes). Clamped to [0, 254] so a scale
// byte is never the NaN code (only reachable with infinite amax).
MEGAMOE_HD int intermediate_scale_exponent(float amax) {
  return clamp_int(ue8m0_ceil_exponent(amax / kE4M3Max), 0, 254);
}

// E4M3 code of v under biased scale exponent b: E4M3(v * 2^(127 - b)), saturating.
MEGAMOE_HD uint8_t e4m3_quantize_scaled(float v, int b) {
  return e4m3_from_f32(v * exp2i(kUe8m0Bias - b));
}

// MXFP4: biased exponent of 2^ceil(log2(amax / 6)), clamped to [0, 254].
MEGAMOE_HD int mxfp4_scale_exponent(float amax) {
  return clamp_int(ue8m0_ceil_exponent(amax / kE2M1Max), 0, 254);
}

// x: bf16 [rows, cols] -> q: e4m3 [rows, cols], sf: ue8m0 [rows, cols/32]. cols % 32 == 0.
void quantize_input(const uint16_t* x, int64_t rows, int64_t cols, uint8_t* q, uint8_t* sf);

// v: fp32 [rows, cols] -> q: e4m3 [rows, cols], sf: ue8m0 [rows, cols/32]. cols % 32 == 0.
void requantize_intermediate(const float* v, int64_t rows, int64_t cols, uint8_t* q, uint8_t* sf);

// w: fp32 or bf16 [rows, cols] -> packed: uint8 [rows, cols/2], sf: ue8m0 [rows, cols/32].
// Non-finite weights are rejected (kInvalidArgument naming row and column).
void quantize_mxfp4(const float* w, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* sf);
void quantize_mxfp4_bf16(const uint16_t* w, int64_t rows, int64_t cols, uint8_t* packed,
                         uint8_t* sf);

// Exact inverses, into FP32 (products of a code and a power of two are exact in FP32 except at
// the far ends of the scale range, where FP32 subnormals/overflow apply).
void dequantize_fp8(const uint8_t* q, const uint8_t* sf, int64_t rows, int64_t cols, float* out);
void dequantize_mxfp4(const uint8_t* packed, const uint8_t* sf, int64_t rows, int64_t cols,
                      float* out);

// FP8 mode (docs/numerics.md "FP8 mode"), in place on dequantized rows.
// Token rows: vals [rows, cols] = code x 2^(sf - 127) per 32 -> e4m3(code x 2^(sf - s_max)) x
// 2^(s_max - 127), s_max the row's largest scale byte (one power of two per row).
void fp8_mode_rebase_rows(float* vals, const uint8_t* sf, int64_t rows, int64_t cols);
// Weight rows: w [rows, cols] = E2M1 x 2^(sf - 127) per 32 -> e4m3(E2M1 x 2^(sf - s_max + 1)) x
// 2^(s_max - 128), s_max the row's largest scale byte.
void fp8_mode_fold_weights(float* w, const uint8_t* sf, int64_t rows, int64_t cols);

}  // namespace megamoe
