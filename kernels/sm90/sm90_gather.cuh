// sm90_gather.cuh: stage 3 of the layer, the B operand of L1 for every routed row.
//
//   act[r, :] = bf16( e4m3(x_q[t, :]) * 2^(x_sf[t, :/32] - 127) ),  t = row_slot[r] / K
//
// The product of an E4M3 value and a power of two is exact in BF16 (3 mantissa bits into 7; with
// the 1e-4 amax floor the smallest value is 2^-9 * 2^-22, far from BF16's subnormal range), so act
// carries exactly the quantized input and L1 on BF16 tensor cores stays exact (numerics.md 8).
// NaN codes stay NaN.
//
// Thread mapping: one thread per kGatherVec = 16 channels of a row (16-byte load of codes, two
// 16-byte stores of BF16). The grid covers the host-known bound T*K rows; rows at or past
// row_offsets[E_l] (not routed to this rank) exit at once.
// Conversion: cvt.rn.f16x2.e4m3x2 and cvt.f32.f16 (exact), one FMUL by the power-of-two scale
// (exact), cvt.rn.bf16x2.f32 (exact here, so the bits of bf16_from_f32; a NaN code gives the
// canonical BF16 NaN 0x7FFF, still NaN as the contract asks).
// NOTES: the software decode (megamoe::e4m3_to_f32, bf16_from_f32: ~12 instructions per value)
// and 8 channels per thread kept the kernel instruction-bound, well below the copy ceiling
// (docs/tuning-log.md).
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"
#include "sm90/sm90_gather_row.cuh"

namespace megamoe::sm90 {

constexpr int kGatherBlockThreads = 256;

// max_rows = T * K. The launcher guarantees max_rows * H / kGatherVec < 2^32, so work items are
// indexed in 32 bits. NOTES: with 64-bit indices the two divisions per item (row of the item,
// token of the row) made the kernel instruction-bound.
__global__ void __launch_bounds__(kGatherBlockThreads)
sm90_gather_dequant_e4m3_bf16_kernel(const uint8_t* __restrict__ x_q,
                                     const uint8_t* __restrict__ x_sf,
                                     const int32_t* __restrict__ row_offsets,
                                     const int32_t* __restrict__ row_slot, int32_t num_local,
                                     uint32_t top_k, uint32_t hidden, int64_t max_rows,
                                     uint16_t* __restrict__ act) {
  // PDL: dispatch's outputs are read below; the next kernel (L1) may start after this wait: it
  // builds its schedule and issues its first weight copies while gather runs, and takes its
  // work units at run time, so its CTAs' uneven placement does not unbalance it
  // (sm90_grouped_gemm_bf16_mxfp4.cuh).
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const uint32_t chunks_per_row = hidden / kGatherVec;
  const uint32_t num_rows =
      static_cast<uint32_t>(min(static_cast<int64_t>(__ldg(row_offsets + num_local)), max_rows));
  const uint32_t total = num_rows * chunks_per_row;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    const uint32_t r = i / chunks_per_row;
    const uint32_t c = i - r * chunks_per_row;
    const uint32_t t = static_cast<uint32_t>(__ldg(row_slot + r)) / top_k;
    gather_chunk<false>(x_q + static_cast<size_t>(t) * hidden,
                        x_sf + static_cast<size_t>(t) * (hidden / kScaleBlock), c,
                        act + static_cast<size_t>(r) * hidden);
  }
}

}  // namespace megamoe::sm90
