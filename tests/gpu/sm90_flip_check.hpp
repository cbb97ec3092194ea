// sm90_flip_check.hpp: is a differing intermediate code explained by summation order alone?
//
// numerics.md section 8: in exact mode the GPU's L1 accumulators differ from the CPU's only by
// FP32 summation order, |acc_gpu - acc_cpu| <= delta = gamma * sum_k |x_k w_k|, with
// sum_k |x_k w_k| <= ||x_t|| * ||w_n|| (+ |bias|) by Cauchy-Schwarz. Where the sum cancels
// (|acc| << sum |x w|) that is a large *relative* change of g or u, and through the BF16 rounding,
// the activation (swiglu_oai's u + 1 cancels too) and the per-32 requantization it can move an
// E4M3 code by more than one step. A code is accepted exactly when some accumulators inside the
// bound produce it:
//   g in [g_cpu - dg, g_cpu + dg], u likewise -> every BF16 value they round to -> v = act(g, u) * w
//   (FP64, plus a 1e-5 relative slack for FP32 / fast-math evaluation) -> [v_min, v_max]
//   accepted iff Q(v_min) <= a <= Q(v_max), Q = dequant(quantize at the GPU's own scale byte)
// (Q is monotone, so this is exact for the interval). The scale byte itself is the GPU's: a group
// whose amax crossed a power of two under the same bound gets the other scale.
#pragma once

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "megamoe/activation.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/quantize.hpp"

namespace megamoe::test {

constexpr int kFlipCheckSamples = 129;     // points sampled across an accumulator interval
constexpr double kFlipCheckSlack = 1e-5;   // relative, FP32 / approximate-math evaluation of v

inline double activation_fp64(const Activation& a, double g, double u) {
  switch (a.kind) {
    case ActivationKind::kSwiglu: {
      if (a.has_clamp) {
        const double lim = bf16_round(a.clamp);
        g = std::min(g, lim);
        u = std::min(std::max(u, -lim), lim);
      }
      return g / (1.0 + std::exp(-g)) * u;
    }
    case ActivationKind::kSitu: {
      const double beta = a.beta, lbeta = a.linear_beta;
      return beta * std::tanh(g / beta) / (1.0 + std::exp(-g)) * (lbeta * std::tanh(u / lbeta));
    }
    case ActivationKind::kSwigluOai: {
      const double lim = bf16_round(a.clamp);
      g = std::min(g, lim);
      u = std::min(std::max(u, -lim), lim);
      return g / (1.0 + std::exp(-static_cast<double>(a.alpha) * g)) * (u + 1.0);
    }
  }
  return 0.0;
}

// The BF16 values that FP32 accumulators in [lo, hi] round to (sampled when there are many).
inline std::vector<double> bf16_values_in(double lo, double hi) {
  std::set<double> values;
  for (int i = 0; i < kFlipCheckSamples; ++i) {
    const double p = lo + (hi - lo) * i / (kFlipCheckSamples - 1);
    values.insert(bf16_round(static_cast<float>(p)));
  }
  return {values.begin(), values.end()};
}

inline double dequant_e4m3(double v, int sf) {
  return static_cast<double>(e4m3_to_f32(e4m3_quantize_scaled(static_cast<float>(v), sf))) *
         ue8m0_to_f32(static_cast<uint8_t>(sf));
}

// a: the GPU's dequantized code under its scale byte sf. g_cpu, u_cpu: the CPU's accumulators
// (bias included); dg, du: their bounds; weight: the routing weight.
inline bool flip_explained(const Activation& act, double a, int sf, double g_cpu, double u_cpu,
                           double dg, double du, double weight) {
  double vmin = INFINITY, vmax = -INFINITY;
  for (double g : bf16_values_in(g_cpu - dg, g_cpu + dg))
    for (double u : bf16_values_in(u_cpu - du, u_cpu + du)) {
      const double v = activation_fp64(act, g, u) * weight;
      vmin = std::min(vmin, v);
      vmax = std::max(vmax, v);
    }
  const double slack = kFlipCheckSlack * std::max(std::fabs(vmin), std::fabs(vmax));
  return dequant_e4m3(vmin - slack, sf) <= a && a <= dequant_e4m3(vmax + slack, sf);
}

}  // namespace megamoe::test
