// The diff metric of numerics.md section 8 and the row / expert breakdown every accuracy check
// reports (a single global number can hide one broken row or expert).
#include <algorithm>
#include <cmath>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/reference.hpp"
#include "reference/reference_internal.hpp"

namespace megamoe {

namespace {

// Running sums of the metric: <a,a>, <b,b>, <a,b>.
struct DiffSums {
  double aa = 0, bb = 0, ab = 0;
  void add(double a, double b) {
    aa += a * a;
    bb += b * b;
    ab += a * b;
  }
  double diff() const {
    const double denom = aa + bb;
    if (denom == 0.0) return 0.0;  // both all-zero: identical
    return 1.0 - 2.0 * ab / denom;
  }
};

// Whether diff d should replace the current worst: larger, or NaN (a NaN row is the worst row).
bool is_worse(double d, double current, int64_t current_index) {
  if (current_index < 0) return true;
  if (std::isnan(current)) return false;
  return std::isnan(d) || d > current;
}

}  // namespace

double diff_metric(const double* a, const double* b, int64_t n) {
  MEGAMOE_CHECK_ARG(n >= 0, "diff_metric: n must be >= 0, got ", n);
  DiffSums s;
  for (int64_t i = 0; i < n; ++i) s.add(a[i], b[i]);
  return s.diff();
}

DiffReport compare_output(const LayerConfig& config, const uint16_t* y, const double* ref,
                          const int32_t* topk_idx, int64_t num_tokens) {
  config.validate();
  MEGAMOE_CHECK_ARG(num_tokens >= 0, "compare_output: num_tokens must be >= 0, got ", num_tokens);
  const auto plan = reference_detail::plan_routing("compare_output", config, topk_idx, num_tokens);
  const int64_t h_dim = config.shape.hidden, top_k = config.shape.top_k;

  DiffReport report;
  DiffSums total;
  std::vector<DiffSums> rows(static_cast<size_t>(num_tokens));
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t n = 0; n < h_dim; ++n) {
      const double a = bf16_to_f32(y[t * h_dim + n]);
      const double b = ref[t * h_dim + n];
      rows[t].add(a, b);
      // NaN never compares greater: count it as an infinite error so it cannot hide.
      const double err = std::fabs(a - b);
      report.max_abs_err = std::isnan(err) ? HUGE_VAL : std::max(report.max_abs_err, err);
    }
    total.aa += rows[t].aa;
    total.bb += rows[t].bb;
    total.ab += rows[t].ab;
    const double d = rows[t].diff();
    if (is_worse(d, report.worst_row_diff, report.worst_row)) {
      report.worst_row_diff = d;
      report.worst_row = t;
    }
  }
  report.diff = total.diff();

  // Per local expert: the diff over the rows of the tokens routed to it.
  const int64_t first = config.first_local_expert();
  for (size_t e = 0; e + 1 < plan.expert_begin.size(); ++e) {
    const int64_t r0 = plan.expert_begin[e], r1 = plan.expert_begin[e + 1];
    if (r0 == r1) continue;
    DiffSums s;
    for (int64_t r = r0; r < r1; ++r) {
      const DiffSums& row = rows[static_cast<size_t>(plan.row_slot[r] / top_k)];
      s.aa += row.aa;
      s.bb += row.bb;
      s.ab += row.ab;
    }
    const double d = s.diff();
    if (is_worse(d, report.worst_expert_diff, report.worst_expert)) {
      report.worst_expert_diff = d;
      report.worst_expert = first + static_cast<int64_t>(e);
    }
  }
  return report;
}

}  // namespace megamoe
