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

// errors: the layer's invalid-id record (error, error_flag) and E; the other fields are unused.
void launch_send(const EpParams& p, const uint8_t* x_q, const uint8_t* x_sf,
                 const int32_t* topk_idx, const float* topk_weights, int32_t* slot_map,
                 sm90::DispatchError* error, int32_t* error_flag, cudaStream_t stream,
                 bool programmatic);

// rows: row_offsets [E_l + 1], row_slot / row_weights [p.max_rows] (sm90_dispatch.cuh).
void launch_dispatch(const EpParams& p, int32_t* row_offsets, int32_t* row_slot,
                     float* row_weights, cudaStream_t stream, bool programmatic);
// Raises the dispatch kernel's shared-memory limit for num_local experts (host call, made at
// layer construction so that forward() makes none).
void configure_dispatch(int64_t num_local);

void launch_return(const EpParams& p, const uint16_t* out, const int32_t* row_offsets,
                   const int32_t* row_slot, cudaStream_t stream, bool programmatic);
// Loads the EP kernels into the current context (see sm90::load_gemm_kernels).
void load_kernels();

void launch_wait_return(const EpParams& p, cudaStream_t stream, bool programmatic);

}  // namespace megamoe::ep
#endif
