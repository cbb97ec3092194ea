// sm90_gemm_mainloop.cuh: the math warpgroup's mainloop of the grouped BF16 x MXFP4 GEMM.
//
// Per 64-deep k-block (one per pipeline stage, or Cfg::kKBlocksPerStage of them): each thread
// loads its 16 bytes of packed E2M1 per 64-row weight block and one word of scales from shared
// memory, converts them to BF16 A fragments in registers (exact: E2M1 x 2^(s-127)), and issues
// 4 wgmma m64nNk16 per weight block with B (token rows) read from the TMA-written, 128B-swizzled
// stage.
// Three mainloops: the serial one (per stage wait, convert, wgmma, wait_group 0), the overlapped
// one (Cfg::kOverlapConvert; kAuto's prefill tiles: the next block's conversion runs while the
// current block's wgmmas are in flight, see run_overlapped), and the warp-level one
// (Cfg::kWarpMma; kAuto's decode tiles: the same conversion feeding mma.sync, see run_warp).
// NOTES: the serial chain is latency-bound (decode streamed well below the copy ceiling; a
// prefill stage took ~3x its tensor time). Double-buffering with wait_group 1 across stages was tried: ptxas could
// not prove the in-flight registers untouched and serialized every wgmma (C7513).
// NOTES: all kMBlocksPerWG blocks are computed even when the last m-tile is partial (the producer
// leaves stale bytes there and the epilogue skips them): a wgmma under a data-dependent branch
// makes ptxas serialize every wgmma of the kernel (C7520).
#pragma once

#include <cstdint>
#include <type_traits>

#include "layout/sm90_weight_layout.hpp"
#include "ptx/sm90_ptx.cuh"
#include "ptx/sm90_wgmma_bf16_rs.cuh"
#include "ptx/sm90_wgmma_e4m3_rs.cuh"
#include "sm90/sm90_diag.hpp"

namespace megamoe::sm90 {

__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t sf_word, int byte) {
  const uint32_t bits = sm90_layout::scale_bf16_bits((sf_word >> (8 * byte)) & 0xFFu);
  return bits | (bits << 16);
}

// BF16x2 (2^(a - 1), 2^(b - 1)) of scale bytes a = byte kLo (low half) and b = byte kHi (high
// half) of the word, both < 128: the bytes are placed at bits 0 and 16 (prmt), and
// a * 2^7 + (126 << 7) is the BF16 with exponent field a + 126 (likewise b).
template <int kLo, int kHi>
__device__ __forceinline__ uint32_t scale_folded_pair_bf16x2(uint32_t sf_word) {
  constexpr uint32_t kZeroByte = 4;
  constexpr uint32_t kSelector = (kZeroByte << 12) | (kHi << 8) | (kZeroByte << 4) | kLo;
  const uint32_t b2 = __byte_perm(sf_word, 0u, kSelector);
  return b2 * (1u << 7) + sm90_layout::kFoldedScaleBias;
}

template <class Cfg>
struct Mainloop {
  static constexpr int kMBlocksPerWG = Cfg::kMBlocksPerWG;
  static constexpr int kSteps = sm90_layout::kStepsPerBlock;
  static constexpr bool kFp8 = Cfg::kFp8;
  // The wgmmas of one 64 x 64 weight block: four k16 steps (BF16) or two k32 steps (FP8 mode).
  static constexpr int kUnitSteps = kFp8 ? 2 : kSteps;
  using BlockFrags = uint32_t[kUnitSteps][4];  // one 64-row block's A fragments for one unit
  using Frags = uint32_t[kMBlocksPerWG][kSteps][4];
  // FP8 mode: the largest scale byte of this thread's two rows (g, g + 8) of each of its weight
  // blocks in the current tile (GemmParams::w_row_exp; unused in exact mode).
  struct RowExps {
    int v[kMBlocksPerWG][2];
  };

  // Runs the K loop of one tile with N = kN token rows (the wgmma N, or kN / 8 mma.sync n8
  // chunks). acc[sub] receives the m64 x kN accumulators (the same layout either way).
  // stage/phase carry the pipeline position across tiles.
  template <int kN>
  __device__ __forceinline__ static void run(float (&acc)[kMBlocksPerWG][Cfg::kBlockN / 2],
                                             uint8_t* smem_b, const uint8_t* smem_a,
                                             const uint8_t* smem_sf, uint64_t* full_bars,
                                             uint64_t* empty_bars, int num_k_blocks, int wg,
                                             int tid, int& stage, uint32_t& phase,
                                             const RowExps& rx) {
    if constexpr (Cfg::kWarpMma) {
      run_warp<kN>(acc, smem_b, smem_a, smem_sf, full_bars, empty_bars, num_k_blocks, wg, tid,
                   stage, phase);
    } else if constexpr (Cfg::kOverlapConvert) {
      run_overlapped<kN>(acc, smem_b, smem_a, smem_sf, full_bars, empty_bars, num_k_blocks, wg,
                         tid, stage, phase, rx);
    } else {
      run_serial<kN>(acc, smem_b, smem_a, smem_sf, full_bars, empty_bars, num_k_blocks, wg, tid,
                     stage, phase);
    }
  }

  // ---- serial mainloop (the validated default): per stage wait, convert all blocks, wgmma,
  // wait_group 0. Two multiplies per conversion.
  __device__ __forceinline__ static void load_convert_serial(const uint8_t* smem_a,
                                                             const uint8_t* smem_sf, int wg,
                                                             int tid, Frags& frags) {
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
        uint32_t bits[4];
        sm90_layout::decode_word_bits(words[s], bits);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          frags[sub][s][i] = ptx::mul_bf16x2(
              ptx::mul_bf16x2(bits[i], sm90_layout::kDecodeUnscale), sc[i & 1][j]);
        }
      }
    }
  }

  template <int kN>
  __device__ __forceinline__ static void run_serial(float (&acc)[kMBlocksPerWG][Cfg::kBlockN / 2],
                                                    uint8_t* smem_b, const uint8_t* smem_a,
                                                    const uint8_t* smem_sf, uint64_t* full_bars,
                                                    uint64_t* empty_bars, int num_k_blocks,
                                                    int wg, int tid, int& stage,
                                                    uint32_t& phase) {
    static_assert(kN % 8 == 0 && kN <= Cfg::kBlockN, "wgmma N");
    Frags frags;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ptx::mbar_wait(&full_bars[stage], phase);
      load_convert_serial(smem_a + stage * Cfg::kSmemABytes, smem_sf + stage * Cfg::kSmemSfBytes,
                          wg, tid, frags);
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
      ptx::mbar_arrive(&empty_bars[stage]);  // every math thread (see run_overlapped)
      if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
    }
  }

  // ---- overlapped mainloop (kOverlapConvert, the configs kAuto picks): conversion of the next
  // block during the current block's wgmmas, one multiply per conversion (weight scale bytes
  // < 128 only: GemmParams::small_scales).

  // This thread's shared-window addresses of its words and scale word in the warpgroup's first
  // weight block of stage 0, k-block 0 (computed once per tile); a unit's loads add only the
  // stage offset (warp-uniform) and compile-time offsets.
  // NOTES: why: with the block pointers and tid passed down, ptxas rebuilt the thread part from
  // SR_TID.X in every unit (~17 instructions, S2R's latency at the head of the conversion's
  // dependency chain; SASS of PrefillAsyncK2N96 L1).
  struct ThreadAddrs {
    uint32_t a, sf;
  };
  __device__ __forceinline__ static ThreadAddrs thread_addrs(const uint8_t* smem_a,
                                                             const uint8_t* smem_sf, int wg,
                                                             int tid) {
    const int warp = tid / 32, g = (tid % 32) / 4;
    const int lm0 = wg * kMBlocksPerWG * Cfg::kKBlocksPerStage;
    return {ptx::smem_addr(smem_a) + lm0 * sm90_layout::kBlockBytes + tid * sm90_layout::kThreadBytes,
            ptx::smem_addr(smem_sf) + lm0 * sm90_layout::kSfBlockBytes + (warp * 8 + g) * 4};
  }
  // The same addresses in pipeline stage `stage`.
  __device__ __forceinline__ static ThreadAddrs at_stage(ThreadAddrs addrs, int stage) {
    return {addrs.a + static_cast<uint32_t>(stage * Cfg::kSmemABytes),
            addrs.sf + static_cast<uint32_t>(stage * Cfg::kSmemSfBytes)};
  }
  // Offsets of the warpgroup's weight block `sub`, k-block `j` of a stage (the order of the
  // global layout: block-major, then k-block).
  static constexpr uint32_t a_offset(int sub, int j) {
    return static_cast<uint32_t>((sub * Cfg::kKBlocksPerStage + j) * sm90_layout::kBlockBytes);
  }
  static constexpr uint32_t sf_offset(int sub, int j) {
    return static_cast<uint32_t>((sub * Cfg::kKBlocksPerStage + j) * sm90_layout::kSfBlockBytes);
  }

  // Converts this thread's A fragments of one 64-row x 64-deep weight block in shared memory
  // (a_addr, sf_addr: this thread's words and scale word, ThreadAddrs plus offsets).
  __device__ __forceinline__ static void load_convert_block(uint32_t a_addr, uint32_t sf_addr,
                                                            BlockFrags& frags) {
    const uint4 wv = ptx::ld_shared_v4_at(a_addr);
    const uint32_t sfw = ptx::ld_shared_u32_at(sf_addr);
    if constexpr (MEGAMOE_DIAG_MAINLOOP == 1) {
      const uint32_t words[kSteps] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
#pragma unroll
        for (int i = 0; i < 4; ++i) frags[s][i] = words[s] ^ (sfw << i);
      }
      return;
    }
    // E2M1 x 2^-126 as BF16x2 per A register (sign and magnitude bits moved into place).
    uint32_t bits[kSteps][4];
    const uint32_t words[kSteps] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int s = 0; s < kSteps; ++s) sm90_layout::decode_word_bits(words[s], bits[s]);
    // Registers 0, 2 are row g (scale byte j), registers 1, 3 row g + 8 (byte 2 + j); k16 steps
    // 0, 1 are in the first scale group (j = 0), steps 2, 3 in the second (j = 1).
    // Every scale byte b is < 128 (scale <= 2^0; the launcher runs these configs only on such
    // weights: GemmParams::small_scales): one multiply by 2^(b - 1) = 2^126 x 2^(b - 127), a
    // normal BF16 for b in [0, 127], gives E2M1 x 2^(b - 127) exactly (one factor is a power of
    // two and the product is representable). The two scales of a row (k groups j = 0, 1) share
    // one BF16x2 register, each multiply takes its half.
    // NOTES: why no run-time test: a warp vote per block sent warps with a scale >= 128 to a
    // two-multiply path; dropping the vote and that path made the decode launches 3-5 % faster
    // at T = 1 and 2-4 % at T = 8 and 64 (docs/tuning-log.md), and weights with larger scales
    // (|w| > 6) run the serial configs, whose conversion takes any scale.
    const uint32_t sc[2] = {scale_folded_pair_bf16x2<0, 1>(sfw),
                            scale_folded_pair_bf16x2<2, 3>(sfw)};
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        frags[s][i] = s < 2 ? ptx::mul_bf16x2_by_half<false>(bits[s][i], sc[i & 1])
                            : ptx::mul_bf16x2_by_half<true>(bits[s][i], sc[i & 1]);
      }
    }
  }

  // FP8 mode: this thread's E4M3 A registers of one 64 x 64 weight block, two k32 steps.
  // Each value becomes E2M1 x 2^(s - s_max + 1), s its group's scale byte and s_max the largest of
  // its row (GemmParams::w_row_exp; the epilogue multiplies by 2^(s_max - 128)): exact for groups
  // within 9 binades of the row's largest (the top group reaches 6 x 2 = 12), rounded to nearest
  // below that (E4M3 subnormals, then zero).
  //   decode_word_bits gives each BF16-layout register with sign at bit 15 and e1 e0 m at bits
  //   8..6 (per half); moved to bits 11..9 they read as FP16 E2M1 x 2^-14 (codes 0 / 1 as FP16
  //   subnormals); one HMUL2 by 2^(15 + s - s_max) (an FP16 power of two, exponent field
  //   s - s_max + 30, clamped to >= 1: groups 29 binades down give E4M3 zero either way), then
  //   cvt.rn.satfinite.e4m3x2.f16x2.
  // Register order: word w (k16 step w of the BF16 layout, cols 16 w + 2 t + 8 (i >> 1) + e of
  // register i) fills k32 step w / 2; its registers 0 / 2 (row g) make FP8 register 2 (w % 2) and
  // 1 / 3 (row g + 8) FP8 register 2 (w % 2) + 1, so FP8 slot 4 t + b of a k32 step holds column
  // 2 t + (b & 1) + 8 (b >> 1) (+ 16): the B rows are stored with that permutation of each
  // 32-group (sm90_layout::fp8_row_slot).
  __device__ __forceinline__ static void load_convert_block_fp8(uint32_t a_addr, uint32_t sf_addr,
                                                                const int (&smax)[2],
                                                                BlockFrags& frags) {
    const uint4 wv = ptx::ld_shared_v4_at(a_addr);
    const uint32_t sfw = ptx::ld_shared_u32_at(sf_addr);
    // mult[h]: FP16x2 (2^(15 + s_j0 - s_max), 2^(15 + s_j1 - s_max)) of row half h (bytes 2 h + j).
    uint32_t mult[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int e0 = max(static_cast<int>((sfw >> (16 * h)) & 0xFFu) - smax[h] + 30, 1);
      const int e1 = max(static_cast<int>((sfw >> (16 * h + 8)) & 0xFFu) - smax[h] + 30, 1);
      mult[h] = (static_cast<uint32_t>(e0) << 10) | (static_cast<uint32_t>(e1) << 26);
    }
    const uint32_t words[kSteps] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int w = 0; w < kSteps; ++w) {
      uint32_t bits[4];
      sm90_layout::decode_word_bits(words[w], bits);
      uint32_t e8[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t f16 = (bits[i] | (bits[i] << 3)) & 0x8E008E00u;
        const uint32_t scaled = w < 2 ? ptx::mul_f16x2_by_half<false>(f16, mult[i & 1])
                                      : ptx::mul_f16x2_by_half<true>(f16, mult[i & 1]);
        e8[i] = ptx::cvt_e4m3x2_f16x2(scaled);
      }
      frags[w / 2][2 * (w % 2)] = e8[0] | (e8[2] << 16);
      frags[w / 2][2 * (w % 2) + 1] = e8[1] | (e8[3] << 16);
    }
  }

  // One unit's A registers, exact or FP8 mode (block `sub` of the warpgroup for the row bytes).
  // (sub: a compile-time index once the callers' loops are unrolled)
  __device__ __forceinline__ static void load_convert_unit(uint32_t a_addr, uint32_t sf_addr,
                                                           const RowExps& rx, int sub,
                                                           BlockFrags& frags) {
    if constexpr (kFp8) {
      load_convert_block_fp8(a_addr, sf_addr, rx.v[sub], frags);
    } else {
      load_convert_block(a_addr, sf_addr, frags);
    }
  }

  // Software pipeline over units (stage, k-block j of the stage, weight block sub), in that
  // order: the wgmmas of unit u are issued, then the A fragments of unit u + 1 are converted
  // (waiting for the next stage's copies first when u + 1 starts a new stage) while they run,
  // then wait_group 0. The converted fragments alternate between two register sets: unit g of
  // the tile's K loop uses set g % 2. The set of every unit is a compile-time constant when a
  // stage has an even number of units (kMBlocksPerWG x kKBlocksPerStage), or, with an odd number,
  // when the loop runs two stages per iteration (an even number of stages: run_overlapped);
  // otherwise the next set is copied into the current one after the wait (kCopySets).
  // NOTES: wait_group 0 per unit (not 1 across units) keeps no wgmma in flight over the k-loop
  // back edge and no in-flight register written: ptxas then keeps the wgmmas asynchronous
  // (a version with wait_group 1 across stages serialized them, C7513). The k-blocks of a stage
  // are an unrolled loop of compile-time length (a wgmma under a data-dependent branch
  // serializes them all, C7520), so K must be a multiple of the stage depth (the launcher's
  // check).
  // NOTES (rejected; docs/tuning-log.md): wait_group 1 across units (the next unit's wgmmas
  // queued behind the current ones): ptxas serialized the wgmmas of every prefill config (C7511,
  // "insufficient register resources for the wgmma pipeline"). A __syncwarp after each commit,
  // which keeps a unit's four wgmmas together (ptxas otherwise spreads them over the next
  // conversion): 0.95-1.01x. The next tile's first block converted during the tile's last
  // wgmmas (register sets carried across tiles): 0.98-1.01x.
  // NOTES (rejected): with the funnel-shift decode, the __syncwarp after each commit again
  // (79.8 % tensor-pipe use against 73.2 % in bench/micro/wgmma_conversion.cu): 0.98-1.02x in the
  // GEMMs; each register multiplied as soon as it is decoded (82.6 % against 73.2 % in the
  // micro-benchmark at N = 80, 82.8 against 84.6 at N = 96): 0.98-1.02x. The micro-benchmark has
  // no TMA, barriers or epilogue warps: its instruction orders did not carry over.
  // NOTES (rejected): A through shared memory (each unit's converted block stored with stmatrix
  // into a 128B-swizzled buffer, SS wgmmas, two buffers per warpgroup, wait_group 1 per unit, so
  // no wgmma reads the registers the conversion writes and the next unit's wgmmas queue behind
  // the current ones): 0.82-0.88x in the 256 x 96 and 128 x 192 tiles at T = 4096 / 8192; with
  // the warpgroup barriers taken out (a measurement build) only 0.99-1.04x of that.
  // The stores and the wgmmas' A reads more than double the shared-memory traffic per unit
  // (L1TEX 63 % busy against 36 %, Nsight Compute, Kimi-K3 T = 4096 L1).
  // NOTES: why two stages per iteration: with one unit per stage (the 128 x 192 prefill tiles,
  // one weight block per warpgroup and one k-block per stage) the copy was 16 MOVs per unit on
  // top of ~80 instructions (SASS of PrefillWideAsync L1).
  // NOTES (rejected): loading each block's words one unit ahead of its conversion (a register
  // copy of the packed words, loaded by the previous unit) in the two-k-block prefill tiles, to
  // take the shared-memory latency out of the conversion (the top stall of its first multiply,
  // ~9 % of the samples; ncu, PrefillAsyncK2N96, Kimi-K3 T = 4096 L1): 2-5 % slower in every
  // prefill tile and token count it ran (docs/tuning-log.md), while the 128 x 192 tile, which it
  // left alone, read 0.99-1.02x: the other math warpgroup hides that latency already, and the
  // extra loads land in front of the wgmma wait.
  static constexpr int kUnitsPerStage = kMBlocksPerWG * Cfg::kKBlocksPerStage;

  // One stage of the overlapped loop: its units' wgmmas, the conversion of each next unit (the
  // next stage's first one if has_next_stage, after waiting for its copies), and the release of
  // the stage. kStageParity: the set parity of the stage's first unit.
  template <int kN, int kStageParity, bool kCopySets>
  __device__ __forceinline__ static void overlapped_stage(
      float (&acc)[kMBlocksPerWG][Cfg::kBlockN / 2], uint8_t* smem_b, ThreadAddrs addrs,
      uint64_t* full_bars, uint64_t* empty_bars, bool first_stage, bool has_next_stage, int stage,
      uint32_t phase, BlockFrags (&frags)[2], const RowExps& rx) {
    constexpr int kKSub = Cfg::kKBlocksPerStage;
    // k16 step s of k-block j starts 32 bytes further into each 128-byte swizzled row of box j
    // (descriptor units of 16 B). Descriptors and the scale-d flag are computed before the
    // fence, outside the wgmma window.
    // NOTES: broadcast from lane 0 so that ptxas sees a warp-uniform value: the descriptors then
    // live in uniform registers (UIADD3 / UMOV per wgmma) instead of being moved there by two
    // R2UR plus a rebuilt constant high word per wgmma (~5 fewer instructions per weight block).
    const uint32_t desc_stage = __shfl_sync(
        0xFFFFFFFFu, ptx::smem_desc_k128b_lo(smem_b + stage * Cfg::kSmemBBytes), 0);
    const int next_stage = stage + 1 == Cfg::kNumStages ? 0 : stage + 1;
    const uint32_t next_phase = stage + 1 == Cfg::kNumStages ? phase ^ 1u : phase;
    const ThreadAddrs here = at_stage(addrs, stage);
#pragma unroll
    for (int j = 0; j < kKSub; ++j) {
      // Low descriptor words (the start address field; the stage base is 1024-aligned, so the
      // additions never carry out of it); the high word is the constant kSmemDescK128bHi.
      // FP8 mode: a box holds two k-blocks (64 bytes of each row apiece), k32 step s 32 bytes
      // into the k-block's half.
      uint32_t desc[kUnitSteps];
#pragma unroll
      for (int s = 0; s < kUnitSteps; ++s) {
        desc[s] = desc_stage +
                  static_cast<uint32_t>(
                      (kFp8 ? (j / 2) * Cfg::kSmemBBoxBytes + (j % 2) * 64 + s * 32
                            : j * Cfg::kSmemBBoxBytes + s * sm90_layout::kStepK * 2) / 16);
      }
      const uint32_t scale_d0 = !first_stage || j != 0 ? 1u : 0u;
#pragma unroll
      for (int sub = 0; sub < kMBlocksPerWG; ++sub) {
        const int unit = j * kMBlocksPerWG + sub;
        const int cur = kCopySets ? 0 : (kStageParity + unit) & 1;
        const int nxt = kCopySets ? 1 : cur ^ 1;
        // NOTES (rejected): the decode tiles' four k16 steps alternating between two
        // accumulator sets (two dependent chains of 2 instead of one of 4, summed after the K
        // loop): 0.98-1.01x at T = 1, 8 and 64: the chain's latency is not what bounds them.
        ptx::wgmma_fence();
#pragma unroll
        for (int s = 0; s < kUnitSteps; ++s) {
          if constexpr (kFp8) {
            ptx::WgmmaE4m3RS<kN>::template mma_lo<ptx::kSmemDescK128bHi>(
                acc[sub], frags[cur][s], desc[s], s == 0 ? scale_d0 : 1u);
          } else {
            ptx::WgmmaBf16RS<kN>::template mma_lo<ptx::kSmemDescK128bHi>(
                acc[sub], frags[cur][s], desc[s], s == 0 ? scale_d0 : 1u);
          }
        }
        ptx::wgmma_commit();
        if (sub + 1 < kMBlocksPerWG) {
          load_convert_unit(here.a + a_offset(sub + 1, j), here.sf + sf_offset(sub + 1, j), rx,
                            sub + 1, frags[nxt]);
        } else if (j + 1 < kKSub) {
          load_convert_unit(here.a + a_offset(0, j + 1), here.sf + sf_offset(0, j + 1), rx, 0,
                            frags[nxt]);
        } else if (has_next_stage) {  // uniform over the warpgroup
          ptx::mbar_wait(&full_bars[next_stage], next_phase);
          const ThreadAddrs next = at_stage(addrs, next_stage);
          load_convert_unit(next.a, next.sf, rx, 0, frags[nxt]);
        }
        ptx::wgmma_wait<0>();
        if constexpr (kCopySets) {
#pragma unroll
          for (int s = 0; s < kUnitSteps; ++s) {
#pragma unroll
            for (int r = 0; r < 4; ++r) frags[0][s][r] = frags[1][s][r];
          }
        }
      }
    }
    // This stage's wgmmas are done: release its buffers. Every math thread arrives (the
    // barrier counts all of them), so each thread's own ld.shared of the stage is ordered
    // before the producer's next bulk copy into it by the barrier alone.
    // NOTES: with one arrival per warp (lane 0, after __syncwarp) compute-sanitizer racecheck
    // reported WAR hazards between lanes 1-31's reads and that copy.
    ptx::mbar_arrive(&empty_bars[stage]);
  }

  template <int kN>
  __device__ __forceinline__ static void run_overlapped(
      float (&acc)[kMBlocksPerWG][Cfg::kBlockN / 2], uint8_t* smem_b, const uint8_t* smem_a,
      const uint8_t* smem_sf, uint64_t* full_bars, uint64_t* empty_bars, int num_k_blocks, int wg,
      int tid, int& stage, uint32_t& phase, const RowExps& rx) {
    static_assert(kN % 8 == 0 && kN <= Cfg::kBlockN, "wgmma N");
    if constexpr (MEGAMOE_DIAG_MAINLOOP == 2) {
#pragma unroll
      for (int sub = 0; sub < kMBlocksPerWG; ++sub) {
#pragma unroll
        for (int i = 0; i < Cfg::kBlockN / 2; ++i) acc[sub][i] = 0.0f;
      }
      for (int ks = 0; ks < num_k_blocks / Cfg::kKBlocksPerStage; ++ks) {
        ptx::mbar_wait(&full_bars[stage], phase);
        ptx::mbar_arrive(&empty_bars[stage]);
        if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
      }
      return;
    }
    const int num_k_stages = num_k_blocks / Cfg::kKBlocksPerStage;
    const ThreadAddrs addrs = thread_addrs(smem_a, smem_sf, wg, tid);
    BlockFrags frags[2];
    ptx::mbar_wait(&full_bars[stage], phase);
    const ThreadAddrs first = at_stage(addrs, stage);
    load_convert_unit(first.a, first.sf, rx, 0, frags[0]);
    auto advance = [&] {
      if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
    };
    // One stage per iteration, with the set parity fixed (kCopy = false: an even number of
    // units per stage) or the next set copied into the current one (kCopy = true).
    auto stage_loop = [&](auto copy_tag) {
      constexpr bool kCopy = decltype(copy_tag)::value;
      for (int ks = 0; ks < num_k_stages; ++ks) {
        overlapped_stage<kN, 0, kCopy>(acc, smem_b, addrs, full_bars, empty_bars, ks == 0,
                                       ks + 1 < num_k_stages, stage, phase, frags, rx);
        advance();
      }
    };
    if constexpr (kUnitsPerStage % 2 == 0) {
      stage_loop(std::false_type{});
    } else if (num_k_stages % 2 == 0) {
      // Two stages per iteration: the second stage's units start on the odd set.
      for (int ks = 0; ks < num_k_stages; ks += 2) {
        overlapped_stage<kN, 0, false>(acc, smem_b, addrs, full_bars, empty_bars, ks == 0, true,
                                       stage, phase, frags, rx);
        advance();
        overlapped_stage<kN, 1, false>(acc, smem_b, addrs, full_bars, empty_bars, false,
                                       ks + 2 < num_k_stages, stage, phase, frags, rx);
        advance();
      }
    } else {
      stage_loop(std::true_type{});
    }
  }

  // ---- warp-level MMA mainloop (Cfg::kWarpMma): per stage, each warp converts its 16 rows of
  // every weight block (load_convert_block: the same fragments, which are the A layout of
  // mma.sync m16n8k16 as well) and multiplies them with mma.sync; the B fragments of each k-block
  // come from the 128B-swizzled stage by ldmatrix, once per warp for all its weight blocks.
  // No warpgroup fence, descriptor or wait_group: the four warps of the warpgroup run
  // independently (a wgmma starts when all four have issued it) and the stage is released when
  // its shared memory has been read.
  // NOTES: why: the 128-row decode tiles on this loop measured 1.00-1.09x over their wgmma
  // versions at T = 1, 8 and 64 (docs/tuning-log.md), with ~5 fewer instructions per weight
  // block (no fence, arrive, wait or descriptor update).
  // NOTES (tried): loading the whole stage into registers first and releasing it before the
  // conversion, to let the producer refill it one stage's math earlier: ptxas schedules each
  // load next to its use and the arrival after the last load whatever the source order (the SASS
  // was the same), so it was not kept.
  template <int kN>
  __device__ __forceinline__ static void run_warp(float (&acc)[kMBlocksPerWG][Cfg::kBlockN / 2],
                                                  uint8_t* smem_b, const uint8_t* smem_a,
                                                  const uint8_t* smem_sf, uint64_t* full_bars,
                                                  uint64_t* empty_bars, int num_k_blocks, int wg,
                                                  int tid, int& stage, uint32_t& phase) {
    static_assert(kN % 8 == 0 && kN <= Cfg::kBlockN, "mma N");
    constexpr int kChunks = kN / 8;  // n8 chunks of token rows
    constexpr int kKSub = Cfg::kKBlocksPerStage;
#pragma unroll
    for (int sub = 0; sub < kMBlocksPerWG; ++sub) {
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) acc[sub][i] = 0.0f;
    }
    const ThreadAddrs addrs = thread_addrs(smem_a, smem_sf, wg, tid);
    // ldmatrix row addresses: lane 8 q + r reads token row r (of each n8 chunk) at k-chunk q of
    // a pair of k16 steps (16 bytes each; steps 2 p, 2 p + 1 are k-chunks 4 p + q). The TMA's
    // 128-byte swizzle stores chunk c of row r at chunk c ^ (r % 8) of the row (each box is
    // 1024-aligned, rows 128 bytes), so pair p is the pair-0 address with bit 6 flipped.
    const int lane = tid % 32, r = lane % 8, q = lane / 8;
    const uint32_t b_lane = ptx::smem_addr(smem_b) + static_cast<uint32_t>(r * 128 + ((q ^ r) << 4));
    const int num_k_stages = num_k_blocks / kKSub;
    for (int ks = 0; ks < num_k_stages; ++ks) {
      ptx::mbar_wait(&full_bars[stage], phase);
      const ThreadAddrs here = at_stage(addrs, stage);
      const uint32_t b_stage = b_lane + static_cast<uint32_t>(stage * Cfg::kSmemBBytes);
#pragma unroll
      for (int j = 0; j < kKSub; ++j) {
        // bf[s][c][0 / 1]: k16 step s, chunk c.
        uint32_t bf[kSteps][kChunks][2];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
#pragma unroll
          for (int pair = 0; pair < kSteps / 2; ++pair) {
            uint32_t m[4];
            ptx::ldmatrix_x4((b_stage + static_cast<uint32_t>(j * Cfg::kSmemBBoxBytes + c * 8 * 128)) ^
                                 static_cast<uint32_t>(pair * 64),
                             m);
            bf[2 * pair][c][0] = m[0];
            bf[2 * pair][c][1] = m[1];
            bf[2 * pair + 1][c][0] = m[2];
            bf[2 * pair + 1][c][1] = m[3];
          }
        }
#pragma unroll
        for (int sub = 0; sub < kMBlocksPerWG; ++sub) {
          BlockFrags frags;
          load_convert_block(here.a + a_offset(sub, j), here.sf + sf_offset(sub, j), frags);
#pragma unroll
          for (int s = 0; s < kSteps; ++s) {
#pragma unroll
            for (int c = 0; c < kChunks; ++c) {
              float(&d)[4] = *reinterpret_cast<float(*)[4]>(&acc[sub][4 * c]);
              ptx::mma_m16n8k16_bf16(d, frags[s], bf[s][c][0], bf[s][c][1]);
            }
          }
        }
      }
      // Every math thread arrives, as in the overlapped loop: the arrival releases, so this
      // thread's shared-memory reads of the stage are ordered before the producer's next copy.
      ptx::mbar_arrive(&empty_bars[stage]);
      if (++stage == Cfg::kNumStages) { stage = 0; phase ^= 1u; }
    }
  }

};

}  // namespace megamoe::sm90
