// sm90_combine.cuh: stage 6 of the layer, the deterministic top-k combine (numerics.md 6).
//
//   y[t, :] = bf16( sum over k ascending with slot_to_row[t*K + k] >= 0 of float(out[row, :]) )
//   y[t, :] = 0 when the token has no valid local slot
//
// The sum starts from 0.0f and adds slots in ascending k, one FP32 add per slot, then rounds
// once: the same order as the CPU reference, so the combine itself adds no difference.
//
// Thread mapping: one thread per kCombineVec = 8 channels of a token (16-byte loads and store).
#pragma once

#include <cstdint>

#include "sm90/sm90_combine_items.cuh"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {

// The launcher guarantees T * H / kCombineVec < 2^32 (32-bit item indices).
__global__ void __launch_bounds__(kCombineBlockThreads)
sm90_combine_topk_bf16_kernel(const uint16_t* __restrict__ out,
                              const int32_t* __restrict__ slot_to_row, uint32_t num_tokens,
                              int32_t top_k, uint32_t hidden, uint16_t* __restrict__ y) {
  ptx::grid_dependency_wait();  // PDL: L2's out is read below
  ptx::launch_dependents();
  combine_items<false>(out, slot_to_row, num_tokens, top_k, hidden, y,
                       blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

}  // namespace megamoe::sm90
