// The "sm90" prepared layout: bit-exact round trip, and equality with an independently written
// nibble-level index formula (docs/layouts.md, sm90 section), on the host.
#include <gtest/gtest.h>

#include <cstdint>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/prepare.hpp"
#include "megamoe/weights.hpp"
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
// Written from the wgmma fragment description, not from kernels/layout/sm90_weight_layout.hpp.
struct NibblePos {
  int64_t byte;
  int shift;
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
  const int nib = reg + 4 * elem;
  const int thread = 32 * warp + 4 * g + t;
  const int64_t byte = ((mb * (K / 64) + kb) * 128 + thread) * 16 + step * 4 + nib / 2;
  return {byte, 4 * (nib % 2)};
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
      const uint8_t prep = (pw[pos.byte] >> pos.shift) & 0xF;
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
