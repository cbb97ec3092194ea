// The unquantized FP64 MoE (numerics.md section 8): BF16 x, dequantized MXFP4 weights, no FP8
// anywhere, the activation evaluated exactly in double, no intermediate rounding. Backends are
// compared with it by the diff metric; its distance to the contract is the price of FP8 x MXFP4.
#include <algorithm>
#include <cmath>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/parallel.hpp"
#include "megamoe/quantize.hpp"
#include "megamoe/reference.hpp"
#include "reference/reference_internal.hpp"

namespace megamoe {

namespace {

using reference_detail::kTileRows;
using reference_detail::expert_items;
using reference_detail::Item;
using reference_detail::RoutingPlan;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// numerics.md section 4 in double (the clamp limit as given, without BF16 rounding).
double activation_fp64(const Activation& act, double g, double u) {
  switch (act.kind) {
    case ActivationKind::kSwiglu:
      if (act.has_clamp) {
        const double lim = act.clamp;
        g = std::min(g, lim);
        u = std::clamp(u, -lim, lim);
      }
      return g / (1.0 + std::exp(-g)) * u;
    case ActivationKind::kSitu: {
      const double beta = act.beta, lbeta = act.linear_beta;
      return beta * std::tanh(g / beta) * sigmoid(g) * (lbeta * std::tanh(u / lbeta));
    }
    case ActivationKind::kSwigluOai: {
      const double lim = act.clamp;
      g = std::min(g, lim);
      u = std::clamp(u, -lim, lim);
      return g * sigmoid(static_cast<double>(act.alpha) * g) * (u + 1.0);
    }
  }
  fail(ErrorCode::kInternal, "activation_fp64: unknown activation kind");
}

// Dequantizes `rows` MXFP4 rows of width `cols` into double (exact).
void dequant_rows_fp64(const uint8_t* packed, const uint8_t* sf, int64_t rows, int64_t cols,
                       std::vector<float>& scratch, double* out) {
  scratch.resize(static_cast<size_t>(rows * cols));
  dequantize_mxfp4(packed, sf, rows, cols, scratch.data());
  std::copy(scratch.begin(), scratch.end(), out);
}

}  // namespace

void ideal_forward(const LayerConfig& config, const MoeWeights& weights, const uint16_t* x,
                   const int32_t* topk_idx, const float* topk_weights, int64_t num_tokens,
                   double* y) {
  constexpr const char* kFn = "ideal_forward";
  reference_detail::check_call(kFn, config, weights, num_tokens);
  MEGAMOE_CHECK_ARG(num_tokens == 0 || (x != nullptr && topk_weights != nullptr && y != nullptr),
                    kFn, ": x, topk_weights and y must not be null");
  const RoutingPlan plan = reference_detail::plan_routing(kFn, config, topk_idx, num_tokens);
  const int64_t h_dim = config.shape.hidden, inter = config.shape.intermediate;
  const int64_t top_k = config.shape.top_k;
  const auto* w13_bias = weights.has_bias() ? weights.w13_bias.as<uint16_t>() : nullptr;
  const auto* w2_bias = weights.has_bias() ? weights.w2_bias.as<uint16_t>() : nullptr;

  std::vector<double> x_d(static_cast<size_t>(num_tokens * h_dim));
  for (int64_t i = 0; i < num_tokens * h_dim; ++i) x_d[i] = bf16_to_f32(x[i]);

  // L1 + activation + routing weight: v [R, I] in double.
  std::vector<double> v(static_cast<size_t>(plan.num_rows() * inter));
  {
    const auto items = expert_items(plan, inter, reference_detail::kL1ChunkCols);
    parallel_for(static_cast<int64_t>(items.size()), [&](int64_t item_idx) {
      const Item& it = items[static_cast<size_t>(item_idx)];
      const int64_t row0 = plan.expert_begin[it.expert];
      const int64_t num_rows = plan.expert_begin[it.expert + 1] - row0;
      const int64_t cols = it.col1 - it.col0;
      std::vector<const double*> x_rows(static_cast<size_t>(num_rows));
      for (int64_t r = 0; r < num_rows; ++r)
        x_rows[r] = x_d.data() + (plan.row_slot[row0 + r] / top_k) * h_dim;
      std::vector<double> acc(static_cast<size_t>(num_rows * 2 * cols));
      std::vector<double> w_tile(static_cast<size_t>(kTileRows * h_dim));
      std::vector<float> scratch;
      for (int half = 0; half < 2; ++half) {
        for (int64_t j = it.col0; j < it.col1; j += kTileRows) {
          const int64_t n = std::min(kTileRows, it.col1 - j);
          const int64_t w_row = it.expert * 2 * inter + half * inter + j;
          dequant_rows_fp64(weights.w13.as<uint8_t>() + w_row * (h_dim / 2),
                            weights.w13_sf.as<uint8_t>() + w_row * (h_dim / kScaleBlock), n, h_dim,
                            scratch, w_tile.data());
          reference_detail::dot_tile(w_tile.data(), n, x_rows.data(), num_rows, h_dim,
                                     acc.data() + half * cols + (j - it.col0), 2 * cols);
        }
      }
      for (int64_t r = 0; r < num_rows; ++r) {
        const double route_w = topk_weights[plan.row_slot[row0 + r]];
        const double* a = acc.data() + r * 2 * cols;
        for (int64_t c = 0; c < cols; ++c) {
          double g = a[c], u = a[cols + c];
          if (w13_bias != nullptr) {
            g += bf16_to_f32(w13_bias[it.expert * 2 * inter + it.col0 + c]);
            u += bf16_to_f32(w13_bias[it.expert * 2 * inter + inter + it.col0 + c]);
          }
          v[(row0 + r) * inter + it.col0 + c] = activation_fp64(config.activation, g, u) * route_w;
        }
      }
    });
  }

  // L2 (+ w * bias): o [R, H] in double.
  std::vector<double> o(static_cast<size_t>(plan.num_rows() * h_dim));
  {
    const auto items = expert_items(plan, h_dim, reference_detail::kL2ChunkCols);
    parallel_for(static_cast<int64_t>(items.size()), [&](int64_t item_idx) {
      const Item& it = items[static_cast<size_t>(item_idx)];
      const int64_t row0 = plan.expert_begin[it.expert];
      const int64_t num_rows = plan.expert_begin[it.expert + 1] - row0;
      const int64_t cols = it.col1 - it.col0;
      std::vector<const double*> v_rows(static_cast<size_t>(num_rows));
      for (int64_t r = 0; r < num_rows; ++r) v_rows[r] = v.data() + (row0 + r) * inter;
      std::vector<double> acc(static_cast<size_t>(num_rows * cols));
      std::vector<double> w_tile(static_cast<size_t>(kTileRows * inter));
      std::vector<float> scratch;
      for (int64_t n0 = it.col0; n0 < it.col1; n0 += kTileRows) {
        const int64_t n = std::min(kTileRows, it.col1 - n0);
        const int64_t w_row = it.expert * h_dim + n0;
        dequant_rows_fp64(weights.w2.as<uint8_t>() + w_row * (inter / 2),
                          weights.w2_sf.as<uint8_t>() + w_row * (inter / kScaleBlock), n, inter,
                          scratch, w_tile.data());
        reference_detail::dot_tile(w_tile.data(), n, v_rows.data(), num_rows, inter,
                                   acc.data() + (n0 - it.col0), cols);
      }
      for (int64_t r = 0; r < num_rows; ++r) {
        const double route_w = topk_weights[plan.row_slot[row0 + r]];
        for (int64_t c = 0; c < cols; ++c) {
          double val = acc[r * cols + c];
          if (w2_bias != nullptr) val += route_w * bf16_to_f32(w2_bias[it.expert * h_dim + it.col0 + c]);
          o[(row0 + r) * h_dim + it.col0 + c] = val;
        }
      }
    });
  }

  // Combine in double, ascending k.
  for (int64_t t = 0; t < num_tokens; ++t) {
    double* dst = y + t * h_dim;
    std::fill(dst, dst + h_dim, 0.0);
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t row = plan.slot_row[t * top_k + k];
      if (row < 0) continue;
      for (int64_t n = 0; n < h_dim; ++n) dst[n] += o[row * h_dim + n];
    }
  }
}

}  // namespace megamoe
