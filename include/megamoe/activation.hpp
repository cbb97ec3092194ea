// megamoe/activation.hpp: the activation epilogue of numerics.md section 4, chosen by name.
//
//   swiglu      silu(g) * u                      optional clamp L >= 0 applied to g and u first
//   situ        (beta tanh(g/beta) sigmoid(g)) * (lbeta tanh(u/lbeta))     beta 4, lbeta 25
//   swiglu_oai  g' sigmoid(alpha g') (u' + 1), g' = min(g, L), u' = clamp(u, -L, L)   (GPT-OSS)
//
// There is no numeric sentinel anywhere: the kind is an enum parsed from its name, and a clamp is
// present only when `has_clamp` says so. Activation is a POD so kernels take it by value.
#pragma once

#include <cmath>
#include <string>
#include <string_view>
#include <type_traits>

#include "megamoe/formats.hpp"

namespace megamoe {

enum class ActivationKind : uint8_t { kSwiglu, kSitu, kSwigluOai };

struct Activation {
  ActivationKind kind = ActivationKind::kSwiglu;
  bool has_clamp = false;    // swiglu: optional; swiglu_oai: always (limit); situ: never
  float clamp = 0.0f;        // L, applied to BF16 g/u; meaningful only when has_clamp
  float beta = 4.0f;         // situ
  float linear_beta = 25.0f; // situ
  float alpha = 1.702f;      // swiglu_oai

  static Activation swiglu();
  static Activation swiglu_clamped(float limit);
  static Activation situ(float beta = 4.0f, float linear_beta = 25.0f);
  static Activation swiglu_oai(float alpha = 1.702f, float limit = 7.0f);

  // Parses "swiglu", "swiglu:clamp=7", "situ", "situ:beta=4,linear_beta=25",
  // "swiglu_oai", "swiglu_oai:alpha=1.702,clamp=7". Throws kInvalidArgument naming the problem.
  static Activation parse(std::string_view spec);

  // Throws kInvalidArgument when the combination is invalid (clamp with situ, non-finite or
  // non-positive betas, negative or non-finite clamp, ...).
  void validate() const;

  std::string name() const;       // "swiglu", "situ", "swiglu_oai"
  std::string to_string() const;  // canonical spec that parse() reads back
};

// ---------------------------------------------------------------------------------------------
// Evaluation, shared by the CPU reference and the kernels. g and u are BF16-rounded FP32 values;
// the operations follow numerics.md section 4 in the order written there.
//
// fast_math=false: expf and IEEE division. fast_math=true: exp(x) = ex2.approx(x * log2 e) (what
// __expf does) and the 1/(1+e) of the sigmoid through rcp.approx; tanh stays accurate. The host
// cannot run the approximate instructions: there it rounds x * log2(e) to FP32 like __expf and
// then uses exact exp2 and division, so CPU and GPU fast-math results differ by the few ulps of
// ex2.approx/rcp.approx (docs/numerics.md bounds this).
// ---------------------------------------------------------------------------------------------
MEGAMOE_HD float act_exp(float x, bool fast_math) {
#if defined(__CUDA_ARCH__)
  return fast_math ? __expf(x) : expf(x);
#else
  return fast_math ? std::exp2(x * 1.44269504088896341f) : std::exp(x);
#endif
}

// 1 / d, approximate under fast_math.
MEGAMOE_HD float act_recip(float d, bool fast_math) {
#if defined(__CUDA_ARCH__)
  if (fast_math) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
  }
#endif
  (void)fast_math;
  return 1.0f / d;
}

MEGAMOE_HD float act_sigmoid(float x, bool fast_math) {
  return act_recip(1.0f + act_exp(-x, fast_math), fast_math);
}

// silu(g) = g / (1 + exp(-g)); under fast_math g * rcp(1 + exp(-g)).
MEGAMOE_HD float act_silu(float g, bool fast_math) {
  const float d = 1.0f + act_exp(-g, fast_math);
  return fast_math ? g * act_recip(d, true) : g / d;
}

MEGAMOE_HD float act_tanh(float x) {
#if defined(__CUDA_ARCH__)
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}

// The clamps of swiglu:clamp and swiglu_oai. NaN passes through (fminf/fmaxf would return the
// limit, turning a NaN token into finite values); +-Inf clamps to the limit as min/max do.
MEGAMOE_HD float act_min_keep_nan(float x, float hi) { return x > hi ? hi : x; }
MEGAMOE_HD float act_clamp_keep_nan(float x, float lo, float hi) {
  return x > hi ? hi : (x < lo ? lo : x);
}

MEGAMOE_HD float apply_activation(const Activation& act, float g, float u, bool fast_math) {
  switch (act.kind) {
    case ActivationKind::kSwiglu: {
      if (act.has_clamp) {
        const float lim = bf16_round(act.clamp);
        g = act_min_keep_nan(g, lim);
        u = act_clamp_keep_nan(u, -lim, lim);
      }
      return act_silu(g, fast_math) * u;
    }
    case ActivationKind::kSitu: {
      const float gate = act.beta * act_tanh(g / act.beta) * act_sigmoid(g, fast_math);
      const float lin = act.linear_beta * act_tanh(u / act.linear_beta);
      return gate * lin;
    }
    case ActivationKind::kSwigluOai: {
      const float lim = bf16_round(act.clamp);
      g = act_min_keep_nan(g, lim);
      u = act_clamp_keep_nan(u, -lim, lim);
      return g * act_sigmoid(act.alpha * g, fast_math) * (u + 1.0f);
    }
  }
  return 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Choosing code by the activation: a run-time ActivationKind as a compile-time constant.
// ---------------------------------------------------------------------------------------------
template <ActivationKind kKind>
using ActivationConstant = std::integral_constant<ActivationKind, kKind>;

// Calls f(ActivationConstant<kind>{}) and returns its result: code templated on the kind (the
// GEMM's L1 epilogues) then holds one activation, not three. An unknown kind calls nothing and
// returns a value-initialized result.
template <class F>
MEGAMOE_HD auto with_activation_kind(ActivationKind kind, F&& f)
    -> decltype(f(ActivationConstant<ActivationKind::kSwiglu>{})) {
  using Result = decltype(f(ActivationConstant<ActivationKind::kSwiglu>{}));
  switch (kind) {
    case ActivationKind::kSwiglu: return f(ActivationConstant<ActivationKind::kSwiglu>{});
    case ActivationKind::kSitu: return f(ActivationConstant<ActivationKind::kSitu>{});
    case ActivationKind::kSwigluOai: return f(ActivationConstant<ActivationKind::kSwigluOai>{});
  }
  if constexpr (!std::is_void_v<Result>) return Result{};
}

}  // namespace megamoe
