// sm90_tile_schedule.hpp: the lookups of the persistent GEMMs' tile schedule, host + device (the
// kernels read it from shared memory; the host tests enumerate it).
//
// Tiles are enumerated expert by expert; inside an expert, m-tile (weight rows) major and n-tile
// (token rows) minor, so the tiles that share a weight tile run on neighbouring CTAs at about the
// same time and re-read it from L2. CTA b takes tiles b, b + gridDim.x, ...
//
// MegaSchedule: the work list of the MegaMoE kernel's first step (docs/design.md, "The MegaMoE
// kernel"): L1's tiles, then L2's, over the same token-row n-tiles, and each tile's slot (its
// expert and n-tile), on which an L2 tile waits until every L1 tile of the slot is done.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MEGAMOE_SCHEDULE_FN __host__ __device__
#else
#define MEGAMOE_SCHEDULE_FN
#endif

namespace megamoe::sm90 {

struct TileInfo {
  int expert;
  int m_block0;      // first 64-row weight block of the tile
  int num_m_blocks;  // valid 64-row blocks (the last m-tile may be partial)
  int row0;          // first token row
  int num_rows;      // valid token rows, 1..BLOCK_N
};

MEGAMOE_SCHEDULE_FN constexpr int schedule_min(int a, int b) { return a < b ? a : b; }

template <int kBlockN, int kMBlocksPerCta>
struct TileScheduler {
  const int32_t* offsets;  // smem [E + 1]: row offsets
  const int32_t* prefix;   // smem [E + 1]: exclusive prefix of tiles per expert
  int num_experts;
  int total_m_blocks;      // m_rows / 64
  int m_tiles;             // ceil(total_m_blocks / kMBlocksPerCta)

  MEGAMOE_SCHEDULE_FN int total_tiles() const { return prefix[num_experts]; }

  MEGAMOE_SCHEDULE_FN TileInfo get(int tile) const {
    // Last expert whose prefix <= tile (empty experts share their successor's prefix).
    int lo = 0, hi = num_experts;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (prefix[mid] <= tile) lo = mid; else hi = mid;
    }
    const int rows = offsets[lo + 1] - offsets[lo];
    const int n_tiles = (rows + kBlockN - 1) / kBlockN;
    const int local = tile - prefix[lo];
    const int mt = local / n_tiles, nt = local % n_tiles;
    TileInfo info;
    info.expert = lo;
    info.m_block0 = mt * kMBlocksPerCta;
    info.num_m_blocks = schedule_min(kMBlocksPerCta, total_m_blocks - info.m_block0);
    info.row0 = offsets[lo] + nt * kBlockN;
    info.num_rows = schedule_min(kBlockN, rows - nt * kBlockN);
    return info;
  }
};

// The tile prefix of one GEMM (what build_schedule writes on the device): prefix[e] = m_tiles x
// the n-tiles of experts 0..e-1, prefix[E] the total. Host side (tests, sizing).
template <int kBlockN>
void tile_prefix(const int32_t* offsets, int num_experts, int m_tiles, int32_t* prefix) {
  int32_t sum = 0;
  for (int e = 0; e < num_experts; ++e) {
    prefix[e] = sum;
    sum += m_tiles * ((offsets[e + 1] - offsets[e] + kBlockN - 1) / kBlockN);
  }
  prefix[num_experts] = sum;
}

template <int kBlockN, int kMBlocksPerCta>
struct MegaSchedule {
  TileScheduler<kBlockN, kMBlocksPerCta> l1;  // m_rows 2I: prefix = m_tiles1 x n-tiles
  TileScheduler<kBlockN, kMBlocksPerCta> l2;  // m_rows H, the same offsets

  MEGAMOE_SCHEDULE_FN int l1_tiles() const { return l1.total_tiles(); }
  MEGAMOE_SCHEDULE_FN int total_tiles() const { return l1.total_tiles() + l2.total_tiles(); }
  MEGAMOE_SCHEDULE_FN bool is_l1(int tile) const { return tile < l1_tiles(); }
  MEGAMOE_SCHEDULE_FN TileInfo get(int tile) const {
    return is_l1(tile) ? l1.get(tile) : l2.get(tile - l1_tiles());
  }
  // The slot of a tile (L1 or L2): the n-tiles of the experts before its own, plus its n-tile.
  MEGAMOE_SCHEDULE_FN int slot(const TileInfo& tile) const {
    return l1.prefix[tile.expert] / l1.m_tiles + (tile.row0 - l1.offsets[tile.expert]) / kBlockN;
  }
  // Slots of this call (the ready counters it uses): every expert's n-tiles.
  MEGAMOE_SCHEDULE_FN int num_slots() const { return l1.total_tiles() / l1.m_tiles; }
  // The count a slot's ready counter reaches when every L1 tile of its rows is done.
  MEGAMOE_SCHEDULE_FN int ready_target() const { return l1.m_tiles; }
  // Slot s's rows: its expert, row0 and num_rows (the L1 tile of its first m-tile; the inverse
  // of slot()). The last expert whose slots before it are <= s (empty experts share their
  // successor's prefix).
  MEGAMOE_SCHEDULE_FN TileInfo slot_info(int s) const {
    const int first_tile = s * l1.m_tiles;
    int lo = 0, hi = l1.num_experts;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (l1.prefix[mid] <= first_tile) lo = mid; else hi = mid;
    }
    return l1.get(l1.prefix[lo] + (s - l1.prefix[lo] / l1.m_tiles));
  }
};

// Most slots a call can use: sum over E_l experts of ceil(rows_e / BLOCK_N) <= max_rows / BLOCK_N
// + E_l (the workspace of the ready counters).
constexpr int64_t max_schedule_slots(int64_t max_rows, int64_t num_experts, int block_n) {
  return max_rows / block_n + num_experts;
}

}  // namespace megamoe::sm90
