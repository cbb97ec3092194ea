// Codecs of numerics.md section 1, checked exhaustively over every code and against slow,
// independently written encoders (nearest representable value by search, in double).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "megamoe/formats.hpp"
#include "runtime/random.hpp"

namespace megamoe {
namespace {

// ---------------------------------------------------------------------------------------------
// Independent slow references
// ---------------------------------------------------------------------------------------------
double e4m3_value_slow(int code) {
  const int s = (code >> 7) & 1, e = (code >> 3) & 0xF, m = code & 7;
  const double mag = e == 0 ? (m / 8.0) * std::ldexp(1.0, -6) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return s ? -mag : mag;
}

// Nearest E4M3 code by exhaustive search; ties to the even code; saturating at 448; NaN -> 0x7F.
uint8_t e4m3_encode_slow(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return sign | 0x7F;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 448.0) return sign | 0x7E;
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double d = std::fabs(e4m3_value_slow(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | static_cast<uint8_t>(best);
}

const double kE2M1Values[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

uint8_t e2m1_encode_slow(float f) {
  const uint8_t sign = std::signbit(f) ? 0x8 : 0x0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 6.0) return sign | 7;  // saturating
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 8; ++c) {
    const double d = std::fabs(kE2M1Values[c] - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | static_cast<uint8_t>(best);
}

// BF16 by comparing the two neighbouring BF16 values in double; ties to even; NaN stays NaN.
uint16_t bf16_encode_slow(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  const uint32_t lo = u & 0xFFFF0000u;
  if (lo == u) return static_cast<uint16_t>(u >> 16);
  const uint32_t hi = lo + 0x10000u;  // next BF16 away from zero (may be Inf)
  auto value = [](uint32_t bits) {
    if ((bits & 0x7FFFFFFFu) == 0x7F800000u) return std::ldexp(1.0, 128);  // Inf as 2^128
    float v;
    std::memcpy(&v, &bits, 4);
    return std::fabs(static_cast<double>(v));
  };
  const double a = std::fabs(static_cast<double>(f));
  const double dlo = a - value(lo), dhi = value(hi) - a;
  if (dlo < dhi) return static_cast<uint16_t>(lo >> 16);
  if (dhi < dlo) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
}

float from_bits(uint32_t u) { return f32_from_bits(u); }

// Floats that stress an encoder: every exponent, the mantissa patterns around every rounding
// boundary of `kept` mantissa bits (exact ties, one ulp either side), plus random bits.
std::vector<float> stress_floats(int kept, int num_random) {
  std::vector<float> out;
  const int drop = 23 - kept;
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t exp = 0; exp < 256; ++exp) {
      for (uint32_t top = 0; top < (1u << kept); ++top) {
        const uint32_t base = (sign << 31) | (exp << 23) | (top << drop);
        const uint32_t half = 1u << (drop - 1);
        for (uint32_t low : {0u, 1u, half - 1, half, half + 1, (1u << drop) - 1})
          out.push_back(from_bits(base | low));
      }
    }
  }
  detail::SplitMix64 rng(1234);
  for (int i = 0; i < num_random; ++i) out.push_back(from_bits(static_cast<uint32_t>(rng.next())));
  return out;
}

bool same_bits(float a, float b) { return f32_bits(a) == f32_bits(b); }

// ---------------------------------------------------------------------------------------------
// E4M3
// ---------------------------------------------------------------------------------------------
TEST(E4M3, DecodeEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << "code " << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), e4m3_value_slow(c)) << "code " << c;
    if (c == 0x80) EXPECT_TRUE(std::signbit(v)) << "-0 keeps its sign";
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));
}

TEST(E4M3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    EXPECT_EQ(e4m3_from_f32(e4m3_to_f32(code)), code) << "code " << c;
  }
}

TEST(E4M3, EncoderMatchesSlowReference) {
  int64_t checked = 0;
  for (float f : stress_floats(/*kept=*/3, /*num_random=*/200000)) {
    ASSERT_EQ(e4m3_from_f32(f), e4m3_encode_slow(f)) << "f = " << f << " bits 0x" << std::hex
                                                     << f32_bits(f);
    ++checked;
  }
  EXPECT_GT(checked, 200000);
}

TEST(E4M3, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(e4m3_from_f32(inf), 0x7E) << "+Inf saturates to +448";
  EXPECT_EQ(e4m3_from_f32(-inf), 0xFE) << "-Inf saturates to -448";
  EXPECT_EQ(e4m3_from_f32(std::nanf("")), 0x7F);
  EXPECT_EQ(e4m3_from_f32(-std::nanf("")), 0xFF);
  EXPECT_EQ(e4m3_from_f32(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_f32(0.0f), 0x00);
  EXPECT_EQ(e4m3_from_f32(448.0f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(464.0f), 0x7E) << "the tie above 448 saturates";
  EXPECT_EQ(e4m3_from_f32(1e30f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(from_bits(0x43E00000u - 1)), 0x7E) << "just below 448 rounds to 448";
  EXPECT_EQ(e4m3_from_f32(432.0f), 0x7E) << "tie 416|448 goes to the even code 448 (0x7E)";
  EXPECT_EQ(e4m3_from_f32(std::ldexp(1.0f, -10)), 0x00) << "half of the smallest subnormal: tie to 0";
  EXPECT_EQ(e4m3_from_f32(std::ldexp(1.5f, -10)), 0x01);
  EXPECT_EQ(e4m3_from_f32(std::ldexp(3.0f, -10)), 0x02) << "tie 1|2 (x 2^-9) goes to even 2";
  EXPECT_EQ(e4m3_from_f32(from_bits(1)), 0x00) << "FP32 subnormal";
  EXPECT_EQ(e4m3_from_f32(std::ldexp(1.0f, -6) * 0.9375f), 0x08) << "rounds up into the normals";
}

// ---------------------------------------------------------------------------------------------
// E2M1
// ---------------------------------------------------------------------------------------------
TEST(E2M1, DecodeEveryCode) {
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_to_f32(static_cast<uint8_t>(c));
    const double expect = (c & 8) ? -kE2M1Values[c & 7] : kE2M1Values[c & 7];
    EXPECT_EQ(static_cast<double>(v), expect) << "code " << c;
    EXPECT_EQ(std::signbit(v), (c & 8) != 0) << "code " << c;
    EXPECT_EQ(e2m1_from_f32(v), c) << "round trip of code " << c;
  }
}

TEST(E2M1, MidpointsTiesAndSaturation) {
  // Every midpoint between neighbours goes to the even code; one ulp either side goes to the
  // nearer value.
  for (int c = 0; c < 7; ++c) {
    const float mid = static_cast<float>((kE2M1Values[c] + kE2M1Values[c + 1]) / 2);
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(e2m1_from_f32(mid), even) << "midpoint " << mid;
    EXPECT_EQ(e2m1_from_f32(-mid), 8 | even) << "midpoint " << -mid;
    EXPECT_EQ(e2m1_from_f32(std::nextafter(mid, 0.0f)), c) << "below " << mid;
    EXPECT_EQ(e2m1_from_f32(std::nextafter(mid, 10.0f)), c + 1) << "above " << mid;
  }
  EXPECT_EQ(e2m1_from_f32(7.0f), 7);
  EXPECT_EQ(e2m1_from_f32(1e9f), 7);
  EXPECT_EQ(e2m1_from_f32(-std::numeric_limits<float>::infinity()), 15);
  EXPECT_EQ(e2m1_from_f32(-0.0f), 8);
  EXPECT_EQ(e2m1_from_f32(std::nanf("")), 0) << "documented: NaN -> +0 (the quantizer rejects NaN first)";
  for (float f : stress_floats(/*kept=*/2, /*num_random=*/100000)) {
    if (std::isnan(f)) continue;
    ASSERT_EQ(e2m1_from_f32(f), e2m1_encode_slow(f)) << "f = " << f;
  }
}

TEST(E2M1, Packing) {
  for (int lo = 0; lo < 16; ++lo) {
    for (int hi = 0; hi < 16; ++hi) {
      const uint8_t byte = e2m1_pack(static_cast<uint8_t>(lo), static_cast<uint8_t>(hi));
      EXPECT_EQ(byte, lo | (hi << 4));
      const uint8_t packed[2] = {byte, static_cast<uint8_t>(~byte)};
      EXPECT_EQ(e2m1_unpack(packed, 0), lo) << "even k is the low nibble";
      EXPECT_EQ(e2m1_unpack(packed, 1), hi) << "odd k is the high nibble";
      EXPECT_EQ(e2m1_unpack(packed, 2), (~byte) & 0xF);
      EXPECT_EQ(e2m1_unpack(packed, 3), ((~byte) >> 4) & 0xF);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// UE8M0
// ---------------------------------------------------------------------------------------------
TEST(UE8M0, DecodeEveryCode) {
  for (int b = 0; b < 255; ++b) {
    const float v = ue8m0_to_f32(static_cast<uint8_t>(b));
    EXPECT_EQ(static_cast<double>(v), std::ldexp(1.0, b - 127)) << "byte " << b;
  }
  EXPECT_TRUE(std::isnan(ue8m0_to_f32(0xFF)));
  EXPECT_EQ(ue8m0_to_f32(0), std::ldexp(1.0f, -127)) << "FP32 subnormal, exact";
}

TEST(UE8M0, CeilExponentMatchesLog2) {
  // r = 2^k exactly -> k + 127; anything above 2^k up to 2^(k+1) -> k + 128.
  for (int k = -126; k <= 127; ++k) {
    const float p = std::ldexp(1.0f, k);
    EXPECT_EQ(ue8m0_ceil_exponent(p), k + 127) << "2^" << k;
    if (k < 127) {
      EXPECT_EQ(ue8m0_ceil_exponent(std::nextafter(p, std::numeric_limits<float>::infinity())), k + 128) << "above 2^" << k;
      EXPECT_EQ(ue8m0_ceil_exponent(p * 1.5f), k + 128) << "1.5 * 2^" << k;
    }
  }
  detail::SplitMix64 rng(99);
  for (int i = 0; i < 100000; ++i) {
    const float r = from_bits(static_cast<uint32_t>(rng.next()) & 0x7F7FFFFFu);
    if (r < std::numeric_limits<float>::min()) continue;  // normals only: see the header
    int e = 0;
    const double m = std::frexp(static_cast<double>(r), &e);  // r = m 2^e, m in [0.5, 1)
    const int ceil_log2 = (m == 0.5) ? e - 1 : e;
    ASSERT_EQ(ue8m0_ceil_exponent(r), ceil_log2 + 127) << "r = " << r;
  }
  EXPECT_EQ(ue8m0_ceil_exponent(0.0f), 0);
  EXPECT_EQ(ue8m0_ceil_exponent(std::numeric_limits<float>::infinity()), 255);
  EXPECT_EQ(ue8m0_ceil_exponent(from_bits(1)), 1) << "subnormal: upper bound 2^-126";
}

// ---------------------------------------------------------------------------------------------
// BF16
// ---------------------------------------------------------------------------------------------
TEST(BF16, RoundNearestEvenMatchesSlowReference) {
  for (float f : stress_floats(/*kept=*/7, /*num_random=*/200000)) {
    ASSERT_EQ(bf16_from_f32(f), bf16_encode_slow(f)) << "f = " << f << " bits 0x" << std::hex
                                                     << f32_bits(f);
  }
}

TEST(BF16, TiesSpecialsAndRoundTrip) {
  EXPECT_EQ(bf16_from_f32(from_bits(0x3F808000u)), 0x3F80) << "tie, even below";
  EXPECT_EQ(bf16_from_f32(from_bits(0x3F818000u)), 0x3F82) << "tie, odd below -> up";
  EXPECT_EQ(bf16_from_f32(from_bits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bf16_from_f32(from_bits(0x7F7F8000u)), 0x7F80) << "tie above max -> Inf";
  EXPECT_EQ(bf16_from_f32(from_bits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(bf16_from_f32(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_from_f32(-0.0f), 0x8000);
  const uint16_t nan = bf16_from_f32(from_bits(0x7F800001u));  // signalling NaN, payload in low bits
  EXPECT_TRUE(std::isnan(bf16_to_f32(nan))) << "a NaN whose payload is only in the low half stays NaN";
  EXPECT_TRUE(std::isnan(bf16_round(-std::nanf(""))));
  EXPECT_TRUE(std::signbit(bf16_round(-std::nanf(""))));
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float v = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(bf16_round(v)));
      continue;
    }
    ASSERT_EQ(bf16_from_f32(v), h) << "BF16 value 0x" << std::hex << h << " round trips";
  }
}

TEST(Formats, Exp2i) {
  for (int k = -149; k <= 127; ++k) EXPECT_EQ(static_cast<double>(exp2i(k)), std::ldexp(1.0, k)) << k;
  for (int shift = 1; shift < 31; ++shift) {
    const uint32_t half = 1u << (shift - 1);
    EXPECT_EQ(shift_right_rne(half, shift), 0u) << "0.5 -> 0 (even)";
    EXPECT_EQ(shift_right_rne(3 * half, shift), 2u) << "1.5 -> 2 (even)";
    EXPECT_EQ(shift_right_rne(5 * half, shift), 2u) << "2.5 -> 2 (even)";
  }
}

}  // namespace
}  // namespace megamoe
