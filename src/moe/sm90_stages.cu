// sm90_stages.cu: launchers of the non-GEMM stages (see sm90_stages.hpp).
#include "moe/sm90_stages.hpp"

#include <algorithm>

#include "megamoe/error.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "runtime/cuda_launch.hpp"
#include "sm90/sm90_combine.cuh"
#include "sm90/sm90_decode_front.cuh"
#include "sm90/sm90_gather.cuh"
#include "sm90/sm90_quantize_input.cuh"
#include "sm90/sm90_rebase_rows.cuh"
#include "sm90/sm90_dispatch.cuh"

namespace megamoe::sm90 {

namespace {

// NOTES: grid-stride kernels are launched with at most kWavesPerSm blocks per SM; more blocks
// only add scheduling work, fewer leave memory bandwidth unused at large T.
constexpr int kWavesPerSm = 8;

int grid_for(int64_t work_items, int block_threads) {
  const int64_t blocks = (work_items + block_threads - 1) / block_threads;
  const int64_t cap = static_cast<int64_t>(cuda::device_info().sm_count) * kWavesPerSm;
  return static_cast<int>(std::max<int64_t>(1, std::min(blocks, cap)));
}

void check_aligned(const char* arg, const void* ptr, int64_t alignment) {
  MEGAMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(alignment) == 0, arg,
                    ": expected a ", alignment, "-byte aligned device pointer, got ", ptr);
}

// The local experts of a dispatch lie in [0, E).
void check_local_experts(const char* stage, const DispatchParams& p) {
  MEGAMOE_CHECK_ARG(p.num_local > 0 && p.first_local >= 0 &&
                        p.first_local + p.num_local <= p.num_experts,
                    stage, ": local experts [", p.first_local, ", ", p.first_local + p.num_local,
                    ") do not lie in [0, ", p.num_experts, ")");
}

// The dispatch warp count of a call (launch_dispatch's rule), at most `limit`.
int dispatch_warps_for(int64_t num_slots, int64_t num_local, int limit) {
  // NOTES: the result does not depend on the warp count (a stable sort is unique), so small
  // calls use fewer warps: at T = 1 the zeroing and scan of 32 histograms of 896 experts were
  // most of the kernel's time. One warp per kDispatchUnroll chunks of 32 slots, at most the limit
  // the shared memory allows.
  const int64_t slots_per_warp = int64_t{kDispatchWarpSize} * kDispatchUnroll;
  return static_cast<int>(std::clamp<int64_t>((num_slots + slots_per_warp - 1) / slots_per_warp,
                                              1, std::min(limit, dispatch_num_warps(num_local))));
}

constexpr size_t kFrontSmemLimit = 48 * 1024;  // no attribute call: graph capture stays clean

// The decode front's dispatch warps (block 0) and their histograms' shared memory.
int front_warps(int64_t num_slots, int64_t num_local) {
  return dispatch_warps_for(num_slots, num_local, kFrontBlockThreads / kDispatchWarpSize);
}
size_t front_smem(int warps, int64_t num_local) {
  return static_cast<size_t>(warps) * static_cast<size_t>(num_local) * sizeof(int32_t);
}

}  // namespace

void load_stage_kernels() {
  cudaFuncAttributes a{};
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, sm90_quantize_input_bf16_e4m3_kernel));
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, sm90_rebase_rows_e4m3_kernel));
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, sm90_dispatch_topk_kernel));
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, sm90_gather_dequant_e4m3_bf16_kernel));
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, sm90_combine_topk_bf16_kernel));
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, sm90_decode_front_kernel));
}

void launch_quantize_input(const uint16_t* x, int64_t num_tokens, int64_t hidden, uint8_t* x_q,
                           uint8_t* x_sf, cudaStream_t stream, bool programmatic) {
  MEGAMOE_CHECK_ARG(hidden > 0 && hidden % kScaleBlock == 0,
                    "quantize_input: expected hidden a positive multiple of ", kScaleBlock,
                    ", got ", hidden);
  MEGAMOE_CHECK_ARG(num_tokens >= 0, "quantize_input: expected num_tokens >= 0, got ", num_tokens);
  if (num_tokens == 0) return;
  check_aligned("quantize_input x", x, 16);
  check_aligned("quantize_input x_q", x_q, 8);
  const int64_t num_chunks = num_tokens * hidden / kQuantVec;
  cuda::launch(sm90_quantize_input_bf16_e4m3_kernel, grid_for(num_chunks, kQuantBlockThreads),
               kQuantBlockThreads, 0, stream, programmatic, x, num_chunks, x_q, x_sf);
}

int dispatch_num_warps(int64_t num_local) {
  MEGAMOE_CHECK_ARG(num_local > 0, "dispatch: expected num_local_experts > 0, got ", num_local);
  const int64_t hist_bytes_per_warp = num_local * static_cast<int64_t>(sizeof(int32_t));
  // Static shared memory of the kernel (warp totals) is small; keep a margin for it.
  constexpr int64_t kStaticSmemMargin = 1024;
  const int64_t budget = cuda::device_info().smem_per_block_optin - kStaticSmemMargin;
  const int64_t warps = std::min<int64_t>(kDispatchMaxWarps, budget / hist_bytes_per_warp);
  MEGAMOE_CHECK(warps >= 1, ErrorCode::kUnsupported, "dispatch: ", num_local,
                " local experts need ", hist_bytes_per_warp,
                " bytes of shared memory per warp; the device offers ", budget);
  return static_cast<int>(warps);
}

void configure_dispatch_smem(size_t smem_bytes) {
  // Sm90Layer calls it at construction, so a forward() captured into a CUDA graph makes no
  // attribute call at all.
  cuda::raise_max_dynamic_smem(reinterpret_cast<const void*>(&sm90_dispatch_topk_kernel), smem_bytes);
}

void launch_dispatch(const DispatchParams& params, cudaStream_t stream, bool programmatic) {
  MEGAMOE_CHECK_ARG(params.num_slots >= 0 && params.num_slots <= INT32_MAX,
                    "dispatch: expected 0 <= T*K <= 2^31-1, got ", params.num_slots);
  check_local_experts("dispatch", params);
  const int num_warps = dispatch_warps_for(params.num_slots, params.num_local, kDispatchMaxWarps);
  const size_t smem = static_cast<size_t>(num_warps) * params.num_local * sizeof(int32_t);
  configure_dispatch_smem(smem);
  cuda::launch(sm90_dispatch_topk_kernel, 1, kDispatchMaxWarps * kDispatchWarpSize, smem, stream,
               programmatic, params, num_warps);
}

void launch_gather(const uint8_t* x_q, const uint8_t* x_sf, const int32_t* row_offsets,
                   const int32_t* row_slot, int64_t num_local, int64_t top_k, int64_t hidden,
                   int64_t max_rows, uint16_t* act, cudaStream_t stream, bool programmatic,
                   int64_t grid_rows) {
  MEGAMOE_CHECK_ARG(hidden > 0 && hidden % kScaleBlock == 0,
                    "gather: expected hidden a positive multiple of ", kScaleBlock, ", got ", hidden);
  MEGAMOE_CHECK_ARG(top_k > 0, "gather: expected top_k > 0, got ", top_k);
  if (max_rows == 0) return;
  check_aligned("gather x_q", x_q, 16);
  check_aligned("gather act", act, 16);
  const int64_t work = max_rows * (hidden / kGatherVec);
  MEGAMOE_CHECK(work < (int64_t{1} << 32), ErrorCode::kUnsupported, "gather: ", max_rows,
                " rows x ", hidden, " channels exceed the kernel's 32-bit item index");
  const int64_t grid_work =
      (grid_rows > 0 ? std::min(grid_rows, max_rows) : max_rows) * (hidden / kGatherVec);
  cuda::launch(sm90_gather_dequant_e4m3_bf16_kernel, grid_for(grid_work, kGatherBlockThreads),
               kGatherBlockThreads, 0, stream, programmatic, x_q, x_sf, row_offsets, row_slot,
               static_cast<int32_t>(num_local), static_cast<uint32_t>(top_k),
               static_cast<uint32_t>(hidden), max_rows, act);
}

void launch_rebase_rows_e4m3(const uint8_t* q, const uint8_t* sf, const int32_t* row_offsets,
                             const int32_t* row_slot, int64_t num_local, int64_t top_k,
                             int64_t cols, int64_t max_rows, uint8_t* dst, float* factor,
                             cudaStream_t stream, bool programmatic, int64_t grid_rows) {
  MEGAMOE_CHECK_ARG(cols > 0 && cols % kScaleBlock == 0,
                    "rebase_rows_e4m3: expected cols a positive multiple of ", kScaleBlock, ", got ", cols);
  MEGAMOE_CHECK_ARG(top_k >= 0 && (top_k == 0 || row_slot != nullptr),
                    "rebase_rows_e4m3: expected top_k >= 0 (and row_slot with top_k > 0), got ", top_k);
  if (max_rows == 0) return;
  check_aligned("rebase_rows_e4m3 q", q, 16);
  check_aligned("rebase_rows_e4m3 dst", dst, 16);
  const int64_t rows_for_grid = grid_rows > 0 ? std::min(grid_rows, max_rows) : max_rows;
  cuda::launch(sm90_rebase_rows_e4m3_kernel,
               grid_for(rows_for_grid * 32, kRebaseBlockThreads), kRebaseBlockThreads, 0, stream,
               programmatic, q, sf, row_offsets, row_slot, static_cast<int32_t>(num_local),
               static_cast<uint32_t>(top_k), static_cast<uint32_t>(cols), max_rows, dst, factor);
}

bool decode_front_takes(int64_t num_slots, int64_t num_local) {
  return num_slots >= 1 && num_slots <= kFrontMaxSlots && num_local >= 1 &&
         num_local <= static_cast<int64_t>(kFrontSmemLimit / sizeof(int32_t)) &&
         front_smem(front_warps(num_slots, num_local), num_local) <= kFrontSmemLimit;
}

void launch_decode_front(const uint16_t* x, int64_t num_tokens, int64_t top_k, int64_t hidden,
                         const DispatchParams& dispatch, uint8_t* x_q, uint8_t* x_sf,
                         uint16_t* act, cudaStream_t stream, bool programmatic) {
  MEGAMOE_CHECK_ARG(hidden > 0 && hidden % kScaleBlock == 0,
                    "decode_front: expected hidden a positive multiple of ", kScaleBlock, ", got ",
                    hidden);
  MEGAMOE_CHECK_ARG(top_k > 0 && num_tokens >= 0 && dispatch.num_slots == num_tokens * top_k,
                    "decode_front: expected top_k > 0 and dispatch.num_slots = T*K, got T = ",
                    num_tokens, ", K = ", top_k, ", num_slots = ", dispatch.num_slots);
  MEGAMOE_CHECK_ARG(dispatch.max_rows == 0, "decode_front: expected dispatch.max_rows = 0 (one "
                    "GPU: T*K rows always fit), got ", dispatch.max_rows);
  check_local_experts("decode_front", dispatch);
  if (num_tokens == 0) return;
  MEGAMOE_CHECK_ARG(decode_front_takes(dispatch.num_slots, dispatch.num_local),
                    "decode_front: expected 1 <= T*K <= ", kFrontMaxSlots, " and the dispatch "
                    "histograms of ", dispatch.num_local, " local experts in ", kFrontSmemLimit,
                    " bytes of shared memory, got T*K = ", dispatch.num_slots);
  check_aligned("decode_front x", x, 16);
  check_aligned("decode_front x_q", x_q, 8);
  check_aligned("decode_front act", act, 16);
  FrontParams p{};
  p.dispatch = dispatch;
  p.x = x;
  p.top_k = static_cast<int32_t>(top_k);
  p.hidden = static_cast<int32_t>(hidden);
  p.x_q = x_q;
  p.x_sf = x_sf;
  p.act = act;
  // NOTES: each slot's row is cut into parts of one chunk per thread while the grid stays
  // within one wave of blocks (~1 + T*K*parts <= 4 per SM), up to kFrontChunksPerThread chunks
  // per thread above: with a whole row per block, one SM quantizes a long row alone (why this
  // split: docs/tuning-log.md v26).
  const int64_t chunks = hidden / kQuantVec;
  const int64_t wave = int64_t{4} * cuda::device_info().sm_count;
  int64_t span = kFrontBlockThreads;
  while (span < int64_t{kFrontBlockThreads} * kFrontChunksPerThread &&
         dispatch.num_slots * ((chunks + span - 1) / span) > wave) {
    span *= 2;
  }
  p.chunk_span = static_cast<int32_t>(span);
  p.parts = static_cast<int32_t>((chunks + span - 1) / span);
  const int warps = front_warps(dispatch.num_slots, dispatch.num_local);
  cuda::launch(sm90_decode_front_kernel, static_cast<int>(1 + dispatch.num_slots * p.parts),
               kFrontBlockThreads, front_smem(warps, dispatch.num_local), stream, programmatic, p,
               warps);
}

void launch_combine(const uint16_t* out, const int32_t* slot_to_row, int64_t num_tokens,
                    int64_t top_k, int64_t hidden, uint16_t* y, cudaStream_t stream,
                    bool programmatic) {
  MEGAMOE_CHECK_ARG(hidden > 0 && hidden % kCombineVec == 0,
                    "combine: expected hidden a positive multiple of ", kCombineVec, ", got ",
                    hidden);
  MEGAMOE_CHECK_ARG(top_k > 0, "combine: expected top_k > 0, got ", top_k);
  if (num_tokens == 0) return;
  check_aligned("combine out", out, 16);
  check_aligned("combine y", y, 16);
  const int64_t work = num_tokens * (hidden / kCombineVec);
  MEGAMOE_CHECK(work < (int64_t{1} << 32), ErrorCode::kUnsupported, "combine: ", num_tokens,
                " tokens x ", hidden, " channels exceed the kernel's 32-bit item index");
  cuda::launch(sm90_combine_topk_bf16_kernel, grid_for(work, kCombineBlockThreads),
               kCombineBlockThreads, 0, stream, programmatic, out, slot_to_row,
               static_cast<uint32_t>(num_tokens), static_cast<int32_t>(top_k),
               static_cast<uint32_t>(hidden), y);
}

}  // namespace megamoe::sm90
