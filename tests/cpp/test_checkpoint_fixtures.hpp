// Fixtures shared by the checkpoint and preparation tests: random canonical weights, temporary
// folders, hand-built (possibly malformed) safetensors images, and expectation helpers.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "megamoe/buffer.hpp"
#include "megamoe/error.hpp"
#include "megamoe/weights.hpp"
#include "test_util.hpp"

namespace megamoe::testing_ckpt {

// Random canonical weights: arbitrary E2M1 bytes, UE8M0 scales in [lo, hi], BF16 biases of
// moderate magnitude. Expert e's bytes depend only on (seed, global expert id), so a rank's
// slice of a full draw equals the rank's own draw.
inline MoeWeights random_weights(int64_t num_experts, int64_t first_expert, int64_t hidden,
                                 int64_t intermediate, bool with_bias, uint64_t seed,
                                 int scale_lo = 118, int scale_hi = 127) {
  MoeWeights w;
  w.num_local_experts = num_experts;
  w.first_expert = first_expert;
  w.hidden = hidden;
  w.intermediate = intermediate;
  const int64_t H = hidden, I = intermediate;
  w.w13 = Buffer(num_experts * 2 * I * H / 2);
  w.w13_sf = Buffer(num_experts * 2 * I * H / 32);
  w.w2 = Buffer(num_experts * H * I / 2);
  w.w2_sf = Buffer(num_experts * H * I / 32);
  if (with_bias) {
    w.w13_bias = Buffer(num_experts * 2 * I * 2);
    w.w2_bias = Buffer(num_experts * H * 2);
  }
  for (int64_t j = 0; j < num_experts; ++j) {
    std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(first_expert + j));
    std::uniform_int_distribution<int> byte(0, 255), scale(scale_lo, scale_hi);
    auto fill = [&](Buffer& b, int64_t per_expert, bool is_scale) {
      auto* p = b.as<uint8_t>() + j * per_expert;
      for (int64_t i = 0; i < per_expert; ++i) p[i] = static_cast<uint8_t>(is_scale ? scale(rng) : byte(rng));
    };
    fill(w.w13, 2 * I * H / 2, false);
    fill(w.w13_sf, 2 * I * H / 32, true);
    fill(w.w2, H * I / 2, false);
    fill(w.w2_sf, H * I / 32, true);
    if (with_bias) {
      // BF16 in [-1, 1): sign, exponent 120..126, random mantissa.
      auto bias = [&](Buffer& b, int64_t n) {
        auto* p = b.as<uint16_t>() + j * n;
        for (int64_t i = 0; i < n; ++i) {
          const int e = 120 + byte(rng) % 7;
          p[i] = static_cast<uint16_t>(((byte(rng) & 1) << 15) | (e << 7) | (byte(rng) & 0x7F));
        }
      };
      bias(w.w13_bias, 2 * I);
      bias(w.w2_bias, H);
    }
  }
  return w;
}

inline bool buffers_equal(const Buffer& a, const Buffer& b) {
  return a.size() == b.size() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), static_cast<size_t>(a.size())) == 0);
}

// Bitwise equality of every field and buffer; names the first difference.
inline ::testing::AssertionResult weights_equal(const MoeWeights& a, const MoeWeights& b) {
  if (a.num_local_experts != b.num_local_experts || a.first_expert != b.first_expert ||
      a.hidden != b.hidden || a.intermediate != b.intermediate || a.layout != b.layout) {
    return ::testing::AssertionFailure()
           << "dims/layout differ: (" << a.num_local_experts << ", " << a.first_expert << ", "
           << a.hidden << ", " << a.intermediate << ", " << a.layout << ") vs ("
           << b.num_local_experts << ", " << b.first_expert << ", " << b.hidden << ", "
           << b.intermediate << ", " << b.layout << ")";
  }
  const std::pair<const char*, std::pair<const Buffer*, const Buffer*>> bufs[] = {
      {"w13", {&a.w13, &b.w13}},           {"w13_sf", {&a.w13_sf, &b.w13_sf}},
      {"w2", {&a.w2, &b.w2}},              {"w2_sf", {&a.w2_sf, &b.w2_sf}},
      {"w13_bias", {&a.w13_bias, &b.w13_bias}}, {"w2_bias", {&a.w2_bias, &b.w2_bias}}};
  for (const auto& [name, p] : bufs) {
    if (!buffers_equal(*p.first, *p.second)) {
      return ::testing::AssertionFailure() << "buffer " << name << " differs (sizes "
                                           << p.first->size() << " vs " << p.second->size() << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

inline MoeWeights clone(const MoeWeights& w) {
  return w.to(Device::cpu());
}

// A fresh folder under the test temp dir, removed at scope exit.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::path(::testing::TempDir()) /
            ("megamoe_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors image built by hand: 8-byte LE length (of `header`, unless overridden), the
// header text as given, then `data`.
inline std::vector<uint8_t> raw_safetensors(const std::string& header,
                                            const std::vector<uint8_t>& data = {},
                                            int64_t length_override = -1,
                                            bool use_override = false) {
  std::vector<uint8_t> out(8);
  const uint64_t len = use_override ? static_cast<uint64_t>(length_override) : header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(len >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

using megamoe::test::throws_error;  // test_util.hpp

}  // namespace megamoe::testing_ckpt
