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

#include "sm90/sm90_dispatch_types.hpp"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {


// Local expert of id `id` (read from slot `slot`), or -1. With kRecord, records invalid ids.
template <bool kRecord>
__device__ __forceinline__ int32_t dispatch_local_expert(const DispatchParams& p, int32_t id,
                                                         int64_t slot) {
  if (id == -1) return -1;
  if (id < 0 || id >= p.num_experts) {
    if (kRecord) {
      const unsigned long long record =
          (static_cast<unsigned long long>(slot) << 32) | static_cast<uint32_t>(id);
      atomicMin(&p.error->first_bad, record);
      atomicAdd(&p.error->num_bad, 1ull);
      if (p.error_flag != nullptr) {
        __threadfence_system();  // the record before the flag the host polls
        *reinterpret_cast<volatile int32_t*>(p.error_flag) = 1;
      }
    }
    return -1;
  }
  const int32_t local = id - p.first_local;
  return (local >= 0 && local < p.num_local) ? local : -1;
}

// Block size kDispatchMaxWarps * 32; the first `num_warps` warps take part in the passes.
// Dynamic shared memory: num_warps * num_local int32.
__global__ void __launch_bounds__(kDispatchMaxWarps * kDispatchWarpSize)
sm90_dispatch_topk_kernel(const DispatchParams p, int num_warps) {
  extern __shared__ int32_t hist[];  // [num_warps][num_local]
  __shared__ int32_t warp_totals[kDispatchMaxWarps];
  constexpr unsigned kFullMask = 0xFFFFFFFFu;
  const int lane = threadIdx.x % kDispatchWarpSize;
  const int warp = threadIdx.x / kDispatchWarpSize;
  const int num_local = p.num_local;
  const int hist_size = num_warps * num_local;
  const int64_t segment = (p.num_slots + num_warps - 1) / num_warps;

  for (int i = threadIdx.x; i < hist_size; i += blockDim.x) hist[i] = 0;
  // PDL: the previous kernel's outputs (and its reads of ours) are settled past this point.
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  __syncthreads();

  // ---- pass 1: per-warp histograms ----
  // NOTES: each lane loads kDispatchUnroll ids before using any, so a warp keeps kDispatchUnroll
  // loads in flight; one load at a time left the single CTA latency-bound (at T*K = 131072).
  if (warp < num_warps) {
    const int64_t begin = warp * segment;
    const int64_t end = min(begin + segment, p.num_slots);
    int32_t* my_hist = hist + warp * num_local;
    for (int64_t base = begin; base < end; base += kDispatchWarpSize * kDispatchUnroll) {
      int32_t ids[kDispatchUnroll];
#pragma unroll
      for (int u = 0; u < kDispatchUnroll; ++u) {
        const int64_t s = base + u * kDispatchWarpSize + lane;
        ids[u] = s < end ? __ldg(p.topk_idx + s) : -1;
      }
#pragma unroll
      for (int u = 0; u < kDispatchUnroll; ++u) {
        const int64_t s = base + u * kDispatchWarpSize + lane;
        const int32_t e = dispatch_local_expert<true>(p, ids[u], s);
        if (e >= 0) atomicAdd(my_hist + e, 1);
      }
    }
  }
  __syncthreads();

  // ---- scan: per expert over warps, then over experts ----
  // Thread i owns experts [i * per_thread, (i+1) * per_thread), so a thread-order scan of the
  // per-thread sums is an expert-order scan.
  const int per_thread = (num_local + blockDim.x - 1) / blockDim.x;
  const int e_begin = min(static_cast<int>(threadIdx.x) * per_thread, num_local);
  const int e_end = min(e_begin + per_thread, num_local);
  int32_t local_sum = 0;
  for (int e = e_begin; e < e_end; ++e)
    for (int w = 0; w < num_warps; ++w) local_sum += hist[w * num_local + e];

  // Block-wide exclusive scan of local_sum: within warps by shuffles, then over warp totals.
  int32_t inclusive = local_sum;
#pragma unroll
  for (int offset = 1; offset < kDispatchWarpSize; offset <<= 1) {
    const int32_t n = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += n;
  }
  if (lane == kDispatchWarpSize - 1) warp_totals[warp] = inclusive;
  __syncthreads();
  const int num_block_warps = blockDim.x / kDispatchWarpSize;
  if (warp == 0) {
    int32_t t = lane < num_block_warps ? warp_totals[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < kDispatchWarpSize; offset <<= 1) {
      const int32_t n = __shfl_up_sync(kFullMask, t, offset);
      if (lane >= offset) t += n;
    }
    if (lane < num_block_warps) warp_totals[lane] = t;  // inclusive over block warps
  }
  __syncthreads();
  int32_t row = inclusive - local_sum + (warp > 0 ? warp_totals[warp - 1] : 0);
  for (int e = e_begin; e < e_end; ++e) {
    p.row_offsets[e] = row;
    for (int w = 0; w < num_warps; ++w) {
      const int32_t count = hist[w * num_local + e];
      hist[w * num_local + e] = row;  // first row of warp w's slots of expert e
      row += count;
    }
  }
  if (threadIdx.x == 0) p.row_offsets[num_local] = warp_totals[num_block_warps - 1];
  __syncthreads();

  // ---- pass 2: stable placement ----
  if (warp < num_warps) {
    const int64_t begin = warp * segment;
    const int64_t end = min(begin + segment, p.num_slots);
    int32_t* my_cursor = hist + warp * num_local;
    const unsigned lanes_below = (1u << lane) - 1u;
    for (int64_t base = begin; base < end; base += kDispatchWarpSize * kDispatchUnroll) {
      int32_t ids[kDispatchUnroll];
      float weights[kDispatchUnroll];
#pragma unroll
      for (int u = 0; u < kDispatchUnroll; ++u) {
        const int64_t s = base + u * kDispatchWarpSize + lane;
        ids[u] = s < end ? __ldg(p.topk_idx + s) : -1;
        weights[u] = s < end ? __ldg(p.topk_weights + s) : 0.0f;
      }
      // Chunks in order: the placement stays stable (ascending slots within an expert).
#pragma unroll
      for (int u = 0; u < kDispatchUnroll; ++u) {
        const int64_t s = base + u * kDispatchWarpSize + lane;
        // Invalid ids were recorded in pass 1; here they only map to -1.
        const int32_t e = dispatch_local_expert<false>(p, ids[u], s);
        const unsigned peers = __match_any_sync(kFullMask, e);
        const int32_t rank = __popc(peers & lanes_below);
        int32_t r = -1;
        if (e >= 0) r = my_cursor[e] + rank;
        __syncwarp();
        // The lowest lane of each group advances its expert's cursor by the group size.
        if (e >= 0 && rank == 0) my_cursor[e] += __popc(peers);
        __syncwarp();
        if (s < end) {
          p.slot_to_row[s] = r;
          if (r >= 0) {
            p.row_slot[r] = static_cast<int32_t>(s);
            p.row_weights[r] = weights[u];
          }
        }
      }
    }
  }
}

}  // namespace megamoe::sm90
