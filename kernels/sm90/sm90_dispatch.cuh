// sm90_dispatch.cuh: stage 2 of the layer, dispatch: the per-expert row lists built on the device
// from the top-k routing, with no host synchronization.
//
// Inputs (the caller's device tensors, read once; this is the "staging" of top-k ids/weights):
//   topk_idx     int32 [T, K]  global expert ids in [0, E) or -1
//   topk_weights fp32  [T, K]
// Outputs (layer workspace):
//   row_offsets  int32 [E_l + 1]   rows of local expert e are [row_offsets[e], row_offsets[e+1])
//   slot_to_row  int32 [T * K]     row of slot s = t*K + k, or -1 (empty, other rank, invalid)
//   row_slot     int32 [rows]      inverse map: the slot a row serves (gather reads token s / K)
//   row_weights  fp32  [rows]      topk_weights of that slot
//   error        DispatchError     sticky record of invalid ids (see below)
//
// Placement is a stable counting sort: within an expert, rows follow ascending slot order, so
// every run places every slot in the same row (bitwise determinism of the whole layer).
//
// One CTA, kDispatchMaxWarps warps. The slots are cut into one contiguous segment per warp.
//   pass 1  each warp counts its segment into its own histogram row hist[w][e] (shared memory)
//   scan    per expert: exclusive prefix over warps; over experts: block-wide exclusive scan of
//           the totals -> row_offsets; hist[w][e] becomes the first row of warp w in expert e
//   pass 2  each warp walks its segment again in order, 32 slots at a time; lanes with the same
//           expert find each other with __match_any_sync and take consecutive rows in lane order.
// Shared memory: num_warps * E_l * 4 bytes (896 experts x 32 warps = 112 KiB); the launcher picks
// the largest warp count that fits. NOTES: a single CTA is enough: T*K <= 131072 slots at the
// largest shape is ~2 x 128 32-slot steps per warp, a few microseconds next to the GEMMs, and it
// needs no grid-wide synchronization (which a multi-CTA sort would need to stay deterministic).
//
// Invalid ids (outside [0, E) and not -1) are never used as an index. The slot is treated as
// empty, and the error record keeps the smallest invalid slot with its id (one 64-bit atomicMin
// of (slot << 32 | id), so the record is deterministic) plus a count, and the host-mapped
// error_flag is set so that the host sees a pending error without waiting (Sm90Layer checks it
// at its next forward). The host reads the record only in Sm90Layer::check_errors(), which
// synchronizes; forward() itself never waits.
#pragma once

#include <cstdint>

#include "sm90/sm90_dispatch_sort.cuh"
#include "sm90/sm90_dispatch_types.hpp"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {

// Dynamic shared memory: num_warps * num_local int32.
__global__ void __launch_bounds__(kDispatchMaxWarps * kDispatchWarpSize)
sm90_dispatch_topk_kernel(const DispatchParams p, int num_warps) {
  extern __shared__ int32_t hist[];  // [num_warps][num_local]
  __shared__ int32_t warp_totals[kDispatchMaxWarps];
  // PDL: the previous kernel's outputs (and its reads of ours) are settled past this point.
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  dispatch_sort(p, LocalSlots{p.topk_idx, p.topk_weights}, num_warps, hist, warp_totals);
}

}  // namespace megamoe::sm90
