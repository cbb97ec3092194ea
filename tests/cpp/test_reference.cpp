// The CPU reference layer: against the FP64 ideal MoE on scaled-down variants of every shape,
// stage by stage against an independent recomputation of numerics.md, edge cases, expert
// parallelism and determinism across thread counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/parallel.hpp"
#include "megamoe/quantize.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/routing.hpp"
#include "megamoe/weights.hpp"
#include "reference/reference_internal.hpp"
#include "test_util.hpp"

namespace megamoe {
namespace {

using test::expect_error;

constexpr double kIdealDiffBound = 1e-2;  // numerics.md section 8: FP8 x MXFP4 is 1e-3..1e-2

struct Case {
  std::string name;
  LayerShape shape;
  Activation activation;
  bool bias = false;
  int64_t tokens = 64;
};

std::string describe(const Case& c, RoutingKind routing, uint64_t seed, const LayerConfig& cfg) {
  return c.name + " (" + c.shape.to_string() + ", " + cfg.activation.to_string() +
         ", T=" + std::to_string(c.tokens) + ", routing " + routing_kind_name(routing) +
         " seed " + std::to_string(seed) + ", fast_math " + (cfg.fast_math ? "on" : "off") +
         ", ep " + std::to_string(cfg.ep_rank) + "/" + std::to_string(cfg.ep_size) + ")";
}

// Scaled-down variants of the four shapes of targets.md (same K, same activation, H and I
// divided down, E divided down where large). gpt-oss keeps H = I not a multiple of 128.
std::vector<Case> scaled_cases() {
  return {
      {"kimi-k3/8", {448, 384, 112, 16}, Activation::situ(4.0f, 25.0f), false, 48},
      {"deepseek-v3/8", {896, 256, 32, 8}, Activation::swiglu(), false, 64},
      {"gpt-oss-120b/9", {320, 320, 16, 4}, Activation::swiglu_oai(1.702f, 7.0f), true, 64},
      {"small", {1024, 512, 32, 4}, Activation::swiglu(), false, 64},
      {"small-clamped", {1024, 512, 32, 4}, Activation::swiglu_clamped(7.0f), false, 64},
  };
}

LayerConfig make_config(const Case& c, bool fast_math = true, int ep_size = 1, int ep_rank = 0) {
  LayerConfig cfg;
  cfg.shape = c.shape;
  cfg.activation = c.activation;
  cfg.fast_math = fast_math;
  cfg.ep_size = ep_size;
  cfg.ep_rank = ep_rank;
  cfg.max_tokens_per_rank = 4096;
  return cfg;
}

TEST(Reference, MatchesIdealOnEveryShape) {
  for (const Case& c : scaled_cases()) {
    for (RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kSkewed}) {
      for (bool fast_math : {true, false}) {
        const uint64_t seed = 7;
        const LayerConfig cfg = make_config(c, fast_math);
        const MoeWeights w = synthetic_weights(cfg, seed, c.bias);
        const Routing r = make_routing(routing, c.tokens, c.shape.num_experts, c.shape.top_k, seed);
        const auto x = synthetic_activations(c.tokens, c.shape.hidden, seed);
        std::vector<uint16_t> y(x.size());
        std::vector<double> ideal(x.size());
        reference_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), c.tokens,
                          y.data());
        ideal_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), c.tokens,
                      ideal.data());
        const DiffReport rep = compare_output(cfg, y.data(), ideal.data(), r.topk_idx.data(), c.tokens);
        const std::string what = describe(c, routing, seed, cfg);
        std::printf("  %-70s diff %.2e  worst row %lld (%.2e)  worst expert %lld (%.2e)\n",
                    what.c_str(), rep.diff, static_cast<long long>(rep.worst_row),
                    rep.worst_row_diff, static_cast<long long>(rep.worst_expert),
                    rep.worst_expert_diff);
        EXPECT_LT(rep.diff, kIdealDiffBound) << what;
        EXPECT_LT(rep.worst_row_diff, kIdealDiffBound) << what << " worst row " << rep.worst_row;
        EXPECT_LT(rep.worst_expert_diff, kIdealDiffBound) << what << " worst expert " << rep.worst_expert;
        EXPECT_GT(rep.diff, 0.0) << what << ": FP8 quantization must leave some error";
        double norm = 0;
        for (double v : ideal) norm += v * v;
        EXPECT_GT(norm / static_cast<double>(ideal.size()), 1e-4) << what << ": outputs of unit order";
      }
    }
  }
}

// The FP8 mode (docs/numerics.md "FP8 mode"; issue 31's bar: diff against the FP64 ideal at most
// 1.5x the exact mode's), on every scaled shape and routing, with the weights' scales widened by
// up to +-12 binades per group in one run (rows whose groups fall below the 9-binade window).
TEST(Reference, Fp8ModeStaysWithinTheIssueBar) {
  for (const Case& c : scaled_cases()) {
    for (RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kSkewed}) {
      for (int spread : {0, 12}) {
        const uint64_t seed = 9;
        LayerConfig cfg = make_config(c, false);
        MoeWeights w = synthetic_weights(cfg, seed, c.bias);
        if (spread > 0) {
          std::mt19937 rng(seed);
          for (Buffer* sf : {&w.w13_sf, &w.w2_sf}) {
            uint8_t* b = sf->as<uint8_t>();
            for (int64_t i = 0; i < sf->size(); ++i)
              b[i] = static_cast<uint8_t>(std::clamp(int(b[i]) - spread + int(rng() % (2 * spread + 1)), 1, 254));
          }
        }
        const Routing r = make_routing(routing, c.tokens, c.shape.num_experts, c.shape.top_k, seed);
        const auto x = synthetic_activations(c.tokens, c.shape.hidden, seed);
        std::vector<uint16_t> exact(x.size()), fp8(x.size());
        std::vector<double> ideal(x.size());
        reference_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), c.tokens,
                          exact.data());
        cfg.precision = Precision::kFp8;
        cfg.fp8_min_rows_per_expert = 0;  // every call (these have few rows per expert)
        reference_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), c.tokens,
                          fp8.data());
        ideal_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), c.tokens,
                      ideal.data());
        const DiffReport e = compare_output(cfg, exact.data(), ideal.data(), r.topk_idx.data(), c.tokens);
        const DiffReport f = compare_output(cfg, fp8.data(), ideal.data(), r.topk_idx.data(), c.tokens);
        int64_t differ = 0;
        for (size_t i = 0; i < x.size(); ++i) differ += exact[i] != fp8[i];
        const std::string what = describe(c, routing, seed, cfg) + " spread +-" + std::to_string(spread);
        std::printf("  %-80s exact %.3e  fp8 %.3e (%.4fx)  outputs differing %lld of %zu\n",
                    what.c_str(), e.diff, f.diff, f.diff / e.diff, static_cast<long long>(differ),
                    x.size());
        EXPECT_LE(f.diff, 1.5 * e.diff) << what;
        EXPECT_LE(f.worst_row_diff, 1.5 * e.worst_row_diff + 1e-4) << what;
        if (spread > 0) EXPECT_GT(differ, 0) << what << ": the rebasing must round somewhere";
      }
    }
  }
}

// Its row operations: exact while every group stays in E4M3's window, rounded below it.
TEST(Reference, Fp8ModeRowRebasingAndWeightFolding) {
  // A token row of two groups with codes 448 and 1.5 at scales 2^0 and 2^-gap: rebased to the
  // row's scale the second group's code becomes 1.5 x 2^-gap, exact for gap 3 (a normal E4M3),
  // below half of E4M3's smallest subnormal (2^-9) for gap 12: zero.
  std::vector<float> row(64);
  for (int gap : {3, 12}) {
    const uint8_t sf[2] = {static_cast<uint8_t>(127), static_cast<uint8_t>(127 - gap)};
    for (int c = 0; c < 32; ++c) row[c] = 448.0f;
    for (int c = 32; c < 64; ++c) row[c] = std::ldexp(1.5f, -gap);
    std::vector<float> out = row;
    fp8_mode_rebase_rows(out.data(), sf, 1, 64);
    EXPECT_EQ(out[0], 448.0f);
    if (gap == 3) EXPECT_EQ(out[40], row[40]) << "within the window: exact";
    else EXPECT_EQ(out[40], 0.0f) << "below the window: rounded to zero";
  }
  // Weights: E2M1 x 2^(s - 127); the fold keeps groups within 9 binades of the row's largest.
  std::vector<float> w(64);
  for (int gap : {9, 11}) {
    const uint8_t sf[2] = {static_cast<uint8_t>(120), static_cast<uint8_t>(120 - gap)};
    for (int c = 0; c < 32; ++c) w[c] = std::ldexp(6.0f, 120 - 127);
    for (int c = 32; c < 64; ++c) w[c] = std::ldexp(0.5f, 120 - gap - 127);
    std::vector<float> out = w;
    fp8_mode_fold_weights(out.data(), sf, 1, 64);
    EXPECT_EQ(out[0], w[0]);
    if (gap == 9) EXPECT_EQ(out[40], w[40]) << "0.5 x 2^-8 folded: E4M3's smallest subnormal";
    else EXPECT_EQ(out[40], 0.0f) << "0.5 x 2^-10 folded: below E4M3, rounded to zero";
  }
  // The per-call rule: FP8 from fp8_min_rows_per_expert routed rows per expert (T * K / E) on.
  LayerConfig cfg;
  cfg.shape = {1024, 512, 32, 4};
  cfg.precision = Precision::kFp8;
  EXPECT_FALSE(cfg.fp8_for_tokens(1023)) << "1023 * 4 / 32 < 128";
  EXPECT_TRUE(cfg.fp8_for_tokens(1024));
  cfg.fp8_min_rows_per_expert = 0;
  EXPECT_TRUE(cfg.fp8_for_tokens(1));
  cfg.precision = Precision::kExact;
  EXPECT_FALSE(cfg.fp8_for_tokens(1 << 20));
  cfg.fp8_min_rows_per_expert = -1;
  EXPECT_THROW(cfg.validate(), Error);
  EXPECT_EQ(parse_precision("fp8"), Precision::kFp8);
  EXPECT_STREQ(to_string(Precision::kExact), "exact");
  expect_error([] { (void)parse_precision("bf16"); }, ErrorCode::kInvalidArgument, "expected exact or fp8");
}

// ---------------------------------------------------------------------------------------------
// Stage by stage, against a direct transcription of numerics.md (plain loops, double sums).
// ---------------------------------------------------------------------------------------------
double e2m1_weight(const MoeWeights& w, const uint8_t* packed, const uint8_t* sf, int64_t row,
                   int64_t k, int64_t k_dim) {
  return static_cast<double>(e2m1_to_f32(e2m1_unpack(packed + row * (k_dim / 2), k))) *
         std::ldexp(1.0, sf[row * (k_dim / 32) + k / 32] - 127);
}

TEST(Reference, EveryStageFollowsTheContract) {
  for (const Case& c : scaled_cases()) {
    const LayerConfig cfg = make_config(c, /*fast_math=*/false);
    const int64_t T = 6, H = c.shape.hidden, I = c.shape.intermediate, K = c.shape.top_k;
    const MoeWeights w = synthetic_weights(cfg, 11, c.bias);
    Routing r = make_routing(RoutingKind::kUniform, T, c.shape.num_experts, K, 11);
    r.topk_idx[1 * K + 0] = -1;  // one empty slot
    const auto x = synthetic_activations(T, H, 11);
    std::vector<uint16_t> y(static_cast<size_t>(T * H));
    ReferenceTrace tr;
    reference_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y.data(), &tr);
    const std::string what = c.name;

    // Section 2: input quantization, bit for bit.
    std::vector<uint8_t> xq(static_cast<size_t>(T * H)), xsf(static_cast<size_t>(T * H / 32));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t g = 0; g < H / 32; ++g) {
        float amax = 0;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(bf16_to_f32(x[t * H + g * 32 + i])));
        amax = std::max(amax, 1e-4f);
        const int b = std::clamp(static_cast<int>(std::ceil(std::log2(static_cast<double>(amax / 448.0f)))) + 127, 1, 254);
        ASSERT_EQ(tr.x_sf[t * (H / 32) + g], b) << what << " token " << t << " group " << g;
        for (int i = 0; i < 32; ++i)
          ASSERT_EQ(tr.x_q[t * H + g * 32 + i],
                    e4m3_from_f32(bf16_to_f32(x[t * H + g * 32 + i]) * std::ldexp(1.0f, 127 - b)));
      }
    }

    const auto* w13 = w.w13.as<uint8_t>();
    const auto* w13_sf = w.w13_sf.as<uint8_t>();
    const auto* w2 = w.w2.as<uint8_t>();
    const auto* w2_sf = w.w2_sf.as<uint8_t>();
    int64_t checked_slots = 0;
    for (int64_t t = 0; t < T; ++t) {
      float y_sum[4096] = {};
      bool any = false;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t s = t * K + k;
        const int32_t e = r.topk_idx[s];
        if (e < 0) {
          for (int64_t n = 0; n < 2 * I; ++n) ASSERT_EQ(tr.l1_acc[s * 2 * I + n], 0.0f);
          continue;
        }
        any = true;
        ++checked_slots;
        // Section 3: L1 accumulators within the FP32 summation bound of exact products.
        for (int64_t n = 0; n < 2 * I; ++n) {
          double exact = 0, mag = 0;
          for (int64_t kk = 0; kk < H; ++kk) {
            const double xv = static_cast<double>(e4m3_to_f32(tr.x_q[t * H + kk])) *
                              std::ldexp(1.0, tr.x_sf[t * (H / 32) + kk / 32] - 127);
            const double p = xv * e2m1_weight(w, w13, w13_sf, e * 2 * I + n, kk, H);
            exact += p;
            mag += std::fabs(p);
          }
          if (w.has_bias()) exact += bf16_to_f32(w.w13_bias.as<uint16_t>()[e * 2 * I + n]);
          const double bound = H * std::ldexp(1.0, -24) * mag + std::ldexp(std::fabs(exact) + mag, -23) + 1e-30;
          ASSERT_LE(std::fabs(tr.l1_acc[s * 2 * I + n] - exact), bound)
              << what << " slot " << s << " channel " << n;
        }
        // Sections 4-5 from the reference's own accumulators, bit for bit.
        std::vector<float> v(static_cast<size_t>(I));
        for (int64_t j = 0; j < I; ++j) {
          const float g = bf16_round(tr.l1_acc[s * 2 * I + j]);
          const float u = bf16_round(tr.l1_acc[s * 2 * I + I + j]);
          v[j] = apply_activation(cfg.activation, g, u, false) * r.topk_weights[s];
        }
        for (int64_t g = 0; g < I / 32; ++g) {
          float amax = 0;
          for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[g * 32 + i]));
          const int b = amax == 0 ? 0 : static_cast<int>(std::ceil(std::log2(static_cast<double>(amax / 448.0f)))) + 127;
          ASSERT_EQ(tr.h_sf[s * (I / 32) + g], b) << what << " slot " << s << " group " << g;
          for (int i = 0; i < 32; ++i)
            ASSERT_EQ(tr.h_q[s * I + g * 32 + i], e4m3_from_f32(v[g * 32 + i] * std::ldexp(1.0f, 127 - b)))
                << what << " slot " << s << " j " << g * 32 + i;
        }
        // Section 6: per-slot L2 output within the bound plus one BF16 rounding.
        for (int64_t n = 0; n < H; ++n) {
          double exact = 0, mag = 0;
          for (int64_t j = 0; j < I; ++j) {
            const double hv = static_cast<double>(e4m3_to_f32(tr.h_q[s * I + j])) *
                              std::ldexp(1.0, tr.h_sf[s * (I / 32) + j / 32] - 127);
            const double p = hv * e2m1_weight(w, w2, w2_sf, e * H + n, j, I);
            exact += p;
            mag += std::fabs(p);
          }
          if (w.has_bias()) exact += r.topk_weights[s] * bf16_to_f32(w.w2_bias.as<uint16_t>()[e * H + n]);
          const double got = bf16_to_f32(tr.o[s * H + n]);
          const double bound = I * std::ldexp(1.0, -24) * mag + std::fabs(exact) * std::ldexp(1.0, -8) + 1e-30;
          ASSERT_LE(std::fabs(got - exact), bound) << what << " slot " << s << " n " << n;
          y_sum[n] += bf16_to_f32(tr.o[s * H + n]);  // combine: ascending k, FP32 from 0
        }
      }
      for (int64_t n = 0; n < H; ++n)
        ASSERT_EQ(y[t * H + n], any ? bf16_from_f32(y_sum[n]) : 0) << what << " token " << t << " n " << n;
    }
    EXPECT_EQ(checked_slots, T * K - 1) << what;

    // The quantized entry point and the L2-only entry point reproduce y bit for bit.
    std::vector<uint16_t> y2(y.size()), y3(y.size());
    reference_forward_quantized(cfg, w, tr.x_q.data(), tr.x_sf.data(), r.topk_idx.data(),
                                r.topk_weights.data(), T, y2.data());
    EXPECT_EQ(y2, y) << what;
    reference_l2_combine(cfg, w, tr.h_q.data(), tr.h_sf.data(), r.topk_idx.data(),
                         r.topk_weights.data(), T, y3.data());
    EXPECT_EQ(y3, y) << what;
    if (w.has_bias()) {
      EXPECT_THROW(reference_l2_combine(cfg, w, tr.h_q.data(), tr.h_sf.data(), r.topk_idx.data(),
                                        T, y3.data()),
                   Error)
          << "an L2 bias needs the routing weights";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Edge cases
// ---------------------------------------------------------------------------------------------
struct Small {
  LayerConfig cfg;
  MoeWeights w;
  Small() {
    cfg.shape = shape_preset("small");
    cfg.max_tokens_per_rank = 32;
    w = synthetic_weights(cfg, 3);
  }
};

TEST(Reference, ZeroTokens) {
  Small s;
  reference_forward(s.cfg, s.w, nullptr, nullptr, nullptr, 0, nullptr);
  ideal_forward(s.cfg, s.w, nullptr, nullptr, nullptr, 0, nullptr);
  const DiffReport rep = compare_output(s.cfg, nullptr, nullptr, nullptr, 0);
  EXPECT_EQ(rep.diff, 0.0);
  EXPECT_EQ(rep.worst_row, -1);
}

TEST(Reference, TokenWithoutValidSlotGivesZeros) {
  Small s;
  const int64_t T = 3, H = s.cfg.shape.hidden, K = s.cfg.shape.top_k;
  Routing r = make_routing(RoutingKind::kUniform, T, s.cfg.shape.num_experts, K, 5);
  for (int64_t k = 0; k < K; ++k) r.topk_idx[1 * K + k] = -1;
  for (int64_t k = 0; k < K; ++k) r.topk_weights[1 * K + k] = std::nanf("");  // ignored
  const auto x = synthetic_activations(T, H, 5);
  std::vector<uint16_t> y(static_cast<size_t>(T * H), 0xFFFF);
  std::vector<double> ideal(static_cast<size_t>(T * H), 1.0);
  reference_forward(s.cfg, s.w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y.data());
  ideal_forward(s.cfg, s.w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, ideal.data());
  int nonzero_other = 0;
  for (int64_t n = 0; n < H; ++n) {
    EXPECT_EQ(y[1 * H + n], 0) << "n " << n;
    EXPECT_EQ(ideal[1 * H + n], 0.0) << "n " << n;
    nonzero_other += (y[0 * H + n] != 0) + (y[2 * H + n] != 0);
  }
  EXPECT_GT(nonzero_other, H) << "the other tokens are computed";
}

TEST(Reference, RejectsBadExpertIds) {
  Small s;
  const int64_t T = 4, H = s.cfg.shape.hidden, K = s.cfg.shape.top_k, E = s.cfg.shape.num_experts;
  const auto x = synthetic_activations(T, H, 1);
  std::vector<uint16_t> y(static_cast<size_t>(T * H));
  for (int32_t bad : {static_cast<int32_t>(E), static_cast<int32_t>(E + 1000), -2, INT32_MIN}) {
    Routing r = make_routing(RoutingKind::kUniform, T, E, K, 1);
    r.topk_idx[3 * K + 1] = bad;
    SCOPED_TRACE(testing::Message() << "expert id " << bad);
    expect_error([&] {
      reference_forward(s.cfg, s.w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y.data());
    }, ErrorCode::kOutOfRange, "topk_idx[3, 1] = " + std::to_string(bad));
    std::vector<double> ideal(static_cast<size_t>(T * H));
    EXPECT_THROW(ideal_forward(s.cfg, s.w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T,
                               ideal.data()),
                 Error);
  }
}

TEST(Reference, RejectsTokensAboveCapacityAndMismatchedWeights) {
  Small s;
  const int64_t T = s.cfg.max_tokens_per_rank + 1, H = s.cfg.shape.hidden;
  const Routing r = make_routing(RoutingKind::kUniform, T, s.cfg.shape.num_experts, s.cfg.shape.top_k, 1);
  const auto x = synthetic_activations(T, H, 1);
  std::vector<uint16_t> y(static_cast<size_t>(T * H));
  expect_error([&] {
    reference_forward(s.cfg, s.w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y.data());
  }, ErrorCode::kOutOfRange, "max_tokens_per_rank = 32");
  // At capacity it runs.
  reference_forward(s.cfg, s.w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T - 1, y.data());

  LayerConfig other = s.cfg;
  other.shape.intermediate = 256;
  EXPECT_THROW(reference_forward(other, s.w, x.data(), r.topk_idx.data(), r.topk_weights.data(), 1,
                                 y.data()),
               Error);
  MoeWeights prepared = synthetic_weights(s.cfg, 3);
  prepared.layout = "sm90";
  EXPECT_THROW(reference_forward(s.cfg, prepared, x.data(), r.topk_idx.data(),
                                 r.topk_weights.data(), 1, y.data()),
               Error);
}

TEST(Reference, NonFiniteInputsStayInTheirToken) {
  Small s;
  const int64_t T = 4, H = s.cfg.shape.hidden;
  const Routing r = make_routing(RoutingKind::kUniform, T, s.cfg.shape.num_experts, s.cfg.shape.top_k, 9);
  auto x = synthetic_activations(T, H, 9);
  std::vector<uint16_t> y_clean(static_cast<size_t>(T * H)), y(static_cast<size_t>(T * H));
  reference_forward(s.cfg, s.w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y_clean.data());
  x[1 * H + 5] = bf16_from_f32(std::nanf(""));
  x[2 * H + 70] = bf16_from_f32(std::numeric_limits<float>::infinity());
  reference_forward(s.cfg, s.w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y.data());
  int nonfinite_1 = 0, nonfinite_2 = 0;
  for (int64_t n = 0; n < H; ++n) {
    EXPECT_EQ(y[0 * H + n], y_clean[0 * H + n]);
    EXPECT_EQ(y[3 * H + n], y_clean[3 * H + n]);
    nonfinite_1 += !std::isfinite(bf16_to_f32(y[1 * H + n]));
    nonfinite_2 += !std::isfinite(bf16_to_f32(y[2 * H + n]));
  }
  // Documented (docs/numerics.md): a NaN or Inf input reaches every L1 accumulator of its token,
  // so the token's whole output row is non-finite; other tokens are untouched.
  EXPECT_EQ(nonfinite_1, H);
  EXPECT_EQ(nonfinite_2, H);
}

// ---------------------------------------------------------------------------------------------
// Expert parallelism and determinism
// ---------------------------------------------------------------------------------------------
TEST(Reference, ExpertParallelRanksComputeTheirLocalSlots) {
  const Case c = scaled_cases()[1];  // deepseek-v3/8: E = 32
  const int64_t T = 40, H = c.shape.hidden, K = c.shape.top_k;
  const Routing r = make_routing(RoutingKind::kUniform, T, c.shape.num_experts, K, 21);
  const auto x = synthetic_activations(T, H, 21);
  const LayerConfig full = make_config(c);
  std::vector<uint16_t> y(static_cast<size_t>(T * H));
  ReferenceTrace tr_full;
  reference_forward(full, synthetic_weights(full, 21), x.data(), r.topk_idx.data(),
                    r.topk_weights.data(), T, y.data(), &tr_full);
  constexpr int kRanks = 4;
  std::vector<uint16_t> o_union(tr_full.o.size(), 0);
  for (int rank = 0; rank < kRanks; ++rank) {
    const LayerConfig cfg = make_config(c, true, kRanks, rank);
    const MoeWeights w = synthetic_weights(cfg, 21);
    ASSERT_EQ(w.first_expert, rank * c.shape.num_experts / kRanks);
    std::vector<uint16_t> y_rank(static_cast<size_t>(T * H));
    ReferenceTrace tr;
    reference_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T,
                      y_rank.data(), &tr);
    for (int64_t s = 0; s < T * K; ++s) {
      const bool local = r.topk_idx[s] / (c.shape.num_experts / kRanks) == rank;
      for (int64_t n = 0; n < H; ++n) {
        if (local) o_union[s * H + n] = tr.o[s * H + n];
        else ASSERT_EQ(tr.o[s * H + n], 0) << "rank " << rank << " computed a foreign slot " << s;
      }
    }
  }
  EXPECT_EQ(o_union, tr_full.o) << "each slot is computed identically by the rank owning it";
}

TEST(Reference, DeterministicAcrossThreadCounts) {
  const Case c = scaled_cases()[0];  // kimi-k3/8
  const LayerConfig cfg = make_config(c);
  const int64_t T = 40;
  const MoeWeights w = synthetic_weights(cfg, 4);
  const Routing r = make_routing(RoutingKind::kSkewed, T, c.shape.num_experts, c.shape.top_k, 4);
  const auto x = synthetic_activations(T, c.shape.hidden, 4);
  std::vector<uint16_t> y_ref;
  std::vector<double> ideal_ref;
  ReferenceTrace tr_ref;
  for (int threads : {1, 2, 3, 7}) {
    set_num_threads(threads);
    const MoeWeights w_t = synthetic_weights(cfg, 4);
    EXPECT_EQ(std::memcmp(w_t.w13.data(), w.w13.data(), static_cast<size_t>(w.w13.size())), 0);
    EXPECT_EQ(std::memcmp(w_t.w2_sf.data(), w.w2_sf.data(), static_cast<size_t>(w.w2_sf.size())), 0);
    std::vector<uint16_t> y(x.size());
    std::vector<double> ideal(x.size());
    ReferenceTrace tr;
    reference_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y.data(), &tr);
    ideal_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, ideal.data());
    if (y_ref.empty()) {
      y_ref = y;
      ideal_ref = ideal;
      tr_ref = tr;
      continue;
    }
    EXPECT_EQ(y, y_ref) << threads << " threads";
    EXPECT_EQ(ideal, ideal_ref) << threads << " threads";
    EXPECT_EQ(tr.l1_acc, tr_ref.l1_acc) << threads << " threads";
    EXPECT_EQ(tr.h_q, tr_ref.h_q) << threads << " threads";
  }
  set_num_threads(0);
}

TEST(Reference, VectorPathsAreBitIdentical) {
  // The AVX2 and SSE2 dot kernels follow one summation order: same bits for the layer and the ideal.
  const Case c = scaled_cases()[2];  // gpt-oss-120b/9: biases, swiglu_oai
  const LayerConfig cfg = make_config(c);
  const int64_t T = 24;
  const MoeWeights w = synthetic_weights(cfg, 6, c.bias);
  const Routing r = make_routing(RoutingKind::kUniform, T, c.shape.num_experts, c.shape.top_k, 6);
  const auto x = synthetic_activations(T, c.shape.hidden, 6);
  std::vector<uint16_t> y_auto(x.size()), y_base(x.size());
  std::vector<double> i_auto(x.size()), i_base(x.size());
  reference_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y_auto.data());
  ideal_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, i_auto.data());
  const bool has_avx2 = reference_detail::force_baseline_dot(true);
  reference_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y_base.data());
  ideal_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, i_base.data());
  reference_detail::force_baseline_dot(false);
  if (!has_avx2) GTEST_SKIP() << "this CPU has no AVX2: only the baseline path exists";
  EXPECT_EQ(y_auto, y_base);
  EXPECT_EQ(i_auto, i_base);
}

TEST(Reference, FastMathIsCloseToExact) {
  const Case c = scaled_cases()[0];
  const int64_t T = 32;
  const Routing r = make_routing(RoutingKind::kUniform, T, c.shape.num_experts, c.shape.top_k, 8);
  const auto x = synthetic_activations(T, c.shape.hidden, 8);
  std::vector<uint16_t> y_fast(x.size()), y_exact(x.size());
  const LayerConfig fast = make_config(c, true), exact = make_config(c, false);
  const MoeWeights w = synthetic_weights(fast, 8);
  reference_forward(fast, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y_fast.data());
  reference_forward(exact, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y_exact.data());
  std::vector<double> a(x.size()), b(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    a[i] = bf16_to_f32(y_fast[i]);
    b[i] = bf16_to_f32(y_exact[i]);
  }
  // fast_math changes exp by a few ulps, which can flip an FP8 code now and then.
  EXPECT_LT(diff_metric(a.data(), b.data(), static_cast<int64_t>(a.size())), 1e-4);
}

TEST(Reference, SmallShapeIsFast) {
  LayerConfig cfg;
  cfg.shape = shape_preset("small");
  const int64_t T = 256;
  const MoeWeights w = synthetic_weights(cfg, 1);
  const Routing r = make_routing(RoutingKind::kUniform, T, cfg.shape.num_experts, cfg.shape.top_k, 1);
  const auto x = synthetic_activations(T, cfg.shape.hidden, 1);
  std::vector<uint16_t> y(x.size());
  const auto t0 = std::chrono::steady_clock::now();
  reference_forward(cfg, w, x.data(), r.topk_idx.data(), r.topk_weights.data(), T, y.data());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  small shape, T=%lld, %d threads: %.3f s\n", static_cast<long long>(T),
              num_threads(), secs);
  // The requirement is "well under a second" on 2 cores; the bound leaves room for a loaded CI.
  EXPECT_LT(secs, 3.0);
}

TEST(Diff, Metric) {
  const double a[3] = {1, 2, 3}, b[3] = {1, 2, 3}, z[3] = {0, 0, 0}, n[3] = {-1, -2, -3};
  EXPECT_EQ(diff_metric(a, b, 3), 0.0);
  EXPECT_EQ(diff_metric(z, z, 3), 0.0);
  EXPECT_EQ(diff_metric(a, z, 3), 1.0);
  EXPECT_EQ(diff_metric(a, n, 3), 2.0);
  const double c[2] = {1, 0}, d[2] = {0, 1};
  EXPECT_EQ(diff_metric(c, d, 2), 1.0);
  const double e[1] = {2}, f[1] = {1};
  EXPECT_NEAR(diff_metric(e, f, 1), 1.0 - 4.0 / 5.0, 1e-15);
}

}  // namespace
}  // namespace megamoe
