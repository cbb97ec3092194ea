// megamoe/parallel.hpp: the host thread pool size and a deterministic parallel-for.
//
// megamoe's CPU code (the reference layer, synthetic weights) splits work into items whose
// outputs are disjoint and whose reductions are never split across threads, so results do not
// depend on the number of threads: only the speed does.
#pragma once

#include <cstdint>
#include <functional>

namespace megamoe {

// Threads the CPU code may use. n = 0 restores the default (std::thread::hardware_concurrency()).
void set_num_threads(int n);
int num_threads();

// Runs fn(i) for every i in [0, n) on up to num_threads() threads, the caller included. Items
// are handed out dynamically, so fn must only write outputs owned by item i. If fn throws, the
// remaining items are skipped and the first exception is rethrown after all threads stopped.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace megamoe
