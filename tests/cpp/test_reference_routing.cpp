// Synthetic workloads (routing, activations, weights), the sigmoid top-k router and the layer
// configuration presets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/routing.hpp"
#include "megamoe/weights.hpp"
#include "test_util.hpp"

namespace megamoe {
namespace {

using test::expect_error;

TEST(Routing, EveryKindIsValidAndDeterministic) {
  const int64_t T = 300, E = 64, K = 6;
  for (RoutingKind kind : {RoutingKind::kUniform, RoutingKind::kSkewed, RoutingKind::kAdversarial}) {
    const Routing r = make_routing(kind, T, E, K, 42);
    ASSERT_EQ(r.topk_idx.size(), static_cast<size_t>(T * K));
    for (int64_t t = 0; t < T; ++t) {
      std::set<int32_t> seen;
      float sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = r.topk_idx[t * K + k];
        ASSERT_GE(e, 0);
        ASSERT_LT(e, E);
        ASSERT_TRUE(seen.insert(e).second) << routing_kind_name(kind) << ": repeated expert in token " << t;
        ASSERT_GT(r.topk_weights[t * K + k], 0.0f);
        sum += r.topk_weights[t * K + k];
      }
      ASSERT_NEAR(sum, 1.0f, 1e-5f);
    }
    const Routing again = make_routing(kind, T, E, K, 42);
    EXPECT_EQ(again.topk_idx, r.topk_idx);
    EXPECT_EQ(again.topk_weights, r.topk_weights);
    const Routing prefix = make_routing(kind, 10, E, K, 42);
    EXPECT_TRUE(std::equal(prefix.topk_idx.begin(), prefix.topk_idx.end(), r.topk_idx.begin()))
        << "token t does not depend on T";
    const Routing other = make_routing(kind, T, E, K, 43);
    EXPECT_NE(other.topk_weights, r.topk_weights);
    EXPECT_EQ(parse_routing_kind(routing_kind_name(kind)), kind);
  }
}

TEST(Routing, DistributionsHaveTheirShape) {
  const int64_t T = 4000, E = 32, K = 4;
  auto counts = [&](RoutingKind kind) {
    const Routing r = make_routing(kind, T, E, K, 1);
    std::vector<int64_t> c(E, 0);
    for (int32_t e : r.topk_idx) ++c[e];
    std::sort(c.begin(), c.end());
    return c;
  };
  const auto uniform = counts(RoutingKind::kUniform);
  const double mean = static_cast<double>(T * K) / E;
  EXPECT_GT(uniform.front(), 0.8 * mean);
  EXPECT_LT(uniform.back(), 1.2 * mean);
  const auto skewed = counts(RoutingKind::kSkewed);
  EXPECT_GT(skewed.back(), 2.5 * mean) << "the hottest expert of Zipf(1.2)";
  EXPECT_LT(skewed.front(), 0.6 * mean);
  const auto adversarial = counts(RoutingKind::kAdversarial);
  EXPECT_EQ(adversarial.back(), T);
  EXPECT_EQ(std::count(adversarial.begin(), adversarial.end(), T), K);
  EXPECT_EQ(std::count(adversarial.begin(), adversarial.end(), 0), E - K);
}

TEST(Routing, RejectsBadArguments) {
  EXPECT_THROW(make_routing(RoutingKind::kUniform, 4, 8, 9, 0), Error);
  EXPECT_THROW(make_routing(RoutingKind::kUniform, 4, 8, 0, 0), Error);
  EXPECT_THROW(make_routing(RoutingKind::kUniform, -1, 8, 2, 0), Error);
  expect_error([&] { parse_routing_kind("zipf"); }, ErrorCode::kInvalidArgument,
               "expected uniform, skewed or adversarial");
  // K = E works (every expert once per token).
  const Routing all = make_routing(RoutingKind::kSkewed, 3, 8, 8, 0);
  for (int t = 0; t < 3; ++t) {
    std::set<int32_t> s(all.topk_idx.begin() + t * 8, all.topk_idx.begin() + t * 8 + 8);
    EXPECT_EQ(s.size(), 8u);
  }
}

TEST(Router, SigmoidTopkWithCorrectionBias) {
  // One token, 6 experts. Scores s = sigmoid(logit); the bias changes the choice, not the weights.
  const float logits[6] = {2.0f, 1.0f, 0.0f, -1.0f, 3.0f, 0.5f};
  const float bias[6] = {0.0f, 0.0f, 0.9f, 0.0f, 0.0f, 0.0f};
  int32_t idx[3];
  float w[3];
  route_sigmoid_topk(logits, bias, 1, 6, 3, 2.5f, idx, w);
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  // choice: 0.881, 0.731, 0.5 + 0.9 = 1.4, 0.269, 0.953, 0.622 -> experts 2, 4, 0.
  EXPECT_EQ(idx[0], 2);
  EXPECT_EQ(idx[1], 4);
  EXPECT_EQ(idx[2], 0);
  const double sum = sig(0.0) + sig(3.0) + sig(2.0);
  EXPECT_NEAR(w[0], sig(0.0) / sum * 2.5, 1e-6);
  EXPECT_NEAR(w[1], sig(3.0) / sum * 2.5, 1e-6);
  EXPECT_NEAR(w[2], sig(2.0) / sum * 2.5, 1e-6);

  // Without bias: 4, 0, 1. Ties go to the lower expert id.
  route_sigmoid_topk(logits, nullptr, 1, 6, 3, 1.0f, idx, w);
  EXPECT_EQ(idx[0], 4);
  EXPECT_EQ(idx[1], 0);
  EXPECT_EQ(idx[2], 1);
  const float tied[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  int32_t idx2[2];
  float w2[2];
  route_sigmoid_topk(tied, nullptr, 1, 4, 2, 1.0f, idx2, w2);
  EXPECT_EQ(idx2[0], 0);
  EXPECT_EQ(idx2[1], 1);
  EXPECT_FLOAT_EQ(w2[0], 0.5f);

  float bad[6] = {0, 0, std::nanf(""), 0, 0, 0};
  try {
    route_sigmoid_topk(bad, nullptr, 1, 6, 2, 1.0f, idx, w);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("logits[0, 2] is not finite"), std::string::npos) << e.what();
  }
  EXPECT_THROW(route_sigmoid_topk(logits, nullptr, 1, 6, 7, 1.0f, idx, w), Error);
}

TEST(Synthetic, ActivationsAreDeterministicNormals) {
  const auto a = synthetic_activations(16, 256, 3);
  const auto b = synthetic_activations(4, 256, 3);
  EXPECT_TRUE(std::equal(b.begin(), b.end(), a.begin()));
  double sum = 0, sq = 0;
  for (uint16_t v : a) {
    sum += bf16_to_f32(v);
    sq += bf16_to_f32(v) * bf16_to_f32(v);
  }
  const double n = static_cast<double>(a.size());
  EXPECT_NEAR(sum / n, 0.0, 0.1);
  EXPECT_NEAR(sq / n, 1.0, 0.1);
}

TEST(Synthetic, WeightsAreCanonicalAndIndependentOfTheEpSplit) {
  LayerConfig full;
  full.shape = {256, 128, 16, 2};
  const MoeWeights wf = synthetic_weights(full, 9, /*with_bias=*/true);
  wf.validate_canonical();
  wf.check_matches(full);
  EXPECT_TRUE(wf.has_bias());
  EXPECT_EQ(wf.total_bytes(), wf.w13_bytes() + wf.w13_sf_bytes() + wf.w2_bytes() + wf.w2_sf_bytes() +
                                  16 * 2 * 128 * 2 + 16 * 256 * 2);
  // Scales around 2^-round(log2(sqrt(K))): H = 256 -> 2^-4 (byte 123), I = 128 -> 2^-4 (byte 123).
  for (int64_t i = 0; i < wf.w13_sf.size(); ++i) {
    const int b = wf.w13_sf.as<uint8_t>()[i];
    ASSERT_TRUE(b >= 122 && b <= 124) << b;
  }
  for (int64_t i = 0; i < wf.w2_sf.size(); ++i) {
    const int b = wf.w2_sf.as<uint8_t>()[i];
    ASSERT_TRUE(b >= 122 && b <= 124) << b;
  }
  LayerConfig rank = full;
  rank.ep_size = 4;
  rank.ep_rank = 2;
  const MoeWeights wr = synthetic_weights(rank, 9, true);
  EXPECT_EQ(wr.first_expert, 8);
  EXPECT_EQ(wr.num_local_experts, 4);
  const int64_t per = wf.w13_bytes() / 16;
  EXPECT_EQ(std::memcmp(wr.w13.data(), wf.w13.as<uint8_t>() + 8 * per, static_cast<size_t>(4 * per)), 0);
  const int64_t per2 = wf.w2_sf_bytes() / 16;
  EXPECT_EQ(std::memcmp(wr.w2_sf.data(), wf.w2_sf.as<uint8_t>() + 8 * per2, static_cast<size_t>(4 * per2)), 0);
  const MoeWeights other_seed = synthetic_weights(full, 10);
  EXPECT_NE(std::memcmp(other_seed.w13.data(), wf.w13.data(), static_cast<size_t>(wf.w13.size())), 0);
}

TEST(Weights, ValidationNamesTheProblem) {
  LayerConfig cfg;
  cfg.shape = {64, 64, 4, 2};
  MoeWeights w = MoeWeights::allocate(4, 0, 64, 64, false);
  w.validate_canonical();
  w.w2_sf.shrink(w.w2_sf.size() - 1);
  try {
    w.validate_canonical();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFormat);
    EXPECT_NE(std::string(e.what()).find("w2_sf expected 512 bytes"), std::string::npos) << e.what();
  }
  EXPECT_THROW(MoeWeights::allocate(4, 0, 48, 64, false), Error);
  EXPECT_THROW(MoeWeights::allocate(0, 0, 64, 64, false), Error);
  MoeWeights ok = MoeWeights::allocate(2, 2, 64, 64, false);
  cfg.ep_size = 2;
  cfg.ep_rank = 0;
  try {
    ok.check_matches(cfg);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("first_expert 2 does not match"), std::string::npos) << e.what();
  }
  cfg.ep_rank = 1;
  ok.check_matches(cfg);
}

TEST(Config, PresetsAndValidation) {
  const LayerShape k3 = shape_preset("kimi-k3");
  EXPECT_EQ(k3.hidden, 3584);
  EXPECT_EQ(k3.intermediate, 3072);
  EXPECT_EQ(k3.num_experts, 896);
  EXPECT_EQ(k3.top_k, 16);
  EXPECT_EQ(shape_preset("deepseek-v3").hidden, 7168);
  EXPECT_EQ(shape_preset("gpt-oss-120b").intermediate, 2880);
  EXPECT_EQ(shape_preset("small").num_experts, 32);
  EXPECT_EQ(activation_preset("kimi-k3").to_string(), "situ:beta=4,linear_beta=25");
  EXPECT_EQ(activation_preset("gpt-oss-120b").to_string(), "swiglu_oai:alpha=1.702,clamp=7");
  EXPECT_EQ(activation_preset("deepseek-v3").to_string(), "swiglu");
  EXPECT_EQ(shape_preset_names().size(), 4u);
  for (const auto& n : shape_preset_names()) shape_preset(n).validate();
  try {
    shape_preset("llama");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown preset 'llama' (expected one of kimi-k3, "
                                         "deepseek-v3, gpt-oss-120b, small)"),
              std::string::npos)
        << e.what();
  }
  LayerConfig cfg;
  cfg.shape = k3;
  cfg.ep_size = 8;
  cfg.ep_rank = 7;
  cfg.validate();
  EXPECT_EQ(cfg.num_local_experts(), 112);
  EXPECT_EQ(cfg.first_local_expert(), 784);
  cfg.ep_rank = 8;
  EXPECT_THROW(cfg.validate(), Error);
  cfg.ep_rank = 0;
  // The dispatch and the combine inside the MegaMoE kernel need the kernel.
  for (bool Sm90Options::*option : {&Sm90Options::mega_dispatch, &Sm90Options::mega_combine}) {
    const std::string name = option == &Sm90Options::mega_dispatch ? "sm90.mega_dispatch"
                                                                   : "sm90.mega_combine";
    cfg.sm90 = Sm90Options{};
    cfg.sm90.*option = true;
    try {
      cfg.validate();
      FAIL() << name << " without mega_kernel accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
    cfg.sm90.mega_kernel = true;
    cfg.validate();
  }
  cfg.sm90 = Sm90Options{};
  cfg.ep_size = 5;  // does not divide 896
  EXPECT_THROW(cfg.validate(), Error);
  cfg.ep_size = 1;
  cfg.max_tokens_per_rank = -1;
  EXPECT_THROW(cfg.validate(), Error);
  LayerShape bad = k3;
  bad.hidden = 3583;
  EXPECT_THROW(bad.validate(), Error);
  bad = k3;
  bad.top_k = 897;
  EXPECT_THROW(bad.validate(), Error);
  EXPECT_EQ(k3.to_string(), "H=3584 I=3072 E=896 K=16");
}

}  // namespace
}  // namespace megamoe
