// sm90_gemm.cu: launchers of the Hopper grouped expert GEMMs (kernels/sm90/), with input checks,
// the tile-config choice, the TMA descriptor of the token rows, and the persistent grid size.
#include "moe/sm90_gemm.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "megamoe/error.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "runtime/cuda_launch.hpp"
#include "sm90/sm90_grouped_gemm_bf16_mxfp4.cuh"

namespace megamoe::sm90 {
namespace {

// Average routed rows per active expert above which the prefill config is used.
// NOTES: at or below 16 rows the decode config's BLOCK_N = 16 covers an expert in one tile and its
// 64-row weight tiles spread the weight stream over all SMs; above it, the prefill config's
// 256 x 128 tiles reuse each weight tile for up to 128 rows.
constexpr int64_t kDecodeMaxAvgRows = 16;
// The overlapped configs switch earlier: at 16 average rows (DeepSeek-V3, T = 512) the staged
// prefill tiles ran 14 % (L1) and 12 % (L2) faster than the overlapped 16-row decode tile, at 9
// (Kimi-K3, T = 512) 15 % slower (H200, revision c68aefa, docs/perf.md).
constexpr int64_t kDecodeOverlapMaxAvgRows = 12;
// (At 16 average rows the 128-row two-k-block decode tile was used until the staged prefill
// tiles got two k-blocks per stage and the stmatrix epilogues: PrefillK2 then beat it 1.18x (L1)
// and 1.20x (L2) at DeepSeek-V3 T = 512; H200, revision 59c5d80.)
// The 128-row decode tile (Decode16X2Overlap) is used when its tiles cover at least 3/4 of the
// CTA slots (SMs x 4): on the H200 (revision c2f4f9b) it streamed weights 1.1-1.2x faster than
// the 64-row tile from T = 8 up, and at T = 1 whenever it had enough tiles (Kimi-K3 L1: 512
// tiles, 117 against 123 us; DeepSeek-V3 L2: 448 tiles, 45 against 52 us), but lost with half
// the slots empty (DeepSeek-V3 L1 at T = 1: 256 tiles, 105 against 82 us).
// It runs with two k-blocks per pipeline stage (Decode16X2K2; its one-k-block twin when K is not
// a multiple of 128): 1.05-1.13x faster than Decode16X2Overlap at every decode point of both
// shapes, and faster than the 256-row tiles with one or two k-blocks per stage (Decode16X4Overlap,
// kAuto's former pick at <= 4 average rows, and Decode16X4K2) except within 1 % at Kimi-K3 T = 64
// L2 (H200, revision fe21102, docs/perf.md).
constexpr int64_t kDecodeX2Rows = Decode16X2K2Config::kBlockM;
constexpr int64_t kDecodeCtasPerSm = Decode16X2K2Config::kMinBlocksPerSM;
// With 3 CTAs per SM (Decode16X2K2x3) when that grid's waves are >= 10 % fuller: the last wave
// of a persistent launch leaves slots idle, e.g. Kimi-K3 L1 at T = 1 (768 tiles: 73 % of 2 waves
// of 528 slots, 97 % of 2 waves of 396). In full waves 3 CTAs per SM streamed 3-5 % slower than
// 4 (Decode16X2Overlap3 against Decode16X2Overlap, revision c375334).
static_assert(Decode16X2K2x3Config::kBlockM == kDecodeX2Rows, "same tile");
constexpr int64_t kDecodeCtasPerSm3 = Decode16X2K2x3Config::kMinBlocksPerSM;

// Split-K (decode launches with few tiles): the K parts fill the CTA slots that the tiles leave
// idle, in one wave: parts = slots / tiles (at most kMaxKSplits and the pipeline stages of K).
// NOTES: why one wave: at T = 1 on the H200 (revision 6bfe8a4, bench/results/gemm_bench_6bfe8a4.txt)
// DeepSeek-V3 L1 (256 tiles of 128 rows, 528 slots) ran 1.30x faster in 2 parts (512 units) but
// slower in 3 or 4 (a second wave); launches with more tiles than half the slots (448, 768) only
// lost (1.25-2.3x slower with 2-4 parts): every unit pays its pipeline fill and the partials'
// round trip, which a full grid does not win back.
int split_k_parts(int64_t tiles, int64_t slots, int64_t stages) {
  if (tiles <= 0) return 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({slots / tiles, kMaxKSplits, stages})));
}

// NOTES (rejected, v9): a launch with between half and all as many tiles as slots (Kimi-K3 and
// DeepSeek-V3 L2 at T = 1: 448 tiles, 80 slots idle) leaves its last CTAs to end 1.25x after the
// median SM (MEGAMOE_DIAG_TIMELINE, H200, d3cce03). Neither evening the work out per CTA
// (stream-K: every CTA an equal range of K stages, tiles cut at range boundaries; 1.3-1.4x
// slower, every CTA paying its cut tiles' hand-offs) nor per SM (the last slots - tiles tiles in
// two K parts, one unit per slot: Kimi-K3 L2 42.9 against 42.9 us, DeepSeek-V3 L2 30.6 against
// 29.9; 64e566b) moved the last CTAs' end: the tail is not the tile count per SM.
// NOTES (rejected, v15): the timeline of the 128 x 8 tile at T = 1 (DeepSeek-V3 L2, 448 tiles)
// shows the 52 SMs that run four units ending at 25.5 us on average against 20.8 for the 80 that
// run three (Kimi-K3 L2 35.4 / 29.1; bench/results/timeline_2e72c98.txt). Halving the last
// (slots - tiles) tiles in M instead of K (two one-block units, no hand-off, the missing block's
// conversion skipped; every SM then 3 or 3.5 tiles' worth) measured 0.97-1.01x (H200, f63a1d1,
// bench/results/gemm_ab_f63a1d1_*.txt): four CTAs busy on every SM convert no faster in total.

// Fraction of the CTA slots busy over the waves of a persistent launch of `tiles` tiles.
double wave_fill(int64_t tiles, int64_t slots) {
  const int64_t waves = (tiles + slots - 1) / slots;
  return waves == 0 ? 1.0 : static_cast<double>(tiles) / static_cast<double>(waves * slots);
}
constexpr int64_t kDecodeFillNum = 3, kDecodeFillDen = 4;
// At or below 4 average rows, 8-row tiles (half the B bytes per stage; most experts get 1-3 rows).
constexpr int64_t kDecode8MaxAvgRows = 4;
// Average rows in (112, 166] (overlapped configs only): the 128 x 192 tiles (PrefillWide) hold an
// expert's rows in one n-tile (uniform routing spreads counts by ~sqrt(avg), so ~1.15 x avg stays
// within 192) where 256 x 128 tiles would split most experts into 128 + a small remainder.
// Both GEMMs run the asynchronous epilogue there (PrefillWideAsync): for L1 1.04x at Kimi-K3
// T = 8192, 1.09x at DeepSeek-V3 T = 4096 over PrefillWideStaged (59c5d80); for L2 1.02-1.09x over
// PrefillWideStaged in each of the last three runs (Kimi-K3 T = 8192 474 / 472 / 479 TFLOP/s
// against 458 / 448 / 471, DeepSeek-V3 T = 4096 434 / 428 / 455 against 422 / 410 / 416; H200,
// 22bacc4, bfaad7c, b59f869), where at 59c5d80 the staged tile had led at Kimi-K3 T = 8192
// (1.08x); L2 ran PrefillWideStaged until then. Outside that range (and above
// kAsyncN96MaxAvgRows, or when K is not a multiple of 128) both GEMMs run PrefillK2
// (256 x 128, two k-blocks per stage):
// 1.07-1.36x over the former PrefillStaged (L1) / PrefillOverlap (L2) picks at T >= 4096 (H200,
// revision 59c5d80, bench/results/gemm_bench_59c5d80.txt).
constexpr int64_t kWideMinAvgRows = 112;
constexpr int64_t kWideMaxAvgRows = 166;
// Average rows in (kDecodeOverlapMaxAvgRows, 80] (overlapped configs, K a multiple of 128): the
// 256 x 96 tile with the asynchronous epilogue (PrefillAsyncK2N96, 3 stages). Where PrefillK2 runs
// wgmma N <= 96 anyway, its smaller B stage leaves room for the staging of the asynchronous
// epilogue with one stage more than the 128-row version (PrefillAsyncK2, 2 stages). Measured
// against PrefillK2 (H200, 3f7d1ed, bench/results/gemm_bench_3f7d1ed.txt): Kimi-K3 T = 4096
// (73 rows) L1 1.06x, L2 1.04x; DeepSeek-V3 T = 512 (16 rows) L1 1.14x, L2 1.06x.
// NOTES: 80 leaves the largest expert of uniform routing within 96 rows (~1.8 sigma at 80);
// above it experts start to need a second n-tile, which costs a whole K loop of conversion.
// Since v13 the tile runs with a second epilogue warpgroup (PrefillAsyncK2N96E2: 7 epilogue warps
// instead of 3): against PrefillAsyncK2N96, forced, two runs in one call (H200, a275c59,
// bench/results/gemm_bench_a275c59_*.txt), Kimi-K3 T = 4096 L1 390 / 389 against 369 / 368
// TFLOP/s (1.06x), L2 425 / 419 against 401 / 399 (1.05x); DeepSeek-V3 T = 2048 (64 rows) L1
// 1.01x, L2 1.04x; Kimi-K3 T = 2048 (37 rows, where kAuto takes the 64-row tile) 0.98x / 1.02x.
constexpr int64_t kAsyncN96MaxAvgRows = 80;
// At or below 40 average rows the 256 x 64 version (PrefillAsyncK2N64, 5 stages): against the
// 96-row one (H200, dd2ab35, bench/results/gemm_bench_dd2ab35.txt) Kimi-K3 T = 1024 (18 rows) L1
// 1.01x, L2 1.10x, T = 2048 (37 rows) 1.03x / 1.03x; DeepSeek-V3 T = 512 (16 rows) 1.02x /
// 1.03x, T = 1024 (32 rows) 1.02x / 0.96x. 40 keeps the largest expert of uniform routing within
// 64 rows (~3.8 sigma).
constexpr int64_t kAsyncN64MaxAvgRows = 40;

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult query{};
    MEGAMOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                        cudaEnableDefault, &query));
    MEGAMOE_CHECK(query == cudaDriverEntryPointSuccess && ptr != nullptr, ErrorCode::kCuda,
                  "cuTensorMapEncodeTiled: driver entry point not found");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// Row-major bf16 [rows, cols] token rows, read in boxes of box_rows x 64 with 128-byte swizzle.
CUtensorMap make_rows_map(const uint16_t* base, int64_t rows, int64_t cols, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * sizeof(uint16_t)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(sm90_layout::kBlockK),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t*>(base), dims, strides, box,
      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MEGAMOE_CHECK(res == CUDA_SUCCESS, ErrorCode::kCuda, "cuTensorMapEncodeTiled failed (error ",
                static_cast<int>(res), ") for rows ", rows, " cols ", cols, " box rows ", box_rows);
  return map;
}

template <class Cfg, GemmKind kKind>
void launch_config(const GemmParams& p, const uint16_t* b_rows, cudaStream_t stream) {
  auto* kernel = &sm90_grouped_gemm_bf16_mxfp4_kernel<Cfg, kKind>;
  if (p.k_splits > 1) {
    MEGAMOE_CHECK_ARG(Cfg::kSupportsSplitK, "sm90 gemm: k_splits: only the split tiles ",
                      "kDecode16X2K2Split (", static_cast<int>(GemmTile::kDecode16X2K2Split),
                      ") and kDecode16X2K2SplitWarp (",
                      static_cast<int>(GemmTile::kDecode16X2K2SplitWarp),
                      ") split K; this tile runs unsplit: expected k_splits <= 1, got ",
                      p.k_splits);
    const int stages = p.k / Cfg::kBlockK / Cfg::kKBlocksPerStage;
    MEGAMOE_CHECK_ARG(p.k_splits <= stages, "sm90 gemm: k_splits: expected at most the ", stages,
                      " pipeline stages of K = ", p.k, ", got ", p.k_splits);
  }
  MEGAMOE_CHECK_ARG(!Cfg::kOverlapConvert || p.small_scales != 0,
                    "sm90 gemm: the overlapped tiles convert with one multiply, exact only for "
                    "weight scale bytes < 128 (L1Args / L2Args::small_scales, scales_all_small); "
                    "these weights have a larger scale (or small_scales was not set): use kAuto, "
                    "which runs the serial tiles for them, or a serial tile");
  const auto& dev = cuda::device_info();
  const size_t smem = Cfg::smem_bytes(p.num_experts);
  MEGAMOE_CHECK(static_cast<int64_t>(Cfg::smem_bytes(kMaxLocalExperts)) <= dev.smem_per_block_optin,
                ErrorCode::kUnsupported, "sm90 gemm: needs ", Cfg::smem_bytes(kMaxLocalExperts),
                " bytes of shared memory per block, device allows ", dev.smem_per_block_optin);
  static std::once_flag once;
  std::call_once(once, [&] {
    MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(Cfg::smem_bytes(kMaxLocalExperts))));
  });
  const CUtensorMap map =
      make_rows_map(b_rows, static_cast<int64_t>(p.max_rows) + kRowSlack, p.k, Cfg::kBlockN);
  const int grid = dev.sm_count * Cfg::kMinBlocksPerSM;
  cuda::launch(kernel, grid, Cfg::kThreads, smem, stream, p.prefetch_before_wait != 0, map, p);
}

// K (a multiple of 64, check_common) is a whole number of the config's pipeline stages.
template <class Cfg>
bool k_fits_stages(int64_t k) {
  return (k / sm90_layout::kBlockK) % Cfg::kKBlocksPerStage == 0;
}

// Pipeline stages of K for a config launched through launch_k_staged (its twin, one k-block per
// stage, when K is not a multiple of its stage depth).
template <class Cfg>
int64_t k_staged_stages(int64_t k) {
  const int64_t k_blocks = k / sm90_layout::kBlockK;
  return k_fits_stages<Cfg>(k) ? k_blocks / Cfg::kKBlocksPerStage : k_blocks;
}

// A config with several k-blocks per stage when K is a multiple of its stage depth, else its
// one-k-block twin (same tile, same function).
template <class Cfg, class Twin, GemmKind kKind>
void launch_k_staged(const GemmParams& p, const uint16_t* b_rows, cudaStream_t stream) {
  static_assert(Twin::kKBlocksPerStage == 1 && Twin::kBlockM == Cfg::kBlockM &&
                    Twin::kBlockN == Cfg::kBlockN, "the twin is the same tile");
  if (k_fits_stages<Cfg>(p.k)) {
    launch_config<Cfg, kKind>(p, b_rows, stream);
  } else {
    launch_config<Twin, kKind>(p, b_rows, stream);
  }
}

// A config with several k-blocks per stage that has no one-k-block twin: K must be a multiple of
// its stage depth.
template <class Cfg, GemmKind kKind>
void launch_k_multiple(const GemmParams& p, const uint16_t* b_rows, cudaStream_t stream) {
  constexpr int kStageK = Cfg::kKBlocksPerStage * sm90_layout::kBlockK;
  MEGAMOE_CHECK_ARG(k_fits_stages<Cfg>(p.k), "sm90 gemm: tile with ", Cfg::kKBlocksPerStage,
                    " k-blocks per stage: expected K (the reduction: H for L1, I for L2) a "
                    "multiple of ", kStageK, ", got ", p.k);
  launch_config<Cfg, kKind>(p, b_rows, stream);
}

// kAuto picks among the overlapped-mainloop configs unless MEGAMOE_SM90_GEMM_OVERLAP=0 or the
// weights have a scale byte >= 128 (GemmParams::small_scales: their one-multiply conversion is
// exact only below), else among the serial ones.
bool auto_overlaps(const GemmParams& p) {
  static const bool on = [] {
    const char* v = std::getenv("MEGAMOE_SM90_GEMM_OVERLAP");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on && p.small_scales != 0;
}

// MEGAMOE_SM90_GEMM_TILE=<GemmTile number> (read once per process) replaces kAuto's choice in
// every launch: for profiling a candidate tile inside the layer (`megamoe bench` under Nsight
// Compute). 0 or unset: kAuto's policy. A number that is not a GemmTile fails at the launch.
GemmTile forced_tile() {
  static const GemmTile tile = [] {
    const char* v = std::getenv("MEGAMOE_SM90_GEMM_TILE");
    return v == nullptr ? GemmTile::kAuto : static_cast<GemmTile>(std::atoi(v));
  }();
  return tile;
}

// kAuto's reading of a row estimate (0: the capacity): spread over as many experts as there are
// rows, up to E_l (the most experts they can hit), and the rows per expert.
struct RowEstimate {
  int64_t active, avg;
};
RowEstimate estimate_rows(int64_t rows_hint, int64_t max_rows, int num_experts) {
  const int64_t rows = rows_hint > 0 ? std::min<int64_t>(rows_hint, max_rows) : max_rows;
  const int64_t active = std::max<int64_t>(1, std::min<int64_t>(rows, num_experts));
  return {active, rows / active};
}

// How a forced tile takes K: any multiple of 64 (kAny), its one-k-block twin when K is not a
// multiple of its stage depth (kTwin), or only a multiple of its stage depth (kMultiple).
enum class KRule { kAny, kTwin, kMultiple };
template <class T>
struct TypeTag {
  using type = T;
};
template <KRule kRule>
using KRuleTag = std::integral_constant<KRule, kRule>;

// The configuration of each forced tile, in one place: calls f(TypeTag<Cfg>, TypeTag<Twin>,
// KRuleTag) (Twin = Cfg unless the rule is kTwin) and returns true, or returns false for kAuto*
// and values that are not a GemmTile.
template <class F>
bool with_tile_config(GemmTile tile, F&& f) {
  auto any = [&](auto cfg) { f(cfg, cfg, KRuleTag<KRule::kAny>{}); };
  auto twin = [&](auto cfg, auto one) { f(cfg, one, KRuleTag<KRule::kTwin>{}); };
  auto multiple = [&](auto cfg) { f(cfg, cfg, KRuleTag<KRule::kMultiple>{}); };
  switch (tile) {
    case GemmTile::kDecode8: any(TypeTag<Decode8Config>{}); return true;
    case GemmTile::kDecode16: any(TypeTag<DecodeConfig>{}); return true;
    case GemmTile::kPrefill: any(TypeTag<PrefillConfig>{}); return true;
    case GemmTile::kDecode16Overlap: any(TypeTag<DecodeOverlapConfig>{}); return true;
    case GemmTile::kPrefillOverlap: any(TypeTag<PrefillOverlapConfig>{}); return true;
    case GemmTile::kPrefillWideOverlap: any(TypeTag<PrefillWideOverlapConfig>{}); return true;
    case GemmTile::kPrefillStaged: any(TypeTag<PrefillStagedConfig>{}); return true;
    case GemmTile::kPrefillWideStaged: any(TypeTag<PrefillWideStagedConfig>{}); return true;
    case GemmTile::kDecode16X2: any(TypeTag<Decode16X2Config>{}); return true;
    case GemmTile::kDecode8X2: any(TypeTag<Decode8X2Config>{}); return true;
    case GemmTile::kDecode16X2Overlap: any(TypeTag<Decode16X2OverlapConfig>{}); return true;
    case GemmTile::kDecode16X4Overlap: any(TypeTag<Decode16X4OverlapConfig>{}); return true;
    case GemmTile::kDecode16X2Overlap3: any(TypeTag<Decode16X2Overlap3Config>{}); return true;
    case GemmTile::kDecode16X2K2:
      twin(TypeTag<Decode16X2K2Config>{}, TypeTag<Decode16X2OverlapConfig>{});
      return true;
    case GemmTile::kDecode16X4K2:
      twin(TypeTag<Decode16X4K2Config>{}, TypeTag<Decode16X4OverlapConfig>{});
      return true;
    case GemmTile::kDecode16X2K2x3:
      twin(TypeTag<Decode16X2K2x3Config>{}, TypeTag<Decode16X2Overlap3Config>{});
      return true;
    case GemmTile::kPrefillK2:
      twin(TypeTag<PrefillK2Config>{}, TypeTag<PrefillStagedConfig>{});
      return true;
    case GemmTile::kDecode16X2K2Split:
      twin(TypeTag<Decode16X2K2SplitConfig>{}, TypeTag<Decode16X2OverlapSplitConfig>{});
      return true;
    case GemmTile::kDecode8X2K2:
      twin(TypeTag<Decode8X2K2Config>{}, TypeTag<Decode8X2OverlapConfig>{});
      return true;
    case GemmTile::kPrefillAsyncK2:
      twin(TypeTag<PrefillAsyncK2Config>{}, TypeTag<PrefillAsyncK2TwinConfig>{});
      return true;
    case GemmTile::kPrefillWideAsync: any(TypeTag<PrefillWideAsyncConfig>{}); return true;
    case GemmTile::kPrefillAsyncK2N96: multiple(TypeTag<PrefillAsyncK2N96Config>{}); return true;
    case GemmTile::kPrefillAsyncK2N64: multiple(TypeTag<PrefillAsyncK2N64Config>{}); return true;
    case GemmTile::kPrefillAsyncK2N96E2: multiple(TypeTag<PrefillAsyncK2N96E2Config>{}); return true;
    case GemmTile::kDecode8X2K2Warp:
      twin(TypeTag<Decode8X2K2WarpConfig>{}, TypeTag<Decode8X2OverlapWarpConfig>{});
      return true;
    case GemmTile::kDecode16X2K2Warp:
      twin(TypeTag<Decode16X2K2WarpConfig>{}, TypeTag<Decode16X2OverlapWarpConfig>{});
      return true;
    case GemmTile::kDecode8X4KWarp: multiple(TypeTag<Decode8X4KWarpConfig>{}); return true;
    case GemmTile::kDecode16X2K2SplitWarp:
      twin(TypeTag<Decode16X2K2SplitWarpConfig>{}, TypeTag<Decode16X2OverlapSplitWarpConfig>{});
      return true;
    case GemmTile::kAuto:
    case GemmTile::kAutoOverlap:
    case GemmTile::kAutoSerial:
      return false;
  }
  return false;
}

template <GemmKind kKind>
void launch_one(GemmParams p, int64_t rows_hint, GemmTile tile, const uint16_t* b_rows,
                cudaStream_t stream) {
  const bool auto_splits = p.k_splits == 0;
  if (auto_splits) p.k_splits = 1;
  if (tile == GemmTile::kAuto) tile = forced_tile();
  if (tile == GemmTile::kAuto) {
    tile = auto_overlaps(p) ? GemmTile::kAutoOverlap : GemmTile::kAutoSerial;
  }
  if (tile == GemmTile::kAutoSerial || tile == GemmTile::kAutoOverlap) {
    const bool overlap = tile == GemmTile::kAutoOverlap;
    const RowEstimate est = estimate_rows(rows_hint, p.max_rows, p.num_experts);
    const int64_t active = est.active, avg = est.avg;
    // Decode with the overlapped configs: the 128-row weight tile (two accumulator chains, two
    // k-blocks per stage) when its tiles fill enough of the persistent grid, else the 64-row one.
    const int64_t sms = cuda::device_info().sm_count;
    const int64_t slots = sms * kDecodeCtasPerSm;
    const int64_t x2_tiles = active * ((p.m_rows + kDecodeX2Rows - 1) / kDecodeX2Rows);
    const bool three_per_sm =
        wave_fill(x2_tiles, sms * kDecodeCtasPerSm3) >= 1.1 * wave_fill(x2_tiles, slots);
    // With a split-K workspace, launches with at most half as many 128-row tiles as CTA slots
    // run them in K parts (Decode16X2K2SplitWarp, 4 CTAs per SM) instead of the 64-row tile.
    const int parts = split_k_parts(x2_tiles, slots,
                                    k_staged_stages<Decode16X2K2SplitWarpConfig>(p.k));
    // (The kernel repeats the capacity check on the actual tile count and runs unsplit if it fails.)
    const bool split = auto_splits && p.split_partials != nullptr && parts > 1 &&
                       x2_tiles <= p.split_counters_capacity &&
                       x2_tiles * parts * Decode16X2K2SplitWarpConfig::kSplitUnitFloats <=
                           p.split_partial_floats;
    // Units taken at run time (a unit counter in the workspace): the 128 x 8 tile where the
    // experts average at most kDecode8MaxAvgRows rows, 4 CTAs per SM otherwise (the 3-per-SM
    // tile only evened out the static split's waves).
    const bool dynamic = p.unit_counter != nullptr;
    // The 128-row tiles run on warp-level MMAs (tuning log v16: 1.00-1.09x over their wgmma
    // versions, which stay as forced tiles); the 8-row one with four k-blocks per stage where K
    // allows (1.03-1.08x over two at most points, v16).
    const GemmTile decode8 = k_fits_stages<Decode8X4KWarpConfig>(p.k) ? GemmTile::kDecode8X4KWarp
                                                                       : GemmTile::kDecode8X2K2Warp;
    const GemmTile decode_overlap =
        split                                               ? GemmTile::kDecode16X2K2SplitWarp
        : x2_tiles * kDecodeFillDen < slots * kDecodeFillNum ? GemmTile::kDecode16Overlap
        : dynamic && avg <= kDecode8MaxAvgRows              ? decode8
        : three_per_sm && !dynamic                          ? GemmTile::kDecode16X2K2x3
                                                            : GemmTile::kDecode16X2K2Warp;
    if (avg <= kDecode8MaxAvgRows) {
      // NOTES: no overlapped 64 x 8 tile: its first version wrote h_q/h_act that disagreed on the
      // H200 (device run at dbab4e4) and was removed. The overlapped 128 x 8 tile (Decode8X2K2)
      // runs here with a unit counter (decode_overlap), the 16-row tiles without one.
      tile = overlap ? decode_overlap : GemmTile::kDecode8;
    } else if (avg <= (overlap ? kDecodeOverlapMaxAvgRows : kDecodeMaxAvgRows)) {
      tile = overlap ? decode_overlap : GemmTile::kDecode16;
    } else if (overlap && avg > kWideMinAvgRows && avg <= kWideMaxAvgRows) {
      tile = GemmTile::kPrefillWideAsync;
    } else if (overlap && avg <= kAsyncN64MaxAvgRows && k_fits_stages<PrefillAsyncK2N64Config>(p.k)) {
      tile = GemmTile::kPrefillAsyncK2N64;
    } else if (overlap && avg <= kAsyncN96MaxAvgRows && k_fits_stages<PrefillAsyncK2N96E2Config>(p.k)) {
      tile = GemmTile::kPrefillAsyncK2N96E2;
    } else if (overlap) {
      tile = GemmTile::kPrefillK2;
    } else {
      tile = GemmTile::kPrefill;
    }
    if (tile == GemmTile::kDecode16X2K2SplitWarp) p.k_splits = parts;  // picked only to split
  }
  const bool known = with_tile_config(tile, [&](auto cfg, auto twin, auto k_rule) {
    using Cfg = typename decltype(cfg)::type;
    using Twin = typename decltype(twin)::type;
    if constexpr (decltype(k_rule)::value == KRule::kAny) {
      launch_config<Cfg, kKind>(p, b_rows, stream);
    } else if constexpr (decltype(k_rule)::value == KRule::kTwin) {
      launch_k_staged<Cfg, Twin, kKind>(p, b_rows, stream);
    } else {
      launch_k_multiple<Cfg, kKind>(p, b_rows, stream);
    }
  });
  MEGAMOE_CHECK_ARG(known, "sm90 gemm: tile: expected a GemmTile value, got ",
                    static_cast<int>(tile));
}

// kAuto's classes of rows per expert: 0 the 128 x 8 decode tile's (<= kDecode8MaxAvgRows), 1 the
// other decode tiles' (<= kDecodeOverlapMaxAvgRows), 2 the prefill tiles'.
constexpr int kRowClasses = 3;
constexpr int64_t kClassMaxAvg[kRowClasses - 1] = {kDecode8MaxAvgRows, kDecodeOverlapMaxAvgRows};
int avg_class(int64_t avg) {
  int c = 0;
  while (c + 1 < kRowClasses && avg > kClassMaxAvg[c]) ++c;
  return c;
}

}  // namespace

// kAuto with the largest rows per expert a launch can meet (L1Args::rows_per_expert_max): when
// that falls in the prefill class and kAuto's estimate (estimate_rows, as in launch_one) in a
// decode class, one launch per class from the estimate's to the
// prefill one, each gated on the actual rows per hit expert (GemmParams::gate_min_avg /
// gate_max_avg; the first open below, the last open above), so exactly one of them runs and the
// others exit after their wait. The tile of the first class is kAuto's for rows_hint, of each
// later class kAuto's for E_l experts at that class's largest average (the last:
// rows_per_expert_max).
// NOTES: only when the prefill class is possible: between the decode classes alone (T <= 12
// on one GPU) the skipped launch cost more than the better decode tile gained (H200, ef5095a:
// T = 8 1.5-3 % slower with uniform routing, Kimi-K3 adversarial 9 % slower).
LaunchPlan plan_launches(int64_t rows_hint, int64_t rows_per_expert_max, int num_experts,
                         int64_t max_rows) {
  LaunchPlan plan;
  const int64_t e = std::max(1, num_experts);
  const bool gated = rows_hint > 0 && rows_per_expert_max > 0;
  const int lo = gated ? avg_class(estimate_rows(rows_hint, max_rows, num_experts).avg) : 0;
  const int hi = gated ? avg_class(rows_per_expert_max) : 0;
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

template <GemmKind kKind>
void launch(const GemmParams& p, int64_t rows_hint, int64_t rows_per_expert_max, GemmTile tile,
            const uint16_t* b_rows, cudaStream_t stream) {
  const bool autotile = tile == GemmTile::kAuto && forced_tile() == GemmTile::kAuto &&
                        auto_overlaps(p);
  if (!autotile) {
    launch_one<kKind>(p, rows_hint, tile, b_rows, stream);
    return;
  }
  const LaunchPlan plan =
      plan_launches(rows_hint, rows_per_expert_max, p.num_experts, p.max_rows);
  for (int i = 0; i < plan.count; ++i) {
    GemmParams pi = p;
    pi.gate_min_avg = plan.launch[i].gate_min_avg;
    pi.gate_max_avg = plan.launch[i].gate_max_avg;
    launch_one<kKind>(pi, plan.launch[i].rows, tile, b_rows, stream);
  }
}

void check_common(const char* who, int num_experts, int64_t hidden, int64_t intermediate,
                  int64_t max_rows, const void* row_offsets) {
  MEGAMOE_CHECK_ARG(num_experts >= 1, who, ": num_experts: expected >= 1, got ", num_experts);
  MEGAMOE_CHECK(num_experts <= kMaxLocalExperts, ErrorCode::kUnsupported, who,
                ": num_experts: expected <= ", kMaxLocalExperts, ", got ", num_experts);
  MEGAMOE_CHECK_ARG(hidden > 0 && hidden % sm90_layout::kColAlign == 0, who,
                    ": hidden: expected a positive multiple of 64, got ", hidden);
  MEGAMOE_CHECK_ARG(intermediate > 0 && intermediate % sm90_layout::kColAlign == 0, who,
                    ": intermediate: expected a positive multiple of 64, got ", intermediate);
  MEGAMOE_CHECK_ARG(max_rows >= 0 && max_rows + kRowSlack < (int64_t{1} << 31), who,
                    ": max_rows: expected in [0, 2^31 - ", kRowSlack, "), got ", max_rows);
  MEGAMOE_CHECK_ARG(2 * intermediate * hidden < (int64_t{1} << 31) * 4, who,
                    ": 2 * I * H too large for one expert, got I ", intermediate, " H ", hidden);
  MEGAMOE_CHECK_ARG(row_offsets != nullptr, who, ": row_offsets: expected a device pointer, got null");
}

void set_split_k(GemmParams& p, const SplitKWorkspace& ws, int k_splits, const char* who) {
  MEGAMOE_CHECK_ARG(k_splits >= 0 && k_splits <= kMaxKSplits, who, ": k_splits: expected 0 (auto), 1 or up to ",
                    kMaxKSplits, ", got ", k_splits);
  MEGAMOE_CHECK_ARG(k_splits <= 1 || !ws.empty(), who,
                    ": k_splits: ", k_splits, " parts need a split_k workspace, got an empty one");
  MEGAMOE_CHECK_ARG(ws.partial_floats >= 0 && ws.counters_capacity >= 0, who,
                    ": split_k: expected non-negative capacities");
  p.k_splits = k_splits;
  p.unit_counter = ws.unit_counter;
  if (ws.empty()) return;
  p.split_partials = ws.partials;
  p.split_partial_floats = ws.partial_floats;
  p.split_counters = ws.counters;
  p.split_counters_capacity = ws.counters_capacity;
}

}  // namespace

int split_k_counters() {
  // kAuto splits only launches with at most half as many tiles as CTA slots.
  return cuda::device_info().sm_count * static_cast<int>(kDecodeCtasPerSm) / 2;
}

static_assert(Decode16X2K2SplitConfig::kSplitUnitFloats ==
                  Decode16X2K2SplitWarpConfig::kSplitUnitFloats,
              "the two split tiles take the same workspace");
int64_t split_k_partial_floats() {
  // At most one unit per CTA slot (~4 MiB on an H200).
  return static_cast<int64_t>(cuda::device_info().sm_count) * kDecodeCtasPerSm *
         Decode16X2K2SplitWarpConfig::kSplitUnitFloats;
}

TileTraits tile_traits(GemmTile tile) {
  TileTraits t;
  const bool known = with_tile_config(tile, [&](auto cfg, auto twin, auto k_rule) {
    using Cfg = typename decltype(cfg)::type;
    using Twin = typename decltype(twin)::type;
    static_assert(Cfg::kOverlapConvert == Twin::kOverlapConvert, "a twin converts the same way");
    t.needs_small_scales = Cfg::kOverlapConvert;
    t.k_multiple = decltype(k_rule)::value == KRule::kMultiple
                       ? Cfg::kKBlocksPerStage * sm90_layout::kBlockK
                       : sm90_layout::kBlockK;
  });
  MEGAMOE_CHECK_ARG(known, "tile_traits: tile: expected a forced tile (not kAuto, kAutoOverlap or "
                    "kAutoSerial), got ", static_cast<int>(tile));
  return t;
}

namespace {

// Sets *found when any byte of [sf, sf + bytes) has its high bit set (16 bytes per thread and
// step where sf is 16-byte aligned, bytewise otherwise and for the tail).
__global__ void scale_high_bit_kernel(const uint8_t* sf, int64_t bytes, int32_t* found) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vecs = reinterpret_cast<uintptr_t>(sf) % 16 == 0 ? bytes / 16 : 0;
  const uint4* v = reinterpret_cast<const uint4*>(sf);
  uint32_t any = 0;
  for (int64_t i = first; i < vecs; i += stride) {
    const uint4 w = __ldg(v + i);
    any |= w.x | w.y | w.z | w.w;
  }
  for (int64_t i = vecs * 16 + first; i < bytes; i += stride) any |= sf[i];
  if ((any & sm90_layout::kScaleHighBits) != 0) atomicOr(found, 1);
}

}  // namespace

bool scales_all_small(const uint8_t* sf, int64_t bytes, cudaStream_t stream) {
  MEGAMOE_CHECK_ARG(bytes >= 0, "scales_all_small: bytes: expected >= 0, got ", bytes);
  if (bytes == 0) return true;
  MEGAMOE_CHECK_ARG(sf != nullptr, "scales_all_small: sf: expected a device pointer, got null");
  int32_t* found = nullptr;
  MEGAMOE_CUDA_CHECK(cudaMallocAsync(&found, sizeof(int32_t), stream));
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(found, 0, sizeof(int32_t), stream));
  const int64_t blocks = std::min<int64_t>(
      std::max<int64_t>(1, (bytes / 16 + 255) / 256), 8LL * cuda::device_info().sm_count);
  scale_high_bit_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(sf, bytes, found);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  int32_t host = 0;
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(&host, found, sizeof host, cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(cudaFreeAsync(found, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host == 0;
}

void launch_l1(const L1Args& a, cudaStream_t stream) {
  check_common("launch_l1", a.num_experts, a.hidden, a.intermediate, a.max_rows, a.row_offsets);
  if (a.max_rows == 0) return;  // no rows can exist
  MEGAMOE_CHECK_ARG(a.act && a.row_weights && a.w13 && a.w13_sf && a.h_q && a.h_sf && a.h_act,
                    "launch_l1: act, row_weights, w13, w13_sf, h_q, h_sf, h_act: expected device "
                    "pointers, got a null one");
  MEGAMOE_CHECK_ARG(a.activation.kind != ActivationKind::kSitu || !a.activation.has_clamp,
                    "launch_l1: activation: situ takes no clamp");
  // The staged epilogue stores 8 bytes of h_q and 16 of h_act at a time.
  // (Checked for every tile: kAuto may pick a staged one.)
  MEGAMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(a.h_q) % 8 == 0 &&
                        reinterpret_cast<uintptr_t>(a.h_act) % 16 == 0,
                    "launch_l1: h_q / h_act: expected 8- / 16-byte aligned pointers, got ",
                    static_cast<const void*>(a.h_q), " / ", static_cast<const void*>(a.h_act));
  GemmParams p;
  p.num_experts = a.num_experts;
  p.k = static_cast<int>(a.hidden);
  p.m_rows = static_cast<int>(2 * a.intermediate);
  p.max_rows = static_cast<int>(a.max_rows);
  p.row_offsets = a.row_offsets;
  p.w = a.w13;
  p.sf = a.w13_sf;
  p.row_weights = a.row_weights;
  p.bias = a.w13_bias;
  p.intermediate = static_cast<int>(a.intermediate);
  p.activation = a.activation;
  p.fast_math = a.fast_math;
  p.h_q = a.h_q;
  p.h_sf = a.h_sf;
  p.h_act = a.h_act;
  p.small_scales = a.small_scales ? 1 : 0;
  set_split_k(p, a.split_k, a.k_splits, "launch_l1");
  p.prefetch_before_wait = a.programmatic ? 1 : 0;
  launch<GemmKind::kL1>(p, a.rows_hint, a.rows_per_expert_max, a.tile, a.act, stream);
}

void launch_l2(const L2Args& a, cudaStream_t stream) {
  check_common("launch_l2", a.num_experts, a.hidden, a.intermediate, a.max_rows, a.row_offsets);
  if (a.max_rows == 0) return;
  MEGAMOE_CHECK_ARG(a.h_act && a.w2 && a.w2_sf && a.out,
                    "launch_l2: h_act, w2, w2_sf, out: expected device pointers, got a null one");
  // The asynchronous epilogue stores 16 bytes of out at a time (checked for every tile).
  MEGAMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(a.out) % 16 == 0,
                    "launch_l2: out: expected a 16-byte aligned pointer, got ",
                    static_cast<const void*>(a.out));
  MEGAMOE_CHECK_ARG(a.w2_bias == nullptr || a.row_weights != nullptr,
                    "launch_l2: row_weights: expected a device pointer when w2_bias is given");
  GemmParams p;
  p.num_experts = a.num_experts;
  p.k = static_cast<int>(a.intermediate);
  p.m_rows = static_cast<int>(a.hidden);
  p.max_rows = static_cast<int>(a.max_rows);
  p.row_offsets = a.row_offsets;
  p.w = a.w2;
  p.sf = a.w2_sf;
  p.row_weights = a.row_weights;
  p.bias = a.w2_bias;
  p.intermediate = static_cast<int>(a.intermediate);
  p.out = a.out;
  p.small_scales = a.small_scales ? 1 : 0;
  set_split_k(p, a.split_k, a.k_splits, "launch_l2");
  p.prefetch_before_wait = a.programmatic ? 1 : 0;
  launch<GemmKind::kL2>(p, a.rows_hint, a.rows_per_expert_max, a.tile, a.h_act, stream);
}

#if MEGAMOE_DIAG_TIMELINE
std::vector<uint64_t> diag_read_timeline() {
  std::vector<uint64_t> table(static_cast<size_t>(diag::kTimelineCtas) * diag::kNumEvents);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  MEGAMOE_CUDA_CHECK(cudaMemcpyFromSymbol(table.data(), diag::g_timeline, table.size() * sizeof(uint64_t)));
  const std::vector<uint64_t> zeros(table.size(), 0);
  MEGAMOE_CUDA_CHECK(cudaMemcpyToSymbol(diag::g_timeline, zeros.data(), zeros.size() * sizeof(uint64_t)));
  return table;
}
#endif

}  // namespace megamoe::sm90
