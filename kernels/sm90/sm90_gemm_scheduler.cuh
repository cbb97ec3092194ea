// sm90_gemm_scheduler.cuh: the persistent tile schedule of the grouped GEMMs, built on the device
// from row_offsets (no host synchronization: the grid is sized from the SM count alone). The
// schedule's lookups (TileScheduler) are in sm90_tile_schedule.hpp, host + device.
#pragma once

#include <cstdint>

#include "sm90/sm90_gemm_config.hpp"  // kMaxLocalExperts
#include "sm90/sm90_tile_schedule.hpp"  // TileInfo, TileScheduler (host + device)

namespace megamoe::sm90 {

// Inclusive sum of v over the lanes 0..lane of the warp (all 32 lanes call it).
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xFFFFFFFFu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// Exclusive prefix over the CTA of one value per thread (threads in index order); *total, when
// given, gets the sum over all threads. Called by all kThreads threads (contains one
// __syncthreads). Its warp sums live in one shared array per kernel: a second call may only
// start after a barrier that follows the first call's return.
template <int kThreads>
__device__ __forceinline__ int block_exclusive_sum(int v, int* total = nullptr) {
  __shared__ int32_t s_warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int incl = warp_inclusive_sum(v, lane);
  if (lane == 31) s_warp_sums[warp] = incl;
  __syncthreads();
  int before = incl - v, sum = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    before += w < warp ? s_warp_sums[w] : 0;
    sum += s_warp_sums[w];
  }
  if (total != nullptr) *total = sum;
  return before;
}

// Copies row_offsets[0..E] into shared memory with coalesced loads: thread i loads entries i,
// i + kThreads, ...; all of a thread's loads are issued before its first store, so the CTA waits
// for one global load latency, not one per kThreads experts. No barrier: the caller syncs.
// NOTES: ld.global.cg (L2), not the read-only path: with programmatic dependent launch this
// runs before the grid's dependency wait (GemmParams::prefetch_before_wait).
template <int kThreads>
__device__ __forceinline__ void load_row_offsets(const int32_t* __restrict__ row_offsets,
                                                 int num_experts, int32_t* s_offsets) {
  constexpr int kPerThread = (kMaxLocalExperts + 1 + kThreads - 1) / kThreads;
  const int tid = threadIdx.x;
  int32_t loaded[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = tid + i * kThreads;
    loaded[i] = e <= num_experts ? __ldcg(row_offsets + e) : 0;
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = tid + i * kThreads;
    if (e <= num_experts) s_offsets[e] = loaded[i];
  }
}

// The row offsets the dispatch writes, counted from the caller's top-k ids into s_offsets[0..E]
// (GemmParams::topk_idx): each local expert's slots, then an exclusive scan. Called by all
// kThreads threads of the CTA (contains __syncthreads; the caller syncs after it).
template <int kThreads>
__device__ __forceinline__ void count_row_offsets(const int32_t* __restrict__ topk_idx,
                                                  int num_slots, int first_local, int num_experts,
                                                  int32_t* s_offsets) {
  const int tid = threadIdx.x;
  for (int e = tid; e <= num_experts; e += kThreads) s_offsets[e] = 0;
  __syncthreads();
  for (int s = tid; s < num_slots; s += kThreads) {
    // ld.global.cg as load_row_offsets: this runs before the grid's dependency wait.
    const int local = __ldcg(topk_idx + s) - first_local;  // -1 and invalid ids: out of range
    if (local >= 0 && local < num_experts) atomicAdd(&s_offsets[local], 1);
  }
  __syncthreads();
  // Exclusive scan of the counts in place: thread i owns entries [i C, i C + C).
  const int per = (num_experts + 1 + kThreads - 1) / kThreads;
  const int first = tid * per;
  int sum = 0;
  for (int j = 0; j < per && first + j <= num_experts; ++j) sum += s_offsets[first + j];
  int run = block_exclusive_sum<kThreads>(sum);
  for (int j = 0; j < per && first + j <= num_experts; ++j) {
    const int count = s_offsets[first + j];
    s_offsets[first + j] = run;
    run += count;
  }
}

// build_schedule of the configs with setmaxnreg (prefill): the same schedule, kThreads experts per
// round with two __syncthreads each. Called by all kThreads threads of the CTA (contains
// __syncthreads).
// NOTES: the one-round version below made ptxas spill 2-3 KB in the asynchronous-epilogue
// prefill kernels (40 bytes in PrefillWideAsync L2, none before; nvcc 13.0), whose launches last
// milliseconds, where the rounds' microsecond does not matter.
template <int kThreads, int kBlockN>
__device__ void build_schedule_rounds(const int32_t* __restrict__ row_offsets, int num_experts,
                                      int max_rows, int m_tiles, int32_t* s_offsets,
                                      int32_t* s_prefix) {
  const int tid = threadIdx.x;
  // NOTES: a loop of dependent load + store rounds took ~5 % of the samples of Kimi-K3 L1 at
  // T = 1 (7 rounds for 896 experts; Nsight Compute): load_row_offsets issues all loads first.
  load_row_offsets<kThreads>(row_offsets, num_experts, s_offsets);
  __syncthreads();
  for (int e = tid; e < num_experts; e += kThreads) {
    const int lo = s_offsets[e], hi = s_offsets[e + 1];
    // Invalid offsets would index out of bounds: fail the launch (no printf: see mbar_wait).
    if (lo < 0 || hi < lo || hi > max_rows) __trap();
  }
  int carry = 0;
  for (int base = 0; base <= num_experts; base += kThreads) {
    const int e = base + tid;
    const int tiles =
        e < num_experts ? m_tiles * ((s_offsets[e + 1] - s_offsets[e] + kBlockN - 1) / kBlockN) : 0;
    int total = 0;
    const int before = block_exclusive_sum<kThreads>(tiles, &total);
    if (e <= num_experts) s_prefix[e] = carry + before;
    carry += total;
    __syncthreads();  // the next round's scan rewrites the warp sums
  }
}

// Loads row_offsets into shared memory, checks them, and writes the tile prefix. Called by all
// kThreads threads of the CTA (contains __syncthreads; the caller synchronizes after it).
// The loads are coalesced (thread i loads entries i, i + kThreads, ...; all of a thread's loads
// are issued before its first store, so the CTA waits for one global load latency) into shared
// memory; then thread i takes the C = ceil((E + 1) / kThreads) consecutive entries [i C, i C + C)
// from there (a stride of C words: no bank conflicts for odd C), checks and counts its experts'
// tiles in registers, and one block-wide scan of the per-thread counts gives every prefix.
// NOTES: the former version scanned kThreads experts per round with two __syncthreads each (6
// rounds at E_l = 896), slower from kernel entry to the schedule (MEGAMOE_DIAG_TIMELINE build).
// A first one-round version that loaded each thread's C entries straight from global memory (C
// words apart across a warp, 7x the L2 requests of coalesced loads) was slower still
// (docs/tuning-log.md).
// With topk_idx (GemmParams::topk_idx), the offsets are counted from the ids instead.
template <int kThreads, int kBlockN>
__device__ void build_schedule(const int32_t* __restrict__ row_offsets, int num_experts,
                               int max_rows, int m_tiles, int32_t* s_offsets, int32_t* s_prefix,
                               const int32_t* __restrict__ topk_idx = nullptr, int topk_slots = 0,
                               int topk_first_local = 0) {
  const int tid = threadIdx.x;
  constexpr int kMaxPer = (kMaxLocalExperts + 1 + kThreads - 1) / kThreads;
  if (topk_idx != nullptr) {
    count_row_offsets<kThreads>(topk_idx, topk_slots, topk_first_local, num_experts, s_offsets);
  } else {
    load_row_offsets<kThreads>(row_offsets, num_experts, s_offsets);
  }
  __syncthreads();
  const int per = (num_experts + 1 + kThreads - 1) / kThreads;  // C <= kMaxPer
  const int first = tid * per;
  int tiles_before[kMaxPer];  // this thread's tiles before entry first + j
  int count = 0;
  int hi = first <= num_experts ? s_offsets[first] : 0;
#pragma unroll
  for (int j = 0; j < kMaxPer; ++j) {
    const int e = first + j;
    tiles_before[j] = count;
    if (j < per && e < num_experts) {
      const int lo = hi;
      hi = s_offsets[e + 1];
      // Invalid offsets would index out of bounds: fail the launch (no printf: see mbar_wait).
      if (lo < 0 || hi < lo || hi > max_rows) __trap();
      count += m_tiles * ((hi - lo + kBlockN - 1) / kBlockN);
    }
  }
  // Exclusive prefix of the per-thread counts over the CTA.
  const int base = block_exclusive_sum<kThreads>(count);
#pragma unroll
  for (int j = 0; j < kMaxPer; ++j) {
    const int e = first + j;
    if (j < per && e <= num_experts) s_prefix[e] = base + tiles_before[j];
  }
}

}  // namespace megamoe::sm90
