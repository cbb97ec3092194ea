// The dense (non-expert) operations of the example model, in FP32 on the host.
//
// Plain multi-threaded C++ on megamoe's parallel_for: each work item owns disjoint output rows,
// and every reduction runs inside one item in a fixed order, so results do not depend on the
// thread count (parallel.hpp).
#pragma once

#include <cstdint>
#include <vector>

namespace megamoe::model::dense {

// y[n, out] = x[n, in] . w[out, in]^T        (row-major; y must not alias x)
void linear(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y);

// y[n, d] = x * rsqrt(mean(x^2) + eps) * weight     (y may alias x)
void rms_norm(const float* x, int64_t n, int64_t d, const float* weight, double eps, float* y);

// Rotary embedding, half-split form (x[i] pairs with x[i + hd/2]), in place on every head of
// every row: row r is x[r * row_stride, + heads * hd), positions[n]. cos/sin: [max_pos, hd/2].
struct RopeTable {
  int64_t head_dim = 0, max_pos = 0;
  std::vector<float> cos, sin;
  RopeTable(int64_t head_dim, int64_t max_pos, double theta);
};
void apply_rope(float* x, int64_t n, int64_t row_stride, int64_t heads, const int64_t* positions,
                const RopeTable& table);

// SiTU on FP32 gate/up pairs (numerics.md section 4 with exact exp):
//   out[i] = (beta tanh(g/beta) sigmoid(g)) * (lbeta tanh(u/lbeta))
// gu: [n, 2 * width] rows of gate then up; out: [n, width].
void situ_rows(const float* gu, int64_t n, int64_t width, float beta, float linear_beta,
               float* out);

}  // namespace megamoe::model::dense
