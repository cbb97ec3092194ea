// The "sm90" prepared layout: bit-exact round trip, and equality with an independently written
// nibble-level index formula (docs/layouts.md, sm90 section), on the host.
#include <gtest/gtest.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/prepare.hpp"
#include "megamoe/weights.hpp"
#include "kernels/layout/sm90_weight_layout.hpp"
#include "prep/sm90_layout.hpp"
#include "test_util.hpp"

namespace megamoe {
namespace {

using test::expect_error;

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Independent formula: where canonical nibble (row c, k) lands in the prepared expert.
// Written from the wgmma fragment description and the bit table of docs/layouts-sm90.md, not
// from kernels/layout/sm90_weight_layout.hpp.
struct NibblePos {
  int64_t word;  // prepared 32-bit word (little-endian) of the expert
  int bit[4];    // word bit of code bit 0 (m), 1 (e0), 2 (e1), 3 (sign)
};

// kWordBit[register][element][code bit], the docs' table.
constexpr int kWordBit[4][2][4] = {
    {{2, 3, 4, 11}, {18, 19, 20, 27}},
    {{8, 9, 10, 17}, {24, 25, 26, 1}},
    {{12, 13, 14, 21}, {28, 29, 30, 5}},
    {{6, 7, 0, 15}, {22, 23, 16, 31}},
};

int64_t prepared_row(bool w13, int64_t c, int64_t I) {
  if (!w13) return c;
  const bool up = c >= I;
  const int64_t j = up ? c - I : c;
  return 2 * j - j % 8 + (up ? 8 : 0);  // 16 (j / 8) + j % 8, up rows 8 later
}

NibblePos nibble_pos(bool w13, int64_t c, int64_t k, int64_t I, int64_t K) {
  const int64_t p = prepared_row(w13, c, I);
  const int64_t mb = p / 64, kb = k / 64;
  const int warp = static_cast<int>(p % 64) / 16;
  const int row_in_warp = static_cast<int>(p % 16);  // g or g + 8
  const int g = row_in_warp % 8, upper_row = row_in_warp / 8;
  const int kk = static_cast<int>(k % 64);
  const int step = kk / 16, kin = kk % 16;
  const int upper_k = kin / 8, t = (kin % 8) / 2, elem = kin % 2;
  const int reg = upper_row + 2 * upper_k;  // a0..a3 of the m64k16 fragment
  const int thread = 32 * warp + 4 * g + t;
  NibblePos pos{};
  pos.word = ((mb * (K / 64) + kb) * 128 + thread) * 4 + step;
  for (int b = 0; b < 4; ++b) pos.bit[b] = kWordBit[reg][elem][b];
  return pos;
}

uint8_t code_at(const std::vector<uint8_t>& prepared, const NibblePos& pos) {
  uint32_t w = 0;
  for (int i = 0; i < 4; ++i) w |= static_cast<uint32_t>(prepared[pos.word * 4 + i]) << (8 * i);
  uint8_t code = 0;
  for (int b = 0; b < 4; ++b) code |= static_cast<uint8_t>(((w >> pos.bit[b]) & 1u) << b);
  return code;
}

int64_t scale_pos(bool w13, int64_t c, int64_t group, int64_t I, int64_t K) {
  const int64_t p = prepared_row(w13, c, I);
  const int64_t mb = p / 64, kb = group / 2;
  const int warp = static_cast<int>(p % 64) / 16, g = static_cast<int>(p % 8);
  const int half = static_cast<int>(p % 16) / 8;
  return (mb * (K / 64) + kb) * 128 + (8 * warp + g) * 4 + 2 * half + group % 2;
}

void check_matrix(Sm90Matrix which, const ExpertDims& dims, uint32_t seed) {
  const bool w13 = which == Sm90Matrix::kW13;
  const int64_t rows = w13 ? 2 * dims.intermediate : dims.hidden;
  const int64_t K = w13 ? dims.hidden : dims.intermediate;
  const auto w = random_bytes(rows * K / 2, seed);
  const auto sf = random_bytes(rows * K / 32, seed + 1);
  std::vector<uint8_t> pw(w.size()), psf(sf.size()), bw(w.size()), bsf(sf.size());
  sm90_prepare_expert(which, dims, w.data(), sf.data(), pw.data(), psf.data());

  int64_t mismatches = 0;
  for (int64_t c = 0; c < rows; ++c) {
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t canon = (w[c * K / 2 + k / 2] >> (4 * (k % 2))) & 0xF;
      const NibblePos pos = nibble_pos(w13, c, k, dims.intermediate, K);
      const uint8_t prep = code_at(pw, pos);
      if (canon != prep && ++mismatches <= 5) {
        ADD_FAILURE() << "nibble row " << c << " k " << k << ": canonical " << int(canon)
                      << " prepared " << int(prep) << " (H " << dims.hidden << " I "
                      << dims.intermediate << (w13 ? " w13)" : " w2)");
      }
    }
    for (int64_t grp = 0; grp < K / 32; ++grp) {
      const uint8_t canon = sf[c * (K / 32) + grp];
      const uint8_t prep = psf[scale_pos(w13, c, grp, dims.intermediate, K)];
      if (canon != prep && ++mismatches <= 5) {
        ADD_FAILURE() << "scale row " << c << " group " << grp << ": canonical " << int(canon)
                      << " prepared " << int(prep);
      }
    }
  }
  EXPECT_EQ(mismatches, 0);

  sm90_unprepare_expert(which, dims, pw.data(), psf.data(), bw.data(), bsf.data());
  EXPECT_EQ(bw, w) << "weights round trip";
  EXPECT_EQ(bsf, sf) << "scales round trip";
}

TEST(Sm90Layout, MatchesIndependentFormulaAndInverts) {
  for (const ExpertDims dims : {ExpertDims{128, 64}, ExpertDims{192, 128}, ExpertDims{256, 320}}) {
    check_matrix(Sm90Matrix::kW13, dims, 7);
    check_matrix(Sm90Matrix::kW2, dims, 11);
  }
}

// The kernels' decoding of a word: every register half reads as a BF16 equal to its E2M1 code's
// value times 2^-126 (sign at bit 15, magnitude e1 e0 m at bits 8..6), for every code in every
// position, whatever the other codes of the word.
TEST(Sm90Layout, DecodedWordIsE2m1TimesTwoToMinus126) {
  namespace L = sm90_layout;
  std::mt19937 rng(5);
  for (int reg = 0; reg < 4; ++reg) {
    for (int elem = 0; elem < 2; ++elem) {
      for (uint8_t code = 0; code < 16; ++code) {
        for (int trial = 0; trial < 8; ++trial) {
          uint8_t bytes[4];
          for (auto& b : bytes) b = static_cast<uint8_t>(rng());
          bytes[reg] = static_cast<uint8_t>(elem == 0 ? (bytes[reg] & 0xF0) | code
                                                      : (bytes[reg] & 0x0F) | (code << 4));
          uint32_t a[4];
          L::decode_word_bits(L::pack_word(bytes), a);
          const uint32_t half = (a[reg] >> (16 * elem)) & 0xFFFFu;
          EXPECT_EQ(half & ~0x81C0u, 0u) << "stray bits, register " << reg;
          float value;
          const uint32_t f32 = half << 16;
          std::memcpy(&value, &f32, sizeof value);
          EXPECT_EQ(value, std::ldexp(e2m1_to_f32(code), -126))
              << "register " << reg << " element " << elem << " code " << int(code);
          EXPECT_EQ(L::unpack_word_byte(L::pack_word(bytes), reg), bytes[reg]);
        }
      }
    }
  }
}

TEST(Sm90Layout, RejectsUnalignedDims) {
  std::vector<uint8_t> buf(96 * 64);
  expect_error([&] {
    sm90_prepare_expert(Sm90Matrix::kW2, ExpertDims{96, 64}, buf.data(), buf.data(), buf.data(),
                        buf.data());
  }, ErrorCode::kUnsupported, "hidden");
}

TEST(Sm90Layout, RegisteredLayoutRoundTripsWholeLayer) {
  LayerConfig config;
  config.shape = LayerShape{256, 128, 4, 2};
  config.activation = Activation::swiglu();
  MoeWeights w = synthetic_weights(config, 3, /*with_bias=*/true);
  const std::vector<uint8_t> w13(w.w13.as<uint8_t>(), w.w13.as<uint8_t>() + w.w13.size());
  const std::vector<uint8_t> w2sf(w.w2_sf.as<uint8_t>(), w.w2_sf.as<uint8_t>() + w.w2_sf.size());
  const PrepareReport rep = prepare(w, "sm90");
  EXPECT_EQ(w.layout, "sm90") << rep.summary();
  EXPECT_EQ(w.w13.size(), static_cast<int64_t>(w13.size()));
  // Expert 1 of w13 equals the per-expert function applied to canonical expert 1.
  const ExpertDims dims{256, 128};
  const int64_t eb = 2 * 128 * 256 / 2, esf = 2 * 128 * 256 / 32;
  std::vector<uint8_t> sf_dummy(esf), pw(eb), psf(esf);
  sm90_prepare_expert(Sm90Matrix::kW13, dims, w13.data() + eb, sf_dummy.data(), pw.data(),
                      psf.data());
  EXPECT_TRUE(std::equal(pw.begin(), pw.end(), w.w13.as<uint8_t>() + eb));
  EXPECT_TRUE(prepare(w, "sm90").no_op);
  unprepare(w);
  EXPECT_EQ(w.layout, kCanonicalLayout);
  EXPECT_TRUE(std::equal(w13.begin(), w13.end(), w.w13.as<uint8_t>()));
  EXPECT_TRUE(std::equal(w2sf.begin(), w2sf.end(), w.w2_sf.as<uint8_t>()));
}

}  // namespace
}  // namespace megamoe
