// sm90_gemm_launch.cuh: the definitions of the per-tile launchers (sm90_gemm_launch.hpp), for the
// generated translation units only.
#pragma once

#include <vector>

#include "megamoe/error.hpp"
#include "moe/sm90_gemm_launch.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "runtime/cuda_launch.hpp"
#include "sm90/sm90_grouped_gemm_bf16_mxfp4.cuh"

namespace megamoe::sm90 {

template <TileId kId, GemmKind kKind>
void launch_tile(const GemmParams& p, const void* b_rows, cudaStream_t stream) {
  using Cfg = GemmConfig<kId>;
  auto* kernel = &sm90_grouped_gemm_bf16_mxfp4_kernel<Cfg, kKind>;
  MEGAMOE_CHECK_ARG(p.k % Cfg::kTile.k_multiple() == 0, "sm90 gemm: tile ", Cfg::kTile.name,
                    " takes K (the reduction: H for L1, I for L2) in multiples of ",
                    Cfg::kTile.k_multiple(), ", got ", p.k, "; its sibling ",
                    tile_config(fit_k(kId, p.k)).name, " takes it");
  if (p.k_splits > 1) {
    MEGAMOE_CHECK_ARG(Cfg::kSupportsSplitK, "sm90 gemm: k_splits: tile ", Cfg::kTile.name,
                      " runs unsplit (the split tiles are the *_splitk ones): expected k_splits "
                      "<= 1, got ", p.k_splits);
    const int stages = p.k / Cfg::kTile.k_multiple();
    MEGAMOE_CHECK_ARG(p.k_splits <= stages, "sm90 gemm: k_splits: expected at most the ", stages,
                      " pipeline stages of K = ", p.k, ", got ", p.k_splits);
  }
  MEGAMOE_CHECK_ARG(!Cfg::kFp8 || (p.w_row_exp != nullptr && p.b_row_factor != nullptr),
                    "sm90 gemm: tile ", Cfg::kTile.name, " is an FP8-mode tile: it needs E4M3 "
                    "token rows with their row factors and the weights' row exponents (L1Args / "
                    "L2Args: act_fp8 / h_fp8 and the rest of the FP8 inputs)");
  MEGAMOE_CHECK_ARG(!Cfg::kTile.needs_small_scales() || p.small_scales != 0, "sm90 gemm: tile ",
                    Cfg::kTile.name, " converts with one multiply, exact only for weight scale "
                    "bytes < 128 (L1Args / L2Args::small_scales, scales_all_small); these weights "
                    "have a larger scale (or small_scales was not set): use the policy (auto or "
                    "serial) or a serial_* tile");
  const auto& dev = cuda::device_info();
  const size_t smem_max = Cfg::smem_bytes(kMaxLocalExperts);
  MEGAMOE_CHECK(static_cast<int64_t>(smem_max) <= dev.smem_per_block_optin,
                ErrorCode::kUnsupported, "sm90 gemm: tile ", Cfg::kTile.name, " needs ", smem_max,
                " bytes of shared memory per block, device allows ", dev.smem_per_block_optin);
  // Per device (a process may launch on several GPUs): the attribute belongs to the function on
  // the current device.
  cuda::raise_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem_max);
  const CUtensorMap map = make_rows_map(b_rows, static_cast<int64_t>(p.max_rows) + kRowSlack, p.k,
                                       Cfg::kBlockN, Cfg::kFp8);
  const int grid = dev.sm_count * Cfg::kMinBlocksPerSM;
  cuda::launch(kernel, grid, Cfg::kThreads, Cfg::smem_bytes(p.num_experts), stream,
               p.prefetch_before_wait != 0, map, p);
}

template <TileId kId, GemmKind kKind>
void load_tile() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&attributes,
                                           &sm90_grouped_gemm_bf16_mxfp4_kernel<GemmConfig<kId>, kKind>));
}

#if MEGAMOE_DIAG_TIMELINE
template <TileId kId>
std::vector<uint64_t> diag_read_timeline_of() {
  std::vector<uint64_t> table(static_cast<size_t>(diag::kTimelineCtas) * diag::kNumEvents);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  MEGAMOE_CUDA_CHECK(cudaMemcpyFromSymbol(table.data(), diag::g_timeline, table.size() * sizeof(uint64_t)));
  const std::vector<uint64_t> zeros(table.size(), 0);
  MEGAMOE_CUDA_CHECK(cudaMemcpyToSymbol(diag::g_timeline, zeros.data(), zeros.size() * sizeof(uint64_t)));
  return table;
}
#endif

}  // namespace megamoe::sm90
