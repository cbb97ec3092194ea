// `megamoe run`: one MoE layer call on synthetic MXFP4 weights, timed and checked against the
// FP64 ideal MoE (and, for a non-CPU backend, against the CPU reference of the contract). With
// no option at all it runs the example model instead (`megamoe model` at its defaults).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megamoe/buffer.hpp"
#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/parallel.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/routing.hpp"
#include "megamoe/weights.hpp"
#include "tools/cli.hpp"
#include "tools/cmd_model.hpp"

namespace megamoe::cli {
namespace {

constexpr double kDefaultMaxDiff = 1e-2;  // numerics.md section 8: FP8 x MXFP4 gives 1e-3..1e-2
constexpr double kBytesPerMiB = 1024.0 * 1024.0;

struct RunOptions {
  std::string shape = "small";
  int64_t hidden = 0, intermediate = 0, experts = 0, top_k = 0;  // 0 = the preset's
  int64_t tokens = 64;
  std::string activation;  // empty = the preset's
  std::string backend = "auto";
  bool exact = false;
  uint64_t seed = 0;
  int ep_size = 1;
  int ep_rank = 0;
  std::string routing = "uniform";
  std::string bias = "auto";
  int64_t capacity = 0;  // 0 = tokens
  int warmup = 1;
  int iters = 3;
  int threads = 0;
  bool no_check = false;
  double max_diff = kDefaultMaxDiff;
  bool json = false;
  Sm90Flags sm90;
};

// NOTES: T x H BF16 inputs plus the FP64 reference output are allocated on the host; 2^24 tokens
// (already 512 GiB of reference output at H = 3584) is far past any machine and keeps sizes in
// int64 range, so a larger --tokens is refused by name instead of failing in the allocator.
constexpr int64_t kMaxTokens = int64_t{1} << 24;
constexpr int kMaxCount = 1 << 20;  // --threads

const CLI::Validator kFiniteNonNegative(
    [](std::string& text) -> std::string {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0' || !std::isfinite(v) || v < 0)
        return "must be a finite number >= 0, got '" + text + "'";
      return {};
    },
    "FINITE>=0");

const CLI::Validator kUnsignedInteger(
    [](std::string& text) -> std::string {
      if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
        return "must be an unsigned integer, got '" + text + "'";
      return {};
    },
    "UINT");

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A host vector mirrored on the layer's device (a plain view of it on the CPU).
struct DeviceCopy {
  Buffer buffer;
  void* ptr = nullptr;
  DeviceCopy(const void* host, int64_t bytes, Device device) {
    if (device.type == DeviceType::kCPU) {
      ptr = const_cast<void*>(host);
      return;
    }
    buffer = Buffer(bytes, device);
    copy_bytes(buffer.data(), device, host, Device::cpu(), bytes);
    ptr = buffer.data();
  }
};

int run(const RunOptions& o) {
  const auto t_start = std::chrono::steady_clock::now();
  if (o.threads > 0) set_num_threads(o.threads);

  LayerConfig cfg;
  cfg.shape = shape_preset(o.shape);
  if (o.hidden) cfg.shape.hidden = o.hidden;
  if (o.intermediate) cfg.shape.intermediate = o.intermediate;
  if (o.experts) cfg.shape.num_experts = o.experts;
  if (o.top_k) cfg.shape.top_k = o.top_k;
  cfg.activation = o.activation.empty() ? activation_preset(o.shape) : Activation::parse(o.activation);
  cfg.fast_math = !o.exact;
  cfg.ep_size = o.ep_size;
  cfg.ep_rank = o.ep_rank;
  MEGAMOE_CHECK_ARG(o.tokens >= 0, "--tokens must be >= 0, got ", o.tokens);
  MEGAMOE_CHECK_ARG(o.tokens <= kMaxTokens && o.capacity <= kMaxTokens, "--tokens and --capacity must be <= ",
                    kMaxTokens, ", got ", std::max(o.tokens, o.capacity));
  MEGAMOE_CHECK_ARG(o.threads >= 0 && o.threads <= kMaxCount, "--threads must be in [0, ", kMaxCount,
                    "] (0 = all cores), got ", o.threads);
  cfg.max_tokens_per_rank = o.capacity > 0 ? o.capacity : std::max<int64_t>(o.tokens, 1);
  o.sm90.apply(cfg);
  cfg.validate();
  MEGAMOE_CHECK_ARG(o.bias == "auto" || o.bias == "on" || o.bias == "off",
                    "--bias: expected auto, on or off, got '", o.bias, "'");
  const bool with_bias = o.bias == "on" || (o.bias == "auto" && o.shape == "gpt-oss-120b");
  MEGAMOE_CHECK_ARG(o.iters >= 1 && o.warmup >= 0, "--iters must be >= 1 and --warmup >= 0");
  const RoutingKind routing_kind = parse_routing_kind(o.routing);

  const int64_t T = o.tokens, H = cfg.shape.hidden, K = cfg.shape.top_k;
  const auto t_weights = std::chrono::steady_clock::now();
  MoeWeights weights = synthetic_weights(cfg, o.seed, with_bias);
  const double weights_s = seconds_since(t_weights);
  const int64_t weight_bytes = weights.total_bytes();
  const Routing routing = make_routing(routing_kind, T, cfg.shape.num_experts, K, o.seed);
  const std::vector<uint16_t> x = synthetic_activations(T, H, o.seed);

  // The FP64 ideal (and the contract reference for GPU backends) before the layer takes the weights.
  std::vector<double> ideal;
  double ideal_s = 0;
  if (!o.no_check) {
    const auto t0 = std::chrono::steady_clock::now();
    ideal.resize(static_cast<size_t>(T * H));
    ideal_forward(cfg, weights, x.data(), routing.topk_idx.data(), routing.topk_weights.data(), T,
                  ideal.data());
    ideal_s = seconds_since(t0);
  }
  const std::string chosen = o.backend == "auto" ? available_backends().front() : o.backend;
  std::vector<uint16_t> contract;
  if (!o.no_check && chosen != "cpu") {
    contract.resize(static_cast<size_t>(T * H));
    reference_forward(cfg, weights, x.data(), routing.topk_idx.data(), routing.topk_weights.data(),
                      T, contract.data());
  }

  const auto t_layer = std::chrono::steady_clock::now();
  MoeLayer layer(cfg, std::move(weights), chosen);
  const double layer_s = seconds_since(t_layer);
  const Device dev = layer.device();
  const int64_t x_bytes = T * H * dtype_bytes(DType::kBF16);
  DeviceCopy d_x(x.data(), x_bytes, dev);
  DeviceCopy d_idx(routing.topk_idx.data(), T * K * dtype_bytes(DType::kI32), dev);
  DeviceCopy d_w(routing.topk_weights.data(), T * K * dtype_bytes(DType::kF32), dev);
  std::vector<uint16_t> y(static_cast<size_t>(T * H));
  Buffer y_dev = dev.type == DeviceType::kCPU ? Buffer() : Buffer(x_bytes, dev);
  void* y_ptr = dev.type == DeviceType::kCPU ? static_cast<void*>(y.data()) : y_dev.data();

  // NOTES: each timed call is forward + copying y to the host, which also waits for a GPU
  // backend; `megamoe bench` measures kernels with CUDA events.
  std::vector<double> times;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    layer.forward(TensorView::contiguous(d_x.ptr, DType::kBF16, {T, H}, dev),
                  TensorView::contiguous(d_idx.ptr, DType::kI32, {T, K}, dev),
                  TensorView::contiguous(d_w.ptr, DType::kF32, {T, K}, dev),
                  TensorView::contiguous(y_ptr, DType::kBF16, {T, H}, dev));
    if (dev.type != DeviceType::kCPU) copy_bytes(y.data(), Device::cpu(), y_ptr, dev, x_bytes);
    if (i >= o.warmup) times.push_back(seconds_since(t0));
  }
  layer.check_errors(nullptr);  // device-side input errors of GPU backends
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double median_s = sorted[sorted.size() / 2];
  const double min_s = sorted.front();
  // Effective rate over the routed work of this rank (targets.md): 6 T_local H I per local slot.
  int64_t local_slots = 0;
  for (int32_t e : routing.topk_idx)
    local_slots += e >= cfg.first_local_expert() && e < cfg.first_local_expert() + cfg.num_local_experts();
  const double flops = 6.0 * static_cast<double>(local_slots) * static_cast<double>(H) *
                       static_cast<double>(cfg.shape.intermediate);

  DiffReport rep;
  double contract_diff = 0;
  int64_t contract_mismatches = 0;
  bool pass = true;
  if (!o.no_check) {
    rep = compare_output(cfg, y.data(), ideal.data(), routing.topk_idx.data(), T);
    auto within = [&](double d) { return std::isfinite(d) && d <= o.max_diff; };
    pass = within(rep.diff) && within(rep.worst_row_diff) && within(rep.worst_expert_diff);
    if (!contract.empty()) {
      std::vector<double> a(contract.size()), b(contract.size());
      for (size_t i = 0; i < contract.size(); ++i) {
        a[i] = bf16_to_f32(y[i]);
        b[i] = bf16_to_f32(contract[i]);
        contract_mismatches += y[i] != contract[i];
      }
      contract_diff = diff_metric(a.data(), b.data(), static_cast<int64_t>(a.size()));
    }
  }

  const std::string shape_desc = o.shape + ": " + cfg.shape.to_string();
  if (o.json) {
    nlohmann::json j;
    j["shape"] = {{"name", o.shape}, {"hidden", H}, {"intermediate", cfg.shape.intermediate},
                  {"experts", cfg.shape.num_experts}, {"top_k", K}};
    j["activation"] = cfg.activation.to_string();
    j["tokens"] = T;
    j["routing"] = routing_kind_name(routing_kind);
    j["seed"] = o.seed;
    j["backend"] = layer.backend();
    j["fast_math"] = cfg.fast_math;
    j["gemm_tile"] = cfg.sm90.gemm_tile;
    j["ep"] = {{"size", cfg.ep_size}, {"rank", cfg.ep_rank},
               {"first_local_expert", cfg.first_local_expert()},
               {"local_experts", cfg.num_local_experts()}, {"local_slots", local_slots}};
    j["bias"] = with_bias;
    j["threads"] = num_threads();
    j["weights"] = {{"bytes", weight_bytes}, {"generate_ms", weights_s * 1e3},
                    {"layer_setup_ms", layer_s * 1e3}};
    j["time_ms"] = {{"median", median_s * 1e3}, {"min", min_s * 1e3}, {"iters", o.iters},
                    {"warmup", o.warmup}};
    j["effective_gflops"] = median_s > 0 ? flops / median_s * 1e-9 : 0.0;
    if (!o.no_check) {
      j["check"] = {{"diff", rep.diff},
                    {"worst_row", rep.worst_row},
                    {"worst_row_diff", rep.worst_row_diff},
                    {"worst_expert", rep.worst_expert},
                    {"worst_expert_diff", rep.worst_expert_diff},
                    {"max_abs_err", rep.max_abs_err},
                    {"max_diff", o.max_diff},
                    {"ideal_ms", ideal_s * 1e3},
                    {"pass", pass}};
      if (!contract.empty())
        j["check"]["vs_cpu_reference"] = {{"diff", contract_diff}, {"mismatches", contract_mismatches}};
    }
    j["total_s"] = seconds_since(t_start);
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("megamoe run\n");
    std::printf("  shape       %s\n", shape_desc.c_str());
    std::printf("  activation  %s%s\n", cfg.activation.to_string().c_str(),
                with_bias ? " (with expert biases)" : "");
    std::printf("  tokens      %lld, routing %s, seed %llu\n", static_cast<long long>(T),
                routing_kind_name(routing_kind), static_cast<unsigned long long>(o.seed));
    std::printf("  experts     EP rank %d of %d: local experts [%lld, %lld), %lld local slots, "
                "%.1f MiB of MXFP4 weights (synthetic, generated in %.0f ms)\n",
                cfg.ep_rank, cfg.ep_size, static_cast<long long>(cfg.first_local_expert()),
                static_cast<long long>(cfg.first_local_expert() + cfg.num_local_experts()),
                static_cast<long long>(local_slots), static_cast<double>(weight_bytes) / kBytesPerMiB,
                weights_s * 1e3);
    std::printf("  backend     %s on %s, fast_math %s, %d host threads\n", layer.backend().c_str(),
                device_name(dev).c_str(), cfg.fast_math ? "on" : "off (exact)", num_threads());
    std::printf("  time        %.3f ms median, %.3f ms min over %d calls (after %d warm-up), "
                "%.1f GFLOP/s effective\n",
                median_s * 1e3, min_s * 1e3, o.iters, o.warmup,
                median_s > 0 ? flops / median_s * 1e-9 : 0.0);
    if (o.no_check) {
      std::printf("  accuracy    not checked (--no-check)\n");
    } else {
      std::printf("  accuracy    diff %.3e vs the FP64 ideal MoE (limit %.0e); worst row %lld "
                  "(%.3e), worst expert %lld (%.3e), max |err| %.4g\n",
                  rep.diff, o.max_diff, static_cast<long long>(rep.worst_row), rep.worst_row_diff,
                  static_cast<long long>(rep.worst_expert), rep.worst_expert_diff, rep.max_abs_err);
      if (!contract.empty())
        std::printf("  contract    diff %.3e vs the CPU reference, %lld of %lld outputs differ\n",
                    contract_diff, static_cast<long long>(contract_mismatches),
                    static_cast<long long>(contract.size()));
      std::printf("  result      %s\n", pass ? "PASS" : "FAIL (error above the limit)");
    }
  }
  return pass ? kExitOk : kExitCheckFailed;
}

const Command kRun{
    "run",
    "Run one MoE layer on synthetic MXFP4 weights and check it against the FP64 ideal MoE "
    "(no options: run the example model, as `megamoe model` does)",
    [](CLI::App& app) -> CommandMain {
      auto o = std::make_shared<RunOptions>();
      std::string shapes;
      for (const auto& s : shape_preset_names()) shapes += (shapes.empty() ? "" : ", ") + s;
      app.add_option("--shape", o->shape, "Layer shape preset: " + shapes)->capture_default_str();
      app.add_option("--hidden", o->hidden, "Override H (expert input width, multiple of 32)");
      app.add_option("--intermediate", o->intermediate, "Override I (multiple of 32)");
      app.add_option("--experts", o->experts, "Override E (experts in total)");
      app.add_option("--top-k", o->top_k, "Override K (experts per token)");
      app.add_option("--tokens,-t", o->tokens, "Tokens T on this rank (0 is valid)")
          ->capture_default_str();
      app.add_option("--activation", o->activation,
                     "Activation by name: swiglu, swiglu:clamp=7, situ, "
                     "situ:beta=4,linear_beta=25, swiglu_oai:alpha=1.702,clamp=7 "
                     "(default: the shape's; kimi-k3 situ, gpt-oss-120b swiglu_oai, else swiglu)");
      app.add_option("--backend", o->backend, "auto (best available), sm90 or cpu")
          ->capture_default_str();
      app.add_flag("--exact", o->exact,
                   "fast_math off: exact expf and division in the activation (default: fast_math on)");
      app.add_option("--seed", o->seed, "Seed of weights, routing and activations")
          ->check(kUnsignedInteger)
          ->capture_default_str();
      app.add_option("--ep-size", o->ep_size, "Expert-parallel ranks R (must divide E)")
          ->capture_default_str();
      app.add_option("--ep-rank", o->ep_rank,
                     "This rank r: computes experts [r*E/R, (r+1)*E/R) only")
          ->capture_default_str();
      app.add_option("--routing", o->routing,
                     "uniform (distinct uniform experts), skewed (Zipf s=1.2), adversarial "
                     "(every token the same K experts)")
          ->capture_default_str();
      app.add_option("--bias", o->bias, "Synthetic expert biases: auto (on for gpt-oss-120b), on, off")
          ->capture_default_str();
      app.add_option("--capacity", o->capacity,
                     "max_tokens_per_rank of the layer (default: --tokens)");
      app.add_option("--warmup", o->warmup, "Untimed calls first")->capture_default_str();
      app.add_option("--iters", o->iters, "Timed calls (median and min reported)")
          ->capture_default_str();
      app.add_option("--threads", o->threads, "Host threads for the CPU paths (0 = all cores)")
          ->capture_default_str();
      app.add_flag("--no-check", o->no_check, "Skip the FP64 ideal comparison (large shapes)");
      app.add_option("--max-diff", o->max_diff,
                     "Fail (exit 3) when diff, worst-row or worst-expert diff exceeds this")
          ->check(kFiniteNonNegative)
          ->capture_default_str();
      app.add_flag("--json", o->json, "Print one JSON object instead of text");
      o->sm90.add_to(app);
      // NOTES: `megamoe run` with no option at all is the README's main job: the example model
      // (examples/kimi_mini) answering problems. Any option selects the synthetic layer.
      return [o, &app] {
        for (const CLI::Option* opt : app.get_options())
          if (opt->count() > 0) return run(*o);
        return run_default_model();
      };
    }};

}  // namespace
}  // namespace megamoe::cli
