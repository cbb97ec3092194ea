// MoeLayer: backend choice, tensor checks on every argument, and that the cpu backend is the
// reference.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/routing.hpp"
#include "test_util.hpp"

namespace megamoe {
namespace {

LayerConfig small_config(int64_t capacity = 64) {
  LayerConfig cfg;
  cfg.shape = shape_preset("small");
  cfg.activation = Activation::situ();
  cfg.max_tokens_per_rank = capacity;
  return cfg;
}

using megamoe::test::expect_error;

TEST(Layer, BackendsListCpuLast) {
  const auto names = available_backends();
  ASSERT_FALSE(names.empty());
  EXPECT_EQ(names.back(), "cpu");
  for (const auto& n : names) EXPECT_TRUE(n == "cpu" || n == "sm90") << n;
}

TEST(Layer, CpuBackendIsTheReference) {
  const LayerConfig cfg = small_config();
  const int64_t T = 20, H = cfg.shape.hidden, K = cfg.shape.top_k;
  MoeLayer layer(cfg, synthetic_weights(cfg, 2), "cpu");
  EXPECT_EQ(layer.backend(), "cpu");
  EXPECT_EQ(layer.device(), Device::cpu());
  EXPECT_EQ(layer.weights().layout, kCanonicalLayout);

  const Routing r = make_routing(RoutingKind::kUniform, T, cfg.shape.num_experts, K, 2);
  auto x = synthetic_activations(T, H, 2);
  std::vector<uint16_t> y(static_cast<size_t>(T * H)), y_ref(y.size());
  auto idx = r.topk_idx;
  auto w = r.topk_weights;
  layer.forward(TensorView::contiguous(x.data(), DType::kBF16, {T, H}),
                TensorView::contiguous(idx.data(), DType::kI32, {T, K}),
                TensorView::contiguous(w.data(), DType::kF32, {T, K}),
                TensorView::contiguous(y.data(), DType::kBF16, {T, H}));
  const MoeWeights weights = synthetic_weights(cfg, 2);
  reference_forward(cfg, weights, x.data(), idx.data(), w.data(), T, y_ref.data());
  EXPECT_EQ(y, y_ref);
  layer.check_errors();  // the cpu backend reports errors from forward: nothing pending

  // T = 0 is a valid call.
  layer.forward(TensorView::contiguous(nullptr, DType::kBF16, {0, H}),
                TensorView::contiguous(nullptr, DType::kI32, {0, K}),
                TensorView::contiguous(nullptr, DType::kF32, {0, K}),
                TensorView::contiguous(nullptr, DType::kBF16, {0, H}));

  // Moving the layer keeps it usable; the moved-from one reports its state.
  MoeLayer moved = std::move(layer);
  EXPECT_EQ(moved.backend(), "cpu");
  expect_error([&] { (void)layer.backend(); }, ErrorCode::kInvalidArgument, "moved from");
}

TEST(Layer, AutoPicksTheFirstAvailableBackend) {
  const LayerConfig cfg = small_config();
  MoeLayer layer(cfg, synthetic_weights(cfg, 1));
  EXPECT_EQ(layer.backend(), available_backends().front());
}

TEST(Layer, RejectsBadBackendsAndWeights) {
  const LayerConfig cfg = small_config();
  expect_error([&] { MoeLayer(cfg, synthetic_weights(cfg, 1), "tpu"); },
               ErrorCode::kInvalidArgument, "unknown backend 'tpu'");
  bool has_sm90 = false;
  for (const auto& n : available_backends()) has_sm90 |= n == "sm90";
  if (!has_sm90) {
    expect_error([&] { MoeLayer(cfg, synthetic_weights(cfg, 1), "sm90"); },
                 ErrorCode::kUnsupported, "backend sm90 cannot run here");
  }
  LayerConfig other = cfg;
  other.shape.hidden = 512;
  expect_error([&] { MoeLayer(other, synthetic_weights(cfg, 1), "cpu"); },
               ErrorCode::kInvalidArgument, "hidden 1024 does not match");
  MoeWeights prepared = synthetic_weights(cfg, 1);
  prepared.layout = "sm90";
  expect_error([&] { MoeLayer(cfg, std::move(prepared), "cpu"); }, ErrorCode::kInvalidArgument,
               "layout, got 'sm90'");
  LayerConfig bad = cfg;
  bad.ep_size = 3;
  expect_error([&] { MoeLayer(bad, synthetic_weights(cfg, 1), "cpu"); },
               ErrorCode::kInvalidArgument, "ep_size 3 must divide num_experts 32");
}

TEST(Layer, ChecksEveryTensor) {
  const LayerConfig cfg = small_config(/*capacity=*/8);
  const int64_t H = cfg.shape.hidden, K = cfg.shape.top_k, T = 4;
  MoeLayer layer(cfg, synthetic_weights(cfg, 1), "cpu");
  std::vector<uint16_t> x(static_cast<size_t>(16 * H)), y(static_cast<size_t>(16 * H));
  std::vector<int32_t> idx(static_cast<size_t>(16 * K), 0);
  std::vector<float> w(static_cast<size_t>(16 * K), 0.25f);
  auto X = [&](int64_t t) { return TensorView::contiguous(x.data(), DType::kBF16, {t, H}); };
  auto I = [&](int64_t t) { return TensorView::contiguous(idx.data(), DType::kI32, {t, K}); };
  auto W = [&](int64_t t) { return TensorView::contiguous(w.data(), DType::kF32, {t, K}); };
  auto Y = [&](int64_t t) { return TensorView::contiguous(y.data(), DType::kBF16, {t, H}); };
  layer.forward(X(T), I(T), W(T), Y(T));

  expect_error([&] { layer.forward(TensorView::contiguous(x.data(), DType::kF32, {T, H}), I(T), W(T), Y(T)); },
               ErrorCode::kInvalidArgument, "x: expected dtype bfloat16, got float32");
  expect_error([&] { layer.forward(TensorView::contiguous(x.data(), DType::kBF16, {T, H / 2}), I(T), W(T), Y(T)); },
               ErrorCode::kInvalidArgument, "x: expected shape [*, 1024], got [4, 512]");
  expect_error([&] { layer.forward(X(T), I(T - 1), W(T), Y(T)); }, ErrorCode::kInvalidArgument,
               "topk_idx: expected shape [4, 4], got [3, 4]");
  expect_error([&] { layer.forward(X(T), TensorView::contiguous(idx.data(), DType::kF32, {T, K}), W(T), Y(T)); },
               ErrorCode::kInvalidArgument, "topk_idx: expected dtype int32");
  expect_error([&] { layer.forward(X(T), I(T), TensorView::contiguous(w.data(), DType::kF32, {T, K + 1}), Y(T)); },
               ErrorCode::kInvalidArgument, "topk_weights: expected shape");
  expect_error([&] { layer.forward(X(T), I(T), W(T), Y(T + 1)); }, ErrorCode::kInvalidArgument,
               "y: expected shape");
  TensorView strided = X(T);
  strided.strides[0] = 2 * H;
  expect_error([&] { layer.forward(strided, I(T), W(T), Y(T)); }, ErrorCode::kInvalidArgument,
               "x: expected a contiguous");
  expect_error([&] { layer.forward(TensorView::contiguous(x.data(), DType::kBF16, {T, H}, Device::cuda(0)), I(T), W(T), Y(T)); },
               ErrorCode::kInvalidArgument, "x: expected a tensor on cpu, got one on cuda:0");
  expect_error([&] { layer.forward(X(T), I(T), W(T), TensorView::contiguous(nullptr, DType::kBF16, {T, H})); },
               ErrorCode::kInvalidArgument, "y: null data pointer");
  expect_error([&] { layer.forward(X(9), I(9), W(9), Y(9)); }, ErrorCode::kOutOfRange,
               "num_tokens 9 exceeds the layer capacity max_tokens_per_rank = 8");
  idx[2 * K + 3] = 32;
  expect_error([&] { layer.forward(X(T), I(T), W(T), Y(T)); }, ErrorCode::kOutOfRange,
               "topk_idx[2, 3] = 32");
}

}  // namespace
}  // namespace megamoe
