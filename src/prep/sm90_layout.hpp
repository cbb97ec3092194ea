// sm90_layout.hpp: the "sm90" prepared layout of the Hopper grouped GEMMs (kernels/sm90/).
//
// Index formulas: kernels/layout/sm90_weight_layout.hpp (shared with the kernels); diagram and
// fragment layout: docs/layouts.md, section "sm90". Summary:
//   w13      gate/up rows interleaved in groups of 8, then per (64-row, 64-k) block 128 threads x
//            16 bytes: each thread's wgmma A fragments for 4 k16 steps (nibble-permuted)
//   w13_sf   per (64-row, 64-k) block 128 bytes: 4 scale bytes per (warp, g) lane group
//   w2, w2_sf the same without the row interleave
//   biases   unchanged (the kernels read canonical bias order)
// Prepared buffers have exactly the canonical sizes; the transform is a pure permutation.
// Requires H % 64 == 0 and I % 64 == 0 (kUnsupported otherwise).
#pragma once

#include <cstdint>

#include "megamoe/prepare.hpp"

namespace megamoe::prep {

constexpr const char* kSm90LayoutName = "sm90";

// The registered layout (registry.cpp picks it up through __has_include).
WeightLayout sm90_weight_layout();

}  // namespace megamoe::prep

namespace megamoe {

enum class Sm90Matrix { kW13, kW2 };

// One expert's matrix on the host: canonical packed [rows, cols/2] + scales [rows, cols/32] ->
// prepared (same byte counts), and the exact inverse. rows x cols = 2I x H (kW13) or H x I (kW2).
void sm90_prepare_expert(Sm90Matrix which, const ExpertDims& dims, const uint8_t* w,
                         const uint8_t* sf, uint8_t* w_out, uint8_t* sf_out);
void sm90_unprepare_expert(Sm90Matrix which, const ExpertDims& dims, const uint8_t* w,
                           const uint8_t* sf, uint8_t* w_out, uint8_t* sf_out);

namespace sm90_prep_detail {
// Device implementations (src/prep/sm90_layout.cu); `stream` is a cudaStream_t.
void device_weights(bool forward, bool interleave, const uint8_t* src, uint8_t* dst,
                    int64_t num_experts, int64_t rows, int64_t cols, int64_t intermediate,
                    void* stream);
void device_scales(bool forward, bool interleave, const uint8_t* src, uint8_t* dst,
                   int64_t num_experts, int64_t rows, int64_t cols, int64_t intermediate,
                   void* stream);
}  // namespace sm90_prep_detail

}  // namespace megamoe
