// `megamoe run`: one MoE layer call on synthetic MXFP4 weights, timed and checked against the
// FP64 ideal MoE (and, for a non-CPU backend, against the CPU reference of the contract). With
// no option at all it runs the example model instead (`megamoe model` at its defaults).
//
// Expert parallelism has two modes:
//   slice    --ep-rank r given (or the cpu backend): rank r's experts on its own tokens, no
//            communication; slots routed to other ranks' experts are skipped
//   virtual  --ep-size R > 1 without --ep-rank on the sm90 backend: R ranks of one EP group on
//            this GPU (EpGroup::create_virtual), each with its tokens, experts and stream, every
//            call exchanging tokens and results; checked against one EP=1 layer on all tokens
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
#include "megamoe/ep.hpp"
#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/parallel.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/routing.hpp"
#include "megamoe/weights.hpp"
#include "tools/cli.hpp"
#include "tools/cmd_model.hpp"

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>

#include "runtime/cuda_check.hpp"
#endif

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
  PrecisionFlags precision;
  uint64_t seed = 0;
  int ep_size = 1;
  int ep_rank = 0;
  bool ep_rank_given = false;  // set from the parsed command line: slice mode
  double ep_timeout = EpOptions{}.timeout_s;
  int64_t ep_max_recv_rows = 0;
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
constexpr double kMaxEpTimeout = 3600;  // EpOptions.timeout_s accepts up to an hour

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

// How far two BF16 outputs of the same call are apart: the elements whose bits differ and the
// diff metric of their values.
struct Bf16Agreement {
  int64_t mismatches = 0;
  double diff = 0;
};
Bf16Agreement compare_bf16(const std::vector<uint16_t>& y, const std::vector<uint16_t>& ref) {
  Bf16Agreement out;
  std::vector<double> a(y.size()), b(y.size());
  for (size_t i = 0; i < y.size(); ++i) {
    a[i] = bf16_to_f32(y[i]);
    b[i] = bf16_to_f32(ref[i]);
    out.mismatches += y[i] != ref[i];
  }
  out.diff = diff_metric(a.data(), b.data(), static_cast<int64_t>(a.size()));
  return out;
}

// The check against the FP64 ideal: the whole output, its worst row and its worst expert within
// the limit (a NaN diff fails).
bool passes(const DiffReport& rep, double max_diff) {
  auto within = [&](double d) { return std::isfinite(d) && d <= max_diff; };
  return within(rep.diff) && within(rep.worst_row_diff) && within(rep.worst_expert_diff);
}

// The "check" object of --json: the comparison with the FP64 ideal.
nlohmann::json check_json(const DiffReport& rep, double max_diff, double ideal_s, bool pass) {
  return {{"diff", rep.diff},
          {"worst_row", rep.worst_row},
          {"worst_row_diff", rep.worst_row_diff},
          {"worst_expert", rep.worst_expert},
          {"worst_expert_diff", rep.worst_expert_diff},
          {"max_abs_err", rep.max_abs_err},
          {"max_diff", max_diff},
          {"ideal_ms", ideal_s * 1e3},
          {"pass", pass}};
}

// The text report's "accuracy" line: the comparison with the FP64 ideal.
void print_accuracy(const DiffReport& rep, double max_diff) {
  std::printf("  accuracy    diff %.3e vs the FP64 ideal MoE (limit %.0e); worst row %lld "
              "(%.3e), worst expert %lld (%.3e), max |err| %.4g\n",
              rep.diff, max_diff, static_cast<long long>(rep.worst_row), rep.worst_row_diff,
              static_cast<long long>(rep.worst_expert), rep.worst_expert_diff, rep.max_abs_err);
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

// What both modes share: the layer configuration (ep_rank = --ep-rank, 0 when not given), the
// options checked once, and the backend with "auto" resolved.
struct RunSetup {
  LayerConfig cfg;
  bool with_bias = false;
  RoutingKind routing_kind = RoutingKind::kUniform;
  std::string backend;
};

RunSetup setup_run(const RunOptions& o) {
  if (o.threads > 0) set_num_threads(o.threads);
  RunSetup s;
  LayerConfig& cfg = s.cfg;
  cfg.shape = shape_preset(o.shape);
  if (o.hidden) cfg.shape.hidden = o.hidden;
  if (o.intermediate) cfg.shape.intermediate = o.intermediate;
  if (o.experts) cfg.shape.num_experts = o.experts;
  if (o.top_k) cfg.shape.top_k = o.top_k;
  cfg.activation = o.activation.empty() ? activation_preset(o.shape) : Activation::parse(o.activation);
  cfg.fast_math = !o.exact;
  o.precision.apply(cfg);
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
  s.with_bias = o.bias == "on" || (o.bias == "auto" && o.shape == "gpt-oss-120b");
  MEGAMOE_CHECK_ARG(o.iters >= 1 && o.warmup >= 0, "--iters must be >= 1 and --warmup >= 0");
  // Checked in either mode, so that a command line means the same on every machine.
  MEGAMOE_CHECK_ARG(std::isfinite(o.ep_timeout) && o.ep_timeout > 0 && o.ep_timeout <= kMaxEpTimeout,
                    "--ep-timeout must be a number of seconds in (0, ", kMaxEpTimeout, "], got ",
                    o.ep_timeout);
  MEGAMOE_CHECK_ARG(o.ep_max_recv_rows >= 0, "--ep-max-recv-rows must be >= 0 (0 = the worst case), got ",
                    o.ep_max_recv_rows);
  s.routing_kind = parse_routing_kind(o.routing);
  s.backend = o.backend == "auto" ? available_backends().front() : o.backend;
  return s;
}

// One rank alone: rank ep_rank's experts on --tokens tokens (the whole layer when ep_size = 1).
int run_slice(const RunOptions& o, const RunSetup& s, std::chrono::steady_clock::time_point t_start) {
  const LayerConfig& cfg = s.cfg;
  const bool with_bias = s.with_bias;
  const RoutingKind routing_kind = s.routing_kind;
  const std::string& chosen = s.backend;
  // --ep-size alone on a backend without communication: rank 0's slice, and the output says so.
  const bool implicit_rank = cfg.ep_size > 1 && !o.ep_rank_given;

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
    pass = passes(rep, o.max_diff);
    if (!contract.empty()) {
      const Bf16Agreement agreement = compare_bf16(y, contract);
      contract_mismatches = agreement.mismatches;
      contract_diff = agreement.diff;
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
    j["precision"] = to_string(cfg.precision);
    j["gemm_tile"] = cfg.sm90.gemm_tile;
    j["mega_kernel"] = cfg.sm90.mega_kernel;
    j["decode_front"] = cfg.sm90.decode_front;
    j["ep"] = {{"mode", "slice"}, {"size", cfg.ep_size}, {"rank", cfg.ep_rank},
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
      j["check"] = check_json(rep, o.max_diff, ideal_s, pass);
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
    if (implicit_rank)
      std::printf("  note        --ep-size without --ep-rank runs rank 0's slice on the %s backend; "
                  "all %d ranks exchanging tokens (virtual ranks) need the sm90 backend\n",
                  chosen.c_str(), cfg.ep_size);
    std::printf("  backend     %s on %s, fast_math %s, precision %s, %d host threads\n",
                layer.backend().c_str(), device_name(dev).c_str(),
                cfg.fast_math ? "on" : "off (exact)", to_string(cfg.precision), num_threads());
    std::printf("  time        %.3f ms median, %.3f ms min over %d calls (after %d warm-up), "
                "%.1f GFLOP/s effective\n",
                median_s * 1e3, min_s * 1e3, o.iters, o.warmup,
                median_s > 0 ? flops / median_s * 1e-9 : 0.0);
    if (o.no_check) {
      std::printf("  accuracy    not checked (--no-check)\n");
    } else {
      print_accuracy(rep, o.max_diff);
      if (!contract.empty())
        std::printf("  contract    diff %.3e vs the CPU reference, %lld of %lld outputs differ\n",
                    contract_diff, static_cast<long long>(contract_mismatches),
                    static_cast<long long>(contract.size()));
      std::printf("  result      %s\n", pass ? "PASS" : "FAIL (error above the limit)");
    }
  }
  return pass ? kExitOk : kExitCheckFailed;
}

// One virtual rank's stream, and the CUDA events that time its part of each group call.
class RankStream {
 public:
  RankStream(const RankStream&) = delete;
  RankStream& operator=(const RankStream&) = delete;
#if defined(MEGAMOE_WITH_CUDA)
  // Non-blocking: the legacy default stream (copy_bytes, the check's layer) neither waits for a
  // rank's calls nor makes them wait, so nothing outside the group call orders one rank's launches
  // behind another's (a rank whose launch waited for a peer's call would never meet it).
  RankStream() {
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&start_));
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~RankStream() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
  }
  void* stream() const { return stream_; }
  void start() { MEGAMOE_CUDA_CHECK(cudaEventRecord(start_, stream_)); }
  void stop() { MEGAMOE_CUDA_CHECK(cudaEventRecord(stop_, stream_)); }
  void synchronize() { MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  double elapsed_ms() const {
    float ms = 0;
    MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }
  // Waits for the copies made on the legacy default stream: one from pageable host memory may
  // return before its DMA has landed, and the rank streams are not ordered after it.
  static void wait_for_copies() { MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize()); }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
#else
  // Unreachable in practice: EpGroup::create_virtual already refuses a build without CUDA.
  RankStream() { fail(ErrorCode::kUnsupported, "virtual EP ranks need a CUDA build"); }
  void* stream() const { return nullptr; }
  void start() {}
  void stop() {}
  void synchronize() {}
  double elapsed_ms() const { return 0; }
  static void wait_for_copies() {}
#endif
};

// Median and minimum of a non-empty series.
std::pair<double, double> median_min(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front()};
}

// R ranks of one EP group on this GPU (EpGroup::create_virtual): rank r has --tokens tokens
// (routing and activations seeded with seed + r), the experts [r E_l, (r+1) E_l) of the synthetic
// weights and its own stream. Every call launches all R forwards from this thread (forward never
// waits for the device), so they are in flight together as the group requires. The check runs one
// EP=1 layer with all E experts on every rank's tokens: the group's output must match it.
int run_virtual(const RunOptions& o, const RunSetup& s, std::chrono::steady_clock::time_point t_start) {
  const LayerConfig& base = s.cfg;
  const int R = base.ep_size;
  const int64_t T = o.tokens, H = base.shape.hidden, K = base.shape.top_k,
                E = base.shape.num_experts, I = base.shape.intermediate;
  const int64_t total = int64_t{R} * T;
  MEGAMOE_CHECK_ARG(total <= kMaxTokens, "--ep-size * --tokens must be <= ", kMaxTokens,
                    " (the check's layer takes every rank's tokens), got ", total);
  // Refused before anything runs: one rank above its capacity would still take part in the call
  // (as T = 0) and throw only after the others were launched.
  MEGAMOE_CHECK(T <= base.max_tokens_per_rank, ErrorCode::kOutOfRange, "--tokens ", T,
                " exceeds max_tokens_per_rank = ", base.max_tokens_per_rank,
                " of every rank (--capacity)");
  EpOptions ep_options;
  ep_options.timeout_s = o.ep_timeout;
  ep_options.max_recv_rows = o.ep_max_recv_rows;
  const auto t_setup = std::chrono::steady_clock::now();
  const std::vector<std::shared_ptr<EpGroup>> groups = EpGroup::create_virtual(R, base, ep_options);

  // Every rank's tokens, rank after rank: rank r's rows are [r T, (r+1) T) of these arrays, which
  // the check's EP=1 layer takes in one call.
  std::vector<uint16_t> x(static_cast<size_t>(total * H));
  std::vector<int32_t> idx(static_cast<size_t>(total * K));
  std::vector<float> w(static_cast<size_t>(total * K));
  for (int r = 0; r < R; ++r) {
    const Routing routing = make_routing(s.routing_kind, T, E, K, o.seed + r);
    const std::vector<uint16_t> xr = synthetic_activations(T, H, o.seed + r);
    std::copy(routing.topk_idx.begin(), routing.topk_idx.end(), idx.begin() + r * T * K);
    std::copy(routing.topk_weights.begin(), routing.topk_weights.end(), w.begin() + r * T * K);
    std::copy(xr.begin(), xr.end(), x.begin() + r * T * H);
  }

  // Each rank generates only its own experts: synthetic weights are a function of the global
  // expert id (src/moe/weights.cpp), so these are exactly slices of the EP=1 layer's weights.
  std::vector<std::unique_ptr<MoeLayer>> layers;
  double weights_s = 0;
  int64_t rank_weight_bytes = 0;
  for (int r = 0; r < R; ++r) {
    LayerConfig cfg_r = base;
    cfg_r.ep_rank = r;
    const auto t_weights = std::chrono::steady_clock::now();
    MoeWeights wr = synthetic_weights(cfg_r, o.seed, s.with_bias);
    weights_s += seconds_since(t_weights);
    rank_weight_bytes = wr.total_bytes();
    layers.push_back(std::make_unique<MoeLayer>(cfg_r, std::move(wr), groups[static_cast<size_t>(r)],
                                                s.backend));
  }
  const double layer_s = seconds_since(t_setup) - weights_s;
  const std::string backend_name = layers.front()->backend();
  const Device dev = layers.front()->device();
  const int64_t x_bytes = total * H * dtype_bytes(DType::kBF16);
  DeviceCopy d_x(x.data(), x_bytes, dev);
  DeviceCopy d_idx(idx.data(), total * K * dtype_bytes(DType::kI32), dev);
  DeviceCopy d_w(w.data(), total * K * dtype_bytes(DType::kF32), dev);
  Buffer y_dev(x_bytes, dev);
  auto rank_rows = [&](void* all, DType dtype, int64_t width, int r) {
    return TensorView::contiguous(static_cast<uint8_t*>(all) + r * T * width * dtype_bytes(dtype),
                                  dtype, {T, width}, dev);
  };
  std::vector<std::unique_ptr<RankStream>> streams;
  for (int r = 0; r < R; ++r) streams.push_back(std::make_unique<RankStream>());
  RankStream::wait_for_copies();

  // NOTES: a rank's time (CUDA events on its stream) includes waiting for the other ranks'
  // tokens and rows; the wall time is the whole group call, from the first launch until every
  // stream is done, as the caller of R ranks sees it. Neither includes copying y to the host.
  std::vector<std::vector<double>> rank_ms(static_cast<size_t>(R));
  std::vector<double> wall;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < R; ++r) {
      RankStream& st = *streams[static_cast<size_t>(r)];
      st.start();
      layers[static_cast<size_t>(r)]->forward(
          rank_rows(d_x.ptr, DType::kBF16, H, r), rank_rows(d_idx.ptr, DType::kI32, K, r),
          rank_rows(d_w.ptr, DType::kF32, K, r), rank_rows(y_dev.data(), DType::kBF16, H, r),
          st.stream());
      st.stop();
    }
    for (auto& st : streams) st->synchronize();
    const double wall_s = seconds_since(t0);
    // Device-side errors (a timeout, a receive overflow) end the run at the call that had them.
    for (int r = 0; r < R; ++r)
      layers[static_cast<size_t>(r)]->check_errors(streams[static_cast<size_t>(r)]->stream());
    if (i < o.warmup) continue;
    wall.push_back(wall_s);
    for (int r = 0; r < R; ++r)
      rank_ms[static_cast<size_t>(r)].push_back(streams[static_cast<size_t>(r)]->elapsed_ms());
  }
  std::vector<int64_t> recv_rows(static_cast<size_t>(R), 0);
  for (int r = 0; r < R; ++r)
    for (int64_t n : layers[static_cast<size_t>(r)]->expert_rows(streams[static_cast<size_t>(r)]->stream()))
      recv_rows[static_cast<size_t>(r)] += n;
  std::vector<uint16_t> y(static_cast<size_t>(total * H));
  copy_bytes(y.data(), Device::cpu(), y_dev.data(), dev, x_bytes);
  layers.clear();  // the check's layer holds all E experts: one copy of the weights at a time

  const auto [wall_median_s, wall_min_s] = median_min(wall);
  std::vector<std::pair<double, double>> rank_times;
  double max_rank_median = 0;
  for (const auto& ms : rank_ms) {
    rank_times.push_back(median_min(ms));
    max_rank_median = std::max(max_rank_median, rank_times.back().first);
  }
  int64_t slots = 0;
  for (int32_t e : idx) slots += e >= 0;
  const double flops = 6.0 * static_cast<double>(slots) * static_cast<double>(H) * static_cast<double>(I);
  const double gflops = wall_median_s > 0 ? flops / wall_median_s * 1e-9 : 0.0;

  // The check: one EP=1 layer (all E experts, capacity R T) on the same tokens, and the FP64
  // ideal of those tokens for both.
  DiffReport rep, rep_ep1;
  int64_t mismatches = 0;
  double ep1_diff = 0, ideal_s = 0;
  bool pass = true;
  if (!o.no_check) {
    LayerConfig full = base;
    full.ep_size = 1;
    full.ep_rank = 0;
    full.max_tokens_per_rank = std::max<int64_t>(total, 1);
    MoeWeights wf = synthetic_weights(full, o.seed, s.with_bias);
    std::vector<double> ideal(static_cast<size_t>(total * H));
    const auto t0 = std::chrono::steady_clock::now();
    ideal_forward(full, wf, x.data(), idx.data(), w.data(), total, ideal.data());
    ideal_s = seconds_since(t0);
    MoeLayer ep1(full, std::move(wf), s.backend);
    Buffer y_ep1_dev(x_bytes, dev);
    ep1.forward(TensorView::contiguous(d_x.ptr, DType::kBF16, {total, H}, dev),
                TensorView::contiguous(d_idx.ptr, DType::kI32, {total, K}, dev),
                TensorView::contiguous(d_w.ptr, DType::kF32, {total, K}, dev),
                TensorView::contiguous(y_ep1_dev.data(), DType::kBF16, {total, H}, dev));
    std::vector<uint16_t> y_ep1(y.size());
    // copy_bytes runs on the legacy default stream, after the layer's work on it
    copy_bytes(y_ep1.data(), Device::cpu(), y_ep1_dev.data(), dev, x_bytes);
    ep1.check_errors(nullptr);
    const Bf16Agreement agreement = compare_bf16(y, y_ep1);
    mismatches = agreement.mismatches;
    ep1_diff = agreement.diff;
    rep = compare_output(full, y.data(), ideal.data(), idx.data(), total);
    rep_ep1 = compare_output(full, y_ep1.data(), ideal.data(), idx.data(), total);
    pass = passes(rep, o.max_diff);
  }

  const int64_t el = base.num_local_experts();
  const EpGroup& g0 = *groups.front();
  if (o.json) {
    nlohmann::json j;
    j["shape"] = {{"name", o.shape}, {"hidden", H}, {"intermediate", I}, {"experts", E}, {"top_k", K}};
    j["activation"] = base.activation.to_string();
    j["tokens"] = T;
    j["routing"] = routing_kind_name(s.routing_kind);
    j["seed"] = o.seed;
    j["backend"] = backend_name;
    j["fast_math"] = base.fast_math;
    j["gemm_tile"] = base.sm90.gemm_tile;
    j["mega_kernel"] = base.sm90.mega_kernel;
    j["decode_front"] = base.sm90.decode_front;
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < R; ++r) {
      const auto& t = rank_times[static_cast<size_t>(r)];
      ranks.push_back({{"rank", r}, {"first_local_expert", r * el}, {"seed", o.seed + r},
                       {"recv_rows", recv_rows[static_cast<size_t>(r)]},
                       {"time_ms", {{"median", t.first}, {"min", t.second}}}});
    }
    j["ep"] = {{"mode", "virtual"}, {"size", R}, {"transport", g0.transport()},
               {"local_experts", el}, {"tokens_per_rank", T}, {"total_tokens", total},
               {"timeout_s", g0.options().timeout_s}, {"max_recv_rows", g0.max_recv_rows()},
               {"window_bytes", g0.window_bytes()}, {"ranks", ranks},
               {"max_rank_median_ms", max_rank_median},
               {"wall_ms", {{"median", wall_median_s * 1e3}, {"min", wall_min_s * 1e3}}}};
    if (!o.no_check)
      j["ep"]["check"] = {{"reference", "sm90 layer, EP=1, all experts, every rank's tokens"},
                          {"elements", static_cast<int64_t>(y.size())},
                          {"mismatches", mismatches},
                          {"diff", ep1_diff},
                          {"reference_ideal_diff", rep_ep1.diff}};
    j["bias"] = s.with_bias;
    j["threads"] = num_threads();
    j["weights"] = {{"bytes", rank_weight_bytes * R}, {"bytes_per_rank", rank_weight_bytes},
                    {"generate_ms", weights_s * 1e3}, {"layer_setup_ms", layer_s * 1e3}};
    j["time_ms"] = {{"median", wall_median_s * 1e3}, {"min", wall_min_s * 1e3}, {"iters", o.iters},
                    {"warmup", o.warmup}};
    j["effective_gflops"] = gflops;
    if (!o.no_check)
      j["check"] = check_json(rep, o.max_diff, ideal_s, pass);
    j["total_s"] = seconds_since(t_start);
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("megamoe run\n");
    std::printf("  shape       %s: %s\n", o.shape.c_str(), base.shape.to_string().c_str());
    std::printf("  activation  %s%s\n", base.activation.to_string().c_str(),
                s.with_bias ? " (with expert biases)" : "");
    std::printf("  tokens      %lld per rank, %lld in all, routing %s, seed %llu (rank r: seed + r)\n",
                static_cast<long long>(T), static_cast<long long>(total),
                routing_kind_name(s.routing_kind), static_cast<unsigned long long>(o.seed));
    std::printf("  experts     EP %d virtual ranks on one GPU, %lld experts each (rank r: [%lld r, "
                "%lld (r+1))), %.1f MiB of MXFP4 weights per rank (synthetic, generated in %.0f ms)\n",
                R, static_cast<long long>(el), static_cast<long long>(el), static_cast<long long>(el),
                static_cast<double>(rank_weight_bytes) / kBytesPerMiB, weights_s * 1e3);
    std::printf("  group       timeout %g s, max_recv_rows %lld, window %.1f MiB per rank\n",
                g0.options().timeout_s, static_cast<long long>(g0.max_recv_rows()),
                static_cast<double>(g0.window_bytes()) / kBytesPerMiB);
    std::printf("  backend     %s on %s, fast_math %s, %d host threads\n", backend_name.c_str(),
                device_name(dev).c_str(), base.fast_math ? "on" : "off (exact)", num_threads());
    for (int r = 0; r < R; ++r) {
      const auto& t = rank_times[static_cast<size_t>(r)];
      std::printf("  rank %-6d %.3f ms median, %.3f ms min; %lld rows received\n", r, t.first,
                  t.second, static_cast<long long>(recv_rows[static_cast<size_t>(r)]));
    }
    std::printf("  time        %.3f ms max rank median (CUDA events on each rank's stream); group "
                "call %.3f ms median, %.3f ms min wall over %d calls (after %d warm-up), "
                "%.1f GFLOP/s effective\n",
                max_rank_median, wall_median_s * 1e3, wall_min_s * 1e3, o.iters, o.warmup, gflops);
    if (o.no_check) {
      std::printf("  accuracy    not checked (--no-check)\n");
    } else {
      print_accuracy(rep, o.max_diff);
      std::printf("  vs EP=1     %lld of %lld outputs differ from one sm90 layer with all %lld "
                  "experts on the %lld tokens (diff %.3e; that layer's diff vs the ideal %.3e)\n",
                  static_cast<long long>(mismatches), static_cast<long long>(y.size()),
                  static_cast<long long>(E), static_cast<long long>(total), ep1_diff, rep_ep1.diff);
      std::printf("  result      %s\n", pass ? "PASS" : "FAIL (error above the limit)");
    }
  }
  return pass ? kExitOk : kExitCheckFailed;
}

int run(const RunOptions& o) {
  const auto t_start = std::chrono::steady_clock::now();
  const RunSetup s = setup_run(o);
  if (!o.ep_rank_given && s.cfg.ep_size > 1 && s.backend == "sm90") return run_virtual(o, s, t_start);
  return run_slice(o, s, t_start);
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
      app.add_option("--tokens,-t", o->tokens, "Tokens T on this rank, on each rank with virtual "
                     "ranks (0 is valid)")
          ->capture_default_str();
      app.add_option("--activation", o->activation,
                     "Activation by name: swiglu, swiglu:clamp=7, situ, "
                     "situ:beta=4,linear_beta=25, swiglu_oai:alpha=1.702,clamp=7 "
                     "(default: the shape's; kimi-k3 situ, gpt-oss-120b swiglu_oai, else swiglu)");
      app.add_option("--backend", o->backend, "auto (best available), sm90 or cpu")
          ->capture_default_str();
      app.add_flag("--exact", o->exact,
                   "fast_math off: exact expf and division in the activation (default: fast_math on)");
      o->precision.add_to(app);
      app.add_option("--seed", o->seed, "Seed of weights, routing and activations")
          ->check(kUnsignedInteger)
          ->capture_default_str();
      app.add_option("--ep-size", o->ep_size,
                     "Expert-parallel ranks R (must divide E). Without --ep-rank on the sm90 "
                     "backend: all R ranks as virtual ranks of one EP group on this GPU, each with "
                     "--tokens tokens, exchanging tokens and results (per-rank and group times; "
                     "checked against one EP=1 layer on all R*T tokens). On the cpu backend, which "
                     "has no communication: rank 0's slice, as --ep-rank 0")
          ->capture_default_str();
      CLI::Option* ep_rank =
          app.add_option("--ep-rank", o->ep_rank,
                         "This rank r alone: computes experts [r*E/R, (r+1)*E/R) of its --tokens "
                         "tokens, no communication (slots of other ranks' experts are skipped)")
              ->capture_default_str();
      app.add_option("--ep-timeout", o->ep_timeout,
                     "Virtual ranks: seconds a rank waits for another before the call fails with "
                     "a timeout error, in (0, 3600]")
          ->capture_default_str();
      app.add_option("--ep-max-recv-rows", o->ep_max_recv_rows,
                     "Virtual ranks: rows one rank may receive per call (0 = the worst case, "
                     "R*capacity*min(K, E/R)); a call above it fails on every rank")
          ->capture_default_str();
      app.add_option("--routing", o->routing,
                     "uniform (distinct uniform experts), skewed (Zipf s=1.2), adversarial "
                     "(every token the same K experts)")
          ->capture_default_str();
      app.add_option("--bias", o->bias, "Synthetic expert biases: auto (on for gpt-oss-120b), on, off")
          ->capture_default_str();
      app.add_option("--capacity", o->capacity,
                     "max_tokens_per_rank of the layer, of each rank with virtual ranks "
                     "(default: --tokens)");
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
      return [o, &app, ep_rank] {
        o->ep_rank_given = ep_rank->count() > 0;
        for (const CLI::Option* opt : app.get_options())
          if (opt->count() > 0) return run(*o);
        return run_default_model();
      };
    }};

}  // namespace
}  // namespace megamoe::cli
