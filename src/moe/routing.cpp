// Synthetic routings and activations for tests/benchmarks, and the sigmoid top-k router.
#include "megamoe/routing.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "runtime/random.hpp"

namespace megamoe {

namespace {

// Stream ids (derive_seed) so that routing, weights and activations never share a stream.
constexpr uint64_t kStreamRouting = 0x526F757465ull;     // "Route"
constexpr uint64_t kStreamActivations = 0x416374ull;     // "Act"
constexpr uint64_t kStreamPermutation = 0x5065726Dull;   // "Perm"
constexpr float kMinRawWeight = 0.05f;  // raw weights uniform in [0.05, 1) before normalising

void check_routing_args(int64_t num_tokens, int64_t num_experts, int64_t top_k) {
  MEGAMOE_CHECK_ARG(num_tokens >= 0, "make_routing: num_tokens must be >= 0, got ", num_tokens);
  MEGAMOE_CHECK_ARG(num_experts > 0 && num_experts <= INT32_MAX,
                    "make_routing: num_experts must be in [1, 2^31), got ", num_experts);
  MEGAMOE_CHECK_ARG(top_k > 0 && top_k <= num_experts, "make_routing: top_k must be in [1, E=",
                    num_experts, "], got ", top_k);
}

// Draws k distinct experts with `draw` (rejection of repeats; k <= E so this terminates).
template <typename Draw>
void draw_distinct(int64_t top_k, int32_t* out, Draw draw) {
  for (int64_t k = 0; k < top_k;) {
    const auto e = static_cast<int32_t>(draw());
    if (std::find(out, out + k, e) != out + k) continue;
    out[k++] = e;
  }
}

void random_weights(detail::SplitMix64& rng, int64_t top_k, float* out) {
  float sum = 0.0f;
  for (int64_t k = 0; k < top_k; ++k) {
    out[k] = kMinRawWeight + (1.0f - kMinRawWeight) * rng.uniform();
    sum += out[k];
  }
  for (int64_t k = 0; k < top_k; ++k) out[k] /= sum;
}

}  // namespace

RoutingKind parse_routing_kind(std::string_view name) {
  if (name == "uniform") return RoutingKind::kUniform;
  if (name == "skewed") return RoutingKind::kSkewed;
  if (name == "adversarial") return RoutingKind::kAdversarial;
  fail(ErrorCode::kInvalidArgument, "routing: unknown kind '", name,
       "' (expected uniform, skewed or adversarial)");
}

const char* routing_kind_name(RoutingKind kind) {
  switch (kind) {
    case RoutingKind::kUniform: return "uniform";
    case RoutingKind::kSkewed: return "skewed";
    case RoutingKind::kAdversarial: return "adversarial";
  }
  return "unknown";
}

Routing make_routing(RoutingKind kind, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                     uint64_t seed) {
  check_routing_args(num_tokens, num_experts, top_k);
  Routing r;
  r.num_tokens = num_tokens;
  r.top_k = top_k;
  r.topk_idx.resize(static_cast<size_t>(num_tokens * top_k));
  r.topk_weights.resize(static_cast<size_t>(num_tokens * top_k));

  // Skewed: a seeded permutation maps popularity rank -> expert; the CDF of p(i) ~ 1/(i+1)^s.
  std::vector<int32_t> perm;
  std::vector<double> cdf;
  if (kind == RoutingKind::kSkewed) {
    perm.resize(static_cast<size_t>(num_experts));
    std::iota(perm.begin(), perm.end(), 0);
    detail::SplitMix64 prng(detail::derive_seed(seed, {kStreamPermutation}));
    for (int64_t i = num_experts - 1; i > 0; --i)
      std::swap(perm[i], perm[prng.below(static_cast<uint64_t>(i + 1))]);
    cdf.resize(static_cast<size_t>(num_experts));
    double acc = 0;
    for (int64_t i = 0; i < num_experts; ++i) {
      acc += std::pow(static_cast<double>(i + 1), -kSkewedZipfExponent);
      cdf[i] = acc;
    }
    for (double& c : cdf) c /= acc;
  }
  std::vector<int32_t> fixed(static_cast<size_t>(top_k));
  if (kind == RoutingKind::kAdversarial) {
    detail::SplitMix64 prng(detail::derive_seed(seed, {kStreamPermutation}));
    draw_distinct(top_k, fixed.data(), [&] { return prng.below(static_cast<uint64_t>(num_experts)); });
  }

  for (int64_t t = 0; t < num_tokens; ++t) {
    detail::SplitMix64 rng(detail::derive_seed(
        seed, {kStreamRouting, static_cast<uint64_t>(kind), static_cast<uint64_t>(t)}));
    int32_t* idx = r.topk_idx.data() + t * top_k;
    switch (kind) {
      case RoutingKind::kUniform:
        draw_distinct(top_k, idx, [&] { return rng.below(static_cast<uint64_t>(num_experts)); });
        break;
      case RoutingKind::kSkewed:
        draw_distinct(top_k, idx, [&] {
          const double u = rng.uniform_double();
          const auto rank = std::min<int64_t>(
              num_experts - 1, std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
          return perm[static_cast<size_t>(rank)];
        });
        break;
      case RoutingKind::kAdversarial:
        std::copy(fixed.begin(), fixed.end(), idx);
        break;
    }
    random_weights(rng, top_k, r.topk_weights.data() + t * top_k);
  }
  return r;
}

std::vector<uint16_t> synthetic_activations(int64_t num_tokens, int64_t hidden, uint64_t seed) {
  MEGAMOE_CHECK_ARG(num_tokens >= 0 && hidden >= 0, "synthetic_activations: num_tokens and ",
                    "hidden must be >= 0, got ", num_tokens, " and ", hidden);
  std::vector<uint16_t> x(static_cast<size_t>(num_tokens * hidden));
  for (int64_t t = 0; t < num_tokens; ++t) {
    detail::SplitMix64 rng(detail::derive_seed(seed, {kStreamActivations, static_cast<uint64_t>(t)}));
    for (int64_t i = 0; i < hidden; ++i)
      x[t * hidden + i] = bf16_from_f32(static_cast<float>(rng.normal()));
  }
  return x;
}

void route_sigmoid_topk(const float* logits, const float* correction_bias, int64_t num_tokens,
                        int64_t num_experts, int64_t top_k, float routed_scaling_factor,
                        int32_t* topk_idx, float* topk_weights) {
  MEGAMOE_CHECK_ARG(num_tokens >= 0, "route_sigmoid_topk: num_tokens must be >= 0, got ",
                    num_tokens);
  MEGAMOE_CHECK_ARG(num_experts > 0 && top_k > 0 && top_k <= num_experts,
                    "route_sigmoid_topk: need 0 < top_k <= num_experts, got top_k ", top_k,
                    " and num_experts ", num_experts);
  MEGAMOE_CHECK_ARG(std::isfinite(routed_scaling_factor),
                    "route_sigmoid_topk: routed_scaling_factor must be finite, got ",
                    routed_scaling_factor);
  if (num_tokens == 0) return;
  MEGAMOE_CHECK_ARG(logits != nullptr && topk_idx != nullptr && topk_weights != nullptr,
                    "route_sigmoid_topk: logits, topk_idx and topk_weights must not be null");
  if (correction_bias != nullptr)
    for (int64_t e = 0; e < num_experts; ++e)
      MEGAMOE_CHECK_ARG(std::isfinite(correction_bias[e]), "route_sigmoid_topk: correction_bias[",
                        e, "] is not finite (", correction_bias[e], ")");

  std::vector<float> score(static_cast<size_t>(num_experts));
  std::vector<float> choice(static_cast<size_t>(num_experts));
  std::vector<int32_t> order(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * num_experts;
    for (int64_t e = 0; e < num_experts; ++e) {
      MEGAMOE_CHECK_ARG(std::isfinite(row[e]), "route_sigmoid_topk: logits[", t, ", ", e,
                        "] is not finite (", row[e], ")");
      score[e] = 1.0f / (1.0f + std::exp(-row[e]));
      choice[e] = score[e] + (correction_bias != nullptr ? correction_bias[e] : 0.0f);
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
      return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
    });
    float sum = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) sum += score[order[k]];
    for (int64_t k = 0; k < top_k; ++k) {
      topk_idx[t * top_k + k] = order[k];
      // sum > 0: every sigmoid of a finite logit is > 0 (or underflows only below -88).
      topk_weights[t * top_k + k] =
          sum > 0.0f ? score[order[k]] / sum * routed_scaling_factor : 0.0f;
    }
  }
}

}  // namespace megamoe
