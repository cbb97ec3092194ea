// sm90_gemm_config.hpp: the kernel parameter struct of the Hopper grouped GEMMs (the kernel
// ABI), and GemmConfig: a shipped tile's compile-time constants and shared-memory layout, used by
// both the launcher (sizing) and the kernel (offsets). Host + device.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ep/ep_protocol.hpp"
#include "layout/sm90_weight_layout.hpp"
#include "megamoe/activation.hpp"
#include "sm90/sm90_tiles.hpp"

namespace megamoe::sm90 {

enum class GemmKind : int {
  kL1 = 0,  // W13 x act -> activation, row weight, per-32 requantization (h_q, h_sf, h_act)
  kL2 = 1,  // W2 x h_act -> bf16 out (+ row_weight * bias)
};

// Most local experts one launch schedules: the per-expert row offsets and tile prefix live in
// shared memory (8 bytes per expert). Kimi-K3 without expert parallelism has 896.
constexpr int kMaxLocalExperts = 1024;

// The kernel ABI: raw pointers and sizes only.
struct GemmParams {
  int num_experts = 0;        // E_l
  int k = 0;                  // reduction: H (L1) or I (L2)
  int m_rows = 0;             // prepared weight rows per expert: 2I (L1) or H (L2)
  int max_rows = 0;           // row capacity (row_offsets[E_l] must not exceed it)
  const int32_t* row_offsets = nullptr;  // [E_l + 1]
  const uint8_t* w = nullptr;            // sm90 layout, [E_l, m_rows, k/2] bytes
  const uint8_t* sf = nullptr;           // sm90 layout, [E_l, m_rows, k/32] bytes
  const float* row_weights = nullptr;    // [max_rows]
  const uint16_t* bias = nullptr;        // bf16 [E_l, m_rows] canonical row order, or nullptr
  // L1 epilogue
  int intermediate = 0;
  Activation activation;
  bool fast_math = true;
  uint8_t* h_q = nullptr;                // [max_rows, I]
  uint8_t* h_sf = nullptr;               // [max_rows, I/32]
  uint16_t* h_act = nullptr;             // [max_rows, I]
  // L2 epilogue
  uint16_t* out = nullptr;               // [max_rows, H]
  // Optional [max_rows]: row r's destination (H bf16 values) instead of out + r * H. Under expert
  // parallelism the EP dispatch points each received row at its source rank's combine slot, so
  // the L2 epilogue returns the rows itself.
  uint16_t* const* out_rows = nullptr;
  // FP8 mode (the E4M3 tiles, TileConfig::fp8): the B rows are E4M3 [rows, k] rebased to one
  // power of two per row, their K order permuted within each 32-group (sm90_layout
  // fp8_row_slot); the accumulator of (weight row m, token row r) is multiplied by
  // 2^(w_row_exp[e, m] - 128) * b_row_factor[r] before the epilogue.
  const uint8_t* w_row_exp = nullptr;    // [E_l, m_rows]: each prepared row's largest scale byte
  const float* b_row_factor = nullptr;   // [max_rows]
  // Split-K (one-math-warpgroup tiles only; GemmConfig::kSupportsSplitK): each tile's K loop
  // is cut into k_splits parts run as separate work units. Every unit stores its FP32
  // accumulators to split_partials; the tile's last unit to arrive (split_counters, zero before
  // the launch and left zero) adds the parts in split order (deterministic) and runs the
  // epilogue. A launch whose tiles exceed the capacities runs unsplit (all CTAs agree: the tile
  // count comes from the same schedule).
  int k_splits = 1;
  float* split_partials = nullptr;       // [split_partial_floats]
  int64_t split_partial_floats = 0;
  int32_t* split_counters = nullptr;     // [split_counters_capacity], zero-initialized
  int split_counters_capacity = 0;
  // Programmatic dependent launch (L1Args / L2Args::programmatic): build the schedule from
  // row_offsets and issue the first stages' weight copies before waiting for the previous kernel
  // of the stream (tiles without setmaxnreg; the others wait first). 0: wait first (also
  // correct in a plainly launched grid, where the wait is a no-op).
  int prefetch_before_wait = 0;
  // Schedule counted from the top-k ids (L1Args::topk_idx; nullptr: read from row_offsets):
  // where the previous kernel itself writes row_offsets (the layer's decode front), a schedule
  // built before the wait counts each local expert's rows from the caller's ids instead, which
  // the kernel two launches back has written: topk_slots = T*K ids, local experts
  // [topk_first_local, topk_first_local + num_experts); other ids (-1, invalid, other ranks')
  // have no row, as in the dispatch. Tiles with setmaxnreg (prefill) ignore it: they wait first.
  const int32_t* topk_idx = nullptr;
  int topk_slots = 0;
  int topk_first_local = 0;
  // Work units taken at run time (tiles without setmaxnreg or an asynchronous epilogue; others
  // ignore it): CTA b runs unit b first, then each CTA's producer takes the next unit from
  // unit_counter[0] (gridDim.x + atomicAdd) when it has issued its current unit's copies, and
  // hands it to the math warpgroup through the stage it fills first. unit_counter[1] counts the
  // CTAs that are done; the last one sets both back to zero. Zero-initialized once, left zero by
  // every launch; taken only after the grid's dependency wait, so launches of one stream may
  // share it (the previous one has completed). nullptr: the static split (CTA b: units b,
  // b + gridDim.x, ...).
  int32_t* unit_counter = nullptr;       // [2]
  // Launch gate (L1Args::rows_per_expert_max): where the host cannot tell which tile suits the
  // rows this launch will find (skewed routing; under expert parallelism a rank gets anywhere from
  // none to all T*K slots), it launches one tile per candidate and each runs only if the actual
  // rows per hit expert, read from row_offsets, lie in (gate_min_avg, gate_max_avg] (0: no limit
  // on that side). One that does not run waits for the previous kernel and exits, so the
  // stream's order still holds. Both 0: no gate.
  int gate_min_avg = 0;
  int gate_max_avg = 0;
  // Every scale byte of sf is < 128 (weight scales <= 2^0; L1Args::small_scales). The overlapped
  // tiles' one-multiply conversion is exact only then: the launcher refuses them otherwise
  // (the policy runs the serial tiles). The kernels do not read it.
  int small_scales = 0;
};

// The MegaMoE kernel's ABI (kernels/sm90/sm90_mega_moe.cuh): both GEMMs of a call in one launch.
// The gather inside the MegaMoE kernel (expert parallelism; x_q != nullptr): gather units ahead of
// L1's units write each slot's B rows from the received token rows (x_q / x_sf: the window's
// recv_xq / recv_sf, token row row_slot[r] / top_k), each row once its arrival word says it is
// there (ep::RowArrival; the call number read from the window's state), as launch_gather (exact
// mode: BF16 act) or launch_rebase_rows_e4m3 (FP8 mode: act_fp8, act_factor) would; the slot's L1
// tiles wait for its gather units.
struct MegaGather {
  const uint8_t* x_q = nullptr;     // [R * T_max][H] E4M3
  const uint8_t* x_sf = nullptr;    // [R * T_max][H / 32] UE8M0
  const int32_t* row_slot = nullptr;
  uint16_t* act = nullptr;          // exact mode: L1's BF16 rows (what tmap_act reads)
  uint8_t* act_fp8 = nullptr;       // FP8 mode: L1's E4M3 rows and row factors
  float* act_factor = nullptr;
  ep::RowArrival arrival;
  int32_t top_k = 0;
};

// The combine inside the MegaMoE kernel (counters != nullptr): the last unit of every CTA, which
// first orders the CTA's L2 rows (a fence: at system scope under expert parallelism, where they
// went to other ranks' combine slots) and counts the CTA out; the last one out sets the count
// back to zero and publishes: on one GPU a new generation of `counters[1]`, under expert
// parallelism this rank's return_sig on every rank (ep_return's protocol). Then y is the combine
// launch's sum over `rows` (one GPU: L2's out; under expert parallelism this rank's combine
// slots, which every rank's L2 writes), by every CTA (all_ctas: the grid alone on its GPU) or by
// the last one out alone (several ranks on one GPU: the others exit, so a rank waiting for the
// others holds one CTA's resources), once the last CTA's generation (one GPU) or every rank's
// return_sig (and this rank's own rows_sig: its send has ended) is in.
struct MegaCombine {
  const uint16_t* rows = nullptr;        // [.., H] bf16
  const int32_t* slot_to_row = nullptr;  // [T * K]: the row of slot t*K + k in `rows`, or -1
  uint16_t* y = nullptr;                 // [T, H] bf16
  int32_t num_tokens = 0;
  int32_t top_k = 0;
  int32_t all_ctas = 0;
  uint32_t* counters = nullptr;          // [2]: CTAs out (zero, left zero), generation
  int32_t expert_parallel = 0;           // 1: under expert parallelism (ep)
  ep::EpParams ep;
};

struct MegaParams {
  GemmParams l1;                 // as launch_l1 runs it (no gate); l1.unit_counter: the units
                                 // taken at run time (required); l1.k_splits: K parts of each L1
                                 // tile (split tiles), l1.split_*: the fused kernel's split-K
                                 // workspace, for both GEMMs' parts (L1's tiles first)
  GemmParams l2;                 // as launch_l2; the same num_experts, max_rows, row_offsets;
                                 // l2.k_splits: K parts of each L2 tile
  int32_t* ready = nullptr;      // [ready_capacity]: finished L1 tiles per slot; zero, left zero
  int32_t* consumed = nullptr;   // [ready_capacity]: L2 tiles past their wait per slot; the same
  int ready_capacity = 0;        // >= max_schedule_slots(max_rows, E_l, BLOCK_N)
  // Under expert parallelism l2.out_rows points each row at its source rank's combine slot.
  // FP8 mode (the E4M3 tiles): L2's B rows and row factors (l2.b_row_factor == h_factor), which
  // the kernel's rebase units write from l1.h_q / l1.h_sf as launch_rebase_rows_e4m3 would.
  uint8_t* h_fp8 = nullptr;      // [max_rows + kRowSlack, I]
  float* h_factor = nullptr;     // [max_rows + kRowSlack]
  MegaGather gather;             // under expert parallelism: L1's rows gathered inside the launch
  MegaCombine combine;           // y summed inside the launch (optional)
};

// The launch gate's test: `rows` routed rows over `hits` experts lie in (p.gate_min_avg,
// p.gate_max_avg] rows per expert (0: no limit on that side; no rows pass as 0 per expert). The
// kernel applies it (gate_passes); the launcher's plan (sm90::plan_launches) is tested against it.
MEGAMOE_HD bool gate_admits(const GemmParams& p, int64_t rows, int hits) {
  return (p.gate_min_avg == 0 || rows > static_cast<int64_t>(p.gate_min_avg) * hits) &&
         (p.gate_max_avg == 0 || rows <= static_cast<int64_t>(p.gate_max_avg) * hits);
}

// The compile-time constants of one shipped tile (sm90_tiles.hpp), and the shared-memory layout
// used by both the launcher (sizing) and the kernel (offsets). The CTA has kNumMathWG consumer
// warpgroups (each kMBlocksPerWG 64-row weight blocks x up to kBlockN token rows) and a producer
// (one warp, or a whole warpgroup where setmaxnreg moves registers to the math warpgroups).
template <TileId kId>
struct GemmConfig {
  static constexpr TileId kTileId = kId;
  static constexpr TileConfig kTile = tile_config(kId);

  static constexpr bool kOverlapConvert = kTile.mainloop == MainloopKind::kOverlap;
  static constexpr bool kFp8 = kTile.fp8();
  static constexpr bool kWarpMma = kTile.mma == MmaKind::kWarp;
  static constexpr bool kAsyncEpilogue = kTile.epilogue == EpilogueKind::kAsync;
  static constexpr bool kStagedEpilogue = kTile.epilogue != EpilogueKind::kRegisters;
  static constexpr int kEpilogueWG = kTile.epilogue_warpgroups;
  // A stage of S k-blocks takes one bulk copy of S x 2 KiB per weight block (an m-block's
  // consecutive k-blocks are contiguous in the sm90 layout), one of S x 128 B per scale block
  // and S boxes of B rows, and one full/empty barrier round trip.
  static constexpr int kKBlocksPerStage = kTile.k_blocks_per_stage;
  static constexpr int kNumMathWG = kTile.math_warpgroups;
  static constexpr int kMBlocksPerWG = kTile.m_blocks_per_warpgroup;
  static constexpr int kMBlocksPerCta = kNumMathWG * kMBlocksPerWG;
  static constexpr int kBlockM = sm90_layout::kBlockRows * kMBlocksPerCta;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNStep = kTile.n_step;
  static constexpr int kNumStages = kTile.stages;
  static constexpr int kMinBlocksPerSM = kTile.ctas_per_sm;
  static constexpr int kBlockK = sm90_layout::kBlockK;
  static constexpr int kWarpgroupThreads = 128;

  // NOTES: setmaxnreg only takes effect with a register cap at entry (1 block per SM); the
  // producer needs few registers, the math warpgroups hold kMBlocksPerWG x kBlockN/2 fp32
  // accumulators plus the converted A fragments. setmaxnreg works per warpgroup, so with it the
  // producer is a whole warpgroup; without it (decode: several CTAs per SM) one warp.
  // kAsyncEpilogue: the producer warpgroup's warps 1..3 run the epilogue and keep more
  // registers. The pool is the launch allocation (the math warpgroups can only grow by what the
  // producer warpgroup gives back), and kMathRegs is all of it: with 384 threads at 168
  // registers, 168 + 128 x (168 - 88) / (2 x 128) = 208 (232 with a 40-register producer). With
  // a second epilogue warpgroup (7 epilogue warps, 512 threads at 128): 128 + 2 x 128 x
  // (128 - 88) / (2 x 128) = 168.
  static constexpr bool kUseSetMaxNReg = kMinBlocksPerSM == 1 && kNumMathWG >= 2;
  static constexpr int kProducerThreads = kUseSetMaxNReg ? kWarpgroupThreads * kEpilogueWG : 32;
  static constexpr int kThreads = kWarpgroupThreads * kNumMathWG + kProducerThreads;
  static constexpr int kEpilogueThreads = kAsyncEpilogue ? kProducerThreads - 32 : 0;
  // Named barriers of the asynchronous epilogue, per math warpgroup w: kBarStaged + 2w (the
  // warpgroup's tile is in shared memory) and kBarStageFree + 2w (the epilogue warps have read it),
  // after 1 + w, the staged epilogue's own warpgroup barriers.
  static constexpr int kBarStaged = 1 + kNumMathWG;
  static constexpr int kBarStageFree = kBarStaged + 1;
  static constexpr int kStageSyncThreads = kWarpgroupThreads + kEpilogueThreads;
  static constexpr int kProducerRegs = kAsyncEpilogue ? 88 : 40;
  // The launch allocation per thread (65536 registers over the CTA, in units of 8).
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  // What the math warpgroups take (setmaxnreg configs): the launch allocation plus their share
  // of what the producer warpgroup(s) give back, in units of 8.
  static constexpr int kMathRegs =
      (kLaunchRegs + kEpilogueWG * (kLaunchRegs - kProducerRegs) / kNumMathWG) / 8 * 8;

  // Shared memory per stage: B as boxes of [BLOCK_N rows][128 bytes] (128B-swizzled,
  // kSmemBBoxBytes each): one box of 64 BF16 per k-block, or of 128 E4M3 per two k-blocks (FP8
  // mode); A and SF per weight block m, k-block j of the stage at (m * kKBlocksPerStage + j) x
  // the block size (the order of the global layout).
  static constexpr int kBoxK = kFp8 ? 2 * kBlockK : kBlockK;  // elements of K per box row
  static constexpr int kBoxesPerStage = kFp8 ? kKBlocksPerStage / 2 : kKBlocksPerStage;
  static constexpr int kSmemBBoxBytes = kBlockN * 128;
  static constexpr int kSmemBBytes = kSmemBBoxBytes * kBoxesPerStage;
  static constexpr int kSmemABytes = kMBlocksPerCta * sm90_layout::kBlockBytes * kKBlocksPerStage;
  static constexpr int kSmemSfBytes = kMBlocksPerCta * sm90_layout::kSfBlockBytes * kKBlocksPerStage;

  // Layout (offsets from a 1024-byte aligned base): B stages, A stages, SF stages, full/empty
  // barriers, epilogue amax exchange, staging, schedule (row offsets + tile prefix, E_l + 1 each).
  static constexpr size_t kOffB = 0;
  static constexpr size_t kOffA = kOffB + static_cast<size_t>(kNumStages) * kSmemBBytes;
  static constexpr size_t kOffSf = kOffA + static_cast<size_t>(kNumStages) * kSmemABytes;
  static constexpr size_t kOffBars = kOffSf + static_cast<size_t>(kNumStages) * kSmemSfBytes;
  static constexpr size_t kOffAmax = kOffBars + 2 * kNumStages * sizeof(uint64_t);
  static constexpr size_t kAmaxBytes = static_cast<size_t>(kNumMathWG) * 4 * kBlockN * sizeof(float);
  // Staged epilogue: per math warpgroup one 64-row block as [BLOCK_N][kStagePitch] BF16.
  // NOTES: pitch 72 (not 64): the fragment writes (lanes g -> consecutive rows, t -> columns two
  // apart, 144 words) spread over 16 banks without conflicts, and 144-byte rows keep the
  // 16-byte reads aligned.
  static constexpr int kStagePitch = 72;
  static constexpr size_t kOffStage = kOffAmax + kAmaxBytes;
  // Asynchronous epilogue: every weight block of the tile has its own staging area (L1: g/u, L2:
  // the output values), [math warpgroup][block][BLOCK_N][kStagePitch] BF16.
  static constexpr size_t kStageBlocks = kAsyncEpilogue ? kNumMathWG * kMBlocksPerWG : kNumMathWG;
  static constexpr size_t kStageBytes =
      kStagedEpilogue ? kStageBlocks * kBlockN * kStagePitch * sizeof(uint16_t) : 0;
  static constexpr size_t kOffSchedule = kOffStage + kStageBytes;
  static constexpr size_t kAlignSlack = 1024;  // the dynamic smem base is re-aligned to 1024
  // Split-K: only tiles where one warpgroup owns the whole tile (its accumulators are the tile's
  // partial sums) and no other warps finish it; a separate tile, so that the kernels of unsplit
  // launches carry none of its code.
  static constexpr bool kSupportsSplitK = kTile.split_k;
  // FP32 partials of one work unit: the warpgroup's accumulators, [block][BLOCK_N / 2][thread].
  static constexpr int kSplitUnitFloats = kTile.split_unit_floats();

  static constexpr size_t smem_bytes(int num_experts) {
    return kAlignSlack + kOffSchedule + 2 * sizeof(int32_t) * static_cast<size_t>(num_experts + 1);
  }

  static_assert(kBlockN % 8 == 0 && kBlockN <= 256, "wgmma N is a multiple of 8, at most 256");
  static_assert(!kFp8 || (kKBlocksPerStage % 2 == 0 && kOverlapConvert && !kWarpMma &&
                          !kTile.split_k),
                "FP8 tiles: overlapped wgmma tiles, two k-blocks per TMA box, unsplit");
  static_assert(kBlockN % kNStep == 0 && kNStep % 8 == 0, "N steps must tile BLOCK_N");
  static_assert(kSmemBBytes % 1024 == 0, "each B stage must stay 1024-aligned (128B swizzle)");
  static_assert(kOffStage % 16 == 0, "staging rows are read 16 bytes at a time");
  static_assert(kOffA % 1024 == 0 && kOffSf % 16 == 0 && kOffBars % 8 == 0,
                "bulk copy destinations 16-aligned, barriers 8-aligned");
  static_assert(!kAsyncEpilogue || kBarStageFree + 2 * (kNumMathWG - 1) <= 15,
                "named barriers 1..kNumMathWG, then two per math warpgroup");
  static_assert(!kUseSetMaxNReg || kNumMathWG * (kMathRegs - kLaunchRegs) <=
                                       kEpilogueWG * (kLaunchRegs - kProducerRegs),
                "setmaxnreg: the math warpgroups can only take what the producer warpgroup gives "
                "back (a larger request never completes)");
  static_assert(kNumMathWG * 4 <= 15, "named barriers 1..kNumMathWG");
  static_assert(kKBlocksPerStage >= 1 && (kKBlocksPerStage == 1 || kOverlapConvert),
                "several k-blocks per stage: overlapped mainloop only");
  static_assert(!kWarpMma || (kOverlapConvert && !kAsyncEpilogue),
                "warp-level MMAs: the overlapped conversion, no asynchronous epilogue");
  static_assert(kEpilogueWG == 1 || (kEpilogueWG == 2 && kAsyncEpilogue),
                "a second epilogue warpgroup: asynchronous epilogue only");
  static_assert(!kSupportsSplitK || (kNumMathWG == 1 && !kAsyncEpilogue),
                "split-K: one math warpgroup owns the tile");
  static_assert(!kAsyncEpilogue || (kStagedEpilogue && kOverlapConvert && kMinBlocksPerSM == 1 &&
                                    kNumMathWG == 2),
                "the asynchronous epilogue: staged, overlapped, one CTA per SM, two math warpgroups");
};

}  // namespace megamoe::sm90
