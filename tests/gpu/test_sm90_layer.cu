// The whole Hopper layer against the CPU contract (numerics.md section 8, exact-mode checks).
//
// For every case:
//  1. x_q / x_sf of the layer equal the CPU quantizer bit for bit.
//  2. The GPU's own intermediate (h_q, h_sf) is fed to the CPU L2 + combine, slot by slot; the
//     layer's y must match within a bound derived from summation order only:
//       |y - y_cpu(h_gpu)| <= sum_k [ gamma * ||a_k|| * ||w2_e[n, :]|| + ulp(o_k) ] + ulp(y)
//     gamma = kGammaC * sqrt(I) * 2^-24 (FP32 summation of I exact products in another order,
//     with ||a|| ||w|| >= sum |a_j w_j| by Cauchy-Schwarz), ulp(o_k) for a BF16 rounding of each
//     slot output that may flip, ulp(y) for the final rounding. The fraction of the bound used is
//     printed.
//  3. The GPU's h codes are compared with the CPU reference fed the same quantized x: a code may
//     flip only to a neighbouring value (an L1 accumulator difference in the last bits can cross
//     a rounding boundary), and flips must be rare (<= kMaxFlipFraction of the codes).
//  4. y against the full CPU reference: diff metric (section 8) under kMaxDiff overall, for the
//     worst row and the worst expert.
// Large token counts compare a subset of tokens (every stride-th) with the CPU, since the CPU
// reference of a 4096-token deepseek-v3 layer takes minutes; the GPU always computes all tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/tensor.hpp"
#include "megamoe/parallel.hpp"
#include "megamoe/quantize.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/weights.hpp"
#include "moe/sm90_layer.hpp"
#include "sm90/sm90_dispatch_types.hpp"
#include "sm90_flip_check.hpp"
#include "sm90_test_util.hpp"

namespace megamoe::sm90 {
namespace {

using test::DeviceArray;
using test::Routing;
using test::Stream;
using test::StreamGraph;

constexpr double kGammaC = 4.0;
constexpr double kMaxFlipFraction = 1e-3;
constexpr double kMaxDiff = 1e-4;      // y vs the full reference (flips included)
constexpr int64_t kCapacity = 4096;   // max_tokens_per_rank of the test layers
constexpr uint64_t kWeightSeed = 1234;

double bf16_ulp(double v) {
  v = std::fabs(v);
  if (v < 1e-38) return std::ldexp(1.0, -133);
  int e;
  std::frexp(v, &e);  // v in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1 - 7);
}

// ---------------------------------------------------------------------------------------------
// Shapes: host canonical weights (kept for the CPU reference) and per-row norms of W2.
// ---------------------------------------------------------------------------------------------
struct ShapeData {
  LayerConfig base;
  MoeWeights host;                      // canonical, for the reference
  MoeWeights prepared;                  // the same, on the GPU in the sm90 layout (layers borrow it)
  std::vector<double> w2_row_norm;      // [E_l, H]
  mutable std::vector<double> w13_row_norm;  // [E_l, 2I], computed on demand (< 0: not yet)

  double w13_norm(int64_t local_expert, int64_t row) const {
    const int64_t h = host.hidden, rows = 2 * host.intermediate;
    if (w13_row_norm.empty()) w13_row_norm.assign(static_cast<size_t>(host.num_local_experts * rows), -1.0);
    double& n = w13_row_norm[static_cast<size_t>(local_expert * rows + row)];
    if (n < 0) {
      const int64_t r = local_expert * rows + row;
      const uint8_t* w = host.w13.as<uint8_t>() + r * h / 2;
      const uint8_t* sf = host.w13_sf.as<uint8_t>() + r * h / kScaleBlock;
      double s = 0;
      for (int64_t k = 0; k < h; ++k) {
        const double v = e2m1_to_f32(e2m1_unpack(w, k)) * ue8m0_to_f32(sf[k / kScaleBlock]);
        s += v * v;
      }
      n = std::sqrt(s);
    }
    return n;
  }
};

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

const ShapeData& shape_data(const std::string& name, int ep_size, int ep_rank, bool bias) {
  static std::map<std::string, std::unique_ptr<ShapeData>> cache;
  const std::string key = name + "/" + std::to_string(ep_size) + "/" + std::to_string(ep_rank) +
                          (bias ? "/bias" : "");
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  auto d = std::make_unique<ShapeData>();
  d->base.shape = shape_preset(name);
  d->base.ep_size = ep_size;
  d->base.ep_rank = ep_rank;
  d->base.max_tokens_per_rank = kCapacity;
  d->base.activation = activation_preset(name);
  d->host = synthetic_weights(d->base, kWeightSeed, bias);
  d->prepared = Sm90Layer::prepare_device_weights(d->base, clone_host(d->host));
  const int64_t el = d->host.num_local_experts, h = d->host.hidden, inter = d->host.intermediate;
  d->w2_row_norm.assign(static_cast<size_t>(el * h), 0.0);
  const uint8_t* w2 = d->host.w2.as<uint8_t>();
  const uint8_t* w2_sf = d->host.w2_sf.as<uint8_t>();
  parallel_for(el * h, [&](int64_t row) {
    double s = 0;
    for (int64_t j = 0; j < inter; ++j) {
      const double v = e2m1_to_f32(e2m1_unpack(w2 + row * inter / 2, j)) *
                       ue8m0_to_f32(w2_sf[row * inter / kScaleBlock + j / kScaleBlock]);
      s += v * v;
    }
    d->w2_row_norm[row] = std::sqrt(s);
  });
  return *cache.emplace(key, std::move(d)).first->second;
}

// ---------------------------------------------------------------------------------------------
// One case
// ---------------------------------------------------------------------------------------------
struct LayerCase {
  std::string shape;
  int ep_size = 1, ep_rank = 0;
  int64_t tokens = 0;
  Routing routing = Routing::kUniform;
  std::string activation;     // "" = the shape's preset
  bool fast_math = true;
  bool bias = false;
  double empty_fraction = 0.0;
  int64_t max_checked_tokens = 1 << 30;  // compare a strided subset beyond this
  std::string gemm_tile = "auto";          // LayerConfig::sm90.gemm_tile
  bool mega = false;                       // LayerConfig::sm90.mega_kernel
  bool mega_combine = true;                // LayerConfig::sm90.mega_combine (with mega)
  bool decode_front = true;                // LayerConfig::sm90.decode_front
  bool fp8 = false;                        // precision fp8 (from fp8_min_rows rows per expert)
  int64_t fp8_min_rows = 0;                // LayerConfig::fp8_min_rows_per_expert with fp8
  std::string describe() const {
    return shape + " ep " + std::to_string(ep_rank) + "/" + std::to_string(ep_size) + " T=" +
           std::to_string(tokens) + " routing=" + test::routing_name(routing) + " act=" +
           (activation.empty() ? "preset" : activation) + (fast_math ? " fast_math" : " exact_math") +
           (bias ? " bias" : "") + " empty=" + std::to_string(empty_fraction) + " tile=" + gemm_tile +
           (mega ? (mega_combine ? " mega" : " mega without the combine") : "") + (decode_front ? "" : " no_front") + (fp8 ? " fp8" : "");
  }
};

struct LayerRun {
  std::vector<uint16_t> y;
  std::vector<uint8_t> x_q, x_sf;
  std::vector<int32_t> slot_to_row;
  std::vector<uint8_t> h_q, h_sf;  // row order
};

LayerRun download_run(const Sm90Layer& layer, int64_t t, const DeviceArray<uint16_t>& y) {
  const LayerShape& s = layer.config().shape;
  const WorkspaceView& v = layer.workspace();
  LayerRun r;
  r.y = y.download(t * s.hidden);
  r.x_q = test::download(v.x_q, t * s.hidden);
  r.x_sf = test::download(v.x_sf, t * s.hidden / kScaleBlock);
  r.slot_to_row = test::download(v.slot_to_row, t * s.top_k);
  const auto offsets = test::download(v.row_offsets, layer.config().num_local_experts() + 1);
  const int64_t rows = offsets.back();
  r.h_q = test::download(v.h_q, rows * s.intermediate);
  r.h_sf = test::download(v.h_sf, rows * s.intermediate / kScaleBlock);
  return r;
}

std::unique_ptr<Sm90Layer> make_layer(const LayerCase& c, LayerConfig* config_out) {
  const ShapeData& sd = shape_data(c.shape, c.ep_size, c.ep_rank, c.bias);
  LayerConfig config = sd.base;
  if (!c.activation.empty()) config.activation = Activation::parse(c.activation);
  config.fast_math = c.fast_math;
  config.sm90.gemm_tile = c.gemm_tile;
  config.sm90.mega_kernel = c.mega;
  config.sm90.mega_combine = c.mega && c.mega_combine;
  config.sm90.decode_front = c.decode_front;
  if (c.fp8) {
    config.precision = Precision::kFp8;
    config.fp8_min_rows_per_expert = c.fp8_min_rows;
  }
  *config_out = config;
  return std::make_unique<Sm90Layer>(config, &sd.prepared);
}

void run_case(const LayerCase& c, uint64_t seed) {
  SCOPED_TRACE(c.describe());
  LayerConfig config;
  auto layer = make_layer(c, &config);
  const ShapeData& sd = shape_data(c.shape, c.ep_size, c.ep_rank, c.bias);
  const LayerShape& s = config.shape;
  const int64_t t = c.tokens, k = s.top_k, h = s.hidden, inter = s.intermediate;
  const int64_t first_local = config.first_local_expert(), el = config.num_local_experts();

  const auto x = test::make_inputs(t, h, seed);
  const auto routing = test::make_routing(c.routing, t, s.num_experts, k, seed, c.empty_fraction,
                                          first_local);
  DeviceArray<uint16_t> dx(x), dy(std::max<int64_t>(t, 1) * h);
  DeviceArray<int32_t> didx(routing.idx);
  DeviceArray<float> dw(routing.weights);
  dy.fill_bytes(0xFF);  // poison: every element must be written
  layer->forward(dx.get(), didx.get(), dw.get(), t, dy.get(), nullptr);
  layer->check_errors(nullptr);
  if (t == 0) return;
  const LayerRun run = download_run(*layer, t, dy);

  // 1. quantized input, bit for bit.
  std::vector<uint8_t> xq_ref(static_cast<size_t>(t * h)), xsf_ref(static_cast<size_t>(t * h / kScaleBlock));
  quantize_input(x.data(), t, h, xq_ref.data(), xsf_ref.data());
  ASSERT_EQ(run.x_q, xq_ref) << "x_q differs from the CPU quantizer";
  ASSERT_EQ(run.x_sf, xsf_ref) << "x_sf differs from the CPU quantizer";

  // The checked tokens: all, or a strided subset.
  std::vector<int64_t> tokens;
  const int64_t stride = std::max<int64_t>(1, (t + c.max_checked_tokens - 1) / c.max_checked_tokens);
  for (int64_t i = 0; i < t; i += stride) tokens.push_back(i);
  if (tokens.back() != t - 1) tokens.push_back(t - 1);
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<uint8_t> sub_xq(static_cast<size_t>(n * h)), sub_xsf(static_cast<size_t>(n * h / kScaleBlock));
  std::vector<int32_t> sub_idx(static_cast<size_t>(n * k));
  std::vector<float> sub_w(static_cast<size_t>(n * k));
  std::vector<uint8_t> sub_hq(static_cast<size_t>(n * k * inter), 0), sub_hsf(static_cast<size_t>(n * k * inter / kScaleBlock), 0);
  std::vector<uint16_t> sub_y(static_cast<size_t>(n * h));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tok = tokens[i];
    std::copy_n(xq_ref.begin() + tok * h, h, sub_xq.begin() + i * h);
    std::copy_n(xsf_ref.begin() + tok * h / kScaleBlock, h / kScaleBlock, sub_xsf.begin() + i * h / kScaleBlock);
    std::copy_n(routing.idx.begin() + tok * k, k, sub_idx.begin() + i * k);
    std::copy_n(routing.weights.begin() + tok * k, k, sub_w.begin() + i * k);
    std::copy_n(run.y.begin() + tok * h, h, sub_y.begin() + i * h);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t row = run.slot_to_row[tok * k + j];
      const int32_t id = routing.idx[tok * k + j];
      const bool local = id >= first_local && id < first_local + el;
      ASSERT_EQ(row >= 0, local) << "slot_to_row of token " << tok << " slot " << j;
      if (row < 0) continue;
      std::copy_n(run.h_q.begin() + int64_t(row) * inter, inter, sub_hq.begin() + (i * k + j) * inter);
      std::copy_n(run.h_sf.begin() + int64_t(row) * inter / kScaleBlock, inter / kScaleBlock,
                  sub_hsf.begin() + (i * k + j) * inter / kScaleBlock);
    }
  }

  // CPU reference fed the same quantized input.
  LayerConfig ref_config = config;
  ReferenceTrace trace;
  std::vector<uint16_t> y_ref(static_cast<size_t>(n * h));
  reference_forward_quantized(ref_config, sd.host, sub_xq.data(), sub_xsf.data(), sub_idx.data(),
                              sub_w.data(), n, y_ref.data(), &trace);

  // 3. flips of intermediate codes: each must be explained by L1 accumulators within the
  // summation-order bound (sm90_flip_check.hpp), and flips must be rare.
  const double gamma_h = kGammaC * std::sqrt(static_cast<double>(h)) * std::ldexp(1.0, -24);
  std::vector<double> x_norm(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (int64_t q = 0; q < h; ++q) {
      const double v = e4m3_to_f32(sub_xq[i * h + q]) * ue8m0_to_f32(sub_xsf[(i * h + q) / kScaleBlock]);
      ss += v * v;
    }
    x_norm[i] = std::sqrt(ss);
  }
  const uint16_t* w13_bias = sd.host.has_bias() ? sd.host.w13_bias.as<uint16_t>() : nullptr;
  int64_t flips = 0, codes = 0, bad_flips = 0;
  std::string first_bad;
  for (int64_t slot = 0; slot < n * k; ++slot) {
    const int32_t id = sub_idx[slot];
    if (id < first_local || id >= first_local + el) continue;
    const int64_t e = id - first_local;
    for (int64_t j = 0; j < inter; ++j) {
      const size_t qi = static_cast<size_t>(slot * inter + j), si = static_cast<size_t>((slot * inter + j) / kScaleBlock);
      ++codes;
      if (sub_hq[qi] == trace.h_q[qi] && sub_hsf[si] == trace.h_sf[si]) continue;
      ++flips;
      const double a = e4m3_to_f32(sub_hq[qi]) * ue8m0_to_f32(sub_hsf[si]);
      const double b = e4m3_to_f32(trace.h_q[qi]) * ue8m0_to_f32(trace.h_sf[si]);
      const size_t acc = static_cast<size_t>(slot * 2 * inter);
      const double g_cpu = trace.l1_acc[acc + j], u_cpu = trace.l1_acc[acc + inter + j];
      auto bound = [&](int64_t row) {
        double s_abs = x_norm[slot / k] * sd.w13_norm(e, row);
        if (w13_bias) s_abs += std::fabs(bf16_to_f32(w13_bias[e * 2 * inter + row]));
        return gamma_h * s_abs;
      };
      if (!test::flip_explained(config.activation, a, sub_hsf[si], g_cpu, u_cpu, bound(j),
                                bound(inter + j), sub_w[slot])) {
        if (bad_flips++ == 0)
          first_bad = "slot " + std::to_string(slot) + " j " + std::to_string(j) + ": gpu " +
                      std::to_string(a) + " (sf " + std::to_string(sub_hsf[si]) + ") cpu " +
                      std::to_string(b) + " (sf " + std::to_string(trace.h_sf[si]) + "), g " +
                      std::to_string(g_cpu) + " +- " + std::to_string(bound(j)) + ", u " +
                      std::to_string(u_cpu) + " +- " + std::to_string(bound(inter + j));
      }
    }
  }
  EXPECT_EQ(bad_flips, 0) << bad_flips << " intermediate codes are not explained by L1 "
                          << "summation order; first: " << first_bad;
  EXPECT_LE(flips, std::max<double>(2.0, kMaxFlipFraction * codes))
      << flips << " of " << codes << " intermediate codes flipped";

  // 2. L2 + combine recomputed on the CPU from the GPU's own intermediate, slot by slot.
  std::vector<std::vector<uint16_t>> o_slot(static_cast<size_t>(k));
  for (int64_t j = 0; j < k; ++j) {
    std::vector<int32_t> only(sub_idx.size(), -1);
    for (int64_t i = 0; i < n; ++i) only[i * k + j] = sub_idx[i * k + j];
    o_slot[j].resize(static_cast<size_t>(n * h));
    reference_l2_combine(ref_config, sd.host, sub_hq.data(), sub_hsf.data(), only.data(),
                         sub_w.data(), n, o_slot[j].data());
  }
  const double gamma = kGammaC * std::sqrt(static_cast<double>(inter)) * std::ldexp(1.0, -24);
  double worst_fraction = 0;
  int64_t exact = 0, over = 0;
  std::string worst;
  const uint16_t* w2_bias = sd.host.has_bias() ? sd.host.w2_bias.as<uint16_t>() : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> a_norm(static_cast<size_t>(k), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      double ss = 0;
      for (int64_t q = 0; q < inter; ++q) {
        const size_t qi = static_cast<size_t>((i * k + j) * inter + q);
        const double v = e4m3_to_f32(sub_hq[qi]) * ue8m0_to_f32(sub_hsf[qi / kScaleBlock]);
        ss += v * v;
      }
      a_norm[j] = std::sqrt(ss);
    }
    for (int64_t col = 0; col < h; ++col) {
      float sum = 0.0f;
      double bound = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t id = sub_idx[i * k + j];
        if (id < first_local || id >= first_local + el) continue;
        const float o = bf16_to_f32(o_slot[j][i * h + col]);
        sum += o;
        double s_abs = a_norm[j] * sd.w2_row_norm[(id - first_local) * h + col];
        if (w2_bias)
          s_abs += std::fabs(sub_w[i * k + j] * bf16_to_f32(w2_bias[(id - first_local) * h + col]));
        bound += gamma * s_abs + bf16_ulp(o);
      }
      const float want = bf16_round(sum);
      bound += bf16_ulp(want);
      const float got = bf16_to_f32(sub_y[i * h + col]);
      exact += got == want || (std::isnan(got) && std::isnan(want));
      const double err = std::fabs(double(got) - double(want));
      const double fraction = bound > 0 ? err / bound : (err == 0 ? 0 : 1e9);
      if (!(fraction <= 1.0)) {
        if (over++ == 0)
          worst = "token " + std::to_string(tokens[i]) + " col " + std::to_string(col) + ": gpu " +
                  std::to_string(got) + " cpu(h_gpu) " + std::to_string(want) + " bound " + std::to_string(bound);
      }
      worst_fraction = std::max(worst_fraction, std::isnan(fraction) ? 1e9 : fraction);
    }
  }
  std::printf("[ layer    ] %s: %lld/%lld tokens checked; y vs CPU(L2 from GPU h): %.1f%% bitwise equal, "
              "%.3f of the bound used; h flips %lld of %lld codes\n",
              c.describe().c_str(), static_cast<long long>(n), static_cast<long long>(t),
              100.0 * exact / double(n * h), worst_fraction, static_cast<long long>(flips),
              static_cast<long long>(codes));
  EXPECT_EQ(over, 0) << over << " outputs exceed the summation-order bound; first: " << worst;

  // 4. against the full reference (flips included): diff metric overall, worst row, worst expert.
  std::vector<double> rd(y_ref.size());
  for (size_t i = 0; i < y_ref.size(); ++i) rd[i] = bf16_to_f32(y_ref[i]);
  const DiffReport rep = compare_output(ref_config, sub_y.data(), rd.data(), sub_idx.data(), n);
  EXPECT_LE(rep.diff, kMaxDiff) << "diff vs reference";
  EXPECT_LE(rep.worst_row_diff, kMaxDiff * 10) << "worst row " << rep.worst_row;
  EXPECT_LE(rep.worst_expert_diff, kMaxDiff * 10) << "worst expert " << rep.worst_expert;
}

// ---------------------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------------------
TEST(Sm90Layer, SmallAllTokenCountsAndRoutings) {
  MEGAMOE_REQUIRE_SM90();
  const int64_t tokens[] = {0, 1, 7, 64, 513, 4096};
  const Routing kinds[] = {Routing::kUniform, Routing::kSkewed, Routing::kAdversarial};
  uint64_t seed = 1;
  for (Routing r : kinds)
    for (int64_t t : tokens) {
      LayerCase c;
      c.shape = "small";
      c.tokens = t;
      c.routing = r;
      c.empty_fraction = r == Routing::kUniform ? 0.1 : 0.0;
      c.max_checked_tokens = 512;
      run_case(c, seed++);
    }
}

// FP8 mode (docs/numerics.md "FP8 mode"): Sm90Layer with precision fp8, on every call
// (fp8_min_rows_per_expert 0) and by the default per-call rule, against the CPU's FP8 mode on the
// same inputs (the FP8 tensor cores accumulate with fewer bits: a small diff, not bitwise) and
// against the FP64 ideal (issue 31's bar: at most 1.5x the exact mode's diff).
TEST(Sm90Layer, Fp8ModeAgainstTheCpuFp8ModeAndTheIdeal) {
  MEGAMOE_REQUIRE_SM90();
  struct Case { int64_t tokens; int64_t min_rows; Routing routing; };
  const Case cases[] = {{64, 0, Routing::kUniform}, {513, 0, Routing::kSkewed},
                        {2048, 128, Routing::kUniform}};
  uint64_t seed = 900;
  for (const Case& c : cases)
  for (bool mega : {false, true}) {  // the chain, and the MegaMoE kernel (its rebase inside)
    LayerConfig cfg;
    cfg.sm90.mega_kernel = mega;
    if (mega) cfg.sm90.gemm_tile = "fp8_128x192_k2_async";  // (the policy chains the FP8 mode)
    cfg.shape = shape_preset("small");
    cfg.max_tokens_per_rank = kCapacity;
    cfg.precision = Precision::kFp8;
    cfg.fp8_min_rows_per_expert = c.min_rows;
    ASSERT_TRUE(cfg.fp8_for_tokens(c.tokens));
    const MoeWeights host = synthetic_weights(cfg, seed, false);
    const auto x = test::make_inputs(c.tokens, cfg.shape.hidden, seed);
    const auto r = test::make_routing(c.routing, c.tokens, cfg.shape.num_experts, cfg.shape.top_k,
                                      seed, 0.05, 0);
    Sm90Layer layer(cfg, synthetic_weights(cfg, seed, false));
    DeviceArray<uint16_t> dx(x), dy(x.size());
    DeviceArray<int32_t> didx(r.idx);
    DeviceArray<float> dw(r.weights);
    layer.forward(dx.get(), didx.get(), dw.get(), c.tokens, dy.get(), nullptr);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(layer.last_gemms_fused(), mega) << "T=" << c.tokens;
    const auto y = dy.download();
    std::vector<uint16_t> y_fp8(x.size()), y_exact(x.size());
    std::vector<double> ideal(x.size()), cpu_fp8(x.size());
    reference_forward(cfg, host, x.data(), r.idx.data(), r.weights.data(), c.tokens, y_fp8.data());
    LayerConfig exact = cfg;
    exact.precision = Precision::kExact;
    exact.sm90.gemm_tile = "auto";  // (an FP8 tile names the FP8 mode's calls only)
    reference_forward(exact, host, x.data(), r.idx.data(), r.weights.data(), c.tokens, y_exact.data());
    ideal_forward(cfg, host, x.data(), r.idx.data(), r.weights.data(), c.tokens, ideal.data());
    for (size_t i = 0; i < y_fp8.size(); ++i) cpu_fp8[i] = bf16_to_f32(y_fp8[i]);
    const DiffReport vs_cpu = compare_output(cfg, y.data(), cpu_fp8.data(), r.idx.data(), c.tokens);
    const DiffReport gpu_ideal = compare_output(cfg, y.data(), ideal.data(), r.idx.data(), c.tokens);
    const DiffReport exact_ideal = compare_output(cfg, y_exact.data(), ideal.data(), r.idx.data(), c.tokens);
    std::printf("[ layer    ] fp8%s small T=%lld: vs the CPU's FP8 mode diff %.2e (worst row %.2e); vs "
                "ideal %.3e against the exact mode's %.3e (%.4fx)\n", mega ? " mega" : "", (long long)c.tokens,
                vs_cpu.diff, vs_cpu.worst_row_diff, gpu_ideal.diff, exact_ideal.diff,
                gpu_ideal.diff / exact_ideal.diff);
    EXPECT_LE(vs_cpu.diff, 1e-4) << "T=" << c.tokens << (mega ? " mega" : "");
    EXPECT_LE(gpu_ideal.diff, 1.5 * exact_ideal.diff) << "T=" << c.tokens << (mega ? " mega" : "");
    if (mega) seed++;
  }
}

// The small shape at T tokens with activation `act` (bias for swiglu_oai), uniform routing at
// T = 64 and skewed otherwise, 10 % empty slots.
LayerCase small_case(int64_t t, const char* act, bool fast_math, const char* gemm_tile = "auto") {
  LayerCase c;
  c.shape = "small";
  c.tokens = t;
  c.routing = t == 64 ? Routing::kUniform : Routing::kSkewed;
  c.activation = act;
  c.bias = std::string(act) == "swiglu_oai";
  c.fast_math = fast_math;
  c.empty_fraction = 0.1;
  c.gemm_tile = gemm_tile;
  return c;
}

TEST(Sm90Layer, SmallAllActivationsBothMathModes) {
  MEGAMOE_REQUIRE_SM90();
  const char* acts[] = {"swiglu", "swiglu:clamp=7", "situ", "swiglu_oai"};
  uint64_t seed = 100;
  for (const char* a : acts)
    for (bool fast : {true, false})
      for (int64_t t : {int64_t(64), int64_t(513)}) run_case(small_case(t, a, fast), seed++);
}

// The layer on the serial-mainloop tiles (LayerConfig::sm90.gemm_tile = "serial", what the policy
// runs for weights with a scale byte >= 128), and on one forced tile of each kind, in the same
// process as the default policy's runs.
TEST(Sm90Layer, SerialAndForcedTiles) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 300;
  for (const char* tile : {"serial", "decode_128x16_k2_warp", "prefill_256x128_k2_staged"}) {
    for (int64_t t : {int64_t(1), int64_t(64), int64_t(513)}) {
      for (const char* a : {"situ", "swiglu_oai"}) run_case(small_case(t, a, true, tile), seed++);
    }
  }
}

TEST(Sm90Layer, DeepseekV3) {
  MEGAMOE_REQUIRE_SM90();
  struct P { int64_t t; Routing r; const char* act; bool fast; int64_t checked; };
  const P cases[] = {{0, Routing::kUniform, "", true, 64},
                     {1, Routing::kUniform, "", true, 64},
                     {1, Routing::kAdversarial, "", true, 64},
                     {7, Routing::kSkewed, "", true, 64},
                     {7, Routing::kUniform, "situ", true, 64},
                     {64, Routing::kUniform, "", true, 64},
                     {64, Routing::kUniform, "", false, 64},
                     {64, Routing::kAdversarial, "", false, 32},
                     {64, Routing::kSkewed, "swiglu_oai", true, 16},
                     {513, Routing::kSkewed, "", true, 24},
                     {513, Routing::kUniform, "swiglu:clamp=7", false, 16},
                     {4096, Routing::kAdversarial, "", true, 8},
                     {4096, Routing::kUniform, "", true, 8}};
  uint64_t seed = 300;
  for (const P& p : cases) {
    LayerCase c;
    c.shape = "deepseek-v3";
    c.tokens = p.t;
    c.routing = p.r;
    c.activation = p.act;
    c.bias = std::string(p.act) == "swiglu_oai";
    c.fast_math = p.fast;
    c.max_checked_tokens = p.checked;
    run_case(c, seed++);
  }
}

TEST(Sm90Layer, KimiK3Ep8) {
  MEGAMOE_REQUIRE_SM90();
  struct P { int64_t t; Routing r; const char* act; bool fast; int64_t checked; };
  const P cases[] = {{0, Routing::kUniform, "", true, 64},
                     {1, Routing::kUniform, "", true, 64},
                     {1, Routing::kAdversarial, "", true, 64},
                     {7, Routing::kSkewed, "", true, 64},
                     {7, Routing::kUniform, "swiglu", true, 64},
                     {64, Routing::kUniform, "", true, 64},
                     {64, Routing::kSkewed, "", false, 64},
                     {64, Routing::kAdversarial, "", true, 16},
                     {64, Routing::kUniform, "swiglu_oai", false, 32},
                     {513, Routing::kAdversarial, "", true, 16},
                     {513, Routing::kSkewed, "", false, 32},
                     {4096, Routing::kUniform, "", true, 32},
                     {4096, Routing::kSkewed, "", true, 16}};
  uint64_t seed = 400;
  for (const P& p : cases) {
    LayerCase c;
    c.shape = "kimi-k3";
    c.ep_size = 8;
    c.ep_rank = 3;
    c.tokens = p.t;
    c.routing = p.r;
    c.activation = p.act;
    c.bias = std::string(p.act) == "swiglu_oai";
    c.fast_math = p.fast;
    c.max_checked_tokens = p.checked;
    run_case(c, seed++);
  }
}

// ---------------------------------------------------------------------------------------------
// Graph replay, determinism, errors
// ---------------------------------------------------------------------------------------------
// One call's inputs on the device: the case's tokens, routing and empty slots, from `seed`.
struct DeviceInput {
  DeviceArray<uint16_t> x;
  DeviceArray<int32_t> idx;
  DeviceArray<float> w;
};

DeviceInput upload_input(const LayerCase& c, const LayerConfig& config, uint64_t seed) {
  const LayerShape& s = config.shape;
  const auto routing = test::make_routing(c.routing, c.tokens, s.num_experts, s.top_k, seed,
                                          c.empty_fraction, config.first_local_expert());
  return DeviceInput{DeviceArray<uint16_t>(test::make_inputs(c.tokens, s.hidden, seed)),
                     DeviceArray<int32_t>(routing.idx), DeviceArray<float>(routing.weights)};
}

void check_graph_and_determinism(const LayerCase& c, uint64_t seed) {
  SCOPED_TRACE(c.describe());
  LayerConfig config;
  auto layer = make_layer(c, &config);
  const LayerShape& s = config.shape;
  const int64_t t = c.tokens;
  const DeviceInput in = upload_input(c, config, seed);
  DeviceArray<uint16_t> dy(t * s.hidden);
  const Stream stream;

  dy.fill_bytes(0xFF);
  layer->forward(in.x.get(), in.idx.get(), in.w.get(), t, dy.get(), stream);
  layer->check_errors(stream);
  const LayerRun eager = download_run(*layer, t, dy);

  dy.fill_bytes(0xFF);
  layer->forward(in.x.get(), in.idx.get(), in.w.get(), t, dy.get(), stream);
  layer->check_errors(stream);
  const LayerRun again = download_run(*layer, t, dy);
  EXPECT_EQ(again.y, eager.y) << "run-to-run: y differs";
  EXPECT_EQ(again.h_q, eager.h_q) << "run-to-run: h_q differs";
  EXPECT_EQ(again.slot_to_row, eager.slot_to_row) << "run-to-run: slot_to_row differs";

  const StreamGraph graph(stream, [&] {
    layer->forward(in.x.get(), in.idx.get(), in.w.get(), t, dy.get(), stream);
  });
  for (int replay = 0; replay < 3; ++replay) {
    dy.fill_bytes(0xFF);
    graph.launch(stream);
    layer->check_errors(stream);
    const LayerRun g = download_run(*layer, t, dy);
    EXPECT_EQ(g.y, eager.y) << "graph replay " << replay << ": y differs from eager";
    EXPECT_EQ(g.h_q, eager.h_q) << "graph replay " << replay << ": h_q differs from eager";
  }
}

TEST(Sm90Layer, GraphReplayEqualsEagerAndRunsAreDeterministic) {
  MEGAMOE_REQUIRE_SM90();
  LayerCase a;
  a.shape = "small";
  a.tokens = 513;
  a.routing = Routing::kSkewed;
  a.empty_fraction = 0.1;
  check_graph_and_determinism(a, 900);
  LayerCase b;
  b.shape = "kimi-k3";
  b.ep_size = 8;
  b.ep_rank = 3;
  b.tokens = 4096;
  b.routing = Routing::kUniform;
  check_graph_and_determinism(b, 901);
  LayerCase d;
  d.shape = "deepseek-v3";
  d.tokens = 64;
  d.routing = Routing::kAdversarial;
  d.fast_math = false;
  check_graph_and_determinism(d, 902);
  // T = 1: the tile policy runs L1 (both shapes) and L2 (small) in split-K parts.
  LayerCase e;
  e.shape = "deepseek-v3";
  e.tokens = 1;
  e.routing = Routing::kUniform;
  check_graph_and_determinism(e, 903);
  LayerCase f;
  f.shape = "small";
  f.tokens = 1;
  f.routing = Routing::kUniform;
  check_graph_and_determinism(f, 904);
}

// Programmatic dependent launch changes timing only: three calls on two inputs (A, B, A) issued
// back to back without synchronization, eagerly and as one captured graph, give bit for bit the
// outputs of plain launches with a synchronization after each call. Back-to-back calls are where
// a wait placed too late would show: each call's quantize / gather overwrite buffers the previous
// call's kernels read, and the GEMMs start streaming weights before the previous kernel ends.
void check_programmatic_launch(const LayerCase& c, uint64_t seed) {
  SCOPED_TRACE(c.describe());
  LayerConfig config;
  auto layer = make_layer(c, &config);
  const LayerShape& s = config.shape;
  const int64_t t = c.tokens;
  const DeviceInput in[2] = {upload_input(c, config, seed), upload_input(c, config, seed + 1)};
  constexpr int kOrder[3] = {0, 1, 0};
  DeviceArray<uint16_t> dy[3] = {DeviceArray<uint16_t>(t * s.hidden),
                                 DeviceArray<uint16_t>(t * s.hidden),
                                 DeviceArray<uint16_t>(t * s.hidden)};
  const Stream stream;
  auto run_calls = [&](bool sync_each) {
    for (int i = 0; i < 3; ++i) {
      const DeviceInput& x = in[kOrder[i]];
      layer->forward(x.x.get(), x.idx.get(), x.w.get(), t, dy[i].get(), stream);
      if (sync_each) MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  };
  auto outputs = [&] {
    layer->check_errors(stream);
    std::vector<std::vector<uint16_t>> ys;
    for (auto& y : dy) ys.push_back(y.download(t * s.hidden));
    return ys;
  };
  auto clear = [&] {
    for (auto& y : dy) y.fill_bytes(0xFF);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());  // the fills are done before the stream's calls
  };

  layer->set_programmatic_launch(false);
  clear();
  run_calls(true);
  const auto plain = outputs();
  ASSERT_NE(plain[0], plain[1]) << "the two inputs must give different outputs";
  EXPECT_EQ(plain[2], plain[0]) << "plain launches: the same input gave different outputs";

  layer->set_programmatic_launch(true);
  clear();
  run_calls(false);
  const auto chained = outputs();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(chained[i], plain[i]) << "programmatic, eager: call " << i;

  const StreamGraph graph(stream, [&] { run_calls(false); });
  for (int replay = 0; replay < 2; ++replay) {
    clear();
    graph.launch(stream);
    const auto g = outputs();
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(g[i], plain[i]) << "programmatic, graph replay " << replay << ": call " << i;
    }
  }
}

TEST(Sm90Layer, ProgrammaticLaunchChangesNothingButTiming) {
  MEGAMOE_REQUIRE_SM90();
  LayerCase a;  // T = 1: the decode tiles (L1 split-K), weights prefetched before the wait
  a.shape = "deepseek-v3";
  a.tokens = 1;
  a.routing = Routing::kUniform;
  check_programmatic_launch(a, 910);
  LayerCase b;  // Kimi-K3 (EP 8) at T = 64: the 128-row decode tile, several waves
  b.shape = "kimi-k3";
  b.ep_size = 8;
  b.ep_rank = 3;
  b.tokens = 64;
  b.routing = Routing::kSkewed;
  check_programmatic_launch(b, 911);
  LayerCase d;  // prefill tiles (setmaxnreg: they wait first), empty experts
  d.shape = "small";
  d.tokens = 4096;
  d.routing = Routing::kSkewed;
  d.empty_fraction = 0.1;
  check_programmatic_launch(d, 912);
}

// A shape at one rank's share of the experts (ep_size, ep_rank; no expert-parallel runtime).
struct ShapeRank {
  const char* name;
  int ep_size, ep_rank;
};

// The decode front (LayerConfig::sm90.decode_front: quantize, dispatch and gather in one launch)
// against the three launches: the same workspace and output bit for bit, chained and fused GEMMs,
// at every decode token count it takes and just above its bound (where both run the three).
TEST(Sm90Layer, DecodeFrontChangesNothingButTiming) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 3400;
  for (const ShapeRank& sh :
       {ShapeRank{"small", 1, 0}, ShapeRank{"deepseek-v3", 1, 0}, ShapeRank{"kimi-k3", 8, 3}}) {
    for (int64_t t : {int64_t(1), int64_t(8), int64_t(64), int64_t(65), int64_t(129)}) {
      for (bool mega : {false, true}) {
        LayerCase c;
        c.shape = sh.name;
        c.ep_size = sh.ep_size;
        c.ep_rank = sh.ep_rank;
        c.tokens = t;
        c.routing = t == 8 ? Routing::kSkewed : Routing::kUniform;
        c.empty_fraction = t == 8 ? 0.1 : 0.0;
        c.mega = mega;
        SCOPED_TRACE(c.describe());
        LayerConfig config;
        auto with = make_layer(c, &config);
        c.decode_front = false;
        auto without = make_layer(c, &config);
        const LayerShape& s = config.shape;
        const auto x = test::make_inputs(t, s.hidden, seed);
        const auto routing = test::make_routing(c.routing, t, s.num_experts, s.top_k, seed++,
                                                c.empty_fraction, config.first_local_expert());
        DeviceArray<uint16_t> dx(x), dy(t * s.hidden);
        DeviceArray<int32_t> didx(routing.idx);
        DeviceArray<float> dw(routing.weights);
        LayerRun runs[2];
        Sm90Layer* layers[2] = {without.get(), with.get()};
        for (int i = 0; i < 2; ++i) {
          dy.fill_bytes(0xFF);
          layers[i]->forward(dx.get(), didx.get(), dw.get(), t, dy.get(), nullptr);
          layers[i]->check_errors(nullptr);
          runs[i] = download_run(*layers[i], t, dy);
        }
        EXPECT_EQ(runs[1].x_q, runs[0].x_q);
        EXPECT_EQ(runs[1].x_sf, runs[0].x_sf);
        EXPECT_EQ(runs[1].slot_to_row, runs[0].slot_to_row);
        EXPECT_EQ(runs[1].h_q, runs[0].h_q);
        EXPECT_EQ(runs[1].h_sf, runs[0].h_sf);
        EXPECT_EQ(runs[1].y, runs[0].y);
      }
    }
  }
}

TEST(Sm90Layer, InvalidExpertIdsAreReportedAndTreatedAsEmpty) {
  MEGAMOE_REQUIRE_SM90();
  LayerCase c;
  c.shape = "small";
  c.tokens = 64;
  LayerConfig config;
  auto layer = make_layer(c, &config);
  const LayerShape& s = config.shape;
  const auto x = test::make_inputs(c.tokens, s.hidden, 5);
  auto routing = test::make_routing(Routing::kUniform, c.tokens, s.num_experts, s.top_k, 5);
  auto cleaned = routing;
  const int64_t bad_slots[] = {3 * s.top_k + 1, 40 * s.top_k + 2};
  routing.idx[bad_slots[0]] = static_cast<int32_t>(s.num_experts);  // one past the end
  routing.idx[bad_slots[1]] = -5;
  for (int64_t slot : bad_slots) cleaned.idx[slot] = -1;

  DeviceArray<uint16_t> dx(x), dy(c.tokens * s.hidden), dy_clean(c.tokens * s.hidden);
  DeviceArray<int32_t> didx(routing.idx), dclean(cleaned.idx);
  DeviceArray<float> dw(routing.weights);
  layer->forward(dx.get(), didx.get(), dw.get(), c.tokens, dy.get(), nullptr);
  try {
    layer->check_errors(nullptr);
    ADD_FAILURE() << "check_errors did not report the invalid expert ids";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("token 3 slot 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("2 invalid slot"), std::string::npos) << msg;
  }
  layer->check_errors(nullptr);  // cleared: no throw
  EXPECT_FALSE(layer->error_pending());
  layer->forward(dx.get(), dclean.get(), dw.get(), c.tokens, dy_clean.get(), nullptr);
  layer->check_errors(nullptr);
  EXPECT_EQ(dy.download(), dy_clean.download()) << "invalid slots must act as empty (-1) slots";

  // Without a check in between, the next call reports it (after the bad call has finished: the
  // host sees the flag without waiting) and launches nothing: y keeps its poison.
  layer->forward(dx.get(), didx.get(), dw.get(), c.tokens, dy.get(), nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(layer->error_pending());
  DeviceArray<uint16_t> dy_next(c.tokens * s.hidden);
  dy_next.fill_bytes(0x7F);
  try {
    layer->forward(dx.get(), dclean.get(), dw.get(), c.tokens, dy_next.get(), nullptr);
    ADD_FAILURE() << "the next forward did not report the earlier call's invalid expert ids";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("token 3 slot 1"), std::string::npos) << e.what();
  }
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(dy_next.download(), std::vector<uint16_t>(c.tokens * s.hidden, 0x7F7F))
      << "the reporting call launched its kernels";
  EXPECT_FALSE(layer->error_pending());
  layer->forward(dx.get(), dclean.get(), dw.get(), c.tokens, dy_next.get(), nullptr);  // clean again
  layer->check_errors(nullptr);
  EXPECT_EQ(dy_next.download(), dy_clean.download());

  // Opt-in synchronous checking: the bad call itself throws.
  LayerConfig sync_config = config;
  sync_config.sync_error_check = true;
  const ShapeData& sd = shape_data(c.shape, c.ep_size, c.ep_rank, c.bias);
  Sm90Layer sync_layer(sync_config, &sd.prepared);
  sync_layer.forward(dx.get(), dclean.get(), dw.get(), c.tokens, dy_next.get(), nullptr);
  EXPECT_THROW(sync_layer.forward(dx.get(), didx.get(), dw.get(), c.tokens, dy.get(), nullptr), Error);
  sync_layer.check_errors(nullptr);  // reported and cleared by the call

  // T above capacity: a host-side error before anything is launched.
  EXPECT_THROW(layer->forward(dx.get(), didx.get(), dw.get(), kCapacity + 1, dy.get(), nullptr), Error);
}

}  // namespace
}  // namespace megamoe::sm90

namespace megamoe::sm90 {
namespace {

// The public API: MoeLayer with backend "sm90" (TensorView checks, then Sm90Backend) gives the
// same bits as Sm90Layer, and "auto" picks sm90 on an H200.
TEST(Sm90Layer, MoeLayerSm90BackendMatchesSm90Layer) {
  MEGAMOE_REQUIRE_SM90();
  LayerConfig config;
  config.shape = shape_preset("small");
  config.max_tokens_per_rank = 128;
  config.activation = activation_preset("small");
  const int64_t t = 100;
  const LayerShape& s = config.shape;
  const auto x = test::make_inputs(t, s.hidden, 77);
  const auto routing = test::make_routing(Routing::kSkewed, t, s.num_experts, s.top_k, 77, 0.1);
  DeviceArray<uint16_t> dx(x), y_api(t * s.hidden), y_direct(t * s.hidden);
  DeviceArray<int32_t> didx(routing.idx);
  DeviceArray<float> dw(routing.weights);

  ASSERT_FALSE(available_backends().empty());
  EXPECT_EQ(available_backends().front(), "sm90");
  MoeLayer layer(config, synthetic_weights(config, kWeightSeed), "auto");
  EXPECT_EQ(layer.backend(), "sm90");
  EXPECT_EQ(layer.device(), Device::cuda(cuda::current_device()));
  const Device dev = layer.device();
  layer.forward(TensorView::contiguous(dx.get(), DType::kBF16, {t, s.hidden}, dev),
                TensorView::contiguous(didx.get(), DType::kI32, {t, s.top_k}, dev),
                TensorView::contiguous(dw.get(), DType::kF32, {t, s.top_k}, dev),
                TensorView::contiguous(y_api.get(), DType::kBF16, {t, s.hidden}, dev));
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());

  Sm90Layer direct(config, synthetic_weights(config, kWeightSeed));
  direct.forward(dx.get(), didx.get(), dw.get(), t, y_direct.get(), nullptr);
  direct.check_errors(nullptr);
  EXPECT_EQ(y_api.download(), y_direct.download());

  // Host tensors are rejected by the sm90 backend with a message naming the argument.
  std::vector<uint16_t> host_y(static_cast<size_t>(t * s.hidden));
  EXPECT_THROW(layer.forward(TensorView::contiguous(const_cast<uint16_t*>(x.data()), DType::kBF16, {t, s.hidden}),
                             TensorView::contiguous(didx.get(), DType::kI32, {t, s.top_k}, dev),
                             TensorView::contiguous(dw.get(), DType::kF32, {t, s.top_k}, dev),
                             TensorView::contiguous(host_y.data(), DType::kBF16, {t, s.hidden})),
               Error);
}

}  // namespace
}  // namespace megamoe::sm90

namespace megamoe::sm90 {
namespace {

// numerics.md section 7: NaN/Inf in x never crash; finite overflow saturates, NaN propagates.
// Tokens are independent, so the other tokens' outputs must be bitwise those of a run without the
// non-finite tokens, and a poisoned token's output has NaN exactly where the CPU reference has.
TEST(Sm90Layer, NonFiniteInputsPropagateLikeTheReference) {
  MEGAMOE_REQUIRE_SM90();
  LayerCase c;
  c.shape = "small";
  c.tokens = 64;
  LayerConfig config;
  auto layer = make_layer(c, &config);
  const ShapeData& sd = shape_data(c.shape, 1, 0, false);
  const LayerShape& s = config.shape;
  const int64_t t = c.tokens, h = s.hidden;
  auto x = test::make_inputs(t, h, 21);
  const auto clean_x = x;
  const auto routing = test::make_routing(Routing::kUniform, t, s.num_experts, s.top_k, 21);
  const int64_t nan_token = 5, inf_token = 9, big_token = 13;
  x[static_cast<size_t>(nan_token * h + 17)] = bf16_from_f32(std::nanf(""));
  x[static_cast<size_t>(inf_token * h + 300)] = bf16_from_f32(INFINITY);
  x[static_cast<size_t>(big_token * h + 2)] = bf16_from_f32(-3.0e38f);

  DeviceArray<uint16_t> dx(x), dclean(clean_x), dy(t * h), dy_clean(t * h);
  DeviceArray<int32_t> didx(routing.idx);
  DeviceArray<float> dw(routing.weights);
  layer->forward(dx.get(), didx.get(), dw.get(), t, dy.get(), nullptr);
  layer->check_errors(nullptr);
  layer->forward(dclean.get(), didx.get(), dw.get(), t, dy_clean.get(), nullptr);
  layer->check_errors(nullptr);
  const auto y = dy.download(), y_clean = dy_clean.download();
  for (int64_t tok = 0; tok < t; ++tok) {
    if (tok == nan_token || tok == inf_token || tok == big_token) continue;
    for (int64_t i = 0; i < h; ++i)
      ASSERT_EQ(y[tok * h + i], y_clean[tok * h + i]) << "token " << tok << " changed";
  }
  std::vector<uint8_t> xq(static_cast<size_t>(t * h)), xsf(static_cast<size_t>(t * h / kScaleBlock));
  quantize_input(x.data(), t, h, xq.data(), xsf.data());
  std::vector<uint16_t> y_ref(static_cast<size_t>(t * h));
  reference_forward_quantized(config, sd.host, xq.data(), xsf.data(), routing.idx.data(),
                              routing.weights.data(), t, y_ref.data());
  for (int64_t tok : {nan_token, inf_token, big_token}) {
    int64_t nan_gpu = 0, nan_ref = 0, mismatched = 0;
    for (int64_t i = 0; i < h; ++i) {
      const bool a = std::isnan(bf16_to_f32(y[tok * h + i]));
      const bool b = std::isnan(bf16_to_f32(y_ref[tok * h + i]));
      nan_gpu += a;
      nan_ref += b;
      mismatched += a != b;
    }
    std::printf("[ nonfinite] token %lld: %lld NaN outputs on the GPU, %lld in the reference\n",
                static_cast<long long>(tok), static_cast<long long>(nan_gpu), static_cast<long long>(nan_ref));
    EXPECT_EQ(mismatched, 0) << "token " << tok << ": NaN pattern differs from the reference";
  }
}

}  // namespace
}  // namespace megamoe::sm90

// ---------------------------------------------------------------------------------------------
// The MegaMoE kernel (LayerConfig::sm90.mega_kernel; kernels/sm90/sm90_mega_moe.cuh)
// ---------------------------------------------------------------------------------------------
namespace megamoe::sm90 {
namespace {

// Every counter the MegaMoE kernel and the decode launches use is back at zero after a call.
void expect_counters_zero(const Sm90Layer& layer) {
  const WorkspaceView& v = layer.workspace();
  const auto ready = test::download(v.mega.ready, v.mega.capacity);
  const auto consumed = test::download(v.mega.consumed, v.mega.capacity);
  const auto units = test::download(v.split_k.unit_counter, 2);
  EXPECT_EQ(std::count(ready.begin(), ready.end(), 0), v.mega.capacity) << "ready counters left set";
  EXPECT_EQ(std::count(consumed.begin(), consumed.end(), 0), v.mega.capacity)
      << "consumed counters left set";
  EXPECT_EQ(units[0], 0) << "unit counter left set";
  EXPECT_EQ(units[1], 0) << "CTA exit counter left set";
  const auto combine = test::download(v.mega.combine_counters, 2);
  EXPECT_EQ(combine[0], 0u) << "the combine's CTA count left set";
}

// The fused kernel against the chain on the same tile: y and the intermediate h_q / h_sf bit for
// bit (the same mainloop over the same operands), on two calls of each layer.
// y_too = false: only the intermediate (the chain's L2 may run another tile than the fused
// kernel's, which changes the FP32 summation order of y).
void expect_mega_equals_chain(LayerCase c, uint64_t seed, bool y_too = true) {
  LayerConfig config;
  c.mega = false;
  auto chain = make_layer(c, &config);
  c.mega = true;
  auto mega = make_layer(c, &config);
  SCOPED_TRACE(c.describe());
  const LayerShape& s = config.shape;
  const int64_t t = c.tokens;
  const DeviceInput in = upload_input(c, config, seed);
  DeviceArray<uint16_t> dy(std::max<int64_t>(t, 1) * s.hidden);
  const Stream stream;
  auto run = [&](Sm90Layer& layer) {
    dy.fill_bytes(0xFF);
    layer.forward(in.x.get(), in.idx.get(), in.w.get(), t, dy.get(), stream);
    layer.check_errors(stream);
    return download_run(layer, t, dy);
  };
  const LayerRun want = run(*chain);
  EXPECT_FALSE(chain->last_gemms_fused());
  for (int call = 0; call < 2; ++call) {
    const LayerRun got = run(*mega);
    EXPECT_TRUE(mega->last_gemms_fused()) << "call " << call << ": the MegaMoE kernel did not run";
    EXPECT_EQ(mega->last_combine_fused(), mega_combine_inside(config, c.tokens, false)) << "call " << call;
    EXPECT_EQ(got.h_q, want.h_q) << "call " << call << ": h_q differs from the chain";
    EXPECT_EQ(got.h_sf, want.h_sf) << "call " << call << ": h_sf differs from the chain";
    int64_t differ = 0;
    for (size_t i = 0; i < got.y.size(); ++i) differ += got.y[i] != want.y[i];
    if (y_too) {
      EXPECT_EQ(differ, 0) << "call " << call << ": y differs from the chain in " << differ
                           << " of " << got.y.size();
    }
    expect_counters_zero(*mega);
  }
}

// A case of the fused kernel's tests: `shape` at EP ep_size (rank ep_rank), t tokens, `routing`
// (10 % empty slots when skewed), the MegaMoE kernel on.
LayerCase mega_case(const char* shape, int64_t t, Routing routing = Routing::kUniform,
                    int ep_size = 1, int ep_rank = 0) {
  LayerCase c;
  c.shape = shape;
  c.ep_size = ep_size;
  c.ep_rank = ep_rank;
  c.tokens = t;
  c.routing = routing;
  c.empty_fraction = routing == Routing::kSkewed ? 0.1 : 0.0;
  c.mega = true;
  return c;
}

TEST(Sm90Layer, MegaKernelEqualsTheChainBitForBit) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 3200;
  for (const ShapeRank& sh :
       {ShapeRank{"small", 1, 0}, ShapeRank{"deepseek-v3", 1, 0}, ShapeRank{"kimi-k3", 8, 3}}) {
    for (const char* tile : {"decode_128x8_k4_warp", "decode_128x16_k2_warp", "decode_128x16_k1_warp"}) {
      for (int64_t t : {int64_t(1), int64_t(8), int64_t(64), int64_t(300)}) {
        for (Routing routing : {Routing::kUniform, Routing::kSkewed, Routing::kAdversarial}) {
          if (std::string(sh.name) != "small" && routing != Routing::kUniform && t != 64) continue;
          LayerCase c = mega_case(sh.name, t, routing, sh.ep_size, sh.ep_rank);
          c.gemm_tile = tile;
          expect_mega_equals_chain(c, seed++);
        }
      }
    }
  }
  // The prefill tiles: staged and asynchronous epilogues, experts over several n-tiles.
  for (const char* tile : {"prefill_128x192_async", "prefill_256x64_k2_async",
                           "prefill_256x128_k2_staged", "prefill_256x128_k1_staged"}) {
    for (int64_t t : {int64_t(8), int64_t(513), int64_t(2000)}) {
      for (Routing routing : {Routing::kUniform, Routing::kSkewed}) {
        LayerCase c = mega_case("small", t, routing);
        c.gemm_tile = tile;
        expect_mega_equals_chain(c, seed++);
      }
    }
  }
  LayerCase ds = mega_case("deepseek-v3", 512);
  ds.gemm_tile = "prefill_256x64_k2_async";
  expect_mega_equals_chain(ds, seed++);
}

// The combine by its own launch after the fused kernel (LayerConfig::sm90.mega_combine off), and
// the combine inside at token counts whose items do not fill the grid, fill it several times, and
// on a tile of each epilogue kind: both equal the chain bit for bit.
TEST(Sm90Layer, MegaCombineInsideAndByLaunchEqualTheChain) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 3400;
  for (bool inside : {false, true}) {
    for (const char* tile : {"decode_128x16_k2_warp", "prefill_128x192_async",
                             "prefill_256x128_k2_staged"}) {
      // (small: up to 128 tokens inside, kimi-k3 up to 36)
      for (int64_t t : {int64_t(1), int64_t(33), int64_t(128), int64_t(1500)}) {
        // (kimi-k3 EP 8 rank 5's slice at decode: 7168 channels over 132 CTAs' combine)
        const bool kimi = t == 1 && std::string(tile).rfind("decode", 0) == 0;
        LayerCase c = mega_case(kimi ? "kimi-k3" : "small", t, Routing::kSkewed, kimi ? 8 : 1,
                                kimi ? 5 : 0);
        c.gemm_tile = tile;
        c.mega_combine = inside;
        expect_mega_equals_chain(c, seed++);
      }
    }
  }
}

// The FP8 mode (its rebase of L1's rows inside the fused kernel) against the chain (L1, the
// rebase launch, L2) on the same forced FP8 tile, bit for bit: one GPU and an EP8 rank's share,
// experts over several n-tiles, skewed routing with empty slots.
TEST(Sm90Layer, MegaKernelFp8EqualsTheChainBitForBit) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 3280;
  for (const char* tile : {"fp8_128x192_k2_async", "fp8_256x128_k2_staged"}) {
    for (int64_t t : {int64_t(8), int64_t(513), int64_t(2000)}) {
      for (Routing routing : {Routing::kUniform, Routing::kSkewed}) {
        LayerCase c = mega_case("small", t, routing);
        c.gemm_tile = tile;
        c.fp8 = true;
        expect_mega_equals_chain(c, seed++);
      }
    }
    LayerCase ds = mega_case("deepseek-v3", 1024);
    ds.gemm_tile = tile;
    ds.fp8 = true;
    expect_mega_equals_chain(ds, seed++);
    LayerCase kimi = mega_case("kimi-k3", 512, Routing::kSkewed, 8, 3);
    kimi.gemm_tile = tile;
    kimi.fp8 = true;
    expect_mega_equals_chain(kimi, seed++);
  }
  // An exact-mode call of that layer (below fp8_min_rows): the forced FP8 tile does not apply,
  // the exact mode's policy does (deepseek-v3 T = 1: L1 split in the same two parts as the
  // chain's, MegaKernelSplitsL1AsTheChain; y is compared there against the reference).
  LayerCase exact_call = mega_case("deepseek-v3", 1);
  exact_call.gemm_tile = "fp8_128x192_k2_async";
  exact_call.fp8 = true;
  exact_call.fp8_min_rows = 128;
  expect_mega_equals_chain(exact_call, seed++, false);
}

// deepseek-v3 T = 1 by the policy: the chain and the fused kernel split L1 in the same two parts
// on the same tile, so the intermediate is the same bit for bit (y: the reference checks below).
TEST(Sm90Layer, MegaKernelSplitsL1AsTheChain) {
  MEGAMOE_REQUIRE_SM90();
  expect_mega_equals_chain(mega_case("deepseek-v3", 1), 3250, false);
}

// The policy's tile (auto): the reference checks of every layer test, at decode and prefill
// token counts (decode and prefill tiles in the fused kernel; the small shape's T = 1 has 4
// rows, which the policy chains), every activation of the small shape.
TEST(Sm90Layer, MegaKernelAgainstTheReference) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 3300;
  for (const char* a : {"swiglu", "swiglu:clamp=7", "situ", "swiglu_oai"}) {
    for (int64_t t : {int64_t(1), int64_t(2), int64_t(64), int64_t(513)}) {
      LayerCase c = small_case(t, a, true);
      c.mega = true;
      run_case(c, seed++);
    }
  }
  for (int64_t t : {int64_t(1), int64_t(8), int64_t(64), int64_t(512)}) {
    LayerCase c = mega_case("deepseek-v3", t);
    c.max_checked_tokens = 16;
    run_case(c, seed++);
  }
}

// Graph replay, back-to-back calls with programmatic launch, and the counters' reset between
// calls, with the fused kernel.
TEST(Sm90Layer, MegaKernelGraphReplayAndBackToBackCalls) {
  MEGAMOE_REQUIRE_SM90();
  const LayerCase a = mega_case("deepseek-v3", 1);
  check_graph_and_determinism(a, 3400);
  check_programmatic_launch(a, 3401);
  const LayerCase b = mega_case("kimi-k3", 64, Routing::kSkewed, 8, 3);
  check_graph_and_determinism(b, 3402);
  check_programmatic_launch(b, 3403);
}

}  // namespace
}  // namespace megamoe::sm90
