// runtime/cuda_launch.hpp: kernel launch with optional programmatic dependent launch (PDL).
//
//   cuda::launch(kernel, grid, block, smem, stream, programmatic, args...);
//
// programmatic = true launches the kernel with cudaLaunchAttributeProgrammaticStreamSerialization:
// it may start before the previous kernel of the stream has finished (once every CTA of that
// kernel has executed griddepcontrol.launch_dependents or exited), so the kernel must call
// ptx::grid_dependency_wait() before it touches memory that kernel writes or reads. Every megamoe
// kernel does (kernels/ptx/sm90_ptx.cuh). Also valid during CUDA-graph capture (the edge becomes
// a programmatic dependency). programmatic = false is a plain launch.
#pragma once

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>

#include <utility>

#include "runtime/cuda_check.hpp"

namespace megamoe::cuda {

template <class... KernelArgs, class... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1]{};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = programmatic ? 1 : 0;
  MEGAMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace megamoe::cuda
#endif  // MEGAMOE_WITH_CUDA
