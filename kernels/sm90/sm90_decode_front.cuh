// sm90_decode_front.cuh: stages 1-3 of the layer (quantize, dispatch, gather) in one launch, for
// decode-sized calls on one GPU in the exact mode (launch_decode_front: T*K <= kFrontMaxSlots).
//
// Inputs: x bf16 [T, H], topk_idx / topk_weights [T, K] (DispatchParams). Outputs: the same
// workspace the three separate kernels write, bit for bit:
//   x_q, x_sf                       the quantize kernel's (sm90_quantize_input.cuh)
//   row_offsets, slot_to_row,
//   row_slot, row_weights, error    the dispatch kernel's (sm90_dispatch.cuh)
//   act [rows, H]                   the gather kernel's (sm90_gather.cuh)
//
// Block 0 runs the dispatch sort's count and scan (dispatch_count, with the dispatch kernel's warp
// count rule): row_offsets. Blocks 1 + s * parts + part serve slot s (token t = s / K), each a
// range of chunk_span 8-channel chunks of the row: they quantize their part of row t of x with
// the quantize kernel's per-chunk code (the blocks of k = 0 store x_q / x_sf of the token), and
// when the slot has a local expert e they find the slot's row without waiting for block 0,
//   r = #{local slots of experts < e} + #{slots of e before s},
// which is where the stable counting sort puts it (the sort is unique), with one
// __syncthreads_count per kFrontBlockThreads slots, and write their part of act[r] as the gather
// does; part 0 records the slot's id if invalid and writes slot_to_row[s], row_slot[r] and
// row_weights[r] (the sort's pass 2).
// NOTES: why: at decode sizes the three launches cost mostly the latency of each dependent launch
// and of its one-CTA or one-row work (docs/perf.md, "The decode front"); here every slot's row
// is converted in parallel and no block waits for another. Each slot's blocks quantize their
// token again (K times per token, from L2), which is why the launcher caps T*K.
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"
#include "sm90/sm90_dispatch_sort.cuh"
#include "sm90/sm90_dispatch_types.hpp"
#include "sm90/sm90_gather.cuh"
#include "sm90/sm90_quantize_input.cuh"
#include "ptx/sm90_ptx.cuh"

namespace megamoe::sm90 {

constexpr int kFrontBlockThreads = 256;
constexpr int kFrontChunksPerThread = 4;  // x chunks each thread has in flight
static_assert(kFrontBlockThreads % (kQuantThreadsPerGroup * 32) == 0, "whole warps of groups");

struct FrontParams {
  DispatchParams dispatch;  // max_rows 0: T*K rows always fit
  const uint16_t* x;        // bf16 [T, H]
  int32_t top_k;
  int32_t hidden;           // H % 32 == 0
  uint8_t* x_q;             // e4m3 [T, H]
  uint8_t* x_sf;            // ue8m0 [T, H/32]
  uint16_t* act;            // bf16 [T*K, H]
  int32_t parts;            // blocks per slot, each a range of chunk_span 8-channel chunks
  int32_t chunk_span;       // a multiple of 32
};

// The caller's slots, as the dispatch reads them (LocalSlots), but with invalid ids recorded by
// the slots' own blocks, not by block 0's count.
struct FrontSlots : LocalSlots {
  static constexpr bool kRecord = false;
};

// Row of slot s, whose local expert is e >= 0 (the whole block calls it with the same s and e).
__device__ __forceinline__ int32_t front_slot_row(const DispatchParams& p, int64_t s, int32_t e) {
  int32_t before = 0;
  for (int64_t base = 0; base < p.num_slots; base += blockDim.x) {
    const int64_t other = base + threadIdx.x;
    bool earlier = false;
    if (other < p.num_slots) {
      const int32_t e2 = dispatch_local_expert<false>(p, __ldg(p.topk_idx + other), other);
      earlier = e2 >= 0 && (e2 < e || (e2 == e && other < s));
    }
    before += __syncthreads_count(earlier);
  }
  return before;
}

// Grid 1 + T*K*parts blocks of kFrontBlockThreads; dynamic shared memory dispatch_warps * E_l int32.
__global__ void __launch_bounds__(kFrontBlockThreads)
sm90_decode_front_kernel(const FrontParams p, int dispatch_warps) {
  extern __shared__ int32_t hist[];  // block 0: [dispatch_warps][num_local]
  __shared__ int32_t warp_totals[kDispatchMaxWarps];
  // PDL: the previous layer call's GEMMs and combine may read this workspace until this returns.
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const DispatchParams& d = p.dispatch;
  if (blockIdx.x == 0) {
    dispatch_count(d, FrontSlots{{d.topk_idx, d.topk_weights}}, dispatch_warps, hist, warp_totals);
    return;
  }

  // ---- slot s, chunks [c_begin, c_end) of its token's row: the row of x requested, then the
  // slot's row, then the codes ----
  // NOTES: the loads of the token's row are issued before the ids are read: the id scan's and
  // the row's latencies overlap (each thread holds up to kFrontChunksPerThread 16-byte chunks).
  // A slot's row is cut over `parts` blocks (launch_decode_front), so that a long row is not
  // quantized by one SM alone.
  const int64_t s = (blockIdx.x - 1) / p.parts;
  const int part = static_cast<int>((blockIdx.x - 1) % p.parts);
  const int64_t t = s / p.top_k;
  const int chunks = p.hidden / kQuantVec;  // a multiple of kQuantThreadsPerGroup
  const int c_begin = part * p.chunk_span;  // a multiple of 32: whole groups, whole warps
  const int c_end = min(chunks, c_begin + p.chunk_span);
  const uint4* x_row = reinterpret_cast<const uint4*>(p.x + t * p.hidden);
  // Loop bound in whole warps so that every lane of a group reaches quantize_chunk's shuffles.
  const int bound = c_begin + (c_end - c_begin + 31) / 32 * 32;
  const int per_pass = kFrontBlockThreads * kFrontChunksPerThread;
  uint4 raw[kFrontChunksPerThread];
  auto load_pass = [&](int base) {
#pragma unroll
    for (int i = 0; i < kFrontChunksPerThread; ++i) {
      const int c = base + static_cast<int>(threadIdx.x) + i * kFrontBlockThreads;
      raw[i] = c < c_end ? __ldg(x_row + c) : make_uint4(0, 0, 0, 0);
    }
  };
  load_pass(c_begin);
  const int32_t id = __ldg(d.topk_idx + s);
  // Thread 0 of part 0 records an invalid id (once per slot, as the dispatch does).
  const int32_t e = part == 0 && threadIdx.x == 0 ? dispatch_local_expert<true>(d, id, s)
                                     : dispatch_local_expert<false>(d, id, s);
  const int32_t row = e >= 0 ? front_slot_row(d, s, e) : -1;
  if (part == 0 && threadIdx.x == 0) {  // the dispatch's placement of the slot
    d.slot_to_row[s] = row;
    if (row >= 0) {
      d.row_slot[row] = static_cast<int32_t>(s);
      d.row_weights[row] = __ldg(d.topk_weights + s);
    }
  }
  const bool stores_codes = s % p.top_k == 0;
  if (row < 0 && !stores_codes) return;  // uniform over the block
  for (int base = c_begin; base < bound; base += per_pass) {
    if (base > c_begin) load_pass(base);
#pragma unroll
    for (int i = 0; i < kFrontChunksPerThread; ++i) {
      const int c = base + static_cast<int>(threadIdx.x) + i * kFrontBlockThreads;
      if (c >= bound) break;  // uniform over each warp
      uint32_t packed[2];
      const int b = quantize_chunk(raw[i], packed);
      if (c >= c_end) continue;
      if (stores_codes) {
        reinterpret_cast<uint2*>(p.x_q + t * p.hidden)[c] = make_uint2(packed[0], packed[1]);
        if (c % kQuantThreadsPerGroup == 0)
          p.x_sf[t * (p.hidden / kScaleBlock) + c / kQuantThreadsPerGroup] = static_cast<uint8_t>(b);
      }
      if (row >= 0) {
        const float scale = ue8m0_to_f32(static_cast<uint8_t>(b));
        uint4 out;
        out.x = dequant_e4m3x2_bf16x2(static_cast<uint16_t>(packed[0] & 0xFFFFu), scale);
        out.y = dequant_e4m3x2_bf16x2(static_cast<uint16_t>(packed[0] >> 16), scale);
        out.z = dequant_e4m3x2_bf16x2(static_cast<uint16_t>(packed[1] & 0xFFFFu), scale);
        out.w = dequant_e4m3x2_bf16x2(static_cast<uint16_t>(packed[1] >> 16), scale);
        reinterpret_cast<uint4*>(p.act + static_cast<int64_t>(row) * p.hidden)[c] = out;
      }
    }
  }
}

}  // namespace megamoe::sm90
