// sm90_gemm_launch.hpp: the per-tile launchers of the Hopper grouped GEMMs. Declared here, defined
// in sm90_gemm_launch.cuh and instantiated once per shipped tile in generated translation units
// (CMakeLists.txt, sm90_gemm_tile.cu.in), so the kernels compile in parallel and sm90_gemm.cu,
// which dispatches to them by TileId, compiles none.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <vector>

#include "moe/sm90_gemm.hpp"
#include "sm90/sm90_diag.hpp"
#include "sm90/sm90_gemm_config.hpp"

namespace megamoe::sm90 {

// Launches tile kId's kernel of kind kKind on `stream` (checks what the tile asks of K, k_splits,
// the scales and shared memory first).
// b_rows: bf16 token rows, or E4M3 ones for an FP8 tile.
template <TileId kId, GemmKind kKind>
void launch_tile(const GemmParams& p, const void* b_rows, cudaStream_t stream);

// Launches the MegaMoE kernel (kernels/sm90/sm90_mega_moe.cuh) of tile kId (kMegaTiles) on
// `stream`: act and h_act are L1's and L2's bf16 token rows. Checks what the tile asks of K and
// the scales, and shared memory, first.
template <TileId kId>
void launch_mega_tile(const MegaParams& mp, const void* act, const void* h_act, cudaStream_t stream);
template <TileId kId>
void load_mega_tile();

// The GemmParams of launch_l1 / launch_l2 (their argument checks included), for the MegaMoE
// launcher (sm90_mega.cu).
GemmParams l1_params(const L1Args& args);
GemmParams l2_params(const L2Args& args);

// Loads tile kId's kernel of kind kKind into the context now (CUDA loads kernels lazily, at
// their first launch, and that load waits for the device to be idle: see load_gemm_kernels).
template <TileId kId, GemmKind kKind>
void load_tile();

// Row-major [rows, cols] token rows, bf16 (read in boxes of box_rows x 64) or E4M3 (fp8: boxes of
// box_rows x 128), 128-byte swizzle.
CUtensorMap make_rows_map(const void* base, int64_t rows, int64_t cols, int box_rows, bool fp8);

#if MEGAMOE_DIAG_TIMELINE
// Measurement builds: the stamps of tile kId's translation unit (each has its own table), and the
// table cleared. Synchronizes the device.
template <TileId kId>
std::vector<uint64_t> diag_read_timeline_of();
#endif

}  // namespace megamoe::sm90
