// The CPU MoE layer: numerics.md sections 2-6, step by step (and, with Precision::kFp8, the
// FP8 mode of docs/numerics.md: token rows and weight rows rebased to E4M3 per row before the
// products; the sums stay exact-product FP32).
//
//   x (bf16) -> quantize_input -> x_q, x_sf                                       (section 2)
//   per valid local slot (t, k), expert e:
//     acc = W13_e . x_t  (exact products, FP32 sums)   [+ bias]                   (section 3)
//     g, u = bf16_rn(acc[j]), bf16_rn(acc[I + j]);  a = act(g, u);  v = a * w[t, k]  (section 4)
//     h_q, h_sf = requantize(v) per 32, no floor                                  (section 5)
//     o = bf16_rn(W2_e . dequant(h) [+ w[t, k] * bias])                            (section 6)
//   y[t] = bf16_rn(sum over valid k ascending of o[t, k]) (FP32 from 0; 0 without a valid slot)
//
// Expert parallelism: this computes the rank's local experts only. Slots routed to another
// rank's experts are skipped, so with ep_size > 1, y is the sum of this rank's contributions
// (the trace's per-slot outputs o let a caller combine several ranks exactly); with ep_size = 1
// every expert is local and y is the layer output.
//
// Work items are (expert, block of output channels) and never split a reduction, so the result
// does not depend on the thread count. Within an item a tile of weight rows is dequantized once
// and dotted with every token routed to the expert.
#include <algorithm>
#include <cstring>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/parallel.hpp"
#include "megamoe/quantize.hpp"
#include "megamoe/reference.hpp"
#include "reference/reference_internal.hpp"

namespace megamoe {

using reference_detail::expert_items;
using reference_detail::Item;
using reference_detail::RoutingPlan;

namespace {

constexpr int64_t kQuantChunkTokens = 64;

struct Dims {
  int64_t h, inter, top_k;
  explicit Dims(const LayerConfig& c)
      : h(c.shape.hidden), inter(c.shape.intermediate), top_k(c.shape.top_k) {}
};

void prepare_trace(ReferenceTrace* trace, const Dims& d, int64_t num_tokens) {
  if (trace == nullptr) return;
  const auto slots = static_cast<size_t>(num_tokens * d.top_k);
  trace->x_q.assign(static_cast<size_t>(num_tokens * d.h), 0);
  trace->x_sf.assign(static_cast<size_t>(num_tokens * d.h / kScaleBlock), 0);
  trace->l1_acc.assign(slots * static_cast<size_t>(2 * d.inter), 0.0f);
  trace->h_q.assign(slots * static_cast<size_t>(d.inter), 0);
  trace->h_sf.assign(slots * static_cast<size_t>(d.inter / kScaleBlock), 0);
  trace->o.assign(slots * static_cast<size_t>(d.h), 0);
}

// x_f [T, H]: the dequantized FP8 input (exact). Fills h [R, I] with the dequantized
// intermediate of each plan row (exact), and the trace's l1_acc, h_q, h_sf.
void run_l1(const LayerConfig& config, const MoeWeights& weights, const RoutingPlan& plan,
            const float* x_f, const float* topk_weights, std::vector<float>& h,
            ReferenceTrace* trace) {
  using reference_detail::kL1ChunkCols;
  using reference_detail::kTileRows;
  const Dims d(config);
  const int64_t h_groups = d.h / kScaleBlock;
  const int64_t i_groups = d.inter / kScaleBlock;
  h.assign(static_cast<size_t>(plan.num_rows() * d.inter), 0.0f);
  const bool fp8 = config.fp8_for_tokens(plan.num_tokens);
  // FP8 mode: each row's scale bytes, to rebase the whole row once every item has written it.
  std::vector<uint8_t> h_sf_rows(fp8 ? static_cast<size_t>(plan.num_rows() * i_groups) : 0);
  const auto* w13 = weights.w13.as<uint8_t>();
  const auto* w13_sf = weights.w13_sf.as<uint8_t>();
  const auto* w13_bias = weights.has_bias() ? weights.w13_bias.as<uint16_t>() : nullptr;

  const std::vector<Item> items = expert_items(plan, d.inter, kL1ChunkCols);
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t item_idx) {
    const Item& it = items[static_cast<size_t>(item_idx)];
    const int64_t row0 = plan.expert_begin[it.expert];
    const int64_t num_rows = plan.expert_begin[it.expert + 1] - row0;
    const int64_t cols = it.col1 - it.col0;
    std::vector<const float*> x_rows(static_cast<size_t>(num_rows));
    for (int64_t r = 0; r < num_rows; ++r)
      x_rows[r] = x_f + (plan.row_slot[row0 + r] / d.top_k) * d.h;

    // acc [num_rows, 2 * cols]: gate channels [0, cols), up channels [cols, 2 cols).
    std::vector<float> acc(static_cast<size_t>(num_rows * 2 * cols));
    std::vector<float> w_tile(static_cast<size_t>(kTileRows * d.h));
    for (int half = 0; half < 2; ++half) {  // 0: gate rows j, 1: up rows I + j
      for (int64_t j = it.col0; j < it.col1; j += kTileRows) {
        const int64_t n = std::min(kTileRows, it.col1 - j);
        const int64_t w_row = it.expert * 2 * d.inter + half * d.inter + j;
        dequantize_mxfp4(w13 + w_row * (d.h / 2), w13_sf + w_row * h_groups, n, d.h,
                         w_tile.data());
        if (fp8) fp8_mode_fold_weights(w_tile.data(), w13_sf + w_row * h_groups, n, d.h);
        reference_detail::dot_tile(w_tile.data(), n, x_rows.data(), num_rows, d.h,
                                   acc.data() + half * cols + (j - it.col0), 2 * cols);
      }
    }

    // Epilogue per row: bias, BF16 g/u, activation, routing weight, requantization per 32.
    std::vector<float> v(static_cast<size_t>(cols));
    std::vector<uint8_t> q(static_cast<size_t>(cols));
    std::vector<uint8_t> sf(static_cast<size_t>(cols / kScaleBlock));
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t slot = plan.row_slot[row0 + r];
      const float route_w = topk_weights[slot];
      float* a = acc.data() + r * 2 * cols;
      if (w13_bias != nullptr) {
        const uint16_t* b = w13_bias + it.expert * 2 * d.inter;
        for (int64_t c = 0; c < cols; ++c) {
          a[c] += bf16_to_f32(b[it.col0 + c]);
          a[cols + c] += bf16_to_f32(b[d.inter + it.col0 + c]);
        }
      }
      for (int64_t c = 0; c < cols; ++c) {
        const float g = bf16_round(a[c]);
        const float u = bf16_round(a[cols + c]);
        v[c] = apply_activation(config.activation, g, u, config.fast_math) * route_w;
      }
      requantize_intermediate(v.data(), 1, cols, q.data(), sf.data());
      float* h_row = h.data() + (row0 + r) * d.inter + it.col0;
      dequantize_fp8(q.data(), sf.data(), 1, cols, h_row);
      if (fp8) {
        std::copy(sf.begin(), sf.end(),
                  h_sf_rows.begin() + (row0 + r) * i_groups + it.col0 / kScaleBlock);
      }
      if (trace != nullptr) {
        float* t_acc = trace->l1_acc.data() + slot * 2 * d.inter;
        std::copy(a, a + cols, t_acc + it.col0);
        std::copy(a + cols, a + 2 * cols, t_acc + d.inter + it.col0);
        std::copy(q.begin(), q.end(), trace->h_q.begin() + slot * d.inter + it.col0);
        std::copy(sf.begin(), sf.end(),
                  trace->h_sf.begin() + slot * i_groups + it.col0 / kScaleBlock);
      }
    }
  });
  if (fp8) {  // L2's token rows: one power of two per row (numerics.md "FP8 mode")
    parallel_for(plan.num_rows(), [&](int64_t r) {
      fp8_mode_rebase_rows(h.data() + r * d.inter, h_sf_rows.data() + r * i_groups, 1, d.inter);
    });
  }
}

// h [R, I] dequantized intermediate per plan row -> y [T, H] (and the trace's o).
void run_l2_combine(const LayerConfig& config, const MoeWeights& weights, const RoutingPlan& plan,
                    const float* h, const float* topk_weights, uint16_t* y,
                    ReferenceTrace* trace) {
  using reference_detail::kL2ChunkCols;
  using reference_detail::kTileRows;
  const Dims d(config);
  const int64_t i_groups = d.inter / kScaleBlock;
  const auto* w2 = weights.w2.as<uint8_t>();
  const auto* w2_sf = weights.w2_sf.as<uint8_t>();
  const auto* w2_bias = weights.has_bias() ? weights.w2_bias.as<uint16_t>() : nullptr;
  std::vector<uint16_t> o(static_cast<size_t>(plan.num_rows() * d.h));

  const std::vector<Item> items = expert_items(plan, d.h, kL2ChunkCols);
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t item_idx) {
    const Item& it = items[static_cast<size_t>(item_idx)];
    const int64_t row0 = plan.expert_begin[it.expert];
    const int64_t num_rows = plan.expert_begin[it.expert + 1] - row0;
    const int64_t cols = it.col1 - it.col0;
    std::vector<const float*> h_rows(static_cast<size_t>(num_rows));
    for (int64_t r = 0; r < num_rows; ++r) h_rows[r] = h + (row0 + r) * d.inter;
    std::vector<float> acc(static_cast<size_t>(num_rows * cols));
    std::vector<float> w_tile(static_cast<size_t>(kTileRows * d.inter));
    for (int64_t n0 = it.col0; n0 < it.col1; n0 += kTileRows) {
      const int64_t n = std::min(kTileRows, it.col1 - n0);
      const int64_t w_row = it.expert * d.h + n0;
      dequantize_mxfp4(w2 + w_row * (d.inter / 2), w2_sf + w_row * i_groups, n, d.inter,
                       w_tile.data());
      if (config.fp8_for_tokens(plan.num_tokens)) {
        fp8_mode_fold_weights(w_tile.data(), w2_sf + w_row * i_groups, n, d.inter);
      }
      reference_detail::dot_tile(w_tile.data(), n, h_rows.data(), num_rows, d.inter,
                                 acc.data() + (n0 - it.col0), cols);
    }
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t slot = plan.row_slot[row0 + r];
      const float* a = acc.data() + r * cols;
      uint16_t* dst = o.data() + (row0 + r) * d.h + it.col0;
      if (w2_bias != nullptr) {
        // NOTES: GPT-OSS adds the down-projection bias inside each expert, before the routing
        // weight; with the weight applied before L2 (section 4) that is + w * bias here.
        const float route_w = topk_weights[slot];
        const uint16_t* b = w2_bias + it.expert * d.h + it.col0;
        for (int64_t c = 0; c < cols; ++c) dst[c] = bf16_from_f32(a[c] + route_w * bf16_to_f32(b[c]));
      } else {
        for (int64_t c = 0; c < cols; ++c) dst[c] = bf16_from_f32(a[c]);
      }
      if (trace != nullptr)
        std::copy(dst, dst + cols, trace->o.begin() + slot * d.h + it.col0);
    }
  });

  // Combine: ascending k, FP32 from 0, one BF16 rounding.
  const int64_t chunks = (plan.num_tokens + reference_detail::kCombineChunkTokens - 1) /
                         reference_detail::kCombineChunkTokens;
  parallel_for(chunks, [&](int64_t c) {
    const int64_t t0 = c * reference_detail::kCombineChunkTokens;
    const int64_t t1 = std::min(plan.num_tokens, t0 + reference_detail::kCombineChunkTokens);
    std::vector<float> sum(static_cast<size_t>(d.h));
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t k = 0; k < d.top_k; ++k) {
        const int64_t row = plan.slot_row[t * d.top_k + k];
        if (row < 0) continue;
        const uint16_t* src = o.data() + row * d.h;
        for (int64_t n = 0; n < d.h; ++n) sum[n] += bf16_to_f32(src[n]);
      }
      for (int64_t n = 0; n < d.h; ++n) y[t * d.h + n] = bf16_from_f32(sum[n]);
    }
  });
}

void check_pointers(const char* fn, int64_t num_tokens, const void* x, const void* topk_weights,
                    const void* y) {
  if (num_tokens == 0) return;
  MEGAMOE_CHECK_ARG(x != nullptr, fn, ": x is null");
  MEGAMOE_CHECK_ARG(topk_weights != nullptr, fn, ": topk_weights is null");
  MEGAMOE_CHECK_ARG(y != nullptr, fn, ": y is null");
}

// Both entry points: x given as its dequantized FP8 values x_f [T, H].
void forward_from_dequantized(const LayerConfig& config, const MoeWeights& weights,
                              const RoutingPlan& plan, const float* x_f,
                              const float* topk_weights, uint16_t* y, ReferenceTrace* trace) {
  std::vector<float> h;
  run_l1(config, weights, plan, x_f, topk_weights, h, trace);
  run_l2_combine(config, weights, plan, h.data(), topk_weights, y, trace);
}

// (FP8 mode: each token row rebased to one power of two, numerics.md "FP8 mode".)
void dequantize_input(const LayerConfig& config, const Dims& d, const uint8_t* x_q,
                      const uint8_t* x_sf, int64_t num_tokens, std::vector<float>& x_f) {
  x_f.resize(static_cast<size_t>(num_tokens * d.h));
  const int64_t chunks = (num_tokens + kQuantChunkTokens - 1) / kQuantChunkTokens;
  parallel_for(chunks, [&](int64_t c) {
    const int64_t t0 = c * kQuantChunkTokens;
    const int64_t n = std::min(kQuantChunkTokens, num_tokens - t0);
    const uint8_t* sf = x_sf + t0 * (d.h / kScaleBlock);
    dequantize_fp8(x_q + t0 * d.h, sf, n, d.h, x_f.data() + t0 * d.h);
    if (config.fp8_for_tokens(num_tokens)) fp8_mode_rebase_rows(x_f.data() + t0 * d.h, sf, n, d.h);
  });
}

}  // namespace

void reference_forward(const LayerConfig& config, const MoeWeights& weights, const uint16_t* x,
                       const int32_t* topk_idx, const float* topk_weights, int64_t num_tokens,
                       uint16_t* y, ReferenceTrace* trace) {
  constexpr const char* kFn = "reference_forward";
  reference_detail::check_call(kFn, config, weights, num_tokens);
  check_pointers(kFn, num_tokens, x, topk_weights, y);
  const RoutingPlan plan = reference_detail::plan_routing(kFn, config, topk_idx, num_tokens);
  const Dims d(config);
  prepare_trace(trace, d, num_tokens);

  std::vector<uint8_t> x_q(static_cast<size_t>(num_tokens * d.h));
  std::vector<uint8_t> x_sf(static_cast<size_t>(num_tokens * d.h / kScaleBlock));
  const int64_t chunks = (num_tokens + kQuantChunkTokens - 1) / kQuantChunkTokens;
  parallel_for(chunks, [&](int64_t c) {
    const int64_t t0 = c * kQuantChunkTokens;
    const int64_t n = std::min(kQuantChunkTokens, num_tokens - t0);
    quantize_input(x + t0 * d.h, n, d.h, x_q.data() + t0 * d.h,
                   x_sf.data() + t0 * (d.h / kScaleBlock));
  });
  std::vector<float> x_f;
  dequantize_input(config, d, x_q.data(), x_sf.data(), num_tokens, x_f);
  if (trace != nullptr) {
    trace->x_q = x_q;
    trace->x_sf = x_sf;
  }
  forward_from_dequantized(config, weights, plan, x_f.data(), topk_weights, y, trace);
}

void reference_forward_quantized(const LayerConfig& config, const MoeWeights& weights,
                                 const uint8_t* x_q, const uint8_t* x_sf, const int32_t* topk_idx,
                                 const float* topk_weights, int64_t num_tokens, uint16_t* y,
                                 ReferenceTrace* trace) {
  constexpr const char* kFn = "reference_forward_quantized";
  reference_detail::check_call(kFn, config, weights, num_tokens);
  check_pointers(kFn, num_tokens, x_q, topk_weights, y);
  MEGAMOE_CHECK_ARG(num_tokens == 0 || x_sf != nullptr, kFn, ": x_sf is null");
  const RoutingPlan plan = reference_detail::plan_routing(kFn, config, topk_idx, num_tokens);
  const Dims d(config);
  prepare_trace(trace, d, num_tokens);
  std::vector<float> x_f;
  dequantize_input(config, d, x_q, x_sf, num_tokens, x_f);
  if (trace != nullptr) {
    std::copy(x_q, x_q + num_tokens * d.h, trace->x_q.begin());
    std::copy(x_sf, x_sf + num_tokens * d.h / kScaleBlock, trace->x_sf.begin());
  }
  forward_from_dequantized(config, weights, plan, x_f.data(), topk_weights, y, trace);
}

void reference_l2_combine(const LayerConfig& config, const MoeWeights& weights,
                          const uint8_t* h_q, const uint8_t* h_sf, const int32_t* topk_idx,
                          const float* topk_weights, int64_t num_tokens, uint16_t* y) {
  constexpr const char* kFn = "reference_l2_combine";
  reference_detail::check_call(kFn, config, weights, num_tokens);
  MEGAMOE_CHECK_ARG(!weights.has_bias() || num_tokens == 0 || topk_weights != nullptr, kFn,
                    ": these weights have an L2 bias, which is scaled by the routing weight: ",
                    "topk_weights is required");
  MEGAMOE_CHECK_ARG(num_tokens == 0 || (h_q != nullptr && h_sf != nullptr && y != nullptr), kFn,
                    ": h_q, h_sf and y must not be null");
  const RoutingPlan plan = reference_detail::plan_routing(kFn, config, topk_idx, num_tokens);
  const Dims d(config);
  const int64_t i_groups = d.inter / kScaleBlock;
  // Dequantize the given intermediate of each local slot into plan-row order.
  std::vector<float> h(static_cast<size_t>(plan.num_rows() * d.inter));
  parallel_for(plan.num_rows(), [&](int64_t r) {
    const int64_t slot = plan.row_slot[r];
    dequantize_fp8(h_q + slot * d.inter, h_sf + slot * i_groups, 1, d.inter,
                   h.data() + r * d.inter);
    if (config.fp8_for_tokens(num_tokens)) {
      fp8_mode_rebase_rows(h.data() + r * d.inter, h_sf + slot * i_groups, 1, d.inter);
    }
  });
  run_l2_combine(config, weights, plan, h.data(), topk_weights, y, nullptr);
}

void reference_l2_combine(const LayerConfig& config, const MoeWeights& weights,
                          const uint8_t* h_q, const uint8_t* h_sf, const int32_t* topk_idx,
                          int64_t num_tokens, uint16_t* y) {
  reference_l2_combine(config, weights, h_q, h_sf, topk_idx, nullptr, num_tokens, y);
}

}  // namespace megamoe
