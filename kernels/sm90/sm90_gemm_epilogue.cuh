// sm90_gemm_epilogue.cuh: the epilogues of the grouped GEMMs, run by each math warpgroup on its
// m64 x N accumulator blocks.
//
// Accumulator fragment (wgmma m64nN f32): warp w of the warpgroup holds rows 16w..16w+15; lane
// (g = lane/4, t = lane%4) holds acc[4i + h] = (row 16w + g, col 8i + 2t + h) and
// acc[4i + 2 + h] = (row 16w + g + 8, same col), h = 0, 1. Rows are weight rows, cols token rows.
//
// L1: with the sm90 gate/up interleave, row g is gate channel j and row g + 8 the up channel j of
// the same j = 32 mb + 8w + g, so the activation needs no data exchange; the 32 channels of one
// requantization group are the 64 rows of the block: amax over lanes (shuffles over g) and over
// the 4 warps (shared memory).
// L2: out[row, n] = bf16(acc (+ row_weight * bias[n])).
#pragma once

#include <cstdint>

#include "megamoe/activation.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/quantize.hpp"
#include "ptx/sm90_ptx.cuh"
#include "sm90/sm90_gemm_config.hpp"
#include "sm90/sm90_gemm_scheduler.cuh"

namespace megamoe::sm90 {

constexpr int kChannelsPerGroup = 32;  // requantization group (numerics.md section 5)

// stmatrix.x4.trans of column groups i, i + 1 (rows 8 (i + j / 2) + c of the stage from the lane
// address `base` of group 0): the address moves by 8 i stage rows.
template <int kPitch>
__device__ __forceinline__ void stmatrix_x4_trans_at(uint32_t base, int i, const uint32_t (&r)[4]) {
  ptx::stmatrix_x4_trans(base + static_cast<uint32_t>(8 * i * kPitch * 2), r[0], r[1], r[2], r[3]);
}

// kKind is the activation, fixed at compile time: apply_activation's switch folds away, so the
// unrolled element loop holds one activation's code, not three.
// NOTES: with the switch left at run time the L1 kernel ran at half the speed of L2 per FLOP
// (measured, prefill Kimi-K3): the unrolled loop x 3 activations blows the instruction cache.
template <class Cfg, ActivationKind kKind>
__device__ __forceinline__ void epilogue_l1(const GemmParams& p, const TileInfo& tile, int mblk,
                                            const float (&acc)[Cfg::kBlockN / 2], float* smem_amax,
                                            int wg, int tid) {
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int I = p.intermediate;
  Activation act = p.activation;
  act.kind = kKind;
  const int j = mblk * kChannelsPerGroup + warp * 8 + g;
  float bias_gate = 0.0f, bias_up = 0.0f;
  if (p.bias != nullptr) {
    const int64_t base = static_cast<int64_t>(tile.expert) * 2 * I;
    bias_gate = bf16_to_f32(p.bias[base + j]);
    bias_up = bf16_to_f32(p.bias[base + I + j]);
  }
  float* amax_wg = smem_amax + wg * 4 * Cfg::kBlockN;
  // v of one element (activation of the bias-added, BF16-rounded gate/up times the row weight).
  // NOTES: v is computed twice (for the amax, then for the codes) rather than kept: keeping 32
  // more live registers next to the accumulators spilled, and writing v back into the
  // accumulators makes ptxas fence (serialize) the wgmmas that own them.
  auto value = [&](int i, int h, int col) {
    const float gate = bf16_round(acc[4 * i + h] + bias_gate);
    const float up = bf16_round(acc[4 * i + 2 + h] + bias_up);
    return apply_activation(act, gate, up, p.fast_math) * __ldg(p.row_weights + tile.row0 + col);
  };

  // Activation, routing weight, and the per-warp part of the group amax.
#pragma unroll
  for (int i = 0; i < Cfg::kBlockN / 8; ++i) {
    if (8 * i < tile.num_rows) {  // uniform over the warpgroup
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 8 * i + 2 * t + h;
        const float v = col < tile.num_rows ? value(i, h, col) : 0.0f;
        float a = fabsf(v);
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 4));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 8));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 16));
        if (g == 0) amax_wg[warp * Cfg::kBlockN + col] = a;
      }
    }
  }
  ptx::named_barrier_sync(1 + wg, Cfg::kWarpgroupThreads);

  // Requantize: scale from the amax over the 4 warps, E4M3 code, and its exact BF16 value.
#pragma unroll
  for (int i = 0; i < Cfg::kBlockN / 8; ++i) {
    if (8 * i < tile.num_rows) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 8 * i + 2 * t + h;
        if (col < tile.num_rows) {
          float amax = amax_wg[col];
#pragma unroll
          for (int w = 1; w < 4; ++w) amax = fmaxf(amax, amax_wg[w * Cfg::kBlockN + col]);
          const int b = intermediate_scale_exponent(amax);
          const uint8_t q = e4m3_quantize_scaled(value(i, h, col), b);
          const int64_t row = tile.row0 + col;
          p.h_q[row * I + j] = q;
          p.h_act[row * I + j] = bf16_from_f32(e4m3_to_f32(q) * exp2i(b - kUe8m0Bias));
          if (warp == 0 && g == 0) {
            p.h_sf[row * (I / kChannelsPerGroup) + mblk] = static_cast<uint8_t>(b);
          }
        }
      }
    }
  }
  ptx::named_barrier_sync(1 + wg, Cfg::kWarpgroupThreads);  // amax_wg is reused next
}

// Staged L1 epilogue (Cfg::kStagedEpilogue): same function as epilogue_l1, element for element
// (the same expressions: bias add, BF16 rounding, activation, row weight, group amax, scale,
// E4M3 code, dequantized BF16), organised for a short instruction stream and wide stores:
//   1. stage_l1_block: each thread adds the bias to its accumulators and rounds them to BF16
//      (g and u as epilogue_l1 computes them) and writes them to shared memory
//      ([col][kStagePitch] BF16, prepared row r of the block at index r);
//   2. finish_l1_block: a rolled loop gives each column (token row) to 4 consecutive threads,
//      thread k4 taking the channels c = 8 k4 .. 8 k4 + 7 of the group (gate = prepared row
//      16 k4 + e, up = 16 k4 + 8 + e): two 16-byte reads, the group amax by two quad shuffles,
//      and one 8-byte h_q store and one 16-byte h_act store per thread (h_sf by k4 == 0).
// epilogue_l1_staged runs both in the math warpgroup (named barrier 1 + wg); with
// Cfg::kAsyncEpilogue the math warpgroup runs step 1 and the epilogue warps step 2 (the kernel).

// stage_block_bf16 writes one m64 x N accumulator block, plus bias_row[hh] (hh = 0: rows g, 1: rows g + 8 of the
// warp's 16), rounded to BF16, to stage[col][kStagePitch] (weight row r of the block at index
// r), with BF16x2 packing and stmatrix.trans (8 x 8 blocks: token columns 8 i..8 i + 7 x rows
// 16 w + 8 hh..+7): the bits of bf16_from_f32 for every non-NaN value. A NaN becomes the
// canonical BF16 NaN 0x7FFF; on the GPU every NaN here comes out of arithmetic (wgmma, the bias
// add), which already gives the canonical FP32 NaN, whose bf16_from_f32 is the same 0x7FFF
// (docs/numerics.md). (A software fallback for other NaN bits in a divergent branch made ptxas
// serialize the wgmmas, C7518.)
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

template <class Cfg>
__device__ __forceinline__ void stage_l1_block(const GemmParams& p, const TileInfo& tile, int mblk,
                                               const float (&acc)[Cfg::kBlockN / 2],
                                               uint16_t* stage, int tid) {
  const int warp = tid / 32, g = (tid % 32) / 4;
  const int I = p.intermediate;
  // Rows g / g + 8 of warp w are gate / up of channel j (sm90 interleave). All N columns are
  // written; those past num_rows are never read.
  const int j = mblk * kChannelsPerGroup + warp * 8 + g;
  float bias[2] = {0.0f, 0.0f};
  if (p.bias != nullptr) {
    const int64_t base = static_cast<int64_t>(tile.expert) * 2 * I;
    bias[0] = bf16_to_f32(p.bias[base + j]);
    bias[1] = bf16_to_f32(p.bias[base + I + j]);
  }
  stage_block_bf16<Cfg, StageBias::kRowBias>(acc, bias, tile.num_rows, [](int) { return 0.0f; },
                                             stage, tid);
}

// Step 2 by kThreads threads (tid in [0, kThreads), whole warps).
// NOTES (rejected): p.fast_math as a compile-time constant here (one dispatch per block instead of
// a branch per element's exp and reciprocal): 0.99-1.01x at Kimi-K3 T = 4096 (H200, c7e2cdb).
template <class Cfg, ActivationKind kKind, int kThreads>
__device__ __forceinline__ void finish_l1_block(const GemmParams& p, const TileInfo& tile, int mblk,
                                                const uint16_t* stage, int tid) {
  constexpr int kPitch = Cfg::kStagePitch;
  constexpr int kChunk = 8;                                     // channels per thread
  constexpr int kThreadsPerCol = kChannelsPerGroup / kChunk;    // 4
  constexpr int kColsPerPass = kThreads / kThreadsPerCol;
  static_assert(kThreads % 32 == 0, "whole warps");
  const int lane = tid % 32;
  const int I = p.intermediate;
  Activation act = p.activation;
  act.kind = kKind;
  const int k4 = tid % kThreadsPerCol;
  const int j0 = mblk * kChannelsPerGroup + k4 * kChunk;  // first channel of this thread
  for (int col = tid / kThreadsPerCol; col < tile.num_rows; col += kColsPerPass) {
    const uint16_t* src = stage + col * kPitch + 16 * k4;
    const uint4 gw = *reinterpret_cast<const uint4*>(src);      // gate, channels 8 k4 + 0..7
    const uint4 uw = *reinterpret_cast<const uint4*>(src + 8);  // up, same channels
    const uint32_t gate_words[4] = {gw.x, gw.y, gw.z, gw.w};
    const uint32_t up_words[4] = {uw.x, uw.y, uw.z, uw.w};
    const int64_t row = tile.row0 + col;
    const float rw = __ldg(p.row_weights + row);
    float v[kChunk];
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      const float gate = bf16_to_f32(static_cast<uint16_t>(gate_words[e / 2] >> (16 * (e % 2))));
      const float up = bf16_to_f32(static_cast<uint16_t>(up_words[e / 2] >> (16 * (e % 2))));
      v[e] = apply_activation(act, gate, up, p.fast_math) * rw;
    }
    // fmaxf over the group's 32 |v| (NaN ignored unless all are NaN, as in epilogue_l1).
    float amax = fabsf(v[0]);
#pragma unroll
    for (int e = 1; e < kChunk; ++e) amax = fmaxf(amax, fabsf(v[e]));
    // The 4 threads of a column are consecutive lanes of one quad. Lanes whose column is past
    // num_rows have left the loop: the mask names the lanes of this pass that are in it.
    const int first_col = col - lane / kThreadsPerCol;  // column of lane 0 in this pass
    const int active_lanes = min(32, kThreadsPerCol * (tile.num_rows - first_col));
    const unsigned mask = active_lanes >= 32 ? 0xFFFFFFFFu : (1u << active_lanes) - 1u;
    amax = fmaxf(amax, __shfl_xor_sync(mask, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(mask, amax, 2));
    const int b = intermediate_scale_exponent(amax);
    const float unscale = exp2i(b - kUe8m0Bias);
    // e4m3_quantize_scaled and bf16_from_f32(e4m3_to_f32(q) * unscale) two elements at a time
    // with the conversion instructions (the same codes and bits: round to nearest even, 448
    // saturation, exact decode; NaN here is the canonical NaN of GPU arithmetic, see
    // docs/numerics.md).
    const float scale = exp2i(kUe8m0Bias - b);
    uint32_t q_words[2] = {0u, 0u};
    uint32_t act_words[4];
#pragma unroll
    for (int e = 0; e < kChunk; e += 2) {
      const uint16_t q2 = ptx::cvt_e4m3x2_satfinite(v[e] * scale, v[e + 1] * scale);
      float d0, d1;
      ptx::e4m3x2_to_f32x2(q2, d0, d1);
      act_words[e / 2] = ptx::cvt_bf16x2_rn(d0 * unscale, d1 * unscale);
      q_words[e / 4] |= static_cast<uint32_t>(q2) << (16 * ((e / 2) % 2));
    }
    const int64_t base = row * I + j0;
    *reinterpret_cast<uint2*>(p.h_q + base) = make_uint2(q_words[0], q_words[1]);
    *reinterpret_cast<uint4*>(p.h_act + base) =
        make_uint4(act_words[0], act_words[1], act_words[2], act_words[3]);
    if (k4 == 0) p.h_sf[row * (I / kChannelsPerGroup) + mblk] = static_cast<uint8_t>(b);
  }
}

// Called by all 128 threads of the warpgroup (named barrier 1 + wg).
template <class Cfg, ActivationKind kKind>
__device__ __forceinline__ void epilogue_l1_staged(const GemmParams& p, const TileInfo& tile,
                                                   int mblk, const float (&acc)[Cfg::kBlockN / 2],
                                                   uint16_t* smem_stage, int wg, int tid) {
  uint16_t* stage = smem_stage + static_cast<size_t>(wg) * Cfg::kBlockN * Cfg::kStagePitch;
  stage_l1_block<Cfg>(p, tile, mblk, acc, stage, tid);
  ptx::named_barrier_sync(1 + wg, Cfg::kWarpgroupThreads);
  finish_l1_block<Cfg, kKind, Cfg::kWarpgroupThreads>(p, tile, mblk, stage, tid);
  ptx::named_barrier_sync(1 + wg, Cfg::kWarpgroupThreads);  // the staging area is reused next
}

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
  const int H = p.m_rows;
  for (int col = tid / kThreadsPerCol; col < tile.num_rows; col += kColsPerPass) {
    const uint4 v = *reinterpret_cast<const uint4*>(stage + col * kPitch + 8 * k8);
    *reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(tile.row0 + col) * H +
                              mblk * sm90_layout::kBlockRows + 8 * k8) = v;
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

template <class Cfg>
__device__ __forceinline__ void epilogue_l2(const GemmParams& p, const TileInfo& tile, int mblk,
                                            const float (&acc)[Cfg::kBlockN / 2], int tid) {
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int H = p.m_rows;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int n = mblk * sm90_layout::kBlockRows + warp * 16 + g + 8 * half;
    const float bias = p.bias != nullptr
                           ? bf16_to_f32(p.bias[static_cast<int64_t>(tile.expert) * H + n])
                           : 0.0f;
    if constexpr (Cfg::kBlockN > 128) {
      // NOTES: one 64-bit base per half and 32-bit column offsets col * H, with H through an
      // opaque move: otherwise the compiler hoists every col * H (loop-invariant) out of the
      // tile loop and spills them (seen at 192 token rows; the validated <= 128-row configs
      // keep the per-column addresses below until re-measured).
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
    } else {
#pragma unroll
      for (int i = 0; i < Cfg::kBlockN / 8; ++i) {
        if (8 * i < tile.num_rows) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int col = 8 * i + 2 * t + h;
            if (col < tile.num_rows) {
              const int64_t row = tile.row0 + col;
              float v = acc[4 * i + 2 * half + h];
              if (p.bias != nullptr) v += __ldg(p.row_weights + row) * bias;
              p.out[row * H + n] = bf16_from_f32(v);
            }
          }
        }
      }
    }
  }
}

}  // namespace megamoe::sm90
