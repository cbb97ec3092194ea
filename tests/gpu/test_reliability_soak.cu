// Reliability of the sm90 layer through the public API (docs/reliability.md, "GPU soak" and
// "compute-sanitizer"):
//
//   ReliabilitySoak.ManyLayerCalls     MEGAMOE_SOAK_CALLS calls (default kDefaultSoakCalls, so a
//                                      plain `ctest -L gpu` stays quick; tests/gpu/run_reliability.sh
//                                      sets 10000) of megamoe::MoeLayer(config, weights, "sm90")
//                                      with random token counts, routings (uniform, skewed,
//                                      adversarial, all tokens to one expert, most experts empty,
//                                      random empty slots), activations (situ, swiglu, clamped
//                                      swiglu) and fast_math on/off, on two shapes (small and a
//                                      deepseek-v3-like shape with 16 experts). Every
//                                      kCheckInterval-th call is compared with the CPU reference
//                                      (numerics.md section 8 diff metric, overall and worst row),
//                                      every kRepeatInterval-th call is repeated and must be
//                                      bitwise identical, CUDA errors are polled every
//                                      kSyncInterval calls, and at the end neither megamoe's device
//                                      bytes nor the driver's free memory may have changed.
//   ReliabilitySanitize.SmallLayer     a short fixed driver for compute-sanitizer (memcheck,
//                                      racecheck, synccheck): each activation, both math modes,
//                                      T = 0, 1, 7, 40, invalid expert ids (reported by
//                                      MoeLayer::check_errors, never read), on the small shape.
//
// Both skip with a printed reason where there is no sm_90 GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/buffer.hpp"
#include "megamoe/error.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/weights.hpp"
#include "sm90_test_util.hpp"

namespace megamoe {
namespace {

constexpr int64_t kDefaultSoakCalls = 600;
constexpr int64_t kCheckInterval = 500;     // compare with the CPU reference
constexpr int64_t kRepeatInterval = 37;     // repeat the call, expect bitwise equality
constexpr int64_t kSyncInterval = 64;       // poll for asynchronous CUDA errors
constexpr double kDefaultMaxSeconds = 170;  // the soak stops (and fails) past this
constexpr double kMaxDiff = 1e-4;           // as tests/gpu/test_sm90_layer.cu (kMaxDiff)
constexpr double kMaxRowDiff = 1e-3;
constexpr int64_t kMaxCheckedTokensSmall = 256;  // the CPU reference is the slow side
constexpr int64_t kMaxCheckedTokensLarge = 16;
constexpr uint64_t kWeightSeed = 4242;
constexpr int64_t kMemSlackBytes = 0;       // no growth at all in megamoe's own accounting

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

MoeWeights clone_host(const MoeWeights& w) {
  MoeWeights c;
  c.num_local_experts = w.num_local_experts;
  c.first_expert = w.first_expert;
  c.hidden = w.hidden;
  c.intermediate = w.intermediate;
  c.layout = w.layout;
  c.w13 = w.w13.to(Device::cpu());
  c.w13_sf = w.w13_sf.to(Device::cpu());
  c.w2 = w.w2.to(Device::cpu());
  c.w2_sf = w.w2_sf.to(Device::cpu());
  if (w.has_bias()) {
    c.w13_bias = w.w13_bias.to(Device::cpu());
    c.w2_bias = w.w2_bias.to(Device::cpu());
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// One shape: host weights for the reference, a pool of inputs (host + device), and a layer per
// (activation, fast_math).
// ---------------------------------------------------------------------------------------------
struct SoakShape {
  std::string name;
  LayerShape shape;
  int64_t capacity = 0;
  int64_t max_checked_tokens = 0;
  MoeWeights host;                    // canonical, for the CPU reference
  std::vector<uint16_t> x_pool;       // [capacity, H]
  test::DeviceArray<uint16_t> d_x_pool;
};

const char* const kActivations[] = {"situ", "swiglu", "swiglu:clamp=7"};
constexpr int kNumActivations = 3;

struct SoakLayer {
  const SoakShape* shape;
  LayerConfig config;
  std::unique_ptr<MoeLayer> layer;
  std::string describe() const {
    return shape->name + " " + config.activation.to_string() +
           (config.fast_math ? " fast_math" : " exact_math");
  }
};

enum class SoakRouting { kUniform, kSkewed, kAdversarial, kOneExpert, kFewExperts, kManyEmpty };
constexpr int kNumSoakRoutings = 6;
const char* soak_routing_name(SoakRouting r) {
  switch (r) {
    case SoakRouting::kUniform: return "uniform";
    case SoakRouting::kSkewed: return "skewed";
    case SoakRouting::kAdversarial: return "adversarial";
    case SoakRouting::kOneExpert: return "all-to-one-expert";
    case SoakRouting::kFewExperts: return "two-experts-rest-empty";
    case SoakRouting::kManyEmpty: return "half-slots-empty";
  }
  return "?";
}

test::RoutingData soak_routing(SoakRouting kind, int64_t t, const LayerShape& s, uint64_t seed,
                               detail::SplitMix64& rng) {
  switch (kind) {
    case SoakRouting::kUniform:
      return test::make_routing(test::Routing::kUniform, t, s.num_experts, s.top_k, seed, 0.05);
    case SoakRouting::kSkewed:
      return test::make_routing(test::Routing::kSkewed, t, s.num_experts, s.top_k, seed);
    case SoakRouting::kAdversarial:
      return test::make_routing(test::Routing::kAdversarial, t, s.num_experts, s.top_k, seed, 0.0,
                                static_cast<int64_t>(rng.below(s.num_experts)));
    case SoakRouting::kManyEmpty:
      return test::make_routing(test::Routing::kUniform, t, s.num_experts, s.top_k, seed, 0.5);
    case SoakRouting::kOneExpert:
    case SoakRouting::kFewExperts: {
      // Slot 0 of every token -> one expert (kOneExpert) or one of two (kFewExperts); the other
      // slots empty (kOneExpert) or on a second fixed expert. Every other expert gets no token.
      test::RoutingData r = test::make_routing(test::Routing::kUniform, t, s.num_experts, s.top_k, seed);
      const int32_t a = static_cast<int32_t>(rng.below(s.num_experts));
      const int32_t b = static_cast<int32_t>((a + 1 + rng.below(s.num_experts - 1)) % s.num_experts);
      for (int64_t tok = 0; tok < t; ++tok) {
        for (int64_t k = 0; k < s.top_k; ++k) {
          int32_t& id = r.idx[tok * s.top_k + k];
          if (kind == SoakRouting::kOneExpert) id = k == 0 ? a : -1;
          else id = k == 0 ? a : (k == 1 ? b : -1);
        }
      }
      return r;
    }
  }
  return {};
}

// Token counts: mostly decode-sized, some middle, a few up to the capacity, and T = 0.
int64_t soak_tokens(detail::SplitMix64& rng, int64_t capacity) {
  const uint64_t bucket = rng.below(100);
  if (bucket < 3) return 0;
  if (bucket < 55) return 1 + static_cast<int64_t>(rng.below(std::min<int64_t>(16, capacity)));
  if (bucket < 90) return 1 + static_cast<int64_t>(rng.below(std::min<int64_t>(128, capacity)));
  return 1 + static_cast<int64_t>(rng.below(capacity));
}

std::string cuda_last_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

struct DeviceMem {
  size_t free = 0, total = 0;
  int64_t megamoe_device = 0;
};
DeviceMem device_mem() {
  DeviceMem m;
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  MEGAMOE_CUDA_CHECK(cudaMemGetInfo(&m.free, &m.total));
  m.megamoe_device = memory_stats().device_bytes;
  return m;
}

// Compares y with the CPU reference for the call's inputs; returns "" or what failed.
std::string check_against_reference(const SoakLayer& l, const uint16_t* x_host,
                                    const test::RoutingData& r, int64_t t,
                                    const std::vector<uint16_t>& y, double* diff_out) {
  std::vector<uint16_t> y_ref(static_cast<size_t>(t * l.config.shape.hidden));
  reference_forward(l.config, l.shape->host, x_host, r.idx.data(), r.weights.data(), t,
                    y_ref.data());
  std::vector<double> ref(y_ref.size());
  for (size_t i = 0; i < y_ref.size(); ++i) ref[i] = bf16_to_f32(y_ref[i]);
  int64_t nonfinite = 0;
  for (uint16_t v : y) nonfinite += !std::isfinite(bf16_to_f32(v));
  const DiffReport rep = compare_output(l.config, y.data(), ref.data(), r.idx.data(), t);
  *diff_out = rep.diff;
  if (nonfinite > 0) return std::to_string(nonfinite) + " non-finite outputs";
  if (!(rep.diff <= kMaxDiff)) return "diff " + std::to_string(rep.diff);
  if (!(rep.worst_row_diff <= kMaxRowDiff))
    return "worst row " + std::to_string(rep.worst_row) + " diff " + std::to_string(rep.worst_row_diff);
  return "";
}

std::vector<std::unique_ptr<SoakShape>> make_shapes() {
  std::vector<std::unique_ptr<SoakShape>> shapes;
  auto add = [&](const char* name, LayerShape s, int64_t capacity, int64_t max_checked) {
    auto d = std::make_unique<SoakShape>();
    d->name = name;
    d->shape = s;
    d->capacity = capacity;
    d->max_checked_tokens = max_checked;
    LayerConfig cfg;
    cfg.shape = s;
    cfg.max_tokens_per_rank = capacity;
    d->host = synthetic_weights(cfg, kWeightSeed);
    d->x_pool = test::make_inputs(capacity, s.hidden, kWeightSeed);
    d->d_x_pool = test::DeviceArray<uint16_t>(d->x_pool);
    shapes.push_back(std::move(d));
  };
  add("small", shape_preset("small"), 1024, kMaxCheckedTokensSmall);
  add("deepseek-v3-like(E=16)", {7168, 2048, 16, 8}, 256, kMaxCheckedTokensLarge);
  return shapes;
}

std::vector<SoakLayer> make_layers(const std::vector<std::unique_ptr<SoakShape>>& shapes) {
  std::vector<SoakLayer> layers;
  for (const auto& s : shapes) {
    for (int a = 0; a < kNumActivations; ++a) {
      for (bool fast : {true, false}) {
        SoakLayer l;
        l.shape = s.get();
        l.config.shape = s->shape;
        l.config.max_tokens_per_rank = s->capacity;
        l.config.activation = Activation::parse(kActivations[a]);
        l.config.fast_math = fast;
        l.layer = std::make_unique<MoeLayer>(l.config, clone_host(s->host), "sm90");
        layers.push_back(std::move(l));
      }
    }
  }
  return layers;
}

TEST(ReliabilitySoak, ManyLayerCalls) {
  MEGAMOE_REQUIRE_SM90();
  const int64_t num_calls = env_int("MEGAMOE_SOAK_CALLS", kDefaultSoakCalls);
  const double max_seconds = static_cast<double>(env_int("MEGAMOE_SOAK_MAX_SECONDS",
                                                         static_cast<int64_t>(kDefaultMaxSeconds)));
  const uint64_t seed = static_cast<uint64_t>(env_int("MEGAMOE_SOAK_SEED", 1));
  const auto t_setup = std::chrono::steady_clock::now();
  auto shapes = make_shapes();
  std::vector<SoakLayer> layers = make_layers(shapes);
  const test::Stream stream;
  int64_t max_out = 0;
  for (const auto& s : shapes) max_out = std::max(max_out, s->capacity * s->shape.hidden);
  test::DeviceArray<uint16_t> d_y(max_out), d_y2(max_out);
  const int64_t max_slots = 1024 * 16;
  test::DeviceArray<int32_t> d_idx(max_slots);
  test::DeviceArray<float> d_w(max_slots);

  auto launch = [&](SoakLayer& l, const uint16_t* d_x, int64_t t, uint16_t* y) {
    const int64_t h = l.config.shape.hidden, k = l.config.shape.top_k;
    l.layer->forward(TensorView::contiguous(const_cast<uint16_t*>(d_x), DType::kBF16, {t, h}, l.layer->device()),
                     TensorView::contiguous(d_idx.get(), DType::kI32, {t, k}, l.layer->device()),
                     TensorView::contiguous(d_w.get(), DType::kF32, {t, k}, l.layer->device()),
                     TensorView::contiguous(y, DType::kBF16, {t, h}, l.layer->device()), stream);
  };
  auto upload_routing = [&](const test::RoutingData& r) {
    if (r.idx.empty()) return;
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(d_idx.get(), r.idx.data(), r.idx.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream));
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(d_w.get(), r.weights.data(), r.weights.size() * sizeof(float),
                                       cudaMemcpyHostToDevice, stream));
  };
  auto download = [&](const uint16_t* d, int64_t count) {
    std::vector<uint16_t> h(static_cast<size_t>(count));
    if (count > 0)
      MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(h.data(), d, count * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    return h;
  };

  // Warm-up: every layer once at a few sizes (module loading, first-touch allocations), then the
  // memory baseline.
  detail::SplitMix64 rng(detail::derive_seed(seed, {0x736f616bull}));
  for (auto& l : layers) {
    for (int64_t t : {int64_t{1}, int64_t{64}, l.shape->capacity}) {
      const auto r = soak_routing(SoakRouting::kUniform, t, l.config.shape, rng.next(), rng);
      upload_routing(r);
      launch(l, l.shape->d_x_pool.get(), t, d_y.get());
    }
  }
  const DeviceMem mem_before = device_mem();
  const double setup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_setup).count();

  int64_t calls = 0, checks = 0, repeats = 0, failures = 0, per_routing[kNumSoakRoutings] = {};
  int64_t tokens_total = 0, zero_token_calls = 0;
  double worst_diff = 0;
  std::string first_failure;
  auto record_failure = [&](const std::string& what) {
    if (failures++ == 0) first_failure = what;
    ADD_FAILURE() << what;
  };
  const auto t0 = std::chrono::steady_clock::now();
  double elapsed = 0;
  for (; calls < num_calls; ++calls) {
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (elapsed > max_seconds) break;
    SoakLayer& l = layers[rng.below(layers.size())];
    const SoakShape& s = *l.shape;
    const bool check = (calls + 1) % kCheckInterval == 0 || calls + 1 == num_calls;
    int64_t t = soak_tokens(rng, s.capacity);
    if (check) t = std::max<int64_t>(1, std::min(t, s.max_checked_tokens));
    const auto kind = static_cast<SoakRouting>(rng.below(kNumSoakRoutings));
    const uint64_t call_seed = rng.next();
    const test::RoutingData r = soak_routing(kind, t, s.shape, call_seed, rng);
    const int64_t x_row = static_cast<int64_t>(rng.below(s.capacity - t + 1));
    const uint16_t* d_x = s.d_x_pool.get() + x_row * s.shape.hidden;
    ++per_routing[static_cast<int>(kind)];
    tokens_total += t;
    zero_token_calls += t == 0;
    const std::string what = "call " + std::to_string(calls) + " " + l.describe() + " T=" +
                             std::to_string(t) + " routing=" + soak_routing_name(kind) +
                             " seed=" + std::to_string(call_seed) + " x_row=" + std::to_string(x_row);
    try {
      upload_routing(r);
      launch(l, d_x, t, d_y.get());
      if (calls % kRepeatInterval == 0 && t > 0) {
        launch(l, d_x, t, d_y2.get());
        const auto a = download(d_y.get(), t * s.shape.hidden);
        const auto b = download(d_y2.get(), t * s.shape.hidden);
        ++repeats;
        if (a != b) record_failure(what + ": a repeated call is not bitwise identical");
      }
      if (check) {
        const auto y = download(d_y.get(), t * s.shape.hidden);
        double diff = 0;
        const std::string bad = check_against_reference(l, s.x_pool.data() + x_row * s.shape.hidden,
                                                        r, t, y, &diff);
        ++checks;
        worst_diff = std::max(worst_diff, diff);
        if (!bad.empty()) record_failure(what + ": vs the CPU reference: " + bad);
      }
      if (calls % kSyncInterval == 0) {
        l.layer->check_errors(stream);  // synchronizes; no invalid id was given, so must not throw
        const std::string err = cuda_last_error();
        if (!err.empty()) record_failure(what + ": CUDA error " + err);
      }
    } catch (const Error& e) {
      record_failure(what + ": megamoe::Error " + e.what());
    }
    if (failures > 10) break;
  }
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const DeviceMem mem_after = device_mem();

  const long long free_delta = static_cast<long long>(mem_before.free) - static_cast<long long>(mem_after.free);
  const long long mm_delta = mem_after.megamoe_device - mem_before.megamoe_device;
  std::string routings;
  for (int i = 0; i < kNumSoakRoutings; ++i)
    routings += std::string(i ? ", " : "") + soak_routing_name(static_cast<SoakRouting>(i)) + " " +
                std::to_string(per_routing[i]);
  std::printf("[ soak     ] routings: %s; %lld calls with T=0, %.1f tokens per call on average\n",
              routings.c_str(), static_cast<long long>(zero_token_calls),
              calls ? static_cast<double>(tokens_total) / calls : 0.0);
  std::printf("SOAK SUMMARY: %lld/%lld sm90 layer calls in %.1f s (setup %.1f s) on %zu layers "
              "(2 shapes x 3 activations x fast_math on/off); %lld reference checks (worst diff "
              "%.2e, limit %.0e), %lld repeat checks bitwise; device free memory delta %lld B, "
              "megamoe device bytes delta %lld B; failures %lld%s%s\n",
              static_cast<long long>(calls), static_cast<long long>(num_calls), elapsed, setup_s,
              layers.size(), static_cast<long long>(checks), worst_diff, kMaxDiff,
              static_cast<long long>(repeats), free_delta, mm_delta,
              static_cast<long long>(failures), failures ? "; first: " : "", first_failure.c_str());
  EXPECT_EQ(calls, num_calls) << "the soak stopped early (time limit " << max_seconds
                              << " s or too many failures)";
  EXPECT_EQ(failures, 0) << first_failure;
  EXPECT_LE(mm_delta, kMemSlackBytes) << "megamoe's device allocations grew during the soak";
  EXPECT_LE(free_delta, static_cast<long long>(env_int("MEGAMOE_SOAK_FREE_SLACK_BYTES", 0)))
      << "the driver's free device memory shrank during the soak";
  EXPECT_GT(checks, 0);
  EXPECT_GT(repeats, 0);
}

// ---------------------------------------------------------------------------------------------
// A small fixed driver for compute-sanitizer (tests/gpu/run_reliability.sh).
// ---------------------------------------------------------------------------------------------
TEST(ReliabilitySanitize, SmallLayer) {
  MEGAMOE_REQUIRE_SM90();
  LayerConfig base;
  base.shape = shape_preset("small");
  base.max_tokens_per_rank = 64;
  const MoeWeights host = synthetic_weights(base, kWeightSeed);
  const int64_t h = base.shape.hidden, k = base.shape.top_k;
  for (int a = 0; a < kNumActivations; ++a) {
    for (bool fast : {true, false}) {
      LayerConfig cfg = base;
      cfg.activation = Activation::parse(kActivations[a]);
      cfg.fast_math = fast;
      MoeLayer layer(cfg, clone_host(host), "sm90");
      for (int64_t t : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{40}}) {
        SCOPED_TRACE(cfg.activation.to_string() + (fast ? " fast" : " exact") + " T=" + std::to_string(t));
        const auto r = test::make_routing(test::Routing::kSkewed, t, base.shape.num_experts, k, t + 1, 0.1);
        const auto x = test::make_inputs(t, h, t + 2);
        test::DeviceArray<uint16_t> dx(x), dy(std::max<int64_t>(t, 1) * h);
        test::DeviceArray<int32_t> didx(r.idx);
        test::DeviceArray<float> dw(r.weights);
        const Device dev = layer.device();
        layer.forward(TensorView::contiguous(dx.get(), DType::kBF16, {t, h}, dev),
                      TensorView::contiguous(didx.get(), DType::kI32, {t, k}, dev),
                      TensorView::contiguous(dw.get(), DType::kF32, {t, k}, dev),
                      TensorView::contiguous(dy.get(), DType::kBF16, {t, h}, dev));
        MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
        ASSERT_EQ(cuda_last_error(), "");
        if (t == 0) continue;
        const auto y = dy.download(t * h);
        std::vector<uint16_t> y_ref(y.size());
        reference_forward(cfg, host, x.data(), r.idx.data(), r.weights.data(), t, y_ref.data());
        std::vector<double> ref(y_ref.size());
        for (size_t i = 0; i < y_ref.size(); ++i) ref[i] = bf16_to_f32(y_ref[i]);
        const DiffReport rep = compare_output(cfg, y.data(), ref.data(), r.idx.data(), t);
        EXPECT_LE(rep.diff, kMaxDiff);
      }
    }
  }
  // An invalid expert id: never read out of bounds (memcheck watches), reported by the sm90
  // backend's device-side record (tests/gpu/test_sm90_layer.cu checks the report itself).
  LayerConfig cfg = base;
  MoeLayer layer(cfg, clone_host(host), "sm90");
  const int64_t t = 5;
  auto r = test::make_routing(test::Routing::kUniform, t, base.shape.num_experts, k, 9);
  r.idx[2 * k + 1] = static_cast<int32_t>(base.shape.num_experts) + 1000;
  r.idx[3 * k + 0] = -77;
  const auto x = test::make_inputs(t, h, 9);
  test::DeviceArray<uint16_t> dx(x), dy(t * h);
  test::DeviceArray<int32_t> didx(r.idx);
  test::DeviceArray<float> dw(r.weights);
  const Device dev = layer.device();
  auto call = [&] {
    layer.forward(TensorView::contiguous(dx.get(), DType::kBF16, {t, h}, dev),
                  TensorView::contiguous(didx.get(), DType::kI32, {t, k}, dev),
                  TensorView::contiguous(dw.get(), DType::kF32, {t, k}, dev),
                  TensorView::contiguous(dy.get(), DType::kBF16, {t, h}, dev));
    layer.check_errors(nullptr);
  };
  try {
    call();
    ADD_FAILURE() << "invalid expert ids were not reported by check_errors";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfRange) << e.what();
    EXPECT_NE(std::string(e.what()).find("topk_idx"), std::string::npos) << e.what();
  }
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(cuda_last_error(), "");
  // The record was cleared: a clean call afterwards reports nothing.
  didx.upload(test::make_routing(test::Routing::kUniform, t, base.shape.num_experts, k, 9).idx);
  call();
}

}  // namespace
}  // namespace megamoe
