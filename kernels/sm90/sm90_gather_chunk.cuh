// sm90_gather_chunk.cuh: one work item of the gather (sm90_gather.cuh, whose header comment has
// the conversion and why it is exact): 16 channels of one act row. Shared by the gather kernel
// and the MegaMoE kernel's gather units (a header of its own: sm90_gather.cuh defines a kernel,
// which only one translation unit may include).
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {

constexpr int kGatherVec = 16;
static_assert(kScaleBlock % kGatherVec == 0, "a thread's channels share one scale");

// act[r, 16 c .. 16 c + 15] of a row r whose token row is t (x_q / x_sf rows; act_row = act + r H).
__device__ __forceinline__ void gather_chunk(const uint8_t* __restrict__ x_q,
                                             const uint8_t* __restrict__ x_sf, uint32_t t,
                                             uint32_t hidden, uint32_t c,
                                             uint16_t* __restrict__ act_row) {
  const uint4 codes =
      __ldg(reinterpret_cast<const uint4*>(x_q + static_cast<size_t>(t) * hidden) + c);
  const int b = __ldg(x_sf + static_cast<size_t>(t) * (hidden / kScaleBlock) +
                      (c * kGatherVec) / kScaleBlock);
  const float scale = ue8m0_to_f32(static_cast<uint8_t>(b));
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t out[kGatherVec / 2];
#pragma unroll
  for (int j = 0; j < kGatherVec / 2; ++j) {
    float lo, hi;
    ptx::e4m3x2_to_f32x2(static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2))), lo, hi);
    out[j] = ptx::cvt_bf16x2_rn(lo * scale, hi * scale);
  }
  uint4* dst = reinterpret_cast<uint4*>(act_row) + 2 * c;
  dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
  dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace megamoe::sm90
