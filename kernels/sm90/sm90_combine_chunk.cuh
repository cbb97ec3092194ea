// sm90_combine_chunk.cuh: the deterministic top-k combine of one token's 8 channels (numerics.md 6;
// the formula in sm90_combine.cuh), shared by the combine launch and the MegaMoE kernel's combine.
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"

namespace megamoe::sm90 {

constexpr int kCombineVec = 8;

constexpr int kCombineBatch = 8;  // slots whose rows are loaded before any is added

// y[t, 8c .. 8c + 8), one token t and channel chunk c of it (sm90_combine.cuh's formula). kCoherent (the
// MegaMoE kernel's combine, whose rows were written during its own launch, some by other GPUs):
// every load goes through L2 (ld.global.cg), not the read-only path.
// NOTES: the rows of kCombineBatch slots are loaded before the first add (independent loads in
// flight); loading and adding one slot at a time left the kernel latency-bound (about half the
// bandwidth at T = 8192, K = 16). The adds stay in ascending k.
template <bool kCoherent>
__device__ __forceinline__ void combine_chunk(const uint16_t* __restrict__ out,
                                              const int32_t* __restrict__ slot_to_row, uint32_t t,
                                              uint32_t c, int32_t top_k, uint32_t hidden,
                                              uint16_t* __restrict__ y) {
  const int32_t* rows = slot_to_row + static_cast<size_t>(t) * top_k;
  float acc[kCombineVec];
#pragma unroll
  for (int j = 0; j < kCombineVec; ++j) acc[j] = 0.0f;
  for (int k0 = 0; k0 < top_k; k0 += kCombineBatch) {
    int32_t r[kCombineBatch];
    uint4 v[kCombineBatch];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      r[b] = k0 + b >= top_k ? -1 : kCoherent ? __ldcg(rows + k0 + b) : __ldg(rows + k0 + b);
    }
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const uint4* src = reinterpret_cast<const uint4*>(out + static_cast<size_t>(r[b]) * hidden) + c;
      v[b] = r[b] < 0 ? make_uint4(0, 0, 0, 0) : kCoherent ? __ldcg(src) : __ldg(src);
    }
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

}  // namespace megamoe::sm90
