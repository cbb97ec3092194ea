// Input checks, the routing plan and the dot-product kernels shared by the CPU reference and the
// FP64 ideal MoE.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "megamoe/error.hpp"
#include "reference/reference_internal.hpp"

// NOTES: the dot kernels exist twice on x86-64, for AVX2 (8-float vectors) and for the SSE2
// baseline (4-float vectors), picked once at run time. Both perform the same operations in the
// same order (16 float / 8 double independent partial sums, each in ascending k, combined
// pairwise), and the products of E4M3/BF16 and E2M1 values are exact, so they give bit-identical
// results; AVX2 only makes the CPU reference faster.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGAMOE_X86_DISPATCH 1
#else
#define MEGAMOE_X86_DISPATCH 0
#endif
// The helpers must be inlined into each target-specific caller to be compiled for it.
#define MEGAMOE_ALWAYS_INLINE inline __attribute__((always_inline))

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

std::vector<Item> expert_items(const RoutingPlan& plan, int64_t cols, int64_t chunk) {
  std::vector<Item> items;
  for (size_t e = 0; e + 1 < plan.expert_begin.size(); ++e) {
    if (plan.expert_begin[e + 1] == plan.expert_begin[e]) continue;
    for (int64_t c = 0; c < cols; c += chunk)
      items.push_back({static_cast<int64_t>(e), c, std::min(cols, c + chunk)});
  }
  return items;
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

// The summation order every dot product follows: kLanes partial sums (lane l takes k = l,
// l + kLanes, ... in ascending order), then pairwise: lanes [0, w) += lanes [w, 2w) for
// w = kLanes/2, ..., 1. The partial sums are held in GCC/Clang vectors of type V (kLanes /
// width(V) vectors per row) so they stay in registers; lane-wise vector arithmetic is exactly
// the scalar sequence, so the vector width changes speed only.
template <typename T>
constexpr int kLanes = 64 / static_cast<int>(sizeof(T));  // 16 floats, 8 doubles

template <typename T, typename V, int kRowBlock>
MEGAMOE_ALWAYS_INLINE void dot_rows_block(const T* w, const T* x, int64_t n, T* out) {
  constexpr int kWidth = static_cast<int>(sizeof(V) / sizeof(T));
  constexpr int kVecs = kLanes<T> / kWidth;
  static_assert(kLanes<T> % kWidth == 0, "a vector must tile the partial sums");
  V acc[kRowBlock][kVecs];
  std::memset(acc, 0, sizeof acc);
  for (int64_t i = 0; i < n; i += kLanes<T>) {
    for (int v = 0; v < kVecs; ++v) {
      V xv, wv;
      std::memcpy(&xv, x + i + v * kWidth, sizeof xv);
      for (int r = 0; r < kRowBlock; ++r) {
        std::memcpy(&wv, w + r * n + i + v * kWidth, sizeof wv);
        acc[r][v] += wv * xv;
      }
    }
  }
  for (int r = 0; r < kRowBlock; ++r) {
    T part[kLanes<T>];
    std::memcpy(part, acc[r], sizeof part);
    for (int width = kLanes<T> / 2; width > 0; width /= 2)
      for (int l = 0; l < width; ++l) part[l] += part[l + width];
    out[r] = part[0];
  }
}

template <typename T, typename V, int kRowBlock>
MEGAMOE_ALWAYS_INLINE void dot_tile_impl(const T* w, int64_t num_w_rows, const T* const* x_rows,
                                         int64_t num_x_rows, int64_t k_dim, T* out,
                                         int64_t out_stride) {
  for (int64_t r = 0; r < num_x_rows; ++r) {  // x row stays in L1 across the tile's weight rows
    T* dst = out + r * out_stride;
    int64_t i = 0;
    for (; i + kRowBlock <= num_w_rows; i += kRowBlock)
      dot_rows_block<T, V, kRowBlock>(w + i * k_dim, x_rows[r], k_dim, dst + i);
    for (; i < num_w_rows; ++i) dot_rows_block<T, V, 1>(w + i * k_dim, x_rows[r], k_dim, dst + i);
  }
}

#if MEGAMOE_X86_DISPATCH
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef double f64x2 __attribute__((vector_size(16)));

// Row blocks sized to the register file: AVX2 16 ymm (4 rows x 2 vectors + x), SSE2 16 xmm.
constexpr int kRowBlockAvx2 = 4;
constexpr int kRowBlockSse2 = 2;

__attribute__((target("avx2"))) void dot_tile_avx2(const float* w, int64_t nw, const float* const* x,
                                                   int64_t nx, int64_t k, float* out, int64_t s) {
  dot_tile_impl<float, f32x8, kRowBlockAvx2>(w, nw, x, nx, k, out, s);
}
__attribute__((target("avx2"))) void dot_tile_avx2(const double* w, int64_t nw, const double* const* x,
                                                   int64_t nx, int64_t k, double* out, int64_t s) {
  dot_tile_impl<double, f64x4, kRowBlockAvx2>(w, nw, x, nx, k, out, s);
}
void dot_tile_base(const float* w, int64_t nw, const float* const* x, int64_t nx, int64_t k,
                   float* out, int64_t s) {
  dot_tile_impl<float, f32x4, kRowBlockSse2>(w, nw, x, nx, k, out, s);
}
void dot_tile_base(const double* w, int64_t nw, const double* const* x, int64_t nx, int64_t k,
                   double* out, int64_t s) {
  dot_tile_impl<double, f64x2, kRowBlockSse2>(w, nw, x, nx, k, out, s);
}
std::atomic<bool> g_force_baseline{false};
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has && !g_force_baseline.load(std::memory_order_relaxed);
}
#endif

}  // namespace

bool force_baseline_dot(bool on) {
#if MEGAMOE_X86_DISPATCH
  g_force_baseline.store(on);
  return __builtin_cpu_supports("avx2");
#else
  (void)on;
  return false;
#endif
}

void dot_tile(const float* w, int64_t num_w_rows, const float* const* x_rows, int64_t num_x_rows,
              int64_t k_dim, float* out, int64_t out_stride) {
#if MEGAMOE_X86_DISPATCH
  if (cpu_has_avx2()) return dot_tile_avx2(w, num_w_rows, x_rows, num_x_rows, k_dim, out, out_stride);
  return dot_tile_base(w, num_w_rows, x_rows, num_x_rows, k_dim, out, out_stride);
#else
  dot_tile_impl<float, float, 1>(w, num_w_rows, x_rows, num_x_rows, k_dim, out, out_stride);
#endif
}

void dot_tile(const double* w, int64_t num_w_rows, const double* const* x_rows,
              int64_t num_x_rows, int64_t k_dim, double* out, int64_t out_stride) {
#if MEGAMOE_X86_DISPATCH
  if (cpu_has_avx2()) return dot_tile_avx2(w, num_w_rows, x_rows, num_x_rows, k_dim, out, out_stride);
  return dot_tile_base(w, num_w_rows, x_rows, num_x_rows, k_dim, out, out_stride);
#else
  dot_tile_impl<double, double, 1>(w, num_w_rows, x_rows, num_x_rows, k_dim, out, out_stride);
#endif
}

}  // namespace megamoe::reference_detail
