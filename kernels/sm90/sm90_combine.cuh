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

namespace megamoe::sm90 {

constexpr int kCombineVec = 8;
constexpr int kCombineBlockThreads = 256;

__global__ void __launch_bounds__(kCombineBlockThreads)
sm90_combine_topk_bf16_kernel(const uint16_t* __restrict__ out,
                              const int32_t* __restrict__ slot_to_row, int64_t num_tokens,
                              int32_t top_k, int64_t hidden, uint16_t* __restrict__ y) {
  const int64_t chunks_per_row = hidden / kCombineVec;
  const int64_t total = num_tokens * chunks_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t t = i / chunks_per_row;
    const int64_t c = i - t * chunks_per_row;
    float acc[kCombineVec];
#pragma unroll
    for (int j = 0; j < kCombineVec; ++j) acc[j] = 0.0f;
    for (int k = 0; k < top_k; ++k) {
      const int32_t r = __ldg(slot_to_row + t * top_k + k);
      if (r < 0) continue;
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(out + static_cast<int64_t>(r) * hidden) + c);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < kCombineVec / 2; ++j) {
        acc[2 * j] += bf16_to_f32(static_cast<uint16_t>(words[j] & 0xFFFFu));
        acc[2 * j + 1] += bf16_to_f32(static_cast<uint16_t>(words[j] >> 16));
      }
    }
    uint32_t packed[kCombineVec / 2];
#pragma unroll
    for (int j = 0; j < kCombineVec / 2; ++j)
      packed[j] = static_cast<uint32_t>(bf16_from_f32(acc[2 * j])) |
                  (static_cast<uint32_t>(bf16_from_f32(acc[2 * j + 1])) << 16);
    reinterpret_cast<uint4*>(y + t * hidden)[c] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

}  // namespace megamoe::sm90
