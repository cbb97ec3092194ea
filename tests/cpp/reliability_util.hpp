// reliability_util.hpp: helpers of the bad-input tests (tests/cpp/test_reliability*.cpp).
//
// - expect_error(fn, code, fragment): from test_util.hpp.
// - Guarded<T>: an output buffer with guard regions on both sides. The body is pre-filled with a
//   poison pattern and the guards with another; after a call, guards_intact() proves nothing was
//   written out of bounds, body_untouched() proves a rejected call wrote nothing. Inputs are plain
//   exact-size std::vectors, so a sanitizer build (tests/sanitize.sh) also catches over-reads.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "megamoe/error.hpp"
#include "test_util.hpp"

namespace megamoe::test {

// Bytes of each guard region (a cache line on either side, plus odd tails would show as well).
constexpr int64_t kGuardBytes = 256;
constexpr uint8_t kGuardByte = 0xA5;   // guard pattern
constexpr uint8_t kPoisonByte = 0x5B;  // body pattern before a call (0x5B5B: a finite BF16)

template <typename T>
class Guarded {
 public:
  explicit Guarded(int64_t count)
      : count_(count), bytes_(static_cast<size_t>(2 * kGuardBytes) + count * sizeof(T)) {
    reset();
  }
  // Poisons the body and re-arms the guards.
  void reset() {
    std::memset(bytes_.data(), kGuardByte, kGuardBytes);
    std::memset(bytes_.data() + kGuardBytes, kPoisonByte, count_ * sizeof(T));
    std::memset(bytes_.data() + kGuardBytes + count_ * sizeof(T), kGuardByte, kGuardBytes);
  }
  T* data() { return reinterpret_cast<T*>(bytes_.data() + kGuardBytes); }
  int64_t size() const { return count_; }
  std::vector<T> body() const {
    std::vector<T> v(static_cast<size_t>(count_));
    if (count_ > 0) std::memcpy(v.data(), bytes_.data() + kGuardBytes, count_ * sizeof(T));
    return v;
  }
  // First corrupted guard byte as "before[i]"/"after[i]", or "" when both guards are intact.
  std::string guard_damage() const {
    for (int64_t i = 0; i < kGuardBytes; ++i)
      if (bytes_[i] != kGuardByte) return "guard before the buffer, byte " + std::to_string(i);
    const size_t tail = kGuardBytes + count_ * sizeof(T);
    for (int64_t i = 0; i < kGuardBytes; ++i)
      if (bytes_[tail + i] != kGuardByte) return "guard after the buffer, byte " + std::to_string(i);
    return "";
  }
  bool guards_intact() const { return guard_damage().empty(); }
  bool body_untouched() const {
    for (size_t i = kGuardBytes; i < kGuardBytes + count_ * sizeof(T); ++i)
      if (bytes_[i] != kPoisonByte) return false;
    return true;
  }

 private:
  int64_t count_;
  std::vector<uint8_t> bytes_;
};

}  // namespace megamoe::test
