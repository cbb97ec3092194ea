// sm90_rebase_rows.cuh: FP8 mode (docs/numerics.md "FP8 mode"): the E4M3 token rows the FP8 GEMM
// tiles read, from rows of FP8 codes with per-32 UE8M0 scales.
//
//   s_max = max over the row's groups of sf;  factor[r] = 2^(s_max - 127)
//   dst[r, 32 g + fp8_row_slot(j)] = e4m3_rn(code[src, 32 g + j] * 2^(sf[src, g] - s_max))
//   src = row_slot[r] / top_k (L1's operand: the token of each routed row), or r when top_k is 0
//   (L2's operand: L1's intermediate rows themselves)
//
// Exact for every value that stays in E4M3's range after the shift; below it, one rounding to
// nearest (the code's value times a power of two is exact in FP32, then cvt.rn.satfinite). NaN
// codes stay NaN. Rows at or past row_offsets[num_local] (not routed here) are left alone.
//
// Mapping: one warp per row (grid-stride over rows); lane l takes groups l, l + 32, ...: the row's
// largest scale byte by a warp max, then each group's 32 bytes in, rebased, permuted in
// registers and stored as 32 bytes.
#pragma once

#include <cstdint>

#include "layout/sm90_weight_layout.hpp"
#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {

constexpr int kRebaseBlockThreads = 256;

// Two FP32 values to two E4M3 bytes (low byte: lo), round to nearest even, saturating.
__device__ __forceinline__ uint32_t cvt_e4m3x2_f32(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

__global__ void __launch_bounds__(kRebaseBlockThreads)
sm90_rebase_rows_e4m3_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ sf,
                             const int32_t* __restrict__ row_offsets,
                             const int32_t* __restrict__ row_slot, int32_t num_local,
                             uint32_t top_k, uint32_t cols, int64_t max_rows,
                             uint8_t* __restrict__ dst, float* __restrict__ factor) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t num_rows = min(static_cast<int64_t>(__ldg(row_offsets + num_local)), max_rows);
  const uint32_t groups = cols / kScaleBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       r < num_rows; r += warps) {
    const int64_t src = top_k == 0 ? r : __ldg(row_slot + r) / static_cast<int32_t>(top_k);
    const uint8_t* row_sf = sf + src * groups;
    uint32_t s_max = 0;
    for (uint32_t g = lane; g < groups; g += 32) s_max = max(s_max, static_cast<uint32_t>(__ldg(row_sf + g)));
    s_max = __reduce_max_sync(0xFFFFFFFFu, s_max);
    if (lane == 0) factor[r] = ldexpf(1.0f, static_cast<int>(s_max) - 127);
    for (uint32_t g = lane; g < groups; g += 32) {
      const float shift = ldexpf(1.0f, static_cast<int>(__ldg(row_sf + g)) - static_cast<int>(s_max));
      const uint4* in = reinterpret_cast<const uint4*>(q + src * cols + g * kScaleBlock);
      const uint4 a = __ldg(in), b = __ldg(in + 1);
      const uint32_t words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      uint32_t out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < kScaleBlock; j += 2) {  // columns j, j + 1 of the group
        float lo, hi;
        ptx::e4m3x2_to_f32x2(static_cast<uint16_t>(words[j / 4] >> (8 * (j % 4))), lo, hi);
        const uint32_t e8 = cvt_e4m3x2_f32(lo * shift, hi * shift);
        const int s0 = sm90_layout::fp8_row_slot(j), s1 = sm90_layout::fp8_row_slot(j + 1);
        out[s0 / 4] |= (e8 & 0xFFu) << (8 * (s0 % 4));
        out[s1 / 4] |= (e8 >> 8) << (8 * (s1 % 4));
      }
      uint4* o = reinterpret_cast<uint4*>(dst + r * cols + g * kScaleBlock);
      o[0] = make_uint4(out[0], out[1], out[2], out[3]);
      o[1] = make_uint4(out[4], out[5], out[6], out[7]);
    }
  }
}

}  // namespace megamoe::sm90
