// C entry points of libmegamoe_marlin_peer.so (megamoe bench/peers, issue 34): vLLM's Marlin MoE
// GEMM (the launcher marlin_mm behind vLLM's `moe_wna16_marlin_gemm` op) for MXFP4 weights and
// BF16 activations, reached without torch. Raw device pointers, sizes and a cudaStream_t in; 0 or
// non-zero out, with mmp_last_error() saying why. The caller (bench/peers/peer_marlin.py) owns
// every buffer; the checks below are the ones vLLM's torch wrapper makes on tensor shapes, made
// here on the sizes the caller states.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>

// vLLM csrc/moe/marlin_moe_wna16/ops.cu up to its torch wrapper, torch includes removed
// (written by build_marlin.sh); it brings marlin_moe_wna16::marlin_mm and get_marlin_kernel.
#include "marlin_moe_ops_core.cu"
#include "peer_error.h"

#ifndef MMP_VLLM_VERSION
  #define MMP_VLLM_VERSION "unknown"
#endif
#ifndef MMP_ARCH
  #define MMP_ARCH "unknown"
#endif

namespace megamoe_marlin_peer {

thread_local std::string g_last_error;

void set_error(const std::string& message) { g_last_error = message; }

constexpr int kMxGroup = 32;                 // MXFP4: one e8m0 scale per 32 weights along K
constexpr int kMaxBlocksPerSm = 4;           // vLLM MARLIN_MAX_BLOCKS_PER_SM (workspace = locks)

int sm_count() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

}  // namespace megamoe_marlin_peer

using namespace megamoe_marlin_peer;

extern "C" {

const char* mmp_last_error(void) { return g_last_error.c_str(); }

const char* mmp_build_info(void) {
  return "vllm " MMP_VLLM_VERSION " marlin_moe_wna16 (bf16 x fe2m1f, fe8m0fnu scales, group 32) + gptq_marlin_repack 4-bit, " MMP_ARCH;
}

// Floats of the FP32 reduce buffer (C_tmp) one GEMM needs, as vLLM's wrapper sizes it.
long long mmp_moe_c_tmp_floats(int size_n, long long sorted_len, int moe_block_size) {
  long long n = std::min<long long>((long long)size_n * sorted_len,
                                    (long long)sm_count() * 4 * moe_block_size * marlin_moe_wna16::max_thread_n);
  return moe_block_size == 8 ? 2 * n : n;
}

// int32 locks the GEMM needs (zeroed once by the caller; the kernel leaves them zero).
int mmp_moe_workspace_ints(void) { return sm_count() * kMaxBlocksPerSm; }

// C[sorted row] = A[sorted row / top_k] @ W[expert]^T (x topk_weights[sorted row] if
// mul_topk_weights), for the rows of each moe block of sorted_token_ids (moe_align_block_size
// layout: entries >= size_m * top_k are padding).
//   a           bf16 [size_m, size_k]
//   c           bf16 [size_m * top_k, size_n]
//   c_tmp       fp32 [c_tmp_floats]  (use_fp32_reduce)
//   b_q_weight  int32 [num_experts, size_k / 16, size_n * 2]   (gptq_marlin_repack output)
//   b_scales    uint8 e8m0 [num_experts, size_k / 32, size_n]  (Marlin-permuted)
//   b_bias      bf16 [num_experts, size_n] (Marlin-permuted) or null
//   sorted_token_ids int32 [sorted_len], expert_ids int32 [sorted_len / moe_block_size],
//   num_tokens_post_padded int32 [1], topk_weights fp32 [size_m * top_k], workspace int32 [workspace_ints]
int mmp_moe_mxfp4_gemm(const void* a, void* c, void* c_tmp, long long c_tmp_floats, const void* b_q_weight,
                       const void* b_scales, const void* b_bias, const void* sorted_token_ids,
                       long long sorted_len, const void* expert_ids, const void* num_tokens_post_padded,
                       const void* topk_weights, void* workspace, int workspace_ints, int moe_block_size,
                       int num_experts, int top_k, int mul_topk_weights, int size_m, int size_n, int size_k,
                       int use_fp32_reduce, int thread_k, int thread_n, int blocks_per_sm, void* stream) {
  try {
    g_last_error.clear();
    STD_TORCH_CHECK(moe_block_size == 8 || (moe_block_size % 16 == 0 && moe_block_size >= 16 && moe_block_size <= 64),
                    "unsupported moe_block_size=", moe_block_size);
    STD_TORCH_CHECK(size_m > 0 && size_n > 0 && size_k > 0 && top_k > 0 && num_experts > 0, "empty problem");
    STD_TORCH_CHECK(size_k % kMxGroup == 0 && size_k % marlin_moe_wna16::tile_size == 0, "size_k = ", size_k,
                    " is not a multiple of 32");
    STD_TORCH_CHECK(size_n % marlin_moe_wna16::min_thread_n == 0, "size_n = ", size_n,
                    " is not a multiple of ", marlin_moe_wna16::min_thread_n);
    const int sms = sm_count();
    const long long max_n_tiles = size_n / marlin_moe_wna16::min_thread_n;
    const long long min_ws = std::min<long long>(max_n_tiles * (sorted_len / moe_block_size), (long long)sms * 4);
    STD_TORCH_CHECK(workspace_ints >= min_ws, "workspace has ", workspace_ints, " ints, below ", min_ws);
    if (use_fp32_reduce) {
      const long long need = mmp_moe_c_tmp_floats(size_n, sorted_len, moe_block_size);
      STD_TORCH_CHECK(c_tmp_floats >= need, "c_tmp has ", c_tmp_floats, " floats, below ", need);
    }
    int dev = 0;
    cudaGetDevice(&dev);
    marlin_moe_wna16::marlin_mm(
        a, b_q_weight, c, c_tmp, const_cast<void*>(b_bias), /*a_s=*/nullptr, const_cast<void*>(b_scales),
        /*g_s=*/nullptr, /*zp=*/nullptr, const_cast<void*>(sorted_token_ids), const_cast<void*>(expert_ids),
        const_cast<void*>(num_tokens_post_padded), const_cast<void*>(topk_weights), moe_block_size, num_experts,
        top_k, mul_topk_weights != 0, size_m, size_n, size_k, workspace, vllm::kBFloat16, vllm::kFE2M1f,
        vllm::kBFloat16, vllm::kFE8M0fnu, /*has_bias=*/b_bias != nullptr, /*has_zp=*/false, kMxGroup, dev,
        static_cast<cudaStream_t>(stream), thread_k, thread_n, sms, blocks_per_sm, /*use_atomic_add=*/false,
        use_fp32_reduce != 0, /*is_zp_float=*/false);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      set_error(std::string("Marlin MoE launch: ") + cudaGetErrorString(err));
      return 2;
    }
    return 0;
  } catch (const std::exception& e) {
    set_error(e.what());
    return 1;
  }
}

}  // extern "C"
