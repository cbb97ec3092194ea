// sm90_mega.hpp: the launcher of the MegaMoE kernel (kernels/sm90/sm90_mega_moe.cuh): L1 and L2
// of a layer call in one persistent launch, for the calls the policy gives it
// (choose_mega_tile, sm90_tile_policy.hpp); the layer chains launch_l1 and launch_l2 for the
// others.
#pragma once

#include <cstdint>

#include "moe/sm90_gemm.hpp"
#include "sm90/sm90_gemm_config.hpp"  // MegaGather

namespace megamoe::sm90 {

// The kernel's per-slot counters (zero-initialized once by the owner, left zero by every launch;
// one workspace serves the launches of one stream in turn).
struct MegaWorkspace {
  int32_t* ready = nullptr;     // [capacity]
  int32_t* consumed = nullptr;  // [capacity]
  int64_t capacity = 0;
  // Split-K parts of both GEMMs in one launch (optional; without it nothing is split): FP32
  // partials and one arrival counter per tile (zero-initialized once, left zero). A launch whose
  // parts exceed it runs unsplit.
  float* split_partials = nullptr;
  int64_t split_partial_floats = 0;
  int32_t* split_counters = nullptr;
  int64_t split_counters_capacity = 0;
  // The combine inside the launch (MegaCombine::counters): 2 words, zero-initialized once.
  uint32_t* combine_counters = nullptr;
  bool empty() const { return ready == nullptr || consumed == nullptr; }
};

// Counters each of `ready` and `consumed` needs for a layer of max_rows rows over num_experts
// local experts, for every tile of kMegaTiles (the most slots: the smallest BLOCK_N).
int64_t mega_counters(int64_t max_rows, int num_experts);
// (Its split-K workspace: mega_split_counters / mega_split_partial_floats, sm90_tile_policy.hpp.)

#if defined(MEGAMOE_WITH_CUDA)
// One launch of both GEMMs when choose_mega_tile picks the MegaMoE kernel for this call (the
// exact mode, decode-class rows per expert, small scales; l1.tile for both), or, in the FP8 mode
// (l1.act_fp8 and l2.h_fp8 given), choose_mega_fp8_tile does, and returns true; in the FP8 mode
// the launch also writes l2.h_fp8 and l2.h_row_factor from L1's h_q / h_sf (what
// launch_rebase_rows_e4m3 between the chained launches writes);
// otherwise launches nothing and returns false (the caller runs launch_l1 then launch_l2). l1 and
// l2 are the arguments the two launches would get (the same experts, rows and row_offsets;
// l1.split_k.unit_counter is required; their split_k partials are not used: ws has the fused
// kernel's own). l1.k_splits / l2.k_splits: 0 the policy's parts, n >= 1 n parts of each tile
// (a split tile, ws's split workspace). Asynchronous, capturable. Under expert parallelism
// l2.out_rows sends L2's rows to their sources' combine slots, as the chained L2 does, and
// `gather` (optional: its inputs, x_q, x_sf, row_slot, arrival, top_k) gathers L1's B rows
// (l1.act, or in the FP8 mode l1.act_fp8 / act_row_factor) from the received rows inside the
// launch, each row once it has arrived (MegaGather; what launch_gather or
// launch_rebase_rows_e4m3 before it would write). `combine` (optional: its rows, slot_to_row, y,
// T, K, all_ctas and, under expert parallelism, the rank's EpParams; the counters are ws's) sums y
// inside the launch after both GEMMs (MegaCombine; what launch_combine after it, and under expert
// parallelism ep::launch_return before that, would do).
bool launch_mega(const L1Args& l1, const L2Args& l2, const MegaWorkspace& ws, cudaStream_t stream,
                 const MegaGather* gather = nullptr, const MegaCombine* combine = nullptr);
// Whether launch_mega with these arguments runs the kernel (the policy's choice), without
// launching: a caller that gathers inside the launch decides its EP dispatch by it.
bool mega_fuses(const L1Args& l1, const L2Args& l2, const MegaWorkspace& ws);
// The checks launch_mega makes of `gather` (throws kInvalidArgument naming what is missing); a
// caller that launches the EP dispatch first makes them before it.
void check_mega_gather(const MegaGather& gather, const L1Args& l1);

// Loads every MegaMoE kernel now (see load_gemm_kernels).
void load_mega_kernels();
#endif

}  // namespace megamoe::sm90
