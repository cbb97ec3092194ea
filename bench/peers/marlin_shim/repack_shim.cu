// C entry point of libmegamoe_marlin_peer.so: vLLM's gptq_marlin_repack kernel (4-bit, BF16/FP16
// activations), which lays GPTQ-packed weights out in Marlin's tile order, over a stack of experts.
#include <cuda_runtime.h>

#include <cstdint>
#include <exception>
#include <string>

// vLLM csrc/quantization/marlin/gptq_marlin_repack.cu up to its torch launcher, torch includes
// removed (written by build_marlin.sh); it brings marlin::gptq_marlin_repack_kernel.
#include "marlin_repack_core.cuh"
#include <torch/headeronly/util/Exception.h>   // our stand-in (include/): STD_TORCH_CHECK
#include "peer_error.h"

extern "C" {

// in:  int32 [num_experts, size_k / 8, size_n]   (8 E2M1 codes per int32 along K, code k at bits 4k)
// out: int32 [num_experts, size_k / 16, size_n * 2]
int mmp_gptq_repack_4bit(const void* in, void* out, int num_experts, int size_k, int size_n, void* stream) {
  try {
    STD_TORCH_CHECK(size_k % marlin::tile_k_size == 0, "size_k = ", size_k, " is not a multiple of ",
                    marlin::tile_k_size);
    STD_TORCH_CHECK(size_n % marlin::tile_n_size == 0, "size_n = ", size_n, " is not a multiple of ",
                    marlin::tile_n_size);
    int dev = 0, sms = 0, max_shared_mem = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&max_shared_mem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    STD_TORCH_CHECK(max_shared_mem > 0, "no shared memory opt-in size");
    auto kernel = marlin::gptq_marlin_repack_kernel<marlin::repack_threads, 4, false>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_shared_mem);
    const int64_t in_stride = int64_t(size_k / 8) * size_n;
    const int64_t out_stride = int64_t(size_k / marlin::tile_size) * size_n * marlin::tile_size / 8;
    for (int e = 0; e < num_experts; ++e) {
      kernel<<<sms, marlin::repack_threads, max_shared_mem, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const uint32_t*>(in) + e * in_stride, static_cast<uint32_t*>(out) + e * out_stride, size_k,
          size_n);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      megamoe_marlin_peer::set_error(std::string("repack launch: ") + cudaGetErrorString(err));
      return 2;
    }
    return 0;
  } catch (const std::exception& e) {
    megamoe_marlin_peer::set_error(e.what());
    return 1;
  }
}

}  // extern "C"
