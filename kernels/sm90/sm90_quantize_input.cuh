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

namespace megamoe::sm90 {

constexpr int kQuantVec = 8;                                   // channels per thread
constexpr int kQuantThreadsPerGroup = kScaleBlock / kQuantVec; // 4 lanes per scale group
constexpr int kQuantBlockThreads = 256;
static_assert(kScaleBlock % kQuantVec == 0, "a scale group must be whole thread chunks");
static_assert(32 % kQuantThreadsPerGroup == 0, "a group's lanes must sit inside one warp");

// One thread's kQuantVec channels (the 16 bytes `raw` of BF16 x; zeros for lanes past the end):
// the scale byte b of their 32-channel group and their codes, channel i at byte i % 4 of
// packed[i / 4]. The group's kQuantThreadsPerGroup adjacent lanes reduce their amax with
// shuffles, so every lane of the warp must call it together.
__device__ __forceinline__ int quantize_chunk(const uint4& raw, uint32_t (&packed)[2]) {
  constexpr unsigned kFullMask = 0xFFFFFFFFu;
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  float v[kQuantVec];
#pragma unroll
  for (int i = 0; i < kQuantVec / 2; ++i) {
    v[2 * i] = bf16_to_f32(static_cast<uint16_t>(words[i] & 0xFFFFu));
    v[2 * i + 1] = bf16_to_f32(static_cast<uint16_t>(words[i] >> 16));
  }
  // amax ignores NaN (fmaxf), as input_scale_exponent requires.
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kQuantVec; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int offset = 1; offset < kQuantThreadsPerGroup; offset <<= 1)
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
  const int b = input_scale_exponent(amax);
  packed[0] = packed[1] = 0;
#pragma unroll
  for (int i = 0; i < kQuantVec; ++i)
    packed[i / 4] |= static_cast<uint32_t>(e4m3_quantize_scaled(v[i], b)) << (8 * (i % 4));
  return b;
}

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
