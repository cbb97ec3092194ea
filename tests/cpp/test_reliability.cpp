// Bad inputs to the C++ API (docs/reliability.md, rows A*): every rejected call throws the
// specific megamoe::Error (code + message fragment) and writes nothing; every accepted odd input
// (NaN/Inf, NaN scales, empty slots, T = 0) has its documented result; and no call writes outside
// its output (guard regions around y, tests/cpp/reliability_util.hpp).
//
// Shape: a tiny layer (H 128, I 64, E 8, K 4) so the whole file runs in well under a second, also
// under ASan/UBSan (tests/sanitize.sh).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpp/reliability_util.hpp"
#include "megamoe/activation.hpp"
#include "megamoe/config.hpp"
#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/prepare.hpp"
#include "megamoe/quantize.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/routing.hpp"
#include "megamoe/tensor.hpp"
#include "megamoe/weights.hpp"

namespace megamoe {
namespace {

using test::expect_error;
using test::Guarded;

constexpr int64_t kH = 128, kI = 64, kE = 8, kK = 4;
constexpr int64_t kCapacity = 16;
constexpr int64_t kTokens = 6;
constexpr uint64_t kSeed = 7;
constexpr uint8_t kUe8m0NaN = 0xFF;
constexpr uint16_t kBf16NaN = 0x7FC0, kBf16Inf = 0x7F80, kBf16NegInf = 0xFF80;

LayerConfig tiny_config(Activation act = Activation::swiglu()) {
  LayerConfig cfg;
  cfg.shape = {kH, kI, kE, kK};
  cfg.max_tokens_per_rank = kCapacity;
  cfg.activation = act;
  return cfg;
}

bool is_bf16_nan(uint16_t v) { return (v & 0x7F80) == 0x7F80 && (v & 0x7F) != 0; }

// One call's inputs (exact-size vectors) and a guarded output.
struct Call {
  int64_t t;
  std::vector<uint16_t> x;
  std::vector<int32_t> idx;
  std::vector<float> w;
  Guarded<uint16_t> y;
  explicit Call(int64_t tokens, uint64_t seed = kSeed)
      : t(tokens), x(synthetic_activations(tokens, kH, seed)), y(tokens * kH) {
    const Routing r = make_routing(RoutingKind::kUniform, tokens, kE, kK, seed);
    idx = r.topk_idx;
    w = r.topk_weights;
  }
  TensorView X() { return TensorView::contiguous(x.data(), DType::kBF16, {t, kH}); }
  TensorView I() { return TensorView::contiguous(idx.data(), DType::kI32, {t, kK}); }
  TensorView W() { return TensorView::contiguous(w.data(), DType::kF32, {t, kK}); }
  TensorView Y() { return TensorView::contiguous(y.data(), DType::kBF16, {t, kH}); }
  void run(MoeLayer& layer) { layer.forward(X(), I(), W(), Y()); }
};

// A rejected forward: the specific error, nothing written into y, guards intact.
template <typename F>
void expect_rejected(Call& c, F&& fn, ErrorCode code, const std::string& fragment) {
  c.y.reset();
  expect_error(fn, code, fragment);
  EXPECT_TRUE(c.y.body_untouched()) << "a rejected call wrote into y (" << fragment << ")";
  EXPECT_TRUE(c.y.guards_intact()) << c.y.guard_damage() << " (" << fragment << ")";
}

// ---------------------------------------------------------------------------------------------
// A1-A14: tensor arguments of MoeLayer::forward
// ---------------------------------------------------------------------------------------------
TEST(Reliability, ForwardRejectsBadTensorsAndWritesNothing) {
  MoeLayer layer(tiny_config(), synthetic_weights(tiny_config(), kSeed), "cpu");
  Call c(kTokens);
  const int64_t t = c.t;
  auto ok = [&] { c.run(layer); };
  // The same call with good arguments writes y in full and nothing outside it.
  c.y.reset();
  ok();
  EXPECT_TRUE(c.y.guards_intact()) << c.y.guard_damage();
  EXPECT_FALSE(c.y.body_untouched());

  const ErrorCode kArg = ErrorCode::kInvalidArgument;
  // A1 dtype of each argument.
  expect_rejected(c, [&] { layer.forward(TensorView::contiguous(c.x.data(), DType::kF32, {t, kH / 2}), c.I(), c.W(), c.Y()); },
                  kArg, "x: expected dtype bfloat16, got float32");
  expect_rejected(c, [&] { layer.forward(c.X(), TensorView::contiguous(c.idx.data(), DType::kF32, {t, kK}), c.W(), c.Y()); },
                  kArg, "topk_idx: expected dtype int32, got float32");
  expect_rejected(c, [&] { layer.forward(c.X(), c.I(), TensorView::contiguous(c.w.data(), DType::kI32, {t, kK}), c.Y()); },
                  kArg, "topk_weights: expected dtype float32, got int32");
  expect_rejected(c, [&] { layer.forward(c.X(), c.I(), c.W(), TensorView::contiguous(c.y.data(), DType::kU8, {t, kH})); },
                  kArg, "y: expected dtype bfloat16, got uint8");
  // A2 shapes: wrong H, wrong K, wrong T between arguments, wrong rank (1-D and 3-D).
  expect_rejected(c, [&] { layer.forward(TensorView::contiguous(c.x.data(), DType::kBF16, {2 * t, kH / 2}), c.I(), c.W(), c.Y()); },
                  kArg, "x: expected shape [*, 128], got [12, 64]");
  expect_rejected(c, [&] { layer.forward(c.X(), TensorView::contiguous(c.idx.data(), DType::kI32, {2 * t, kK / 2}), c.W(), c.Y()); },
                  kArg, "topk_idx: expected shape [6, 4], got [12, 2]");
  expect_rejected(c, [&] { layer.forward(c.X(), c.I(), TensorView::contiguous(c.w.data(), DType::kF32, {t - 1, kK}), c.Y()); },
                  kArg, "topk_weights: expected shape [6, 4], got [5, 4]");
  expect_rejected(c, [&] { layer.forward(TensorView::contiguous(c.x.data(), DType::kBF16, {t * kH}), c.I(), c.W(), c.Y()); },
                  kArg, "x: expected shape [*, 128], got [768]");
  expect_rejected(c, [&] { layer.forward(c.X(), c.I(), c.W(), TensorView::contiguous(c.y.data(), DType::kBF16, {1, t, kH})); },
                  kArg, "y: expected shape [6, 128], got [1, 6, 128]");
  // A3 a y smaller than x (the classic overflow): rejected by shape, not written.
  expect_rejected(c, [&] { layer.forward(c.X(), c.I(), c.W(), TensorView::contiguous(c.y.data(), DType::kBF16, {t - 1, kH})); },
                  kArg, "y: expected shape [6, 128], got [5, 128]");
  // A4 strides: row-padded x, transposed y, broadcast (stride 0) weights.
  {
    TensorView v = c.X();
    v.strides[0] = 2 * kH;
    expect_rejected(c, [&] { layer.forward(v, c.I(), c.W(), c.Y()); }, kArg,
                    "x: expected a contiguous (row-major) tensor, got strides [256, 1]");
    TensorView yt = c.Y();
    yt.strides[0] = 1;
    yt.strides[1] = t;
    expect_rejected(c, [&] { layer.forward(c.X(), c.I(), c.W(), yt); }, kArg,
                    "y: expected a contiguous (row-major) tensor, got strides [1, 6]");
    TensorView wb = c.W();
    wb.strides[0] = 0;
    expect_rejected(c, [&] { layer.forward(c.X(), c.I(), wb, c.Y()); }, kArg,
                    "topk_weights: expected a contiguous (row-major) tensor, got strides [0, 1]");
  }
  // A5 device: a tensor that claims to be on a GPU given to the CPU layer (never dereferenced).
  expect_rejected(c, [&] { layer.forward(TensorView::contiguous(c.x.data(), DType::kBF16, {t, kH}, Device::cuda(0)), c.I(), c.W(), c.Y()); },
                  kArg, "x: expected a tensor on cpu, got one on cuda:0");
  expect_rejected(c, [&] { layer.forward(c.X(), c.I(), c.W(), TensorView::contiguous(c.y.data(), DType::kBF16, {t, kH}, Device::cuda(1))); },
                  kArg, "y: expected a tensor on cpu, got one on cuda:1");
  // A6 null data with elements; negative extents.
  expect_rejected(c, [&] { layer.forward(c.X(), TensorView::contiguous(nullptr, DType::kI32, {t, kK}), c.W(), c.Y()); },
                  kArg, "topk_idx: null data pointer");
  expect_rejected(c, [&] { layer.forward(TensorView::contiguous(c.x.data(), DType::kBF16, {-3, kH}), c.I(), c.W(), c.Y()); },
                  kArg, "x: negative extent in dim 0");
  // A7 a hand-built view whose ndim is outside [0, 4].
  {
    TensorView v = c.X();
    v.ndim = 7;
    expect_rejected(c, [&] { layer.forward(v, c.I(), c.W(), c.Y()); }, kArg,
                    "x: expected a view with 0..4 dims, got ndim 7");
    v.ndim = -1;
    expect_rejected(c, [&] { layer.forward(v, c.I(), c.W(), c.Y()); }, kArg,
                    "x: expected a view with 0..4 dims, got ndim -1");
  }
  // A8 corrupt token counts: a byte size that overflows int64, and a huge but countable T (caught
  // by the capacity check before any pointer is touched).
  for (const int64_t huge : {int64_t{1} << 60, int64_t{1} << 40}) {
    auto call = [&] {
      layer.forward(TensorView::contiguous(c.x.data(), DType::kBF16, {huge, kH}),
                    TensorView::contiguous(c.idx.data(), DType::kI32, {huge, kK}),
                    TensorView::contiguous(c.w.data(), DType::kF32, {huge, kK}),
                    TensorView::contiguous(c.y.data(), DType::kBF16, {huge, kH}));
    };
    if (huge == int64_t{1} << 60) {
      expect_rejected(c, call, kArg,
                      "x: shape [1152921504606846976, 128] has more bytes than int64 can count");
    } else {
      expect_rejected(c, call, ErrorCode::kOutOfRange,
                      "num_tokens 1099511627776 exceeds the layer capacity max_tokens_per_rank = 16");
    }
  }
}

// A9 capacity: T > max_tokens_per_rank is an error, never a silent drop; T == capacity works.
TEST(Reliability, CapacityOverflowIsAnErrorNotADrop) {
  MoeLayer layer(tiny_config(), synthetic_weights(tiny_config(), kSeed), "cpu");
  Call over(kCapacity + 1);
  expect_rejected(over, [&] { over.run(layer); }, ErrorCode::kOutOfRange,
                  "num_tokens 17 exceeds the layer capacity max_tokens_per_rank = 16");
  Call full(kCapacity);
  full.run(layer);
  EXPECT_TRUE(full.y.guards_intact()) << full.y.guard_damage();
  // The reference entry point checks the same.
  const MoeWeights w = synthetic_weights(tiny_config(), kSeed);
  expect_rejected(over, [&] {
    reference_forward(tiny_config(), w, over.x.data(), over.idx.data(), over.w.data(), over.t, over.y.data());
  }, ErrorCode::kOutOfRange, "reference_forward: num_tokens 17 exceeds the layer capacity");
  expect_rejected(over, [&] {
    reference_forward(tiny_config(), w, over.x.data(), over.idx.data(), over.w.data(), -1, over.y.data());
  }, ErrorCode::kInvalidArgument, "reference_forward: num_tokens must be >= 0, got -1");
}

// A10 expert ids: >= E, < -1 (including INT32_MIN/MAX) are reported naming token and slot, before
// anything is written; -1 is an empty slot.
TEST(Reliability, ExpertIdsOutOfRangeAreReportedBeforeAnyWrite) {
  MoeLayer layer(tiny_config(), synthetic_weights(tiny_config(), kSeed), "cpu");
  const int32_t bad_ids[] = {kE, kE + 1, 1 << 20, std::numeric_limits<int32_t>::max(), -2,
                             -100, std::numeric_limits<int32_t>::min()};
  for (int32_t bad : bad_ids) {
    Call c(kTokens);
    c.idx[4 * kK + 2] = bad;
    expect_rejected(c, [&] { c.run(layer); }, ErrorCode::kOutOfRange,
                    "topk_idx[4, 2] = " + std::to_string(bad) + " is not an expert id in [0, 8)");
  }
  // The last slot of the last token too (an off-by-one in a scan would miss it).
  Call c(kTokens);
  c.idx.back() = kE;
  expect_rejected(c, [&] { c.run(layer); }, ErrorCode::kOutOfRange, "topk_idx[5, 3] = 8");
}

// A11 empty slots: all -1 gives zeros; T = 0 with null pointers is a valid call.
TEST(Reliability, EmptySlotsAndZeroTokens) {
  MoeLayer layer(tiny_config(), synthetic_weights(tiny_config(), kSeed), "cpu");
  Call c(kTokens);
  for (int64_t k = 0; k < kK; ++k) c.idx[2 * kK + k] = -1;
  c.w[2 * kK + 1] = std::numeric_limits<float>::quiet_NaN();  // weights of empty slots are ignored
  c.run(layer);
  const auto y = c.y.body();
  for (int64_t j = 0; j < kH; ++j) ASSERT_EQ(y[2 * kH + j], 0) << "column " << j;
  EXPECT_TRUE(c.y.guards_intact()) << c.y.guard_damage();
  layer.forward(TensorView::contiguous(nullptr, DType::kBF16, {0, kH}),
                TensorView::contiguous(nullptr, DType::kI32, {0, kK}),
                TensorView::contiguous(nullptr, DType::kF32, {0, kK}),
                TensorView::contiguous(nullptr, DType::kBF16, {0, kH}));
  // Empty arrays exported by numpy/DLPack carry arbitrary strides (e.g. [0, 0]): still valid.
  TensorView ex = TensorView::contiguous(nullptr, DType::kBF16, {0, kH});
  ex.strides[0] = ex.strides[1] = 0;
  layer.forward(ex, TensorView::contiguous(nullptr, DType::kI32, {0, kK}),
                TensorView::contiguous(nullptr, DType::kF32, {0, kK}), ex);
}

// A12-A14 non-finite values. Documented behaviour (numerics.md section 7): a NaN in x makes every
// output of that token NaN (the NaN E4M3 code enters every L1 dot product); +-Inf saturates to
// +-448 times the group's clamped scale 2^127, which overflows FP32 when dequantized, so the token's
// outputs are non-finite too; NaN or Inf routing weights poison their token only; a NaN UE8M0
// weight scale (0xFF) poisons exactly the tokens routed to that expert. Other tokens are bitwise
// unchanged (tokens are independent), and nothing crashes.
// Every activation, the clamped ones included (their clamps used to turn NaN into the limit).
class NonFinite : public ::testing::TestWithParam<const char*> {};

TEST_P(NonFinite, InputsStayInTheirToken) {
  const LayerConfig cfg = tiny_config(Activation::parse(GetParam()));
  MoeLayer layer(cfg, synthetic_weights(cfg, kSeed), "cpu");
  Call clean(kTokens);
  clean.run(layer);
  const std::vector<uint16_t> ref = clean.y.body();

  auto check = [&](Call& c, int64_t poisoned, const char* what) {
    SCOPED_TRACE(what);
    c.y.reset();
    c.run(layer);
    EXPECT_TRUE(c.y.guards_intact()) << c.y.guard_damage();
    const auto y = c.y.body();
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int64_t j = 0; j < kH; ++j) {
        const uint16_t v = y[t * kH + j];
        if (t == poisoned) {
          ASSERT_TRUE(!std::isfinite(bf16_to_f32(v))) << "token " << t << " column " << j;
        } else {
          ASSERT_EQ(v, ref[t * kH + j]) << "token " << t << " column " << j;
        }
      }
    }
  };
  {
    Call c(kTokens);
    c.x[1 * kH + 37] = kBf16NaN;
    check(c, 1, "NaN in x");
    const auto y = c.y.body();
    for (int64_t j = 0; j < kH; ++j) EXPECT_TRUE(is_bf16_nan(y[1 * kH + j])) << j;
  }
  {
    Call c(kTokens);
    c.x[3 * kH + 5] = kBf16Inf;
    check(c, 3, "+Inf in x");
    Call d(kTokens);
    d.x[3 * kH + 100] = kBf16NegInf;
    check(d, 3, "-Inf in x");
  }
  {
    Call c(kTokens);
    c.w[4 * kK + 1] = std::numeric_limits<float>::quiet_NaN();
    check(c, 4, "NaN routing weight");
    Call d(kTokens);
    d.w[0 * kK + 3] = std::numeric_limits<float>::infinity();
    check(d, 0, "Inf routing weight");
  }
  // The quantizer of section 2 on the non-finite values themselves.
  {
    std::vector<uint16_t> x(kH, bf16_from_f32(1.0f));
    x[0] = kBf16NaN;
    x[32] = kBf16Inf;
    x[64] = bf16_from_f32(1e30f);  // finite overflow: saturates to 448 under scale 2^(b-127)
    std::vector<uint8_t> q(kH), sf(kH / kScaleBlock);
    quantize_input(x.data(), 1, kH, q.data(), sf.data());
    EXPECT_EQ(q[0] & 0x7F, 0x7F) << "NaN -> the E4M3 NaN code";
    EXPECT_EQ(sf[0], input_scale_exponent(1.0f)) << "NaN is ignored by amax";
    EXPECT_EQ(sf[1], 254) << "Inf amax -> the largest finite scale";
    EXPECT_EQ(q[32], 0x7E) << "Inf -> +448";
    EXPECT_TRUE(std::isfinite(e4m3_to_f32(q[64])) && e4m3_to_f32(q[64]) > 0);
  }
}
INSTANTIATE_TEST_SUITE_P(Reliability, NonFinite,
                         ::testing::Values("situ", "swiglu", "swiglu:clamp=7", "swiglu_oai"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           for (char& ch : name) if (ch == ':' || ch == '=') ch = '_';
                           return name;
                         });

TEST(Reliability, NanWeightScaleOnlyPoisonsItsExpert) {
  const LayerConfig cfg = tiny_config();
  MoeWeights weights = synthetic_weights(cfg, kSeed);
  constexpr int64_t kPoisonedExpert = 5;
  // One UE8M0 byte of expert 5's W13 set to 0xFF (NaN), and one of its W2.
  weights.w13_sf.as<uint8_t>()[kPoisonedExpert * 2 * kI * (kH / kScaleBlock) + 3] = kUe8m0NaN;
  weights.w2_sf.as<uint8_t>()[kPoisonedExpert * kH * (kI / kScaleBlock) + 7] = kUe8m0NaN;
  MoeLayer layer(cfg, std::move(weights), "cpu");
  MoeLayer clean_layer(cfg, synthetic_weights(cfg, kSeed), "cpu");
  Call c(kTokens);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t k = 0; k < kK; ++k) c.idx[t * kK + k] = static_cast<int32_t>((t + k) % 4);
  c.idx[2 * kK + 1] = kPoisonedExpert;  // only token 2 uses expert 5
  Call ref(kTokens);
  ref.idx = c.idx;
  ref.run(clean_layer);
  c.run(layer);
  EXPECT_TRUE(c.y.guards_intact()) << c.y.guard_damage();
  const auto y = c.y.body(), r = ref.y.body();
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t j = 0; j < kH; ++j) {
      if (t == 2) {
        ASSERT_TRUE(is_bf16_nan(y[t * kH + j])) << "column " << j;
      } else {
        ASSERT_EQ(y[t * kH + j], r[t * kH + j]) << "token " << t << " column " << j;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A15-A22: configuration, backend choice and weights
// ---------------------------------------------------------------------------------------------
TEST(Reliability, ConfigRejectsBadShapesAndParallelism) {
  const ErrorCode kArg = ErrorCode::kInvalidArgument;
  auto with = [](auto edit) {
    LayerConfig c = tiny_config();
    edit(c);
    return c;
  };
  auto bad = [&](auto edit, const std::string& fragment) {
    const LayerConfig c = with(edit);
    expect_error([&] { c.validate(); }, kArg, fragment);
    // The layer constructor and the synthetic weights check the config first.
    expect_error([&] { MoeLayer(c, synthetic_weights(tiny_config(), kSeed), "cpu"); }, kArg, fragment);
    expect_error([&] { (void)synthetic_weights(c, kSeed); }, kArg, fragment);
  };
  bad([](LayerConfig& c) { c.shape.hidden = 100; }, "hidden (H) must be a positive multiple of 32, got 100");
  bad([](LayerConfig& c) { c.shape.hidden = 0; }, "hidden (H) must be a positive multiple of 32, got 0");
  bad([](LayerConfig& c) { c.shape.hidden = -32; }, "got -32");
  bad([](LayerConfig& c) { c.shape.intermediate = 48; }, "intermediate (I) must be a positive multiple of 32, got 48");
  bad([](LayerConfig& c) { c.shape.num_experts = 0; }, "num_experts (E) must be > 0, got 0");
  bad([](LayerConfig& c) { c.shape.top_k = 9; }, "top_k (K) must be in [1, E=8], got 9");
  bad([](LayerConfig& c) { c.shape.top_k = 0; }, "top_k (K) must be in [1, E=8], got 0");
  bad([](LayerConfig& c) { c.ep_size = 0; }, "ep_size must be >= 1, got 0");
  bad([](LayerConfig& c) { c.ep_size = 3; }, "ep_size 3 must divide num_experts 8");
  bad([](LayerConfig& c) { c.ep_size = 2; c.ep_rank = 2; }, "ep_rank must be in [0, ep_size=2), got 2");
  bad([](LayerConfig& c) { c.ep_rank = -1; }, "ep_rank must be in [0, ep_size=1), got -1");
  bad([](LayerConfig& c) { c.max_tokens_per_rank = -1; }, "max_tokens_per_rank must be >= 0, got -1");
  // Activation fields set directly (bypassing parse): the config check catches them.
  bad([](LayerConfig& c) { c.activation = Activation::situ(); c.activation.has_clamp = true; c.activation.clamp = 7; },
      "activation situ: a clamp is not allowed");
  bad([](LayerConfig& c) { c.activation = Activation::situ(); c.activation.beta = std::nanf(""); },
      "situ: beta must be finite and > 0, got nan");
  bad([](LayerConfig& c) { c.activation.has_clamp = true; c.activation.clamp = -1; },
      "swiglu: clamp must be finite and >= 0, got -1");
  bad([](LayerConfig& c) { c.activation.has_clamp = true; c.activation.clamp = INFINITY; },
      "swiglu: clamp must be finite and >= 0, got inf");
  bad([](LayerConfig& c) { c.activation.kind = static_cast<ActivationKind>(9); },
      "activation: unknown kind 9");
  bad([](LayerConfig& c) { c.activation = Activation::swiglu_oai(); c.activation.has_clamp = false; },
      "swiglu_oai: the clamp (limit) is required");
  expect_error([] { (void)shape_preset("kimi-k2"); }, kArg, "shape: unknown preset 'kimi-k2'");
}

TEST(Reliability, ActivationSpecsAreParsedStrictly) {
  const ErrorCode kArg = ErrorCode::kInvalidArgument;
  const std::pair<const char*, const char*> bad[] = {
      {"gelu", "unknown name 'gelu' (expected swiglu, situ or swiglu_oai)"},
      {"", "unknown name ''"},
      {"SwiGLU", "unknown name 'SwiGLU'"},
      {"situ:clamp=7", "situ takes no clamp"},
      {"swiglu:clamp=-1", "clamp must be finite and >= 0, got -1"},
      {"swiglu:clamp=nan", "clamp must be finite and >= 0, got nan"},
      {"swiglu:clamp=inf", "clamp must be finite and >= 0, got inf"},
      {"swiglu:clamp=1e39", "overflows float32"},
      {"situ:beta=0", "beta must be finite and > 0, got 0"},
      {"situ:beta=-4", "beta must be finite and > 0, got -4"},
      {"situ:linear_beta=inf", "linear_beta must be finite and > 0, got inf"},
      {"situ:beta=", "parameter 'beta' has no value"},
      {"situ:beta=4x", "parameter 'beta' expected a number, got '4x'"},
      {"situ:beta", "parameter 'beta' is not of the form key=value"},
      {"situ:", "expected key=value parameters after ':'"},
      {"situ:beta=4,beta=5", "parameter 'beta' given twice"},
      {"situ:alpha=1", "unknown parameter 'alpha' for situ (allowed: beta, linear_beta)"},
      {"swiglu:beta=1", "unknown parameter 'beta' for swiglu (allowed: clamp)"},
      {"swiglu_oai:alpha=0", "alpha must be finite and > 0, got 0"},
      {"swiglu:clamp=1,", "parameter '' is not of the form key=value"},
  };
  for (const auto& [spec, fragment] : bad) {
    SCOPED_TRACE(spec);
    expect_error([&] { (void)Activation::parse(spec); }, kArg, fragment);
  }
  // Factories validate too.
  expect_error([] { (void)Activation::situ(0.0f, 25.0f); }, kArg, "beta must be finite and > 0");
  expect_error([] { (void)Activation::swiglu_clamped(-0.5f); }, kArg, "clamp must be finite and >= 0");
  // Round trip of the canonical spelling.
  for (const char* s : {"swiglu", "swiglu:clamp=7", "situ:beta=4,linear_beta=25", "swiglu_oai:alpha=1.702,clamp=7"})
    EXPECT_EQ(Activation::parse(Activation::parse(s).to_string()).to_string(), Activation::parse(s).to_string());
}

TEST(Reliability, BackendNamesAndAvailability) {
  const LayerConfig cfg = tiny_config();
  for (const char* name : {"tpu", "", "CPU", "sm100", "auto "}) {
    SCOPED_TRACE(name);
    expect_error([&] { MoeLayer(cfg, synthetic_weights(cfg, kSeed), name); },
                 ErrorCode::kInvalidArgument, "unknown backend '" + std::string(name) + "'");
  }
  bool has_sm90 = false;
  for (const auto& n : available_backends()) has_sm90 |= n == "sm90";
  if (!has_sm90) {
    expect_error([&] { MoeLayer(cfg, synthetic_weights(cfg, kSeed), "sm90"); },
                 ErrorCode::kUnsupported, "backend sm90 cannot run here");
    return;
  }
  // A GPU layer given host tensors (and a CPU layer given device tensors above): rejected by
  // device before any pointer is touched.
  MoeLayer gpu(cfg, synthetic_weights(cfg, kSeed), "sm90");
  Call c(kTokens);
  expect_rejected(c, [&] { c.run(gpu); }, ErrorCode::kInvalidArgument,
                  "x: expected a tensor on cuda:");
}

TEST(Reliability, WeightsThatDoNotFitTheConfig) {
  const LayerConfig cfg = tiny_config();
  const ErrorCode kArg = ErrorCode::kInvalidArgument;
  LayerConfig other = cfg;
  other.shape.intermediate = 2 * kI;
  expect_error([&] { MoeLayer(cfg, synthetic_weights(other, kSeed), "cpu"); }, kArg,
               "weights: intermediate 128 does not match the config's I=64");
  other = cfg;
  other.shape.num_experts = 2 * kE;
  expect_error([&] { MoeLayer(cfg, synthetic_weights(other, kSeed), "cpu"); }, kArg,
               "weights: num_local_experts 16 does not match the config's E/ep_size=8");
  // Weights of EP rank 1 given to a layer of EP rank 0.
  LayerConfig rank0 = cfg, rank1 = cfg;
  rank0.ep_size = rank1.ep_size = 2;
  rank1.ep_rank = 1;
  expect_error([&] { MoeLayer(rank0, synthetic_weights(rank1, kSeed), "cpu"); }, kArg,
               "weights: first_expert 4 does not match the config's ep_rank*E_l=0");
  // A truncated buffer, a half-present bias, buffers on two devices.
  MoeWeights w = synthetic_weights(cfg, kSeed);
  w.w2_sf.shrink(w.w2_sf.size() - 1);
  expect_error([&] { MoeLayer(cfg, std::move(w), "cpu"); }, ErrorCode::kFormat,
               "weights: w2_sf expected 2048 bytes (canonical form), got 2047");
  MoeWeights b = synthetic_weights(cfg, kSeed, /*with_bias=*/true);
  b.w2_bias.release();
  expect_error([&] { MoeLayer(cfg, std::move(b), "cpu"); }, ErrorCode::kFormat,
               "w13_bias and w2_bias must be both present or both absent");
  expect_error([] { (void)MoeWeights::allocate(0, 0, kH, kI, false); }, kArg,
               "num_local_experts must be > 0, got 0");
  expect_error([] { (void)MoeWeights::allocate(2, 0, 96 + 1, kI, false); }, kArg,
               "hidden must be a positive multiple of 32, got 97");
}

TEST(Reliability, PreparedWeightsMisuse) {
  const LayerConfig cfg = tiny_config();
  const ErrorCode kArg = ErrorCode::kInvalidArgument;
  // Unknown preparation backend: nothing changes.
  MoeWeights w = synthetic_weights(cfg, kSeed);
  const std::vector<uint8_t> before(w.w13.as<uint8_t>(), w.w13.as<uint8_t>() + w.w13.size());
  expect_error([&] { (void)prepare(w, "tpu"); }, kArg, "unknown backend 'tpu'");
  EXPECT_EQ(w.layout, kCanonicalLayout);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), w.w13.as<uint8_t>()));
  // Preparing twice: the second is a no-op, never a double transform.
  const PrepareReport first = prepare(w, "blackwell-interop");
  EXPECT_FALSE(first.no_op);
  const std::vector<uint8_t> once(w.w13_sf.as<uint8_t>(), w.w13_sf.as<uint8_t>() + w.w13_sf.size());
  const PrepareReport second = prepare(w, "blackwell-interop");
  EXPECT_TRUE(second.no_op);
  EXPECT_EQ(w.layout, "blackwell-interop");
  EXPECT_TRUE(std::equal(once.begin(), once.end(), w.w13_sf.as<uint8_t>()));
  // Prepared weights given to the CPU layer (which reads the canonical form): rejected.
  MoeWeights copy = synthetic_weights(cfg, kSeed);
  (void)prepare(copy, "blackwell-interop");
  expect_error([&] { MoeLayer(cfg, std::move(copy), "cpu"); }, kArg,
               "backend cpu: needs weights in the 'canonical' layout, got 'blackwell-interop'");
  // ... and to the reference directly.
  Call c(kTokens);
  expect_rejected(c, [&] {
    reference_forward(cfg, w, c.x.data(), c.idx.data(), c.w.data(), c.t, c.y.data());
  }, kArg, "weights: expected the 'canonical' layout, got 'blackwell-interop'");
  // A layout name that is not registered; a fused arch that has no kernel.
  MoeWeights lie = synthetic_weights(cfg, kSeed);
  lie.layout = "marlin";
  expect_error([&] { check_weights_layout(lie); }, kArg, "layout 'marlin' is not registered");
  expect_error([&] { (void)unprepare(lie); }, kArg, "layout 'marlin' is not registered");
  expect_error([] { (void)fused_layout_for_arch(80); }, ErrorCode::kUnsupported,
               "prepare_for_fused: no fused MegaMoE kernel for sm_80");
  // Weights claiming the canonical layout with the wrong byte count cannot be prepared.
  MoeWeights shortw = synthetic_weights(cfg, kSeed);
  shortw.w13.shrink(shortw.w13.size() / 2);
  expect_error([&] { (void)prepare(shortw, "blackwell-interop"); }, kArg, "weights.w13: expected");
  EXPECT_EQ(shortw.layout, kCanonicalLayout);
  // Back to canonical: bit for bit, and the CPU layer takes it.
  (void)unprepare(w);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), w.w13.as<uint8_t>()));
  MoeLayer layer(cfg, std::move(w), "cpu");
  c.run(layer);
  EXPECT_TRUE(c.y.guards_intact()) << c.y.guard_damage();
}

TEST(Reliability, MovedFromLayerIsAnError) {
  MoeLayer layer(tiny_config(), synthetic_weights(tiny_config(), kSeed), "cpu");
  MoeLayer other = std::move(layer);
  Call c(kTokens);
  expect_rejected(c, [&] { c.run(layer); }, ErrorCode::kInvalidArgument,
                  "MoeLayer::forward: this layer was moved from");
  c.run(other);
}

// ---------------------------------------------------------------------------------------------
// A23-A26: helpers that take user data: routing, the router, the weight quantizer
// ---------------------------------------------------------------------------------------------
TEST(Reliability, RoutingAndQuantizerInputs) {
  const ErrorCode kArg = ErrorCode::kInvalidArgument;
  expect_error([] { (void)make_routing(RoutingKind::kUniform, 4, 8, 9, 1); }, kArg, "make_routing: top_k must be in [1, E=8]");
  expect_error([] { (void)make_routing(RoutingKind::kUniform, -1, 8, 2, 1); }, kArg, "make_routing: num_tokens must be >= 0, got -1");
  expect_error([] { (void)parse_routing_kind("zipf"); }, kArg, "routing: unknown kind 'zipf'");
  // The router: non-finite logits or bias are rejected naming token and expert. (Rows of earlier
  // tokens may already be written when a later token's logits are bad; never outside the outputs.)
  std::vector<float> logits(2 * kE, 0.5f), bias(kE, 0.0f);
  Guarded<int32_t> idx(2 * kK);
  Guarded<float> w(2 * kK);
  logits[1 * kE + 3] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { route_sigmoid_topk(logits.data(), bias.data(), 2, kE, kK, 1.0f, idx.data(), w.data()); },
               kArg, "route_sigmoid_topk: logits[1, 3] is not finite (nan)");
  logits[1 * kE + 3] = 0.5f;
  bias[6] = std::numeric_limits<float>::infinity();
  expect_error([&] { route_sigmoid_topk(logits.data(), bias.data(), 2, kE, kK, 1.0f, idx.data(), w.data()); },
               kArg, "route_sigmoid_topk: correction_bias[6] is not finite (inf)");
  EXPECT_TRUE(idx.guards_intact() && w.guards_intact());
  // MXFP4 weight quantizer: non-finite weights are rejected naming row and column.
  std::vector<float> wt(2 * 64, 1.0f);
  wt[1 * 64 + 40] = std::numeric_limits<float>::infinity();
  Guarded<uint8_t> packed(2 * 32), sf(2 * 2);
  expect_error([&] { quantize_mxfp4(wt.data(), 2, 64, packed.data(), sf.data()); }, kArg, "quantize_mxfp4: weight [1, 40] is not finite (inf)");
  EXPECT_TRUE(packed.guards_intact() && sf.guards_intact());
}

}  // namespace
}  // namespace megamoe
