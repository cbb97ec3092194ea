// parallel_for on std::thread: threads are started per call (a call's items are large: an
// expert's rows, a chunk of weights), so a persistent pool would save only microseconds.
#include "megamoe/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "megamoe/error.hpp"

namespace megamoe {

namespace {
std::atomic<int> g_num_threads{0};  // 0 = hardware concurrency
}  // namespace

void set_num_threads(int n) {
  MEGAMOE_CHECK_ARG(n >= 0, "set_num_threads: n must be >= 0 (0 = all cores), got ", n);
  g_num_threads.store(n);
}

int num_threads() {
  const int n = g_num_threads.load();
  if (n > 0) return n;
  return std::max(1u, std::thread::hardware_concurrency());
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(num_threads(), n);
  if (workers == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> stop{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto work = [&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const int64_t i = next.fetch_add(1);
      if (i >= n) return;
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        stop.store(true);
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace megamoe
