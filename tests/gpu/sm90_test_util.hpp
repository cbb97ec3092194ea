// sm90_test_util.hpp: helpers shared by the Hopper GPU tests (tests/gpu/test_sm90_*.cu).
//
// - MEGAMOE_REQUIRE_SM90(): skips the test, printing why, where there is no sm_90 GPU (CI);
//   on an H200 every test runs and fails loudly.
// - DeviceArray<T>: a typed device allocation with upload/download.
// - Routing generators of targets.md (uniform without repeats, Zipf s = 1.2, adversarial), with
//   optional empty (-1) slots; deterministic in the seed.
// - Input generators that exercise the quantizer (groups of very different magnitude, groups
//   under the 1e-4 amax floor, exact zeros).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/gpu_timing.hpp"
#include "megamoe/buffer.hpp"
#include "megamoe/formats.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "runtime/random.hpp"

#define MEGAMOE_REQUIRE_SM90()                                                             \
  do {                                                                                     \
    if (!::megamoe::sm90_available()) {                                                    \
      const std::string why_ = ::megamoe::cuda_available()                                 \
                                   ? "the GPU is not compute capability 9.0"               \
                                   : "no CUDA device (or no CUDA build)";                  \
      std::printf("[  SKIPPED ] %s: needs an sm_90 GPU: %s\n",                             \
                  ::testing::UnitTest::GetInstance()->current_test_info()->name(),        \
                  why_.c_str());                                                           \
      GTEST_SKIP() << "needs an sm_90 GPU: " << why_;                                      \
    }                                                                                      \
  } while (0)

namespace megamoe::test {

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(int64_t count)
      : count_(count), buf_(std::max<int64_t>(count, 1) * sizeof(T), Device::cuda()) {}
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(static_cast<int64_t>(host.size())) {
    upload(host);
  }
  T* get() const { return buf_.as<T>(); }
  int64_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    if (!host.empty())
      MEGAMOE_CUDA_CHECK(cudaMemcpy(get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download(int64_t count = -1) const {
    if (count < 0) count = count_;
    std::vector<T> host(static_cast<size_t>(count));
    if (count > 0)
      MEGAMOE_CUDA_CHECK(cudaMemcpy(host.data(), get(), count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void fill_bytes(int value) {
    MEGAMOE_CUDA_CHECK(cudaMemset(get(), value, std::max<int64_t>(count_, 1) * sizeof(T)));
  }

 private:
  int64_t count_ = 0;
  Buffer buf_;
};

template <typename T>
std::vector<T> download(const T* device_ptr, int64_t count) {
  std::vector<T> host(static_cast<size_t>(count));
  if (count > 0)
    MEGAMOE_CUDA_CHECK(cudaMemcpy(host.data(), device_ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

enum class Routing { kUniform, kSkewed, kAdversarial };

inline const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kAdversarial: return "adversarial";
  }
  return "?";
}

struct RoutingData {
  std::vector<int32_t> idx;    // [T, K]
  std::vector<float> weights;  // [T, K]
};

// Top-k ids without repeats per token. uniform: all experts equally likely; skewed: Zipf with
// s = 1.2 over a seeded permutation of the experts; adversarial: every token picks the experts
// [adversarial_first, adversarial_first + K). `empty_fraction` of slots become -1.
inline RoutingData make_routing(Routing kind, int64_t num_tokens, int64_t num_experts,
                                int64_t top_k, uint64_t seed, double empty_fraction = 0.0,
                                int64_t adversarial_first = 0) {
  constexpr double kZipfS = 1.2;
  detail::SplitMix64 rng(detail::derive_seed(seed, {0x726f757465ull}));
  RoutingData r;
  r.idx.resize(static_cast<size_t>(num_tokens * top_k));
  r.weights.resize(r.idx.size());
  std::vector<int32_t> perm(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) perm[e] = static_cast<int32_t>(e);
  for (int64_t e = num_experts - 1; e > 0; --e) std::swap(perm[e], perm[rng.below(e + 1)]);
  std::vector<double> zipf_cdf(static_cast<size_t>(num_experts));
  double acc = 0;
  for (int64_t e = 0; e < num_experts; ++e) zipf_cdf[e] = (acc += std::pow(double(e + 1), -kZipfS));
  for (auto& c : zipf_cdf) c /= acc;

  std::vector<int32_t> pool(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t) {
    int32_t* ids = r.idx.data() + t * top_k;
    if (kind == Routing::kUniform) {
      for (int64_t e = 0; e < num_experts; ++e) pool[e] = static_cast<int32_t>(e);
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t j = k + static_cast<int64_t>(rng.below(num_experts - k));
        std::swap(pool[k], pool[j]);
        ids[k] = pool[k];
      }
    } else if (kind == Routing::kSkewed) {
      for (int64_t k = 0; k < top_k; ++k) {
        int32_t id;
        do {
          const double u = rng.uniform_double();
          const int64_t rank = std::lower_bound(zipf_cdf.begin(), zipf_cdf.end(), u) - zipf_cdf.begin();
          id = perm[std::min<int64_t>(rank, num_experts - 1)];
        } while (std::find(ids, ids + k, id) != ids + k);
        ids[k] = id;
      }
    } else {
      for (int64_t k = 0; k < top_k; ++k)
        ids[k] = static_cast<int32_t>((adversarial_first + k) % num_experts);
    }
    float sum = 0;
    for (int64_t k = 0; k < top_k; ++k) sum += (r.weights[t * top_k + k] = 0.05f + rng.uniform());
    for (int64_t k = 0; k < top_k; ++k) {
      r.weights[t * top_k + k] /= sum;
      if (empty_fraction > 0 && rng.uniform_double() < empty_fraction) ids[k] = -1;
    }
  }
  return r;
}

// BF16 inputs whose 32-channel groups span many magnitudes: most groups ~N(0, 1) times a per-group
// factor in [2^-12, 2^6], some groups entirely under the 1e-4 floor, some exact zeros.
inline std::vector<uint16_t> make_inputs(int64_t num_tokens, int64_t hidden, uint64_t seed) {
  detail::SplitMix64 rng(detail::derive_seed(seed, {0x78ull}));
  std::vector<uint16_t> x(static_cast<size_t>(num_tokens * hidden));
  for (int64_t g = 0; g < num_tokens * hidden / kScaleBlock; ++g) {
    const uint64_t kind = rng.below(16);
    float factor = std::ldexp(1.0f, static_cast<int>(rng.below(19)) - 12);
    if (kind == 0) factor = 1e-6f;  // under the 1e-4 amax floor
    for (int i = 0; i < kScaleBlock; ++i) {
      const float v = kind == 1 ? 0.0f : static_cast<float>(rng.normal()) * factor;
      x[g * kScaleBlock + i] = bf16_from_f32(v);
    }
  }
  return x;
}

// The stream, graph and timing helpers live with the benchmarks (bench/gpu_timing.hpp).
using bench::device_copy_tbs;
using bench::GraphTiming;
using bench::Stream;
using bench::StreamGraph;
using bench::time_graph_launches;

}  // namespace megamoe::test
