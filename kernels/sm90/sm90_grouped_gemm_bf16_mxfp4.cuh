// sm90_grouped_gemm_bf16_mxfp4.cuh: the Hopper grouped expert GEMM, BF16 activations x MXFP4
// weights, FP32 accumulation on wgmma (exact mode of numerics.md section 8); with an FP8 tile
// (TileConfig::fp8), E4M3 token rows x MXFP4 weights rebased to E4M3 per row (the FP8 mode,
// docs/numerics.md), on the FP8 tensor cores.
//
//   D[n, r] = sum_k W_e[n, k] * X[r, k]   for the rows r of local expert e (row_offsets)
//
// Swap A/B: the weights are wgmma's A (M side, converted to BF16 in registers), the routed token
// rows are B (N side, shared memory via TMA). One persistent CTA per SM slot walks the tiles
// (expert, m-tile, n-tile) of the device-built schedule. Warp roles (one kernel, branches):
//   producer warpgroup(s) (last; Cfg::kEpilogueWG of them): thread 0 issues, per stage of S
//                             k-blocks (Cfg::kKBlocksPerStage),
//                             one 1D bulk copy per 64-row weight block (S x 2 KiB), one per scale
//                             block (S x 128 B) and S 2D TMA boxes of B rows;
//   math warpgroups:          convert + wgmma (sm90_gemm_mainloop.cuh), then the epilogue of
//                             the GEMM kind (sm90_epilogue_l1.cuh, sm90_epilogue_l2.cuh); with
//                             Cfg::kAsyncEpilogue only its first half (results staged in shared
//                             memory), the producer warpgroup's other warps (3, or 7 with a
//                             second warpgroup) doing the rest while the math warpgroups run
//                             the next tile.
// Stages are guarded by full (TMA transaction bytes) and empty (one arrive per math thread)
// mbarriers.
#pragma once

#include <cstdint>
#include <type_traits>

#include "ptx/sm90_ptx.cuh"
#include "sm90/sm90_diag.hpp"
#include "sm90/sm90_diag_timeline.cuh"
#include "sm90/sm90_epilogue_l1.cuh"
#include "sm90/sm90_epilogue_l2.cuh"
#include "sm90/sm90_gemm_config.hpp"
#include "sm90/sm90_gemm_mainloop.cuh"
#include "sm90/sm90_gemm_scheduler.cuh"

namespace megamoe::sm90 {

// Calls f(std::integral_constant<int, N>) with N = the smallest multiple of kStep >= n.
template <int kStep, int kMax, int kN = kStep, class F>
__device__ __forceinline__ void dispatch_n(int n, F&& f) {
  if constexpr (kN >= kMax) {
    f(std::integral_constant<int, kMax>{});
  } else {
    if (n <= kN) f(std::integral_constant<int, kN>{});
    else dispatch_n<kStep, kMax, kN + kStep>(n, f);
  }
}

// K parts per tile of this launch: p.k_splits when the config supports split-K and the tiles
// fit the workspace, else 1 (the same answer in every CTA).
template <class Cfg>
__device__ __forceinline__ int split_k_units(const GemmParams& p, int num_tiles) {
  if constexpr (!Cfg::kSupportsSplitK) {
    return 1;
  } else {
    if (p.k_splits <= 1 || num_tiles > p.split_counters_capacity ||
        static_cast<int64_t>(num_tiles) * p.k_splits * Cfg::kSplitUnitFloats >
            p.split_partial_floats) {
      return 1;
    }
    return p.k_splits;
  }
}

// Split-K hand-off after unit (tile t, part sp) has accumulated its K part: stores the part,
// and returns true in the tile's last unit to arrive, with acc = the parts summed in split order
// (part 0 + part 1 + ..., whichever unit arrives last: deterministic). Called by the whole math
// warpgroup (named barrier 1 + wg).
// The tile's parts are at tile_parts (splits x Cfg::kSplitUnitFloats), its arrival counter at
// *counter (zero before the tile's first part arrives; left zero).
template <class Cfg>
__device__ __forceinline__ bool split_k_reduce_at(float* tile_parts, int32_t* counter,
                                                  float (&acc)[Cfg::kMBlocksPerWG][Cfg::kBlockN / 2],
                                                  int sp, int splits, int wg, int tid) {
#if MEGAMOE_DIAG_SPLIT_FREE
  // Measurement builds only: no hand-off at all (the last part runs the epilogue on its own
  // part; results are wrong): times what the K parts would cost with a free hand-off.
  (void)tile_parts; (void)counter; (void)acc; (void)wg; (void)tid;
  return sp == splits - 1;
#endif
  __shared__ int s_last[Cfg::kNumMathWG];
  constexpr int kPer = Cfg::kBlockN / 2;
  float* mine = tile_parts + static_cast<int64_t>(sp) * Cfg::kSplitUnitFloats;
  const uint64_t t0 = diag::now();
#pragma unroll
  for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) __stcg(mine + (sub * kPer + i) * Cfg::kWarpgroupThreads + tid, acc[sub][i]);
  }
  __threadfence();  // this thread's part is visible device-wide before the arrival below
  const uint64_t t1 = diag::now();
  if (tid == 0) diag::add(diag::kReduceStoreNs, t1 - t0);
  ptx::named_barrier_sync(1 + wg, Cfg::kWarpgroupThreads);
  if (tid == 0) {
    const int arrived = atomicAdd(counter, 1);
    const bool last = arrived == splits - 1;
    if (last) *counter = 0;  // every part has arrived: ready for the next launch
    s_last[wg] = last;
  }
  ptx::named_barrier_sync(1 + wg, Cfg::kWarpgroupThreads);
  const bool last = s_last[wg] != 0;
  ptx::named_barrier_sync(1 + wg, Cfg::kWarpgroupThreads);  // s_last is rewritten next tile
  const uint64_t t2 = diag::now();
  if (tid == 0) diag::add(diag::kReduceArriveNs, t2 - t1);
  if (!last) return false;
  __threadfence();  // the other parts' stores (ordered before their arrivals) are read below
  // Part by part, all of a part's values at once: one L2 round trip per part.
  // NOTES: the former loop (per value, a runtime loop over the parts) issued its loads one
  // dependent round trip at a time, on the critical path of the last CTAs (DeepSeek-V3 L1 at
  // T = 1, MEGAMOE_DIAG_TIMELINE build; docs/tuning-log.md).
#pragma unroll
  for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[sub][i] = __ldcg(tile_parts + (sub * kPer + i) * Cfg::kWarpgroupThreads + tid);
  }
#pragma unroll 1
  for (int s = 1; s < splits; ++s) {
    const float* part = tile_parts + static_cast<int64_t>(s) * Cfg::kSplitUnitFloats;
    float v[Cfg::kMBlocksPerWG][kPer];
#pragma unroll
    for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) v[sub][i] = __ldcg(part + (sub * kPer + i) * Cfg::kWarpgroupThreads + tid);
    }
#pragma unroll
    for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[sub][i] += v[sub][i];
    }
  }
  if (tid == 0) {
    diag::add(diag::kReduceSumNs, diag::now() - t2);
    diag::add(diag::kLastArrivals, 1);
  }
  return true;
}

template <class Cfg>
__device__ __forceinline__ bool split_k_reduce(const GemmParams& p,
                                               float (&acc)[Cfg::kMBlocksPerWG][Cfg::kBlockN / 2],
                                               int t, int sp, int splits, int wg, int tid) {
  return split_k_reduce_at<Cfg>(
      p.split_partials + static_cast<int64_t>(t) * splits * Cfg::kSplitUnitFloats,
      p.split_counters + t, acc, sp, splits, wg, tid);
}

// The launch gate (GemmParams::gate_min_avg / gate_max_avg, gate_admits) on the schedule's row
// offsets in shared memory. Called by all kThreads threads (contains __syncthreads); the same answer in every CTA.
template <int kThreads>
__device__ __forceinline__ bool gate_passes(const GemmParams& p, const int32_t* s_offsets) {
  int hits = 0;
  for (int base = 0; base < p.num_experts; base += kThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    hits += __syncthreads_count(e < p.num_experts && s_offsets[e + 1] > s_offsets[e]);
  }
  const int64_t rows = s_offsets[p.num_experts] - s_offsets[0];
  return gate_admits(p, rows, hits);
}

// FP8 mode: the largest scale byte of this thread's rows g, g + 8 of each of its weight blocks in
// `tile` (GemmParams::w_row_exp); blocks past the tile's last read none (their results are
// never stored).
template <class Cfg>
__device__ __forceinline__ typename Mainloop<Cfg>::RowExps fp8_row_exps(
    const GemmParams& p, const TileInfo& tile, const bool (&valid)[Cfg::kMBlocksPerWG], int wg,
    int tid) {
  typename Mainloop<Cfg>::RowExps rx{};
  if constexpr (Cfg::kFp8) {
    const int warp = tid / 32, g = (tid % 32) / 4;
    const uint8_t* rows = p.w_row_exp + static_cast<int64_t>(tile.expert) * p.m_rows;
#pragma unroll
    for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
      const int row = (tile.m_block0 + wg * Cfg::kMBlocksPerWG + sub) * sm90_layout::kBlockRows +
                      16 * warp + g;
#pragma unroll
      for (int h = 0; h < 2; ++h) rx.v[sub][h] = valid[sub] ? __ldg(rows + row + 8 * h) : 128;
    }
  }
  return rx;
}

// FP8 mode: the accumulators of (weight row m, token row r) times 2^(s_max(m) - 128) *
// b_row_factor[r], the two factors the operands were rebased by (columns past the tile's rows
// read factors of the slack rows and are never stored). kCoherent: b_row_factor read through L2
// only, for factors written earlier in the same launch (the MegaMoE kernel's rebase units).
template <class Cfg, bool kCoherent = false>
__device__ __forceinline__ void fp8_apply_row_factors(
    const GemmParams& p, const TileInfo& tile, const typename Mainloop<Cfg>::RowExps& rx,
    float (&acc)[Cfg::kMBlocksPerWG][Cfg::kBlockN / 2], int tid) {
  const int t = tid % 4;
  float fw[Cfg::kMBlocksPerWG][2];
#pragma unroll
  for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
#pragma unroll
    for (int h = 0; h < 2; ++h) fw[sub][h] = ldexpf(1.0f, rx.v[sub][h] - 128);
  }
#pragma unroll
  for (int c = 0; c < Cfg::kBlockN / 8; ++c) {
    // (two loads: a tile's first row may be odd)
    const float* f = p.b_row_factor + tile.row0 + 8 * c + 2 * t;
    const float2 fb = kCoherent ? make_float2(__ldcg(f), __ldcg(f + 1))
                                : make_float2(__ldg(f), __ldg(f + 1));
#pragma unroll
    for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
      acc[sub][4 * c + 0] *= fw[sub][0] * fb.x;
      acc[sub][4 * c + 1] *= fw[sub][0] * fb.y;
      acc[sub][4 * c + 2] *= fw[sub][1] * fb.x;
      acc[sub][4 * c + 3] *= fw[sub][1] * fb.y;
    }
  }
}

// One pipeline stage's weight and scale copies of `tile` (k-blocks kb .. kb + S - 1), after
// announcing the stage's bytes, B included, on its full barrier (the B boxes follow).
template <class Cfg>
__device__ __forceinline__ void issue_weight_stage(const GemmParams& p, const TileInfo& tile,
                                                   int total_m_blocks, int num_k_blocks, int kb,
                                                   uint8_t* smem_a, uint8_t* smem_sf,
                                                   uint64_t* full_bars, int stage,
                                                   uint64_t policy) {
  constexpr int kKSub = Cfg::kKBlocksPerStage;
  const uint32_t stage_bytes =
      tile.num_m_blocks * (sm90_layout::kBlockBytes + sm90_layout::kSfBlockBytes) * kKSub +
      Cfg::kSmemBBytes;
  const int64_t block_base =
      (static_cast<int64_t>(tile.expert) * total_m_blocks + tile.m_block0) * num_k_blocks;
  ptx::mbar_arrive_expect_tx(&full_bars[stage], stage_bytes);
  // Weight block m's kKSub k-blocks (and their scales) are contiguous in the sm90 layout.
  for (int m = 0; m < tile.num_m_blocks; ++m) {
    const int64_t block = block_base + static_cast<int64_t>(m) * num_k_blocks + kb;
    ptx::bulk_copy_g2s(smem_a + stage * Cfg::kSmemABytes + m * kKSub * sm90_layout::kBlockBytes,
                       p.w + block * sm90_layout::kBlockBytes, kKSub * sm90_layout::kBlockBytes,
                       &full_bars[stage], policy);
    ptx::bulk_copy_g2s(
        smem_sf + stage * Cfg::kSmemSfBytes + m * kKSub * sm90_layout::kSfBlockBytes,
        p.sf + block * sm90_layout::kSfBlockBytes, kKSub * sm90_layout::kSfBlockBytes,
        &full_bars[stage], policy);
  }
}

// Asynchronous epilogue (Cfg::kAsyncEpilogue), math side: math warpgroup wg stages its valid
// blocks of `tile` (its own part of the staging area) for the epilogue warps.
template <class Cfg, GemmKind kKind>
__device__ __forceinline__ void stage_async_blocks(const GemmParams& p, const TileInfo& tile,
                                                   const float (&acc)[Cfg::kMBlocksPerWG][Cfg::kBlockN / 2],
                                                   uint16_t* smem_stage, int wg, int tid) {
  uint16_t* wg_stage =
      smem_stage + static_cast<size_t>(wg) * Cfg::kMBlocksPerWG * Cfg::kBlockN * Cfg::kStagePitch;
#pragma unroll
  for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
    if (wg * Cfg::kMBlocksPerWG + sub >= tile.num_m_blocks) continue;
    const int mblk = tile.m_block0 + wg * Cfg::kMBlocksPerWG + sub;
    uint16_t* blk = wg_stage + static_cast<size_t>(sub) * Cfg::kBlockN * Cfg::kStagePitch;
    if constexpr (kKind == GemmKind::kL1) {
      stage_l1_block<Cfg>(p, tile, mblk, acc[sub], blk, tid);
    } else {
      stage_l2_block<Cfg>(p, tile, mblk, acc[sub], blk, tid);
    }
  }
}

// Asynchronous epilogue, epilogue-warp side: finishes the blocks of `tile` that math warpgroup w
// has staged (etid: the thread's index among the Cfg::kEpilogueThreads epilogue threads).
template <class Cfg, GemmKind kKind>
__device__ __forceinline__ void finish_async_blocks(const GemmParams& p, const TileInfo& tile,
                                                    const uint16_t* smem_stage, int w, int etid) {
#pragma unroll 1
  for (int sub = 0; sub < (MEGAMOE_DIAG_EPILOGUE_FREE ? 0 : Cfg::kMBlocksPerWG); ++sub) {
    const int lm = w * Cfg::kMBlocksPerWG + sub;
    if (lm >= tile.num_m_blocks) break;
    const int mblk = tile.m_block0 + lm;
    const uint16_t* blk = smem_stage + static_cast<size_t>(lm) * Cfg::kBlockN * Cfg::kStagePitch;
    if constexpr (kKind == GemmKind::kL1) {
      with_activation_kind(p.activation.kind, [&](auto kind) {
        constexpr ActivationKind kAct = decltype(kind)::value;
        finish_l1_block<Cfg, kAct, Cfg::kEpilogueThreads>(p, tile, mblk, blk, etid);
      });
    } else {
      finish_l2_block<Cfg, Cfg::kEpilogueThreads>(p, tile, mblk, blk, etid);
    }
  }
}

template <class Cfg, GemmKind kKind>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
sm90_grouped_gemm_bf16_mxfp4_kernel(const __grid_constant__ CUtensorMap tmap_b,
                                    const GemmParams p) {
  // ---- shared memory carve-up (offsets: GemmConfig) ----
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* smem_b = smem + Cfg::kOffB;
  uint8_t* smem_a = smem + Cfg::kOffA;
  uint8_t* smem_sf = smem + Cfg::kOffSf;
  uint64_t* full_bars = reinterpret_cast<uint64_t*>(smem + Cfg::kOffBars);
  uint64_t* empty_bars = full_bars + Cfg::kNumStages;
  float* smem_amax = reinterpret_cast<float*>(smem + Cfg::kOffAmax);
  uint16_t* smem_stage = reinterpret_cast<uint16_t*>(smem + Cfg::kOffStage);  // staged L1 epilogue
  int32_t* s_offsets = reinterpret_cast<int32_t*>(smem + Cfg::kOffSchedule);
  int32_t* s_prefix = s_offsets + (p.num_experts + 1);

  const int wg = threadIdx.x / Cfg::kWarpgroupThreads;
  const int tid = threadIdx.x % Cfg::kWarpgroupThreads;
  const int total_m_blocks = p.m_rows / sm90_layout::kBlockRows;
  const int m_tiles = (total_m_blocks + Cfg::kMBlocksPerCta - 1) / Cfg::kMBlocksPerCta;
  const int num_k_blocks = p.k / Cfg::kBlockK;

  // ---- setup: barriers and the tile schedule ----
  if (threadIdx.x == 0) {
    diag::stamp(diag::kEntry);
    diag::record_smid();
    for (int s = 0; s < Cfg::kNumStages; ++s) {
      ptx::mbar_init(&full_bars[s], 1);
      ptx::mbar_init(&empty_bars[s], Cfg::kWarpgroupThreads * Cfg::kNumMathWG);  // every math thread
    }
    ptx::mbar_init_fence();
    ptx::prefetch_tensor_map(&tmap_b);
  }
  // Programmatic dependent launch (GemmParams::prefetch_before_wait): the schedule and the first
  // stages' weight copies come before the wait for the previous kernel; without it, everything
  // comes after (the wait is a no-op in a plainly launched grid).
  // NOTES: only the configs without setmaxnreg prefetch: in the prefill configs the producer
  // runs at 40 registers, where the prefetch code spilled (PrefillK2 L1: 4 bytes), and their
  // launches last milliseconds, so a few microseconds of overlap do not matter there.
  const bool prefetch = !Cfg::kUseSetMaxNReg && p.prefetch_before_wait != 0;
  // Work units taken at run time (GemmParams::unit_counter) in the configs where one producer
  // thread feeds math warpgroups that finish their own tiles.
  constexpr bool kCanTakeUnits = !Cfg::kUseSetMaxNReg && !Cfg::kAsyncEpilogue;
  const bool dynamic = kCanTakeUnits && p.unit_counter != nullptr;
  // The unit each stage starts (dynamic units only; written before the stage's full-barrier
  // arrival, -1: no more units).
  __shared__ int32_t s_stage_unit[Cfg::kNumStages];
  // Release of the next kernel: the configs that take units release it after their wait (below);
  // the others only when their CTAs exit.
  // NOTES: with the static split (CTA b: tiles b, b + grid, ...) the CTAs below num_tiles % grid
  // have one tile more, and with 3-4 CTAs per SM the launch is balanced only because plainly
  // launched CTAs are spread round-robin over the SMs. A GEMM started while its predecessor still
  // holds SMs gets its CTAs placed on the free SMs first, consecutive blockIdx together: with
  // gather releasing L1 early, DeepSeek-V3 L1 at T = 8 (3.5 tiles per CTA) measured 1.11x slower
  // (docs/tuning-log.md). Units taken at run time go to whichever CTAs run first, wherever they
  // were placed.
  if (!prefetch) ptx::grid_dependency_wait();
  if constexpr (Cfg::kUseSetMaxNReg) {
    build_schedule_rounds<Cfg::kThreads, Cfg::kBlockN>(p.row_offsets, p.num_experts, p.max_rows,
                                                       m_tiles, s_offsets, s_prefix);
  } else {
    build_schedule<Cfg::kThreads, Cfg::kBlockN>(p.row_offsets, p.num_experts, p.max_rows, m_tiles,
                                                s_offsets, s_prefix, p.topk_idx, p.topk_slots,
                                                p.topk_first_local);
  }
  __syncthreads();
  if ((p.gate_min_avg | p.gate_max_avg) != 0 && !gate_passes<Cfg::kThreads>(p, s_offsets)) {
    if (prefetch) ptx::grid_dependency_wait();  // the stream's order (GemmParams: launch gate)
    return;
  }
  if (threadIdx.x == 0) diag::stamp(diag::kScheduleBuilt);
  const TileScheduler<Cfg::kBlockN, Cfg::kMBlocksPerCta> sched{
      s_offsets, s_prefix, p.num_experts, total_m_blocks, m_tiles};
  const int num_tiles = sched.total_tiles();
  // Work units: tile t, K part sp = unit u / splits, u % splits (the parts of a tile run on
  // neighbouring CTAs at about the same time). k_begin(sp, parts): part sp's first k-block,
  // covering stages [sp S / parts, (sp + 1) S / parts) of the S = num_k_blocks /
  // kKBlocksPerStage stages (the launcher keeps parts <= S, so no part is empty); the producer
  // and the math warpgroups both take their k range from it.
  const int splits = split_k_units<Cfg>(p, num_tiles);
  const int num_units = num_tiles * splits;
  const int num_k_stages = num_k_blocks / Cfg::kKBlocksPerStage;
  auto k_begin = [&](int sp, int parts) {
    return sp * num_k_stages / parts * Cfg::kKBlocksPerStage;
  };

  if (wg >= Cfg::kNumMathWG) {
    if constexpr (Cfg::kUseSetMaxNReg) ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if constexpr (Cfg::kAsyncEpilogue) {
      // Thread index within the producer's warpgroup(s): 0 the producer, 32.. the epilogue.
      const int ptid = static_cast<int>(threadIdx.x) - Cfg::kNumMathWG * Cfg::kWarpgroupThreads;
      if (ptid >= 32) {
        // ============================ epilogue warps ============================
        // The same tile sequence as the math warpgroups; per tile and math warpgroup w: wait
        // until w has staged its blocks, finish them, and hand the staging area back (only when
        // w has another tile, so every arrival is matched by a sync).
        const int etid = ptid - 32;
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
          const TileInfo tile = sched.get(t);
          const bool has_next = t + static_cast<int>(gridDim.x) < num_tiles;
#pragma unroll 1
          for (int w = 0; w < Cfg::kNumMathWG; ++w) {
            ptx::named_barrier_sync(Cfg::kBarStaged + 2 * w, Cfg::kStageSyncThreads);
            finish_async_blocks<Cfg, kKind>(p, tile, smem_stage, w, etid);
            if (has_next) ptx::named_barrier_arrive(Cfg::kBarStageFree + 2 * w, Cfg::kStageSyncThreads);
          }
        }
        return;
      }
    }
    // ================================ producer ================================
    if (threadIdx.x != Cfg::kNumMathWG * Cfg::kWarpgroupThreads) return;
    const uint64_t policy = ptx::policy_evict_first();
    constexpr int kKSub = Cfg::kKBlocksPerStage;
    auto copy_weights = [&](const TileInfo& tile, int kb, int stage) {
      issue_weight_stage<Cfg>(p, tile, total_m_blocks, num_k_blocks, kb, smem_a, smem_sf,
                              full_bars, stage, policy);
    };
    // PDL: the weights do not depend on the previous kernel, so the first unit's first stages
    // (stages 0.. of phase 0, whose empty barriers are free) get their weight copies now; the
    // loop below then issues only their B boxes (act / h_act: written by the previous kernel).
    int ahead = 0;
    if (prefetch) {
      const int u = blockIdx.x;
      if (u < num_units) {
        const TileInfo tile = sched.get(u / splits);
        const int kb_end = k_begin(u % splits + 1, splits);
        for (int kb = k_begin(u % splits, splits); kb < kb_end && ahead < Cfg::kNumStages;
             kb += kKSub) {
          copy_weights(tile, kb, ahead++);
        }
      }
      ptx::grid_dependency_wait();
    }
    // Every read of the previous kernel's outputs (and of the unit counter) comes after this
    // thread's wait above (prefetch) or at the top; the math warpgroups wait before their first
    // store.
    if constexpr (kCanTakeUnits) ptx::launch_dependents();
    int stage = 0;
    uint32_t phase = 0;
    int u = blockIdx.x;
    while (u < num_units) {
      const TileInfo tile = sched.get(u / splits);
      const int kb_begin = k_begin(u % splits, splits), kb_end = k_begin(u % splits + 1, splits);
      for (int kb = kb_begin; kb < kb_end; kb += kKSub) {
        if (ahead > 0) {
          --ahead;  // weights already issued (same unit, k-block and stage)
        } else {
          ptx::mbar_wait(&empty_bars[stage], phase ^ 1u);
          if (dynamic && kb == kb_begin) s_stage_unit[stage] = u;  // released by the arrival
          copy_weights(tile, kb, stage);
        }
#pragma unroll
        for (int j = 0; j < Cfg::kBoxesPerStage; ++j) {
          ptx::tma_load_2d(smem_b + stage * Cfg::kSmemBBytes + j * Cfg::kSmemBBoxBytes, &tmap_b,
                           kb * Cfg::kBlockK + j * Cfg::kBoxK, tile.row0, &full_bars[stage]);
        }
        if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
      }
      // The next unit: taken when this one's copies are all issued (the stages in flight cover
      // the atomic's round trip).
      u = dynamic ? static_cast<int>(gridDim.x) + atomicAdd(p.unit_counter, 1)
                  : u + static_cast<int>(gridDim.x);
    }
    if (dynamic) {
      // No more units: tell the math warpgroup through the next stage, then count this CTA out;
      // the last CTA sets the counters back to zero (every CTA's last take came before its
      // count, fenced).
      ptx::mbar_wait(&empty_bars[stage], phase ^ 1u);
      s_stage_unit[stage] = -1;
      ptx::mbar_arrive(&full_bars[stage]);
      __threadfence();
      if (atomicAdd(p.unit_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        atomicExch(p.unit_counter, 0);
        atomicExch(p.unit_counter + 1, 0);
      }
    }
    diag::stamp(diag::kProducerDone);
  } else {
    // ================================ math ================================
    if constexpr (Cfg::kUseSetMaxNReg) ptx::setmaxnreg_inc<Cfg::kMathRegs>();
    if (prefetch) ptx::grid_dependency_wait();  // before the first output store (PDL)
    using ML = Mainloop<Cfg>;
    float acc[Cfg::kMBlocksPerWG][Cfg::kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    // NOTES: the split count is re-read (from the schedule in shared memory) where it is used
    // after the mainloop instead of kept live across it: the split tile runs at the register cap
    // of 4 CTAs per SM, where the live values spilled (24 bytes, L1; measured when the split
    // path was still compiled into Decode16X2K2).
    auto live_splits = [&] { return split_k_units<Cfg>(p, sched.total_tiles()); };
    int units_done = 0;  // (diagnostics only)
    // The unit after u: the producer names it in the stage it fills first (-1: none), or the
    // static split's.
    auto next_unit = [&](int u) {
      if (!dynamic) return u + static_cast<int>(gridDim.x);
      ptx::mbar_wait(&full_bars[stage], phase);
      return static_cast<int>(s_stage_unit[stage]);
    };
    for (int u = blockIdx.x; u >= 0 && u < sched.total_tiles() * live_splits(); u = next_unit(u)) {
      ++units_done;
      const int n_splits = live_splits();
      const TileInfo tile = sched.get(u / n_splits);
      const int unit_k_blocks = k_begin(u % n_splits + 1, n_splits) - k_begin(u % n_splits, n_splits);
      bool valid[Cfg::kMBlocksPerWG];
#pragma unroll
      for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
        valid[sub] = wg * Cfg::kMBlocksPerWG + sub < tile.num_m_blocks;
      }
      const typename ML::RowExps rx = fp8_row_exps<Cfg>(p, tile, valid, wg, tid);
      dispatch_n<Cfg::kNStep, Cfg::kBlockN>(tile.num_rows, [&](auto n_tag) {
        ML::template run<decltype(n_tag)::value>(acc, smem_b, smem_a, smem_sf, full_bars,
                                                  empty_bars, unit_k_blocks, wg, tid, stage, phase,
                                                  rx);
      });
      if constexpr (Cfg::kFp8) fp8_apply_row_factors<Cfg>(p, tile, rx, acc, tid);
      if (wg == 0 && tid == 0 && u == static_cast<int>(blockIdx.x)) diag::stamp(diag::kFirstUnitDone);
      if constexpr (Cfg::kSupportsSplitK) {
        const int n_splits = live_splits();
        if (n_splits > 1 &&
            !split_k_reduce<Cfg>(p, acc, u / n_splits, u % n_splits, n_splits, wg, tid)) {
          continue;
        }
      }
      if constexpr (Cfg::kAsyncEpilogue) {
        // Stage this warpgroup's blocks (once the epilogue warps have read the previous tile's)
        // and go on with the next tile.
        if (u != static_cast<int>(blockIdx.x)) {  // (async configs: one unit per tile)
          ptx::named_barrier_sync(Cfg::kBarStageFree + 2 * wg, Cfg::kStageSyncThreads);
        }
        stage_async_blocks<Cfg, kKind>(p, tile, acc, smem_stage, wg, tid);
        ptx::named_barrier_arrive(Cfg::kBarStaged + 2 * wg, Cfg::kStageSyncThreads);
      } else {
        const uint64_t e0 = diag::now();
#pragma unroll
        for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
          if (!valid[sub]) continue;
          const int mblk = tile.m_block0 + wg * Cfg::kMBlocksPerWG + sub;
          if constexpr (kKind == GemmKind::kL1 && Cfg::kStagedEpilogue) {
            with_activation_kind(p.activation.kind, [&](auto kind) {
              constexpr ActivationKind kAct = decltype(kind)::value;
              epilogue_l1_staged<Cfg, kAct>(p, tile, mblk, acc[sub], smem_stage, wg, tid);
            });
          } else if constexpr (kKind == GemmKind::kL1) {
            with_activation_kind(p.activation.kind, [&](auto kind) {
              constexpr ActivationKind kAct = decltype(kind)::value;
              epilogue_l1<Cfg, kAct>(p, tile, mblk, acc[sub], smem_amax, wg, tid);
            });
          } else if constexpr (Cfg::kStagedEpilogue) {
            if (p.bias == nullptr) {
              epilogue_l2_staged<Cfg>(p, tile, mblk, acc[sub], smem_stage, wg, tid);
            } else {
              epilogue_l2<Cfg>(p, tile, mblk, acc[sub], tid);
            }
          } else {
            epilogue_l2<Cfg>(p, tile, mblk, acc[sub], tid);
          }
        }
        if (wg == 0 && tid == 0) diag::add(diag::kEpilogueNs, diag::now() - e0);
      }
    }
    if (wg == 0 && tid == 0) {
      diag::stamp(diag::kMathDone);
      diag::record(diag::kUnits, units_done);
    }
  }
}

}  // namespace megamoe::sm90
