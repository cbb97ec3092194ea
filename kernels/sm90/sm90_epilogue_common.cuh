// sm90_epilogue_common.cuh: what the L1 and L2 epilogues of the grouped GEMM share (they run in
// each math warpgroup on its m64 x N accumulator blocks): the accumulator fragment layout, and
// the staging of a block, rounded to BF16, in shared memory.
//
// Accumulator fragment (wgmma m64nN f32): warp w of the warpgroup holds rows 16w..16w+15; lane
// (g = lane/4, t = lane%4) holds acc[4i + h] = (row 16w + g, col 8i + 2t + h) and
// acc[4i + 2 + h] = (row 16w + g + 8, same col), h = 0, 1. Rows are weight rows, cols token rows.
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {

// stmatrix.x4.trans of column groups i, i + 1 (rows 8 (i + j / 2) + c of the stage from the lane
// address `base` of group 0): the address moves by 8 i stage rows.
template <int kPitch>
__device__ __forceinline__ void stmatrix_x4_trans_at(uint32_t base, int i, const uint32_t (&r)[4]) {
  ptx::stmatrix_x4_trans(base + static_cast<uint32_t>(8 * i * kPitch * 2), r[0], r[1], r[2], r[3]);
}

// stage_block_bf16 writes one m64 x N accumulator block, plus bias_row[hh] (hh = 0: rows g,
// 1: rows g + 8 of the warp's 16), rounded to BF16, to stage[col][kStagePitch] (weight row r of
// the block at index r), with BF16x2 packing and stmatrix.trans (8 x 8 blocks: token columns
// 8 i..8 i + 7 x rows 16 w + 8 hh..+7): the bits of bf16_from_f32 for every non-NaN value. A NaN
// becomes the canonical BF16 NaN 0x7FFF; on the GPU every NaN here comes out of arithmetic (wgmma,
// the bias add), which already gives the canonical FP32 NaN, whose bf16_from_f32 is the same
// 0x7FFF (docs/numerics.md). (A software fallback for other NaN bits in a divergent branch made
// ptxas serialize the wgmmas, C7518.)
// The value: kBias == kRowBias (L1): acc + bias_row[hh]; kColRowBias (L2 with a bias): acc +
// col_bias(col) * bias_row[hh] for col < num_rows; kNoBias (L2): acc.
enum class StageBias { kRowBias, kColRowBias, kNoBias };
template <class Cfg, StageBias kBias, class ColBias>
__device__ __forceinline__ void stage_block_bf16(const float (&acc)[Cfg::kBlockN / 2],
                                                 const float (&bias_row)[2], int num_rows,
                                                 ColBias&& col_bias, uint16_t* stage, int tid) {
  constexpr int kPitch = Cfg::kStagePitch;
  const int warp = tid / 32, lane = tid % 32, t = lane % 4;
  // Lane l addresses row c = l % 8 of matrix j = l / 8: column-group offset j / 2, half j % 2.
  const int j = lane / 8, c = lane % 8;
  const uint32_t base = ptx::smem_addr(stage) +
                        static_cast<uint32_t>(((8 * (j / 2) + c) * kPitch + 16 * warp + 8 * (j % 2)) * 2);
  auto value = [&](int i, int hh, int h) {
    float v = acc[4 * i + 2 * hh + h];
    if constexpr (kBias == StageBias::kColRowBias) {
      const int col = 8 * i + 2 * t + h;
      if (col < num_rows) v += col_bias(col) * bias_row[hh];
    } else if constexpr (kBias == StageBias::kRowBias) {
      v += bias_row[hh];
    }
    return v;
  };
  static_assert(Cfg::kBlockN % 16 == 0, "two 8-column groups per stmatrix.x4");
#pragma unroll
  for (int i = 0; i < Cfg::kBlockN / 8; i += 2) {
    uint32_t r[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      r[m] = ptx::cvt_bf16x2_rn(value(i + m / 2, m % 2, 0), value(i + m / 2, m % 2, 1));
    }
    stmatrix_x4_trans_at<kPitch>(base, i, r);
  }
}

}  // namespace megamoe::sm90
