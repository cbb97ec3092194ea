// sm90_tiles.hpp: the tile configurations of the Hopper grouped GEMMs that the library ships,
// as one table of named fields. The policy (src/moe/sm90_tile_policy.*) chooses among exactly
// these; GemmConfig<TileId> (sm90_gemm_config.hpp) derives the kernel's compile-time constants
// from a row. Plain C++ (host and device): the CPU build and its tests read the same table.
#pragma once

#include <cstdint>
#include <string_view>

namespace megamoe::sm90 {

// How the K loop converts and multiplies (kernels/sm90/sm90_gemm_mainloop.cuh).
enum class MainloopKind : uint8_t {
  kSerial,   // convert a stage, then its wgmmas; exact for every scale byte
  kOverlap,  // the next block's conversion runs under the current MMAs; one multiply per
             // converted register, exact only for scale bytes < 128
};
// Which tensor-core instruction the math warps issue.
enum class MmaKind : uint8_t {
  kWgmma,    // wgmma m64nNk16, A from registers, one warpgroup per 64-row block
  kWarp,     // mma.sync m16n8k16 per warp (B fragments by ldmatrix): no warpgroup fences
};
// What the tensor cores multiply (docs/numerics.md: the exact mode and the FP8 mode).
enum class OperandKind : uint8_t {
  kBf16,  // exact mode: E2M1 x 2^s and E4M3 x 2^s carried exactly in BF16, wgmma m64nNk16
  kE4m3,  // FP8 mode: each weight row's values rebased to one power of two per row and each
          // token row's to one per row, both E4M3, wgmma m64nNk32; two k-blocks per TMA box
};
// How the tile's results leave the accumulators (kernels/sm90/sm90_gemm_epilogue.cuh).
enum class EpilogueKind : uint8_t {
  kRegisters,  // straight from the accumulator registers
  kStaged,     // through shared memory, a rolled loop with wide stores
  kAsync,      // staged, and finished by the producer warpgroup while the math goes on
};

struct TileConfig {
  const char* name;            // what `--tile` and LayerConfig::sm90.gemm_tile accept
  int math_warpgroups;         // consumer warpgroups of the CTA
  int m_blocks_per_warpgroup;  // 64-row weight blocks each one owns (its accumulator chains)
  int block_n;                 // most token rows of one tile (the TMA box rows)
  int n_step;                  // granularity of the per-tile MMA N
  int stages;                  // pipeline stages in shared memory
  int ctas_per_sm;             // resident CTAs per SM (the persistent grid is SMs x this)
  int k_blocks_per_stage;      // 64-deep k-blocks per stage: K must be a multiple of 64 x this
  MainloopKind mainloop;
  MmaKind mma;
  EpilogueKind epilogue;
  int epilogue_warpgroups;     // warpgroups beside the math ones that run the async epilogue
  bool split_k;                // takes GemmParams::k_splits (K cut into separate work units)
  OperandKind operands;        // BF16 (exact mode) or E4M3 (FP8 mode)

  constexpr int block_m() const { return 64 * math_warpgroups * m_blocks_per_warpgroup; }
  constexpr int k_multiple() const { return 64 * k_blocks_per_stage; }
  constexpr bool needs_small_scales() const {
    return mainloop == MainloopKind::kOverlap && operands == OperandKind::kBf16;
  }
  constexpr bool fp8() const { return operands == OperandKind::kE4m3; }
  // Whether the MegaMoE kernel (kernels/sm90/sm90_mega_moe.cuh) can run this tile: one math
  // warpgroup that finishes its own tiles from registers (decode; a split-K tile splits either
  // GEMM), or an overlapped prefill tile with a staged or asynchronous epilogue (the FP8 tiles
  // among them).
  constexpr bool mega_kernel() const {
    return math_warpgroups == 1 ? epilogue == EpilogueKind::kRegisters
                                : epilogue != EpilogueKind::kRegisters && mainloop == MainloopKind::kOverlap;
  }
  // FP32 partials of one split-K work unit: the warpgroup's accumulators.
  constexpr int split_unit_floats() const { return m_blocks_per_warpgroup * (block_n / 2) * 128; }
};

// The shipped tiles. The names say: phase, BLOCK_M x BLOCK_N, k-blocks per stage, and what sets
// them apart. A "k1" tile is the same tile with one k-block per stage, for K that its "k2"/"k4"
// sibling cannot take (e.g. GPT-OSS, H = 2880 = 45 x 64).
enum class TileId : uint8_t {
  // Serial mainloop: any scale byte. The policy's only choice when a weight scale byte is >= 128.
  kSerial64x8,
  kSerial64x16,
  kSerial256x128,
  // Overlapped mainloop, decode (few rows per expert: stream the weights over every SM).
  kDecode64x16,
  kDecode128x8K4Warp,
  kDecode128x8K2Warp,
  kDecode128x8K1Warp,
  kDecode128x16K2Cta3,
  kDecode128x16K1Cta3,
  kDecode128x16K2Warp,
  kDecode128x16K1Warp,
  kDecode128x16K2WarpSplitK,
  kDecode128x16K1WarpSplitK,
  kDecode128x8K4WarpSplitK,
  // Overlapped mainloop, prefill (many rows per expert: reuse each weight tile).
  kPrefill128x192Async,
  kPrefill256x64K2Async,
  kPrefill256x96K2Async2,
  kPrefill256x128K2Staged,
  kPrefill256x128K1Staged,
  // FP8 mode (OperandKind::kE4m3), prefill.
  kFp8Prefill128x192K2Async,
  kFp8Prefill256x128K2Staged,
  kFp8Prefill128x256K2Async,
};
constexpr int kNumTiles = 22;

namespace tile_detail {
constexpr MainloopKind S = MainloopKind::kSerial, O = MainloopKind::kOverlap;
constexpr MmaKind G = MmaKind::kWgmma, W = MmaKind::kWarp;
constexpr EpilogueKind R = EpilogueKind::kRegisters, St = EpilogueKind::kStaged,
                       A = EpilogueKind::kAsync;
constexpr OperandKind B = OperandKind::kBf16, F = OperandKind::kE4m3;

// One row per TileId, in its order. Columns: name, math warpgroups, m-blocks per warpgroup,
// block_n, n_step, stages, CTAs per SM, k-blocks per stage, mainloop (Serial / Overlap), MMA
// (wGmma / Warp), epilogue (Registers / STaged / Async), epilogue warpgroups, split-K, operands
// (Bf16 / Fp8 e4m3).
inline constexpr TileConfig kTable[kNumTiles] = {
    {"serial_64x8",                   1, 1,   8,  8, 10, 4, 1, S, G, R,  1, false, B},
    {"serial_64x16",                  1, 1,  16,  8, 10, 4, 1, S, G, R,  1, false, B},
    {"serial_256x128",                2, 2, 128, 16,  7, 1, 1, S, G, R,  1, false, B},
    {"decode_64x16",                  1, 1,  16,  8, 10, 4, 1, O, G, R,  1, false, B},
    {"decode_128x8_k4_warp",          1, 2,   8,  8,  2, 4, 4, O, W, R,  1, false, B},
    {"decode_128x8_k2_warp",          1, 2,   8,  8,  4, 4, 2, O, W, R,  1, false, B},
    {"decode_128x8_k1_warp",          1, 2,   8,  8,  8, 4, 1, O, W, R,  1, false, B},
    {"decode_128x16_k2_3cta",         1, 2,  16,  8,  5, 3, 2, O, G, R,  1, false, B},
    {"decode_128x16_k1_3cta",         1, 2,  16,  8, 10, 3, 1, O, G, R,  1, false, B},
    {"decode_128x16_k2_warp",         1, 2,  16,  8,  3, 4, 2, O, W, R,  1, false, B},
    {"decode_128x16_k1_warp",         1, 2,  16,  8,  7, 4, 1, O, W, R,  1, false, B},
    {"decode_128x16_k2_warp_splitk",  1, 2,  16,  8,  3, 4, 2, O, W, R,  1, true, B},
    {"decode_128x16_k1_warp_splitk",  1, 2,  16,  8,  7, 4, 1, O, W, R,  1, true, B},
    {"decode_128x8_k4_warp_splitk",   1, 2,   8,  8,  2, 4, 4, O, W, R,  1, true, B},
    {"prefill_128x192_async",         2, 1, 192,  8,  5, 1, 1, O, G, A,  1, false, B},
    {"prefill_256x64_k2_async",       2, 2,  64, 16,  5, 1, 2, O, G, A,  1, false, B},
    {"prefill_256x96_k2_async2",      2, 2,  96,  8,  3, 1, 2, O, G, A,  2, false, B},
    {"prefill_256x128_k2_staged",     2, 2, 128, 16,  3, 1, 2, O, G, St, 1, false, B},
    {"prefill_256x128_k1_staged",     2, 2, 128, 16,  7, 1, 1, O, G, St, 1, false, B},
    {"fp8_128x192_k2_async",          2, 1, 192,  8,  4, 1, 2, O, G, A,  1, false, F},
    {"fp8_256x128_k2_staged",         2, 2, 128, 16,  5, 1, 2, O, G, St, 1, false, F},
    {"fp8_128x256_k2_async",          2, 1, 256,  8,  3, 1, 2, O, G, A,  1, false, F},
};
}  // namespace tile_detail

inline constexpr const TileConfig (&kTileTable)[kNumTiles] = tile_detail::kTable;

constexpr const TileConfig& tile_config(TileId id) { return kTileTable[static_cast<int>(id)]; }

// The same tile with fewer k-blocks per stage (the next shallower one), for K that `id` cannot
// take; `id` itself when it has one k-block per stage or no shallower twin (the two `_k2_async`
// prefill tiles and `decode_128x8_k4_warp_splitk`: the policy takes them only for K they take).
constexpr TileId shallower_sibling(TileId id) {
  switch (id) {
    case TileId::kDecode128x8K4Warp: return TileId::kDecode128x8K2Warp;
    case TileId::kDecode128x8K2Warp: return TileId::kDecode128x8K1Warp;
    case TileId::kDecode128x16K2Cta3: return TileId::kDecode128x16K1Cta3;
    case TileId::kDecode128x16K2Warp: return TileId::kDecode128x16K1Warp;
    case TileId::kDecode128x16K2WarpSplitK: return TileId::kDecode128x16K1WarpSplitK;
    case TileId::kPrefill256x128K2Staged: return TileId::kPrefill256x128K1Staged;
    default: return id;
  }
}

// `id` or its shallowest sibling that takes K (K a multiple of 64: every k1 tile takes it; a
// tile without a k1 sibling may not).
constexpr TileId fit_k(TileId id, int64_t k) {
  while (k % tile_config(id).k_multiple() != 0 && shallower_sibling(id) != id) {
    id = shallower_sibling(id);
  }
  return id;
}

// The tile of a name in the table, or false.
constexpr bool tile_by_name(std::string_view name, TileId* out) {
  for (int i = 0; i < kNumTiles; ++i) {
    if (name == kTileTable[i].name) {
      *out = static_cast<TileId>(i);
      return true;
    }
  }
  return false;
}

namespace tile_detail {
constexpr bool table_is_consistent() {
  for (int i = 0; i < kNumTiles; ++i) {
    const TileConfig& t = kTileTable[i];
    const TileConfig& s = tile_config(shallower_sibling(static_cast<TileId>(i)));
    if (s.k_blocks_per_stage > t.k_blocks_per_stage ||
        (s.k_blocks_per_stage == t.k_blocks_per_stage && &s != &t) ||
        s.block_m() != t.block_m() || s.block_n != t.block_n ||
        s.mainloop != t.mainloop || s.mma != t.mma || s.split_k != t.split_k ||
        s.operands != t.operands || (t.fp8() && (t.k_blocks_per_stage % 2 != 0 ||
                                                  t.mainloop != MainloopKind::kOverlap ||
                                                  t.mma != MmaKind::kWgmma || t.split_k))) {
      return false;
    }
    for (int j = 0; j < i; ++j) {
      if (std::string_view(kTileTable[j].name) == t.name) return false;
    }
  }
  return true;
}
}  // namespace tile_detail
static_assert(tile_detail::table_is_consistent(),
              "tile names are unique, every shallower sibling is the same tile with fewer k-blocks "
              "per stage, and the FP8 tiles are overlapped wgmma tiles with an even number of "
              "k-blocks per stage (a TMA box of 128 E4M3 covers two)");

}  // namespace megamoe::sm90
