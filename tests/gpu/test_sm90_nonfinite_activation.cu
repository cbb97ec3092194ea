// NaN and Inf inputs through the sm90 layer with every activation, the clamped ones included
// (the clamps used to turn NaN into the limit: docs/numerics.md, "The clamps keep NaN"). A token
// with a NaN input has every output NaN; the NaN positions of each poisoned token equal the CPU
// reference's; the other tokens are bitwise what they are without the poison.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/tensor.hpp"
#include "megamoe/weights.hpp"
#include "sm90_test_util.hpp"

namespace megamoe {
namespace {

constexpr int64_t kTokens = 16;
constexpr int64_t kNanToken = 3, kInfToken = 9;
constexpr uint64_t kSeed = 5;
const char* const kActivations[] = {"swiglu:clamp=7", "swiglu_oai", "swiglu", "situ"};

std::vector<uint16_t> run_sm90(MoeLayer& layer, const std::vector<uint16_t>& x,
                               const test::RoutingData& r, int64_t h, int64_t k) {
  test::DeviceArray<uint16_t> dx(x), dy(kTokens * h);
  test::DeviceArray<int32_t> didx(r.idx);
  test::DeviceArray<float> dw(r.weights);
  const Device dev = layer.device();
  layer.forward(TensorView::contiguous(dx.get(), DType::kBF16, {kTokens, h}, dev),
                TensorView::contiguous(didx.get(), DType::kI32, {kTokens, k}, dev),
                TensorView::contiguous(dw.get(), DType::kF32, {kTokens, k}, dev),
                TensorView::contiguous(dy.get(), DType::kBF16, {kTokens, h}, dev));
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  return dy.download();
}

TEST(Sm90NonFinite, EveryActivationKeepsNaNLikeTheReference) {
  MEGAMOE_REQUIRE_SM90();
  for (const char* spec : kActivations) {
    for (bool fast : {true, false}) {
      SCOPED_TRACE(std::string(spec) + (fast ? " fast_math" : " exact"));
      LayerConfig cfg;
      cfg.shape = shape_preset("small");
      cfg.max_tokens_per_rank = kTokens;
      cfg.activation = Activation::parse(spec);
      cfg.fast_math = fast;
      const bool bias = cfg.activation.kind == ActivationKind::kSwigluOai;
      const MoeWeights host = synthetic_weights(cfg, kSeed, bias);
      MoeLayer layer(cfg, host.to(Device::cpu()), "sm90");
      const int64_t h = cfg.shape.hidden, k = cfg.shape.top_k;
      const auto r = test::make_routing(test::Routing::kUniform, kTokens, cfg.shape.num_experts, k, kSeed);
      const std::vector<uint16_t> clean_x = test::make_inputs(kTokens, h, kSeed);
      std::vector<uint16_t> x = clean_x;
      x[kNanToken * h + 17] = bf16_from_f32(std::nanf(""));
      x[kInfToken * h + 300] = bf16_from_f32(INFINITY);

      const auto y = run_sm90(layer, x, r, h, k);
      const auto y_clean = run_sm90(layer, clean_x, r, h, k);
      std::vector<uint16_t> y_ref(y.size());
      reference_forward(cfg, host, x.data(), r.idx.data(), r.weights.data(), kTokens, y_ref.data());

      for (int64_t t = 0; t < kTokens; ++t) {
        int64_t nan_gpu = 0, nan_ref = 0, mismatched = 0, changed = 0;
        for (int64_t i = 0; i < h; ++i) {
          const bool a = std::isnan(bf16_to_f32(y[t * h + i]));
          const bool b = std::isnan(bf16_to_f32(y_ref[t * h + i]));
          nan_gpu += a;
          nan_ref += b;
          mismatched += a != b;
          changed += y[t * h + i] != y_clean[t * h + i];
        }
        if (t == kNanToken || t == kInfToken) {
          std::printf("[ nonfinite] %s%s token %lld: %lld NaN outputs on the GPU, %lld in the reference\n",
                      spec, fast ? " fast_math" : "", static_cast<long long>(t),
                      static_cast<long long>(nan_gpu), static_cast<long long>(nan_ref));
          EXPECT_EQ(mismatched, 0) << "token " << t << ": NaN positions differ from the reference";
        } else {
          EXPECT_EQ(changed, 0) << "token " << t << " changed by another token's NaN/Inf";
          EXPECT_EQ(nan_gpu, 0) << "token " << t;
        }
        if (t == kNanToken) {
          EXPECT_EQ(nan_gpu, h) << "a NaN input must make every output of its token NaN";
        }
      }
    }
  }
}

}  // namespace
}  // namespace megamoe
