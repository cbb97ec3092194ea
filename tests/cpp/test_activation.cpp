// Activations (numerics.md section 4): known answers computed by hand (values below were
// evaluated in double outside this code base), the clamp edges, and every rejection path of
// parse/validate.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "megamoe/activation.hpp"
#include "megamoe/error.hpp"
#include "test_util.hpp"

namespace megamoe {
namespace {

using test::expect_error;

// |got - want| <= kRelTol * |want| + kAbsTol: a few FP32 ulps of the result.
constexpr double kRelTol = 4e-7;
constexpr double kAbsTol = 1e-30;
constexpr double kRelTolFast = 2e-6;  // fast_math on the host: exp2(x log2 e), see activation.hpp

double situ_fp64(double g, double u, double beta = 4.0, double lbeta = 25.0) {
  return beta * std::tanh(g / beta) / (1.0 + std::exp(-g)) * lbeta * std::tanh(u / lbeta);
}

TEST(Activation, SituKnownAnswers) {
  // (g, u, situ(g, u)) with beta 4, linear_beta 25. g = -1.22 enters as its BF16 value -1.21875.
  struct Kat {
    float g, u;
    double want;
  };
  const Kat kats[] = {
      {0.0f, 0.0f, 0.0},         {0.0f, 10.0f, 0.0},
      {0.0f, 100.0f, 0.0},       {1.0f, 0.0f, 0.0},
      {1.0f, 10.0f, 6.802981959984283},       {1.0f, 100.0f, 17.892980040939985},
      {-1.21875f, 0.0f, 0.0},    {-1.21875f, 10.0f, -2.562461246922966},
      {-1.21875f, 100.0f, -6.739701533323006}, {30.0f, 0.0f, 0.0},
      {30.0f, 10.0f, 37.9948729800722},        {30.0f, 100.0f, 99.93286883448572},
  };
  ASSERT_EQ(bf16_round(-1.22f), -1.21875f);
  const Activation situ = Activation::situ();
  for (const Kat& k : kats) {
    EXPECT_NEAR(situ_fp64(k.g, k.u), k.want, 1e-12 * std::fabs(k.want)) << "the table itself";
    for (bool fast : {false, true}) {
      const double got = apply_activation(situ, k.g, k.u, fast);
      const double tol = (fast ? kRelTolFast : kRelTol) * std::fabs(k.want) + kAbsTol;
      EXPECT_NEAR(got, k.want, tol) << "situ(" << k.g << ", " << k.u << ") fast_math " << fast;
    }
  }
}

TEST(Activation, SituMatchesFp64OnAGrid) {
  const Activation a = Activation::situ(2.5f, 12.0f);
  for (float g = -40.0f; g <= 40.0f; g += 0.37f) {
    for (float u = -150.0f; u <= 150.0f; u += 7.3f) {
      const double want = situ_fp64(g, u, 2.5, 12.0);
      EXPECT_NEAR(apply_activation(a, g, u, false), want, 1e-6 * std::fabs(want) + 1e-30)
          << g << ", " << u;
    }
  }
}

TEST(Activation, SwigluAndClampEdges) {
  const Activation plain = Activation::swiglu();
  const double silu7_times7 = 48.95535849147437;  // 7 / (1 + e^-7) * 7
  EXPECT_NEAR(apply_activation(plain, 7.0f, 7.0f, false), silu7_times7, 1e-6 * silu7_times7);
  EXPECT_EQ(apply_activation(plain, 0.0f, 5.0f, false), 0.0f);
  EXPECT_NEAR(apply_activation(plain, 10.0f, 10.0f, false), 10.0 / (1 + std::exp(-10.0)) * 10, 1e-4);

  const Activation c = Activation::swiglu_clamped(7.0f);
  const float above = 7.03125f;  // the next BF16 value above 7
  const float at_edge = apply_activation(c, 7.0f, 7.0f, false);
  EXPECT_EQ(apply_activation(c, above, 7.0f, false), at_edge) << "g above L clamps to L";
  EXPECT_EQ(apply_activation(c, 7.0f, above, false), at_edge) << "u above L clamps to L";
  EXPECT_EQ(apply_activation(c, 7.0f, -above, false), -at_edge) << "u below -L clamps to -L";
  EXPECT_EQ(apply_activation(c, 1000.0f, 1000.0f, false), at_edge);
  EXPECT_NEAR(at_edge, silu7_times7, 1e-6 * silu7_times7);
  // Below the clamp nothing changes; g is clamped only from above.
  EXPECT_EQ(apply_activation(c, 6.96875f, -6.96875f, false), apply_activation(plain, 6.96875f, -6.96875f, false));
  EXPECT_EQ(apply_activation(c, -50.0f, 3.0f, false), apply_activation(plain, -50.0f, 3.0f, false));

  // The limit is used as a BF16 value: 7.3 -> 7.3125.
  const Activation c73 = Activation::swiglu_clamped(7.3f);
  EXPECT_EQ(apply_activation(c73, 7.34375f, 1.0f, false), apply_activation(plain, 7.3125f, 1.0f, false));
  EXPECT_EQ(apply_activation(c73, 7.3125f, 1.0f, false), apply_activation(plain, 7.3125f, 1.0f, false));

  const Activation zero = Activation::swiglu_clamped(0.0f);
  EXPECT_EQ(apply_activation(zero, 3.0f, 3.0f, false), 0.0f) << "L = 0 forces u = 0";
}

TEST(Activation, SwigluOaiKnownAnswers) {
  const Activation a = Activation::swiglu_oai();
  EXPECT_NEAR(apply_activation(a, 1.0f, 2.0f, false), 2.537387297798464, 1e-6);
  // g clamped to 7 from above only; u clamped to [-7, 7]; then (u + 1).
  const double g7 = 7.0 / (1.0 + std::exp(-1.702 * 7.0));
  EXPECT_NEAR(apply_activation(a, 9.0f, 9.0f, false), g7 * 8.0, 1e-5);
  EXPECT_NEAR(apply_activation(a, 7.0f, -9.0f, false), g7 * -6.0, 1e-5);
  EXPECT_NEAR(apply_activation(a, -3.0f, 0.0f, false), -3.0 / (1.0 + std::exp(1.702 * 3.0)), 1e-7);
}

// NaN in g or u must stay NaN through the clamps (fminf/fmaxf would return the limit: about -49
// for swiglu:clamp=7 and -42 for swiglu_oai at (NaN, NaN)); +-Inf clamps to the limit as written.
TEST(Activation, ClampsKeepNaNAndClampInf) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const Activation& a : {Activation::swiglu(), Activation::swiglu_clamped(7.0f),
                              Activation::swiglu_clamped(0.0f), Activation::situ(),
                              Activation::swiglu_oai()}) {
    for (bool fast : {false, true}) {
      SCOPED_TRACE(a.to_string() + (fast ? " fast_math" : " exact"));
      EXPECT_TRUE(std::isnan(apply_activation(a, nan, nan, fast)));
      EXPECT_TRUE(std::isnan(apply_activation(a, nan, 1.0f, fast)));
      EXPECT_TRUE(std::isnan(apply_activation(a, 1.0f, nan, fast)));
      EXPECT_TRUE(std::isnan(apply_activation(a, nan, -1.0f, fast)));
      EXPECT_TRUE(std::isnan(apply_activation(a, -1.0f, nan, fast)));
    }
  }
  for (const Activation& a : {Activation::swiglu_clamped(7.0f), Activation::swiglu_oai()}) {
    SCOPED_TRACE(a.to_string());
    EXPECT_EQ(apply_activation(a, inf, inf, false), apply_activation(a, 7.0f, 7.0f, false));
    EXPECT_EQ(apply_activation(a, inf, -inf, false), apply_activation(a, 7.0f, -7.0f, false));
    EXPECT_EQ(apply_activation(a, 2.0f, -inf, false), apply_activation(a, 2.0f, -7.0f, false));
  }
  EXPECT_EQ(act_min_keep_nan(-inf, 7.0f), -inf);
  EXPECT_EQ(act_clamp_keep_nan(inf, -7.0f, 7.0f), 7.0f);
  EXPECT_EQ(act_clamp_keep_nan(-inf, -7.0f, 7.0f), -7.0f);
  EXPECT_TRUE(std::isnan(act_clamp_keep_nan(nan, -7.0f, 7.0f)));
  EXPECT_TRUE(std::signbit(act_clamp_keep_nan(-0.0f, -0.0f, 0.0f)));
}

TEST(Activation, SiluIsGOverOnePlusExp) {
  // Exactly as written: g / (1 + exp(-g)). Large negative g gives -0 / +Inf -> -0, never NaN.
  EXPECT_EQ(act_silu(-200.0f, false), -0.0f);
  EXPECT_FALSE(std::isnan(act_silu(-200.0f, true)));
  EXPECT_EQ(act_silu(200.0f, false), 200.0f);
  for (float g = -20.0f; g < 20.0f; g += 0.25f)
    EXPECT_EQ(act_silu(g, false), g / (1.0f + std::exp(-g))) << g;
}

// ---------------------------------------------------------------------------------------------
// Names, parse, validate
// ---------------------------------------------------------------------------------------------
void expect_invalid(const std::string& spec, const std::string& fragment) {
  SCOPED_TRACE("spec '" + spec + "'");
  expect_error([&] { (void)Activation::parse(spec); }, ErrorCode::kInvalidArgument, fragment);
}

TEST(Activation, ParseAndPrint) {
  EXPECT_EQ(Activation::parse("swiglu").to_string(), "swiglu");
  EXPECT_FALSE(Activation::parse("swiglu").has_clamp);
  EXPECT_EQ(Activation::parse("swiglu:clamp=7").to_string(), "swiglu:clamp=7");
  EXPECT_EQ(Activation::parse("swiglu:limit=7.5").clamp, 7.5f);
  EXPECT_EQ(Activation::parse("situ").to_string(), "situ:beta=4,linear_beta=25");
  EXPECT_EQ(Activation::parse(" situ : beta=3 , lbeta=20 ").to_string(), "situ:beta=3,linear_beta=20");
  EXPECT_EQ(Activation::parse("swiglu_oai").to_string(), "swiglu_oai:alpha=1.702,clamp=7");
  EXPECT_EQ(Activation::parse("swiglu_oai:alpha=1.5,clamp=10").to_string(),
            "swiglu_oai:alpha=1.5,clamp=10");
  for (const Activation& a : {Activation::swiglu(), Activation::swiglu_clamped(0.1f),
                              Activation::situ(0.3f, 1e-3f), Activation::swiglu_oai(1.702f, 7.0f)}) {
    const Activation b = Activation::parse(a.to_string());
    EXPECT_EQ(b.kind, a.kind);
    EXPECT_EQ(b.has_clamp, a.has_clamp);
    EXPECT_EQ(b.to_string(), a.to_string());
    if (a.has_clamp) EXPECT_EQ(b.clamp, a.clamp) << "exact round trip of " << a.to_string();
    EXPECT_EQ(b.beta, a.beta);
    EXPECT_EQ(b.linear_beta, a.linear_beta);
  }
  EXPECT_EQ(Activation::situ().name(), "situ");
  EXPECT_EQ(Activation::swiglu_oai().name(), "swiglu_oai");
}

TEST(Activation, RejectsInvalidSpecs) {
  expect_invalid("situ:clamp=7", "situ takes no clamp");
  expect_invalid("situ:beta=0", "beta must be finite and > 0, got 0");
  expect_invalid("situ:beta=-1", "beta must be finite and > 0, got -1");
  expect_invalid("situ:linear_beta=inf", "linear_beta must be finite and > 0, got inf");
  expect_invalid("situ:beta=nan", "beta must be finite and > 0, got nan");
  expect_invalid("situ:beta=1e39", "overflows float32");
  expect_invalid("swiglu:clamp=-1", "clamp must be finite and >= 0, got -1");
  expect_invalid("swiglu:clamp=inf", "clamp must be finite and >= 0");
  expect_invalid("swiglu_oai:alpha=0", "alpha must be finite and > 0");
  expect_invalid("gelu", "unknown name 'gelu' (expected swiglu, situ or swiglu_oai)");
  expect_invalid("", "unknown name ''");
  expect_invalid("swiglu:alpha=1", "unknown parameter 'alpha' for swiglu (allowed: clamp)");
  expect_invalid("situ:gamma=1", "unknown parameter 'gamma' for situ (allowed: beta, linear_beta)");
  expect_invalid("situ:beta", "is not of the form key=value");
  expect_invalid("situ:beta=", "has no value");
  expect_invalid("situ:beta=4x", "expected a number, got '4x'");
  expect_invalid("situ:beta=4,beta=5", "'beta' given twice");
  expect_invalid("swiglu:", "expected key=value parameters");
}

TEST(Activation, ValidateRejectsBadStructs) {
  Activation a = Activation::situ();
  a.has_clamp = true;
  a.clamp = 7.0f;
  expect_error([&] { a.validate(); }, ErrorCode::kInvalidArgument, "situ: a clamp is not allowed");
  EXPECT_THROW(Activation::situ(0.0f, 25.0f), Error);
  EXPECT_THROW(Activation::situ(4.0f, -25.0f), Error);
  EXPECT_THROW(Activation::situ(std::numeric_limits<float>::infinity(), 25.0f), Error);
  EXPECT_THROW(Activation::swiglu_clamped(-0.5f), Error);
  EXPECT_THROW(Activation::swiglu_clamped(std::nanf("")), Error);
  Activation oai = Activation::swiglu_oai();
  oai.has_clamp = false;
  EXPECT_THROW(oai.validate(), Error);
  Activation bad_kind;
  bad_kind.kind = static_cast<ActivationKind>(42);
  EXPECT_THROW(bad_kind.validate(), Error);
}

}  // namespace
}  // namespace megamoe
