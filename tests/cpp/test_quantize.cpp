// Quantizers (numerics.md sections 2 and 5, the MXFP4 weight quantizer): known answers, the
// documented NaN/Inf behaviour, and agreement with a slow transcription of the rules.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/quantize.hpp"
#include "runtime/random.hpp"
#include "test_util.hpp"

namespace megamoe {
namespace {

using test::expect_error;

constexpr int kG = 32;
const float kInf = std::numeric_limits<float>::infinity();

std::vector<uint16_t> bf16_group(const std::vector<float>& v) {
  std::vector<uint16_t> out;
  for (float f : v) out.push_back(bf16_from_f32(f));
  return out;
}

// One group through quantize_input.
void quantize_one(const std::vector<float>& values, uint8_t* q, uint8_t* sf) {
  ASSERT_EQ(values.size(), static_cast<size_t>(kG));
  const auto x = bf16_group(values);
  quantize_input(x.data(), 1, kG, q, sf);
}

TEST(QuantizeInput, AmaxExactlyPowerOfTwoTimes448) {
  for (int k = -20; k <= 20; ++k) {
    std::vector<float> v(kG, 0.0f);
    const float amax = std::ldexp(448.0f, k);
    v[5] = amax;
    v[6] = -amax / 2;
    v[7] = std::ldexp(1.0f, k);  // 1/448 of amax -> E4M3 value 1
    uint8_t q[kG], sf;
    quantize_one(v, q, &sf);
    EXPECT_EQ(sf, 127 + k) << "2^ceil(log2(amax/448)) = 2^" << k << " exactly";
    EXPECT_EQ(q[5], 0x7E) << "amax maps to 448";
    EXPECT_EQ(q[6], 0xF6) << "-224";
    EXPECT_EQ(q[7], 0x38) << "1.0";
    EXPECT_EQ(q[0], 0x00);
    // One BF16 ulp above: the next exponent, amax -> 224.
    v[5] = bf16_to_f32(static_cast<uint16_t>(bf16_from_f32(amax) + 1));
    quantize_one(v, q, &sf);
    EXPECT_EQ(sf, 128 + k);
    EXPECT_EQ(q[5], 0x76) << "224";
  }
}

TEST(QuantizeInput, AmaxFloor) {
  // amax = max(amax, 1e-4): 1e-4 / 448 = 2.23e-7 -> 2^-22 -> b = 105, for zeros and tiny groups.
  ASSERT_EQ(input_scale_exponent(0.0f), 105);
  ASSERT_EQ(input_scale_exponent(1e-4f), 105);
  ASSERT_EQ(input_scale_exponent(1e-6f), 105);
  uint8_t q[kG], sf;
  quantize_one(std::vector<float>(kG, 0.0f), q, &sf);
  EXPECT_EQ(sf, 105);
  for (int i = 0; i < kG; ++i) EXPECT_EQ(q[i], 0);
  std::vector<float> tiny(kG, 0.0f);
  tiny[0] = 1e-5f;  // below the floor: scaled by 2^22 -> 41.9 -> E4M3 40
  quantize_one(tiny, q, &sf);
  EXPECT_EQ(sf, 105);
  EXPECT_EQ(e4m3_to_f32(q[0]), 40.0f);
  EXPECT_EQ(q[0], e4m3_from_f32(bf16_round(1e-5f) * std::ldexp(1.0f, 22)));
  // Just above the floor: no longer floored.
  EXPECT_EQ(input_scale_exponent(2e-4f), 106);
}

TEST(QuantizeInput, NanAndInfBehaviour) {
  std::vector<float> v(kG);
  for (int i = 0; i < kG; ++i) v[i] = 0.1f * static_cast<float>(i - 16);
  uint8_t q_clean[kG], sf_clean;
  quantize_one(v, q_clean, &sf_clean);

  // NaN: ignored by amax (the scale is that of the other values); encodes to the NaN code.
  std::vector<float> with_nan = v;
  with_nan[3] = std::nanf("");
  with_nan[4] = -std::nanf("");
  uint8_t q[kG], sf;
  quantize_one(with_nan, q, &sf);
  EXPECT_EQ(sf, sf_clean);
  EXPECT_EQ(q[3], 0x7F);
  EXPECT_EQ(q[4], 0xFF);
  for (int i = 0; i < kG; ++i)
    if (i != 3 && i != 4) EXPECT_EQ(q[i], q_clean[i]) << i;
  // An all-NaN group: amax = 0 -> floored scale, all NaN codes.
  quantize_one(std::vector<float>(kG, std::nanf("")), q, &sf);
  EXPECT_EQ(sf, 105);
  for (int i = 0; i < kG; ++i) EXPECT_EQ(q[i] & 0x7F, 0x7F);

  // +-Inf: amax = Inf -> exponent 255 clamped to 254; Inf saturates to 448, finite values of
  // the group scale by 2^-127 to zero.
  std::vector<float> with_inf = v;
  with_inf[10] = kInf;
  with_inf[11] = -kInf;
  quantize_one(with_inf, q, &sf);
  EXPECT_EQ(sf, 254);
  EXPECT_EQ(q[10], 0x7E);
  EXPECT_EQ(q[11], 0xFE);
  for (int i = 0; i < kG; ++i)
    if (i != 10 && i != 11) EXPECT_EQ(q[i] & 0x7F, 0) << i;
  // Huge finite values saturate rather than overflow (BF16 max 3.39e38).
  std::vector<float> huge(kG, 3.0e38f);
  quantize_one(huge, q, &sf);
  EXPECT_LE(sf, 254);
  EXPECT_EQ(q[0], e4m3_from_f32(bf16_round(3.0e38f) * std::ldexp(1.0f, 127 - sf)));
}

TEST(QuantizeInput, MatchesTheRuleOnRandomData) {
  detail::SplitMix64 rng(5);
  const int64_t rows = 64, cols = 256;
  std::vector<uint16_t> x(static_cast<size_t>(rows * cols));
  for (auto& v : x) v = bf16_from_f32(static_cast<float>(rng.normal() * std::ldexp(1.0, static_cast<int>(rng.below(40)) - 20)));
  std::vector<uint8_t> q(x.size()), sf(x.size() / kG);
  quantize_input(x.data(), rows, cols, q.data(), sf.data());
  std::vector<float> deq(x.size());
  dequantize_fp8(q.data(), sf.data(), rows, cols, deq.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < cols / kG; ++g) {
      double amax = 0;
      for (int i = 0; i < kG; ++i) amax = std::max(amax, std::fabs(static_cast<double>(bf16_to_f32(x[r * cols + g * kG + i]))));
      amax = std::max(amax, static_cast<double>(1e-4f));
      const int b = static_cast<int>(std::ceil(std::log2(static_cast<double>(static_cast<float>(amax) / 448.0f)))) + 127;
      ASSERT_EQ(sf[r * (cols / kG) + g], std::clamp(b, 1, 254));
      for (int i = 0; i < kG; ++i) {
        const int64_t idx = r * cols + g * kG + i;
        const double xv = bf16_to_f32(x[idx]);
        // E4M3 has 3 mantissa bits: error <= 2^-4 relative, or half a subnormal step 2^-10 * scale.
        const double bound = std::max(std::fabs(xv) * 0.0625, std::ldexp(1.0, b - 127 - 10));
        ASSERT_LE(std::fabs(deq[idx] - xv), bound) << "row " << r << " col " << g * kG + i;
      }
    }
  }
}

TEST(RequantizeIntermediate, ZeroAndPowerOfTwoGroups) {
  std::vector<float> v(2 * kG, 0.0f);
  v[kG + 1] = 448.0f;
  v[kG + 2] = -1.0f;
  uint8_t q[2 * kG], sf[2];
  requantize_intermediate(v.data(), 1, 2 * kG, q, sf);
  EXPECT_EQ(sf[0], 0) << "amax = 0: scale byte 0, no floor";
  for (int i = 0; i < kG; ++i) EXPECT_EQ(q[i], 0);
  EXPECT_EQ(sf[1], 127);
  EXPECT_EQ(q[kG + 1], 0x7E);
  EXPECT_EQ(q[kG + 2], 0xB8);
  // No floor: a tiny group keeps its own scale.
  std::vector<float> tiny(kG, 0.0f);
  tiny[0] = std::ldexp(1.0f, -100);
  requantize_intermediate(tiny.data(), 1, kG, q, sf);
  EXPECT_EQ(sf[0], ue8m0_ceil_exponent(std::ldexp(1.0f, -100) / 448.0f));
  EXPECT_EQ(e4m3_to_f32(q[0]) * ue8m0_to_f32(sf[0]), std::ldexp(1.0f, -100)) << "exact";
  // +Inf: exponent clamped to 254 (never the NaN scale byte 255).
  tiny[1] = kInf;
  requantize_intermediate(tiny.data(), 1, kG, q, sf);
  EXPECT_EQ(sf[0], 254);
  EXPECT_EQ(q[1], 0x7E);
  EXPECT_EQ(intermediate_scale_exponent(0.0f), 0);
}

TEST(QuantizeMxfp4, ScaleIsCeilLog2OfAmaxOver6) {
  EXPECT_EQ(mxfp4_scale_exponent(6.0f), 127);
  EXPECT_EQ(mxfp4_scale_exponent(std::nextafter(6.0f, 7.0f)), 128);
  EXPECT_EQ(mxfp4_scale_exponent(3.0f), 126);
  EXPECT_EQ(mxfp4_scale_exponent(5.0f), 127);
  EXPECT_EQ(mxfp4_scale_exponent(0.0f), 0) << "all-zero group: byte 0";
  EXPECT_EQ(mxfp4_scale_exponent(std::ldexp(6.0f, -140)), 1) << "FP32 subnormal amax/6: bound 2^-126";

  // Known answers, including ties to the even code.
  std::vector<float> w(kG, 0.0f);
  w[0] = 6.0f;
  w[1] = 5.0f;    // tie between 4 and 6 -> even code 6 (4.0)
  w[2] = -2.5f;   // tie between 2 and 3 -> even code 4 (2.0)
  w[3] = 0.25f;   // tie between 0 and 0.5 -> code 0
  w[4] = 0.75f;   // tie between 0.5 and 1 -> code 2 (1.0)
  w[5] = 1.75f;   // tie between 1.5 and 2 -> code 4 (2.0)
  w[6] = 3.5f;    // tie between 3 and 4 -> code 6 (4.0)
  w[7] = -0.0f;
  uint8_t packed[kG / 2], sf;
  quantize_mxfp4(w.data(), 1, kG, packed, &sf);
  EXPECT_EQ(sf, 127);
  const uint8_t want[8] = {7, 6, 8 | 4, 0, 2, 4, 6, 8};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(e2m1_unpack(packed, i), want[i]) << "element " << i;

  // amax 7 -> scale 2: 7/2 = 3.5 is a tie -> 4 -> dequantized 8 (documented).
  std::vector<float> w7(kG, 0.0f);
  w7[0] = 7.0f;
  quantize_mxfp4(w7.data(), 1, kG, packed, &sf);
  EXPECT_EQ(sf, 128);
  float deq[kG];
  dequantize_mxfp4(packed, &sf, 1, kG, deq);
  EXPECT_EQ(deq[0], 8.0f);

  std::vector<float> zeros(kG, 0.0f);
  quantize_mxfp4(zeros.data(), 1, kG, packed, &sf);
  EXPECT_EQ(sf, 0);
  for (int i = 0; i < kG / 2; ++i) EXPECT_EQ(packed[i], 0);
}

TEST(QuantizeMxfp4, RoundTripsRepresentableWeightsAndBoundsTheRest) {
  detail::SplitMix64 rng(17);
  const int64_t rows = 16, cols = 128;
  // Representable: codes times a per-group power of two with a code of magnitude 6 present.
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < cols / kG; ++g) {
      const int e = static_cast<int>(rng.below(20)) - 10;
      for (int i = 0; i < kG; ++i)
        w[r * cols + g * kG + i] = e2m1_to_f32(static_cast<uint8_t>(i == 0 ? 7 : rng.below(16))) * std::ldexp(1.0f, e);
    }
  std::vector<uint8_t> packed(w.size() / 2), sf(w.size() / kG);
  quantize_mxfp4(w.data(), rows, cols, packed.data(), sf.data());
  std::vector<float> deq(w.size());
  dequantize_mxfp4(packed.data(), sf.data(), rows, cols, deq.data());
  EXPECT_EQ(deq, w);

  // BF16 entry point = FP32 entry point on the same values.
  std::vector<uint16_t> wb(w.size());
  for (size_t i = 0; i < w.size(); ++i) wb[i] = bf16_from_f32(w[i]);
  std::vector<uint8_t> packed_b(packed.size()), sf_b(sf.size());
  quantize_mxfp4_bf16(wb.data(), rows, cols, packed_b.data(), sf_b.data());
  EXPECT_EQ(packed_b, packed);
  EXPECT_EQ(sf_b, sf);

  // Random normal weights: error at most half the largest code gap (1.0) times the scale.
  for (auto& v : w) v = static_cast<float>(rng.normal());
  quantize_mxfp4(w.data(), rows, cols, packed.data(), sf.data());
  dequantize_mxfp4(packed.data(), sf.data(), rows, cols, deq.data());
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float scale = ue8m0_to_f32(sf[i / kG]);
    ASSERT_LE(std::fabs(deq[i] - w[i]), scale * 1.0f) << i;
    ASSERT_EQ(e2m1_unpack(packed.data() + (i / cols) * (cols / 2), i % cols),
              e2m1_from_f32(w[i] / scale)) << i;
  }
}

TEST(QuantizeMxfp4, RejectsNonFiniteWeights) {
  std::vector<float> w(2 * 64, 1.0f);
  w[64 + 37] = std::nanf("");
  std::vector<uint8_t> packed(w.size() / 2), sf(w.size() / kG);
  expect_error([&] { quantize_mxfp4(w.data(), 2, 64, packed.data(), sf.data()); },
               ErrorCode::kInvalidArgument, "weight [1, 37] is not finite");
  w[64 + 37] = -kInf;
  EXPECT_THROW(quantize_mxfp4(w.data(), 2, 64, packed.data(), sf.data()), Error);
  EXPECT_THROW(quantize_mxfp4(w.data(), 2, 48, packed.data(), sf.data()), Error) << "cols % 32";
}

TEST(Dequantize, Fp8IsCodeTimesScale) {
  for (int code = 0; code < 256; ++code) {
    for (int b : {1, 100, 127, 130, 200}) {
      const uint8_t q = static_cast<uint8_t>(code);
      std::vector<uint8_t> qs(kG, q);
      const uint8_t s = static_cast<uint8_t>(b);
      float out[kG];
      dequantize_fp8(qs.data(), &s, 1, kG, out);
      const double want = static_cast<double>(e4m3_to_f32(q)) * std::ldexp(1.0, b - 127);
      if ((code & 0x7F) == 0x7F) EXPECT_TRUE(std::isnan(out[0]));
      else EXPECT_EQ(static_cast<double>(out[0]), want) << code << " " << b;
    }
  }
}

}  // namespace
}  // namespace megamoe
