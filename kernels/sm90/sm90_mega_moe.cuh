// sm90_mega_moe.cuh: the MegaMoE kernel, first step (issue 32; docs/design.md, "The MegaMoE
// kernel"): both expert GEMMs of a layer call in one persistent launch, L2 tiles starting as soon
// as the L1 tiles of their rows are written, with per-slot ready counters instead of a launch
// boundary.
//
// Work list (MegaSchedule, sm90_tile_schedule.hpp): (under expert parallelism with the dispatch
// inside, MegaParams::gather) the gather units, then L1's tiles, then (FP8 mode) the rebase
// units, then L2's tiles, over the same token-row n-tiles; a slot is an (expert, n-tile). Every CTA's
// producer takes each of its units, the first one included, from a counter in increasing order,
// so a unit is only ever taken by a running CTA and every L1 tile is taken before any rebase unit
// and those before any L2 tile: a unit waits only on earlier units that running CTAs will finish,
// whatever the residency (several virtual EP ranks' kernels, or an EP kernel's waiting CTA,
// sharing the SMs).
//
// Roles (TileConfig::mega_kernel: the decode tiles' shape, one math warpgroup that finishes its
// own tiles from registers and one producer warp, a split-K tile splitting either GEMM's tiles in
// K, the last part to arrive summing the parts in part order and finishing the tile; or a prefill
// tile, two math warpgroups and a producer warpgroup with setmaxnreg, whose epilogue is staged in
// the math warpgroups or, asynchronous, finished by the producer warpgroup's other warps):
//   producer thread: per unit, its stages' weight copies and B boxes (L1: the gathered act rows,
//                    L2: h_act; FP8 mode: act_fp8, h_fp8). A gather unit is named to the math
//                    warpgroups in a stage without data; an L1 unit behind gather units waits
//                    for its slot's count to reach them (weight copies first, as L2 below)
//                    and fences the async proxy. A rebase unit (FP8 mode) waits for
//                    its slot's L1 tiles and is named to the math warpgroups in a stage without
//                    data (a plain arrival). An L2 unit reads the slot's counter (ld.acquire.gpu); if the
//                    slot is not ready, it issues the weight copies of its first stages (they
//                    depend on nothing, up to the pipeline's depth), then spins (nanosleep
//                    back-off, the trap deadline of every wait in these kernels); then
//                    fence.proxy.async before its TMA reads; then it counts itself on the slot's
//                    consumed counter, and the slot's last L2 tile sets both counters back to
//                    zero (the next call finds them zero).
//   math warpgroup:  the mainloop of the tile's GEMM, then its epilogue (L1: activation, routing
//                    weight, requantization to h_q / h_sf / h_act; L2: out, or under expert
//                    parallelism out_rows, each row's source rank's combine slot, as the chained
//                    L2 writes it). A gather unit: 64 of its slot's rows, one warp per row, each
//                    once its arrival word says the row is in (ep::wait_row), converted as the
//                    gather (or, FP8 mode, rebase) launch would into L1's B rows; the barrier and
//                    release add of a rebase unit. After an L1 tile, a barrier of the threads that stored its
//                    rows, and one thread adds 1 to the slot's ready counter with release
//                    semantics (red.release.gpu): the rows' stores are published. A rebase unit
//                    (FP8 mode): 64 of its slot's rows of h_q / h_sf into L2's E4M3 rows and
//                    factors (one warp per row), the same barrier and release add; L2's tiles
//                    wait for L1's m-tiles plus the slot's rebase units.
//   epilogue warps:  (asynchronous prefill tiles) each math warpgroup stages its blocks and names
//                    the unit in shared memory (s_epi_unit) before its staging barrier; the
//                    epilogue warps finish the blocks, hand the staging area back, and publish an
//                    L1 tile as above. After its last unit each math warpgroup stages the unit
//                    -1, which ends them.
// Numerics: every output is the same mainloop over the same operands as the chained launch of
// the same tile, so the results are the chain's bit for bit.
#pragma once

#include <cstdint>

#include "ep/ep_device.cuh"
#include "sm90/sm90_combine_chunk.cuh"
#include "sm90/sm90_gather_row.cuh"
#include "sm90/sm90_grouped_gemm_bf16_mxfp4.cuh"
#include "sm90/sm90_rebase_row.cuh"
#include "sm90/sm90_tile_schedule.hpp"

namespace megamoe::sm90 {

// Dynamic shared memory of the kernel: the tile's, plus the second GEMM's tile prefix.
template <class Cfg>
constexpr size_t mega_smem_bytes(int num_experts) {
  return Cfg::smem_bytes(num_experts) + sizeof(int32_t) * static_cast<size_t>(num_experts + 1);
}

// Row units: kMegaUnitRows rows of a slot each, one warp per row. Under expert parallelism
// (MegaGather) the gather units, ahead of every L1 unit; in FP8 mode the rebase units, between
// L1's and L2's units, which rebase L1's rows (h_q, h_sf) into L2's E4M3 rows (h_fp8, h_factor).
constexpr int kMegaUnitRows = 64;

// The most CTAs that sum y in the combine inside the launch (MegaCombine; below 132, the SMs).
constexpr int kMegaCombineCtas = 64;
template <class Cfg>
constexpr int mega_row_units_per_slot() {
  return (Cfg::kBlockN + kMegaUnitRows - 1) / kMegaUnitRows;
}

// Spins until *counter reaches target (one thread). Gives up after kWaitTimeoutCycles and traps,
// like every wait of these kernels (sm90_ptx.cuh: a lost arrival fails loudly, not as a hang).
__device__ __forceinline__ void wait_count(const int32_t* counter, int target) {
  if (ptx::ld_acquire_gpu(counter) >= target) return;
  const long long start = clock64();
  uint32_t sleep_ns = 32;
#if defined(MEGAMOE_DIAG_WAIT_PRINT) && MEGAMOE_DIAG_WAIT_PRINT
  bool said = false;
#endif
  while (ptx::ld_acquire_gpu(counter) < target) {
    __nanosleep(sleep_ns);
    if (sleep_ns < 256) sleep_ns *= 2;
#if defined(MEGAMOE_DIAG_WAIT_PRINT) && MEGAMOE_DIAG_WAIT_PRINT
    if (!said && clock64() - start > 2'000'000'000ll) {
      said = true;
      printf("[wait] block %d: counter %p at %d of %d\n", blockIdx.x, counter,
             ptx::ld_acquire_gpu(counter), target);
    }
#endif
    if (clock64() - start > ptx::kWaitTimeoutCycles) __trap();
  }
}

// The combine inside the launch (MegaCombine), by the kThreads math threads of a CTA (`mt`: this
// one's index) once its L2 rows are stored; kBar: their named barrier.
template <int kThreads, int kBar>
__device__ inline void mega_combine(const MegaCombine& c, int hidden, int mt) {
  __shared__ uint32_t s_combines;
  __shared__ uint32_t s_generation;
  const bool ep = c.expert_parallel != 0;
  const uint32_t chunks = static_cast<uint32_t>(hidden) / kCombineVec;
  const uint32_t total = static_cast<uint32_t>(c.num_tokens) * chunks;
  // The CTAs that sum: the last `summers` to count out (all_ctas: one per kThreads items, at
  // least one (a rank without tokens still waits for the returns), at most kMegaCombineCtas;
  // otherwise the last one). A summer waits only for CTAs that count out after it, and at most
  // kMegaCombineCtas - 1 wait at once, fewer than the CTAs the GPU holds at one per SM: every
  // CTA of the grid gets to run even when fewer are resident than the occupancy query said (an
  // SM still running another kernel's CTAs under a smaller shared-memory carveout).
  // NOTES: why few and the last: when every CTA waited, or the first ones by index, a grid
  // larger than what was resident could deadlock (tuning log v34).
  const uint32_t summers =
      c.all_ctas ? max(1u, min(min(gridDim.x, static_cast<uint32_t>(kMegaCombineCtas)),
                               (total + kThreads - 1) / kThreads))
                 : 1u;
  __shared__ uint32_t s_part;
  // (under expert parallelism: the call number its EP dispatch, an earlier kernel, wrote)
  const uint64_t call =
      ep ? *reinterpret_cast<volatile const uint64_t*>(&ep::local_state(c.ep)->dispatched) : 0;
  if (mt == 0) {
    // The generation before this CTA counts out: the last one out advances it.
    const uint32_t generation = ep ? 0u : static_cast<uint32_t>(ptx::ld_acquire_gpu(
                                              reinterpret_cast<const int32_t*>(c.counters + 1)));
    if (ep) __threadfence_system(); else __threadfence();  // this CTA's rows (the barrier before)
    const uint32_t ticket = atomicAdd(c.counters, 1u);
    const bool last = ticket == gridDim.x - 1;
    if (last) {
      c.counters[0] = 0;  // every CTA has counted: the next call finds it zero
      if (ep) {
        __threadfence_system();
        ep::publish_return(c.ep, call);
      } else {
        ptx::red_release_gpu_add(reinterpret_cast<int32_t*>(c.counters + 1), 1);
      }
    }
    s_combines = ticket >= gridDim.x - summers ? 1u : 0u;
    s_part = ticket - (gridDim.x - summers);  // (a summer's share)
    s_generation = generation;
  }
  ptx::named_barrier_sync(kBar, kThreads);
  if (s_combines == 0) return;
  if (ep) {
    static_assert(kThreads > ep::kMaxRanks, "a math thread beside the return waits for rows_sig");
    ep::wait_returns(c.ep, call, mt);
  } else if (mt == 0) {
    // Every CTA's rows are in once the generation has moved on (the trap deadline of every wait
    // in these kernels).
    const int32_t* gen = reinterpret_cast<const int32_t*>(c.counters + 1);
    const long long start = clock64();
    while (static_cast<uint32_t>(ptx::ld_acquire_gpu(gen)) == s_generation) {
      __nanosleep(64);
      if (clock64() - start > ptx::kWaitTimeoutCycles) __trap();
    }
  }
  ptx::named_barrier_sync(kBar, kThreads);
  for (uint32_t i = s_part * kThreads + mt; i < total; i += summers * kThreads) {
    const uint32_t t = i / chunks;
    combine_chunk<true>(c.rows, c.slot_to_row, t, i - t * chunks, c.top_k,
                        static_cast<uint32_t>(hidden), c.y);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
sm90_mega_moe_kernel(const __grid_constant__ CUtensorMap tmap_act,
                     const __grid_constant__ CUtensorMap tmap_h,
                     const __grid_constant__ MegaParams mp) {
  static_assert(Cfg::kTile.mega_kernel() && (Cfg::kNumMathWG == 1) != Cfg::kUseSetMaxNReg,
                "the MegaMoE kernel runs the tiles of TileConfig::mega_kernel");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* smem_b = smem + Cfg::kOffB;
  uint8_t* smem_a = smem + Cfg::kOffA;
  uint8_t* smem_sf = smem + Cfg::kOffSf;
  uint64_t* full_bars = reinterpret_cast<uint64_t*>(smem + Cfg::kOffBars);
  uint64_t* empty_bars = full_bars + Cfg::kNumStages;
  float* smem_amax = reinterpret_cast<float*>(smem + Cfg::kOffAmax);
  uint16_t* smem_stage = reinterpret_cast<uint16_t*>(smem + Cfg::kOffStage);  // prefill tiles
  const int num_experts = mp.l1.num_experts;
  int32_t* s_offsets = reinterpret_cast<int32_t*>(smem + Cfg::kOffSchedule);
  int32_t* s_prefix1 = s_offsets + (num_experts + 1);
  int32_t* s_prefix2 = s_prefix1 + (num_experts + 1);

  const int wg = threadIdx.x / Cfg::kWarpgroupThreads;
  const int tid = threadIdx.x % Cfg::kWarpgroupThreads;
  const int m_blocks1 = mp.l1.m_rows / sm90_layout::kBlockRows;
  const int m_blocks2 = mp.l2.m_rows / sm90_layout::kBlockRows;
  const int m_tiles1 = (m_blocks1 + Cfg::kMBlocksPerCta - 1) / Cfg::kMBlocksPerCta;
  const int m_tiles2 = (m_blocks2 + Cfg::kMBlocksPerCta - 1) / Cfg::kMBlocksPerCta;
  const int k_blocks1 = mp.l1.k / Cfg::kBlockK, k_blocks2 = mp.l2.k / Cfg::kBlockK;
  // The barrier of the threads that store an L1 tile's rows before one of them publishes it:
  // the math warpgroup (decode tiles), both math warpgroups (staged prefill tiles), or the
  // epilogue warps (asynchronous ones); after the named barriers the epilogues use.
  constexpr int kBarPublish = Cfg::kAsyncEpilogue ? Cfg::kBarStageFree + 2 * Cfg::kNumMathWG - 1
                                                  : (Cfg::kNumMathWG == 1 ? 1 : 1 + Cfg::kNumMathWG);
  constexpr int kMathThreads = Cfg::kNumMathWG * Cfg::kWarpgroupThreads;
  constexpr int kPublishThreads = Cfg::kAsyncEpilogue ? Cfg::kEpilogueThreads : kMathThreads;
  // The math warpgroups' barrier (after a row unit's rows, before one of them publishes it; in
  // the combine), and (asynchronous epilogue) the math warpgroups' and epilogue warps' barrier
  // before the combine.
  constexpr int kBarMath = kBarPublish + 1;
  constexpr int kBarTail = kBarMath + 1;
  constexpr int kTailThreads = kMathThreads + Cfg::kEpilogueThreads;
  constexpr int kRebaseUnitsPerSlot = Cfg::kFp8 ? mega_row_units_per_slot<Cfg>() : 0;
  static_assert(kBarTail <= 15, "named barriers 0..15");
  static_assert(!Cfg::kFp8 || !Cfg::kSupportsSplitK,
                "the split-K partials are sized for the GEMMs' units, not the rebase units");

  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::kNumStages; ++s) {
      ptx::mbar_init(&full_bars[s], 1);
      ptx::mbar_init(&empty_bars[s], Cfg::kWarpgroupThreads * Cfg::kNumMathWG);  // every math thread
    }
    ptx::mbar_init_fence();
    ptx::prefetch_tensor_map(&tmap_act);
    ptx::prefetch_tensor_map(&tmap_h);
  }
  // Programmatic dependent launch as in the GEMM kernel (GemmParams::prefetch_before_wait): the
  // schedule (row_offsets: written two launches back) is built before the wait for the previous
  // kernel. No weights are: every unit, the first one included, is taken from the unit counter,
  // which is only valid after the wait (a unit fixed per CTA would be held by a CTA that may not
  // be resident while the others wait on it: deadlock). The prefill tiles (setmaxnreg) wait
  // first, as their GEMM launches do, and read row_offsets.
  // Under expert parallelism with the gather inside (mp.gather), the previous kernel is the EP
  // dispatch, which writes row_offsets: the schedule then waits too.
  const bool gathering = mp.gather.x_q != nullptr;
  const bool combining = mp.combine.counters != nullptr;
  const bool prefetch = !Cfg::kUseSetMaxNReg && mp.l1.prefetch_before_wait != 0 && !gathering;
  if (!prefetch) ptx::grid_dependency_wait();
  if constexpr (Cfg::kUseSetMaxNReg) {
    build_schedule_rounds<Cfg::kThreads, Cfg::kBlockN>(mp.l1.row_offsets, num_experts,
                                                       mp.l1.max_rows, m_tiles1, s_offsets,
                                                       s_prefix1);
  } else {
    build_schedule<Cfg::kThreads, Cfg::kBlockN>(mp.l1.row_offsets, num_experts, mp.l1.max_rows,
                                                m_tiles1, s_offsets, s_prefix1, mp.l1.topk_idx,
                                                mp.l1.topk_slots, mp.l1.topk_first_local);
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= num_experts; e += Cfg::kThreads) {
    s_prefix2[e] = s_prefix1[e] / m_tiles1 * m_tiles2;  // the same n-tiles, L2's m-tiles
  }
  __syncthreads();
  const MegaSchedule<Cfg::kBlockN, Cfg::kMBlocksPerCta> ms{
      {s_offsets, s_prefix1, num_experts, m_blocks1, m_tiles1},
      {s_offsets, s_prefix2, num_experts, m_blocks2, m_tiles2}};
  // Units: L1 tile t's K parts t * s1 + sp, then (FP8 mode) the rebase units, then L2 tile t's
  // parts l2_first + t * s2 + sp (below). A part covers stages [sp S / s, (sp + 1) S / s) of the S
  // stages of K. Split
  // tiles only, and only where the workspace (mp.l1.split_*) holds both GEMMs' parts and
  // counters (L1's tiles first); otherwise unsplit (the same answer in every CTA).
  int splits1 = 1, splits2 = 1;
  if constexpr (Cfg::kSupportsSplitK) {
    const int64_t units = static_cast<int64_t>(ms.l1_tiles()) * mp.l1.k_splits +
                          static_cast<int64_t>(ms.l2.total_tiles()) * mp.l2.k_splits;
    if ((mp.l1.k_splits > 1 || mp.l2.k_splits > 1) &&
        ms.total_tiles() <= mp.l1.split_counters_capacity &&
        units * Cfg::kSplitUnitFloats <= mp.l1.split_partial_floats) {
      splits1 = max(mp.l1.k_splits, 1);
      splits2 = max(mp.l2.k_splits, 1);
    }
  }
  // FP8 mode: between L1's units and L2's, kRebaseUnitsPerSlot rebase units per slot (slot-major);
  // each waits for its slot's L1 tiles and adds 1 to the slot's ready count, so an L2 tile waits
  // for ready_target() + kRebaseUnitsPerSlot.
  // Gather units (mp.gather) come first: units [0, num_gather), slot-major, each adding 1 to its
  // slot's ready count, which L1's tiles wait for; the GEMM and rebase units below are numbered
  // from num_gather (u = unit - num_gather), and every later wait target adds gather_target.
  const int gather_target = gathering ? mega_row_units_per_slot<Cfg>() : 0;
  const int num_gather = ms.num_slots() * gather_target;
  const int l1_units = ms.l1_tiles() * splits1;
  const int l2_first = l1_units + ms.num_slots() * kRebaseUnitsPerSlot;
  const int num_units = l2_first + ms.l2.total_tiles() * splits2;
  const int all_units = num_gather + num_units;
  const int rebase_target = gather_target + ms.ready_target();
  const int l2_ready_target = rebase_target + kRebaseUnitsPerSlot;
  auto is_rebase = [&](int u) { return u >= l1_units && u < l2_first; };
  // The unit's tile (a MegaSchedule index), K part and parts (GEMM units).
  auto tile_of = [&](int u) {
    return u < l1_units ? u / splits1 : (u - l2_first) / splits2 + ms.l1_tiles();
  };
  auto part_of = [&](int u) { return u < l1_units ? u % splits1 : (u - l2_first) % splits2; };
  auto k_range = [&](int u, int& kb_begin, int& kb_end) {
    const int parts = u < l1_units ? splits1 : splits2;
    const int sp = part_of(u);
    const int stages = (u < l1_units ? k_blocks1 : k_blocks2) / Cfg::kKBlocksPerStage;
    kb_begin = sp * stages / parts * Cfg::kKBlocksPerStage;
    kb_end = (sp + 1) * stages / parts * Cfg::kKBlocksPerStage;
  };
  // The host sizes the counters for the capacity (max_schedule_slots); more slots cannot occur.
  if (ms.num_slots() > mp.ready_capacity) __trap();
  // The unit each stage starts (written before the stage's first arrival; -1: no more units).
  __shared__ int32_t s_stage_unit[Cfg::kNumStages];
  // Asynchronous epilogue: the unit each math warpgroup has staged (-1: none left) and its tile.
  __shared__ int32_t s_epi_unit[Cfg::kNumMathWG];
  __shared__ TileInfo s_epi_tile[Cfg::kNumMathWG];

  if (wg >= Cfg::kNumMathWG) {
    if constexpr (Cfg::kUseSetMaxNReg) ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    // Thread index within the producer's warpgroup(s): 0 the producer, 32.. the epilogue.
    const int ptid = static_cast<int>(threadIdx.x) - kMathThreads;
    if constexpr (Cfg::kAsyncEpilogue) {
      if (ptid >= 32) {
        // ============================ epilogue warps ============================
        // Per unit and math warpgroup w: wait until w has staged its blocks, finish them, hand
        // the staging area back; after an L1 tile's blocks of every warpgroup, publish it. Every
        // hand-back is matched: each math warpgroup waits for it before staging its next unit
        // or the final -1.
        const int etid = ptid - 32;
        for (;;) {
          int u = -1;
          TileInfo tile{};  // the unit's tile (the math warpgroups stage it beside the unit)
#pragma unroll 1
          for (int w = 0; w < Cfg::kNumMathWG; ++w) {
            ptx::named_barrier_sync(Cfg::kBarStaged + 2 * w, Cfg::kStageSyncThreads);
            u = s_epi_unit[w];
            if (u < 0) continue;
            tile = s_epi_tile[w];
            if (u < l1_units) {
              finish_async_blocks<Cfg, GemmKind::kL1>(mp.l1, tile, smem_stage, w, etid);
            } else {
              finish_async_blocks<Cfg, GemmKind::kL2>(mp.l2, tile, smem_stage, w, etid);
            }
            ptx::named_barrier_arrive(Cfg::kBarStageFree + 2 * w, Cfg::kStageSyncThreads);
          }
          if (u < 0) break;
          if (u < l1_units) {
            ptx::named_barrier_sync(kBarPublish, kPublishThreads);
            if (etid == 0) ptx::red_release_gpu_add(mp.ready + ms.slot(tile), 1);
          }
        }
        if (combining) ptx::named_barrier_arrive(kBarTail, kTailThreads);  // its rows are stored
        return;
      }
    }
    // ================================ producer ================================
    if (ptid != 0) return;
    const uint64_t policy = ptx::policy_evict_first();
    constexpr int kKSub = Cfg::kKBlocksPerStage;
    int stage = 0;
    uint32_t phase = 0;
    int ahead = 0;  // stages from (stage, phase) on whose weight copies are already issued
    // The weight copies of unit u's k-blocks kb.. into stage s (once the math has freed it);
    // `first`: the unit's first stage, which names it to the math warpgroup.
    auto copy_weights = [&](int u, const TileInfo& tile, int kb, bool first, int s, uint32_t ph) {
      ptx::mbar_wait(&empty_bars[s], ph ^ 1u);
      if (first) s_stage_unit[s] = num_gather + u;  // released by the stage's arrival
      if (u < l1_units) {
        issue_weight_stage<Cfg>(mp.l1, tile, m_blocks1, k_blocks1, kb, smem_a, smem_sf, full_bars,
                                s, policy);
      } else {
        issue_weight_stage<Cfg>(mp.l2, tile, m_blocks2, k_blocks2, kb, smem_a, smem_sf, full_bars,
                                s, policy);
      }
    };
    // Unit u's next stages' weight copies, ahead of their B boxes, until `depth` stages are.
    auto copy_weights_ahead = [&](int u, const TileInfo& tile, int depth) {
      int kb_begin, kb_end;
      k_range(u, kb_begin, kb_end);
      int s = stage;
      uint32_t ph = phase;
      for (int i = 0; i < ahead; ++i) {
        if (++s == Cfg::kNumStages) { s = 0; ph ^= 1u; }
      }
      for (int kb = kb_begin + ahead * kKSub; kb < kb_end && ahead < depth; kb += kKSub) {
        copy_weights(u, tile, kb, kb == kb_begin, s, ph);
        ++ahead;
        if (++s == Cfg::kNumStages) { s = 0; ph ^= 1u; }
      }
    };
    if (prefetch) ptx::grid_dependency_wait();
    // Every read of the previous kernels' outputs and of the counters comes after the wait. The
    // prefill tiles release the next kernel only when they exit, as their GEMM launches do.
    // (A combine by the last CTA alone, with several ranks on one GPU, releases it only at the
    // end: the next call's CTAs must not hold the GPU while a rank it waits for needs room.)
    if constexpr (!Cfg::kUseSetMaxNReg) {
      if (!combining || mp.combine.all_ctas) ptx::launch_dependents();
    }
    // A unit that only names itself to the math warpgroups, in a stage without data (a plain
    // arrival completes the stage's full barrier).
    auto name_unit = [&](int unit) {
      ptx::mbar_wait(&empty_bars[stage], phase ^ 1u);
      s_stage_unit[stage] = unit;
      ptx::mbar_arrive(&full_bars[stage]);
      if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
    };
    int next = atomicAdd(mp.l1.unit_counter, 1);
    while (next < all_units) {
      if (next < num_gather) {  // a gather unit: the math warpgroups wait for its rows
        name_unit(next);
        next = atomicAdd(mp.l1.unit_counter, 1);
        continue;
      }
      const int u = next - num_gather;
      if constexpr (kRebaseUnitsPerSlot > 0) {
        if (is_rebase(u)) {
          // A rebase unit: once its slot's L1 tiles are done.
          wait_count(mp.ready + (u - l1_units) / kRebaseUnitsPerSlot, rebase_target);
          name_unit(next);
          next = atomicAdd(mp.l1.unit_counter, 1);
          continue;
        }
      }
      const bool l1 = u < l1_units;
      const TileInfo tile = ms.get(tile_of(u));
      if (l1 && gathering) {
        // An L1 tile reads its slot's B rows, written by the slot's gather units: as an L2 tile
        // waits for its slot's L1 tiles (below).
        const int slot = ms.slot(tile);
        if (ptx::ld_acquire_gpu(mp.ready + slot) < gather_target) {
          copy_weights_ahead(u, tile, Cfg::kNumStages);
          wait_count(mp.ready + slot, gather_target);
        }
        ptx::fence_proxy_async_global();  // the rows were written by generic-proxy stores
      }
      if (!l1) {
        // An L2 tile reads the h rows of its slot: every L1 tile of the slot must be done. Its
        // weights do not depend on them: where the slot is not ready, the pipeline's depth of
        // them goes out before the wait.
        const int slot = ms.slot(tile);
        if (ptx::ld_acquire_gpu(mp.ready + slot) < l2_ready_target) {
          copy_weights_ahead(u, tile, Cfg::kNumStages);
          wait_count(mp.ready + slot, l2_ready_target);
        }
        ptx::fence_proxy_async_global();  // the rows were written by generic-proxy stores
        if (atomicAdd(mp.consumed + slot, 1) == ms.l2.m_tiles * splits2 - 1) {
          // The slot's last L2 tile past its wait: no tile of this call reads either counter again.
          mp.ready[slot] = 0;
          mp.consumed[slot] = 0;
        }
      }
      const CUtensorMap* map = l1 ? &tmap_act : &tmap_h;
      int kb_begin, kb_end;
      k_range(u, kb_begin, kb_end);
      for (int kb = kb_begin; kb < kb_end; kb += kKSub) {
        if (ahead > 0) {
          --ahead;
        } else {
          copy_weights(u, tile, kb, kb == kb_begin, stage, phase);
        }
#pragma unroll
        for (int j = 0; j < Cfg::kBoxesPerStage; ++j) {
          ptx::tma_load_2d(smem_b + stage * Cfg::kSmemBBytes + j * Cfg::kSmemBBoxBytes, map,
                           kb * Cfg::kBlockK + j * Cfg::kBoxK, tile.row0, &full_bars[stage]);
        }
        if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
      }
      next = atomicAdd(mp.l1.unit_counter, 1);
    }
    // No more units: the combine (its math warpgroups' last unit), then tell the math
    // warpgroups, count this CTA out; the last one sets the unit counters back to zero.
    if (combining) name_unit(all_units);
    ptx::mbar_wait(&empty_bars[stage], phase ^ 1u);
    s_stage_unit[stage] = -1;
    ptx::mbar_arrive(&full_bars[stage]);
    __threadfence();
    if (atomicAdd(mp.l1.unit_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(mp.l1.unit_counter, 0);
      atomicExch(mp.l1.unit_counter + 1, 0);
    }
  } else {
    // ================================ math ================================
    if constexpr (Cfg::kUseSetMaxNReg) ptx::setmaxnreg_inc<Cfg::kMathRegs>();
    if (prefetch) ptx::grid_dependency_wait();  // before the first output store
    using ML = Mainloop<Cfg>;
    const int mwg = Cfg::kNumMathWG == 1 ? 0 : wg;  // this math warpgroup
    float acc[Cfg::kMBlocksPerWG][Cfg::kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    bool staged_any = false;  // asynchronous epilogue: a unit of this warpgroup is staged
    auto next_unit = [&] {
      ptx::mbar_wait(&full_bars[stage], phase);
      return static_cast<int>(s_stage_unit[stage]);
    };
    const int mt = mwg * Cfg::kWarpgroupThreads + tid;  // this thread among the math threads
    // A row unit (a gather or a rebase unit): rows [chunk x 64, + 64) of the slot, one warp per
    // row (per_row(r, lane)); then the math warpgroups' barrier, one release add to the slot's
    // count, and the stage back to the producer.
    auto row_unit = [&](int slot, int chunk, auto&& per_row) {
      const TileInfo st = ms.slot_info(slot);
      const int row_end = min(st.row0 + st.num_rows, st.row0 + (chunk + 1) * kMegaUnitRows);
      for (int r = st.row0 + chunk * kMegaUnitRows + mt / 32; r < row_end; r += kMathThreads / 32)
        per_row(r, tid % 32);
      ptx::named_barrier_sync(kBarMath, kMathThreads);
      if (mt == 0) ptx::red_release_gpu_add(mp.ready + slot, 1);
      ptx::mbar_arrive(&empty_bars[stage]);
      if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
    };
    // Asynchronous epilogue: no more units: once the epilogue warps have read this warpgroup's
    // last one, stage -1 (they finish it and end).
    auto end_epilogue = [&] {
      if (staged_any) ptx::named_barrier_sync(Cfg::kBarStageFree + 2 * mwg, Cfg::kStageSyncThreads);
      if (tid == 0) s_epi_unit[mwg] = -1;
      ptx::named_barrier_arrive(Cfg::kBarStaged + 2 * mwg, Cfg::kStageSyncThreads);
    };
    for (int next = next_unit(); next >= 0; next = next_unit()) {
      if (next == all_units) {
        // The combine (MegaCombine), this CTA's last unit: once every L2 row the CTA computed is
        // stored (the math warpgroups' barrier; asynchronous epilogue: the epilogue warps end
        // first, and the barrier is with them), counted out, published by the last CTA out, y
        // summed.
        // NOTES: why a unit and not code after this loop: anything after the loop made ptxas
        // spill inside the prefill tiles' mainloops (tuning log v34).
        if constexpr (Cfg::kAsyncEpilogue) {
          end_epilogue();
          ptx::named_barrier_sync(kBarTail, kTailThreads);
        } else {
          ptx::named_barrier_sync(kBarMath, kMathThreads);
        }
        mega_combine<kMathThreads, kBarMath>(mp.combine, mp.l1.k, mt);
        ptx::mbar_arrive(&empty_bars[stage]);
        if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
        continue;
      }
      if (next < num_gather) {
        // A gather unit: lane 0 waits for the row's token to have arrived (its arrival word,
        // acquire at system scope; the row was written by its source rank while this launch
        // runs: read through L2), then the warp writes L1's B row (exact mode: the gather
        // launch's BF16 conversion; FP8 mode: the rebase launch's E4M3 row and factor).
        const MegaGather& g = mp.gather;
        // (the call number its EP dispatch, the previous kernel, wrote)
        const uint64_t call =
            *reinterpret_cast<volatile const uint64_t*>(&g.arrival.local->dispatched);
        const int H = mp.l1.k;
        const uint32_t groups = static_cast<uint32_t>(H) / kScaleBlock;
        row_unit(next / gather_target, next % gather_target, [&](int r, int lane) {
          const int64_t token = __ldg(g.row_slot + r) / g.top_k;  // s * t_max + t
          if (lane == 0) ep::wait_row(g.arrival, token, call);
          __syncwarp();
          const uint8_t* x_row = g.x_q + token * H;
          const uint8_t* sf_row = g.x_sf + token * groups;
          if constexpr (Cfg::kFp8) {
            rebase_row_e4m3<true>(x_row, sf_row, groups, g.act_fp8 + static_cast<int64_t>(r) * H,
                                  g.act_factor + r, lane);
          } else {
            for (int c = lane; c < H / kGatherVec; c += 32)
              gather_chunk<true>(x_row, sf_row, c, g.act + static_cast<int64_t>(r) * H);
          }
        });
        continue;
      }
      const int u = next - num_gather;
      if constexpr (kRebaseUnitsPerSlot > 0) {
        if (is_rebase(u)) {
          // A rebase unit (the rebase launch's arithmetic): L1's h_q / h_sf (written in this
          // launch: read through L2 after an acquire of the slot's count) into L2's E4M3 rows
          // and factors.
          const int slot = (u - l1_units) / kRebaseUnitsPerSlot;
          (void)ptx::ld_acquire_gpu(mp.ready + slot);
          const int cols = mp.l2.k;
          const uint32_t groups = static_cast<uint32_t>(cols) / kScaleBlock;
          row_unit(slot, (u - l1_units) % kRebaseUnitsPerSlot, [&](int r, int lane) {
            rebase_row_e4m3<true>(mp.l1.h_q + static_cast<int64_t>(r) * cols,
                                  mp.l1.h_sf + static_cast<int64_t>(r) * groups, groups,
                                  mp.h_fp8 + static_cast<int64_t>(r) * cols, mp.h_factor + r, lane);
          });
          continue;
        }
      }
      const bool l1 = u < l1_units;
      const TileInfo tile = ms.get(tile_of(u));
      const GemmParams& gp = l1 ? mp.l1 : mp.l2;
      int kb_begin, kb_end;
      k_range(u, kb_begin, kb_end);
      bool valid[Cfg::kMBlocksPerWG];
#pragma unroll
      for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
        valid[sub] = mwg * Cfg::kMBlocksPerWG + sub < tile.num_m_blocks;
      }
      const typename ML::RowExps rx = fp8_row_exps<Cfg>(gp, tile, valid, mwg, tid);
      dispatch_n<Cfg::kNStep, Cfg::kBlockN>(tile.num_rows, [&](auto n_tag) {
        ML::template run<decltype(n_tag)::value>(acc, smem_b, smem_a, smem_sf, full_bars,
                                                  empty_bars, kb_end - kb_begin, mwg, tid, stage,
                                                  phase, rx);
      });
      if constexpr (Cfg::kFp8) {
        // L2's row factors were written by this launch's rebase units: read through L2 (not the
        // read-only path), after the unit's B rows arrived, which the producer loaded only once
        // it had acquired the slot's count. (Ordered by that TMA completion rather than by an
        // acquire of this thread: the count may be reset by then, by the slot's last L2 tile.)
        fp8_apply_row_factors<Cfg, true>(gp, tile, rx, acc, tid);
      }
      if constexpr (Cfg::kSupportsSplitK) {
        // Only the tile's last part to arrive goes on, with the parts summed in part order.
        const int parts = l1 ? splits1 : splits2;
        if (parts > 1) {
          const int t = tile_of(u);
          const int64_t first_unit = l1 ? static_cast<int64_t>(t) * splits1
                                        : l2_first + static_cast<int64_t>(t - ms.l1_tiles()) * splits2;
          if (!split_k_reduce_at<Cfg>(mp.l1.split_partials + first_unit * Cfg::kSplitUnitFloats,
                                      mp.l1.split_counters + t, acc, part_of(u), parts, 0, tid)) {
            continue;
          }
        }
      }
      if constexpr (Cfg::kAsyncEpilogue) {
        // Stage this warpgroup's blocks (once the epilogue warps have read the previous unit's),
        // name the unit, and go on with the next one.
        if (staged_any) ptx::named_barrier_sync(Cfg::kBarStageFree + 2 * mwg, Cfg::kStageSyncThreads);
        staged_any = true;
        if (l1) {
          stage_async_blocks<Cfg, GemmKind::kL1>(mp.l1, tile, acc, smem_stage, mwg, tid);
        } else {
          stage_async_blocks<Cfg, GemmKind::kL2>(mp.l2, tile, acc, smem_stage, mwg, tid);
        }
        if (tid == 0) {
          s_epi_unit[mwg] = u;
          s_epi_tile[mwg] = tile;
        }
        ptx::named_barrier_arrive(Cfg::kBarStaged + 2 * mwg, Cfg::kStageSyncThreads);
        continue;
      }
      if (l1) {
#pragma unroll
        for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
          if (mwg * Cfg::kMBlocksPerWG + sub >= tile.num_m_blocks) continue;
          const int mblk = tile.m_block0 + mwg * Cfg::kMBlocksPerWG + sub;
          with_activation_kind(mp.l1.activation.kind, [&](auto kind) {
            constexpr ActivationKind kAct = decltype(kind)::value;
            if constexpr (Cfg::kStagedEpilogue) {
              epilogue_l1_staged<Cfg, kAct>(mp.l1, tile, mblk, acc[sub], smem_stage, mwg, tid);
            } else {
              epilogue_l1<Cfg, kAct>(mp.l1, tile, mblk, acc[sub], smem_amax, 0, tid);
            }
          });
        }
        // Publish the tile's rows: the barrier orders the stores of every thread that wrote
        // them before one thread's release add.
        ptx::named_barrier_sync(kBarPublish, kPublishThreads);
        if (mwg == 0 && tid == 0) ptx::red_release_gpu_add(mp.ready + ms.slot(tile), 1);
      } else {
        // (Under expert parallelism l2.out_rows sends each row to its source's combine slot.)
#pragma unroll
        for (int sub = 0; sub < Cfg::kMBlocksPerWG; ++sub) {
          if (mwg * Cfg::kMBlocksPerWG + sub >= tile.num_m_blocks) continue;
          const int mblk = tile.m_block0 + mwg * Cfg::kMBlocksPerWG + sub;
          if constexpr (Cfg::kStagedEpilogue) {
            if (mp.l2.bias == nullptr) {
              epilogue_l2_staged<Cfg>(mp.l2, tile, mblk, acc[sub], smem_stage, mwg, tid);
            } else {
              epilogue_l2<Cfg>(mp.l2, tile, mblk, acc[sub], tid);
            }
          } else {
            epilogue_l2<Cfg>(mp.l2, tile, mblk, acc[sub], tid);
          }
        }
      }
    }
    if constexpr (Cfg::kAsyncEpilogue) {
      if (!combining) end_epilogue();
    }
  }
}

}  // namespace megamoe::sm90
