// ep_launch.hpp: launchers of the expert-parallel stages (kernels/ep/ep_kernels.cuh). All are
// asynchronous on `stream`, allocate nothing and never synchronize (CUDA-graph capture works);
// `programmatic` chains them with programmatic dependent launch like the layer's other stages.
#pragma once

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>

#include <cstdint>

#include "ep/ep_protocol.hpp"
#include "sm90/sm90_dispatch_types.hpp"

namespace megamoe::ep {

// The send's inputs: x the caller's bf16 tokens (a fused call quantizes them: fused_send), x_q/x_sf
// this call's quantized tokens (launch_send), topk_idx/topk_weights the caller's, slot_map [T*K]
// the combine's row map (written), error/error_flag the layer's invalid-id record.
struct SendInputs {
  const uint16_t* x = nullptr;
  const uint8_t* x_q = nullptr;
  const uint8_t* x_sf = nullptr;
  const int32_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  int32_t* slot_map = nullptr;
  sm90::DispatchError* error = nullptr;
  int32_t* error_flag = nullptr;
};

// Whether a call of this rank is quantized and sent by the dispatch kernel from SendInputs::x (no
// quantize launch, no launch_send).
bool fused_send(const EpParams& p);

// Sends this rank's tokens (not for fused calls; see fused_send).
void launch_send(const EpParams& p, const SendInputs& in, cudaStream_t stream, bool programmatic);

// Waits for every rank's tokens and builds the row lists: row_offsets [E_l + 1], row_slot /
// row_weights [p.max_rows] (sm90_dispatch.cuh), and (row_dst != nullptr) each row's destination
// [p.max_rows], its source rank's combine slot, for the L2 epilogue (L2Args::out_rows). `in` is
// what a fused call quantizes and sends first. wait_rows: the kernel also waits for every rank's
// rows (the next kernel reads them); false when the reader waits for each row itself (the
// MegaMoE kernel's gather units: sm90::MegaGather).
void launch_dispatch(const EpParams& p, const SendInputs& in, int32_t* row_offsets,
                     int32_t* row_slot, float* row_weights, uint16_t** row_dst,
                     cudaStream_t stream, bool programmatic, bool wait_rows = true);
// Raises the dispatch kernel's shared-memory limit for num_local experts (host call, made at
// layer construction so that forward() makes none).
void configure_dispatch(int64_t num_local);

// Returns the computed rows to their sources and waits for every rank's. out == nullptr: the rows
// are there already (the layer's L2 epilogue wrote them through launch_dispatch's row_dst): only
// the signals and the wait.
void launch_return(const EpParams& p, const uint16_t* out, const int32_t* row_offsets,
                   const int32_t* row_slot, cudaStream_t stream, bool programmatic);

// Loads the EP kernels into the current context (see sm90::load_gemm_kernels).
void load_kernels();

}  // namespace megamoe::ep
#endif
