// sm90_dispatch_sort.cuh: the device body of the dispatch stage (sm90_dispatch.cuh describes the
// algorithm): the stable counting sort of routed slots into per-local-expert row lists, over a
// slot source (the caller's top-k on one GPU, the received slots under expert parallelism,
// kernels/ep/ep_kernels.cuh).
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

// The slots of a layer call on one GPU: slot s = t*K + k of the caller's topk_idx/topk_weights.
struct LocalSlots {
  static constexpr bool kRecord = true;  // invalid ids are recorded here (the caller's input)
  const int32_t* topk_idx;
  const float* topk_weights;
  __device__ __forceinline__ int32_t id(int64_t s) const { return __ldg(topk_idx + s); }
  __device__ __forceinline__ float weight(int64_t s) const { return __ldg(topk_weights + s); }
  __device__ __forceinline__ int32_t row_slot(int64_t s) const { return static_cast<int32_t>(s); }
};

// The counting sort's pass 1 and scan (see the top of the file): row_offsets written, and
// hist[w][e] left as the first row of warp w's slots of expert e (pass 2's cursors). Block size
// up to kDispatchMaxWarps * 32; the first `num_warps` warps take part in the pass. hist: dynamic
// shared memory of num_warps * num_local int32. Rows above p.max_rows (when nonzero) are never
// written: every expert is then left empty and it returns false.
template <class Slots>
__device__ __forceinline__ bool dispatch_count(const DispatchParams& p, const Slots& slots,
                                               int num_warps, int32_t* hist,
                                               int32_t* warp_totals) {
  constexpr unsigned kFullMask = 0xFFFFFFFFu;
  const int lane = threadIdx.x % kDispatchWarpSize;
  const int warp = threadIdx.x / kDispatchWarpSize;
  const int num_local = p.num_local;
  const int hist_size = num_warps * num_local;
  const int64_t segment = (p.num_slots + num_warps - 1) / num_warps;

  for (int i = threadIdx.x; i < hist_size; i += blockDim.x) hist[i] = 0;
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
        ids[u] = s < end ? slots.id(s) : -1;
      }
#pragma unroll
      for (int u = 0; u < kDispatchUnroll; ++u) {
        const int64_t s = base + u * kDispatchWarpSize + lane;
        const int32_t e = dispatch_local_expert<Slots::kRecord>(p, ids[u], s);
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
  const int32_t total = warp_totals[num_block_warps - 1];
  if (threadIdx.x == 0) p.row_offsets[num_local] = total;
  __syncthreads();
  if (p.max_rows > 0 && total > p.max_rows) {
    // More rows than the workspace holds: nothing is placed, every expert is left empty.
    for (int e = threadIdx.x; e <= num_local; e += blockDim.x) p.row_offsets[e] = 0;
    return false;
  }
  return true;
}

// The counting sort's pass 2, after dispatch_count (the same block, slots and num_warps):
// slot_to_row, row_slot and row_weights.
template <class Slots>
__device__ __forceinline__ void dispatch_place(const DispatchParams& p, const Slots& slots,
                                               int num_warps, int32_t* hist) {
  constexpr unsigned kFullMask = 0xFFFFFFFFu;
  const int lane = threadIdx.x % kDispatchWarpSize;
  const int warp = threadIdx.x / kDispatchWarpSize;
  const int num_local = p.num_local;
  const int64_t segment = (p.num_slots + num_warps - 1) / num_warps;
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
        ids[u] = s < end ? slots.id(s) : -1;
        weights[u] = s < end ? slots.weight(s) : 0.0f;
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
          if (p.slot_to_row != nullptr) p.slot_to_row[s] = r;
          if (r >= 0) {
            p.row_slot[r] = slots.row_slot(s);
            p.row_weights[r] = weights[u];
          }
        }
      }
    }
  }
}

// The same placement for a few slots (p.num_slots <= kDispatchSmallSlots <= blockDim.x), with
// one global round trip and two barriers: thread v loads slot v's id and weight; every slot's
// row and every expert's offset are then counted from the ids in shared memory (a slot's row is
// the number of valid slots of smaller local expert, or of its expert and smaller index: the
// stable order of dispatch_sort). Writes the outputs of dispatch_sort, returns its result and
// the total rows in *total. s_local: shared memory of kDispatchSmallSlots int32. Called by every
// thread of the block.
// NOTES: why: dispatch_sort's passes (zeroed histograms, scans over every local expert, five
// barriers, dependent global round trips) are most of a small EP call's dispatch
// (docs/tuning-log.md).
constexpr int kDispatchSmallSlots = 256;
template <class Slots>
__device__ __forceinline__ bool dispatch_sort_small(const DispatchParams& p, const Slots& slots,
                                                    int32_t* s_local, int32_t* total) {
  const int v = threadIdx.x;
  const int n = static_cast<int>(p.num_slots);
  int32_t local = -1;
  float weight = 0.0f;
  if (v < n) {
    const int32_t id = slots.id(v);
    weight = slots.weight(v);
    local = dispatch_local_expert<Slots::kRecord>(p, id, v);
    s_local[v] = local;
  }
  const int32_t rows = __syncthreads_count(local >= 0);  // also orders s_local's stores
  *total = rows;
  const bool fits = p.max_rows <= 0 || rows <= p.max_rows;
  for (int e = v; e <= p.num_local; e += blockDim.x) {
    int32_t before = 0;
    if (fits) {
      for (int j = 0; j < n; ++j) {
        const int32_t l = s_local[j];
        before += (l >= 0) & (l < e);
      }
    }
    p.row_offsets[e] = before;  // more rows than the workspace holds: every expert empty
  }
  if (!fits) return false;
  if (v < n) {
    int32_t row = -1;
    if (local >= 0) {
      row = 0;
      for (int j = 0; j < n; ++j) {
        const int32_t l = s_local[j];
        row += (l >= 0) & ((l < local) | ((l == local) & (j < v)));
      }
      p.row_slot[row] = slots.row_slot(v);
      p.row_weights[row] = weight;
    }
    if (p.slot_to_row != nullptr) p.slot_to_row[v] = row;
  }
  return true;
}

// The counting sort of the slots [0, p.num_slots) that `slots` reads (see the top of the file):
// dispatch_count, then dispatch_place unless the rows exceed p.max_rows (false: every expert
// left empty, nothing placed).
template <class Slots>
__device__ __forceinline__ bool dispatch_sort(const DispatchParams& p, const Slots& slots,
                                              int num_warps, int32_t* hist,
                                              int32_t* warp_totals) {
  if (!dispatch_count(p, slots, num_warps, hist, warp_totals)) return false;
  dispatch_place(p, slots, num_warps, hist);  // dispatch_count's last barrier follows the cursors'
                                              // last write
  return true;
}

}  // namespace megamoe::sm90
