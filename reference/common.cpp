// Input checks, the routing plan and the dot-product kernels shared by the CPU reference and the
// FP64 ideal MoE.
#include <algorithm>

#include "megamoe/error.hpp"
#include "reference/reference_internal.hpp"

// NOTES: the dot kernels are compiled twice on x86-64, for AVX2 and for the baseline, and the
// loader picks one per machine (GCC/Clang function multi-versioning). Both clones perform the
// same operations in the same order (16 or 8 independent partial sums, each in ascending k,
// combined pairwise), and the products of E4M3/BF16 and E2M1 values are exact, so the clones
// give bit-identical results; AVX2 only makes the CPU reference about twice as fast.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGAMOE_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MEGAMOE_CPU_CLONES
#endif

namespace megamoe::reference_detail {

void check_call(const char* fn, const LayerConfig& config, const MoeWeights& weights,
                int64_t num_tokens) {
  config.validate();
  weights.validate_canonical();
  weights.check_matches(config);
  MEGAMOE_CHECK_ARG(weights.device().type == DeviceType::kCPU, fn,
                    ": weights must be on the host, got ", device_name(weights.device()));
  MEGAMOE_CHECK_ARG(num_tokens >= 0, fn, ": num_tokens must be >= 0, got ", num_tokens);
  MEGAMOE_CHECK(num_tokens <= config.max_tokens_per_rank, ErrorCode::kOutOfRange, fn,
                ": num_tokens ", num_tokens, " exceeds the layer capacity max_tokens_per_rank = ",
                config.max_tokens_per_rank);
}

RoutingPlan plan_routing(const char* fn, const LayerConfig& config, const int32_t* topk_idx,
                         int64_t num_tokens) {
  const int64_t top_k = config.shape.top_k;
  const int64_t num_experts = config.shape.num_experts;
  const int64_t first = config.first_local_expert();
  const int64_t num_local = config.num_local_experts();
  MEGAMOE_CHECK_ARG(num_tokens == 0 || topk_idx != nullptr, fn, ": topk_idx is null");

  RoutingPlan plan;
  plan.num_tokens = num_tokens;
  plan.top_k = top_k;
  plan.slot_row.assign(static_cast<size_t>(num_tokens * top_k), -1);
  std::vector<int64_t> count(static_cast<size_t>(num_local) + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t e = topk_idx[t * top_k + k];
      if (e == -1) continue;
      MEGAMOE_CHECK(e >= 0 && e < num_experts, ErrorCode::kOutOfRange, fn, ": topk_idx[", t, ", ",
                    k, "] = ", e, " is not an expert id in [0, ", num_experts,
                    ") nor -1 (empty slot)");
      if (e >= first && e < first + num_local) ++count[static_cast<size_t>(e - first) + 1];
    }
  }
  plan.expert_begin.assign(static_cast<size_t>(num_local) + 1, 0);
  for (int64_t e = 0; e < num_local; ++e)
    plan.expert_begin[e + 1] = plan.expert_begin[e] + count[static_cast<size_t>(e) + 1];
  plan.row_slot.assign(static_cast<size_t>(plan.expert_begin[num_local]), -1);
  std::vector<int64_t> fill(plan.expert_begin.begin(), plan.expert_begin.end() - 1);
  for (int64_t s = 0; s < num_tokens * top_k; ++s) {  // ascending slot order within an expert
    const int32_t e = topk_idx[s];
    if (e < first || e >= first + num_local) continue;  // -1 or another rank's expert
    const int64_t row = fill[static_cast<size_t>(e - first)]++;
    plan.row_slot[static_cast<size_t>(row)] = s;
    plan.slot_row[static_cast<size_t>(s)] = row;
  }
  return plan;
}

namespace {

template <typename T, int kLanes>
inline T dot_lanes(const T* a, const T* b, int64_t n) {
  T part[kLanes] = {};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += a[i + l] * b[i + l];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) part[l] += part[l + width];
  return part[0];
}

template <typename T, int kLanes>
inline void dot_tile_impl(const T* w, int64_t num_w_rows, const T* const* x_rows,
                          int64_t num_x_rows, int64_t k_dim, T* out, int64_t out_stride) {
  for (int64_t r = 0; r < num_x_rows; ++r)  // x row stays in L1 across the tile's weight rows
    for (int64_t i = 0; i < num_w_rows; ++i)
      out[r * out_stride + i] = dot_lanes<T, kLanes>(w + i * k_dim, x_rows[r], k_dim);
}

constexpr int kFloatLanes = 16;
constexpr int kDoubleLanes = 8;

}  // namespace

MEGAMOE_CPU_CLONES
void dot_tile(const float* w, int64_t num_w_rows, const float* const* x_rows, int64_t num_x_rows,
              int64_t k_dim, float* out, int64_t out_stride) {
  dot_tile_impl<float, kFloatLanes>(w, num_w_rows, x_rows, num_x_rows, k_dim, out, out_stride);
}

MEGAMOE_CPU_CLONES
void dot_tile(const double* w, int64_t num_w_rows, const double* const* x_rows,
              int64_t num_x_rows, int64_t k_dim, double* out, int64_t out_stride) {
  dot_tile_impl<double, kDoubleLanes>(w, num_w_rows, x_rows, num_x_rows, k_dim, out, out_stride);
}

}  // namespace megamoe::reference_detail
