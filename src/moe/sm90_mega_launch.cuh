// sm90_mega_launch.cuh: the definition of the per-tile MegaMoE launcher (sm90_gemm_launch.hpp),
// for the generated translation units only (sm90_mega_tile.cu.in, one per kMegaTiles entry).
#pragma once

#include <algorithm>

#include "megamoe/error.hpp"
#include "moe/sm90_gemm.hpp"
#include "moe/sm90_gemm_launch.hpp"
#include "moe/sm90_tile_policy.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "runtime/cuda_launch.hpp"
#include "sm90/sm90_mega_moe.cuh"

namespace megamoe::sm90 {

template <TileId kId>
void launch_mega_tile(const MegaParams& mp, const void* act, const void* h_act, cudaStream_t stream) {
  using Cfg = GemmConfig<kId>;
  auto* kernel = &sm90_mega_moe_kernel<Cfg>;
  for (const GemmParams* p : {&mp.l1, &mp.l2}) {
    MEGAMOE_CHECK_ARG(p->k % Cfg::kTile.k_multiple() == 0, "sm90 MegaMoE kernel: tile ",
                      Cfg::kTile.name, " takes K (H for L1, I for L2) in multiples of ",
                      Cfg::kTile.k_multiple(), ", got ", p->k);
    MEGAMOE_CHECK_ARG(!Cfg::kTile.needs_small_scales() || p->small_scales != 0,
                      "sm90 MegaMoE kernel: tile ", Cfg::kTile.name, " needs weight scale bytes "
                      "< 128 in both GEMMs (L1Args / L2Args::small_scales)");
  }
  for (const GemmParams* p : {&mp.l1, &mp.l2}) {
    if (p->k_splits <= 1) continue;
    MEGAMOE_CHECK_ARG(Cfg::kSupportsSplitK && p->k_splits <= kMaxKSplits &&
                          p->k_splits <= p->k / Cfg::kTile.k_multiple(),
                      "sm90 MegaMoE kernel: k_splits ", p->k_splits, " (", p == &mp.l1 ? "L1" : "L2",
                      "): tile ", Cfg::kTile.name, Cfg::kSupportsSplitK ? " takes 1 to 4 parts, at most the stages of K"
                                                                    : " runs unsplit (the split tiles are the *_splitk ones)");
  }
  static_assert(mega_smem_bytes<Cfg>(kMaxLocalExperts) <= 227 * 1024,
                "the MegaMoE kernel's shared memory exceeds sm_90's 227 KiB per block");
  const auto& dev = cuda::device_info();
  const size_t smem_max = mega_smem_bytes<Cfg>(kMaxLocalExperts);
  MEGAMOE_CHECK(static_cast<int64_t>(smem_max) <= dev.smem_per_block_optin,
                ErrorCode::kUnsupported, "sm90 MegaMoE kernel: tile ", Cfg::kTile.name, " needs ",
                smem_max, " bytes of shared memory per block, device allows ",
                dev.smem_per_block_optin);
  cuda::raise_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem_max);
  MEGAMOE_CHECK_ARG(!Cfg::kFp8 || (mp.l1.w_row_exp != nullptr && mp.l1.b_row_factor != nullptr &&
                                   mp.l2.w_row_exp != nullptr && mp.h_fp8 != nullptr &&
                                   mp.h_factor != nullptr),
                    "sm90 MegaMoE kernel: FP8 tile ", Cfg::kTile.name, " needs both GEMMs' row "
                    "exponents, L1's row factors and L2's E4M3 rows and factors");
  // The rebase units read h_q and write h_fp8 16 bytes at a time (as launch_rebase_rows_e4m3).
  MEGAMOE_CHECK_ARG(!Cfg::kFp8 || (reinterpret_cast<uintptr_t>(mp.l1.h_q) % 16 == 0 &&
                                   reinterpret_cast<uintptr_t>(mp.h_fp8) % 16 == 0),
                    "sm90 MegaMoE kernel: FP8 mode: h_q / h_fp8: expected 16-byte aligned "
                    "pointers, got ", static_cast<const void*>(mp.l1.h_q), " / ",
                    static_cast<const void*>(mp.h_fp8));
  const int64_t rows = static_cast<int64_t>(mp.l1.max_rows) + kRowSlack;
  // (FP8 tiles: E4M3 rows, act_fp8 and h_fp8; exact mode: BF16 act and h_act.)
  const CUtensorMap map_act = make_rows_map(act, rows, mp.l1.k, Cfg::kBlockN, Cfg::kFp8);
  const CUtensorMap map_h = make_rows_map(h_act, rows, mp.l2.k, Cfg::kBlockN, Cfg::kFp8);
  // A persistent grid: at most what the occupancy query says is resident at once (the shared
  // memory of many local experts can allow fewer CTAs per SM than the tile's kMinBlocksPerSM),
  // so that every CTA the combine inside the launch counts out is running or about to.
  const size_t smem = mega_smem_bytes<Cfg>(mp.l1.num_experts);
  const int per_sm = cuda::resident_ctas_per_sm(reinterpret_cast<const void*>(kernel),
                                                Cfg::kThreads, smem);
  MEGAMOE_CHECK(per_sm >= 1, ErrorCode::kUnsupported, "sm90 MegaMoE kernel: tile ",
                Cfg::kTile.name, " with ", mp.l1.num_experts, " local experts (", smem,
                " bytes of shared memory) has no resident CTA per SM");
  const int grid = dev.sm_count * std::min(Cfg::kMinBlocksPerSM, per_sm);
  cuda::launch(kernel, grid, Cfg::kThreads, smem, stream,
               mp.l1.prefetch_before_wait != 0, map_act, map_h, mp);
}

template <TileId kId>
void load_mega_tile() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, &sm90_mega_moe_kernel<GemmConfig<kId>>));
}

}  // namespace megamoe::sm90
