// sm90_rebase_row.cuh: one row of the FP8 mode's rebase (sm90_rebase_rows.cuh has the formula),
// by one warp: the device function the rebase launch and the MegaMoE kernel's rebase units share.
#pragma once

#include <cstdint>

#include "layout/sm90_weight_layout.hpp"
#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {

// Two FP32 values to two E4M3 bytes (low byte: lo), round to nearest even, saturating.
__device__ __forceinline__ uint32_t cvt_e4m3x2_f32(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

// One row of the rebase by one warp (lane l: groups l, l + 32, ...): factor = 2^(s_max - 127),
// dst = the row's codes rebased to s_max in fp8_row_slot order. kCoherent: reads through L2 only
// (ld.global.cg), for rows written earlier in the same launch (the MegaMoE kernel's rebase of L1's
// rows); otherwise through the read-only path.
template <bool kCoherent>
__device__ __forceinline__ void rebase_row_e4m3(const uint8_t* __restrict__ row_q,
                                                const uint8_t* __restrict__ row_sf, uint32_t groups,
                                                uint8_t* __restrict__ row_dst, float* factor,
                                                int lane) {
  auto load_sf = [&](uint32_t g) -> uint32_t {
    if constexpr (kCoherent) return __ldcg(row_sf + g);
    return __ldg(row_sf + g);
  };
  auto load_q = [&](const uint4* p) -> uint4 {
    if constexpr (kCoherent) return __ldcg(p);
    return __ldg(p);
  };
  uint32_t s_max = 0;
  for (uint32_t g = lane; g < groups; g += 32) s_max = max(s_max, load_sf(g));
  s_max = __reduce_max_sync(0xFFFFFFFFu, s_max);
  if (lane == 0) *factor = ldexpf(1.0f, static_cast<int>(s_max) - 127);
  for (uint32_t g = lane; g < groups; g += 32) {
    const float shift = ldexpf(1.0f, static_cast<int>(load_sf(g)) - static_cast<int>(s_max));
    const uint4* in = reinterpret_cast<const uint4*>(row_q + g * kScaleBlock);
    const uint4 a = load_q(in), b = load_q(in + 1);
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
    uint4* o = reinterpret_cast<uint4*>(row_dst + g * kScaleBlock);
    o[0] = make_uint4(out[0], out[1], out[2], out[3]);
    o[1] = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

}  // namespace megamoe::sm90
