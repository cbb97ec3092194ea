// sm90_epilogue_l2.cuh: the L2 epilogue of the grouped GEMM, run by each math warpgroup on its
// m64 x N accumulator blocks (fragment layout: sm90_epilogue_common.cuh).
//
// L2: out[row, n] = bf16(acc (+ row_weight * bias[n])).
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"
#include "sm90/sm90_epilogue_common.cuh"
#include "sm90/sm90_gemm_config.hpp"
#include "sm90/sm90_gemm_scheduler.cuh"

namespace megamoe::sm90 {

// Staged L2 epilogue: stage_l2_block writes bf16(acc (+ row_weight * bias)) of the block to shared
// memory ([col][kStagePitch], output channel r of the block at index r; the same expression as
// epilogue_l2), finish_l2_block copies each column's 64 values (128 bytes) to out with 16-byte
// stores: both in the math warpgroup (epilogue_l2_staged) or, with Cfg::kAsyncEpilogue, the
// second in the epilogue warps.
// kWithBias = false: only for launches without a bias (the caller checks).
template <class Cfg, bool kWithBias = true>
__device__ __forceinline__ void stage_l2_block(const GemmParams& p, const TileInfo& tile, int mblk,
                                               const float (&acc)[Cfg::kBlockN / 2],
                                               uint16_t* stage, int tid) {
  const int warp = tid / 32, g = (tid % 32) / 4;
  const int H = p.m_rows;
  if (kWithBias && p.bias != nullptr) {
    float bias[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int n = mblk * sm90_layout::kBlockRows + warp * 16 + g + 8 * hh;
      bias[hh] = bf16_to_f32(p.bias[static_cast<int64_t>(tile.expert) * H + n]);
    }
    const float* rw = p.row_weights + tile.row0;
    stage_block_bf16<Cfg, StageBias::kColRowBias>(
        acc, bias, tile.num_rows, [&](int col) { return __ldg(rw + col); }, stage, tid);
  } else {
    const float none[2] = {0.0f, 0.0f};
    stage_block_bf16<Cfg, StageBias::kNoBias>(acc, none, tile.num_rows,
                                              [](int) { return 0.0f; }, stage, tid);
  }
}

template <class Cfg, int kThreads>
__device__ __forceinline__ void finish_l2_block(const GemmParams& p, const TileInfo& tile, int mblk,
                                                const uint16_t* stage, int tid) {
  constexpr int kPitch = Cfg::kStagePitch;
  constexpr int kThreadsPerCol = sm90_layout::kBlockRows / 8;  // 8 x 16 bytes per column
  constexpr int kColsPerPass = kThreads / kThreadsPerCol;
  const int k8 = tid % kThreadsPerCol;
  const int n0 = mblk * sm90_layout::kBlockRows + 8 * k8;
  for (int col = tid / kThreadsPerCol; col < tile.num_rows; col += kColsPerPass) {
    const uint4 v = *reinterpret_cast<const uint4*>(stage + col * kPitch + 8 * k8);
    const int64_t row = tile.row0 + col;
    uint16_t* dst = p.out_rows != nullptr ? p.out_rows[row] : p.out + row * p.m_rows;
    *reinterpret_cast<uint4*>(dst + n0) = v;
  }
}

// Staged L2 epilogue in the math warpgroup (Cfg::kStagedEpilogue without kAsyncEpilogue), for
// launches without a bias: the same values through shared memory, stored 16 bytes at a time
// (named barrier 1 + wg). (With a bias the kernel runs epilogue_l2: staging row weight x bias
// per column next to the accumulators spilled.)
template <class Cfg>
__device__ __forceinline__ void epilogue_l2_staged(const GemmParams& p, const TileInfo& tile,
                                                   int mblk, const float (&acc)[Cfg::kBlockN / 2],
                                                   uint16_t* smem_stage, int wg, int tid) {
  uint16_t* stage = smem_stage + static_cast<size_t>(wg) * Cfg::kBlockN * Cfg::kStagePitch;
  stage_l2_block<Cfg, false>(p, tile, mblk, acc, stage, tid);
  ptx::named_barrier_sync(1 + wg, Cfg::kWarpgroupThreads);
  finish_l2_block<Cfg, Cfg::kWarpgroupThreads>(p, tile, mblk, stage, tid);
  ptx::named_barrier_sync(1 + wg, Cfg::kWarpgroupThreads);  // the staging area is reused next
}

// The bias of channel n (0 without one), as the L2 epilogues add it (times the row weight).
__device__ __forceinline__ float l2_bias(const GemmParams& p, const TileInfo& tile, int n) {
  return p.bias != nullptr ? bf16_to_f32(p.bias[static_cast<int64_t>(tile.expert) * p.m_rows + n])
                           : 0.0f;
}

// epilogue_l2 of one m64 x N block by token row: each row's destination (out_rows[row], or out +
// row * H) found once, then this thread's two channels of it:
// dst[n] = bf16(acc (+ row_weight * bias[n])).
template <class Cfg>
__device__ __forceinline__ void epilogue_l2_by_row(const GemmParams& p, const TileInfo& tile,
                                                   int mblk, const float (&acc)[Cfg::kBlockN / 2],
                                                   int tid) {
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int n0 = mblk * sm90_layout::kBlockRows + warp * 16 + g;
  const float bias[2] = {l2_bias(p, tile, n0), l2_bias(p, tile, n0 + 8)};
#pragma unroll
  for (int i = 0; i < Cfg::kBlockN / 8; ++i) {
    if (8 * i < tile.num_rows) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 8 * i + 2 * t + h;
        if (col < tile.num_rows) {
          const int64_t row = tile.row0 + col;
          uint16_t* dst = p.out_rows != nullptr ? p.out_rows[row] : p.out + row * p.m_rows;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            float v = acc[4 * i + 2 * half + h];
            if (p.bias != nullptr) v += __ldg(p.row_weights + row) * bias[half];
            dst[n0 + 8 * half] = bf16_from_f32(v);
          }
        }
      }
    }
  }
}

template <class Cfg>
__device__ __forceinline__ void epilogue_l2(const GemmParams& p, const TileInfo& tile, int mblk,
                                            const float (&acc)[Cfg::kBlockN / 2], int tid) {
  const int H = p.m_rows;
  if (Cfg::kBlockN <= 128 || p.out_rows != nullptr) {
    epilogue_l2_by_row<Cfg>(p, tile, mblk, acc, tid);
  } else {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int n = mblk * sm90_layout::kBlockRows + warp * 16 + g + 8 * half;
      const float bias = l2_bias(p, tile, n);
      // NOTES: one 64-bit base per half and 32-bit column offsets col * H, with H through an
      // opaque move: otherwise the compiler hoists every col * H (loop-invariant) out of the
      // tile loop and spills them (seen at 192 token rows; the <= 128-row configs find each
      // row's address once, epilogue_l2_by_row).
      const int H_opaque = ptx::opaque(H);
      uint16_t* out_base = p.out + static_cast<int64_t>(tile.row0) * H + n;
      const float* rw_base = p.row_weights + tile.row0;
#pragma unroll
      for (int i = 0; i < Cfg::kBlockN / 8; ++i) {
        if (8 * i < tile.num_rows) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int col = 8 * i + 2 * t + h;
            if (col < tile.num_rows) {
              float v = acc[4 * i + 2 * half + h];
              if (p.bias != nullptr) v += __ldg(rw_base + col) * bias;
              out_base[col * H_opaque] = bf16_from_f32(v);
            }
          }
        }
      }
    }
  }
}

}  // namespace megamoe::sm90
