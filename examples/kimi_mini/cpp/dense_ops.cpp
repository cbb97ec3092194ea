// Dense FP32 operations of the example model (see dense_ops.hpp).
#include "examples/kimi_mini/cpp/dense_ops.hpp"

#include <algorithm>
#include <cmath>

#include "megamoe/error.hpp"
#include "megamoe/parallel.hpp"

namespace megamoe::model::dense {

namespace {

// NOTES: a work item is kRowBlock input rows against every output column, so each weight row
// is loaded once per kRowBlock tokens (the weights of one projection, <= 1 MiB here, stay in
// L2); kLanes independent partial sums let the compiler vectorise the dot products.
constexpr int64_t kRowBlock = 4;
constexpr int kLanes = 8;

// sum_k a_r[k] * w[k] for kRowBlock rows at once (rows beyond `rows` are skipped).
inline void dot_block(const float* const* a, int rows, const float* w, int64_t in, float* out) {
  float part[kRowBlock][kLanes] = {};
  const int64_t in_main = in - in % kLanes;
  for (int64_t k = 0; k < in_main; k += kLanes)
    for (int r = 0; r < kRowBlock; ++r) {
      if (r >= rows) break;
      for (int l = 0; l < kLanes; ++l) part[r][l] += a[r][k + l] * w[k + l];
    }
  for (int r = 0; r < rows; ++r) {
    float s = 0.0f;
    for (int l = 0; l < kLanes; ++l) s += part[r][l];
    for (int64_t k = in_main; k < in; ++k) s += a[r][k] * w[k];
    out[r] = s;
  }
}

}  // namespace

void linear(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y) {
  MEGAMOE_CHECK_ARG(n >= 0 && in > 0 && out > 0, "linear: bad shape n=", n, " in=", in,
                    " out=", out);
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  parallel_for(blocks, [&](int64_t b) {
    const int64_t r0 = b * kRowBlock;
    const int rows = static_cast<int>(std::min(kRowBlock, n - r0));
    const float* a[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) a[r] = x + (r0 + std::min<int64_t>(r, rows - 1)) * in;
    float res[kRowBlock];
    for (int64_t j = 0; j < out; ++j) {
      dot_block(a, rows, w + j * in, in, res);
      for (int r = 0; r < rows; ++r) y[(r0 + r) * out + j] = res[r];
    }
  });
}

void rms_norm(const float* x, int64_t n, int64_t d, const float* weight, double eps, float* y) {
  parallel_for(n, [&](int64_t i) {
    const float* xi = x + i * d;
    float* yi = y + i * d;
    float ss = 0.0f;
    for (int64_t k = 0; k < d; ++k) ss += xi[k] * xi[k];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t k = 0; k < d; ++k) yi[k] = xi[k] * inv * weight[k];
  });
}

RopeTable::RopeTable(int64_t head_dim_, int64_t max_pos_, double theta)
    : head_dim(head_dim_), max_pos(max_pos_) {
  MEGAMOE_CHECK_ARG(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim must be even, got ",
                    head_dim);
  const int64_t half = head_dim / 2;
  cos.resize(static_cast<size_t>(max_pos * half));
  sin.resize(cos.size());
  for (int64_t i = 0; i < half; ++i) {
    // as examples/kimi_mini/model.py: inv = 1 / theta^(2i / hd), angle = pos * inv, in FP32
    const float expo = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float inv = 1.0f / std::pow(static_cast<float>(theta), expo);
    for (int64_t p = 0; p < max_pos; ++p) {
      const float ang = static_cast<float>(p) * inv;
      cos[p * half + i] = std::cos(ang);
      sin[p * half + i] = std::sin(ang);
    }
  }
}

void apply_rope(float* x, int64_t n, int64_t row_stride, int64_t heads, const int64_t* positions,
                const RopeTable& table) {
  const int64_t hd = table.head_dim, half = hd / 2;
  for (int64_t i = 0; i < n; ++i)
    MEGAMOE_CHECK(positions[i] >= 0 && positions[i] < table.max_pos, ErrorCode::kOutOfRange,
                  "rope: position ", positions[i], " of row ", i, " outside [0, ", table.max_pos,
                  ")");
  parallel_for(n, [&](int64_t i) {
    const float* c = table.cos.data() + positions[i] * half;
    const float* s = table.sin.data() + positions[i] * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + i * row_stride + h * hd;
      for (int64_t k = 0; k < half; ++k) {
        const float x1 = v[k], x2 = v[k + half];
        v[k] = x1 * c[k] - x2 * s[k];
        v[k + half] = x2 * c[k] + x1 * s[k];
      }
    }
  });
}

void situ_rows(const float* gu, int64_t n, int64_t width, float beta, float linear_beta,
               float* out) {
  parallel_for(n, [&](int64_t i) {
    const float* g = gu + i * 2 * width;
    const float* u = g + width;
    float* o = out + i * width;
    for (int64_t k = 0; k < width; ++k) {
      const float sig = 1.0f / (1.0f + std::exp(-g[k]));
      o[k] = (beta * std::tanh(g[k] / beta) * sig) * (linear_beta * std::tanh(u[k] / linear_beta));
    }
  });
}

}  // namespace megamoe::model::dense
