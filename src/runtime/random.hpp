// random.hpp: the small, fast, seedable generator megamoe uses for synthetic data.
//
// SplitMix64 (Steele, Lea, Flood 2014): one 64-bit add and a few multiply-xor-shift steps per
// 8 random bytes; good enough statistically for test data and fast enough to fill a Kimi-K3
// rank's 2 GB of synthetic weights in well under a second per core. Streams are derived from
// (seed, stream ids) with the same mixer, so any chunk of a synthetic tensor can be generated
// independently (in parallel) and the result does not depend on the thread count.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace megamoe::detail {

constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ull;

inline uint64_t splitmix_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A seed for the stream named by `ids` under `seed` (order matters).
inline uint64_t derive_seed(uint64_t seed, std::initializer_list<uint64_t> ids) {
  uint64_t s = splitmix_mix(seed + kSplitMixGamma);
  for (uint64_t id : ids) s = splitmix_mix(s ^ (id + kSplitMixGamma));
  return s;
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    state_ += kSplitMixGamma;
    return splitmix_mix(state_);
  }
  // Uniform in [0, 1) with 24 random bits.
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform_double() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  // Uniform integer in [0, n) (n > 0; Lemire's multiply-shift, bias < n / 2^64).
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }
  // Standard normal (Box-Muller).
  double normal() {
    const double u1 = 1.0 - uniform_double();  // (0, 1]
    const double u2 = uniform_double();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  void fill(uint8_t* dst, int64_t bytes) {
    int64_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
      const uint64_t r = next();
      for (int b = 0; b < 8; ++b) dst[i + b] = static_cast<uint8_t>(r >> (8 * b));
    }
    if (i < bytes) {
      const uint64_t r = next();
      for (int b = 0; i < bytes; ++i, ++b) dst[i] = static_cast<uint8_t>(r >> (8 * b));
    }
  }

 private:
  uint64_t state_;
};

}  // namespace megamoe::detail
