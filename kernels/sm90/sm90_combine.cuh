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

#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"
#include "sm90/sm90_combine_chunk.cuh"

namespace megamoe::sm90 {

constexpr int kCombineBlockThreads = 256;

// The launcher guarantees T * H / kCombineVec < 2^32 (32-bit item indices).
__global__ void __launch_bounds__(kCombineBlockThreads)
sm90_combine_topk_bf16_kernel(const uint16_t* __restrict__ out,
                              const int32_t* __restrict__ slot_to_row, uint32_t num_tokens,
                              int32_t top_k, uint32_t hidden, uint16_t* __restrict__ y) {
  ptx::grid_dependency_wait();  // PDL: L2's out is read below
  ptx::launch_dependents();
  const uint32_t chunks_per_row = hidden / kCombineVec;
  const uint32_t total = num_tokens * chunks_per_row;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    const uint32_t t = i / chunks_per_row;
    combine_chunk<false>(out, slot_to_row, t, i - t * chunks_per_row, top_k, hidden, y);
  }
}

}  // namespace megamoe::sm90
