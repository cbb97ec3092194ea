// Weight preparation: every registered layout inverts exactly (bit for bit), blackwell-interop
// equals an independently written index formula, re-preparing is detected, the fused path
// prepares regardless of the current layout, and bad requests change nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "megamoe/prepare.hpp"
#include "test_checkpoint_fixtures.hpp"

namespace megamoe {
namespace {

using testing_ckpt::clone;
using testing_ckpt::random_weights;
using testing_ckpt::throws_error;
using testing_ckpt::weights_equal;

struct Dims {
  int64_t experts, hidden, intermediate;
  bool bias;
};
// Shapes chosen to hit each case: K a multiple of 128 or not (scale padding), biases or not.
const Dims kDims[] = {{3, 128, 64, false}, {2, 256, 128, true}, {4, 384, 192, false},
                      {1, 128, 128, true},  {5, 512, 320, true}};

// ---------------------------------------------------------------------------------------------
// Independent formula for blackwell-interop (weights.md section 3), written from the spec text
// in the forward direction (canonical row -> new row), with the int32 packing done on values.
// ---------------------------------------------------------------------------------------------
// Rule 2: gate row 8j + r -> new row 16j + r; up row 8j + r -> new row 16j + 8 + r.
int64_t spec_interleaved_row(int64_t canonical_row, int64_t I) {
  const bool up = canonical_row >= I;
  const int64_t g = up ? canonical_row - I : canonical_row;
  return 16 * (g / 8) + (up ? 8 : 0) + g % 8;
}
// Rule 3: within each 128-row block, old row 32a + b -> new row 4b + a.
int64_t spec_transposed_row(int64_t row) {
  const int64_t base = row / 128 * 128, old = row % 128;
  const int64_t a = old / 32, b = old % 32;
  return base + 4 * b + a;
}

// Rule 1: per expert, int32 [Np, ceil(G/4)] with strides (1, align(Np, 4)) holding 4 UE8M0
// bytes, group 4j in the low byte; `row_map` = rules 2/3 composed. Np = N rounded up to whole
// 128-row blocks of rule 3 (GPT-OSS H = 2880), the extra rows zero. Little-endian bytes.
std::vector<uint8_t> spec_scales(const uint8_t* sf, int64_t experts, int64_t N, int64_t G,
                                 const std::function<int64_t(int64_t)>& row_map) {
  const int64_t padded_n = (N + 127) / 128 * 128;
  const int64_t packs = (G + 3) / 4, stride_n = (padded_n + 3) / 4 * 4;
  std::vector<uint32_t> words(static_cast<size_t>(experts * packs * stride_n), 0u);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t dst_row = row_map(n);
      for (int64_t j = 0; j < packs; ++j) {
        uint32_t v = 0;
        for (int64_t byte = 0; byte < 4; ++byte) {
          const int64_t g = 4 * j + byte;
          if (g < G) v |= static_cast<uint32_t>(sf[(e * N + n) * G + g]) << (8 * byte);
        }
        words[static_cast<size_t>(e * packs * stride_n + j * stride_n + dst_row)] = v;
      }
    }
  }
  std::vector<uint8_t> bytes(words.size() * 4);
  for (size_t i = 0; i < words.size(); ++i)
    for (int b = 0; b < 4; ++b) bytes[i * 4 + b] = static_cast<uint8_t>(words[i] >> (8 * b));
  return bytes;
}

std::vector<uint8_t> spec_rows(const uint8_t* src, int64_t experts, int64_t rows, int64_t row_bytes,
                               const std::function<int64_t(int64_t)>& row_map) {
  std::vector<uint8_t> out(static_cast<size_t>(experts * rows * row_bytes));
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(&out[(e * rows + row_map(r)) * row_bytes], src + (e * rows + r) * row_bytes, row_bytes);
  return out;
}

::testing::AssertionResult bytes_equal(const Buffer& got, const std::vector<uint8_t>& want, const char* what) {
  if (got.size() != static_cast<int64_t>(want.size()))
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < want.size(); ++i) {
    if (got.as<uint8_t>()[i] != want[i])
      return ::testing::AssertionFailure() << what << ": first difference at byte " << i << ": "
                                           << int(got.as<uint8_t>()[i]) << " vs " << int(want[i]);
  }
  return ::testing::AssertionSuccess();
}

// kDims and dims that are not whole 128-row blocks: GPT-OSS (H = I = 2880), H = 96, 2I = 192.
TEST(PrepLayouts, BlackwellInteropMatchesTheSpecFormula) {
  std::vector<Dims> dims(std::begin(kDims), std::end(kDims));
  dims.insert(dims.end(), {{1, 2880, 2880, true}, {3, 96, 64, false}, {2, 160, 96, true}});
  for (const Dims& d : dims) {
    SCOPED_TRACE(testing::Message() << "E " << d.experts << " H " << d.hidden << " I " << d.intermediate);
    const int64_t H = d.hidden, I = d.intermediate, E = d.experts;
    MoeWeights w = random_weights(E, 0, H, I, d.bias, 77, 0, 255);
    const MoeWeights c = clone(w);
    const PrepareReport r = prepare(w, "blackwell-interop");
    EXPECT_EQ(w.layout, "blackwell-interop");
    EXPECT_FALSE(r.no_op);
    auto l1_rows = [&](int64_t s) { return spec_interleaved_row(s, I); };
    auto l1_sf_rows = [&](int64_t s) { return spec_transposed_row(spec_interleaved_row(s, I)); };
    EXPECT_TRUE(bytes_equal(w.w13, spec_rows(c.w13.as<uint8_t>(), E, 2 * I, H / 2, l1_rows), "w13"));
    EXPECT_TRUE(bytes_equal(w.w13_sf, spec_scales(c.w13_sf.as<uint8_t>(), E, 2 * I, H / 32, l1_sf_rows), "w13_sf"));
    EXPECT_TRUE(testing_ckpt::buffers_equal(w.w2, c.w2)) << "rule 4: w2 unchanged";
    EXPECT_TRUE(bytes_equal(w.w2_sf, spec_scales(c.w2_sf.as<uint8_t>(), E, H, I / 32, spec_transposed_row), "w2_sf"));
    if (d.bias) {
      EXPECT_TRUE(bytes_equal(w.w13_bias, spec_rows(c.w13_bias.as<uint8_t>(), E, 2 * I, 2, l1_rows), "w13_bias"));
      EXPECT_TRUE(testing_ckpt::buffers_equal(w.w2_bias, c.w2_bias));
    }
    // Sizes: int32 [E, Np, ceil(K/128)] with an MN stride of align(Np, 4), Np = align(N, 128).
    EXPECT_EQ(w.w2_sf.size(), E * ((I / 32 + 3) / 4) * 4 * ((H + 127) / 128 * 128));
    // The exact inverse drops the padding.
    unprepare(w);
    EXPECT_TRUE(weights_equal(w, c));
  }
}

// GPT-OSS (H = 2880) used to be refused; its prepared scales hold zero padding rows, the
// preparation goes through a prepared file and back bit for bit, and the fused path takes it.
TEST(PrepLayouts, BlackwellInteropPadsGptOssScaleRows) {
  const int64_t E = 2, H = 2880, I = 2880, Hp = 2944;  // 2944 = 23 blocks of 128 rows
  MoeWeights w = random_weights(E, 0, H, I, true, 29, 1, 254);
  const MoeWeights c = clone(w);
  const PrepareReport r = prepare_for_fused(w, 100);
  EXPECT_EQ(w.layout, "blackwell-interop");
  EXPECT_FALSE(r.no_op);
  const int64_t packs = (I / 32 + 3) / 4;  // 23 int32 per row: 90 groups + 2 zero bytes
  ASSERT_EQ(w.w2_sf.size(), E * packs * Hp * 4);
  // Prepared row p reads canonical row 32 (p % 4) + p / 4 of its block: rows whose source is
  // >= H (the last block holds 64 real rows) are zero in every pack.
  const auto* sf = w.w2_sf.as<uint8_t>();
  int64_t padding_rows = 0;
  for (int64_t p = 0; p < Hp; ++p) {
    const int64_t source = p / 128 * 128 + 32 * (p % 4) + (p % 128) / 4;
    if (source < H) continue;
    ++padding_rows;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t j = 0; j < packs; ++j)
        for (int b = 0; b < 4; ++b)
          ASSERT_EQ(sf[((e * packs + j) * Hp + p) * 4 + b], 0) << "row " << p << " pack " << j;
  }
  EXPECT_EQ(padding_rows, Hp - H);
  unprepare(w);
  EXPECT_TRUE(weights_equal(w, c));
}

TEST(PrepLayouts, BlackwellInteropSpotChecksFromTheSpecText) {
  // A few positions written out by hand (E = 1, H = 128, I = 64).
  const int64_t H = 128, I = 64;
  MoeWeights w = random_weights(1, 0, H, I, false, 1);
  for (int64_t r = 0; r < 2 * I; ++r) std::memset(w.w13.as<uint8_t>() + r * H / 2, static_cast<int>(r), H / 2);
  for (int64_t r = 0; r < 2 * I; ++r)
    for (int64_t g = 0; g < H / 32; ++g) w.w13_sf.as<uint8_t>()[r * (H / 32) + g] = static_cast<uint8_t>(r + 64 * g);
  prepare(w, "blackwell-interop");
  const uint8_t* w13 = w.w13.as<uint8_t>();
  EXPECT_EQ(w13[0 * 64], 0);        // new row 0 = gate row 0
  EXPECT_EQ(w13[7 * 64], 7);        // new row 7 = gate row 7
  EXPECT_EQ(w13[8 * 64], I + 0);    // new row 8 = up row 0
  EXPECT_EQ(w13[16 * 64], 8);       // new row 16 = gate row 8
  EXPECT_EQ(w13[31 * 64], I + 15);  // new row 31 = up row 15
  // Scales: int32 index j * 128 + n; byte 0 = group 0. New row 1 <- interleaved row 32 (a = 1,
  // b = 0) <- gate row 16 (16j + r with j = 2, r = 0). New row 4 <- interleaved row 1 <- gate 1.
  const auto* sf = w.w13_sf.as<uint8_t>();
  EXPECT_EQ(sf[(0 * 128 + 0) * 4 + 0], 0);
  EXPECT_EQ(sf[(0 * 128 + 1) * 4 + 0], 16);
  EXPECT_EQ(sf[(0 * 128 + 4) * 4 + 0], 1);
  EXPECT_EQ(sf[(0 * 128 + 4) * 4 + 3], 1 + 64 * 3);  // group 3 in the high byte
  // New row 2 <- interleaved row 64 (a = 2, b = 0) <- gate row 32; group 1 in byte 1.
  EXPECT_EQ(sf[(0 * 128 + 2) * 4 + 1], 32 + 64);
  // New row 5 <- interleaved row 33 (a = 1, b = 1) <- gate row 17.
  EXPECT_EQ(sf[(0 * 128 + 5) * 4 + 0], 17);
  // New row 32 <- interleaved row 8 (a = 0, b = 8) <- up row 0 = canonical row I.
  EXPECT_EQ(sf[(0 * 128 + 32) * 4 + 0], I);
}

// ---------------------------------------------------------------------------------------------
// Round trips and re-preparation
// ---------------------------------------------------------------------------------------------
// A test-only layout exercising the driver's other paths: w13 bytes reversed per expert, w2_sf
// grown by 16 padding bytes per expert (kept zero), w2 shrunk is impossible (no such layout), so
// the shrink path is covered by its inverse.
int64_t grown_w2_sf(const ExpertDims& d) { return d.hidden * d.intermediate / 32 + 16; }
void reverse_fwd(const uint8_t* s, uint8_t* d, int64_t n, const ExpertDims& dims) {
  const int64_t b = dims.hidden * dims.intermediate;
  for (int64_t e = 0; e < n; ++e)
    for (int64_t i = 0; i < b; ++i) d[e * b + i] = s[e * b + b - 1 - i];
}
void grow_fwd(const uint8_t* s, uint8_t* d, int64_t n, const ExpertDims& dims) {
  const int64_t c = dims.hidden * dims.intermediate / 32, p = c + 16;
  for (int64_t e = 0; e < n; ++e) {
    std::memset(d + e * p, 0, 16);
    std::memcpy(d + e * p + 16, s + e * c, c);
  }
}
void grow_inv(const uint8_t* s, uint8_t* d, int64_t n, const ExpertDims& dims) {
  const int64_t c = dims.hidden * dims.intermediate / 32, p = c + 16;
  for (int64_t e = 0; e < n; ++e) std::memcpy(d + e * c, s + e * p + 16, c);
}

const WeightLayout& test_layout() {
  static const bool registered = [] {
    WeightLayout l;
    l.name = "test-reverse-pad";
    l.description = "test only";
    l.buffers[static_cast<int>(WeightBufferKind::kW13)] = {nullptr, reverse_fwd, reverse_fwd, nullptr, nullptr};
    l.buffers[static_cast<int>(WeightBufferKind::kW2Sf)] = {grown_w2_sf, grow_fwd, grow_inv, nullptr, nullptr};
    register_layout(l);
    return true;
  }();
  (void)registered;
  return find_layout("test-reverse-pad");
}

TEST(PrepLayouts, EveryLayoutRoundTripsBitForBit) {
  test_layout();
  const auto names = layout_names();
  ASSERT_GE(names.size(), 3u);
  for (const std::string& name : names) {
    int served = 0;
    for (const Dims& d : kDims) {
      SCOPED_TRACE(testing::Message() << name << " E " << d.experts << " H " << d.hidden << " I "
                                      << d.intermediate << " bias " << d.bias);
      MoeWeights w = random_weights(d.experts, 2, d.hidden, d.intermediate, d.bias, 31, 0, 255);
      const MoeWeights original = clone(w);
      try {
        if (auto check = find_layout(name).check_dims) check({d.hidden, d.intermediate});
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
        EXPECT_TRUE(throws_error([&] { prepare(w, name); }, ErrorCode::kUnsupported, {}));
        EXPECT_TRUE(weights_equal(w, original)) << "a refused preparation changes nothing";
        continue;
      }
      ++served;
      const PrepareReport p = prepare(w, name);
      EXPECT_EQ(w.layout, name);
      EXPECT_EQ(p.no_op, name == kCanonicalLayout);
      check_weights_layout(w);
      const PrepareReport u = unprepare(w);
      EXPECT_EQ(u.to_layout, kCanonicalLayout);
      EXPECT_TRUE(weights_equal(w, original));
    }
    EXPECT_GT(served, 0) << name << " served none of the test shapes";
  }
}

TEST(PrepLayouts, ConversionBetweenLayoutsGoesThroughCanonical) {
  test_layout();
  MoeWeights w = random_weights(3, 0, 256, 128, true, 4, 0, 255);
  const MoeWeights original = clone(w);
  prepare(w, "test-reverse-pad");
  const PrepareReport r = prepare(w, "blackwell-interop");
  EXPECT_TRUE(r.converted);
  EXPECT_EQ(r.from_layout, "test-reverse-pad");
  MoeWeights direct = clone(original);
  prepare(direct, "blackwell-interop");
  EXPECT_TRUE(weights_equal(w, direct)) << "converting equals preparing from canonical";
  unprepare(w);
  EXPECT_TRUE(weights_equal(w, original));
}

TEST(PrepLayouts, PreparingTwiceIsDetectedAndIsANoOp) {
  MoeWeights w = random_weights(2, 0, 128, 64, false, 8, 0, 255);
  EXPECT_TRUE(prepare(w, "reference").no_op);  // canonical already
  EXPECT_TRUE(prepare(w, "cpu").no_op);
  EXPECT_TRUE(unprepare(w).no_op);
  EXPECT_FALSE(prepare(w, "blackwell-interop").no_op);
  const MoeWeights once = clone(w);
  const PrepareReport again = prepare(w, "blackwell-interop");
  EXPECT_TRUE(again.no_op);
  EXPECT_EQ(again.bytes_transformed, 0);
  EXPECT_NE(again.summary().find("already in layout 'blackwell-interop'"), std::string::npos);
  EXPECT_TRUE(weights_equal(w, once)) << "no double transform";
}

TEST(PrepLayouts, FusedPathPreparesWhateverTheDefaultBackendDid) {
  test_layout();
  EXPECT_EQ(fused_layout_for_arch(100), "blackwell-interop");
  EXPECT_EQ(fused_layout_for_arch(103), "blackwell-interop");
  EXPECT_EQ(fused_layout_for_arch(90), "sm90");
  EXPECT_TRUE(throws_error([] { fused_layout_for_arch(80); }, ErrorCode::kUnsupported, {"sm_80"}));
  EXPECT_TRUE(throws_error([] { fused_layout_for_arch(120); }, ErrorCode::kUnsupported, {"sm_120"}));

  MoeWeights w = random_weights(2, 0, 256, 128, false, 12, 0, 255);
  const MoeWeights original = clone(w);
  MoeWeights expected = clone(original);
  prepare(expected, "blackwell-interop");
  // The default backend prepared the weights for itself first.
  prepare(w, "test-reverse-pad");
  const PrepareReport r = prepare_for_fused(w, 100);
  EXPECT_TRUE(r.converted);
  EXPECT_EQ(w.layout, "blackwell-interop");
  EXPECT_TRUE(weights_equal(w, expected));
  EXPECT_TRUE(prepare_for_fused(w, 100).no_op);
  // Hopper's fused path: the sm90 layout when this build has it.
  MoeWeights h = clone(original);
  if (has_layout("sm90")) {
    prepare_for_fused(h, 90);
    EXPECT_EQ(h.layout, "sm90");
    unprepare(h);
    EXPECT_TRUE(weights_equal(h, original));
  } else {
    EXPECT_TRUE(throws_error([&] { prepare_for_fused(h, 90); }, ErrorCode::kInvalidArgument,
                             {"layout 'sm90' is not registered"}));
    EXPECT_TRUE(weights_equal(h, original));
  }
}

TEST(PrepLayouts, ScratchSizeAndProgressDoNotChangeTheResult) {
  MoeWeights ref = random_weights(7, 0, 384, 192, true, 13, 0, 255);
  const MoeWeights original = clone(ref);
  prepare(ref, "blackwell-interop");
  for (int64_t scratch : {int64_t{0}, int64_t{1}, int64_t{50000}, int64_t{3} << 20, int64_t{1} << 40}) {
    SCOPED_TRACE(scratch);
    MoeWeights w = clone(original);
    PrepareOptions opt;
    opt.scratch_bytes = scratch;
    int64_t last = 0, total = -1, calls = 0;
    opt.progress = [&](int64_t done, int64_t all) {
      EXPECT_GE(done, last);
      last = done;
      total = all;
      ++calls;
    };
    const PrepareReport r = prepare(w, "blackwell-interop", opt);
    EXPECT_TRUE(weights_equal(w, ref));
    EXPECT_GT(calls, 0);
    EXPECT_EQ(last, total);
    EXPECT_EQ(r.bytes_transformed, total);
    last = 0;
    unprepare(w, opt);
    EXPECT_EQ(last, total);
    EXPECT_TRUE(weights_equal(w, original));
  }
}

// ---------------------------------------------------------------------------------------------
// Bad requests (docs/reliability.md, "weight preparation")
// ---------------------------------------------------------------------------------------------
TEST(PrepErrors, BadRequestsAreRejectedAndChangeNothing) {
  MoeWeights w = random_weights(2, 0, 128, 64, true, 3);
  const MoeWeights original = clone(w);
  EXPECT_TRUE(throws_error([&] { prepare(w, "tpu"); }, ErrorCode::kInvalidArgument,
                           {"unknown backend 'tpu'", "blackwell-interop"}));
  // Buffers that do not match the declared layout.
  MoeWeights shrunk = clone(w);
  shrunk.w2_sf.shrink(shrunk.w2_sf.size() - 1);
  EXPECT_TRUE(throws_error([&] { prepare(shrunk, "blackwell-interop"); }, ErrorCode::kInvalidArgument,
                           {"weights.w2_sf: expected 512 bytes for layout 'canonical'", "got 511"}));
  MoeWeights lying = clone(w);
  lying.layout = "blackwell-interop";  // claims prepared, holds canonical bytes of another size
  lying.w13_bias.release();
  lying.w2_bias.release();
  EXPECT_TRUE(throws_error([&] { unprepare(lying); }, ErrorCode::kInvalidArgument,
                           {"weights.w2_sf: expected 1024 bytes for layout 'blackwell-interop'", "got 512"}));
  MoeWeights half_bias = clone(w);
  half_bias.w2_bias.release();
  EXPECT_TRUE(throws_error([&] { prepare(half_bias, "blackwell-interop"); }, ErrorCode::kInvalidArgument,
                           {"w13_bias and w2_bias must both be present"}));
  MoeWeights unknown = clone(w);
  unknown.layout = "mystery";
  EXPECT_TRUE(throws_error([&] { unprepare(unknown); }, ErrorCode::kInvalidArgument,
                           {"layout 'mystery' is not registered"}));
  MoeWeights bad_dims = clone(w);
  bad_dims.hidden = 100;
  EXPECT_TRUE(throws_error([&] { prepare(bad_dims, "blackwell-interop"); }, ErrorCode::kInvalidArgument,
                           {"weights.hidden", "got 100"}));
  MoeWeights huge = clone(w);
  huge.num_local_experts = int64_t{1} << 40;
  huge.hidden = int64_t{1} << 20;
  huge.intermediate = int64_t{1} << 20;
  EXPECT_TRUE(throws_error([&] { prepare(huge, "blackwell-interop"); }, ErrorCode::kInvalidArgument, {"too large"}));
  EXPECT_TRUE(weights_equal(w, original));
}

TEST(PrepErrors, WeightsLabelledWithALayoutThatCannotHoldTheirDimsAreRefused) {
  // Regression (fuzz_prepare, crash-3a56572e): weights labelled "sm90" with H = 224, I = 160
  // were unprepared without the source layout's dimension check, and the sm90 inverse read out
  // of bounds. Every layout's check_dims now runs for the layout the weights claim to be in.
  for (const std::string& name : layout_names()) {
    const auto check = find_layout(name).check_dims;
    if (check == nullptr) continue;
    SCOPED_TRACE(name);
    for (const auto& [h, i] : {std::pair<int64_t, int64_t>{224, 160}, {96, 64}, {160, 32}}) {
      bool served = true;
      try {
        check({h, i});
      } catch (const Error&) {
        served = false;
      }
      if (served) continue;
      MoeWeights w = random_weights(3, 0, h, i, true, 6);
      w.layout = name;
      const MoeWeights before = clone(w);
      EXPECT_TRUE(throws_error([&] { unprepare(w); }, ErrorCode::kUnsupported, {}));
      EXPECT_TRUE(throws_error([&] { prepare(w, "blackwell-interop"); }, ErrorCode::kUnsupported, {}));
      EXPECT_TRUE(weights_equal(w, before));
    }
  }
}

TEST(PrepErrors, RegisteringAnInconsistentLayoutFails) {
  WeightLayout l;
  l.name = "canonical";
  EXPECT_TRUE(throws_error([&] { register_layout(l); }, ErrorCode::kInvalidArgument, {"already registered"}));
  l.name = "";
  EXPECT_TRUE(throws_error([&] { register_layout(l); }, ErrorCode::kInvalidArgument, {"empty layout name"}));
  l.name = "one-way";
  l.buffers[0].forward = reverse_fwd;
  EXPECT_TRUE(throws_error([&] { register_layout(l); }, ErrorCode::kInvalidArgument, {"w13", "forward and inverse"}));
  l.buffers[0].forward = nullptr;
  l.buffers[3].prepared_expert_bytes = grown_w2_sf;
  EXPECT_TRUE(throws_error([&] { register_layout(l); }, ErrorCode::kInvalidArgument, {"w2_sf", "size change needs a transform"}));
  EXPECT_FALSE(has_layout("one-way"));
}

}  // namespace
}  // namespace megamoe
