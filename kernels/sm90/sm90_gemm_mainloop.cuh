// sm90_gemm_mainloop.cuh: the math warpgroup's mainloop of the grouped BF16 x MXFP4 GEMM.
//
// Per pipeline stage (64 of K): each thread loads its 16 bytes of packed E2M1 per 64-row weight
// block and one word of scales from shared memory, converts them to BF16 A fragments in registers
// (exact: E2M1 x 2^(s-127)), and issues 4 wgmma m64nNk16 per weight block with B (token rows)
// read from the TMA-written, 128B-swizzled stage.
// NOTES: each stage ends with wait_group 0. Double-buffering the A fragments (convert stage k+1
// while stage k's wgmmas run, wait_group 1) was tried: ptxas cannot prove the in-flight
// registers untouched and serializes every wgmma (C7513). With two math warpgroups the other
// warpgroup's wgmmas fill the tensor core while one converts.
// NOTES: all kMBlocksPerWG blocks are computed even when the last m-tile is partial (the producer
// leaves stale bytes there and the epilogue skips them): a wgmma under a data-dependent branch
// makes ptxas serialize every wgmma of the kernel (C7520).
#pragma once

#include <cstdint>

#include "layout/sm90_weight_layout.hpp"
#include "ptx/sm90_ptx.cuh"
#include "ptx/sm90_wgmma_bf16_rs.cuh"

namespace megamoe::sm90 {

// BF16x2 of the E2M1 pair of A register i (nibbles i and i + 4 of the word), times 2^-126.
template <int i>
__device__ __forceinline__ uint32_t e2m1x2_bits(uint32_t w) {
  using sm90_layout::kMagMask;
  using sm90_layout::kSignMask;
  static_assert(i >= 0 && i < 4, "four A registers per k16 step");
  constexpr int kSignShift = 12 - 4 * i;  // nibble bit 3 -> BF16 bit 15
  constexpr int kMagShift = 6 - 4 * i;    // nibble bits 0..2 -> BF16 bits 6..8
  const uint32_t sign = (w << kSignShift) & kSignMask;
  uint32_t mag;
  if constexpr (kMagShift >= 0) {
    mag = (w << kMagShift) & kMagMask;
  } else {
    mag = (w >> -kMagShift) & kMagMask;
  }
  return sign | mag;
}

__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t sf_word, int byte) {
  const uint32_t bits = sm90_layout::scale_bf16_bits((sf_word >> (8 * byte)) & 0xFFu);
  return bits | (bits << 16);
}

template <class Cfg>
struct Mainloop {
  static constexpr int kMBlocksPerWG = Cfg::kMBlocksPerWG;
  static constexpr int kSteps = sm90_layout::kStepsPerBlock;
  using Frags = uint32_t[kMBlocksPerWG][kSteps][4];

  // Converts one stage's A operand of this thread into `frags`.
  __device__ __forceinline__ static void load_convert(const uint8_t* smem_a, const uint8_t* smem_sf,
                                                      int wg, int tid, Frags& frags) {
    const int warp = tid / 32, g = (tid % 32) / 4;
#pragma unroll
    for (int sub = 0; sub < kMBlocksPerWG; ++sub) {
      const int lm = wg * kMBlocksPerWG + sub;
      const uint4 wv = ptx::ld_shared_v4(smem_a + lm * sm90_layout::kBlockBytes +
                                         tid * sm90_layout::kThreadBytes);
      const uint32_t sfw = ptx::ld_shared_u32(smem_sf + lm * sm90_layout::kSfBlockBytes +
                                              (warp * 8 + g) * 4);
      // scale[half][j]: row g + 8 half, k group j of the block; byte 2 half + j.
      const uint32_t sc[2][2] = {{scale_bf16x2(sfw, 0), scale_bf16x2(sfw, 1)},
                                 {scale_bf16x2(sfw, 2), scale_bf16x2(sfw, 3)}};
      const uint32_t words[kSteps] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int j = s / 2;  // k16 steps 0,1 in the first scale group, 2,3 in the second
        const uint32_t w = words[s];
        frags[sub][s][0] = ptx::mul_bf16x2(ptx::mul_bf16x2(e2m1x2_bits<0>(w), sm90_layout::kDecodeUnscale), sc[0][j]);
        frags[sub][s][1] = ptx::mul_bf16x2(ptx::mul_bf16x2(e2m1x2_bits<1>(w), sm90_layout::kDecodeUnscale), sc[1][j]);
        frags[sub][s][2] = ptx::mul_bf16x2(ptx::mul_bf16x2(e2m1x2_bits<2>(w), sm90_layout::kDecodeUnscale), sc[0][j]);
        frags[sub][s][3] = ptx::mul_bf16x2(ptx::mul_bf16x2(e2m1x2_bits<3>(w), sm90_layout::kDecodeUnscale), sc[1][j]);
      }
    }
  }

  // Runs the K loop of one tile with wgmma N = kN. acc[sub] receives the m64 x kN accumulators.
  // stage/phase carry the pipeline position across tiles.
  template <int kN>
  __device__ __forceinline__ static void run(float (&acc)[kMBlocksPerWG][Cfg::kBlockN / 2],
                                             uint8_t* smem_b, const uint8_t* smem_a,
                                             const uint8_t* smem_sf, uint64_t* full_bars,
                                             uint64_t* empty_bars, int num_k_blocks, int wg,
                                             int tid, int& stage, uint32_t& phase) {
    static_assert(kN % 8 == 0 && kN <= Cfg::kBlockN, "wgmma N");
    Frags frags;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ptx::mbar_wait(&full_bars[stage], phase);
      load_convert(smem_a + stage * Cfg::kSmemABytes, smem_sf + stage * Cfg::kSmemSfBytes, wg, tid,
                   frags);
      // k16 step s starts 32 bytes further into each 128-byte swizzled row (desc units of 16 B).
      // Descriptors and the scale-d flag are computed before the fence, outside the wgmma window.
      const uint64_t desc0 = ptx::smem_desc_k128b(smem_b + stage * Cfg::kSmemBBytes);
      uint64_t desc[kSteps];
#pragma unroll
      for (int s = 0; s < kSteps; ++s) desc[s] = desc0 + static_cast<uint64_t>(s * sm90_layout::kStepK * 2 / 16);
      const uint32_t scale_d0 = kb != 0 ? 1u : 0u;
      ptx::wgmma_fence();
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
#pragma unroll
        for (int sub = 0; sub < kMBlocksPerWG; ++sub) {
          ptx::WgmmaBf16RS<kN>::mma(acc[sub], frags[sub][s], desc[s], s == 0 ? scale_d0 : 1u);
        }
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();  // this stage's wgmmas are done: release its buffers
      if (tid % 32 == 0) ptx::mbar_arrive(&empty_bars[stage]);
      if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
    }
  }
};

}  // namespace megamoe::sm90
