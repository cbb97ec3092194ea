// ep_launch.cu: launchers of the expert-parallel stages (see ep_launch.hpp).
#include "ep/ep_launch.hpp"

#include <algorithm>

#include "ep/ep_kernels.cuh"
#include "megamoe/error.hpp"
#include "moe/sm90_stages.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "runtime/cuda_launch.hpp"

namespace megamoe::ep {

namespace {

// Grid-stride kernels over warps: enough CTAs for `warps` warps, at most kCtasPerSm per SM.
constexpr int kCtasPerSm = 4;
int grid_for_warps(int64_t warps, int warps_per_cta) {
  const int64_t ctas = (warps + warps_per_cta - 1) / warps_per_cta;
  const int64_t cap = int64_t{cuda::device_info().sm_count} * kCtasPerSm;
  return static_cast<int>(std::clamp<int64_t>(ctas, 1, cap));
}

}  // namespace

namespace {
SendArgs send_args(const EpParams& p, const SendInputs& in) {
  SendArgs a{};
  a.x = in.x;
  a.x_q = in.x_q;
  a.x_sf = in.x_sf;
  a.topk_idx = in.topk_idx;
  a.topk_weights = in.topk_weights;
  a.slot_map = in.slot_map;
  a.errors.num_experts = p.num_experts;
  a.errors.first_local = 0;
  a.errors.num_local = p.num_experts;  // dispatch_local_expert then returns the global id
  a.errors.error = in.error;
  a.errors.error_flag = in.error_flag;
  return a;
}
}  // namespace

bool fused_send(const EpParams& p) { return p.num_tokens <= kFusedSendMaxTokens; }

void launch_send(const EpParams& p, const SendInputs& in, cudaStream_t stream, bool programmatic) {
  MEGAMOE_CHECK_ARG(p.layout.hidden % 32 == 0, "ep send: expected H a multiple of 32, got ",
                    p.layout.hidden);
  cuda::launch(ep_send_kernel, grid_for_warps(p.num_tokens, kSendWarps), kSendThreads, 0, stream,
               programmatic, p, send_args(p, in));
}

void configure_dispatch(int64_t num_local) {
  const size_t smem =
      static_cast<size_t>(sm90::dispatch_num_warps(num_local)) * num_local * sizeof(int32_t);
  cuda::raise_max_dynamic_smem(reinterpret_cast<const void*>(&ep_dispatch_kernel), smem);
}

void launch_dispatch(const EpParams& p, const SendInputs& in, int32_t* row_offsets,
                     int32_t* row_slot, float* row_weights, uint16_t** row_dst,
                     cudaStream_t stream, bool programmatic, bool wait_rows) {
  sm90::DispatchParams d{};
  d.num_experts = p.num_experts;
  d.first_local = p.rank * p.num_local;
  d.num_local = p.num_local;
  d.row_offsets = row_offsets;
  d.slot_to_row = nullptr;
  d.row_slot = row_slot;
  d.row_weights = row_weights;
  d.max_rows = p.max_rows;
  // The received slot count is known only on the device; the sort's result does not depend on
  // the warp count, which is sized for every rank having this rank's T.
  const int64_t slots_per_warp = int64_t{sm90::kDispatchWarpSize} * sm90::kDispatchUnroll;
  const int64_t expected = int64_t{p.size} * std::max(p.num_tokens, 1) * p.layout.top_k;
  const int num_warps = static_cast<int>(std::clamp<int64_t>(
      (expected + slots_per_warp - 1) / slots_per_warp, 1, sm90::dispatch_num_warps(p.num_local)));
  const size_t smem = static_cast<size_t>(num_warps) * p.num_local * sizeof(int32_t);
  configure_dispatch(p.num_local);
  const bool fused = fused_send(p);
  if (fused && p.num_tokens > 0) {
    MEGAMOE_CHECK_ARG(in.x != nullptr && p.layout.hidden % 32 == 0,
                      "ep dispatch: a call of ", p.num_tokens, " tokens quantizes and sends its "
                      "input itself: expected SendInputs::x and H a multiple of 32, got x = ",
                      static_cast<const void*>(in.x), ", H = ", p.layout.hidden);
  }
  // Fused: one CTA per token (quantize_send_token), the last one to finish waits and sorts.
  const int grid = fused ? std::max(1, p.num_tokens) : 1;
  cuda::launch(ep_dispatch_kernel, grid, sm90::kDispatchMaxWarps * sm90::kDispatchWarpSize, smem,
               stream, programmatic, p, d, num_warps, send_args(p, in), fused, row_dst, wait_rows);
}

void launch_return(const EpParams& p, const uint16_t* out, const int32_t* row_offsets,
                   const int32_t* row_slot, cudaStream_t stream, bool programmatic) {
  const int64_t expected_rows =
      out == nullptr ? 1 : std::max<int64_t>(1, int64_t{p.num_tokens} * p.layout.top_k);
  cuda::launch(ep_return_kernel, grid_for_warps(expected_rows, kReturnWarps), kReturnThreads, 0,
               stream, programmatic, p, out, row_offsets, row_slot);
}

void load_kernels() {
  cudaFuncAttributes a{};
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, ep_send_kernel));
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, ep_dispatch_kernel));
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, ep_return_kernel));
}

}  // namespace megamoe::ep
