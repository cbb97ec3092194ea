// The sm90 layout's device transform (src/prep/sm90_layout.cu) byte for byte against the host
// transform (src/prep/sm90_layout.cpp), and its device inverse:
//   - canonical weights prepared on the GPU equal the same weights prepared on the host;
//   - unprepare on the GPU restores canonical bit for bit, both from GPU-prepared bytes and from
//     host-prepared bytes uploaded (the inverse checked on its own, not only as a round trip);
//   - one Kimi-K3 rank's layer (EP8: 112 experts, H 3584, I 3072, 1.97 GB): GPU preparation
//     throughput and peak extra device memory against targets.md (>= 1 TB/s of weight bytes;
//     peak extra <= 64 MiB or one expert, whichever is larger), printed on one PREP-GPU line.
// Random bytes everywhere (scales 0..255 included): the transforms are pure permutations.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "megamoe/buffer.hpp"
#include "megamoe/prepare.hpp"
#include "megamoe/weights.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/random.hpp"
#include "sm90_test_util.hpp"

namespace megamoe {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kPrepScratchBound = 64 * kMiB;  // targets.md, with "or one expert"
constexpr double kPrepTargetBytesPerSecond = 1e12;  // targets.md: >= 1 TB/s

struct Dims {
  int64_t experts, hidden, intermediate;
  bool bias;
};
// Small blocks, a non-square shape, GPT-OSS (H = I = 2880) and Kimi-K3 dims with few experts.
const Dims kDims[] = {{1, 64, 64, false}, {3, 128, 192, true}, {2, 320, 128, false},
                      {2, 2880, 2880, true}, {2, 3584, 3072, false}};

MoeWeights random_canonical(const Dims& d, uint64_t seed) {
  MoeWeights w = MoeWeights::allocate(d.experts, 0, d.hidden, d.intermediate, d.bias);
  uint64_t stream = 0;
  for (Buffer* b : {&w.w13, &w.w13_sf, &w.w2, &w.w2_sf, &w.w13_bias, &w.w2_bias}) {
    detail::SplitMix64 rng(detail::derive_seed(seed, {++stream}));
    if (!b->empty()) rng.fill(b->as<uint8_t>(), b->size());
  }
  return w;
}

std::vector<uint8_t> host_bytes(const Buffer& b) {
  std::vector<uint8_t> out(static_cast<size_t>(b.size()));
  if (b.size() > 0) copy_bytes(out.data(), Device::cpu(), b.data(), b.device(), b.size());
  return out;
}

// Every buffer of `got` (host or device) equals `want` (host) byte for byte, layouts included.
::testing::AssertionResult same_weights(const MoeWeights& got, const MoeWeights& want) {
  if (got.layout != want.layout)
    return ::testing::AssertionFailure() << "layout '" << got.layout << "' vs '" << want.layout << "'";
  const char* names[] = {"w13", "w13_sf", "w2", "w2_sf", "w13_bias", "w2_bias"};
  const Buffer* a[] = {&got.w13, &got.w13_sf, &got.w2, &got.w2_sf, &got.w13_bias, &got.w2_bias};
  const Buffer* b[] = {&want.w13, &want.w13_sf, &want.w2, &want.w2_sf, &want.w13_bias, &want.w2_bias};
  for (int i = 0; i < 6; ++i) {
    if (a[i]->size() != b[i]->size())
      return ::testing::AssertionFailure() << names[i] << ": " << a[i]->size() << " vs "
                                           << b[i]->size() << " bytes";
    const std::vector<uint8_t> x = host_bytes(*a[i]), y = host_bytes(*b[i]);
    const auto diff = std::mismatch(x.begin(), x.end(), y.begin());
    if (diff.first != x.end()) {
      const int64_t at = diff.first - x.begin();
      return ::testing::AssertionFailure() << names[i] << ": first difference at byte " << at
                                           << " of " << x.size() << ": " << int(*diff.first)
                                           << " vs " << int(*diff.second);
    }
  }
  return ::testing::AssertionSuccess();
}

std::string describe(const Dims& d) {
  return "E_l " + std::to_string(d.experts) + ", H " + std::to_string(d.hidden) + ", I " +
         std::to_string(d.intermediate) + (d.bias ? ", biases" : "");
}

// ---------------------------------------------------------------------------------------------
// Byte for byte against the host transform, and the device inverse
// ---------------------------------------------------------------------------------------------
TEST(Sm90PrepareDevice, ForwardMatchesTheHostTransformByteForByte) {
  MEGAMOE_REQUIRE_SM90();
  for (const Dims& d : kDims) {
    for (int64_t scratch : {int64_t{0}, kDefaultPrepareScratchBytes}) {  // one expert per chunk, default
      SCOPED_TRACE(describe(d) + ", scratch " + std::to_string(scratch));
      MoeWeights host = random_canonical(d, 11);
      MoeWeights device = host.to(Device::cuda());
      PrepareOptions opts;
      opts.scratch_bytes = scratch;
      prepare(host, "sm90", opts);
      const PrepareReport r = prepare(device, "sm90", opts);
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_FALSE(r.no_op);
      EXPECT_EQ(device.device(), Device::cuda());
      EXPECT_TRUE(same_weights(device, host));
    }
  }
}

TEST(Sm90PrepareDevice, DeviceInverseRestoresCanonicalBitForBit) {
  MEGAMOE_REQUIRE_SM90();
  for (const Dims& d : kDims) {
    SCOPED_TRACE(describe(d));
    const MoeWeights canonical = random_canonical(d, 23);
    // Round trip on the device.
    MoeWeights device = canonical.to(Device::cuda());
    prepare(device, "sm90");
    const PrepareReport r = unprepare(device);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_FALSE(r.no_op);
    EXPECT_TRUE(same_weights(device, canonical)) << "device prepare + device unprepare";
    // The device inverse alone, on bytes the host prepared.
    MoeWeights host_prepared = canonical.to(Device::cpu());
    prepare(host_prepared, "sm90");
    MoeWeights uploaded = host_prepared.to(Device::cuda());
    ASSERT_EQ(uploaded.layout, "sm90");
    PrepareOptions one_expert;
    one_expert.scratch_bytes = 0;
    unprepare(uploaded, one_expert);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(same_weights(uploaded, canonical)) << "host prepare + device unprepare";
  }
}

// ---------------------------------------------------------------------------------------------
// Throughput and peak extra memory on one Kimi-K3 rank's layer
// ---------------------------------------------------------------------------------------------
__global__ void fill_pattern(uint8_t* p, int64_t n, uint32_t salt) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ static_cast<uint32_t>(i >> 32) ^ salt;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = static_cast<uint8_t>(h);
  }
}

__global__ void count_pattern_mismatches(const uint8_t* p, int64_t n, uint32_t salt,
                                         unsigned long long* mismatches) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ static_cast<uint32_t>(i >> 32) ^ salt;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    if (p[i] != static_cast<uint8_t>(h)) atomicAdd(mismatches, 1ull);
  }
}

constexpr int kPatternThreads = 256;
constexpr int kPatternBlocks = 4096;

TEST(Sm90PrepareDevice, KimiK3LayerThroughputAndPeakMemory) {
  MEGAMOE_REQUIRE_SM90();
  constexpr int64_t kExperts = 112, kHidden = 3584, kIntermediate = 3072;  // Kimi-K3, EP8 rank
  constexpr int kRepeats = 3;
  MoeWeights w = MoeWeights::allocate(kExperts, 0, kHidden, kIntermediate, false, Device::cuda());
  Buffer* buffers[] = {&w.w13, &w.w13_sf, &w.w2, &w.w2_sf};
  for (int i = 0; i < 4; ++i) {
    fill_pattern<<<kPatternBlocks, kPatternThreads>>>(buffers[i]->as<uint8_t>(), buffers[i]->size(),
                                                      static_cast<uint32_t>(i + 1));
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
  }
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const int64_t layer_bytes = w.total_bytes();
  const int64_t one_expert = layer_bytes / kExperts;
  const int64_t bound = std::max(kPrepScratchBound, one_expert);

  // Warm-up round trip: module loading and first-touch costs stay out of the figures.
  prepare(w, "sm90");
  unprepare(w);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  size_t free_before = 0, free_after = 0, total = 0;
  MEGAMOE_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  const int64_t held_before = memory_stats().device_bytes;
  std::vector<double> prep_s, unprep_s;
  int64_t peak_extra = 0, report_peak = 0, scratch = 0, transformed = 0;
  for (int rep = 0; rep < kRepeats; ++rep) {
    for (bool forward : {true, false}) {
      reset_memory_peak();
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      const auto t0 = std::chrono::steady_clock::now();
      const PrepareReport r = forward ? prepare(w, "sm90") : unprepare(w);
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      (forward ? prep_s : unprep_s).push_back(s);
      peak_extra = std::max(peak_extra, memory_stats().device_peak_bytes - held_before);
      report_peak = std::max(report_peak, r.peak_extra_bytes);
      scratch = std::max(scratch, r.scratch_bytes);
      transformed = r.bytes_transformed;
      ASSERT_EQ(w.layout, forward ? "sm90" : kCanonicalLayout);
    }
  }
  MEGAMOE_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  // The round trips (warm-up included) restored the canonical bytes.
  Buffer mismatches(sizeof(unsigned long long), Device::cuda());
  MEGAMOE_CUDA_CHECK(cudaMemset(mismatches.data(), 0, sizeof(unsigned long long)));
  for (int i = 0; i < 4; ++i)
    count_pattern_mismatches<<<kPatternBlocks, kPatternThreads>>>(
        buffers[i]->as<uint8_t>(), buffers[i]->size(), static_cast<uint32_t>(i + 1),
        mismatches.as<unsigned long long>());
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  unsigned long long bad = 0;
  MEGAMOE_CUDA_CHECK(cudaMemcpy(&bad, mismatches.data(), sizeof bad, cudaMemcpyDeviceToHost));
  EXPECT_EQ(bad, 0ull) << "bytes that differ after " << kRepeats + 1 << " device round trips";

  const double best_prep = *std::min_element(prep_s.begin(), prep_s.end());
  const double best_unprep = *std::min_element(unprep_s.begin(), unprep_s.end());
  const double prep_rate = static_cast<double>(transformed) / best_prep;
  const double unprep_rate = static_cast<double>(transformed) / best_unprep;
  std::printf("PREP-GPU kimi-k3 layer (E_l %lld, H %lld, I %lld): %.3f GB of weights, %.3f GB "
              "transformed per call; prepare best %.3f ms = %.3f TB/s, unprepare best %.3f ms = "
              "%.3f TB/s (target >= 1 TB/s: %s); peak extra device memory %.2f MiB (Buffer "
              "accounting; report %.2f MiB, scratch %.2f MiB), bound %.2f MiB (64 MiB or one "
              "expert = %.2f MiB): %s; driver free memory before/after %.1f / %.1f MiB\n",
              static_cast<long long>(kExperts), static_cast<long long>(kHidden),
              static_cast<long long>(kIntermediate), layer_bytes / 1e9, transformed / 1e9,
              best_prep * 1e3, prep_rate / 1e12, best_unprep * 1e3, unprep_rate / 1e12,
              std::min(prep_rate, unprep_rate) >= kPrepTargetBytesPerSecond ? "met" : "NOT met",
              static_cast<double>(peak_extra) / kMiB, static_cast<double>(report_peak) / kMiB,
              static_cast<double>(scratch) / kMiB, static_cast<double>(bound) / kMiB,
              static_cast<double>(one_expert) / kMiB, peak_extra <= bound ? "within" : "EXCEEDED",
              static_cast<double>(free_before) / kMiB, static_cast<double>(free_after) / kMiB);
  EXPECT_LE(peak_extra, bound);
  EXPECT_LE(report_peak, bound);
  EXPECT_EQ(free_after, free_before) << "device memory not returned after preparation";
}

}  // namespace
}  // namespace megamoe
