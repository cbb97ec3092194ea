// sm90_tile_policy.cpp: the tile policy of the Hopper expert GEMMs (see the header). Each
// threshold is named, with the reason it sits where it does; the measurements behind them are in
// docs/tuning-log.md, the current policy in docs/perf.md.
#include "moe/sm90_tile_policy.hpp"

#include <algorithm>
#include <ostream>
#include <sstream>

#include "megamoe/error.hpp"

namespace megamoe::sm90 {
namespace {

// ---- thresholds (rows per expert = the launch's rows over the experts they can hit) ----

// Serial mainloop: the 64 x 16 decode tile covers an expert in one tile up to 16 rows; above
// it the 256 x 128 prefill tile reuses each weight tile for up to 128 rows.
constexpr int64_t kSerialDecodeMaxAvgRows = 16;
// Overlapped mainloop: the prefill tiles win from 13 rows per expert (kDecodeMaxAvgRows = 12),
// and at most 4 rows the 8-row decode tiles halve the B bytes of each stage (kDecode8MaxAvgRows).
// (112, 166]: the 128 x 192 tile holds an expert's rows in one n-tile (uniform routing spreads
// counts by ~sqrt(avg), so ~1.15 x avg stays within 192) where 256 x 128 tiles would split most
// experts into 128 + a small remainder that costs a whole K loop of conversion.
constexpr int64_t kWideMinAvgRows = 112;
constexpr int64_t kWideMaxAvgRows = 166;
// Up to 40 rows the 256 x 64 tile (the largest expert of uniform routing stays within 64 rows,
// ~3.8 sigma), up to 80 the 256 x 96 one (~1.8 sigma): their smaller B stages leave room for
// the asynchronous epilogue's staging with more stages than the 128-row tile.
constexpr int64_t kN64MaxAvgRows = 40;
constexpr int64_t kN96MaxAvgRows = 80;
// The 128-row decode tiles need their tiles to fill at least 3/4 of the CTA slots; with fewer
// the 64-row tile spreads the weight stream over more CTAs.
constexpr int64_t kDecodeFillNum = 3, kDecodeFillDen = 4;
// 3 CTAs per SM instead of 4 (static split only) when that grid's waves are >= 10 % fuller:
// the last wave of a persistent launch leaves slots idle.
constexpr double kThreeCtaMinGain = 1.1;

// The MegaMoE kernel from 8 estimated rows of the launch on: with fewer (a few experts, each GEMM
// split in up to 4 parts) it measured slower than the chain (docs/tuning-log.md v31).
constexpr int64_t kMegaMinRows = 8;

constexpr TileId kDecode128Tile = TileId::kDecode128x16K2Warp;
constexpr TileId kSplitTile = TileId::kDecode128x16K2WarpSplitK;
// Up to kDecode8MaxAvgRows rows per expert the 8-row split tile, as the unsplit launches take
// the 8-row tile there; it has four k-blocks per stage and no shallower twin.
constexpr TileId kSplit8Tile = TileId::kDecode128x8K4WarpSplitK;
constexpr TileId kThreeCtaTile = TileId::kDecode128x16K2Cta3;
constexpr int64_t kDecodeCtasPerSm = tile_config(kDecode128Tile).ctas_per_sm;
constexpr int64_t kDecode128Rows = tile_config(kDecode128Tile).block_m();
static_assert(tile_config(kSplitTile).ctas_per_sm == kDecodeCtasPerSm &&
                  tile_config(kSplitTile).block_m() == kDecode128Rows &&
                  tile_config(kSplit8Tile).ctas_per_sm == kDecodeCtasPerSm &&
                  tile_config(kSplit8Tile).block_m() == kDecode128Rows &&
                  tile_config(kSplit8Tile).split_unit_floats() <=
                      tile_config(kSplitTile).split_unit_floats() &&
                  tile_config(kThreeCtaTile).block_m() == kDecode128Rows,
              "the 128-row decode tiles share their grid arithmetic, and the 16-row split tile's "
              "workspace holds the 8-row one's");

struct RowEstimate {
  int64_t rows, active, avg;
};
// A row estimate (0: the capacity) spread over as many experts as there are rows, up to E_l.
RowEstimate estimate_rows(int64_t rows_hint, int64_t max_rows, int num_experts) {
  const int64_t rows = rows_hint > 0 ? std::min<int64_t>(rows_hint, max_rows) : max_rows;
  const int64_t active = std::max<int64_t>(1, std::min<int64_t>(rows, num_experts));
  return {rows, active, rows / active};
}

// Fraction of the CTA slots busy over the waves of a persistent launch of `tiles` tiles.
double wave_fill(int64_t tiles, int64_t slots) {
  const int64_t waves = (tiles + slots - 1) / slots;
  return waves == 0 ? 1.0 : static_cast<double>(tiles) / static_cast<double>(waves * slots);
}

// Split-K fills the CTA slots that the tiles leave idle, in one wave: parts = slots / tiles, at
// most kMaxKSplits and the pipeline stages of K. NOTES: a second wave of parts only lost (every
// part pays its pipeline fill and the partials' round trip).
int split_k_parts(int64_t tiles, int64_t slots, int64_t stages) {
  if (tiles <= 0) return 1;
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({slots / tiles, kMaxKSplits, stages})));
}

int64_t k_stages(TileId id, int64_t k) { return k / tile_config(id).k_multiple(); }

constexpr int64_t kClassMaxAvg[kRowClasses - 1] = {kDecode8MaxAvgRows, kDecodeMaxAvgRows};
int avg_class(int64_t avg) {
  int c = 0;
  while (c + 1 < kRowClasses && avg > kClassMaxAvg[c]) ++c;
  return c;
}

TileChoice choose_serial(int64_t avg) {
  if (avg <= kDecode8MaxAvgRows) return {TileId::kSerial64x8, 1, "serial: <= 4 rows per expert"};
  if (avg <= kSerialDecodeMaxAvgRows) {
    return {TileId::kSerial64x16, 1, "serial: <= 16 rows per expert, one 16-row tile each"};
  }
  return {TileId::kSerial256x128, 1, "serial: > 16 rows per expert, weight tiles reused"};
}

// The 128-row decode tiles of a launch (est.active experts) and the CTA slots they run on.
struct DecodeTiles {
  int64_t tiles, slots;
};
DecodeTiles decode_tiles(const TileQuery& q, const RowEstimate& est) {
  return {est.active * ((q.m_rows + kDecode128Rows - 1) / kDecode128Rows),
          static_cast<int64_t>(q.sm_count) * kDecodeCtasPerSm};
}

// The K parts of split_tile for those tiles where they would leave CTA slots idle and the query's
// split-K workspace holds them; 1: unsplit.
int decode_split_parts(const TileQuery& q, const DecodeTiles& d, TileId split_tile) {
  const int parts = split_k_parts(d.tiles, d.slots, k_stages(split_tile, q.k));
  const bool fits = q.split_allowed && parts > 1 && d.tiles <= q.split_counters_capacity &&
                    d.tiles * parts * tile_config(split_tile).split_unit_floats() <=
                        q.split_partial_floats;
  return fits ? parts : 1;
}

// The split tile of a decode launch of reduction k (and k_other, the other GEMM's, where one
// tile runs both): the 8-row one where it takes both, else the 16-row one's sibling for both.
TileId split_tile_for(int64_t avg, int64_t k, int64_t k_other) {
  const int64_t m = tile_config(kSplit8Tile).k_multiple();
  if (avg <= kDecode8MaxAvgRows && k % m == 0 && k_other % m == 0) return kSplit8Tile;
  return fit_k(fit_k(kSplitTile, k), k_other);
}

TileChoice choose_decode(const TileQuery& q, const RowEstimate& est) {
  const auto [tiles, slots] = decode_tiles(q, est);
  const TileId split_tile = split_tile_for(est.avg, q.k, q.k);
  const int parts = decode_split_parts(q, {tiles, slots}, split_tile);
  if (parts > 1) return {split_tile, parts, "decode: few tiles, K split to fill the idle CTA slots"};
  if (tiles * kDecodeFillDen < slots * kDecodeFillNum) {
    return {TileId::kDecode64x16, 1, "decode: 128-row tiles would leave over 1/4 of the slots idle"};
  }
  if (q.unit_counter && est.avg <= kDecode8MaxAvgRows) {
    return {fit_k(TileId::kDecode128x8K4Warp, q.k), 1,
            "decode: <= 4 rows per expert, 8-row tiles, units taken at run time"};
  }
  const int64_t sms = q.sm_count;
  const bool three_per_sm = wave_fill(tiles, sms * tile_config(kThreeCtaTile).ctas_per_sm) >=
                            kThreeCtaMinGain * wave_fill(tiles, slots);
  if (three_per_sm && !q.unit_counter) {
    return {fit_k(kThreeCtaTile, q.k), 1, "decode: static split, 3 CTAs per SM fill the waves better"};
  }
  return {fit_k(kDecode128Tile, q.k), 1, "decode: 128 x 16 tiles on warp-level MMAs"};
}

}  // namespace

TileChoice choose_tile(const TileQuery& q) {
  const RowEstimate est = estimate_rows(q.rows_hint, q.max_rows, q.num_experts);
  if (q.serial_only || !q.small_scales) return choose_serial(est.avg);
  if (est.avg <= kDecodeMaxAvgRows) return choose_decode(q, est);
  if (est.avg > kWideMinAvgRows && est.avg <= kWideMaxAvgRows) {
    return {TileId::kPrefill128x192Async, 1, "prefill: 113-166 rows per expert fit one 192-row n-tile"};
  }
  const bool k128 = q.k % tile_config(TileId::kPrefill256x64K2Async).k_multiple() == 0;
  static_assert(tile_config(TileId::kPrefill256x64K2Async).k_multiple() ==
                tile_config(TileId::kPrefill256x96K2Async2).k_multiple(), "one K rule for both");
  if (k128 && est.avg <= kN64MaxAvgRows) {
    return {TileId::kPrefill256x64K2Async, 1, "prefill: 13-40 rows per expert fit one 64-row n-tile"};
  }
  if (k128 && est.avg <= kN96MaxAvgRows) {
    return {TileId::kPrefill256x96K2Async2, 1, "prefill: 41-80 rows per expert fit one 96-row n-tile"};
  }
  return {fit_k(TileId::kPrefill256x128K2Staged, q.k), 1,
          "prefill: 256 x 128 tiles (other row counts, or K not a multiple of 128)"};
}

LaunchPlan plan_launches(int64_t rows_hint, int64_t rows_per_expert_max, int num_experts,
                         int64_t max_rows) {
  LaunchPlan plan;
  const int64_t e = std::max(1, num_experts);
  const bool gated = rows_hint > 0 && rows_per_expert_max > 0;
  const int lo = gated ? avg_class(estimate_rows(rows_hint, max_rows, num_experts).avg) : 0;
  const int hi = gated ? avg_class(rows_per_expert_max) : 0;
  // NOTES: only when the prefill class is possible: between the decode classes alone the
  // skipped launch cost more than the better decode tile gained.
  if (hi <= lo || hi < kRowClasses - 1) {
    plan.launch[plan.count++] = GatedLaunch{0, 0, rows_hint};
    return plan;
  }
  for (int c = lo; c <= hi; ++c) {
    GatedLaunch l;
    l.gate_min_avg = c == lo ? 0 : static_cast<int>(kClassMaxAvg[c - 1]);
    l.gate_max_avg = c == hi ? 0 : static_cast<int>(kClassMaxAvg[c]);
    const int64_t rows = c == lo ? rows_hint
                         : c == hi ? rows_per_expert_max * e
                                   : kClassMaxAvg[c] * e;
    l.rows = std::min<int64_t>(rows, max_rows);
    plan.launch[plan.count++] = l;
  }
  return plan;
}

namespace {
// Whether the MegaMoE kernel is built for `tile` and the tile takes both GEMMs' K.
bool mega_takes(TileId tile, int64_t l1_k, int64_t l2_k) {
  const int64_t k_multiple = tile_config(tile).k_multiple();
  return mega_tile_index(tile) >= 0 && l1_k % k_multiple == 0 && l2_k % k_multiple == 0;
}
}  // namespace

MegaChoice choose_mega_tile(const TileQuery& l1, int64_t l2_k, bool l2_small_scales,
                            const TileRequest& request) {
  if (request.mode == TileRequest::Mode::kForced) {
    const bool built = mega_takes(request.tile, l1.k, l2_k) && !tile_config(request.tile).fp8();
    if (!built || !l1.small_scales || !l2_small_scales) return {false, request.tile, 1, 1, "forced tile: chained"};
    return {true, request.tile, 1, 1, "forced tile, built for the MegaMoE kernel"};
  }
  if (request.mode == TileRequest::Mode::kSerial || !l1.small_scales || !l2_small_scales) {
    return {false, TileId::kDecode128x16K2Warp, 1, 1, "serial tiles: chained"};
  }
  const RowEstimate est = estimate_rows(l1.rows_hint, l1.max_rows, l1.num_experts);
  if (est.rows < kMegaMinRows) {
    return {false, TileId::kDecode128x8K4Warp, 1, 1,
            "fewer than 8 estimated rows: chained (the fused kernel measured slower there)"};
  }
  if (est.avg > kDecodeMaxAvgRows) {
    // The prefill tile L1's launch would take (or its sibling), for both GEMMs.
    // NOTES: only the staged tiles by default: the asynchronous ones run fused when forced but
    // measured slower than the chain (docs/tuning-log.md v29).
    const TileId tile = fit_k(fit_k(choose_tile(l1).tile, l1.k), l2_k);
    if (tile_config(tile).epilogue == EpilogueKind::kStaged && mega_takes(tile, l1.k, l2_k)) {
      return {true, tile, 1, 1, "mega: prefill, L1's staged tile for both GEMMs"};
    }
    return {false, tile, 1, 1, "prefill: L1's tile is not a staged tile of the MegaMoE kernel "
                               "(or does not take both K): chained"};
  }
  // Each GEMM split as choose_decode would split it on its own: L1's tiles run alone first
  // (every L2 tile waits for L1 tiles) and L2's alone last, each leaving CTA slots idle where
  // they are few. Both parts in the fused kernel's one workspace, or L2 unsplit.
  const TileId split_tile = split_tile_for(est.avg, l1.k, l2_k);
  TileQuery l2 = l1;
  l2.m_rows = l1.k;
  l2.k = l2_k;
  const DecodeTiles d1 = decode_tiles(l1, est), d2 = decode_tiles(l2, est);
  // The kernel's own test (sm90_mega_moe.cuh): a counter for every tile of both GEMMs and room
  // for all their parts, else it runs unsplit.
  auto fits = [&](int p1, int p2) {
    return d1.tiles + d2.tiles <= l1.split_counters_capacity &&
           (d1.tiles * p1 + d2.tiles * p2) * tile_config(split_tile).split_unit_floats() <=
               l1.split_partial_floats;
  };
  int parts1 = decode_split_parts(l1, d1, split_tile);
  int parts2 = decode_split_parts(l2, d2, split_tile);
  if (!fits(parts1, parts2)) parts2 = 1;
  if (!fits(parts1, parts2)) parts1 = 1;
  if (parts1 > 1 || parts2 > 1) {
    return {true, split_tile, parts1, parts2,
            parts2 > 1 ? "mega: few tiles, L1 and / or L2 split in K" : "mega: few L1 tiles, L1 split in K"};
  }
  const TileId base = est.avg <= kDecode8MaxAvgRows ? TileId::kDecode128x8K4Warp : TileId::kDecode128x16K2Warp;
  const TileId tile = fit_k(fit_k(base, l1.k), l2_k);
  return {true, tile, 1, 1, est.avg <= kDecode8MaxAvgRows ? "mega: <= 4 rows per expert, 128 x 8 tiles"
                                                       : "mega: <= 12 rows per expert, 128 x 16 tiles"};
}

MegaChoice choose_mega_fp8_tile(const TileQuery& l1, int64_t l2_k, const TileRequest& request) {
  if (request.mode == TileRequest::Mode::kForced) {
    const bool built = mega_takes(request.tile, l1.k, l2_k) && tile_config(request.tile).fp8();
    return {built, request.tile, 1, 1, built ? "forced FP8 tile, built for the MegaMoE kernel"
                                             : "forced tile: chained"};
  }
  // Not fused by the policy: the FP8 plan's 128 x 192 tile measured slower fused than chained,
  // like the exact mode's asynchronous tiles, and 128 x 256 is not built fused
  // (docs/tuning-log.md v32).
  return {false, TileId::kFp8Prefill128x192K2Async, 1, 1,
          "FP8 mode: chained (the gated FP8 launches; fused measured slower)"};
}

// kAuto splits only launches with at most half as many tiles as CTA slots.
int64_t split_k_counters_for(int sm_count) {
  return static_cast<int64_t>(sm_count) * kDecodeCtasPerSm / 2;
}

int64_t split_k_partial_floats_for(int sm_count) {
  static_assert(tile_config(TileId::kDecode128x16K2WarpSplitK).split_unit_floats() ==
                    tile_config(TileId::kDecode128x16K1WarpSplitK).split_unit_floats(),
                "the two split tiles take the same workspace");
  return static_cast<int64_t>(sm_count) * kDecodeCtasPerSm *
         tile_config(kSplitTile).split_unit_floats();
}

// Splits happen only where L1's (or L2's) tiles leave CTA slots idle: each GEMM's parts fill at
// most its CTA slots once, and its tiles at most half of them, while the other GEMM's tiles can
// be a few times more (H / 2I); so the workspace covers 4 CTA slots' worth of tiles and 8 slots'
// worth of parts.
int64_t mega_split_counters(int sm_count) {
  return 4LL * sm_count * kDecodeCtasPerSm;
}
int64_t mega_split_partial_floats(int sm_count) {
  return 8LL * sm_count * kDecodeCtasPerSm * tile_config(kSplitTile).split_unit_floats();
}

TileRequest parse_tile_request(std::string_view name) {
  if (name == "auto") return TileRequest::automatic();
  if (name == "serial") return TileRequest::serial();
  TileId id{};
  MEGAMOE_CHECK_ARG(tile_by_name(name, &id), "gemm tile: expected one of ", tile_request_names(),
                    "; got '", std::string(name), "'");
  return TileRequest::forced(id);
}

std::string to_string(const TileRequest& request) {
  switch (request.mode) {
    case TileRequest::Mode::kAuto: return "auto";
    case TileRequest::Mode::kSerial: return "serial";
    case TileRequest::Mode::kForced: return tile_config(request.tile).name;
  }
  return "?";
}

std::string tile_request_names() {
  std::string names = "auto, serial";
  for (const TileConfig& t : kTileTable) names += std::string(", ") + t.name;
  return names;
}

Fp8Plan plan_fp8_launches(int64_t k) {
  constexpr TileId kNarrow = TileId::kFp8Prefill128x192K2Async, kWide = TileId::kFp8Prefill128x256K2Async;
  static_assert(tile_config(kNarrow).k_multiple() == tile_config(kWide).k_multiple(),
                "one K rule for both FP8 launches");
  static_assert(tile_config(kNarrow).block_n >= kFp8WideMinAvg, "the narrow tile takes its rows");
  MEGAMOE_CHECK_ARG(k % tile_config(kNarrow).k_multiple() == 0, "sm90 gemm: FP8 mode: K (H for L1, "
                    "I for L2) must be a multiple of ", tile_config(kNarrow).k_multiple(), ", got ", k);
  return Fp8Plan{{{kNarrow, 0, kFp8WideMinAvg}, {kWide, kFp8WideMinAvg, 0}}};
}

std::ostream& operator<<(std::ostream& os, const TileConfig& t) {
  static constexpr const char* kMainloop[] = {"serial", "overlap"};
  static constexpr const char* kMma[] = {"wgmma", "warp-mma"};
  static constexpr const char* kEpilogue[] = {"registers", "staged", "async"};
  os << t.name << " {" << t.block_m() << " x " << t.block_n << " (n step " << t.n_step << "), "
     << t.math_warpgroups << " math warpgroups x " << t.m_blocks_per_warpgroup << " m-blocks, "
     << t.stages << " stages x " << t.k_blocks_per_stage << " k-blocks, " << t.ctas_per_sm
     << " CTAs/SM, " << kMainloop[static_cast<int>(t.mainloop)] << " mainloop, "
     << kMma[static_cast<int>(t.mma)] << ", " << kEpilogue[static_cast<int>(t.epilogue)]
     << " epilogue";
  if (t.epilogue_warpgroups > 1) os << " (" << t.epilogue_warpgroups << " warpgroups)";
  if (t.split_k) os << ", split-K";
  if (t.fp8()) os << ", e4m3 operands (FP8 mode)";
  return os << "}";
}

std::ostream& operator<<(std::ostream& os, TileId id) { return os << tile_config(id).name; }

}  // namespace megamoe::sm90
