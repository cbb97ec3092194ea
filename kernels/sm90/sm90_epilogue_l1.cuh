// sm90_epilogue_l1.cuh: the L1 epilogue of the grouped GEMM (bias, activation, routing weight,
// requantization to E4M3 with one UE8M0 scale per 32 channels), run by each math warpgroup on its
// m64 x N accumulator blocks (fragment layout: sm90_epilogue_common.cuh).
//
// L1: with the sm90 gate/up interleave, row g is gate channel j and row g + 8 the up channel j of
// the same j = 32 mb + 8w + g, so the activation needs no data exchange; the 32 channels of one
// requantization group are the 64 rows of the block: amax over lanes (shuffles over g) and over
// the 4 warps (shared memory).
#pragma once

#include <cstdint>

#include "megamoe/activation.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/quantize.hpp"
#include "ptx/sm90_ptx.cuh"
#include "sm90/sm90_epilogue_common.cuh"
#include "sm90/sm90_gemm_config.hpp"
#include "sm90/sm90_gemm_scheduler.cuh"

namespace megamoe::sm90 {

constexpr int kChannelsPerGroup = 32;  // requantization group (numerics.md section 5)

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
// a branch per element's exp and reciprocal): 0.99-1.01x at Kimi-K3 T = 4096.
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
    // FP8 tiles (the FP8 mode) write no h_act: their L2 reads E4M3 rows rebased from h_q / h_sf.
    uint32_t q_words[2] = {0u, 0u};
    uint32_t act_words[4];
#pragma unroll
    for (int e = 0; e < kChunk; e += 2) {
      const uint16_t q2 = ptx::cvt_e4m3x2_satfinite(v[e] * scale, v[e + 1] * scale);
      if constexpr (!Cfg::kFp8) {
        float d0, d1;
        ptx::e4m3x2_to_f32x2(q2, d0, d1);
        act_words[e / 2] = ptx::cvt_bf16x2_rn(d0 * unscale, d1 * unscale);
      }
      q_words[e / 4] |= static_cast<uint32_t>(q2) << (16 * ((e / 2) % 2));
    }
    const int64_t base = row * I + j0;
    *reinterpret_cast<uint2*>(p.h_q + base) = make_uint2(q_words[0], q_words[1]);
    if constexpr (!Cfg::kFp8) {
      *reinterpret_cast<uint4*>(p.h_act + base) =
          make_uint4(act_words[0], act_words[1], act_words[2], act_words[3]);
    }
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

}  // namespace megamoe::sm90
