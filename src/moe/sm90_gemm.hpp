// sm90_gemm.hpp: launchers of the Hopper expert GEMMs (the interface between the layer pipeline
// and the grouped-GEMM kernels). Kernels: kernels/sm90/.
//
// Both GEMMs are grouped over the rank's local experts. Their "rows" are the routed (token, slot)
// pairs sorted by local expert: rows of local expert e are [row_offsets[e], row_offsets[e+1]).
// Row buffers are allocated for `max_rows` rows plus kRowSlack extra rows, so a tile may read
// past the last row without leaving the allocation (those rows are never written back).
//
//   L1:  acc[r, n] = sum_k act[r, k] * W13_e[n, k]         n in [0, 2I), k in [0, H)
//        epilogue (numerics.md sections 4-5): g/u to BF16, activation, * row_weight[r],
//        per-32 requantization -> h_q[r, I] (e4m3), h_sf[r, I/32] (ue8m0), and h_act[r, I], the
//        same values dequantized to BF16 (exact), which is L2's operand.
//   L2:  out[r, n] = bf16( sum_j h_act[r, j] * W2_e[n, j] )   n in [0, H), j in [0, I)
//
// Requirements (checked, kInvalidArgument/kUnsupported naming the field): H % 64 == 0,
// I % 64 == 0, 1 <= E_l <= 1024, weights in the "sm90" layout (src/prep/sm90_layout.hpp),
// row_offsets non-decreasing with row_offsets[E_l] <= max_rows (checked on the device: a bad
// offset traps with a printed message). max_rows == 0 and experts without rows are valid.
// Bias: L1 adds the fp32 bias to the accumulators before the BF16 rounding of g/u; L2 computes
// out = bf16(acc + row_weight * bias).
//
// Operands in exact mode are BF16 values that carry E4M3 x 2^s and E2M1 x 2^s exactly; the
// products are exact and accumulation is FP32 (wgmma), so only summation order differs from the
// CPU reference.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/activation.hpp"

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace megamoe::sm90 {

constexpr int64_t kRowSlack = 256;  // extra rows allocated after max_rows in every row buffer

// Tile configuration of one launch (kernels/sm90/sm90_gemm_config.hpp). kAuto picks one from
// rows_hint and the expert count; the others force one (tests and the micro-benchmark compare
// them). Every choice computes the same function (FP32 sums of exact products; only the
// summation order may differ between configurations).
// The *Overlap / *Staged configurations use the overlapped mainloop (next block's conversion
// during the current wgmmas, one-multiply conversion; Staged: the L1 epilogue through shared
// memory). Measured on an H200 (docs/perf.md, GEMM tuning log) they beat the serial ones at every
// token count, so kAuto picks among them (= kAutoOverlap) when the weights' scales allow their
// one-multiply conversion (L1Args::small_scales); kAutoSerial is the former policy over the serial
// configurations, which kAuto takes for weights with a scale byte >= 128, and the environment
// variable MEGAMOE_SM90_GEMM_OVERLAP=0 (read once per process) makes kAuto behave as kAutoSerial.
enum class GemmTile : int {
  kAuto = 0,
  kDecode8 = 1,              // 64 weight rows x 8 token rows, 4 CTAs per SM
  kDecode16 = 2,             // 64 x 16, 4 CTAs per SM
  kPrefill = 3,              // 256 x up to 128
  kAutoOverlap = 4,
  // 5 was an overlapped 64 x 8 decode tile, removed after it failed on the H200.
  kDecode16Overlap = 6,
  kPrefillOverlap = 7,
  kPrefillWideOverlap = 8,   // 128 x up to 192
  kPrefillStaged = 9,        // kPrefillOverlap + L1 epilogue staged through shared memory
  kPrefillWideStaged = 10,   // kPrefillWideOverlap + the same
  kDecode16X2 = 11,          // 128 weight rows (two chains) x 16 token rows, serial, 4 CTAs per SM
  kDecode8X2 = 12,           // 128 x 8, serial
  kDecode16X2Overlap = 13,   // kDecode16X2 with the overlapped mainloop
  kAutoSerial = 14,          // kAuto's choice among the serial configs (1, 2, 3)
  kDecode16X4Overlap = 15,   // 256 weight rows (four chains) x 16, overlapped, 4 CTAs per SM
  kDecode16X2Overlap3 = 16,  // kDecode16X2Overlap with 3 CTAs per SM and 10 stages
  kDecode16X2K2 = 17,        // kDecode16X2Overlap with two k-blocks per pipeline stage
  kDecode16X4K2 = 18,        // kDecode16X4Overlap with two k-blocks per pipeline stage
  kDecode16X2K2x3 = 20,      // kDecode16X2K2 with 3 CTAs per SM and 5 stages
  // 21-24 were chained-mainloop tiles (prefill and decode), removed: no faster than their
  // overlapped twins (H200, 04ab6b1).
  kPrefillK2 = 25,           // kPrefillStaged with two k-blocks per stage (3 stages)
  // 26 was kPrefillStaged with the asynchronous epilogue (5 stages), removed: slower than 25.
  kPrefillAsyncK2 = 27,      // kPrefillK2 with the asynchronous epilogue (2 stages)
  kPrefillWideAsync = 28,    // kPrefillWideStaged with the asynchronous epilogue
  kDecode16X2K2Split = 29,   // kDecode16X2K2 taking k_splits (split-K, as does 48)
  kDecode8X2K2 = 30,         // 128 x 8, overlapped, two k-blocks per stage, 4 stages (kAuto's
                             // decode tile at <= 4 rows per expert with a unit counter before
                             // v16; now its warp-MMA version, 46)
  // 33 was kPrefillK2 with at most 96 token rows and 4 stages, removed: no faster than 25 or 34
  // (H200, 3f7d1ed).
  kPrefillAsyncK2N96 = 34,   // kPrefillAsyncK2 with at most 96 token rows, 3 stages (K % 128 == 0)
  kPrefillAsyncK2N64 = 35,   // kPrefillAsyncK2 with at most 64 token rows, 5 stages (the same)
  // 36 and 37 were three-math-warpgroup tiles with the asynchronous epilogue (192 x 96 and
  // 192 x 128), removed: no faster than 34 or 28 (H200, 550f76a).
  kPrefillAsyncK2N96E2 = 38, // kPrefillAsyncK2N96 with a second epilogue warpgroup (7 epilogue
                             // warps; kAuto's tile at 41-80 rows; K % 128 == 0)
  kDecode8X2K2Warp = 46,     // kDecode8X2K2 on warp-level MMAs (mma.sync m16n8k16); kAuto's
                             // decode tile at <= 4 rows per expert with a unit counter when K is
                             // not a multiple of 256 (53 otherwise)
  kDecode16X2K2Warp = 47,    // kDecode16X2K2 on warp-level MMAs; kAuto's other decode tile
  kDecode16X2K2SplitWarp = 48,  // kDecode16X2K2Split on warp-level MMAs; kAuto's split tile
  // 54 was kPrefillAsyncK2N96E2 with N steps of 8, now 38 itself (1.02x, H200, 4670141); 55, 56,
  // 57 and 58 were 38, 28, 25 and 54 with their wgmmas issued back to back, removed: 0.95-1.01x.
  // 59 was kPrefillWideAsync with N steps of 8, now 28 itself (1.01-1.02x, H200, c18793d).
  // 60 and 61 were 38 and 28 with A through shared memory (SS wgmmas), removed: 0.82-0.88x
  // (H200, b8762d1, tuning log v18).
  kDecode8X4KWarp = 53,      // kDecode8X2K2Warp with 4 k-blocks per stage, 2 stages (K % 256
                             // == 0); kAuto's 128 x 8 tile where K allows, 46 elsewhere
  // 49 and 50 were kDecode8X2K2Warp / kDecode16X2K2Warp on two math warpgroups of one 64-row
  // block each (8 math warps per CTA, 41-56 registers), removed: 1.05-1.1x slower at T = 1 and
  // 64 (L2 DeepSeek-V3 T = 1 27.0-27.3 against 24.9 us; H200, 1fe14a3, tuning log v16).
  // 51 and 52 were kDecode8X2K2Warp with 5 stages and kDecode16X2K2Warp with 4 (4 CTAs per SM
  // only with few local experts), removed: the same at T = 1 (DeepSeek-V3 L2 24.9 / 24.8 against
  // 24.8 / 24.9 us), within the noise at T = 8 and 64 (H200, 0fae221, tuning log v16).
  // 39 was kPrefillWideAsync with the second epilogue warpgroup, removed: 0.99-1.02x (H200,
  // a275c59). 41 (kPrefillWideAsync with two k-blocks per stage) and 42 (kPrefillAsyncK2N64 with
  // the second epilogue warpgroup) were candidates, removed: slower or no faster (H200, 0a483df).
  // 44 was the 128 x 8 tile on two math warpgroups of one 64-row block each (serial mainloop
  // with the one-multiply conversion, 4 CTAs per SM, 50 registers), removed: 1.2-1.5x slower
  // than 30 at T = 1, 8 and 64 (H200, 69080eb, tuning log v14).
  // 43 was kDecode8X2K2 with the paired issue (both weight blocks' wgmmas of a k-block in flight
  // together, one wait_group per k-block; 3 CTAs per SM, 6 stages: at 4 ptxas serialized its
  // wgmmas for lack of registers), removed: slower than 30 in 22 of 24 pairs at T = 1, 8 and 64
  // (0.98-1.20x; H200, 4bc0de5, tuning log v14).
  // 32 was a 64 x 8 tile with two k-blocks per stage (candidate), removed: 1.08-1.20x slower
  // than 30 at T = 1 and 8 (H200, dddf285).
  // 31 was kDecode16X2K2Split splitting only as many tiles as fill the idle CTA slots, removed:
  // no faster at T = 1 (H200, 64e566b); a stream-K version of it, slower, never shipped.
  // 19 was a three-math-warpgroup prefill tile (192 x 128), removed after it measured slower
  // than kPrefillStaged at every prefill point (H200, fe21102, docs/perf.md).
  // (17, 18, 20, 25, 27, 30, 29, 46, 47, 48: when K is not a multiple of 128 they run as their
  // one-k-block twins, 13, 15, 16, 9, the 5-stage async 256 x 128 tile, the 8-stage 128 x 8
  // overlapped tile, 13 with split-K, and the one-k-block warp-MMA tiles)
};

// Split-K workspace (optional). kAuto cuts the K loop of a decode launch into parts run as
// separate work units when its tiles would leave CTA slots idle (few experts hit, e.g.
// DeepSeek-V3 / Kimi-K3 at T = 1): each part stores FP32 partial accumulators here and the
// tile's last part adds them in part order (deterministic) before the epilogue. Owned by the
// caller: `counters` zero-initialized once (every launch leaves them zero); one workspace serves
// the launches of one stream in turn, not two launches running at the same time. Sizes:
// split_k_counters() / split_k_partial_floats() cover every split kAuto picks; a launch that
// would need more runs unsplit.
//
// unit_counter (optional, 2 int32, zero-initialized once, left zero by every launch): the decode
// tiles then take their work units at run time (the first one per CTA fixed, every further one
// from this counter), so a launch stays balanced wherever its CTAs were placed; with it, they
// also let the next kernel of the stream start early (programmatic launches). Launches of one
// stream may share it (a launch takes units only after the previous kernel has completed).
struct SplitKWorkspace {
  float* partials = nullptr;
  int64_t partial_floats = 0;
  int32_t* counters = nullptr;
  int counters_capacity = 0;
  int32_t* unit_counter = nullptr;
  bool empty() const { return partials == nullptr || counters == nullptr; }
};
constexpr int kMaxKSplits = 4;
#if defined(MEGAMOE_WITH_CUDA)
int split_k_counters();            // on the current device
int64_t split_k_partial_floats();  // on the current device
#endif

struct L1Args {
  int num_experts = 0;                  // E_l
  int64_t hidden = 0;                   // H (reduction)
  int64_t intermediate = 0;             // I (output: 2I accumulators, I activations)
  int64_t max_rows = 0;                 // capacity in rows (host-known upper bound of routed rows)
  int64_t rows_hint = 0;                // kAuto's estimate of this call's routed rows (0 =
                                        // max_rows); picks the tile config only, never a limit:
                                        // any number of rows up to max_rows runs correctly.
                                        // Sm90Layer passes T*K on one GPU and the rank's
                                        // expected share T*K*E_l/E under expert parallelism
  int64_t rows_per_expert_max = 0;      // optional: the most rows one expert can get (T: one
                                        // slot per token; 0: unknown). When kAuto would pick
                                        // another kind of tile for that many than for rows_hint,
                                        // it launches one per kind, each gated on the actual rows
                                        // per hit expert (only one runs; GemmParams)
  const int32_t* row_offsets = nullptr; // device int32 [E_l + 1]
  const uint16_t* act = nullptr;        // device bf16 [max_rows + kRowSlack, H]
  const float* row_weights = nullptr;   // device fp32 [max_rows]
  const uint8_t* w13 = nullptr;         // device, sm90 prepared layout
  const uint8_t* w13_sf = nullptr;      // device, sm90 prepared layout
  bool small_scales = false;            // every scale byte of w13_sf is < 128 (scale <= 2^0;
                                        // scales_all_small). The overlapped configs need it
                                        // (one exact multiply per converted register); without
                                        // it kAuto runs the serial configs (any scale, slower)
                                        // and a forced overlapped tile is refused
  const uint16_t* w13_bias = nullptr;   // device bf16 [E_l, 2I] canonical row order, or nullptr
  Activation activation;
  bool fast_math = true;
  uint8_t* h_q = nullptr;               // device e4m3 [max_rows, I], 8-byte aligned
  uint8_t* h_sf = nullptr;              // device ue8m0 [max_rows, I/32]
  uint16_t* h_act = nullptr;            // device bf16 [max_rows + kRowSlack, I], 16-byte aligned
  GemmTile tile = GemmTile::kAuto;      // tile configuration (kAuto: chosen from rows_hint)
  SplitKWorkspace split_k;              // optional (empty: never split)
  int k_splits = 0;                     // 0: kAuto's choice; 1: unsplit; n in [2, kMaxKSplits]:
                                        // n parts (the split tiles, kDecode16X2K2Split and
                                        // kDecode16X2K2SplitWarp; needs split_k)
  // Programmatic dependent launch (runtime/cuda_launch.hpp): the kernel may start while the
  // previous kernel of the stream still runs; it builds its tile schedule from row_offsets and
  // issues its first weight copies at once, and waits for that kernel before it reads act /
  // h_act, row_weights or the split-K workspace and before it writes anything. So row_offsets
  // must not be written by the previous kernel itself: Sm90Layer's route runs two launches
  // earlier (route, gather, L1, L2), and a megamoe kernel that lets its successor start early
  // does so only after its own wait, so route has completed when L1 or L2 starts.
  bool programmatic = false;
};

struct L2Args {
  int num_experts = 0;
  int64_t hidden = 0;                   // H (output)
  int64_t intermediate = 0;             // I (reduction)
  int64_t max_rows = 0;
  int64_t rows_hint = 0;                // as in L1Args
  int64_t rows_per_expert_max = 0;      // as in L1Args
  const int32_t* row_offsets = nullptr; // device int32 [E_l + 1]
  const uint16_t* h_act = nullptr;      // device bf16 [max_rows + kRowSlack, I]
  const float* row_weights = nullptr;   // device fp32 [max_rows] (scales the L2 bias only)
  const uint8_t* w2 = nullptr;          // device, sm90 prepared layout
  const uint8_t* w2_sf = nullptr;       // device, sm90 prepared layout
  bool small_scales = false;            // as in L1Args, for w2_sf
  const uint16_t* w2_bias = nullptr;    // device bf16 [E_l, H], or nullptr
  uint16_t* out = nullptr;              // device bf16 [max_rows, H]
  GemmTile tile = GemmTile::kAuto;      // as in L1Args
  SplitKWorkspace split_k;              // as in L1Args
  int k_splits = 0;                     // as in L1Args
  bool programmatic = false;            // as in L1Args
};

#if defined(MEGAMOE_WITH_CUDA)
// The launches kAuto makes for one GEMM (docs/design.md, gated launches): launch i runs only if
// the actual rows per hit expert lie in (gate_min_avg, gate_max_avg] (0: open on that side), on
// kAuto's tile for `rows` estimated rows. One launch with both bounds 0: ungated. The intervals
// of a plan cover every average exactly once (GPU test file, Sm90GemmPlan).
struct GatedLaunch {
  int gate_min_avg = 0, gate_max_avg = 0;
  int64_t rows = 0;
};
struct LaunchPlan {
  GatedLaunch launch[3];
  int count = 0;
};
LaunchPlan plan_launches(int64_t rows_hint, int64_t rows_per_expert_max, int num_experts,
                         int64_t max_rows);

// What a forced tile (not kAuto*) asks of a launch: weight scale bytes < 128 (its overlapped
// mainloop's one-multiply conversion; L1Args::small_scales) and K (H for L1, I for L2) a multiple
// of k_multiple (64 for every tile but those without a one-k-block twin, 128). Throws
// kInvalidArgument for kAuto, kAutoOverlap, kAutoSerial and values that are not a GemmTile.
struct TileTraits {
  bool needs_small_scales = false;
  int k_multiple = 64;
};
TileTraits tile_traits(GemmTile tile);

// Whether every one of `bytes` scale bytes at device pointer `sf` is < 128 (weight scales
// <= 2^0: L1Args / L2Args::small_scales). One pass over the bytes on `stream`, then a host
// synchronization of it: for weight loading, not inside a layer call.
bool scales_all_small(const uint8_t* sf, int64_t bytes, cudaStream_t stream);

// Asynchronous on `stream`; no host synchronization and no allocation (CUDA-graph capturable).
void launch_l1(const L1Args& args, cudaStream_t stream);
void launch_l2(const L2Args& args, cudaStream_t stream);

#if defined(MEGAMOE_DIAG_TIMELINE) && MEGAMOE_DIAG_TIMELINE
// Measurement builds only (kernels/sm90/sm90_diag_timeline.cuh): the stamps of the last GEMM
// launch, [CTA][diag::kNumEvents] (zeros for CTAs that did not run), and the table cleared.
// Synchronizes the device.
std::vector<uint64_t> diag_read_timeline();
#endif
#endif

}  // namespace megamoe::sm90
