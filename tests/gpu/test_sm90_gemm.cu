// GPU tests of the Hopper grouped GEMMs (src/moe/sm90_gemm.hpp) against a CPU reference fed the
// same inputs. (The GEMM-only benchmark is bench/gemm_bench.cu.)
//
// Checks (numerics.md section 8):
//  - L2 (FP32 accumulators exposed through a single BF16 rounding): for every output,
//    |gpu - ref| <= c * sqrt(K) * eps32 * sum|terms| + 1 BF16 ulp(ref), ref in FP64; prints the
//    largest used fraction of that bound.
//  - L1: h_q / h_sf against the CPU epilogue (same shared activation/quantize functions) on the
//    FP64 accumulators rounded to FP32; a flipped FP8 code must be a neighbour (one code step)
//    and flips must be rare (<= 0.5% of codes); scale bytes may differ only by one and rarely;
//    h_act must equal h_q x 2^(h_sf - 127) exactly. Rows past a tile end are never written
//    (poisoned outputs outside routed rows stay poisoned).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "megamoe/activation.hpp"
#include "megamoe/buffer.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/quantize.hpp"
#include "moe/sm90_gemm.hpp"
#include "prep/sm90_layout.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "sm90/sm90_gemm_config.hpp"
#include "sm90_gemm_test_util.hpp"
#include "sm90_test_util.hpp"

namespace megamoe {
namespace {

#define SKIP_WITHOUT_SM90()                                                               \
  do {                                                                                    \
    if (!sm90_available()) GTEST_SKIP() << "no sm_90 GPU present: Hopper GEMM tests skipped"; \
  } while (0)

constexpr uint8_t kPoisonByte = 0xA5;

struct Problem {
  int64_t H = 0, I = 0;
  int E = 0;
  std::vector<int> counts;      // rows per local expert
  std::vector<int32_t> offsets;
  int64_t rows = 0;
  // canonical weights
  std::vector<uint8_t> w13, w13_sf, w2, w2_sf;
  std::vector<uint16_t> w13_bias, w2_bias;
  std::vector<uint16_t> act;    // [rows + slack, H] bf16 (E4M3 x 2^s exact)
  std::vector<uint16_t> h_in;   // [rows + slack, I] bf16 (E4M3 x 2^s exact), L2 input
  std::vector<float> row_weights;
};

// BF16 rows that carry E4M3 x 2^s exactly: random values quantized per 32 and dequantized.
std::vector<uint16_t> quantized_rows(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> x(rows * cols), out(rows * cols);
  for (auto& v : x) v = bf16_from_f32(nd(rng) * (1.0f + 3.0f * (rng() % 4 == 0)));
  std::vector<uint8_t> q(rows * cols), sf(rows * cols / 32);
  if (rows > 0) quantize_input(x.data(), rows, cols, q.data(), sf.data());
  for (int64_t i = 0; i < rows * cols; ++i) {
    out[i] = bf16_from_f32(e4m3_to_f32(q[i]) * ue8m0_to_f32(sf[i / 32]));
  }
  return out;
}

Problem make_problem(int64_t H, int64_t I, std::vector<int> counts, bool bias, uint32_t seed) {
  Problem p;
  p.H = H; p.I = I; p.E = static_cast<int>(counts.size()); p.counts = counts;
  p.offsets.assign(p.E + 1, 0);
  for (int e = 0; e < p.E; ++e) p.offsets[e + 1] = p.offsets[e] + counts[e];
  p.rows = p.offsets[p.E];
  std::mt19937 rng(seed);
  auto fill_w = [&](std::vector<uint8_t>& w, std::vector<uint8_t>& sf, int64_t n, int64_t k) {
    w.resize(p.E * n * k / 2);
    sf.resize(p.E * n * k / 32);
    for (auto& b : w) b = static_cast<uint8_t>(rng());
    // scales around 2^-log2(sqrt(k)) with spread, so outputs are O(1)
    const int base = 127 - static_cast<int>(std::lround(std::log2(std::sqrt(double(k))))) - 1;
    for (auto& s : sf) s = static_cast<uint8_t>(base - 2 + static_cast<int>(rng() % 5));
  };
  fill_w(p.w13, p.w13_sf, 2 * I, H);
  fill_w(p.w2, p.w2_sf, H, I);
  if (bias) {
    std::normal_distribution<float> nd(0.0f, 0.5f);
    p.w13_bias.resize(p.E * 2 * I);
    p.w2_bias.resize(p.E * H);
    for (auto& b : p.w13_bias) b = bf16_from_f32(nd(rng));
    for (auto& b : p.w2_bias) b = bf16_from_f32(nd(rng));
  }
  p.act = quantized_rows(p.rows + sm90::kRowSlack, H, rng);
  p.h_in = quantized_rows(p.rows + sm90::kRowSlack, I, rng);
  std::uniform_real_distribution<float> ud(0.05f, 1.0f);
  p.row_weights.resize(std::max<int64_t>(p.rows, 1));
  for (auto& w : p.row_weights) w = ud(rng);
  return p;
}

// Sets a test-wide setting for a scope and restores it after.
template <class T>
struct ScopedSetting {
  ScopedSetting(T& setting, T value) : setting_(setting), before_(setting) { setting_ = value; }
  ~ScopedSetting() { setting_ = before_; }
  T& setting_;
  T before_;
};

// The decode tiles take their units at run time when the workspace has a unit counter (as the
// layer's does); Sm90Gemm.EveryTileConfigStaticUnits runs them without it (the static split).
bool g_static_units = false;

// The most rows one expert can get, handed to the policy (L1Args / L2Args::rows_per_expert_max: gated
// launches when it calls for another tile than rows_hint); 0 (the default) for one launch.
int64_t g_rows_per_expert_max = 0;

// One split-K workspace for every launch of the tests (the layer's sizes); after each launch its
// counters must be back to zero (check_split_counters_zero).
const sm90::SplitKWorkspace& split_workspace() {
  static const SplitWorkspace shared(sm90::split_k_counters(), sm90::split_k_partial_floats());
  return shared.ws;
}

void check_split_counters_zero() {
  const auto& ws = split_workspace();
  std::vector<int32_t> c(ws.counters_capacity + 2);  // the split counters, then the unit counter
  MEGAMOE_CUDA_CHECK(cudaMemcpy(c.data(), ws.counters, c.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < c.size(); ++i) {
    ASSERT_EQ(c[i], 0) << (i < size_t(ws.counters_capacity) ? "split-K counter " : "unit counter ")
                       << i << " left set";
  }
}

// Prepared (sm90) copies of all experts of one matrix.
void prepare_all(Sm90Matrix which, const Problem& p, const std::vector<uint8_t>& w,
                 const std::vector<uint8_t>& sf, std::vector<uint8_t>& pw, std::vector<uint8_t>& psf) {
  pw.resize(w.size());
  psf.resize(sf.size());
  const size_t eb = w.size() / p.E, esf = sf.size() / p.E;
  for (int e = 0; e < p.E; ++e) {
    sm90_prepare_expert(which, ExpertDims{p.H, p.I}, w.data() + e * eb, sf.data() + e * esf,
                        pw.data() + e * eb, psf.data() + e * esf);
  }
}

// Dequantized canonical matrix of expert e: [n, k] floats.
std::vector<float> dequant_expert(const std::vector<uint8_t>& w, const std::vector<uint8_t>& sf,
                                  int e, int64_t n, int64_t k) {
  std::vector<float> out(n * k);
  const uint8_t* we = w.data() + e * n * k / 2;
  const uint8_t* se = sf.data() + e * n * k / 32;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c)
      out[r * k + c] = e2m1_to_f32(e2m1_unpack(we + r * k / 2, c)) * ue8m0_to_f32(se[r * (k / 32) + c / 32]);
  return out;
}

// FP64 dot products and sum of |terms| for rows [r0, r0 + nr) of x against all n rows of w.
void ref_gemm(const std::vector<uint16_t>& x, int64_t r0, int64_t nr, const std::vector<float>& w,
              int64_t n, int64_t k, std::vector<double>& acc, std::vector<double>& mag) {
  acc.assign(nr * n, 0.0);
  mag.assign(nr * n, 0.0);
  std::vector<double> xr(k);
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t c = 0; c < k; ++c) xr[c] = bf16_to_f32(x[(r0 + r) * k + c]);
    for (int64_t j = 0; j < n; ++j) {
      const float* wr = &w[j * k];
      double s = 0, m = 0;
      for (int64_t c = 0; c < k; ++c) {
        const double t = xr[c] * wr[c];
        s += t;
        m += std::fabs(t);
      }
      acc[r * n + j] = s;
      mag[r * n + j] = m;
    }
  }
}

// FP8 mode operands (docs/numerics.md "FP8 mode"), as the kernels must see them.
// Token rows: per row one power of two f = 2^ceil(log2(amax / 448)) and q = e4m3(x / f) (exact
// for the test's rows, which carry E4M3 x 2^s, unless a value falls below E4M3's range), stored
// in fp8_row_slot order; vals = q x f, what the reference multiplies.
struct Fp8Rows {
  std::vector<uint8_t> q;
  std::vector<float> factor, vals;
};
Fp8Rows fp8_rows(const std::vector<uint16_t>& x, int64_t rows, int64_t cols) {
  Fp8Rows out;
  out.q.assign(rows * cols, 0);
  out.factor.assign(rows, 1.0f);
  out.vals.assign(rows * cols, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < cols; ++c) amax = std::fmax(amax, std::fabs(bf16_to_f32(x[r * cols + c])));
    const float f = amax > 0 ? std::ldexp(1.0f, static_cast<int>(std::ceil(std::log2(amax / 448.0)))) : 1.0f;
    out.factor[r] = f;
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t q = e4m3_from_f32(bf16_to_f32(x[r * cols + c]) / f);
      const int64_t slot = c / 32 * 32 + sm90_layout::fp8_row_slot(static_cast<int>(c % 32));
      out.q[r * cols + slot] = q;
      out.vals[r * cols + c] = e4m3_to_f32(q) * f;
    }
  }
  return out;
}

// Weights as the FP8 tiles multiply them: E2M1 x 2^(s - s_max + 1) rounded to E4M3 (exact within
// 9 binades of the row's largest scale s_max), times 2^(s_max - 128). Also each canonical row's
// s_max (rows_exp, [n]).
std::vector<float> fp8_expert(const std::vector<uint8_t>& w, const std::vector<uint8_t>& sf, int e,
                              int64_t n, int64_t k, std::vector<uint8_t>* rows_exp = nullptr) {
  std::vector<float> out(n * k);
  const uint8_t* we = w.data() + e * n * k / 2;
  const uint8_t* se = sf.data() + e * n * k / 32;
  if (rows_exp) rows_exp->assign(n, 0);
  for (int64_t r = 0; r < n; ++r) {
    int smax = 0;
    for (int64_t g = 0; g < k / 32; ++g) smax = std::max(smax, int(se[r * (k / 32) + g]));
    if (rows_exp) (*rows_exp)[r] = static_cast<uint8_t>(smax);
    for (int64_t c = 0; c < k; ++c) {
      const int s = se[r * (k / 32) + c / 32];
      const float folded = std::ldexp(e2m1_to_f32(e2m1_unpack(we + r * k / 2, c)), s - smax + 1);
      out[r * k + c] = e4m3_to_f32(e4m3_from_f32(folded)) * std::ldexp(1.0f, smax - 128);
    }
  }
  return out;
}

// ref_gemm on FP32 rows.
void ref_gemm_f(const std::vector<float>& x, int64_t r0, int64_t nr, const std::vector<float>& w,
                int64_t n, int64_t k, std::vector<double>& acc, std::vector<double>& mag) {
  acc.assign(nr * n, 0.0);
  mag.assign(nr * n, 0.0);
  for (int64_t r = 0; r < nr; ++r) {
    const float* xr = &x[(r0 + r) * k];
    for (int64_t j = 0; j < n; ++j) {
      const float* wr = &w[j * k];
      double s = 0, m = 0;
      for (int64_t c = 0; c < k; ++c) {
        const double t = double(xr[c]) * wr[c];
        s += t;
        m += std::fabs(t);
      }
      acc[r * n + j] = s;
      mag[r * n + j] = m;
    }
  }
}

// FP8 inputs on the device: rows, factors (rows + slack) and the weights' row exponents computed
// by weight_row_exponents from the prepared scales, checked against the canonical rows' s_max.
struct Fp8Device {
  Buffer q, factor, row_exp;
};
Fp8Device fp8_device(const Fp8Rows& rows, const Buffer& d_psf, Sm90Matrix which, const Problem& p,
                     const std::vector<uint8_t>& w, const std::vector<uint8_t>& sf, int64_t n,
                     int64_t k) {
  Fp8Device d;
  d.q = to_device(rows.q);
  d.factor = to_device(rows.factor);
  d.row_exp = Buffer(std::max<int64_t>(p.E * n, 1), Device::cuda());
  sm90::weight_row_exponents(d_psf.as<uint8_t>(), p.E, n, k, d.row_exp.as<uint8_t>(), nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = to_host<uint8_t>(d.row_exp, p.E * n);
  int64_t bad = 0;
  for (int e = 0; e < p.E; ++e) {
    std::vector<uint8_t> expect;
    (void)fp8_expert(w, sf, e, n, k, &expect);
    for (int64_t m = 0; m < n; ++m) {
      const int64_t canon = sm90_layout::canonical_row(which == Sm90Matrix::kW13, m, p.I);
      if (got[e * n + m] != expect[canon] && ++bad <= 5)
        ADD_FAILURE() << "weight_row_exponents expert " << e << " prepared row " << m << ": "
                      << int(got[e * n + m]) << ", expected " << int(expect[canon]);
    }
  }
  return d;
}

std::string describe(const Problem& p, const char* what) {
  std::string s = std::string(what) + " H=" + std::to_string(p.H) + " I=" + std::to_string(p.I) +
                  " counts={";
  for (int c : p.counts) s += std::to_string(c) + ",";
  return s + "}";
}

// Bound constant c of numerics.md section 8 (FP32 accumulation of K terms in any order,
// hardware accumulators that may truncate: generous but still ~1e-4 relative at K = 4096).
constexpr double kBoundC = 2.0;
constexpr double kEps32 = 1.1920928955078125e-07;

double bf16_ulp(double v) {
  const float f = static_cast<float>(std::fabs(v));
  int ex;
  std::frexp(f == 0.0f ? 1e-30f : f, &ex);
  return std::ldexp(1.0, ex - 8);
}

// (out_copy: if given, receives the launch's output rows, for bitwise comparisons.)
void run_l2_case(const Problem& p, int64_t rows_hint, bool with_bias,
                 sm90::TileRequest tile = {}, int k_splits = 0,
                 std::vector<uint16_t>* out_copy = nullptr, bool fp8 = false) {
  SCOPED_TRACE(describe(p, "L2") + " tile=" + sm90::to_string(tile) +
               " k_splits=" + std::to_string(k_splits) + (fp8 ? " fp8" : ""));
  std::vector<uint8_t> pw2, psf2;
  prepare_all(Sm90Matrix::kW2, p, p.w2, p.w2_sf, pw2, psf2);
  Buffer d_off = to_device(p.offsets), d_h = to_device(p.h_in), d_rw = to_device(p.row_weights);
  Buffer d_w = to_device(pw2), d_sf = to_device(psf2);
  Buffer d_bias = with_bias ? to_device(p.w2_bias) : Buffer();
  const int64_t max_rows = p.rows + 5;  // capacity above the routed rows
  Buffer d_out(std::max<int64_t>(max_rows, 1) * p.H * 2, Device::cuda());
  MEGAMOE_CUDA_CHECK(cudaMemset(d_out.data(), kPoisonByte, d_out.size()));
  sm90::L2Args a;
  a.num_experts = p.E; a.hidden = p.H; a.intermediate = p.I; a.max_rows = max_rows;
  a.rows_hint = rows_hint; a.row_offsets = d_off.as<int32_t>(); a.h_act = d_h.as<uint16_t>();
  a.rows_per_expert_max = g_rows_per_expert_max;
  a.row_weights = d_rw.as<float>(); a.w2 = d_w.as<uint8_t>(); a.w2_sf = d_sf.as<uint8_t>();
  a.w2_bias = with_bias ? d_bias.as<uint16_t>() : nullptr; a.out = d_out.as<uint16_t>();
  a.small_scales = sm90::scales_all_small(d_sf.as<uint8_t>(), int64_t(psf2.size()), nullptr);
  Fp8Rows rows8;
  Fp8Device dev8;
  if (fp8) {
    rows8 = fp8_rows(p.h_in, p.rows + sm90::kRowSlack, p.I);
    dev8 = fp8_device(rows8, d_sf, Sm90Matrix::kW2, p, p.w2, p.w2_sf, p.H, p.I);
    a.h_act = nullptr;
    a.h_fp8 = dev8.q.as<uint8_t>();
    a.h_row_factor = dev8.factor.as<float>();
    a.w2_row_exp = dev8.row_exp.as<uint8_t>();
  }
  a.tile = tile;
  a.split_k = split_workspace();
  if (g_static_units) a.split_k.unit_counter = nullptr;
  a.k_splits = k_splits;
  sm90::launch_l2(a, nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  check_split_counters_zero();
  const auto out = to_host<uint16_t>(d_out, max_rows * p.H);
  if (out_copy != nullptr) *out_copy = out;

  double worst = 0;
  int64_t bad = 0;
  std::vector<double> acc, mag;
  for (int e = 0; e < p.E; ++e) {
    if (p.counts[e] == 0) continue;
    if (fp8) {
      ref_gemm_f(rows8.vals, p.offsets[e], p.counts[e], fp8_expert(p.w2, p.w2_sf, e, p.H, p.I), p.H,
                 p.I, acc, mag);
    } else {
      ref_gemm(p.h_in, p.offsets[e], p.counts[e], dequant_expert(p.w2, p.w2_sf, e, p.H, p.I), p.H,
               p.I, acc, mag);
    }
    for (int64_t r = 0; r < p.counts[e]; ++r) {
      const int64_t row = p.offsets[e] + r;
      for (int64_t n = 0; n < p.H; ++n) {
        double ref = acc[r * p.H + n];
        double m = mag[r * p.H + n];
        if (with_bias) {
          const double bt = double(p.row_weights[row]) * bf16_to_f32(p.w2_bias[e * p.H + n]);
          ref += bt;
          m += std::fabs(bt);
        }
        // FP8 mode: the FP8 tensor cores accumulate with fewer bits than FP32 (about 14;
        // docs/numerics.md "FP8 mode"): a bound of 2^-9 of the sum of |terms|.
        const double bound = (fp8 ? std::ldexp(1.0, -9) : kBoundC * std::sqrt(double(p.I)) * kEps32) * m +
                             bf16_ulp(ref);
        const double got = bf16_to_f32(out[row * p.H + n]);
        const double used = std::fabs(got - ref) / bound;
        worst = std::max(worst, std::isnan(used) ? 1e30 : used);
        if (!(used <= 1.0) && ++bad <= 5) {
          ADD_FAILURE() << "L2 row " << row << " (expert " << e << ") n " << n << ": gpu " << got
                        << " ref " << ref << " bound " << bound;
        }
      }
    }
  }
  for (int64_t row = p.rows; row < max_rows; ++row)
    for (int64_t n = 0; n < p.H; ++n)
      ASSERT_EQ(out[row * p.H + n], uint16_t(kPoisonByte * 0x101)) << "row past the routed rows written";
  printf("[sm90 L2] %s rows_hint=%lld tile=%s k_splits=%d bias=%d%s: max |gpu-ref| / bound = %.3f\n",
         describe(p, "").c_str(), (long long)rows_hint, sm90::to_string(tile).c_str(), k_splits,
         int(with_bias), fp8 ? " fp8" : "", worst);
  EXPECT_EQ(bad, 0);
}

// e4m3 codes are monotone in magnitude: neighbours differ by one in the low 7 bits (same sign).
bool neighbour_codes(uint8_t a, uint8_t b) {
  if (a == b) return true;
  const int ma = a & 0x7F, mb = b & 0x7F;
  if ((a & 0x80) != (b & 0x80)) return ma == 0 && mb == 0 ? true : (ma + mb == 1);
  return std::abs(ma - mb) == 1;
}

// FP8 mode: the FP8 tensor cores' accumulation error is a fraction of the sum of |terms| (the
// L2 check bounds it by 2^-9 of that sum), which moves a small code by several steps but only
// by a small absolute amount: codes agree when they are neighbours or their values differ by at
// most 1 in units of the group's scale (whose largest code is about 448).
bool fp8_close_codes(uint8_t a, uint8_t b) {
  return neighbour_codes(a, b) || std::fabs(e4m3_to_f32(a) - e4m3_to_f32(b)) <= 1.0f;
}

// (hact_copy: if given, receives h_act, for bitwise comparisons.)
void run_l1_case(const Problem& p, int64_t rows_hint, const Activation& act, bool fast_math,
                 bool with_bias, sm90::TileRequest tile = {}, int k_splits = 0,
                 std::vector<uint16_t>* hact_copy = nullptr, bool fp8 = false) {
  SCOPED_TRACE(describe(p, "L1") + " tile=" + sm90::to_string(tile) + " act=" + std::to_string(int(act.kind)) +
               " fast_math=" + std::to_string(fast_math) + " k_splits=" + std::to_string(k_splits) +
               (fp8 ? " fp8" : ""));
  std::vector<uint8_t> pw, psf;
  prepare_all(Sm90Matrix::kW13, p, p.w13, p.w13_sf, pw, psf);
  Buffer d_off = to_device(p.offsets), d_x = to_device(p.act), d_rw = to_device(p.row_weights);
  Buffer d_w = to_device(pw), d_sf = to_device(psf);
  Buffer d_bias = with_bias ? to_device(p.w13_bias) : Buffer();
  const int64_t max_rows = p.rows + 3;
  const int64_t I = p.I;
  Buffer d_hq(std::max<int64_t>(max_rows, 1) * I, Device::cuda());
  Buffer d_hsf(std::max<int64_t>(max_rows, 1) * I / 32, Device::cuda());
  Buffer d_hact((max_rows + sm90::kRowSlack) * I * 2, Device::cuda());
  MEGAMOE_CUDA_CHECK(cudaMemset(d_hq.data(), kPoisonByte, d_hq.size()));
  MEGAMOE_CUDA_CHECK(cudaMemset(d_hsf.data(), kPoisonByte, d_hsf.size()));
  MEGAMOE_CUDA_CHECK(cudaMemset(d_hact.data(), kPoisonByte, d_hact.size()));
  sm90::L1Args a;
  a.num_experts = p.E; a.hidden = p.H; a.intermediate = I; a.max_rows = max_rows;
  a.rows_hint = rows_hint; a.row_offsets = d_off.as<int32_t>(); a.act = d_x.as<uint16_t>();
  a.rows_per_expert_max = g_rows_per_expert_max;
  a.row_weights = d_rw.as<float>(); a.w13 = d_w.as<uint8_t>(); a.w13_sf = d_sf.as<uint8_t>();
  a.w13_bias = with_bias ? d_bias.as<uint16_t>() : nullptr; a.activation = act;
  a.fast_math = fast_math; a.h_q = d_hq.as<uint8_t>(); a.h_sf = d_hsf.as<uint8_t>();
  a.h_act = d_hact.as<uint16_t>();
  a.small_scales = sm90::scales_all_small(d_sf.as<uint8_t>(), int64_t(psf.size()), nullptr);
  Fp8Rows rows8;
  Fp8Device dev8;
  if (fp8) {
    rows8 = fp8_rows(p.act, p.rows + sm90::kRowSlack, p.H);
    dev8 = fp8_device(rows8, d_sf, Sm90Matrix::kW13, p, p.w13, p.w13_sf, 2 * I, p.H);
    a.act = nullptr;
    a.act_fp8 = dev8.q.as<uint8_t>();
    a.act_row_factor = dev8.factor.as<float>();
    a.w13_row_exp = dev8.row_exp.as<uint8_t>();
    a.h_act = nullptr;  // the FP8 tiles write no h_act (their L2 reads rebased h_q rows)
  }
  a.tile = tile;
  a.split_k = split_workspace();
  if (g_static_units) a.split_k.unit_counter = nullptr;
  a.k_splits = k_splits;
  sm90::launch_l1(a, nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  check_split_counters_zero();
  const auto hq = to_host<uint8_t>(d_hq, max_rows * I);
  const auto hsf = to_host<uint8_t>(d_hsf, max_rows * I / 32);
  const auto hact = to_host<uint16_t>(d_hact, max_rows * I);
  if (hact_copy != nullptr) *hact_copy = hact;

  int64_t flips = 0, far_flips = 0, sf_diff = 0, sf_far = 0, act_bad = 0, codes = 0;
  std::vector<double> acc, mag;
  std::vector<float> v(I);
  for (int e = 0; e < p.E; ++e) {
    if (p.counts[e] == 0) continue;
    if (fp8) {
      ref_gemm_f(rows8.vals, p.offsets[e], p.counts[e], fp8_expert(p.w13, p.w13_sf, e, 2 * I, p.H),
                 2 * I, p.H, acc, mag);
    } else {
      ref_gemm(p.act, p.offsets[e], p.counts[e], dequant_expert(p.w13, p.w13_sf, e, 2 * I, p.H),
               2 * I, p.H, acc, mag);
    }
    for (int64_t r = 0; r < p.counts[e]; ++r) {
      const int64_t row = p.offsets[e] + r;
      for (int64_t j = 0; j < I; ++j) {
        float ga = static_cast<float>(acc[r * 2 * I + j]);
        float ua = static_cast<float>(acc[r * 2 * I + I + j]);
        if (with_bias) {
          ga += bf16_to_f32(p.w13_bias[e * 2 * I + j]);
          ua += bf16_to_f32(p.w13_bias[e * 2 * I + I + j]);
        }
        v[j] = apply_activation(act, bf16_round(ga), bf16_round(ua), fast_math) * p.row_weights[row];
      }
      for (int64_t grp = 0; grp < I / 32; ++grp) {
        float amax = 0;
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(v[grp * 32 + j]));
        const int b = intermediate_scale_exponent(amax);
        const int gb = hsf[row * (I / 32) + grp];
        if (gb != b) { ++sf_diff; if (std::abs(gb - b) > 1 && ++sf_far <= 5) ADD_FAILURE() << "scale row " << row << " group " << grp << " gpu " << gb << " ref " << b; }
        for (int j = 0; j < 32; ++j) {
          const int64_t idx = row * I + grp * 32 + j;
          const uint8_t rq = e4m3_quantize_scaled(v[grp * 32 + j], b);
          ++codes;
          if (gb == b && hq[idx] != rq) {
            ++flips;
            if (!(fp8 ? fp8_close_codes(hq[idx], rq) : neighbour_codes(hq[idx], rq)) && ++far_flips <= 5)
              ADD_FAILURE() << "code row " << row << " j " << grp * 32 + j << " gpu " << int(hq[idx]) << " ref " << int(rq);
          }
          const uint16_t expect = bf16_from_f32(e4m3_to_f32(hq[idx]) * exp2i(gb - 127));
          if (!fp8 && hact[idx] != expect && ++act_bad <= 5)
            ADD_FAILURE() << "h_act row " << row << " j " << grp * 32 + j << " is not h_q x 2^(h_sf-127)";
        }
      }
    }
  }
  for (int64_t i = p.rows * I; i < max_rows * I; ++i)
    ASSERT_EQ(hq[i], kPoisonByte) << "h_q written past the routed rows";
  const double flip_frac = codes ? double(flips) / codes : 0.0;
  const double sf_frac = codes ? double(sf_diff) * 32 / codes : 0.0;
  printf("[sm90 L1] %s act=%s fast=%d bias=%d%s: codes %lld, flipped %lld (%.4f%%), scale diffs %lld (%.4f%% of groups)\n",
         describe(p, "").c_str(), act.name().c_str(), int(fast_math), int(with_bias), fp8 ? " fp8" : "",
         (long long)codes, (long long)flips, 100 * flip_frac, (long long)sf_diff, 100 * sf_frac);
  EXPECT_EQ(far_flips, 0);
  EXPECT_EQ(sf_far, 0);
  EXPECT_EQ(act_bad, 0);
  // FP8 mode: the FP8 tensor cores' accumulation moves codes near a rounding boundary more often.
  EXPECT_LE(flip_frac, fp8 ? 0.03 : 0.005);
  EXPECT_LE(sf_frac, fp8 ? 0.01 : 0.002);
}

TEST(Sm90Gemm, L2DecodeAndPrefillConfigs) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(1024, 512, {0, 1, 7, 64, 0, 513, 3, 130}, true, 1);
  run_l2_case(p, 4, false);        // decode config (tiles of 16 rows)
  run_l2_case(p, p.rows, false);   // prefill config
  run_l2_case(p, p.rows, true);    // bias
}

TEST(Sm90Gemm, L2PartialTilesAndEmptyLayer) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(320, 192, {5, 0, 200, 17}, true, 2);
  run_l2_case(p, p.rows, true);
  run_l2_case(p, 1, true);
  const Problem empty = make_problem(320, 192, {0, 0, 0}, false, 3);
  run_l2_case(empty, 0, false);
}

TEST(Sm90Gemm, L1AllActivations) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(1024, 512, {0, 1, 7, 64, 0, 513, 3, 130}, true, 4);
  run_l1_case(p, p.rows, Activation::swiglu(), true, false);
  run_l1_case(p, 4, Activation::swiglu(), false, false);
  run_l1_case(p, p.rows, Activation::situ(4.0f, 25.0f), true, false);
  run_l1_case(p, 4, Activation::situ(4.0f, 25.0f), false, false);
  run_l1_case(p, p.rows, Activation::swiglu_oai(1.702f, 7.0f), true, true);
  run_l1_case(p, p.rows, Activation::swiglu_clamped(7.0f), true, false);
}

TEST(Sm90Gemm, L1PartialTiles) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(320, 192, {5, 0, 200, 17}, true, 5);
  run_l1_case(p, p.rows, Activation::swiglu_oai(1.702f, 7.0f), true, true);
  run_l1_case(p, 1, Activation::swiglu(), true, false);
}

// Gated launches (rows_per_expert_max above rows_hint's class): the policy launches one tile per class
// of rows per expert between the two (128 x 8 decode, 128 x 16 decode, prefill) and only the one
// matching the actual rows per hit expert runs. An estimate of ~1 row per expert against rows that
// are few, medium and many per expert: each must come out as the reference says (a launch that
// ran none would leave the poisoned outputs, and the counters must be back at zero).
TEST(Sm90Gemm, GatedLaunchesRunTheTileOfTheActualRows) {
  SKIP_WITHOUT_SM90();
  const ScopedSetting<int64_t> gate(g_rows_per_expert_max, 300);
  const std::vector<std::vector<int>> counts = {
      {1, 0, 2, 1, 0, 3, 0, 1},          // <= 4 per hit expert: the 128 x 8 tile
      {0, 9, 0, 12, 7, 0, 0, 10},         // 4..12: the 128 x 16 tile
      {0, 0, 200, 0, 0, 0, 0, 260},       // > 12: a prefill tile
      {0, 0, 0, 0, 0, 0, 0, 0}};          // no rows
  int seed = 20;
  for (const auto& c : counts) {
    const Problem p = make_problem(512, 256, c, true, seed++);
    run_l1_case(p, 8, Activation::situ(4.0f, 25.0f), true, true);
    run_l2_case(p, 8, true);
  }
}

TEST(Sm90Gemm, KimiShapeDecodeAndOneLargeExpert) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(3584, 3072, {1, 0, 2, 0, 129}, false, 6);
  run_l1_case(p, 4, Activation::situ(4.0f, 25.0f), true, false);
  run_l1_case(p, p.rows, Activation::situ(4.0f, 25.0f), true, false);
  run_l2_case(p, 4, false);
  run_l2_case(p, p.rows, false);
}

using sm90::TileId;
using sm90::TileRequest;

// Every exact-mode tile (the FP8 tiles take other inputs: Fp8Tiles* below).
std::vector<TileId> every_tile() {
  std::vector<TileId> tiles;
  for (int i = 0; i < sm90::kNumTiles; ++i) {
    if (!sm90::tile_config(static_cast<TileId>(i)).fp8()) tiles.push_back(static_cast<TileId>(i));
  }
  return tiles;
}
std::vector<TileId> fp8_tiles() {
  std::vector<TileId> tiles;
  for (int i = 0; i < sm90::kNumTiles; ++i) {
    if (sm90::tile_config(static_cast<TileId>(i)).fp8()) tiles.push_back(static_cast<TileId>(i));
  }
  return tiles;
}
TileRequest forced(TileId id) { return TileRequest::forced(id); }

// Every shipped tile forced on the same problems (the policy picks only some of them here):
// empty experts, partial n- and m-tiles, experts above 128 and 256 rows, odd k-block counts
// (H = 320: 5, I = 192: 3, which the tiles of several k-blocks per stage refuse, naming K), bias,
// all compared to the same reference.
void every_tile_case(TileId tile) {
  const Problem p = make_problem(512, 256, {0, 1, 7, 64, 0, 513, 3, 130, 250}, true, 8);
  const Problem q = make_problem(320, 192, {5, 0, 200, 17, 300}, true, 9);
  run_l1_case(p, p.rows, Activation::swiglu_oai(1.702f, 7.0f), true, true, forced(tile));
  run_l2_case(p, p.rows, true, forced(tile));
  if (sm90::tile_config(tile).k_multiple() > 64) {
    for (int l = 1; l <= 2; ++l) {
      try {
        if (l == 1) run_l1_case(q, 1, Activation::situ(4.0f, 25.0f), false, false, forced(tile));
        else run_l2_case(q, 1, false, forced(tile));
        ADD_FAILURE() << sm90::tile_config(tile).name << " ran K = 320 / 192";
      } catch (const megamoe::Error& e) {
        EXPECT_NE(std::string(e.what()).find("takes K"), std::string::npos) << e.what();
      }
    }
    return;
  }
  run_l1_case(q, 1, Activation::situ(4.0f, 25.0f), false, false, forced(tile));
  run_l2_case(q, 1, false, forced(tile));
}

// Scale bytes on both sides of 128 (weights up to 6 x 2^18): the policy (which then runs the
// serial tiles) and the serial tiles compute them exactly; an overlapped tile is refused with an
// error that names the scales, and launches nothing.
// (W2: warps 0, 2 of each block see 110..145, warps 1, 3 only 110..127; W13 likewise by the
// interleave.)
void wide_scale_case(TileRequest tile) {
  Problem p = make_problem(512, 256, {3, 40, 150}, false, 10);
  std::mt19937 rng(11);
  auto respread = [&](std::vector<uint8_t>& sf, int64_t n, int64_t k) {
    const int64_t groups = k / 32;
    for (int64_t i = 0; i < static_cast<int64_t>(sf.size()); ++i) {
      const int64_t row = (i / groups) % n;
      // canonical rows 0..15 of every 32: 110..145; rows 16..31: 110..127
      sf[i] = static_cast<uint8_t>(110 + rng() % ((row / 16) % 2 == 0 ? 36 : 18));
    }
  };
  respread(p.w13_sf, 2 * p.I, p.H);
  respread(p.w2_sf, p.H, p.I);
  if (tile.mode != TileRequest::Mode::kForced || !sm90::tile_config(tile.tile).needs_small_scales()) {
    run_l1_case(p, p.rows, Activation::swiglu(), true, false, tile);
    run_l2_case(p, p.rows, false, tile);
    return;
  }
  for (int l = 1; l <= 2; ++l) {
    SCOPED_TRACE("L" + std::to_string(l) + " tile=" + sm90::to_string(tile));
    try {
      if (l == 1) run_l1_case(p, p.rows, Activation::swiglu(), true, false, tile);
      else run_l2_case(p, p.rows, false, tile);
      ADD_FAILURE() << "an overlapped tile ran on weights with scale bytes >= 128";
    } catch (const megamoe::Error& e) {
      EXPECT_EQ(e.code(), megamoe::ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("scale bytes < 128"), std::string::npos) << e.what();
    }
  }
}

TEST(Sm90Gemm, EveryTileConfig) {
  SKIP_WITHOUT_SM90();
  for (const TileId tile : every_tile()) every_tile_case(tile);
}

// The same cases with the static split of the units (a workspace without a unit counter).
TEST(Sm90Gemm, EveryTileConfigStaticUnits) {
  SKIP_WITHOUT_SM90();
  const ScopedSetting<bool> static_units(g_static_units, true);
  for (const TileId tile : every_tile()) every_tile_case(tile);
}

// Units taken at run time go to whichever CTA is ahead, and each unit's result does not depend
// on the CTA that runs it: the same launch with and without the unit counter must agree bit for
// bit (the decode tiles, forced: the policy's own pick depends on the counter; the split tile
// with 2 K parts).
TEST(Sm90Gemm, RunTimeUnitsAgreeBitwiseWithStaticSplit) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(512, 256, {0, 1, 7, 64, 0, 513, 3, 130, 250}, true, 8);
  const std::pair<TileId, int> runs[] = {
      {TileId::kDecode128x8K4Warp, 0},   {TileId::kDecode128x8K2Warp, 0},
      {TileId::kDecode128x8K1Warp, 0},   {TileId::kDecode128x16K2Warp, 0},
      {TileId::kDecode128x16K1Warp, 0},  {TileId::kDecode128x16K2WarpSplitK, 2},
      {TileId::kDecode128x16K2Cta3, 0},  {TileId::kDecode64x16, 0},
      {TileId::kDecode128x8K4WarpSplitK, 2}};
  // The 8-row split tile's stages are 256 deep: K = 512 and 1024 for its two parts.
  const Problem deep = make_problem(1024, 512, {0, 1, 7, 64, 0, 513, 3, 130, 250}, true, 9);
  for (const auto& [tile, splits] : runs) {
    SCOPED_TRACE(std::string("tile=") + sm90::tile_config(tile).name + " k_splits=" + std::to_string(splits));
    const Problem& pt = splits > 1 && sm90::tile_config(tile).k_multiple() * splits > p.I ? deep : p;
    std::vector<uint16_t> l1[2], l2[2];
    for (int fixed = 0; fixed < 2; ++fixed) {
      const ScopedSetting<bool> scope(g_static_units, fixed == 1);
      run_l1_case(pt, pt.rows, Activation::swiglu(), true, true, forced(tile), splits, &l1[fixed]);
      run_l2_case(pt, pt.rows, true, forced(tile), splits, &l2[fixed]);
    }
    EXPECT_TRUE(l1[0] == l1[1]) << "L1 h_act differs between run-time units and the static split";
    EXPECT_TRUE(l2[0] == l2[1]) << "L2 out differs between run-time units and the static split";
  }
}

TEST(Sm90Gemm, ScalesAboveAndBelow128) {
  SKIP_WITHOUT_SM90();
  wide_scale_case(TileRequest::automatic());
  wide_scale_case(TileRequest::serial());
  for (const TileId tile : every_tile()) wide_scale_case(forced(tile));
}

// FP8 mode: every FP8 tile (and the FP8 policy) against the reference on the operands as the FP8
// mode rebases them: empty experts, partial n- and m-tiles, experts over 128 / 256 rows, bias,
// every activation; then scale spreads of up to 24 binades in a row (groups below the 9-binade
// window rounded, alike on both sides).
TEST(Sm90Gemm, Fp8TilesAgainstTheRebasedReference) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(512, 256, {0, 1, 7, 64, 0, 513, 3, 130, 250}, true, 8);
  Problem wide = make_problem(384, 128, {9, 200, 0, 70}, false, 12);
  std::mt19937 rng(13);
  for (auto* sf : {&wide.w13_sf, &wide.w2_sf}) {
    for (auto& b : *sf) b = static_cast<uint8_t>(std::clamp(int(b) - 12 + int(rng() % 25), 1, 254));
  }
  std::vector<TileRequest> tiles = {TileRequest::automatic()};
  for (const TileId t : fp8_tiles()) tiles.push_back(forced(t));
  for (const TileRequest& tile : tiles) {
    run_l1_case(p, p.rows, Activation::swiglu(), true, true, tile, 0, nullptr, true);
    run_l1_case(p, p.rows, Activation::situ(4.0f, 25.0f), false, false, tile, 0, nullptr, true);
    run_l1_case(p, p.rows, Activation::swiglu_oai(1.702f, 7.0f), true, true, tile, 0, nullptr, true);
    run_l2_case(p, p.rows, true, tile, 0, nullptr, true);
    run_l1_case(wide, wide.rows, Activation::swiglu(), true, false, tile, 0, nullptr, true);
    run_l2_case(wide, wide.rows, false, tile, 0, nullptr, true);
  }
}

// FP8 mode refusals: an exact-mode tile (or 'serial') with FP8 inputs, an FP8 tile with exact-mode
// inputs, and K not a multiple of 128, each with an error naming what is wrong.
TEST(Sm90Gemm, Fp8RefusesWhatItCannotRun) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(512, 256, {3, 40}, false, 14);
  auto expect_error = [](const char* what, const std::function<void()>& f, const char* needle) {
    try {
      f();
      ADD_FAILURE() << what << ": no error";
    } catch (const megamoe::Error& e) {
      EXPECT_EQ(e.code(), megamoe::ErrorCode::kInvalidArgument) << what;
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  expect_error("exact tile, FP8 inputs", [&] {
    run_l2_case(p, p.rows, false, forced(TileId::kPrefill256x128K2Staged), 0, nullptr, true);
  }, "is an exact-mode tile");
  expect_error("serial, FP8 inputs", [&] {
    run_l2_case(p, p.rows, false, TileRequest::serial(), 0, nullptr, true);
  }, "exact-mode request");
  expect_error("FP8 tile, exact inputs", [&] {
    run_l2_case(p, p.rows, false, forced(TileId::kFp8Prefill256x128K2Staged));
  }, "is an FP8-mode tile");
  const Problem q = make_problem(320, 192, {5, 30}, false, 15);
  expect_error("K % 128", [&] { run_l2_case(q, q.rows, false, TileRequest::automatic(), 0, nullptr, true); },
               "multiple of 128");
}

// scales_all_small: one byte >= 128 anywhere (first, last, inside the 16-byte vectors, in the
// bytewise tail, at an unaligned start) is found; 127s and an empty range are small.
TEST(Sm90Gemm, ScalesAllSmallFindsEveryLargeByte) {
  SKIP_WITHOUT_SM90();
  constexpr int64_t kBytes = 100003;  // not a multiple of 16: a bytewise tail
  Buffer d(kBytes + 16, Device::cuda());
  const std::vector<uint8_t> small(kBytes + 16, 127);
  auto upload = [&](const std::vector<uint8_t>& v) {
    copy_bytes(d.data(), Device::cuda(), v.data(), Device::cpu(), v.size());
  };
  upload(small);
  const uint8_t* base = d.as<uint8_t>();
  EXPECT_TRUE(sm90::scales_all_small(base, kBytes, nullptr));
  EXPECT_TRUE(sm90::scales_all_small(base + 3, kBytes, nullptr));
  EXPECT_TRUE(sm90::scales_all_small(base, 0, nullptr));
  for (const int64_t at : {int64_t{0}, int64_t{15}, int64_t{16}, int64_t{4097}, kBytes - 17,
                           kBytes - 1}) {
    for (const uint8_t value : {uint8_t{128}, uint8_t{255}}) {
      std::vector<uint8_t> v = small;
      v[at] = value;
      upload(v);
      EXPECT_FALSE(sm90::scales_all_small(base, kBytes, nullptr)) << "byte " << at;
      if (at >= 3) EXPECT_FALSE(sm90::scales_all_small(base + 3, kBytes - 3, nullptr)) << "byte " << at;
    }
  }
  // A large byte just past the range is not read.
  std::vector<uint8_t> v = small;
  v[kBytes] = 200;
  upload(v);
  EXPECT_TRUE(sm90::scales_all_small(base, kBytes, nullptr));
  EXPECT_THROW(sm90::scales_all_small(base, -1, nullptr), megamoe::Error);
}

// The decode tiles with several k-blocks per stage on a problem small enough for
// compute-sanitizer (tests/gpu/run_reliability.sh runs ReliabilitySanitize.* under memcheck,
// racecheck and synccheck): the layer's small shape has too few tiles for the policy to pick them.
TEST(ReliabilitySanitize, DecodeTilesTwoKBlocksPerStage) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(512, 256, {3, 0, 9, 1}, false, 13);
  for (const TileId tile : {TileId::kDecode128x16K2Warp, TileId::kDecode128x8K4Warp,
                            TileId::kDecode128x8K2Warp, TileId::kDecode128x16K2Cta3}) {
    run_l1_case(p, p.rows, Activation::swiglu(), true, false, forced(tile));
    run_l2_case(p, p.rows, false, forced(tile));
  }
}

// Split-K (the *_splitk tiles, the policy's when a decode launch has few tiles): 1..4 K parts of
// 4 or 8 stages (two k-blocks each), and of 3 or 5 one-k-block stages (K = 192, 320: the k1
// tile), partial tiles, empty experts, bias, several units per CTA (more units than a small
// problem's tiles), compared with the same reference; the counters must be back to zero after
// every launch. Small enough for compute-sanitizer.
TEST(ReliabilitySanitize, DecodeTilesSplitK) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(1024, 512, {3, 0, 9, 1, 17}, true, 15);
  const Problem q = make_problem(320, 192, {5, 0, 2, 17}, false, 16);
  for (int parts : {1, 2, 3, 4}) {
    run_l1_case(p, p.rows, Activation::swiglu_oai(1.702f, 7.0f), true, true,
                forced(TileId::kDecode128x16K2WarpSplitK), parts);
    run_l2_case(p, p.rows, true, forced(TileId::kDecode128x16K2WarpSplitK), parts);
    run_l1_case(q, q.rows, Activation::situ(4.0f, 25.0f), false, false,
                forced(TileId::kDecode128x16K1WarpSplitK), parts);
    if (parts <= 3) run_l2_case(q, q.rows, false, forced(TileId::kDecode128x16K1WarpSplitK), parts);
    // The 8-row split tile: K = 1024 in 4 stages of four k-blocks, K = 512 in 2.
    run_l1_case(p, p.rows, Activation::swiglu(), true, true, forced(TileId::kDecode128x8K4WarpSplitK), parts);
    if (parts <= 2) run_l2_case(p, p.rows, true, forced(TileId::kDecode128x8K4WarpSplitK), parts);
  }
}

// The policy's split-K choice at T = 1 of the DeepSeek-V3 shape (8 experts, one row each): L1's
// 256 tiles of 128 rows run in 2 K parts on an H200 (132 x 4 slots), L2's 448 unsplit; both
// against the reference.
TEST(Sm90Gemm, KAutoSplitKAtOneToken) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(7168, 2048, std::vector<int>(8, 1), false, 17);
  run_l1_case(p, 8, Activation::swiglu(), true, false);
  run_l2_case(p, 8, false);
}

// Forced k_splits the tile or the K cannot take are rejected with the field named.
TEST(Sm90Gemm, SplitKRejectsWhatCannotSplit) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(512, 256, {3, 1}, false, 18);
  EXPECT_ANY_THROW(run_l2_case(p, p.rows, false, forced(TileId::kPrefill256x128K2Staged), 2));
  EXPECT_ANY_THROW(run_l2_case(p, p.rows, false, forced(TileId::kDecode128x16K2Warp), 2));  // unsplit
  EXPECT_ANY_THROW(run_l2_case(p, p.rows, false, forced(TileId::kDecode128x16K2WarpSplitK), 3));  // 2 stages
  EXPECT_ANY_THROW(run_l2_case(p, p.rows, false, forced(TileId::kDecode128x16K2WarpSplitK), 5));
  EXPECT_ANY_THROW(run_l2_case(p, p.rows, false, forced(TileId::kDecode128x16K1WarpSplitK), 5));
  EXPECT_ANY_THROW(run_l2_case(p, p.rows, false, forced(TileId::kDecode128x8K4WarpSplitK), 2));  // 1 stage
}

// The staged-epilogue prefill tiles (stmatrix staging; the asynchronous epilogue's handshake
// over tile boundaries) on problems small enough for compute-sanitizer: partial m- and n-tiles,
// several tiles per CTA, bias; K = 320 (I) for the tiles that take any multiple of 64.
TEST(ReliabilitySanitize, PrefillStagedEpilogues) {
  SKIP_WITHOUT_SM90();
  const std::vector<int> counts = {0, 1, 7, 64, 0, 200, 3, 130};
  const Problem p = make_problem(512, 320, counts, true, 14);
  const Problem p128 = make_problem(512, 256, counts, true, 14);
  for (const TileId tile : {TileId::kPrefill256x128K2Staged, TileId::kPrefill256x128K1Staged,
                            TileId::kPrefill128x192Async}) {
    const Problem& pt = sm90::tile_config(tile).k_multiple() == 64 ? p : p128;
    run_l1_case(pt, pt.rows, Activation::situ(4.0f, 25.0f), true, true, forced(tile));
    run_l2_case(pt, pt.rows, true, forced(tile));
  }
}

// The same for the asynchronous tiles that need K a multiple of 128 (no one-k-block sibling):
// 96- and 64-row n-tiles, experts above 96 and 192 rows.
TEST(ReliabilitySanitize, PrefillAsyncNarrowTiles) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(512, 256, {0, 1, 7, 64, 0, 200, 3, 130, 97}, true, 19);
  for (const TileId tile : {TileId::kPrefill256x64K2Async, TileId::kPrefill256x96K2Async2}) {
    run_l1_case(p, p.rows, Activation::situ(4.0f, 25.0f), true, true, forced(tile));
    run_l2_case(p, p.rows, true, forced(tile));
  }
}

// More tiles than CTA slots (132 SMs x 4): every CTA runs several tiles, so the pipeline's stage
// and phase carry over tile boundaries (L1 of the 256-row tile: 8 m-tiles x 96 experts).
TEST(Sm90Gemm, SeveralTilesPerCta) {
  SKIP_WITHOUT_SM90();
  std::vector<int> counts(96);
  for (int e = 0; e < 96; ++e) counts[e] = (e * 7) % 5;  // 0..4 rows, some experts empty
  const Problem p = make_problem(1024, 1024, counts, false, 12);
  for (const TileId tile : {TileId::kSerial64x8, TileId::kSerial256x128, TileId::kDecode64x16,
                            TileId::kDecode128x8K4Warp, TileId::kPrefill256x128K2Staged}) {
    run_l1_case(p, p.rows, Activation::situ(4.0f, 25.0f), true, false, forced(tile));
    run_l2_case(p, p.rows, false, forced(tile));
  }
}

// The serial policy (LayerConfig::sm90.gemm_tile = "serial"): decode and prefill picks on the
// Kimi-K3 shape (the default policy's picks are Sm90Gemm.KimiShapeDecodeAndOneLargeExpert).
TEST(Sm90Gemm, KimiShapeAutoSerial) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(3584, 3072, {1, 0, 2, 0, 129}, false, 6);
  run_l1_case(p, 4, Activation::situ(4.0f, 25.0f), true, false, TileRequest::serial());
  run_l1_case(p, p.rows, Activation::situ(4.0f, 25.0f), true, false, TileRequest::serial());
  run_l2_case(p, 4, false, TileRequest::serial());
  run_l2_case(p, p.rows, false, TileRequest::serial());
}

TEST(Sm90Gemm, Rows4096OneExpert) {
  SKIP_WITHOUT_SM90();
  const Problem p = make_problem(512, 256, {4096, 0, 1}, false, 7);
  run_l1_case(p, p.rows, Activation::swiglu(), true, false);
  run_l2_case(p, p.rows, false);
}

}  // namespace
}  // namespace megamoe
