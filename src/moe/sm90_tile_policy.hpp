// sm90_tile_policy.hpp: which shipped tile (kernels/sm90/sm90_tiles.hpp) a Hopper expert GEMM
// launch runs. A pure function of the launch's shape, its row estimate and the SM count, so the
// CPU tests check it for every shape and token count of targets.md (tests/cpp/test_tile_policy.cpp).
// The launcher (sm90_gemm.cu) only adds what it knows at run time: the SM count and the
// workspace it was given.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>

#include "sm90/sm90_tiles.hpp"

namespace megamoe::sm90 {

std::ostream& operator<<(std::ostream& os, const TileConfig& tile);
std::ostream& operator<<(std::ostream& os, TileId id);

// What the caller asks of a launch: the policy (kAuto), the policy restricted to the serial
// mainloop (kSerial: exact for every scale byte, slower), or one tile (kForced).
struct TileRequest {
  enum class Mode : uint8_t { kAuto, kSerial, kForced };
  Mode mode = Mode::kAuto;
  TileId tile = TileId::kSerial64x8;  // kForced only

  static TileRequest automatic() { return {}; }
  static TileRequest serial() { return {Mode::kSerial, TileId::kSerial64x8}; }
  static TileRequest forced(TileId id) { return {Mode::kForced, id}; }
  bool operator==(const TileRequest&) const = default;
};
// "auto", "serial" or a tile name of the table; throws kInvalidArgument listing the valid names.
TileRequest parse_tile_request(std::string_view name);
std::string to_string(const TileRequest& request);
// Every name parse_tile_request accepts, comma-separated.
std::string tile_request_names();

// One GEMM launch as the policy sees it.
struct TileQuery {
  int64_t rows_hint = 0;      // estimated routed rows of the launch (0: max_rows)
  int64_t max_rows = 0;       // capacity in rows
  int num_experts = 0;        // E_l
  int64_t m_rows = 0;         // weight rows per expert: 2I (L1) or H (L2)
  int64_t k = 0;              // reduction: H (L1) or I (L2), a multiple of 64
  int sm_count = 0;
  bool small_scales = false;  // every weight scale byte < 128 (the overlapped tiles need it)
  bool serial_only = false;   // TileRequest::Mode::kSerial
  bool unit_counter = false;  // the decode tiles can take work units at run time
  // Split-K is possible: k_splits left to the policy and a workspace of these capacities.
  bool split_allowed = false;
  int64_t split_counters_capacity = 0;
  int64_t split_partial_floats = 0;
};

struct TileChoice {
  TileId tile = TileId::kSerial64x8;
  int k_splits = 1;
  const char* reason = "";  // one line: the rule that chose it
};

// FP8 mode (the E4M3 tiles, TileConfig::fp8): the launches of an FP8 GEMM of reduction K (a
// multiple of 128; kInvalidArgument otherwise), each gated on the actual rows per hit expert
// (GemmParams::gate_min_avg / gate_max_avg: exactly one runs): 128 x 192 up to kFp8WideMinAvg
// rows per expert, 128 x 256 above (each expert's rows in one n-tile, its weights converted once
// per 256 rows instead of twice; docs/tuning-log.md). The layer runs the FP8 mode only from
// LayerConfig::fp8_min_rows_per_expert on.
constexpr int kFp8WideMinAvg = 192;
struct Fp8Launch {
  TileId tile;
  int gate_min_avg, gate_max_avg;
};
constexpr int kNumFp8Launches = 2;
struct Fp8Plan {
  Fp8Launch launch[kNumFp8Launches];
};
Fp8Plan plan_fp8_launches(int64_t k);

TileChoice choose_tile(const TileQuery& q);

// The classes of rows per expert that need different tiles: the 128 x 8 decode tile's, the
// other decode tiles', the prefill tiles'. Their upper bounds (the last is open).
constexpr int kRowClasses = 3;
constexpr int64_t kDecode8MaxAvgRows = 4;
constexpr int64_t kDecodeMaxAvgRows = 12;

// Gated launches (GemmParams::gate_min_avg / gate_max_avg): where the most rows one expert can
// get (rows_per_expert_max, e.g. T) falls in the prefill class while the estimate falls in a
// decode class, one launch per class from the estimate's to the prefill one, each running only
// if the actual rows per hit expert lie in its interval (the first open below, the last open
// above), so exactly one of them runs. Launch i uses the policy's tile for `rows`.
struct GatedLaunch {
  int gate_min_avg = 0, gate_max_avg = 0;
  int64_t rows = 0;
};
struct LaunchPlan {
  GatedLaunch launch[kRowClasses];
  int count = 0;
};
LaunchPlan plan_launches(int64_t rows_hint, int64_t rows_per_expert_max, int num_experts,
                         int64_t max_rows);

// The MegaMoE kernel (kernels/sm90/sm90_mega_moe.cuh: L1 and L2 in one persistent launch) runs
// one tile for both GEMMs, from the tiles it is built for (kMegaTiles). Its rule: small scales
// (the overlapped tiles), no serial request, at least 8 estimated rows in the launch (fewer:
// chained, measured faster there). Calls whose row estimate is in a decode class
// (<= kDecodeMaxAvgRows per expert): L1's tiles alone come first (every L2 tile waits for L1
// tiles) and L2's alone last, so where either would leave CTA slots idle it is split in K as its
// chained decode launch would split it (the 128 x 8 split tile up to kDecode8MaxAvgRows rows per
// expert where both K are multiples of 256, else the 128 x 16 one; parts only where the fused
// kernel's split workspace holds them with the other GEMM's, L2's dropped first); otherwise the
// 128 x 8 tile up to kDecode8MaxAvgRows rows per expert, 128 x 16 above; each the sibling that
// takes both K (H and I). Prefill calls: the tile choose_tile gives L1 (its sibling for K) where it is a staged
// 256 x 128 tile that takes both K; the asynchronous prefill tiles are built and run when forced,
// but the policy chains them (measured slower fused; kPrefill256x96K2Async2 is not built: its
// mainloop spills in the fused kernel; docs/tuning-log.md v29).
// A forced tile that the kernel is built for runs as forced (unsplit). Otherwise nothing (the
// caller chains the two GEMM launches). `l1` is L1's query (its split fields included).
inline constexpr TileId kMegaTiles[] = {
    TileId::kDecode128x8K4Warp,        TileId::kDecode128x8K2Warp,
    TileId::kDecode128x8K1Warp,        TileId::kDecode128x16K2Warp,
    TileId::kDecode128x16K1Warp,       TileId::kDecode128x16K2WarpSplitK,
    TileId::kDecode128x16K1WarpSplitK, TileId::kDecode128x8K4WarpSplitK,
    TileId::kPrefill128x192Async,      TileId::kPrefill256x64K2Async,
    TileId::kPrefill256x128K2Staged,   TileId::kPrefill256x128K1Staged,
    TileId::kFp8Prefill128x192K2Async, TileId::kFp8Prefill256x128K2Staged};
constexpr int kNumMegaTiles = 14;
constexpr int mega_tile_index(TileId id) {
  for (int i = 0; i < kNumMegaTiles; ++i) {
    if (kMegaTiles[i] == id) return i;
  }
  return -1;
}
namespace policy_detail {
constexpr bool mega_tiles_valid() {
  for (TileId id : kMegaTiles) {
    if (!tile_config(id).mega_kernel() || mega_tile_index(shallower_sibling(id)) < 0) return false;
  }
  return sizeof(kMegaTiles) / sizeof(kMegaTiles[0]) == kNumMegaTiles;
}
}  // namespace policy_detail
static_assert(policy_detail::mega_tiles_valid(), "the MegaMoE kernel's tiles are TileConfig::mega_kernel "
              "tiles, and each one's shallower siblings are built too");
struct MegaChoice {
  bool fused = false;  // false: chain the two GEMM launches
  TileId tile = TileId::kDecode128x16K2Warp;
  int l1_splits = 1;   // K parts of each L1 tile (a split tile)
  int l2_splits = 1;   // K parts of each L2 tile
  const char* reason = "";
};
MegaChoice choose_mega_tile(const TileQuery& l1, int64_t l2_k, bool l2_small_scales,
                            const TileRequest& request);
// The FP8 mode's (E4M3 rows; the kernel's rebase units turn L1's rows into L2's): a forced FP8
// tile the kernel is built for (128 x 192, 256 x 128 staged) runs fused; otherwise chained: the
// FP8 plan's tile up to kFp8WideMinAvg rows per expert, 128 x 192, measured slower fused than
// chained (docs/tuning-log.md v32), and 128 x 256 above is not built fused (its 128 accumulators
// per thread leave the kernel short of registers: ptxas serializes its wgmmas). Exact-mode
// tiles (forced) are chained.
MegaChoice choose_mega_fp8_tile(const TileQuery& l1, int64_t l2_k, const TileRequest& request);

// Split-K workspace the policy may use on a device of `sm_count` SMs: tiles that can be split
// (counters) and FP32 partials (at most one unit per CTA slot of the split tile).
int64_t split_k_counters_for(int sm_count);
int64_t split_k_partial_floats_for(int sm_count);
constexpr int kMaxKSplits = 4;
// The MegaMoE kernel's split-K workspace (MegaWorkspace::split_*), which covers every split
// choose_mega_tile makes on `sm_count` SMs: the tiles of both GEMMs (counters) and both GEMMs'
// parts (FP32 partials).
int64_t mega_split_counters(int sm_count);
int64_t mega_split_partial_floats(int sm_count);

}  // namespace megamoe::sm90
