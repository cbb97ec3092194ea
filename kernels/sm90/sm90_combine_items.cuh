// sm90_combine_items.cuh: the body of the top-k combine (sm90_combine.cuh describes it), a
// device function of its own so that the expert-parallel return kernel runs it for small calls.
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {

constexpr int kCombineVec = 8;
constexpr int kCombineBlockThreads = 256;

constexpr int kCombineBatch = 8;  // slots whose rows are loaded before any is added

// Rows of `out` as the combine reads them: through the read-only cache when they were written
// before the kernel started; coherently (ld.relaxed.sys) when other GPUs' ranks wrote them while
// it ran (the expert-parallel return kernel's fused combine, kernels/ep/ep_kernels.cuh).
template <bool kWrittenDuringKernel>
__device__ __forceinline__ uint4 combine_load(const uint4* p) {
  if constexpr (kWrittenDuringKernel) {
    uint4 v;
    asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
  } else {
    return __ldg(p);
  }
}

// Items first, first + stride, ... of T * H / kCombineVec (one per 8 channels of a token).
// NOTES: the rows of kCombineBatch slots are loaded before the first add (independent loads in
// flight); loading and adding one slot at a time left the kernel latency-bound (about half the
// bandwidth at T = 8192, K = 16). The adds stay in ascending k.
template <bool kWrittenDuringKernel>
__device__ __forceinline__ void combine_items(const uint16_t* __restrict__ out,
                                              const int32_t* __restrict__ slot_to_row,
                                              uint32_t num_tokens, int32_t top_k, uint32_t hidden,
                                              uint16_t* __restrict__ y, uint32_t first,
                                              uint32_t stride) {
  const uint32_t chunks_per_row = hidden / kCombineVec;
  const uint32_t total = num_tokens * chunks_per_row;
  for (uint32_t i = first; i < total; i += stride) {
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
        v[b] = r[b] >= 0 ? combine_load<kWrittenDuringKernel>(
                               reinterpret_cast<const uint4*>(out + static_cast<size_t>(r[b]) * hidden) + c)
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
