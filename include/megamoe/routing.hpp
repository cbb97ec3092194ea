// megamoe/routing.hpp: synthetic workloads (routing and token activations) and the Kimi-K3
// style router of numerics.md section 7.
//
// The benchmark protocol (targets.md) uses three routings, all seeded and deterministic:
//   uniform      each token's top-k: k distinct experts drawn uniformly
//   skewed       k distinct experts drawn by Zipf popularity (p(rank i) ~ 1/i^1.2) over a
//                seeded permutation of the experts, so the hot experts land on random ranks
//   adversarial  every token's top-k = the same k experts (a seeded choice, same slot order)
// Routing weights are positive and sum to 1 per token.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace megamoe {

enum class RoutingKind : uint8_t { kUniform, kSkewed, kAdversarial };

constexpr double kSkewedZipfExponent = 1.2;

RoutingKind parse_routing_kind(std::string_view name);  // "uniform", "skewed", "adversarial"
const char* routing_kind_name(RoutingKind kind);

struct Routing {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  std::vector<int32_t> topk_idx;    // [T, K] global expert ids, no repeats within a token
  std::vector<float> topk_weights;  // [T, K] > 0, each row sums to 1 (up to FP32 rounding)
};

// Throws kInvalidArgument unless 0 < top_k <= num_experts and num_tokens >= 0.
Routing make_routing(RoutingKind kind, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                     uint64_t seed);

// Synthetic token activations: bf16 [num_tokens, hidden], standard normal values. Deterministic
// in the seed; token t does not depend on num_tokens.
std::vector<uint16_t> synthetic_activations(int64_t num_tokens, int64_t hidden, uint64_t seed);

// The Kimi-K3 / DeepSeek-V3 style router (numerics.md section 7), from FP32 gate logits
// [T, E] (x W_g^T, computed by the caller):
//   s = sigmoid(logits); choice = s + correction_bias (selection only; may be null);
//   idx = top-k of choice (descending; ties: lower expert id first);
//   w = s[idx] / sum(s[idx]) * routed_scaling_factor.
// Non-finite logits or bias are rejected (kInvalidArgument naming token and expert).
void route_sigmoid_topk(const float* logits, const float* correction_bias, int64_t num_tokens,
                        int64_t num_experts, int64_t top_k, float routed_scaling_factor,
                        int32_t* topk_idx, float* topk_weights);

}  // namespace megamoe
