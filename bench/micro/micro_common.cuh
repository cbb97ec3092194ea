// micro_common.cuh: the setup shared by the prefill-loop micro-benchmarks (wgmma_chain.cu,
// wgmma_conversion.cu): shared-memory contents, each thread's word and scale addresses, the
// scale registers as the kernels build them, and the host side (launch on every SM, report the
// tensor pipe's use). docs/perf.md, "How it is measured"; docs/tuning-log.md has the readings.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

#include "layout/sm90_weight_layout.hpp"
#include "ptx/sm90_ptx.cuh"
#include "ptx/sm90_wgmma_bf16_rs.cuh"
#include "sm90/sm90_gemm_config.hpp"
#include "sm90/sm90_gemm_mainloop.cuh"

namespace micro {

constexpr int kUnits = 4096;       // units (64 x 64 weight blocks) per warpgroup
constexpr int kRandomWords = 4096;  // the host's random words, reused cyclically

// Bytes of the B tile (N token rows x 128 bytes: one 64-deep k-block of BF16, 128B swizzle),
// rounded up to the 1024-byte swizzle atom.
constexpr int b_tile_bytes(int n) { return ((n * 128 + 1023) / 1024) * 1024; }
// Weight words (two 2048-byte blocks per warpgroup) and one 64-word scale block.
constexpr int word_bytes(int nwg) { return (nwg * 1024 + 64) * 4; }

// Fills n rows of B (BF16 near 1.0), and the weight and scale words, from the random words.
__device__ inline void fill(uint8_t* b_tile, int n, uint32_t* words, int nwg, const uint32_t* gw) {
  for (int i = threadIdx.x; i < n * 32; i += blockDim.x) {
    reinterpret_cast<uint32_t*>(b_tile)[i] = 0x3C003C00u ^ (gw[i % kRandomWords] & 0x00FF00FFu);
  }
  for (int i = threadIdx.x; i < nwg * 1024 + 64; i += blockDim.x) {
    words[i] = gw[(i * 7) % kRandomWords];
  }
}

// Shared-memory addresses of thread t's 16 bytes of weight block 0 of its warpgroup (block 1 is
// 2048 bytes further) and of its scale word.
struct Addrs {
  uint32_t words;
  uint32_t sf;
};
__device__ inline Addrs thread_addrs(const uint32_t* words, int nwg, int wg, int t) {
  return {megamoe::ptx::smem_addr(words + wg * 1024) + static_cast<uint32_t>(t) * 16,
          megamoe::ptx::smem_addr(words + nwg * 1024) + static_cast<uint32_t>(t % 32) * 4};
}

// One 64 x 64 weight block's 16 A registers, by the kernels' own conversion (load_convert_block
// of the overlapped tiles, prefill_256x96_k2_async2's here; the conversion is the same in every
// overlapped tile).
__device__ __forceinline__ void convert_block(uint32_t words, uint32_t sf, uint32_t (&frags)[4][4]) {
  using Cfg = megamoe::sm90::GemmConfig<megamoe::sm90::TileId::kPrefill256x96K2Async2>;
  megamoe::sm90::Mainloop<Cfg>::load_convert_block(words, sf, frags);
}

// The two BF16x2 scale registers of a block, as the kernels' load_convert_block builds them
// (for the producers that take the conversion apart).
__device__ __forceinline__ void scales(uint32_t sfw, uint32_t (&sc)[2]) {
  sc[0] = megamoe::sm90::scale_folded_pair_bf16x2<0, 1>(sfw);
  sc[1] = megamoe::sm90::scale_folded_pair_bf16x2<2, 3>(sfw);
}

// Random words for fill(); the scale bytes' bit 7 is cleared (the fast path's premise).
inline const uint32_t* device_random_words() {
  std::vector<uint32_t> h(kRandomWords);
  uint32_t x = 12345;
  for (auto& v : h) {
    x = x * 1664525u + 1013904223u;
    v = x & 0x7F7F7F7Fu;
  }
  uint32_t* d = nullptr;
  cudaMalloc(&d, h.size() * 4);
  cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  return d;
}

// Launches kernel(gw, cycles, sink) on one CTA per SM (twice: the first is a warm-up), then prints
// the cycles per unit and warpgroup and the tensor pipe's use: ideal = MACs / macs_per_cycle per SM
// cycle (2048: dense BF16; 4096: dense FP8), over the median warpgroup's cycles. The kernel writes its cycles per warpgroup to
// cycles[block * nwg + wg] after running `units` units per warpgroup.
template <class Kernel>
void report(Kernel kernel, int smem, int nwg, int n, const char* name, int units = kUnits,
            double macs_per_cycle = 2048.0) {
  static const uint32_t* gw = device_random_words();
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* cycles = nullptr;
  float* sink = nullptr;
  cudaMalloc(&cycles, static_cast<size_t>(sms) * nwg * 8);
  cudaMalloc(&sink, 1024 * 4);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int rep = 0; rep < 2; ++rep) kernel<<<sms, 128 * nwg, smem>>>(gw, cycles, sink);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("%s: %s\n", name, cudaGetErrorString(e));
    return;
  }
  std::vector<long long> c(static_cast<size_t>(sms) * nwg);
  cudaMemcpy(c.data(), cycles, c.size() * 8, cudaMemcpyDeviceToHost);
  cudaFree(cycles);
  cudaFree(sink);
  std::sort(c.begin(), c.end());
  const double ideal = nwg * static_cast<double>(units) * 64.0 * n * 64 / macs_per_cycle;
  const double med = static_cast<double>(c[c.size() / 2]);
  std::printf("%-44s N=%3d WG=%d  cycles/unit/WG %7.1f  tensor util %5.1f %%  (min %5.1f max %5.1f)\n",
              name, n, nwg, med / units, 100.0 * ideal / med, 100.0 * ideal / c.back(),
              100.0 * ideal / c.front());
}

}  // namespace micro
