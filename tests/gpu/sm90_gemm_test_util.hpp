// sm90_gemm_test_util.hpp: helpers shared by the grouped-GEMM tests (tests/gpu/test_sm90_gemm.cu,
// test_sm90_mega.cu) and the GEMM benchmark (bench/gemm_bench.cu): host <-> device copies, a
// split-K workspace and the MegaMoE kernel's workspace.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "megamoe/buffer.hpp"
#include "moe/sm90_gemm.hpp"
#include "moe/sm90_mega.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"

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

// The MegaMoE kernel's workspace (sm90::MegaWorkspace) with its buffers, zeroed, for max_rows
// rows over num_experts local experts, with the split-K area for the current device.
struct MegaBuffers {
  Buffer counters, partials;
  sm90::MegaWorkspace ws;
  MegaBuffers(int64_t max_rows, int num_experts) {
    const int64_t slots = sm90::mega_counters(max_rows, num_experts);
    const int sms = cuda::device_info().sm_count;
    const int64_t split_counters = sm90::mega_split_counters(sms);
    counters = Buffer((2 * slots + split_counters) * 4, Device::cuda());
    partials = Buffer(sm90::mega_split_partial_floats(sms) * 4, Device::cuda());
    MEGAMOE_CUDA_CHECK(cudaMemset(counters.data(), 0, counters.size()));
    ws.ready = counters.as<int32_t>();
    ws.consumed = ws.ready + slots;
    ws.capacity = slots;
    ws.split_counters = ws.consumed + slots;
    ws.split_counters_capacity = split_counters;
    ws.split_partials = partials.as<float>();
    ws.split_partial_floats = sm90::mega_split_partial_floats(sms);
  }
  // Whether every counter is zero (as every launch must leave them).
  bool all_zero() const {
    const auto c = to_host<int32_t>(counters, counters.size() / 4);
    return std::all_of(c.begin(), c.end(), [](int32_t v) { return v == 0; });
  }
};

}  // namespace megamoe
