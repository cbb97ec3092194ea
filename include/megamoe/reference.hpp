// megamoe/reference.hpp: the CPU implementation of the contract, the FP64 ideal MoE and the
// diff metric (numerics.md sections 2-8). Plain C++, multi-threaded, deterministic: results do
// not depend on the thread count (megamoe/parallel.hpp sets it).
//
// Expert parallelism: every function here computes the rank's local experts only
// ([ep_rank * E_l, (ep_rank + 1) * E_l)); slots routed to other ranks' experts are skipped, so
// with ep_size > 1, y holds this rank's contribution (the trace's per-slot o lets a caller
// combine several ranks exactly). With ep_size = 1 every expert is local.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/weights.hpp"

namespace megamoe {

// Intermediates of one reference call, for comparing kernels stage by stage. Rows are slots
// s = t * K + k; rows of invalid slots are zero.
struct ReferenceTrace {
  std::vector<uint8_t> x_q;      // [T, H]        e4m3
  std::vector<uint8_t> x_sf;     // [T, H/32]     ue8m0
  std::vector<float> l1_acc;     // [T*K, 2I]     fp32 accumulators of L1 (plus bias if any)
  std::vector<uint8_t> h_q;      // [T*K, I]      e4m3 intermediate
  std::vector<uint8_t> h_sf;     // [T*K, I/32]   ue8m0
  std::vector<uint16_t> o;       // [T*K, H]      bf16 per-slot L2 outputs
};

// The contract, from BF16 x: quantize (section 2), L1, activation, weight, requant, L2, combine.
// Validates shapes, expert ids (kOutOfRange naming token and slot) and capacity.
void reference_forward(const LayerConfig& config, const MoeWeights& weights, const uint16_t* x,
                       const int32_t* topk_idx, const float* topk_weights, int64_t num_tokens,
                       uint16_t* y, ReferenceTrace* trace = nullptr);

// The same from already quantized inputs (x_q e4m3 [T, H], x_sf ue8m0 [T, H/32]), so a kernel can
// be compared with the reference fed the same quantized inputs.
void reference_forward_quantized(const LayerConfig& config, const MoeWeights& weights,
                                 const uint8_t* x_q, const uint8_t* x_sf, const int32_t* topk_idx,
                                 const float* topk_weights, int64_t num_tokens, uint16_t* y,
                                 ReferenceTrace* trace = nullptr);

// L2 and combine from given intermediates (h_q [T*K, I], h_sf [T*K, I/32]): lets an exact-mode
// test recompute L2 from a backend's own intermediate (numerics.md section 8).
// Weights with an L2 bias need the routing weights (the bias is added as w[t,k] * bias): use the
// overload below; this one throws kInvalidArgument for them.
void reference_l2_combine(const LayerConfig& config, const MoeWeights& weights,
                          const uint8_t* h_q, const uint8_t* h_sf, const int32_t* topk_idx,
                          int64_t num_tokens, uint16_t* y);
void reference_l2_combine(const LayerConfig& config, const MoeWeights& weights,
                          const uint8_t* h_q, const uint8_t* h_sf, const int32_t* topk_idx,
                          const float* topk_weights, int64_t num_tokens, uint16_t* y);

// The unquantized FP64 MoE: BF16 x, dequantized weights, no intermediate quantization, exact
// activation in FP64. y: fp64 [T, H].
void ideal_forward(const LayerConfig& config, const MoeWeights& weights, const uint16_t* x,
                   const int32_t* topk_idx, const float* topk_weights, int64_t num_tokens,
                   double* y);

// numerics.md section 8: diff = 1 - 2<x,y> / (<x,x> + <y,y>) in FP64 (0 when both are zero).
double diff_metric(const double* a, const double* b, int64_t n);

struct DiffReport {
  double diff = 0;             // over the whole output
  double worst_row_diff = 0;   // max over tokens
  int64_t worst_row = -1;
  double worst_expert_diff = 0;  // max over experts of the diff over the rows routed to them
  int64_t worst_expert = -1;
  double max_abs_err = 0;
};

// Compares a BF16 output with an FP64 one, row by row and expert by expert.
DiffReport compare_output(const LayerConfig& config, const uint16_t* y, const double* ref,
                          const int32_t* topk_idx, int64_t num_tokens);

}  // namespace megamoe
