// sm90_rebase_rows.cuh: FP8 mode (docs/numerics.md "FP8 mode"): the E4M3 token rows the FP8 GEMM
// tiles read, from rows of FP8 codes with per-32 UE8M0 scales.
//
//   s_max = max over the row's groups of sf;  factor[r] = 2^(s_max - 127)
//   dst[r, 32 g + fp8_row_slot(j)] = e4m3_rn(code[src, 32 g + j] * 2^(sf[src, g] - s_max))
//   src = row_slot[r] / top_k (L1's operand: the token of each routed row), or r when top_k is 0
//   (L2's operand: L1's intermediate rows themselves)
//
// Exact for every value that stays in E4M3's range after the shift; below it, one rounding to
// nearest (the code's value times a power of two is exact in FP32, then cvt.rn.satfinite). NaN
// codes stay NaN. Rows at or past row_offsets[num_local] (not routed here) are left alone.
//
// Mapping: one warp per row (grid-stride over rows; rebase_row_e4m3, which the MegaMoE kernel's
// rebase units run too); lane l takes groups l, l + 32, ...: the row's largest scale byte by a
// warp max, then each group's 32 bytes in, rebased, permuted in registers and stored as 32 bytes.
#pragma once

#include <cstdint>

#include "ptx/sm90_ptx.cuh"
#include "sm90/sm90_rebase_row.cuh"

namespace megamoe::sm90 {

constexpr int kRebaseBlockThreads = 256;

__global__ void __launch_bounds__(kRebaseBlockThreads)
sm90_rebase_rows_e4m3_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ sf,
                             const int32_t* __restrict__ row_offsets,
                             const int32_t* __restrict__ row_slot, int32_t num_local,
                             uint32_t top_k, uint32_t cols, int64_t max_rows,
                             uint8_t* __restrict__ dst, float* __restrict__ factor) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t num_rows = min(static_cast<int64_t>(__ldg(row_offsets + num_local)), max_rows);
  const uint32_t groups = cols / kScaleBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       r < num_rows; r += warps) {
    const int64_t src = top_k == 0 ? r : __ldg(row_slot + r) / static_cast<int32_t>(top_k);
    rebase_row_e4m3<false>(q + src * cols, sf + src * groups, groups, dst + r * cols, factor + r,
                           lane);
  }
}

}  // namespace megamoe::sm90
