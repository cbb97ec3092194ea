// sm90_quantize_input.cuh: stage 1 of the layer, BF16 -> E4M3 + UE8M0 per 32 channels.
//
//   x    bf16  [T, H]
//   x_q  e4m3  [T, H]       q  = E4M3(x * 2^(127 - b)), RNE, saturating (numerics.md section 2)
//   x_sf ue8m0 [T, H/32]    b  = input_scale_exponent(max |x| over the group)   (1e-4 floor)
//
// The per-group rule and the E4M3 encoder are the MEGAMOE_HD functions of megamoe/quantize.hpp,
// the same code the CPU reference runs, so the codes match bit for bit.
//
// Thread mapping: each thread owns kQuantVec = 8 consecutive channels (one 16-byte load, one
// 8-byte store); kQuantThreadsPerGroup = 4 adjacent lanes own one 32-channel group and reduce
// their amax with two xor-shuffles. H % 32 == 0, so a group never straddles a row and the number
// of chunks is a multiple of 4: lanes past the end drop out in whole groups.
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"
#include "megamoe/quantize.hpp"
#include "ptx/sm90_ptx.cuh"
#include "sm90/sm90_quantize_chunk.cuh"

namespace megamoe::sm90 {

constexpr int kQuantBlockThreads = 256;

// num_chunks = T * H / kQuantVec.
__global__ void __launch_bounds__(kQuantBlockThreads)
sm90_quantize_input_bf16_e4m3_kernel(const uint16_t* __restrict__ x, int64_t num_chunks,
                                     uint8_t* __restrict__ x_q, uint8_t* __restrict__ x_sf) {
  // PDL: x_q / x_sf may still be read by the previous layer call's gather until this returns.
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // NOTES: the loop bound is rounded up to whole warps so every lane reaches the shuffles.
  const int64_t bound = (num_chunks + 31) / 32 * 32;
  for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; chunk < bound;
       chunk += stride) {
    const bool active = chunk < num_chunks;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (active) raw = __ldg(reinterpret_cast<const uint4*>(x) + chunk);
    uint32_t packed[2];
    const int b = quantize_chunk(raw, packed);
    if (!active) continue;
    reinterpret_cast<uint2*>(x_q)[chunk] = make_uint2(packed[0], packed[1]);
    if (chunk % kQuantThreadsPerGroup == 0)
      x_sf[chunk / kQuantThreadsPerGroup] = static_cast<uint8_t>(b);
  }
}

}  // namespace megamoe::sm90
