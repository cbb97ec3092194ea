// sm90_quantize_chunks.cuh: the body of the input quantization (sm90_quantize_input.cuh
// describes it), a device function of its own so that the expert-parallel dispatch CTA runs it
// for small calls.
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

// Chunks first, first + stride, ... of num_chunks = T * H / kQuantVec (first and stride whole
// warps apart, so a scale group's lanes stay together); the kernel's body, also run by the
// expert-parallel dispatch CTA for small calls (kernels/ep/ep_kernels.cuh).
__device__ __forceinline__ void quantize_chunks(const uint16_t* __restrict__ x, int64_t num_chunks,
                                                uint8_t* __restrict__ x_q,
                                                uint8_t* __restrict__ x_sf, int64_t first,
                                                int64_t stride) {
  constexpr unsigned kFullMask = 0xFFFFFFFFu;
  // NOTES: the loop bound is rounded up to whole warps so every lane reaches the shuffles.
  const int64_t bound = (num_chunks + 31) / 32 * 32;
  for (int64_t chunk = first; chunk < bound; chunk += stride) {
    const bool active = chunk < num_chunks;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (active) raw = __ldg(reinterpret_cast<const uint4*>(x) + chunk);
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
    if (!active) continue;

    const int b = input_scale_exponent(amax);
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < kQuantVec; ++i)
      packed[i / 4] |= static_cast<uint32_t>(e4m3_quantize_scaled(v[i], b)) << (8 * (i % 4));
    reinterpret_cast<uint2*>(x_q)[chunk] = make_uint2(packed[0], packed[1]);
    if (chunk % kQuantThreadsPerGroup == 0)
      x_sf[chunk / kQuantThreadsPerGroup] = static_cast<uint8_t>(b);
  }
}

}  // namespace megamoe::sm90
