// sm90_gemm.cu: launchers of the Hopper grouped expert GEMMs (kernels/sm90/): input checks, the
// tile the policy chooses (sm90_tile_policy.*), gated launches, and the TMA descriptor of the
// token rows. The kernels themselves are instantiated per tile in generated translation units
// (sm90_gemm_launch.cuh).
#include "moe/sm90_gemm.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <utility>

#include "megamoe/error.hpp"
#include "moe/sm90_gemm_launch.hpp"
#include "moe/sm90_tile_policy.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"

namespace megamoe::sm90 {
namespace {

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

}  // namespace

CUtensorMap make_rows_map(const void* base, int64_t rows, int64_t cols, int box_rows, bool fp8) {
  CUtensorMap map{};
  const int64_t elem_bytes = fp8 ? 1 : 2;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * elem_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / elem_bytes),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res = tensor_map_encoder()(
      &map, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
      const_cast<void*>(base), dims, strides, box,
      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MEGAMOE_CHECK(res == CUDA_SUCCESS, ErrorCode::kCuda, "cuTensorMapEncodeTiled failed (error ",
                static_cast<int>(res), ") for rows ", rows, " cols ", cols, " box rows ", box_rows);
  return map;
}

namespace {

// ---- dispatch by tile: one launcher per (tile, kind), defined in the generated units ----
using TileLauncher = void (*)(const GemmParams&, const void*, cudaStream_t);
template <size_t kI, GemmKind kKind>
constexpr TileLauncher launcher_of() {
  constexpr TileId kId = static_cast<TileId>(kI);
  return &launch_tile<kId, kKind>;
}
template <GemmKind kKind, size_t... kI>
constexpr std::array<TileLauncher, kNumTiles> make_launchers(std::index_sequence<kI...>) {
  return {launcher_of<kI, kKind>()...};
}
template <GemmKind kKind>
constexpr std::array<TileLauncher, kNumTiles> kLaunchers =
    make_launchers<kKind>(std::make_index_sequence<kNumTiles>{});

template <GemmKind kKind, size_t... kI>
void load_tiles(std::index_sequence<kI...>) {
  (load_tile<static_cast<TileId>(kI), kKind>(), ...);
}

#if MEGAMOE_DIAG_TIMELINE
using TimelineReader = std::vector<uint64_t> (*)();
template <size_t kI>
constexpr TimelineReader timeline_reader_of() {
  constexpr TileId kId = static_cast<TileId>(kI);
  return &diag_read_timeline_of<kId>;
}
template <size_t... kI>
constexpr auto make_timeline_readers(std::index_sequence<kI...>) {
  return std::array<TimelineReader, kNumTiles>{timeline_reader_of<kI>()...};
}
TileId g_last_tile = TileId::kSerial64x8;  // the last tile launched (measurement builds)
#endif

template <GemmKind kKind>
void run_tile(TileId tile, const GemmParams& p, const void* b_rows, cudaStream_t stream) {
#if MEGAMOE_DIAG_TIMELINE
  g_last_tile = tile;
#endif
  kLaunchers<kKind>[static_cast<int>(tile)](p, b_rows, stream);
}

// The policy's tile for `rows_hint` estimated rows, with its split of K where k_splits is left
// to it (0).
template <GemmKind kKind>
void launch_auto(GemmParams p, int64_t rows_hint, bool serial_only, const void* b_rows,
                 cudaStream_t stream) {
  TileQuery q;
  q.rows_hint = rows_hint;
  q.max_rows = p.max_rows;
  q.num_experts = p.num_experts;
  q.m_rows = p.m_rows;
  q.k = p.k;
  q.sm_count = cuda::device_info().sm_count;
  q.small_scales = p.small_scales != 0;
  q.serial_only = serial_only;
  q.unit_counter = p.unit_counter != nullptr;
  q.split_allowed = p.k_splits == 0 && p.split_partials != nullptr;
  q.split_counters_capacity = p.split_counters_capacity;
  q.split_partial_floats = p.split_partial_floats;
  const TileChoice choice = choose_tile(q);
  if (p.k_splits == 0) p.k_splits = choice.k_splits;
  run_tile<kKind>(choice.tile, p, b_rows, stream);
}

template <GemmKind kKind>
void launch(GemmParams p, int64_t rows_hint, int64_t rows_per_expert_max, const TileRequest& tile,
            const void* b_rows, cudaStream_t stream) {
  const bool fp8 = p.w_row_exp != nullptr;
  switch (tile.mode) {
    case TileRequest::Mode::kForced:
      MEGAMOE_CHECK_ARG(static_cast<int>(tile.tile) < kNumTiles,
                        "sm90 gemm: tile: expected a TileId below ", kNumTiles, ", got ",
                        static_cast<int>(tile.tile));
      MEGAMOE_CHECK_ARG(tile_config(tile.tile).fp8() == fp8, "sm90 gemm: tile ",
                        tile_config(tile.tile).name, " is ",
                        tile_config(tile.tile).fp8() ? "an FP8-mode tile" : "an exact-mode tile",
                        ", the inputs are ", fp8 ? "FP8-mode ones (E4M3 rows)" : "exact-mode ones (BF16 rows)");
      if (p.k_splits == 0) p.k_splits = 1;
      run_tile<kKind>(tile.tile, p, b_rows, stream);
      return;
    case TileRequest::Mode::kSerial:
      MEGAMOE_CHECK_ARG(!fp8, "sm90 gemm: tile 'serial' is an exact-mode request; the inputs are "
                              "FP8-mode ones (E4M3 rows)");
      launch_auto<kKind>(p, rows_hint, true, b_rows, stream);
      return;
    case TileRequest::Mode::kAuto:
      break;
  }
  if (fp8) {  // FP8 mode: two gated launches, one runs (plan_fp8_launches)
    p.k_splits = 1;
    for (const Fp8Launch& l : plan_fp8_launches(p.k).launch) {
      GemmParams pi = p;
      pi.gate_min_avg = l.gate_min_avg;
      pi.gate_max_avg = l.gate_max_avg;
      run_tile<kKind>(l.tile, pi, b_rows, stream);
    }
    return;
  }
  if (p.small_scales == 0) {  // the serial tiles: no gated launches
    launch_auto<kKind>(p, rows_hint, false, b_rows, stream);
    return;
  }
  const LaunchPlan plan = plan_launches(rows_hint, rows_per_expert_max, p.num_experts, p.max_rows);
  for (int i = 0; i < plan.count; ++i) {
    GemmParams pi = p;
    pi.gate_min_avg = plan.launch[i].gate_min_avg;
    pi.gate_max_avg = plan.launch[i].gate_max_avg;
    launch_auto<kKind>(pi, plan.launch[i].rows, false, b_rows, stream);
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
  return static_cast<int>(split_k_counters_for(cuda::device_info().sm_count));
}

int64_t split_k_partial_floats() {
  return split_k_partial_floats_for(cuda::device_info().sm_count);  // ~4 MiB on an H200
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

namespace {

// out[e, m] = the largest scale byte of prepared row m of expert e: row 16 w + g + 8 h of block
// mb holds byte 4 (8 w + g) + 2 h + j of each of the block row's scale blocks (sm90 layout).
__global__ void weight_row_exp_kernel(const uint8_t* sf, int64_t experts, int64_t m_rows,
                                      int64_t k, uint8_t* out) {
  const int64_t rows = experts * m_rows;
  const int64_t kb_count = k / sm90_layout::kBlockK;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / m_rows, m = i % m_rows;
    const int64_t mb = m / sm90_layout::kBlockRows;
    const int r = static_cast<int>(m % sm90_layout::kBlockRows);
    const int w = r / 16, h = (r % 16) / 8, g = r % 8;
    const uint8_t* blocks = sf + (e * (m_rows / sm90_layout::kBlockRows) + mb) * kb_count *
                                     sm90_layout::kSfBlockBytes;
    const int byte = 4 * (8 * w + g) + 2 * h;
    uint32_t best = 0;
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const uint8_t* b = blocks + kb * sm90_layout::kSfBlockBytes + byte;
      best = max(best, static_cast<uint32_t>(max(b[0], b[1])));
    }
    out[i] = static_cast<uint8_t>(best);
  }
}

}  // namespace

void weight_row_exponents(const uint8_t* sf, int num_experts, int64_t m_rows, int64_t k,
                          uint8_t* out, cudaStream_t stream) {
  MEGAMOE_CHECK_ARG(num_experts >= 0 && m_rows % sm90_layout::kBlockRows == 0 &&
                        k % sm90_layout::kBlockK == 0,
                    "weight_row_exponents: expected E >= 0, m_rows % 64 == 0 and k % 64 == 0, got ",
                    num_experts, ", ", m_rows, ", ", k);
  const int64_t rows = num_experts * m_rows;
  if (rows == 0) return;
  MEGAMOE_CHECK_ARG(sf != nullptr && out != nullptr,
                    "weight_row_exponents: sf, out: expected device pointers, got a null one");
  const int64_t blocks = std::min<int64_t>((rows + 255) / 256, 8LL * cuda::device_info().sm_count);
  weight_row_exp_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(sf, num_experts, m_rows,
                                                                           k, out);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

GemmParams l1_params(const L1Args& a) {
  check_common("launch_l1", a.num_experts, a.hidden, a.intermediate, a.max_rows, a.row_offsets);
  const bool fp8 = a.act_fp8 != nullptr;
  // h_act: the exact mode's L2 operand; the FP8 tiles do not write it (may be null there).
  MEGAMOE_CHECK_ARG((fp8 || (a.act && a.h_act)) && a.row_weights && a.w13 && a.w13_sf && a.h_q && a.h_sf,
                    "launch_l1: act and h_act (or act_fp8), row_weights, w13, w13_sf, h_q, h_sf: "
                    "expected device pointers, got a null one");
  MEGAMOE_CHECK_ARG(!fp8 || (a.act_row_factor != nullptr && a.w13_row_exp != nullptr),
                    "launch_l1: FP8 mode (act_fp8 given): act_row_factor and w13_row_exp: "
                    "expected device pointers, got a null one");
  MEGAMOE_CHECK_ARG(a.activation.kind != ActivationKind::kSitu || !a.activation.has_clamp,
                    "launch_l1: activation: situ takes no clamp");
  // The staged epilogue stores 8 bytes of h_q and 16 of h_act at a time.
  // (Checked for every tile: the policy may pick a staged one.)
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
  if (fp8) {
    p.w_row_exp = a.w13_row_exp;
    p.b_row_factor = a.act_row_factor;
  }
  set_split_k(p, a.split_k, a.k_splits, "launch_l1");
  p.prefetch_before_wait = a.programmatic ? 1 : 0;
  if (a.topk_idx != nullptr) {
    MEGAMOE_CHECK_ARG(a.topk_slots > 0 && a.topk_slots <= INT32_MAX && a.topk_first_local >= 0 &&
                          a.topk_first_local <= INT32_MAX,
                      "launch_l1: expected 0 < topk_slots <= 2^31-1 and topk_first_local >= 0, "
                      "got ", a.topk_slots, " and ", a.topk_first_local);
    p.topk_idx = a.topk_idx;
    p.topk_slots = static_cast<int>(a.topk_slots);
    p.topk_first_local = static_cast<int>(a.topk_first_local);
  }
  return p;
}

void launch_l1(const L1Args& a, cudaStream_t stream) {
  if (a.max_rows == 0) {  // no rows can exist
    check_common("launch_l1", a.num_experts, a.hidden, a.intermediate, a.max_rows, a.row_offsets);
    return;
  }
  launch<GemmKind::kL1>(l1_params(a), a.rows_hint, a.rows_per_expert_max, a.tile,
                        a.act_fp8 != nullptr ? static_cast<const void*>(a.act_fp8) : a.act, stream);
}

GemmParams l2_params(const L2Args& a) {
  check_common("launch_l2", a.num_experts, a.hidden, a.intermediate, a.max_rows, a.row_offsets);
  const bool fp8 = a.h_fp8 != nullptr;
  MEGAMOE_CHECK_ARG((fp8 || a.h_act) && a.w2 && a.w2_sf && a.out,
                    "launch_l2: h_act (or h_fp8), w2, w2_sf, out: expected device pointers, got a "
                    "null one");
  MEGAMOE_CHECK_ARG(!fp8 || (a.h_row_factor != nullptr && a.w2_row_exp != nullptr),
                    "launch_l2: FP8 mode (h_fp8 given): h_row_factor and w2_row_exp: expected "
                    "device pointers, got a null one");
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
  p.out_rows = a.out_rows;
  p.small_scales = a.small_scales ? 1 : 0;
  if (fp8) {
    p.w_row_exp = a.w2_row_exp;
    p.b_row_factor = a.h_row_factor;
  }
  set_split_k(p, a.split_k, a.k_splits, "launch_l2");
  p.prefetch_before_wait = a.programmatic ? 1 : 0;
  return p;
}

void launch_l2(const L2Args& a, cudaStream_t stream) {
  if (a.max_rows == 0) {
    check_common("launch_l2", a.num_experts, a.hidden, a.intermediate, a.max_rows, a.row_offsets);
    return;
  }
  launch<GemmKind::kL2>(l2_params(a), a.rows_hint, a.rows_per_expert_max, a.tile,
                        a.h_fp8 != nullptr ? static_cast<const void*>(a.h_fp8) : a.h_act, stream);
}

#if MEGAMOE_DIAG_TIMELINE
std::vector<uint64_t> diag_read_timeline() {
  static constexpr auto kReaders = make_timeline_readers(std::make_index_sequence<kNumTiles>{});
  return kReaders[static_cast<int>(g_last_tile)]();
}
#endif

void load_gemm_kernels() {
  load_tiles<GemmKind::kL1>(std::make_index_sequence<kNumTiles>{});
  load_tiles<GemmKind::kL2>(std::make_index_sequence<kNumTiles>{});
}

}  // namespace megamoe::sm90
