// The quantizers of numerics.md sections 2 and 5, the MXFP4 weight quantizer and their inverses.
//
// NOTES: amax is taken with fmaxf, which ignores NaN, so a NaN element never changes its group's
// scale; the NaN itself encodes to the E4M3 NaN code (sign kept). +-Inf gives amax = Inf, whose
// scale exponent (255) is clamped to 254: the Inf saturates to +-448 and the finite values of
// that group scale to (almost always) zero. docs/numerics.md lists every such reading.
#include "megamoe/quantize.hpp"

#include <algorithm>
#include <cmath>

#include "megamoe/error.hpp"

namespace megamoe {

namespace {

void check_cols(const char* fn, int64_t rows, int64_t cols) {
  MEGAMOE_CHECK_ARG(rows >= 0, fn, ": rows must be >= 0, got ", rows);
  MEGAMOE_CHECK_ARG(cols >= 0 && cols % kScaleBlock == 0, fn, ": cols must be a multiple of ",
                    kScaleBlock, ", got ", cols);
}

float group_amax(const float* v) {
  float amax = 0.0f;
  for (int i = 0; i < kScaleBlock; ++i) amax = fmaxf(amax, std::fabs(v[i]));
  return amax;
}

// Quantizes one group of 32 weights: packed gets 16 bytes, returns the scale byte.
uint8_t quantize_mxfp4_group(const float* w, int64_t row, int64_t col0, uint8_t* packed) {
  float amax = 0.0f;
  for (int i = 0; i < kScaleBlock; ++i) {
    MEGAMOE_CHECK_ARG(std::isfinite(w[i]), "quantize_mxfp4: weight [", row, ", ", col0 + i,
                      "] is not finite (", w[i], ")");
    amax = fmaxf(amax, std::fabs(w[i]));
  }
  const int b = mxfp4_scale_exponent(amax);
  const float inv_scale = exp2i(kUe8m0Bias - b);
  for (int i = 0; i < kScaleBlock; i += 2)
    packed[i / 2] = e2m1_pack(e2m1_from_f32(w[i] * inv_scale), e2m1_from_f32(w[i + 1] * inv_scale));
  return static_cast<uint8_t>(b);
}

}  // namespace

void quantize_input(const uint16_t* x, int64_t rows, int64_t cols, uint8_t* q, uint8_t* sf) {
  check_cols("quantize_input", rows, cols);
  const int64_t groups = cols / kScaleBlock;
  float buf[kScaleBlock];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* src = x + r * cols + g * kScaleBlock;
      for (int i = 0; i < kScaleBlock; ++i) buf[i] = bf16_to_f32(src[i]);
      const int b = input_scale_exponent(group_amax(buf));
      uint8_t* dst = q + r * cols + g * kScaleBlock;
      for (int i = 0; i < kScaleBlock; ++i) dst[i] = e4m3_quantize_scaled(buf[i], b);
      sf[r * groups + g] = static_cast<uint8_t>(b);
    }
  }
}

void requantize_intermediate(const float* v, int64_t rows, int64_t cols, uint8_t* q, uint8_t* sf) {
  check_cols("requantize_intermediate", rows, cols);
  const int64_t groups = cols / kScaleBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = v + r * cols + g * kScaleBlock;
      const int b = intermediate_scale_exponent(group_amax(src));
      uint8_t* dst = q + r * cols + g * kScaleBlock;
      for (int i = 0; i < kScaleBlock; ++i) dst[i] = e4m3_quantize_scaled(src[i], b);
      sf[r * groups + g] = static_cast<uint8_t>(b);
    }
  }
}

void quantize_mxfp4(const float* w, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* sf) {
  check_cols("quantize_mxfp4", rows, cols);
  const int64_t groups = cols / kScaleBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      sf[r * groups + g] = quantize_mxfp4_group(w + r * cols + g * kScaleBlock, r, g * kScaleBlock,
                                                packed + r * (cols / 2) + g * (kScaleBlock / 2));
}

void quantize_mxfp4_bf16(const uint16_t* w, int64_t rows, int64_t cols, uint8_t* packed,
                         uint8_t* sf) {
  check_cols("quantize_mxfp4_bf16", rows, cols);
  const int64_t groups = cols / kScaleBlock;
  float buf[kScaleBlock];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int i = 0; i < kScaleBlock; ++i) buf[i] = bf16_to_f32(w[r * cols + g * kScaleBlock + i]);
      sf[r * groups + g] = quantize_mxfp4_group(buf, r, g * kScaleBlock,
                                                packed + r * (cols / 2) + g * (kScaleBlock / 2));
    }
  }
}

void dequantize_fp8(const uint8_t* q, const uint8_t* sf, int64_t rows, int64_t cols, float* out) {
  check_cols("dequantize_fp8", rows, cols);
  const int64_t groups = cols / kScaleBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = e4m3_to_f32(q[r * cols + c]) * ue8m0_to_f32(sf[r * groups + c / kScaleBlock]);
}

namespace {

// vals [rows, cols] -> e4m3(v x 2^(bias - s_max)) x 2^(s_max - bias) per row.
void round_rows_to_e4m3(float* vals, const uint8_t* sf, int64_t rows, int64_t cols, int bias) {
  const int64_t groups = cols / kScaleBlock;
  for (int64_t r = 0; r < rows; ++r) {
    int s_max = 0;
    for (int64_t g = 0; g < groups; ++g) s_max = std::max(s_max, static_cast<int>(sf[r * groups + g]));
    float* row = vals + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = std::ldexp(row[c], bias - s_max);  // a power of two: exact (or 0 far down)
      row[c] = std::ldexp(e4m3_to_f32(e4m3_from_f32(v)), s_max - bias);
    }
  }
}

}  // namespace

void fp8_mode_rebase_rows(float* vals, const uint8_t* sf, int64_t rows, int64_t cols) {
  check_cols("fp8_mode_rebase_rows", rows, cols);
  round_rows_to_e4m3(vals, sf, rows, cols, 127);
}

void fp8_mode_fold_weights(float* w, const uint8_t* sf, int64_t rows, int64_t cols) {
  check_cols("fp8_mode_fold_weights", rows, cols);
  round_rows_to_e4m3(w, sf, rows, cols, 128);
}

void dequantize_mxfp4(const uint8_t* packed, const uint8_t* sf, int64_t rows, int64_t cols,
                      float* out) {
  check_cols("dequantize_mxfp4", rows, cols);
  // NOTES: the CPU reference dequantizes every weight row it touches through here, so this is
  // its hottest loop for small token counts: one table lookup gives both values of a byte.
  struct PairTable {
    float v[256][2];
    PairTable() {
      for (int b = 0; b < 256; ++b) {
        v[b][0] = e2m1_to_f32(static_cast<uint8_t>(b & 0xF));
        v[b][1] = e2m1_to_f32(static_cast<uint8_t>(b >> 4));
      }
    }
  };
  static const PairTable table;
  const int64_t groups = cols / kScaleBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = ue8m0_to_f32(sf[r * groups + g]);
      const uint8_t* src = packed + r * (cols / 2) + g * (kScaleBlock / 2);
      float* dst = out + r * cols + g * kScaleBlock;
      for (int i = 0; i < kScaleBlock / 2; ++i) {
        dst[2 * i] = table.v[src[i]][0] * scale;
        dst[2 * i + 1] = table.v[src[i]][1] * scale;
      }
    }
  }
}

}  // namespace megamoe
