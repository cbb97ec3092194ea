// Bounded-memory preparation (weights.md section 3: "no duplicate copy survives"). The peak of
// host memory held through Buffer is measured around each preparation; it may exceed the
// weights by one expert (the scratch) or, for a layout that pads a scale buffer, by that one
// scale buffer, never by a second copy of the layer. The detector's sensitivity is proven by
// running it on a deliberately naive copy-based preparation, which it must flag.
#include <gtest/gtest.h>

#include <algorithm>

#include "megamoe/prepare.hpp"
#include "test_checkpoint_fixtures.hpp"

namespace megamoe {
namespace {

using testing_ckpt::clone;
using testing_ckpt::random_weights;
using testing_ckpt::weights_equal;

// Extra host bytes held at the peak while fn runs, beyond what was held before it.
int64_t peak_extra_bytes(const std::function<void()>& fn) {
  reset_memory_peak();
  const int64_t before = memory_stats().host_bytes;
  fn();
  return memory_stats().host_peak_bytes - before;
}

int64_t layer_bytes(const MoeWeights& w) {
  return w.w13.size() + w.w13_sf.size() + w.w2.size() + w.w2_sf.size() + w.w13_bias.size() +
         w.w2_bias.size();
}

// The largest per-expert buffer of the layout (what one scratch expert must hold).
int64_t largest_expert_bytes(const MoeWeights& w, const WeightLayout& layout) {
  int64_t m = 0;
  for (int b = 0; b < kNumWeightBuffers; ++b) {
    const auto kind = static_cast<WeightBufferKind>(b);
    m = std::max({m, canonical_expert_bytes(kind, {w.hidden, w.intermediate}),
                  layout.expert_bytes(kind, {w.hidden, w.intermediate})});
  }
  return m;
}

// What the bound allows: one expert of scratch, or a grown (padded) buffer, whichever is larger.
int64_t allowed_extra(const MoeWeights& w, const WeightLayout& layout) {
  int64_t allowed = largest_expert_bytes(w, layout);
  for (int b = 0; b < kNumWeightBuffers; ++b) {
    const auto kind = static_cast<WeightBufferKind>(b);
    const ExpertDims d{w.hidden, w.intermediate};
    const int64_t p = layout.expert_bytes(kind, d), c = canonical_expert_bytes(kind, d);
    if (p > c) allowed = std::max(allowed, p * w.num_local_experts);
  }
  return allowed;
}

// The detector: fails when the measured peak exceeds the bound.
::testing::AssertionResult within_bound(int64_t measured, int64_t bound, int64_t layer) {
  if (measured <= bound) {
    return ::testing::AssertionSuccess() << "peak extra " << measured << " <= " << bound;
  }
  return ::testing::AssertionFailure() << "peak extra memory " << measured << " bytes exceeds the bound "
                                       << bound << " (layer " << layer << " bytes): a second copy?";
}

// A deliberately naive preparation: transform each buffer into a freshly allocated full copy.
void naive_prepare(MoeWeights& w, const WeightLayout& layout) {
  const ExpertDims d{w.hidden, w.intermediate};
  std::vector<Buffer> fresh;
  for (int b = 0; b < kNumWeightBuffers; ++b) {
    const auto kind = static_cast<WeightBufferKind>(b);
    Buffer& buf = weight_buffer(w, kind);
    const BufferTransform& t = layout.buffer(kind);
    if (buf.empty() || t.forward == nullptr) {
      fresh.emplace_back();
      continue;
    }
    Buffer out(w.num_local_experts * layout.expert_bytes(kind, d));
    t.forward(buf.as<const uint8_t>(), out.as<uint8_t>(), w.num_local_experts, d);
    fresh.push_back(std::move(out));
  }
  for (int b = 0; b < kNumWeightBuffers; ++b) {
    if (!fresh[b].empty()) weight_buffer(w, static_cast<WeightBufferKind>(b)) = std::move(fresh[b]);
  }
  w.layout = layout.name;
}

PrepareOptions one_expert_scratch() {
  PrepareOptions o;
  o.scratch_bytes = 0;  // exactly one expert
  return o;
}

TEST(PrepMemory, PreparingALayerNeverHoldsASecondCopy) {
  // Kimi-K3-like proportions at small size: H, I multiples of 128 (no scale padding), 32 experts.
  MoeWeights w = random_weights(32, 0, 512, 256, false, 1, 0, 255);
  const MoeWeights original = clone(w);
  const WeightLayout& layout = find_layout("blackwell-interop");
  const int64_t layer = layer_bytes(w);
  const int64_t bound = allowed_extra(w, layout);
  ASSERT_LT(bound * 8, layer) << "the test needs a layer much larger than one expert";

  PrepareReport report;
  const int64_t prep_peak = peak_extra_bytes([&] { report = prepare(w, "blackwell-interop", one_expert_scratch()); });
  EXPECT_TRUE(within_bound(prep_peak, bound, layer));
  EXPECT_EQ(report.peak_extra_bytes, prep_peak) << "the report states the measured peak";
  EXPECT_EQ(report.scratch_bytes, largest_expert_bytes(w, layout));
  EXPECT_EQ(layer_bytes(w), layer) << "no scale padding for these dims";

  const int64_t unprep_peak = peak_extra_bytes([&] { unprepare(w, one_expert_scratch()); });
  EXPECT_TRUE(within_bound(unprep_peak, bound, layer));
  EXPECT_TRUE(weights_equal(w, original));

  // The fused path and default scratch (64 MiB, capped at the layer's experts): bounded by the
  // scratch budget, not by the layer.
  PrepareOptions budget;
  budget.scratch_bytes = 4 * largest_expert_bytes(w, layout);
  const int64_t fused_peak = peak_extra_bytes([&] { prepare_for_fused(w, 100, budget); });
  EXPECT_TRUE(within_bound(fused_peak, budget.scratch_bytes, layer));
}

TEST(PrepMemory, PaddedScaleBuffersCostOneScaleBufferAtMost) {
  // I = 192: K/32 = 6 groups per L2 row, padded to 8 (w2_sf grows by a third).
  MoeWeights w = random_weights(24, 0, 256, 192, true, 2, 0, 255);
  const MoeWeights original = clone(w);
  const WeightLayout& layout = find_layout("blackwell-interop");
  const int64_t layer = layer_bytes(w);
  const int64_t grown = w.num_local_experts * layout.expert_bytes(WeightBufferKind::kW2Sf, {256, 192});
  ASSERT_GT(grown, w.w2_sf.size());
  const int64_t bound = allowed_extra(w, layout);
  EXPECT_EQ(bound, std::max(grown, largest_expert_bytes(w, layout)));
  EXPECT_LT(bound * 4, layer);

  // The prepared layer itself is larger by the padding; that growth is the layout, not a copy.
  PrepareReport report;
  const int64_t prep_peak = peak_extra_bytes([&] { report = prepare(w, "blackwell-interop", one_expert_scratch()); });
  const int64_t growth = layer_bytes(w) - layer;
  EXPECT_EQ(growth, grown - original.w2_sf.size());
  EXPECT_TRUE(within_bound(prep_peak, bound + growth, layer));
  EXPECT_EQ(report.peak_extra_bytes, bound);
  // Unpreparing shrinks w2_sf in place (its capacity stays allocated until release).
  const int64_t unprep_peak = peak_extra_bytes([&] { unprepare(w, one_expert_scratch()); });
  EXPECT_TRUE(within_bound(unprep_peak, largest_expert_bytes(w, layout), layer));
  EXPECT_TRUE(weights_equal(w, original));
}

TEST(PrepMemory, TheDetectorFlagsANaiveCopyingPreparation) {
  MoeWeights w = random_weights(32, 0, 512, 256, false, 3, 0, 255);
  const WeightLayout& layout = find_layout("blackwell-interop");
  const int64_t layer = layer_bytes(w);
  const int64_t bound = allowed_extra(w, layout);
  MoeWeights expected = clone(w);
  prepare(expected, "blackwell-interop");

  const int64_t naive_peak = peak_extra_bytes([&] { naive_prepare(w, layout); });
  EXPECT_TRUE(weights_equal(w, expected)) << "the naive version computes the same layout";
  EXPECT_FALSE(within_bound(naive_peak, bound, layer)) << "the detector must flag a full copy";
  EXPECT_GE(naive_peak, w.w13.size()) << "it held at least a second w13";
}

}  // namespace
}  // namespace megamoe
