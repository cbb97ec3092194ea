// sm90_dispatch_types.hpp: the host/device ABI of the dispatch stage (sm90_dispatch.cuh): the
// kernel's POD parameter block and the device-side record of invalid expert ids. Host code
// (launchers, the layer, tests) includes this header, never the kernel itself.
#pragma once

#include <cstdint>

namespace megamoe::sm90 {

constexpr int kDispatchMaxWarps = 32;
constexpr int kDispatchWarpSize = 32;
constexpr int kDispatchUnroll = 8;  // 32-slot chunks whose ids a warp loads before using them
constexpr unsigned long long kDispatchNoError = ~0ull;
// T*K bound of the decode front (sm90_decode_front.cuh: each slot's block scans every id).
constexpr int64_t kFrontMaxSlots = 1024;

struct DispatchError {
  // (slot << 32) | uint32(id) of the smallest invalid slot, or kDispatchNoError
  unsigned long long first_bad;
  unsigned long long num_bad;    // invalid slots seen since the last reset
};

struct DispatchParams {
  const int32_t* topk_idx;
  const float* topk_weights;
  int64_t num_slots;        // T * K
  int32_t num_experts;      // E (global)
  int32_t first_local;      // global id of local expert 0
  int32_t num_local;        // E_l
  int32_t* row_offsets;
  int32_t* slot_to_row;     // may be null (expert parallelism: the source keeps its own map)
  int32_t* row_slot;
  float* row_weights;
  DispatchError* error;
  // Rows the workspace holds (0: unchecked, T*K always fits); a sort that would place more
  // leaves every expert empty (expert parallelism: the receive-row capacity).
  int64_t max_rows;
  // Optional (may be null): a word of mapped pinned host memory that the kernel sets to 1 when it
  // records an invalid id, so the host can see that an error is pending without synchronizing.
  int32_t* error_flag;
};

}  // namespace megamoe::sm90
