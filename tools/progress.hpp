// tools/progress.hpp: a progress bar on stderr for long CLI work (drawn only on a terminal).
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace megamoe::cli {

class ProgressBar {
 public:
  explicit ProgressBar(std::string label, bool enabled = true)
      : label_(std::move(label)), enabled_(enabled && ::isatty(STDERR_FILENO) != 0),
        start_(std::chrono::steady_clock::now()) {}
  ~ProgressBar() { finish(); }

  // `done` of `total` units (bytes or items); redraws at most every kRedrawMs.
  void update(int64_t done, int64_t total) {
    if (!enabled_ || total <= 0) return;
    const auto now = std::chrono::steady_clock::now();
    if (done < total && now - last_ < std::chrono::milliseconds(kRedrawMs)) return;
    last_ = now;
    const double frac = static_cast<double>(done) / static_cast<double>(total);
    const int filled = static_cast<int>(frac * kWidth);
    const double secs = std::chrono::duration<double>(now - start_).count();
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(stderr, "\r%s [%s] %5.1f%% %6.1fs", label_.c_str(), bar.c_str(), 100.0 * frac, secs);
    std::fflush(stderr);
    drawn_ = true;
  }
  void finish() {
    if (drawn_) std::fprintf(stderr, "\n");
    drawn_ = false;
  }

 private:
  static constexpr int kWidth = 40;
  static constexpr int kRedrawMs = 100;
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_{};
};

}  // namespace megamoe::cli
