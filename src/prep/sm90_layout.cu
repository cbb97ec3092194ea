// sm90_layout.cu: device side of the "sm90" layout: the same index maps as the host
// (kernels/layout/sm90_weight_layout.hpp), one thread per prepared 32-bit word or scale byte.
#include <cuda_runtime.h>

#include "layout/sm90_weight_layout.hpp"
#include "prep/sm90_layout.hpp"
#include "runtime/cuda_check.hpp"

namespace megamoe::sm90_prep_detail {
namespace {

namespace L = sm90_layout;
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // grid-stride beyond this

__global__ void weights_kernel(bool forward, bool interleave, const uint8_t* __restrict__ src,
                               uint8_t* __restrict__ dst, int64_t total_words,
                               int64_t words_per_expert, int64_t cols, int64_t intermediate) {
  const int64_t bytes_per_expert = words_per_expert * 4;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / words_per_expert, wi = i % words_per_expert;
    const L::WordSource ws = L::word_source(wi, cols, interleave, intermediate);
    const int64_t base = e * bytes_per_expert;
    if (forward) {
      uint8_t bytes[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) bytes[r] = src[base + ws.row[r] * (cols / 2) + ws.byte_col[r]];
      reinterpret_cast<uint32_t*>(dst)[i] = L::pack_word(bytes);
    } else {
      const uint32_t w = reinterpret_cast<const uint32_t*>(src)[i];
#pragma unroll
      for (int r = 0; r < 4; ++r) dst[base + ws.row[r] * (cols / 2) + ws.byte_col[r]] = L::unpack_word_byte(w, r);
    }
  }
}

__global__ void scales_kernel(bool forward, bool interleave, const uint8_t* __restrict__ src,
                              uint8_t* __restrict__ dst, int64_t total, int64_t per_expert,
                              int64_t cols, int64_t intermediate) {
  const int64_t groups = cols / kScaleBlock;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / per_expert, idx = i % per_expert;
    int64_t row, group;
    L::scale_source(idx, cols, interleave, intermediate, &row, &group);
    const int64_t canon = e * per_expert + row * groups + group;
    if (forward) dst[i] = src[canon];
    else dst[canon] = src[i];
  }
}

int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads));
}

}  // namespace

void device_weights(bool forward, bool interleave, const uint8_t* src, uint8_t* dst,
                    int64_t num_experts, int64_t rows, int64_t cols, int64_t intermediate,
                    void* stream) {
  const int64_t words_per_expert = rows * cols / 8;
  const int64_t total = words_per_expert * num_experts;
  if (total == 0) return;
  weights_kernel<<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      forward, interleave, src, dst, total, words_per_expert, cols, intermediate);
  MEGAMOE_CUDA_CHECK_LAUNCH();
}

void device_scales(bool forward, bool interleave, const uint8_t* src, uint8_t* dst,
                   int64_t num_experts, int64_t rows, int64_t cols, int64_t intermediate,
                   void* stream) {
  const int64_t per_expert = rows * cols / kScaleBlock;
  const int64_t total = per_expert * num_experts;
  if (total == 0) return;
  scales_kernel<<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      forward, interleave, src, dst, total, per_expert, cols, intermediate);
  MEGAMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace megamoe::sm90_prep_detail
