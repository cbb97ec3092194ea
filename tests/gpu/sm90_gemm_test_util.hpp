// sm90_gemm_test_util.hpp: helpers shared by the grouped-GEMM tests (tests/gpu/test_sm90_gemm.cu)
// and the GEMM benchmark (bench/gemm_bench.cu): host <-> device copies and a split-K workspace.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "megamoe/buffer.hpp"
#include "moe/sm90_gemm.hpp"
#include "runtime/cuda_check.hpp"

namespace megamoe {

template <class T>
Buffer to_device(const std::vector<T>& v) {
  Buffer b(static_cast<int64_t>(std::max<size_t>(v.size(), 1) * sizeof(T)), Device::cuda());
  if (!v.empty()) copy_bytes(b.data(), Device::cuda(), v.data(), Device::cpu(), v.size() * sizeof(T));
  return b;
}
template <class T>
std::vector<T> to_host(const Buffer& b, size_t n) {
  std::vector<T> v(n);
  if (n) copy_bytes(v.data(), Device::cpu(), b.data(), Device::cuda(), n * sizeof(T));
  return v;
}

// A split-K workspace with its buffers (counters zeroed, as the layer does), and the unit
// counter (2 int32 after the split counters).
struct SplitWorkspace {
  Buffer partials, counters;
  sm90::SplitKWorkspace ws;
  SplitWorkspace(int counters_capacity, int64_t partial_floats)
      : partials(partial_floats * 4, Device::cuda()),
        counters((int64_t(counters_capacity) + 2) * 4, Device::cuda()) {
    MEGAMOE_CUDA_CHECK(cudaMemset(counters.data(), 0, counters.size()));
    ws.partials = partials.as<float>();
    ws.partial_floats = partial_floats;
    ws.counters = counters.as<int32_t>();
    ws.counters_capacity = counters_capacity;
    ws.unit_counter = counters.as<int32_t>() + counters_capacity;
  }
};

}  // namespace megamoe
