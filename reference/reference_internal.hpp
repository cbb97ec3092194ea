// reference_internal.hpp: what the CPU reference files share: input checks, the routing plan
// (valid local slots grouped by expert) and the dot-product kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/weights.hpp"

namespace megamoe::reference_detail {

// Work split. Items are (local expert, block of output columns); the K reduction of a dot
// product is never split, so results do not depend on the number of threads.
constexpr int64_t kL1ChunkCols = 256;  // intermediate channels j per L1 item (multiple of 32)
constexpr int64_t kL2ChunkCols = 256;  // output channels n per L2 item
constexpr int64_t kTileRows = 8;       // weight rows dequantized together, reused by every token
constexpr int64_t kCombineChunkTokens = 16;
static_assert(kL1ChunkCols % 32 == 0, "an L1 item must hold whole requantization groups");

// The valid slots of this rank, grouped by local expert. Row r of an expert-major buffer holds
// slot row_slot[r] = t * K + k; the rows of local expert e are [expert_begin[e], expert_begin[e+1])
// in ascending slot order. slot_row[s] is the row of slot s, or -1 (empty or not local).
struct RoutingPlan {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  std::vector<int64_t> expert_begin;
  std::vector<int64_t> row_slot;
  std::vector<int64_t> slot_row;
  int64_t num_rows() const { return static_cast<int64_t>(row_slot.size()); }
};

// One work item: a local expert with routed rows and a block [col0, col1) of output columns.
struct Item {
  int64_t expert;
  int64_t col0, col1;
};
// The items of every local expert that has rows, its `cols` columns cut into blocks of `chunk`.
std::vector<Item> expert_items(const RoutingPlan& plan, int64_t cols, int64_t chunk);

// Throws unless config and weights agree, the weights are canonical and on the host, and
// 0 <= num_tokens <= capacity. `fn` names the caller in messages.
void check_call(const char* fn, const LayerConfig& config, const MoeWeights& weights,
                int64_t num_tokens);

// Checks every expert id (kOutOfRange naming token, slot and value) and builds the plan.
RoutingPlan plan_routing(const char* fn, const LayerConfig& config, const int32_t* topk_idx,
                         int64_t num_tokens);

// out[r * out_stride + i] = sum_k w[i * k_dim + k] * x_rows[r][k] for i < num_w_rows,
// r < num_x_rows. Fixed summation order: 16 (float) / 8 (double) interleaved partial sums over
// k, added pairwise at the end. k_dim must be a multiple of 16.
void dot_tile(const float* w, int64_t num_w_rows, const float* const* x_rows, int64_t num_x_rows,
              int64_t k_dim, float* out, int64_t out_stride);
void dot_tile(const double* w, int64_t num_w_rows, const double* const* x_rows,
              int64_t num_x_rows, int64_t k_dim, double* out, int64_t out_stride);

// Tests only: use the baseline (SSE2) dot kernels even where AVX2 is available (on = true) or
// restore the automatic choice. Returns whether this CPU has an AVX2 path at all.
bool force_baseline_dot(bool on);

}  // namespace megamoe::reference_detail
