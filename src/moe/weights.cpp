// MoeWeights: allocation, canonical-form checks and synthetic MXFP4 weights.
#include "megamoe/weights.hpp"

#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/parallel.hpp"
#include "runtime/random.hpp"

namespace megamoe {

namespace {

constexpr int64_t kBf16Bytes = 2;

void check_dims(const char* fn, int64_t num_local_experts, int64_t first_expert, int64_t hidden,
                int64_t intermediate) {
  MEGAMOE_CHECK_ARG(num_local_experts > 0, fn, ": num_local_experts must be > 0, got ",
                    num_local_experts);
  MEGAMOE_CHECK_ARG(first_expert >= 0, fn, ": first_expert must be >= 0, got ", first_expert);
  MEGAMOE_CHECK_ARG(hidden > 0 && hidden % kScaleBlock == 0, fn,
                    ": hidden must be a positive multiple of ", kScaleBlock, ", got ", hidden);
  MEGAMOE_CHECK_ARG(intermediate > 0 && intermediate % kScaleBlock == 0, fn,
                    ": intermediate must be a positive multiple of ", kScaleBlock, ", got ",
                    intermediate);
}

void check_size(const char* name, const Buffer& buf, int64_t expected) {
  MEGAMOE_CHECK(buf.size() == expected, ErrorCode::kFormat, "weights: ", name, " expected ",
                expected, " bytes (canonical form), got ", buf.size());
}

// ---------------------------------------------------------------------------------------------
// Synthetic weights
// ---------------------------------------------------------------------------------------------
// NOTES: every byte is generated from a stream named (seed, tensor, global expert, chunk), so
// expert e gets the same weights whatever the EP split and whatever the thread count.
constexpr int64_t kSyntheticChunkBytes = int64_t{1} << 20;
constexpr float kSyntheticBiasRange = 0.5f;  // biases uniform in [-0.5, 0.5)

enum SyntheticTensor : uint64_t { kW13 = 1, kW13Sf, kW2, kW2Sf, kW13Bias, kW2Bias };

// Biased UE8M0 centre for a reduction of `k` elements: 2^-round(log2(sqrt(k))), so a dot product
// of k unit-order activations with uniform E2M1 codes (rms 2.9) stays of unit order.
uint8_t synthetic_scale_centre(int64_t k) {
  const int shift = static_cast<int>(std::lround(0.5 * std::log2(static_cast<double>(k))));
  return static_cast<uint8_t>(kUe8m0Bias - shift);
}

struct SyntheticJob {
  SyntheticTensor tensor;
  uint8_t* data;            // the whole buffer
  int64_t bytes_per_expert;
  uint8_t scale_centre;     // scale tensors only
};

void fill_synthetic(const SyntheticJob& job, uint64_t seed, int64_t local_expert,
                    int64_t global_expert, int64_t chunk) {
  const int64_t begin = chunk * kSyntheticChunkBytes;
  const int64_t bytes = std::min(kSyntheticChunkBytes, job.bytes_per_expert - begin);
  uint8_t* dst = job.data + local_expert * job.bytes_per_expert + begin;
  detail::SplitMix64 rng(detail::derive_seed(
      seed, {static_cast<uint64_t>(job.tensor), static_cast<uint64_t>(global_expert),
             static_cast<uint64_t>(chunk)}));
  switch (job.tensor) {
    case kW13:
    case kW2:
      rng.fill(dst, bytes);  // uniform over all 16 x 16 pairs of E2M1 codes
      return;
    case kW13Sf:
    case kW2Sf: {
      // Per-group spread of the exponent: -1, 0, 0, +1 with probabilities 1/4, 1/2, 1/4.
      constexpr int kSpread[4] = {-1, 0, 0, 1};
      rng.fill(dst, bytes);
      for (int64_t i = 0; i < bytes; ++i)
        dst[i] = static_cast<uint8_t>(job.scale_centre + kSpread[dst[i] & 3]);
      return;
    }
    case kW13Bias:
    case kW2Bias: {
      auto* bias = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < bytes / kBf16Bytes; ++i)
        bias[i] = bf16_from_f32((2.0f * rng.uniform() - 1.0f) * kSyntheticBiasRange);
      return;
    }
  }
}

}  // namespace

int64_t MoeWeights::total_bytes() const {
  return w13.size() + w13_sf.size() + w2.size() + w2_sf.size() + w13_bias.size() + w2_bias.size();
}

MoeWeights MoeWeights::allocate(int64_t num_local_experts, int64_t first_expert, int64_t hidden,
                                int64_t intermediate, bool with_bias, Device device) {
  check_dims("MoeWeights::allocate", num_local_experts, first_expert, hidden, intermediate);
  MoeWeights w;
  w.num_local_experts = num_local_experts;
  w.first_expert = first_expert;
  w.hidden = hidden;
  w.intermediate = intermediate;
  w.layout = kCanonicalLayout;
  w.w13 = Buffer(w.w13_bytes(), device);
  w.w13_sf = Buffer(w.w13_sf_bytes(), device);
  w.w2 = Buffer(w.w2_bytes(), device);
  w.w2_sf = Buffer(w.w2_sf_bytes(), device);
  if (with_bias) {
    w.w13_bias = Buffer(num_local_experts * 2 * intermediate * kBf16Bytes, device);
    w.w2_bias = Buffer(num_local_experts * hidden * kBf16Bytes, device);
  }
  return w;
}

void MoeWeights::validate_canonical() const {
  MEGAMOE_CHECK_ARG(layout == kCanonicalLayout, "weights: expected the '", kCanonicalLayout,
                    "' layout, got '", layout, "'");
  check_dims("weights", num_local_experts, first_expert, hidden, intermediate);
  check_size("w13", w13, w13_bytes());
  check_size("w13_sf", w13_sf, w13_sf_bytes());
  check_size("w2", w2, w2_bytes());
  check_size("w2_sf", w2_sf, w2_sf_bytes());
  MEGAMOE_CHECK(w13_bias.empty() == w2_bias.empty(), ErrorCode::kFormat,
                "weights: w13_bias and w2_bias must be both present or both absent, got w13_bias ",
                w13_bias.size(), " bytes and w2_bias ", w2_bias.size(), " bytes");
  if (has_bias()) {
    check_size("w13_bias", w13_bias, num_local_experts * 2 * intermediate * kBf16Bytes);
    check_size("w2_bias", w2_bias, num_local_experts * hidden * kBf16Bytes);
  }
  const Buffer* all[] = {&w13_sf, &w2, &w2_sf, &w13_bias, &w2_bias};
  for (const Buffer* b : all)
    MEGAMOE_CHECK_ARG(b->empty() || b->device() == w13.device(),
                      "weights: all buffers must live on one device, w13 is on ",
                      device_name(w13.device()), " but another is on ", device_name(b->device()));
}

void MoeWeights::check_matches(const LayerConfig& config) const {
  MEGAMOE_CHECK_ARG(hidden == config.shape.hidden, "weights: hidden ", hidden,
                    " does not match the config's H=", config.shape.hidden);
  MEGAMOE_CHECK_ARG(intermediate == config.shape.intermediate, "weights: intermediate ",
                    intermediate, " does not match the config's I=", config.shape.intermediate);
  MEGAMOE_CHECK_ARG(num_local_experts == config.num_local_experts(), "weights: num_local_experts ",
                    num_local_experts, " does not match the config's E/ep_size=",
                    config.num_local_experts());
  MEGAMOE_CHECK_ARG(first_expert == config.first_local_expert(), "weights: first_expert ",
                    first_expert, " does not match the config's ep_rank*E_l=",
                    config.first_local_expert());
}

MoeWeights MoeWeights::to(Device device) const {
  MoeWeights c;
  c.num_local_experts = num_local_experts;
  c.first_expert = first_expert;
  c.hidden = hidden;
  c.intermediate = intermediate;
  c.layout = layout;
  c.w13 = w13.to(device);
  c.w13_sf = w13_sf.to(device);
  c.w2 = w2.to(device);
  c.w2_sf = w2_sf.to(device);
  c.w13_bias = w13_bias.to(device);
  c.w2_bias = w2_bias.to(device);
  return c;
}

ScaleByteHit find_scale_byte(const Buffer& scales, int64_t num_local_experts, int min_byte) {
  MEGAMOE_CHECK_ARG(scales.empty() || scales.device().type == DeviceType::kCPU,
                    "find_scale_byte: scales must be in host memory, got ",
                    device_name(scales.device()));
  MEGAMOE_CHECK_ARG(num_local_experts > 0 && scales.size() % num_local_experts == 0,
                    "find_scale_byte: ", scales.size(), " bytes do not split into ",
                    num_local_experts, " experts");
  const auto* p = scales.as<const uint8_t>();
  const int64_t per_expert = scales.size() / num_local_experts;
  for (int64_t i = 0; i < scales.size(); ++i) {
    if (p[i] >= min_byte) return {i / per_expert, i % per_expert, p[i]};
  }
  return {};
}

std::string sm90_gemm_path(const Buffer& scales, int64_t num_local_experts, int64_t first_expert) {
  const ScaleByteHit hit = find_scale_byte(scales, num_local_experts, kSm90SerialScaleByte);
  if (!hit.found()) return "fast path";
  return detail::concat("serial path: scale byte ", hit.byte, " >= ", kSm90SerialScaleByte,
                        " in expert ", first_expert + hit.expert);
}

MoeWeights synthetic_weights(const LayerConfig& config, uint64_t seed, bool with_bias) {
  config.validate();
  const int64_t el = config.num_local_experts();
  const int64_t h = config.shape.hidden;
  const int64_t inter = config.shape.intermediate;
  MoeWeights w = MoeWeights::allocate(el, config.first_local_expert(), h, inter, with_bias);

  std::vector<SyntheticJob> jobs = {
      {kW13, w.w13.as<uint8_t>(), w.w13_bytes() / el, 0},
      {kW13Sf, w.w13_sf.as<uint8_t>(), w.w13_sf_bytes() / el, synthetic_scale_centre(h)},
      {kW2, w.w2.as<uint8_t>(), w.w2_bytes() / el, 0},
      {kW2Sf, w.w2_sf.as<uint8_t>(), w.w2_sf_bytes() / el, synthetic_scale_centre(inter)},
  };
  if (with_bias) {
    jobs.push_back({kW13Bias, w.w13_bias.as<uint8_t>(), w.w13_bias.size() / el, 0});
    jobs.push_back({kW2Bias, w.w2_bias.as<uint8_t>(), w.w2_bias.size() / el, 0});
  }
  // One work item per (job, local expert, chunk).
  struct Item {
    int job;
    int64_t expert, chunk;
  };
  std::vector<Item> items;
  for (int j = 0; j < static_cast<int>(jobs.size()); ++j) {
    const int64_t chunks = (jobs[j].bytes_per_expert + kSyntheticChunkBytes - 1) / kSyntheticChunkBytes;
    for (int64_t e = 0; e < el; ++e)
      for (int64_t c = 0; c < chunks; ++c) items.push_back({j, e, c});
  }
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& it = items[static_cast<size_t>(i)];
    fill_synthetic(jobs[static_cast<size_t>(it.job)], seed, it.expert, w.first_expert + it.expert,
                   it.chunk);
  });
  return w;
}

}  // namespace megamoe
