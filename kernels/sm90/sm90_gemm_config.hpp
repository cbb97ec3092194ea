// sm90_gemm_config.hpp: tile configurations of the Hopper grouped GEMMs, the kernel parameter
// struct (the kernel ABI), and the shared-memory layout used by both the launcher (sizing) and
// the kernel (offsets). Host + device.
#pragma once

#include <cstddef>
#include <cstdint>

#include "layout/sm90_weight_layout.hpp"
#include "megamoe/activation.hpp"

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
  // Split-K (one-math-warpgroup configs only; GemmConfig::kSupportsSplitK): each tile's K loop
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
  // of the stream (configs without setmaxnreg; the others wait first). 0: wait first (also
  // correct in a plainly launched grid, where the wait is a no-op).
  int prefetch_before_wait = 0;
  // Work units taken at run time (configs without setmaxnreg or an asynchronous epilogue; others
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
  // none to all T*K slots), it launches one config per candidate and each runs only if the actual
  // rows per hit expert, read from row_offsets, lie in (gate_min_avg, gate_max_avg] (0: no limit
  // on that side). One that does not run waits for the previous kernel and exits, so the
  // stream's order still holds. Both 0: no gate.
  int gate_min_avg = 0;
  int gate_max_avg = 0;
  // Every scale byte of sf is < 128 (weight scales <= 2^0; L1Args::small_scales). The overlapped
  // configs' one-multiply conversion is exact only then: the launcher refuses them otherwise
  // (kAuto runs the serial configs). The kernels do not read it.
  int small_scales = 0;
};

// The launch gate's test: `rows` routed rows over `hits` experts lie in (p.gate_min_avg,
// p.gate_max_avg] rows per expert (0: no limit on that side; no rows pass as 0 per expert). The
// kernel applies it (gate_passes); the launcher's plan (sm90::plan_launches) is tested against it.
MEGAMOE_HD bool gate_admits(const GemmParams& p, int64_t rows, int hits) {
  return (p.gate_min_avg == 0 || rows > static_cast<int64_t>(p.gate_min_avg) * hits) &&
         (p.gate_max_avg == 0 || rows <= static_cast<int64_t>(p.gate_max_avg) * hits);
}

// One tile configuration. The CTA has kNumMathWG consumer warpgroups (each kMBlocksPerWG
// 64-row weight blocks x up to kBlockN token rows) and one producer warpgroup whose first thread
// issues the copies.
// kOverlapConvert selects the mainloop (sm90_gemm_mainloop.cuh): false = serial per stage (the
// validated default), true = the next block's conversion overlaps the current wgmmas, with the
// one-multiply conversion when the scales allow (opt-in until measured on an H200).
// kStagedEpilogue: the accumulators of one 64-row block go through shared memory (BF16x2 packing,
// stmatrix) and a rolled loop does the L1 activation and requantization with 8/16-byte stores,
// or the L2 output rows with 16-byte stores (sm90_gemm_epilogue.cuh, epilogue_l*_staged).
// kKBlocksPerStage: 64-deep k-blocks per pipeline stage (overlapped mainloop only). A stage of
// S k-blocks takes one bulk copy of S x 2 KiB per weight block (an m-block's consecutive k-blocks
// are contiguous in the sm90 layout), one of S x 128 B per scale block and S boxes of B rows, and
// one full/empty barrier round trip, where S stages of one k-block take S of each: fewer
// producer instructions and barrier operations per weight byte. K must be a multiple of S x 64
// (the launcher falls back to the one-k-block twin otherwise).
template <int kNumMathWG_, int kMBlocksPerWG_, int kBlockN_, int kNStep_, int kNumStages_,
          int kMinBlocksPerSM_, bool kOverlapConvert_ = false, bool kStagedEpilogue_ = false,
          int kKBlocksPerStage_ = 1, bool kAsyncEpilogue_ = false, bool kSplitK_ = false,
          int kEpilogueWG_ = 1, bool kWarpMma_ = false>
struct GemmConfig {
  static constexpr bool kOverlapConvert = kOverlapConvert_;
  // kWarpMma: the overlapped configs' conversion feeding warp-level MMAs (mma.sync m16n8k16, B
  // fragments by ldmatrix) instead of wgmma: every warp runs its own 16 rows, with no warpgroup
  // fence, descriptor or wait_group per weight block (Mainloop::run_warp).
  static constexpr bool kWarpMma = kWarpMma_;
  static constexpr bool kAsyncEpilogue = kAsyncEpilogue_;
  // Warpgroups beside the math ones (setmaxnreg configs): the producer's, and with
  // kEpilogueWG = 2 a second one whose four warps also run the asynchronous epilogue.
  static constexpr int kEpilogueWG = kEpilogueWG_;
  static constexpr int kKBlocksPerStage = kKBlocksPerStage_;
  static constexpr bool kStagedEpilogue = kStagedEpilogue_;
  static constexpr int kNumMathWG = kNumMathWG_;
  static constexpr int kMBlocksPerWG = kMBlocksPerWG_;
  static constexpr int kMBlocksPerCta = kNumMathWG * kMBlocksPerWG;
  static constexpr int kBlockM = sm90_layout::kBlockRows * kMBlocksPerCta;
  static constexpr int kBlockN = kBlockN_;    // token rows per tile (TMA box rows)
  static constexpr int kNStep = kNStep_;      // granularity of the per-tile wgmma N
  static constexpr int kNumStages = kNumStages_;
  static constexpr int kMinBlocksPerSM = kMinBlocksPerSM_;
  static constexpr int kBlockK = sm90_layout::kBlockK;
  static constexpr int kWarpgroupThreads = 128;

  // NOTES: setmaxnreg only takes effect with a register cap at entry (1 block per SM); the
  // producer needs few registers, the math warpgroups hold kMBlocksPerWG x kBlockN/2 fp32
  // accumulators plus the converted A fragments. setmaxnreg works per warpgroup, so with it the
  // producer is a whole warpgroup; without it (decode: several CTAs per SM) one warp.
  // kAsyncEpilogue: the producer warpgroup's warps 1..3 run the epilogue (below) and keep more
  // registers. The pool is the launch allocation (168 x 384: the math warpgroups can only grow
  // by what the producer warpgroup gives back), and kMathRegs is all of it: 168 + 128 x
  // (168 - 88) / (2 x 128) = 208 (232 with a 40-register producer). With a second epilogue
  // warpgroup (kEpilogueWG = 2: 7 epilogue warps, 128 x 512 at launch): 128 + 2 x 128 x
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

  // Shared memory per stage: B as kKBlocksPerStage boxes of [BLOCK_N rows][64 bf16] (128B-swizzled,
  // kSmemBBoxBytes each); A and SF per weight block m, k-block j of the stage at
  // (m * kKBlocksPerStage + j) x the block size (the order of the global layout).
  static constexpr int kSmemBBoxBytes = kBlockN * kBlockK * 2;
  static constexpr int kSmemBBytes = kSmemBBoxBytes * kKBlocksPerStage;
  static constexpr int kSmemABytes = kMBlocksPerCta * sm90_layout::kBlockBytes * kKBlocksPerStage;
  static constexpr int kSmemSfBytes = kMBlocksPerCta * sm90_layout::kSfBlockBytes * kKBlocksPerStage;

  // Layout (offsets from a 1024-byte aligned base): B stages, A stages, SF stages, full/empty
  // barriers, epilogue amax exchange, schedule (row offsets + tile prefix, E_l + 1 each).
  static constexpr size_t kOffB = 0;
  static constexpr size_t kOffA = kOffB + static_cast<size_t>(kNumStages) * kSmemBBytes;
  static constexpr size_t kOffSf = kOffA + static_cast<size_t>(kNumStages) * kSmemABytes;
  static constexpr size_t kOffBars = kOffSf + static_cast<size_t>(kNumStages) * kSmemSfBytes;
  static constexpr size_t kOffAmax = kOffBars + 2 * kNumStages * sizeof(uint64_t);
  static constexpr size_t kAmaxBytes = static_cast<size_t>(kNumMathWG) * 4 * kBlockN * sizeof(float);
  // Staged L1 epilogue: per math warpgroup one 64-row block as [BLOCK_N][kStagePitch] BF16.
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
  // Split-K (kSplitK_): the kernel takes GemmParams::k_splits. Only configs where one warpgroup
  // owns the whole tile (its accumulators are the tile's partial sums) and no other warps finish
  // it. A separate config, so that the kernels of unsplit launches carry none of its code.
  static constexpr bool kSupportsSplitK = kSplitK_;
  // FP32 partials of one work unit: the warpgroup's accumulators, [block][BLOCK_N / 2][thread].
  static constexpr int kSplitUnitFloats = kMBlocksPerWG * (kBlockN / 2) * kWarpgroupThreads;

  static constexpr size_t smem_bytes(int num_experts) {
    return kAlignSlack + kOffSchedule + 2 * sizeof(int32_t) * static_cast<size_t>(num_experts + 1);
  }

  static_assert(kBlockN % 8 == 0 && kBlockN <= 256, "wgmma N is a multiple of 8, at most 256");
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
                "back (a larger request never completes: the first async version failed its "
                "launch)");
  static_assert(kNumMathWG * 4 <= 15, "named barriers 1..kNumMathWG");
  static_assert(kKBlocksPerStage >= 1 && (kKBlocksPerStage == 1 || kOverlapConvert),
                "several k-blocks per stage: overlapped mainloop only");
  static_assert(!kWarpMma || (kOverlapConvert && !kAsyncEpilogue),
                "warp-level MMAs: the overlapped conversion, no asynchronous epilogue");
  static_assert(kEpilogueWG == 1 || (kEpilogueWG == 2 && kAsyncEpilogue),
                "a second epilogue warpgroup: asynchronous epilogue only");
  static_assert(!kSplitK_ || (kNumMathWG == 1 && !kAsyncEpilogue),
                "split-K: one math warpgroup owns the tile");
  static_assert(!kAsyncEpilogue || (kStagedEpilogue && kOverlapConvert && kMinBlocksPerSM == 1 &&
                                    kNumMathWG == 2),
                "the asynchronous epilogue: staged, overlapped, one CTA per SM, two math warpgroups");
};

// The configurations that ship (one table; see the launcher for when each is used):
//   Decode : few rows per expert (T <= ~512 per rank). 1 math warpgroup + 1 producer warp,
//            64-row weight tiles, 8 (Decode8) or 16 token rows, 10 stages, 4 CTAs per SM: many
//            small tiles so the weight stream spreads over every SM, and 4 independent
//            convert -> wgmma -> wait chains per SM keep 4 x 10 x 2 KiB of weights in flight.
//            NOTES: the first version (2 CTAs/SM x 16 stages, a whole producer warpgroup)
//            streamed 1.3 TB/s: each CTA's chain is latency-bound (wait_group 0 per stage).
//   Prefill: many rows per expert. 2 math warpgroups x 2 weight blocks (BLOCK_M 256) x up to
//            128 token rows, per-tile N rounded to 16; 7 stages of 24.5 KiB.
// NOTES (rejected): BLOCK_M 128 x BLOCK_N 256 for prefill: at T = 4096 Kimi-K3 averages 73 rows
// per expert, so a 256-row tile is mostly padding while the B tile is re-read by twice as many
// weight tiles; 256 x 128 halves that L2 traffic. 3 CTAs/SM for decode costs stages (smem).
using Decode8Config = GemmConfig<1, 1, 8, 8, 10, 4>;
using DecodeConfig = GemmConfig<1, 1, 16, 8, 10, 4>;
using PrefillConfig = GemmConfig<2, 2, 128, 16, 7, 1>;

// Opt-in configurations (GemmTile::k*Overlap, or MEGAMOE_SM90_GEMM_OVERLAP=1 for kAuto; see
// src/moe/sm90_gemm.cu): the same tiles with the overlapped mainloop, plus
//   PrefillWide: 2 math warpgroups x 1 weight block (BLOCK_M 128) x up to 192 token rows, 7
//            stages of 28.25 KiB: experts with 129..~190 rows (Kimi-K3 at T = 8192 averages 146)
//            run as one n-tile instead of 128 + a small remainder tile, which costs a whole
//            K loop of conversions for a few rows.
//            NOTES: 192 rather than 256 rows: uniform routing at 146 average rows stays under
//            ~190, and 7 stages fit in shared memory where 256 rows leave 5.
using DecodeOverlapConfig = GemmConfig<1, 1, 16, 8, 10, 4, true>;
using PrefillOverlapConfig = GemmConfig<2, 2, 128, 16, 7, 1, true>;
using PrefillWideOverlapConfig = GemmConfig<2, 1, 192, 16, 7, 1, true>;
//   PrefillStaged / PrefillWideStaged: the Prefill / PrefillWide tiles with the overlapped
//            mainloop and the staged L1 epilogue (36 / 54 KiB of BF16 staging; 7 / 5 stages).
//            NOTES: the unrolled register epilogue of Prefill L1 is ~20K straight-line
//            instructions per tile, executed once (instruction-cache misses), and takes about
//            as long as the mainloop; the staged one is a short rolled loop.
using PrefillStagedConfig = GemmConfig<2, 2, 128, 16, 7, 1, true, true>;
using PrefillWideStagedConfig = GemmConfig<2, 1, 192, 16, 5, 1, true, true>;
//   Decode*X2: decode tiles of 128 weight rows (one math warpgroup, two 64-row blocks with their
//            own accumulators), 4 CTAs per SM. The serial mainloop issues the two blocks' wgmmas
//            interleaved (k16 step outer, block inner), so each stage has two independent
//            accumulator chains where the 64-row tiles have one, and twice the weight bytes per
//            barrier round trip; the B (token) bytes per weight byte halve.
//            NOTES: why: a decode stage of the 64-row tiles takes ~1200 cycles per CTA (1.5-1.8
//            TB/s over 4 CTAs x 2 KiB stages per SM), about four dependent m64n16k16 wgmmas plus
//            the barrier round trip, not the conversion (overlapping it gained 6-10 %).
//            7 / 8 stages keep 4 CTAs within the SM's shared memory at E_l = 896.
using Decode16X2Config = GemmConfig<1, 2, 16, 8, 7, 4>;
using Decode8X2Config = GemmConfig<1, 2, 8, 8, 8, 4>;
using Decode16X2OverlapConfig = GemmConfig<1, 2, 16, 8, 7, 4, true>;
//   Decode16X4Overlap: four chains per stage (256 rows, 4 stages fit; ptxas spills 12-20 bytes),
//            chosen at <= 4 average rows when its tiles fill the grid (1.05-1.08x over X2 at
//            T = 8, 64). Decode16X2Overlap3 (candidate, no policy picks it): two chains, 3 CTAs
//            per SM, 10 stages; best only at Kimi-K3 T = 1 L1 (111 against 120 us).
using Decode16X4OverlapConfig = GemmConfig<1, 4, 16, 8, 4, 4, true>;
using Decode16X2Overlap3Config = GemmConfig<1, 2, 16, 8, 10, 3, true>;
//   Decode16X2K2 / Decode16X4K2: the two- and four-chain decode tiles with two k-blocks per stage
//            (3 and 2 stages: the same weight bytes in flight as 7 and 4 one-k-block stages,
//            within the shared memory of 4 CTAs at E_l = 896).
//            NOTES: why: Nsight Compute on Decode16X2Overlap (Kimi-K3 T = 1, revision bd2184b,
//            bench/results/ncu_*_bd2184b): per k-block a math warp executes 278 instructions, of
//            which ~160 convert and scale; the single-thread producer executes 142 per stage
//            (each bulk copy ~20: the copy operands are made warp-uniform in a loop), all on one
//            scheduler; stalls: fixed-latency waits 22 %, issue (selected + not selected) 36 %.
using Decode16X2K2Config = GemmConfig<1, 2, 16, 8, 3, 4, true, false, 2>;
//   Decode16X2K2x3: the same tile with 3 CTAs per SM and 5 stages, for launches whose tile count
//            fills the 3-CTA grid in clearly fewer, fuller waves (Kimi-K3 L1 at T = 1: 768 tiles
//            are 1.45 waves of 528 slots but 1.94 of 396).
using Decode16X2K2x3Config = GemmConfig<1, 2, 16, 8, 5, 3, true, false, 2>;
using Decode16X4K2Config = GemmConfig<1, 4, 16, 8, 2, 4, true, false, 2>;
//   Decode8X2K2 / its twin: Decode16X2K2 with 8 token rows, which at T <= 8 hold every
//            expert's rows (at most T); the B stage halves (2 KiB), so 4 stages fit 4 CTAs per SM
//            at E_l = 896 where the 16-row tile has 3. kAuto's decode tile at <= 4 rows per
//            expert when the launch takes its units at run time (tuning log v10) until v16,
//            which runs it on warp-level MMAs (Decode8X2K2Warp below).
//            NOTES: a 64-row version (Decode8X1K2, two k-blocks per stage, 6 stages: twice the
//            units, so the CTAs even out better at T = 1) was 1.08-1.20x slower at T = 1 and 8
//            (H200, dddf285, tuning log v10) and was removed.
//            NOTES: why: the copy pipeline alone streams only 0.55-0.75 of the copy ceiling at
//            T = 1 (tuning log v8): one wave of tiles, each CTA with 2 stages in flight.
//            (v8 measured the GEMM kernel with its math removed, of 2026-11-30. A launch of the
//            copy pipeline alone, in this tile's units, stages and CTAs per SM, reads the T = 1
//            bytes at 0.83-0.95 of the copy ceiling, 0.95-1.01 with programmatic launches:
//            Sm90ReadCeilingBench, tuning log v14. What holds T = 1 is the math warps.)
//            NOTES (rejected, v14): the same tile with both weight blocks' wgmmas of a k-block
//            issued together and one wait_group per k-block (two register sets of both blocks'
//            fragments: 98 / 109 registers, so 3 CTAs per SM with 6 stages; at 4 per SM ptxas
//            serialized the wgmmas, C7512) was slower in 22 of 24 pairs at T = 1, 8 and 64
//            (0.98-1.20x; H200, 4bc0de5): the wait per weight block is not what bounds the
//            math warps.
//            NOTES (rejected, v14): the tile on two math warpgroups of one 64-row block each (288
//            threads, 4 CTAs per SM, at most 56 registers: the overlapped mainloop spilled and
//            serialized its wgmmas, so the serial one with the one-multiply conversion, 50
//            registers) was 1.2-1.5x slower than this one at T = 1, 8 and 64 (H200, 69080eb):
//            twice the warps per unit do not convert faster.
//            NOTES (rejected, v15): the same tile with two units' wgmmas in flight (three register
//            sets, wait_group 1 per unit, wait_group 0 every three stages; at 4 CTAs per SM ptxas
//            serialized the wgmmas, C7512, so 3 per SM and 6 stages, 118 / 126 registers) passed
//            the opt-in GPU tests and was slower at T = 1 (Kimi-K3 L2 40.5 against 36.5 us,
//            DeepSeek-V3 L2 28.6 against 25.9) and T = 64 (1.01-1.05x), within the noise at T = 8
//            (H200, 9bfdbf6): a quarter fewer CTAs per SM costs more than the second unit in
//            flight gains.
using Decode8X2K2Config = GemmConfig<1, 2, 8, 8, 4, 4, true, false, 2>;
using Decode8X2OverlapConfig = GemmConfig<1, 2, 8, 8, 8, 4, true>;
//   Decode16X2K2Split / its twin: Decode16X2K2 (Decode16X2Overlap) taking k_splits: kAuto's tile
//            for decode launches whose tiles leave at least half the CTA slots idle.
//   Decode8X2K2Warp / Decode16X2K2Warp / Decode16X2K2SplitWarp (tiles 46 / 47 / 48, with their
//            one-k-block twins): Decode8X2K2 / Decode16X2K2 / Decode16X2K2Split on warp-level
//            MMAs (GemmConfig::kWarpMma), kAuto's decode tiles since tuning log v16.
using Decode8X2K2WarpConfig = GemmConfig<1, 2, 8, 8, 4, 4, true, false, 2, false, false, 1, true>;
using Decode8X2OverlapWarpConfig = GemmConfig<1, 2, 8, 8, 8, 4, true, false, 1, false, false, 1, true>;
using Decode16X2K2WarpConfig = GemmConfig<1, 2, 16, 8, 3, 4, true, false, 2, false, false, 1, true>;
using Decode16X2OverlapWarpConfig = GemmConfig<1, 2, 16, 8, 7, 4, true, false, 1, false, false, 1, true>;
using Decode16X2K2SplitConfig = GemmConfig<1, 2, 16, 8, 3, 4, true, false, 2, false, true>;
using Decode16X2OverlapSplitConfig = GemmConfig<1, 2, 16, 8, 7, 4, true, false, 1, false, true>;
//   Decode8X4KWarp (tile 53): Decode8X2K2Warp with four k-blocks per stage and 2 stages (the
//            same bytes in flight, half the barrier round trips; K % 256 == 0): kAuto's 128 x 8
//            tile where K allows (1.03-1.08x over Decode8X2K2Warp at most points, tuning log v16).
//            The 16-row tiles cannot follow: two 4-k-block stages of theirs do not fit 4 CTAs
//            per SM at E_l = 896.
using Decode8X4KWarpConfig = GemmConfig<1, 2, 8, 8, 2, 4, true, false, 4, false, false, 1, true>;
using Decode16X2K2SplitWarpConfig = GemmConfig<1, 2, 16, 8, 3, 4, true, false, 2, false, true, 1, true>;
using Decode16X2OverlapSplitWarpConfig = GemmConfig<1, 2, 16, 8, 7, 4, true, false, 1, false, true, 1, true>;
//   PrefillK2: the staged 256 x 128 prefill tile with two k-blocks per stage (3 stages of 49 KiB):
//            kAuto's prefill tile for L1 and L2 outside the PrefillWide range.
//            NOTES: why: Nsight Compute (Kimi-K3 T = 4096, revision 8708cfb,
//            bench/results/ncu_*_8708cfb*): the math warps' biggest single stall was the wait on
//            the full barrier (data not yet landed) and the producer executed 12 % of all
//            instructions; one barrier round trip and one copy per weight block for two k-blocks
//            measured 1.08-1.32x over PrefillStaged (H200, 8708cfb). A chained mainloop (one register set per weight
//            block, wait_group 1 between blocks, one drain per stage) measured the same as the
//            one-drain-per-block loop and was removed: the drains are not the limit.
using PrefillK2Config = GemmConfig<2, 2, 128, 16, 3, 1, true, true, 2>;
//   Prefill*Async (kAsyncEpilogue): the math warpgroups stage each tile's results in shared memory
//            and go on with the next tile; the producer warpgroup's warps 1..3 finish them (L1:
//            activation and requantization, L2: 16-byte row stores). PrefillWideAsync is kAuto's
//            tile in the PrefillWide range, L1 and L2 (1.02-1.09x over PrefillWideStaged since
//            22bacc4; src/moe/sm90_gemm.cu); PrefillAsyncK2 is a candidate (best only at Kimi-K3
//            T = 4096 L1, 1.03x over PrefillK2).
//            NOTES: why: at Kimi-K3 T = 4096 the L1 epilogue took 29 % of the math warps' time
//            (ncu, 8708cfb) while the tensor cores idled. The 256 x 128 async tile with one
//            k-block per stage (5 stages) lost to PrefillK2: removed.
//            Stages: PrefillAsyncK2 keeps the whole tile's staging (72 KiB), so 2 stages fit.
using PrefillAsyncK2Config = GemmConfig<2, 2, 128, 16, 2, 1, true, true, 2, true>;
using PrefillAsyncK2TwinConfig = GemmConfig<2, 2, 128, 16, 5, 1, true, true, 1, true>;
//            PrefillWideAsync runs the wgmma N in steps of 8 token rows (since v17; 16 before):
//            1.01-1.02x at DeepSeek-V3 T = 4096 (128 rows per expert) and Kimi-K3 T = 8192 (146),
//            both orders (H200, c18793d, bench/results/gemm_tiles_c18793d_*.txt, tile 59 there).
using PrefillWideAsyncConfig = GemmConfig<2, 1, 192, 8, 5, 1, true, true, 1, true>;
//   PrefillAsyncK2N96 / PrefillAsyncK2N64: PrefillAsyncK2 with at most 96 / 64 token rows per
//            tile, kAuto's tiles for experts averaging 41-80 (since v13 as PrefillAsyncK2N96E2,
//            below) / 13-40 rows when K is a multiple of 128 (no one-k-block twin; the
//            launcher's check). In that range PrefillK2 runs wgmma N <= 96 anyway; the smaller
//            B stage leaves room for the asynchronous epilogue's staging with 3 / 5 stages,
//            where the 128-row version keeps 2.
//            NOTES: the non-asynchronous 256 x 96 tile with 4 stages (tile 33) was no faster than
//            PrefillK2 (Kimi-K3 T = 4096 L1 8429 against 8305 us; H200, 3f7d1ed): removed. The
//            asynchronous epilogue, not the stage count, is the gain.
//            NOTES (rejected): three math warpgroups of one weight block each with the
//            asynchronous epilogue (192 x 96, 4 stages, and 192 x 128, 3 stages; 136 registers
//            per math thread, ~104 used), to put three math warps on each scheduler where the
//            256 x 96 tile's two issue 0.37 instructions per cycle: Kimi-K3 T = 4096 L1 the same
//            as the 256 x 96 tile (7942 / 7814 against 7900 / 7987 us), L2 1.05x slower, DeepSeek-V3
//            T = 4096 1.13x (128 rows: 1.13x slower than kAuto's 128 x 192 tile), T = 2048
//            1.03-1.04x slower (H200, 550f76a, bench/results/gemm_bench_550f76a*.txt). More
//            warps per scheduler do not raise the issue rate: the math warps are not short of
//            latency hiding alone.
using PrefillAsyncK2N96Config = GemmConfig<2, 2, 96, 16, 3, 1, true, true, 2, true>;
using PrefillAsyncK2N64Config = GemmConfig<2, 2, 64, 16, 5, 1, true, true, 2, true>;
//   PrefillAsyncK2N96E2: PrefillAsyncK2N96 with a second epilogue warpgroup (7 epilogue warps
//            instead of 3, one or two on every scheduler; math warps at 168 registers, ~152
//            used): kAuto's tile at 41-80 rows per expert (src/moe/sm90_gemm.cu), 1.05-1.06x
//            over PrefillAsyncK2N96 at Kimi-K3 T = 4096 (H200, a275c59). ptxas: 8 bytes of spill
//            in L2, outside the K loop (a word kept across setmaxnreg, and one in the bias path
//            of the staging).
//            NOTES: why: with the epilogue warps skipping their work (-DMEGAMOE_DIAG_EPILOGUE_FREE=1)
//            Kimi-K3 T = 4096 L1 ran 1.15-1.17x faster on tile 34, T = 8192 1.06-1.10x on tile 28,
//            L2 and DeepSeek-V3 1.00-1.04x (H200, e821cc9, bench/results/gemm_bench_e821cc9_diag*):
//            SiTU's two accurate tanh per element on three warps bound the L1 tile.
//            NOTES (rejected): PrefillWideAsync with the second epilogue warpgroup (24 bytes of
//            spill in L2): 0.99-1.02x where kAuto takes PrefillWideAsync (Kimi-K3 T = 8192,
//            DeepSeek-V3 T = 4096; a275c59), whose longer K loop per tile leaves the three
//            epilogue warps enough time.
//            NOTES (rejected): a fourth stage does not fit (235592 bytes at 1024 experts, the
//            device allows 232448). PrefillWideAsync with two k-blocks per stage (2 stages fit):
//            0.93x at DeepSeek-V3 T = 4096 L1, 0.94x L2, 0.96x at Kimi-K3 T = 8192 L1. The 256 x 64
//            tile with the second epilogue warpgroup: 1.00-1.02x at its rows (13-40), L2 0.89x at
//            Kimi-K3 T = 2048 (H200, 0a483df, bench/results/gemm_bench_0a483df_*.txt).
//            N steps of 8 token rows (since v17; 16 before): Kimi-K3 T = 4096 averages 73 rows per
//            expert, where steps of 16 ran N = 80 for 65-80 rows; 1.02x at L1 and L2 in both
//            orders (H200, 4670141, bench/results/gemm_tiles_4670141_*.txt, tile 54 there).
//            NOTES (rejected): the four wgmmas of a unit issued back to back before the next
//            unit's conversion (a __syncwarp after the commit, which ptxas does not move shared
//            memory accesses across; without it ptxas spreads them over the conversion, gaps of
//            36, 31, 1 instructions): 0.95x here, 0.96-0.98x in PrefillK2, 0.99-1.01x in
//            PrefillWideAsync (same call, tiles 55, 57, 56 there).
using PrefillAsyncK2N96E2Config = GemmConfig<2, 2, 96, 8, 3, 1, true, true, 2, true, false, 2>;

}  // namespace megamoe::sm90
