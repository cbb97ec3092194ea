// sm90_gather_row.cuh: one work item of the gather (sm90_gather.cuh has the formula and why the
// conversion is exact): 16 channels of one BF16 act row from a token row of E4M3 codes and UE8M0
// scales. Shared by the gather launch and the MegaMoE kernel's gather units (a header of its own:
// sm90_gather.cuh defines a kernel, which only one translation unit may include).
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {

constexpr int kGatherVec = 16;
static_assert(kScaleBlock % kGatherVec == 0, "a thread's channels share one scale");

// The BF16x2 of two E4M3 codes (low byte first) times the power of two `scale` (exact).
__device__ __forceinline__ uint32_t dequant_e4m3x2_bf16x2(uint16_t codes, float scale) {
  float lo, hi;
  ptx::e4m3x2_to_f32x2(codes, lo, hi);
  return ptx::cvt_bf16x2_rn(lo * scale, hi * scale);
}

// act_row[16 c .. 16 c + 15] from the token row (x_row: H codes, sf_row: H / 32 scales).
// kCoherent: reads through L2 only (ld.global.cg), for rows written while the reader runs (the
// MegaMoE kernel's gather of received rows, after their arrival word); otherwise through the
// read-only path.
template <bool kCoherent>
__device__ __forceinline__ void gather_chunk(const uint8_t* __restrict__ x_row,
                                             const uint8_t* __restrict__ sf_row, uint32_t c,
                                             uint16_t* __restrict__ act_row) {
  const uint4* src = reinterpret_cast<const uint4*>(x_row) + c;
  const uint8_t* sf = sf_row + (c * kGatherVec) / kScaleBlock;
  const uint4 codes = kCoherent ? __ldcg(src) : __ldg(src);
  const int b = kCoherent ? __ldcg(sf) : __ldg(sf);
  const float scale = ue8m0_to_f32(static_cast<uint8_t>(b));
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t out[kGatherVec / 2];
#pragma unroll
  for (int j = 0; j < kGatherVec / 2; ++j)
    out[j] = dequant_e4m3x2_bf16x2(static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2))), scale);
  uint4* dst = reinterpret_cast<uint4*>(act_row) + 2 * c;
  dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
  dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace megamoe::sm90
