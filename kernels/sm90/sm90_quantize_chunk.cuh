// sm90_quantize_chunk.cuh: the per-thread body of input quantization (BF16 -> E4M3 + UE8M0 per
// 32 channels; sm90_quantize_input.cuh describes the mapping), shared by the quantize kernel, the
// decode front and the EP dispatch's fused send.
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"
#include "megamoe/quantize.hpp"

namespace megamoe::sm90 {

constexpr int kQuantVec = 8;                                   // channels per thread
constexpr int kQuantThreadsPerGroup = kScaleBlock / kQuantVec; // 4 lanes per scale group
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

}  // namespace megamoe::sm90
