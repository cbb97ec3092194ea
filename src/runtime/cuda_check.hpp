// runtime/cuda_check.hpp: CUDA error checking for host code.
//
//   MEGAMOE_CUDA_CHECK(cudaMemsetAsync(p, 0, n, stream));   // throws Error(kCuda) naming the call
//   MEGAMOE_CUDA_CHECK_LAUNCH();                             // after every <<<...>>> launch
//
// The message carries the failed expression, the CUDA error name and text, and file:line, so a
// failure in a batch run on the GPU machine can be traced without a debugger. Checking a launch
// uses cudaGetLastError, which does not synchronize and is legal during CUDA-graph capture.
#pragma once

#include "megamoe/error.hpp"

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>

namespace megamoe::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);

}  // namespace megamoe::cuda

#define MEGAMOE_CUDA_CHECK(expr)                                                   \
  do {                                                                             \
    const cudaError_t megamoe_cuda_err_ = (expr);                                  \
    if (megamoe_cuda_err_ != cudaSuccess)                                          \
      ::megamoe::cuda::throw_cuda_error(megamoe_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define MEGAMOE_CUDA_CHECK_LAUNCH() MEGAMOE_CUDA_CHECK(cudaGetLastError())

#endif  // MEGAMOE_WITH_CUDA
