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

namespace megamoe::sm90 {

constexpr int kCombineVec = 8;
constexpr int kCombineBlockThreads = 256;

constexpr int kCombineBatch = 8;  // slots whose rows are loaded before any is added

// The launcher guarantees T * H / kCombineVec < 2^32 (32-bit item indices).
// NOTES: the rows of kCombineBatch slots are loaded before the first add (independent loads in
// flight); loading and adding one slot at a time left the kernel latency-bound (about half the
// bandwidth at T = 8192, K = 16). The adds stay in ascending k.
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
    const uint32_t c = i - t * chunks_per_row;
    const int32_t* rows = slot_to_row + static_cast<size_t>(t) * top_k;
    float acc[kCombineVec];
#pragma unroll
    for (int j = 0; j < kCombineVec; ++j) acc[j] = 0.0f;
    for (int k0 = 0; k0 < top_k; k0 += kCombineBatch) {
      int32_t r[kCombineBatch];
      uint4 v[kCombineBatch];
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) r[b] = k0 + b < top_k ? __ldg(rows + k0 + b) : -1;
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b)
        v[b] = r[b] >= 0 ? __ldg(reinterpret_cast<const uint4*>(out + static_cast<size_t>(r[b]) * hidden) + c)
                         : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) {
        if (r[b] < 0) continue;  // empty slots are skipped, as in the reference
        const uint32_t words[4] = {v[b].x, v[b].y, v[b].z, v[b].w};
#pragma unroll
        for (int j = 0; j < kCombineVec / 2; ++j) {
          acc[2 * j] += bf16_to_f32(static_cast<uint16_t>(words[j] & 0xFFFFu));
          acc[2 * j + 1] += bf16_to_f32(static_cast<uint16_t>(words[j] >> 16));
        }
      }
    }
    uint32_t packed[kCombineVec / 2];
#pragma unroll
    for (int j = 0; j < kCombineVec / 2; ++j)
      packed[j] = static_cast<uint32_t>(bf16_from_f32(acc[2 * j])) |
                  (static_cast<uint32_t>(bf16_from_f32(acc[2 * j + 1])) << 16);
    reinterpret_cast<uint4*>(y + static_cast<size_t>(t) * hidden)[c] =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

}  // namespace megamoe::sm90
