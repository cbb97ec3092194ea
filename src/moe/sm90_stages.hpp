// sm90_stages.hpp: launchers of the non-GEMM stages of the Hopper layer (kernels/sm90/).
//
//   quantize  x bf16 [T, H] -> x_q e4m3 [T, H], x_sf ue8m0 [T, H/32]           (numerics.md 2)
//   dispatch  topk_idx/weights [T, K] -> row_offsets [E_l+1], slot_to_row [T*K],
//             row_slot / row_weights [T*K]; invalid ids recorded in a DispatchError
//   gather    x_q, x_sf, row_slot -> act bf16 [rows, H] (exact dequantization; L1's B operand)
//   combine   out bf16 [rows, H], slot_to_row -> y bf16 [T, H]                  (numerics.md 6)
//
// All launchers are asynchronous on `stream`, allocate nothing and never synchronize, so a layer
// call made of them can be captured in a CUDA graph. Pointers are device pointers; each launcher
// checks its host-known arguments (sizes, alignment) and throws kInvalidArgument naming them.
// programmatic = true launches the kernel as a programmatic dependent of the previous kernel in
// the stream (runtime/cuda_launch.hpp): it may start before that kernel has finished and waits
// for it on the device before touching memory. Sm90Layer chains its six launches this way.
#pragma once

#include <cstdint>

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>

#include "sm90/sm90_dispatch_types.hpp"

namespace megamoe::sm90 {

// Loads the four stage kernels into the current context (see load_gemm_kernels).
void load_stage_kernels();

void launch_quantize_input(const uint16_t* x, int64_t num_tokens, int64_t hidden, uint8_t* x_q,
                           uint8_t* x_sf, cudaStream_t stream, bool programmatic = false);

// Largest warp count whose histograms fit in shared memory for `num_local` experts
// (>= 1; throws kUnsupported when not even one warp's histogram fits).
int dispatch_num_warps(int64_t num_local);

// Raises the dispatch kernel's dynamic shared-memory limit to at least `smem_bytes` (host call,
// not a stream operation; launch_dispatch calls it too, Sm90Layer at construction).
void configure_dispatch_smem(size_t smem_bytes);

void launch_dispatch(const DispatchParams& params, cudaStream_t stream, bool programmatic = false);

// max_rows: host-known bound on routed rows (T * K). grid_rows: the rows the grid is sized for
// (0: max_rows); the kernel strides over every routed row whatever its grid, so an EP layer,
// whose bound is its receive capacity, sizes it for the rows it expects: a grid for the whole
// capacity would hold the SMs the next GEMM starts streaming weights on.
void launch_gather(const uint8_t* x_q, const uint8_t* x_sf, const int32_t* row_offsets,
                   const int32_t* row_slot, int64_t num_local, int64_t top_k, int64_t hidden,
                   int64_t max_rows, uint16_t* act, cudaStream_t stream,
                   bool programmatic = false, int64_t grid_rows = 0);

// FP8 mode (docs/numerics.md "FP8 mode"; kernels/sm90/sm90_rebase_rows.cuh): the E4M3 token rows
// of the FP8 GEMM tiles and their row factors, from FP8 codes q [.., cols] with per-32 scales sf.
// top_k > 0: row r is the token row_slot[r] / top_k of q (L1's operand, from x_q / x_sf);
// top_k == 0: row r of q itself (L2's operand, from h_q / h_sf). Rows at or past
// row_offsets[num_local] are not written. dst [max_rows + slack, cols], factor [max_rows + slack].
// grid_rows: as launch_gather's.
void launch_rebase_rows_e4m3(const uint8_t* q, const uint8_t* sf, const int32_t* row_offsets,
                             const int32_t* row_slot, int64_t num_local, int64_t top_k,
                             int64_t cols, int64_t max_rows, uint8_t* dst, float* factor,
                             cudaStream_t stream, bool programmatic = false, int64_t grid_rows = 0);

// Quantize, dispatch and gather in one launch (kernels/sm90/sm90_decode_front.cuh) for a call
// on one GPU in the exact mode: the same x_q, x_sf, dispatch outputs (dispatch.row_offsets ..
// dispatch.error; dispatch.max_rows must be 0) and act rows as launch_quantize_input,
// launch_dispatch and launch_gather, bit for bit. decode_front_takes says whether it takes a call
// of num_slots = T*K slots over num_local experts (T*K <= kFrontMaxSlots, and the dispatch
// block's histograms in the default 48 KiB of shared memory); the launcher throws
// kInvalidArgument for a call it does not take.
bool decode_front_takes(int64_t num_slots, int64_t num_local);
void launch_decode_front(const uint16_t* x, int64_t num_tokens, int64_t top_k, int64_t hidden,
                         const DispatchParams& dispatch, uint8_t* x_q, uint8_t* x_sf,
                         uint16_t* act, cudaStream_t stream, bool programmatic = false);

void launch_combine(const uint16_t* out, const int32_t* slot_to_row, int64_t num_tokens,
                    int64_t top_k, int64_t hidden, uint16_t* y, cudaStream_t stream,
                    bool programmatic = false);

}  // namespace megamoe::sm90
#endif  // MEGAMOE_WITH_CUDA
