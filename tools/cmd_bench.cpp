// `megamoe bench`: times the Hopper layer following the benchmark protocol of targets.md.
//
//   megamoe bench --shape kimi-k3,deepseek-v3 --tokens 1,8,64,512,4096,8192 --routing uniform
//
// Protocol (targets.md, "Benchmark protocol"):
// - Ceilings re-measured in the same run: a 1 GiB device-to-device copy (bytes read + written)
//   and a BF16 GEMM 8192^3 through cuBLAS (cublasGemmEx, FP32 accumulation, random data).
// - Every timed layer call is part of a CUDA graph; a graph holds `rotation` calls that cycle
//   through several input sets (x, top-k ids and weights of different seeds) and, for layers
//   whose weights are smaller than 3 x L2, through several copies of the weights, so neither
//   inputs nor weights are served from L2. CUDA events bracket each replay after warm-up, with
//   one untimed replay enqueued ahead of it (the GPU is busy when the start event is taken); the
//   time per call is the replay time / rotation; the median and the minimum over replays are
//   reported.
// - Per-stage breakdown: graphs of the stage prefixes (quantize; +dispatch; +gather; +L1; +L2;
//   +combine = the whole layer) are timed the same way; a stage's time is the difference of
//   consecutive prefixes, so launch gaps are charged to the stage that causes them.
// - Floors (targets.md, "Lower bounds"): weight bytes of the experts the timed calls hit (counted
//   from the routing, averaged over input sets), t_mem = (weight + activation bytes) / copy
//   ceiling, t_math = 6 H I x (local slots; T K with EP = 1) / GEMM ceiling (BF16 measured here; FP8 from targets.md since
//   this build does not measure it), floor = max(t_mem, t_math_bf16) for the exact BF16 path.
// - Output: a table on stdout and JSON lines (--json FILE, appended) with the GPU name, clocks,
//   driver, CUDA version and git revision.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "megamoe/buffer.hpp"
#include "megamoe/config.hpp"
#include "megamoe/error.hpp"
#include "megamoe/parallel.hpp"
#include "megamoe/routing.hpp"
#include "megamoe/weights.hpp"
#include "moe/sm90_tile_policy.hpp"
#include "runtime/cuda_device.hpp"
#include "tools/cli.hpp"

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>

#include "moe/sm90_layer.hpp"
#include "runtime/cuda_check.hpp"
#if defined(MEGAMOE_WITH_CUBLAS)
#include <cublas_v2.h>
#endif
#endif

namespace megamoe::cli {
namespace {

// targets.md constants used where this run does not measure the quantity itself.
constexpr double kTargetsFp8DenseTflops = 1403.0;   // torch._scaled_mm 8192^3 on an H200
constexpr double kTargetsCopyTBs = 4.27;            // fallback when --no-ceilings
constexpr double kTargetsBf16DenseTflops = 776.0;   // fallback when --no-ceilings
constexpr int64_t kCopyBytes = 1LL << 30;            // copy ceiling: 1 GiB each way
constexpr int kCeilingGemmDim = 8192;
constexpr int kL2Multiple = 3;                       // rotate over more than 3 x L2 (targets.md)
constexpr int kMaxInputSets = 16;
constexpr int kMinInputSets = 2;

struct BenchOptions {
  std::string shapes = "kimi-k3,deepseek-v3";
  std::string tokens = "1,8,64,512,4096,8192";
  std::string routing = "uniform";
  std::string activation;  // empty: each shape's preset
  bool exact = false;
  PrecisionFlags precision;
  int ep_size = 1;
  int replays = 10;
  int warmup = 2;
  bool stages = true;
  bool ceilings = true;
  std::string json_path;
  std::string git_rev;
  uint64_t seed = 1;
  Sm90Flags sm90;
  bool list_tiles = false;
};

// The shipped GEMM tiles, one per line (what --tile accepts besides auto and serial).
int list_tiles() {
  for (const sm90::TileConfig& t : sm90::kTileTable) {
    std::ostringstream line;
    line << t;
    std::printf("%s\n", line.str().c_str());
  }
  return kExitOk;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::string run_command(const char* cmd) {
  std::string out;
  FILE* p = popen(cmd, "r");
  if (p == nullptr) return out;
  char buf[256];
  while (fgets(buf, sizeof buf, p) != nullptr) out += buf;
  pclose(p);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

#if defined(MEGAMOE_WITH_CUDA)

// ---------------------------------------------------------------------------------------------
// Timing helpers
// ---------------------------------------------------------------------------------------------
class EventPair {
 public:
  EventPair() {
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&start_));
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~EventPair() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  void start(cudaStream_t s) { MEGAMOE_CUDA_CHECK(cudaEventRecord(start_, s)); }
  void stop(cudaStream_t s) { MEGAMOE_CUDA_CHECK(cudaEventRecord(stop_, s)); }
  double elapsed_us() {
    MEGAMOE_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return 1e3 * ms;
  }

 private:
  cudaEvent_t start_, stop_;
};

struct Ceilings {
  double copy_tbs = kTargetsCopyTBs;
  double bf16_tflops = kTargetsBf16DenseTflops;
  bool measured = false;
};

Ceilings measure_ceilings(cudaStream_t stream) {
  Ceilings c;
  c.measured = true;
  constexpr int kIters = 20, kWarm = 3;
  {
    Buffer src(kCopyBytes, Device::cuda()), dst(kCopyBytes, Device::cuda());
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(src.data(), 0x3C, kCopyBytes, stream));
    EventPair ev;
    std::vector<double> t;
    for (int i = 0; i < kWarm + kIters; ++i) {
      ev.start(stream);
      MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), kCopyBytes, cudaMemcpyDeviceToDevice, stream));
      ev.stop(stream);
      const double us = ev.elapsed_us();
      if (i >= kWarm) t.push_back(us);
    }
    c.copy_tbs = 2.0 * kCopyBytes / (median(t) * 1e-6) / 1e12;
  }
#if defined(MEGAMOE_WITH_CUBLAS)
  {
    const int64_t n = kCeilingGemmDim;
    std::vector<uint16_t> host(static_cast<size_t>(n * n));
    parallel_for(n, [&](int64_t r) {
      uint64_t z = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(r + 1);
      for (int64_t i = 0; i < n; ++i) {
        z ^= z << 13; z ^= z >> 7; z ^= z << 17;
        const float v = static_cast<float>(static_cast<int64_t>(z % 2001) - 1000) / 1000.0f;
        host[r * n + i] = bf16_from_f32(v);
      }
    });
    Buffer a(n * n * 2, Device::cuda()), b(n * n * 2, Device::cuda()), d(n * n * 2, Device::cuda());
    MEGAMOE_CUDA_CHECK(cudaMemcpy(a.data(), host.data(), n * n * 2, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), n * n * 2, cudaMemcpyHostToDevice));
    cublasHandle_t handle;
    MEGAMOE_CHECK(cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS, ErrorCode::kCuda, "cublasCreate failed");
    cublasSetStream(handle, stream);
    const float alpha = 1.0f, beta = 0.0f;
    EventPair ev;
    std::vector<double> t;
    for (int i = 0; i < kWarm + 10; ++i) {
      ev.start(stream);
      const cublasStatus_t st = cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.data(),
                                             CUDA_R_16BF, n, b.data(), CUDA_R_16BF, n, &beta, d.data(),
                                             CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      ev.stop(stream);
      MEGAMOE_CHECK(st == CUBLAS_STATUS_SUCCESS, ErrorCode::kCuda, "cublasGemmEx failed: status ",
                    static_cast<int>(st));
      const double us = ev.elapsed_us();
      if (i >= kWarm) t.push_back(us);
    }
    cublasDestroy(handle);
    c.bf16_tflops = 2.0 * double(n) * n * n / (median(t) * 1e-6) / 1e12;
  }
#else
  std::printf("note: built without cuBLAS: the BF16 GEMM ceiling is the targets.md value\n");
#endif
  return c;
}

// ---------------------------------------------------------------------------------------------
// Workload
// ---------------------------------------------------------------------------------------------
struct InputSet {
  Buffer x, idx, w;
  int64_t experts_hit = 0;  // distinct local experts of this routing
};

std::vector<uint16_t> activations_parallel(int64_t tokens, int64_t hidden, uint64_t seed) {
  constexpr int64_t kChunk = 256;
  std::vector<uint16_t> x(static_cast<size_t>(tokens * hidden));
  const int64_t chunks = (tokens + kChunk - 1) / kChunk;
  parallel_for(chunks, [&](int64_t c) {
    const int64_t t0 = c * kChunk, n = std::min(kChunk, tokens - t0);
    const auto part = synthetic_activations(n, hidden, seed * 1000003ull + static_cast<uint64_t>(c));
    std::copy(part.begin(), part.end(), x.begin() + t0 * hidden);
  });
  return x;
}

struct StageTimes {
  std::vector<double> prefix_us;  // median per call of prefix s (stages 0..s)
};

// Captures `rotation` calls of the layer prefix ending at `last` and times the replays.
void time_graph(std::vector<std::unique_ptr<sm90::Sm90Layer>>& layers, std::vector<InputSet>& sets,
                Buffer& y, int64_t tokens, sm90::Stage last, int rotation, int warmup, int replays,
                cudaStream_t stream, double* median_us, double* min_us) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < rotation; ++i) {
    sm90::Sm90Layer& layer = *layers[static_cast<size_t>(i) % layers.size()];
    InputSet& in = sets[static_cast<size_t>(i) % sets.size()];
    layer.forward(in.x.as<uint16_t>(), in.idx.as<int32_t>(), in.w.as<float>(), tokens,
                  y.as<uint16_t>(), stream, last);
  }
  MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  EventPair ev;
  std::vector<double> t;
  for (int r = 0; r < warmup + replays; ++r) {
    // One untimed replay ahead of the start event keeps the GPU busy while the timed replay is
    // submitted, so the host's submission gap is not inside the events.
    MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    ev.start(stream);
    MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    ev.stop(stream);
    const double us = ev.elapsed_us();
    if (r >= warmup) t.push_back(us / rotation);
  }
  MEGAMOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MEGAMOE_CUDA_CHECK(cudaGraphDestroy(graph));
  *median_us = median(t);
  *min_us = *std::min_element(t.begin(), t.end());
}

nlohmann::json environment_json(const std::string& git_rev) {
  const cuda::DeviceInfo& info = cuda::device_info();
  nlohmann::json env;
  env["gpu"] = info.name;
  env["sm_count"] = info.sm_count;
  env["l2_bytes"] = info.l2_bytes;
  env["max_sm_clock_mhz"] = info.max_clock_khz / 1000;
  env["max_mem_clock_mhz"] = info.mem_clock_khz / 1000;
  env["driver_cuda_version"] = info.driver_version;  // CUDA version the driver supports
  env["cuda_runtime_version"] = info.runtime_version;
  env["driver"] = run_command(
      "nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1");
  // SM clock, memory clock, max SM clock, power, temperature when the run starts.
  env["clocks_now"] = run_command(
      "nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu "
      "--format=csv,noheader 2>/dev/null | head -1");
  std::string rev = git_rev;
  if (rev.empty()) rev = run_command("git rev-parse --short HEAD 2>/dev/null");
  env["git_rev"] = rev.empty() ? "unknown" : rev;
  return env;
}

int run_bench(const BenchOptions& o) {
  MEGAMOE_CHECK(sm90_available(), ErrorCode::kUnsupported,
                "bench: needs an sm_90 GPU (H100/H200); ",
                cuda_available() ? "the current device is " + cuda::device_info().name
                                 : std::string("no CUDA device is available"));
  const cuda::DeviceInfo& info = cuda::device_info();
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::vector<int64_t> token_counts;
  for (const auto& s : split_list(o.tokens)) token_counts.push_back(std::stoll(s));
  MEGAMOE_CHECK_ARG(!token_counts.empty(), "bench: --tokens is empty");
  for (int64_t t : token_counts) MEGAMOE_CHECK_ARG(t > 0, "bench: token counts must be > 0, got ", t);
  const int64_t capacity = *std::max_element(token_counts.begin(), token_counts.end());
  const RoutingKind routing = parse_routing_kind(o.routing);

  nlohmann::json env = environment_json(o.git_rev);
  Ceilings ceil;
  if (o.ceilings) ceil = measure_ceilings(stream);
  std::printf("megamoe bench: %s, %d SMs, L2 %.0f MB, driver %s (CUDA %d), CUDA runtime %d, git %s\n",
              info.name.c_str(), info.sm_count, info.l2_bytes / 1e6,
              env["driver"].get<std::string>().c_str(), info.driver_version, info.runtime_version,
              env["git_rev"].get<std::string>().c_str());
  std::printf("clocks now: %s\n", env["clocks_now"].get<std::string>().c_str());
  std::printf("ceilings (%s): copy %.2f TB/s (read + written), BF16 GEMM %d^3 %.0f TFLOP/s; "
              "FP8 %.0f TFLOP/s (targets.md)\n",
              ceil.measured ? "measured now" : "targets.md", ceil.copy_tbs, kCeilingGemmDim,
              ceil.bf16_tflops, kTargetsFp8DenseTflops);

  FILE* json_file = nullptr;
  if (!o.json_path.empty()) {
    json_file = std::fopen(o.json_path.c_str(), "a");
    MEGAMOE_CHECK(json_file != nullptr, ErrorCode::kIo, "bench: cannot open --json ", o.json_path);
    nlohmann::json j = env;
    j["record"] = "ceilings";
    j["copy_tbs"] = ceil.copy_tbs;
    j["bf16_gemm_tflops"] = ceil.bf16_tflops;
    j["fp8_gemm_tflops_targets_md"] = kTargetsFp8DenseTflops;
    j["ceilings_measured"] = ceil.measured;
    std::fprintf(json_file, "%s\n", j.dump().c_str());
  }

  for (const std::string& shape_name : split_list(o.shapes)) {
    LayerConfig config;
    config.shape = shape_preset(shape_name);
    config.ep_size = o.ep_size;
    config.ep_rank = 0;
    config.max_tokens_per_rank = capacity;
    config.activation = o.activation.empty() ? activation_preset(shape_name)
                                             : Activation::parse(o.activation);
    config.fast_math = !o.exact;
    o.precision.apply(config);
    o.sm90.apply(config);
    config.validate();
    const LayerShape& s = config.shape;
    const int64_t el = config.num_local_experts();

    // ---- weights: synthetic, generated on the host in parallel, prepared on the device ----
    const auto t0 = std::chrono::steady_clock::now();
    const bool bias = config.activation.kind == ActivationKind::kSwigluOai;
    MoeWeights prepared = sm90::Sm90Layer::prepare_device_weights(
        config, synthetic_weights(config, o.seed, bias));
    const double gen_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t weight_bytes = prepared.total_bytes();
    const int64_t l2_rotation_bytes = kL2Multiple * info.l2_bytes;
    const int num_weight_copies =
        static_cast<int>(std::max<int64_t>(1, (l2_rotation_bytes + weight_bytes - 1) / weight_bytes));
    std::vector<MoeWeights> copies;
    for (int i = 1; i < num_weight_copies; ++i) copies.push_back(prepared.to(prepared.device()));
    std::vector<std::unique_ptr<sm90::Sm90Layer>> layers;
    layers.push_back(std::make_unique<sm90::Sm90Layer>(config, &prepared));
    for (auto& c : copies) layers.push_back(std::make_unique<sm90::Sm90Layer>(config, &c));
    std::printf("\n== %s (H=%lld I=%lld E=%lld K=%lld, EP %d: %lld local experts), activation %s, %s, "
                "precision %s (fp8 from %lld rows per expert), GEMMs %s, decode front %s; "
                "weights %.2f GB (generated + prepared in %.1f s), %d weight cop%s rotated\n",
                shape_name.c_str(), (long long)s.hidden, (long long)s.intermediate,
                (long long)s.num_experts, (long long)s.top_k, o.ep_size, (long long)el,
                config.activation.to_string().c_str(), o.exact ? "exact math" : "fast_math",
                to_string(config.precision), (long long)config.fp8_min_rows_per_expert,
                config.sm90.mega_kernel ? "MegaMoE kernel where it applies" : "chained",
                config.sm90.decode_front ? "on" : "off", weight_bytes / 1e9, gen_s,
                num_weight_copies, num_weight_copies == 1 ? "y" : "ies");
    std::printf("%8s %6s %10s %10s %9s %9s %9s %9s %7s %7s %7s | %s\n", "tokens", "sets",
                "median_us", "min_us", "TFLOP/s", "wGB/s", "floor_us", "t_mem_us", "f_floor",
                "f_bf16", "f_fp8", "stages: us (% of layer)");

    const double bytes_per_expert = 3.0 * s.hidden * s.intermediate * (0.5 + 1.0 / 32.0);
    for (int64_t tokens : token_counts) {
      // ---- input sets: enough that inputs rotate through > 3 x L2, at least kMinInputSets ----
      const int64_t set_bytes = tokens * s.hidden * 2 * 2 + tokens * s.top_k * 8;
      const int num_sets = static_cast<int>(std::clamp<int64_t>(
          (l2_rotation_bytes + set_bytes - 1) / set_bytes, kMinInputSets, kMaxInputSets));
      std::vector<InputSet> sets(static_cast<size_t>(num_sets));
      double experts_hit = 0;
      double local_slots = 0;  // routed (token, slot) pairs of this rank: the GEMMs' rows
      for (int i = 0; i < num_sets; ++i) {
        const uint64_t seed = o.seed * 7919 + static_cast<uint64_t>(tokens) * 131 + i;
        const auto x = activations_parallel(tokens, s.hidden, seed);
        const Routing r = make_routing(routing, tokens, s.num_experts, s.top_k, seed);
        InputSet& in = sets[static_cast<size_t>(i)];
        in.x = Buffer(static_cast<int64_t>(x.size() * 2), Device::cuda());
        in.idx = Buffer(static_cast<int64_t>(r.topk_idx.size() * 4), Device::cuda());
        in.w = Buffer(static_cast<int64_t>(r.topk_weights.size() * 4), Device::cuda());
        copy_bytes(in.x.data(), in.x.device(), x.data(), Device::cpu(), in.x.size());
        copy_bytes(in.idx.data(), in.idx.device(), r.topk_idx.data(), Device::cpu(), in.idx.size());
        copy_bytes(in.w.data(), in.w.device(), r.topk_weights.data(), Device::cpu(), in.w.size());
        std::set<int32_t> hit;
        int64_t slots_here = 0;
        for (int32_t id : r.topk_idx)
          if (id >= config.first_local_expert() && id < config.first_local_expert() + el) {
            hit.insert(id);
            ++slots_here;
          }
        local_slots += static_cast<double>(slots_here) / num_sets;
        in.experts_hit = static_cast<int64_t>(hit.size());
        experts_hit += static_cast<double>(hit.size()) / num_sets;
      }
      Buffer y(tokens * s.hidden * 2, Device::cuda());
      const int rotation = std::max<int>(num_sets, static_cast<int>(layers.size()));

      // Eager call once (module load, errors), then graphs.
      layers[0]->forward(sets[0].x.as<uint16_t>(), sets[0].idx.as<int32_t>(), sets[0].w.as<float>(),
                         tokens, y.as<uint16_t>(), stream);
      layers[0]->check_errors(stream);

      double med = 0, mn = 0;
      time_graph(layers, sets, y, tokens, sm90::Stage::kCombine, rotation, o.warmup, o.replays,
                 stream, &med, &mn);
      std::vector<double> prefix(sm90::kNumLayerStages, 0.0);
      if (o.stages) {
        for (int st = 0; st + 1 < sm90::kNumLayerStages; ++st) {
          double m2 = 0, n2 = 0;
          time_graph(layers, sets, y, tokens, static_cast<sm90::Stage>(st), rotation, o.warmup,
                     std::max(3, o.replays / 2), stream, &m2, &n2);
          prefix[st] = m2;
        }
        prefix[sm90::kNumLayerStages - 1] = med;
      }
      layers[0]->check_errors(stream);

      // ---- floors ----
      // Routed work of this rank: 6 H I per local slot (= 6 T K H I with EP = 1, targets.md).
      const double flops = 6.0 * local_slots * s.hidden * s.intermediate;
      const double wbytes = experts_hit * bytes_per_expert;
      const double abytes = 2.0 * tokens * s.hidden * 2 + tokens * s.top_k * 8.0;
      const double t_mem = (wbytes + abytes) / (ceil.copy_tbs * 1e12) * 1e6;
      const double t_bf16 = flops / (ceil.bf16_tflops * 1e12) * 1e6;
      const double t_fp8 = flops / (kTargetsFp8DenseTflops * 1e12) * 1e6;
      const double floor_us = std::max(t_mem, t_bf16);
      const double tflops = flops / (med * 1e-6) / 1e12;
      const double wgbs = wbytes / (med * 1e-6) / 1e9;

      std::ostringstream stages_txt;
      if (config.precision == Precision::kFp8)
        stages_txt << (config.fp8_for_tokens(tokens) ? "[fp8] " : "[exact] ");
      nlohmann::json stage_json = nlohmann::json::object();
      if (o.stages) {
        double prev = 0;
        for (int st = 0; st < sm90::kNumLayerStages; ++st) {
          const double us = std::max(0.0, prefix[st] - prev);
          prev = prefix[st];
          const char* name = sm90::stage_name(static_cast<sm90::Stage>(st));
          stages_txt << name << " " << static_cast<int64_t>(us + 0.5) << " (" 
                     << static_cast<int>(100.0 * us / med + 0.5) << "%) ";
          stage_json[name] = us;
        }
      }
      std::printf("%8lld %6d %10.1f %10.1f %9.1f %9.0f %9.1f %9.1f %7.3f %7.3f %7.3f | %s\n",
                  (long long)tokens, num_sets, med, mn, tflops, wgbs, floor_us, t_mem,
                  floor_us / med, std::max(t_mem, t_bf16) / med, std::max(t_mem, t_fp8) / med,
                  stages_txt.str().c_str());
      std::fflush(stdout);
      if (json_file != nullptr) {
        nlohmann::json j = env;
        j["record"] = "layer";
        j["shape"] = shape_name;
        j["hidden"] = s.hidden;
        j["intermediate"] = s.intermediate;
        j["experts"] = s.num_experts;
        j["top_k"] = s.top_k;
        j["ep_size"] = o.ep_size;
        j["tokens"] = tokens;
        j["routing"] = routing_kind_name(routing);
        j["activation"] = config.activation.to_string();
        j["fast_math"] = config.fast_math;
        j["precision"] = to_string(config.precision);
        j["fp8_call"] = config.fp8_for_tokens(tokens);
        j["gemm_tile"] = config.sm90.gemm_tile;
        j["mega_kernel"] = config.sm90.mega_kernel;
        j["decode_front"] = config.sm90.decode_front;
        j["programmatic_launch"] = config.sm90.programmatic_launch;
        j["rows_hint"] = to_string(config.sm90.rows_hint);
        j["median_us"] = med;
        j["min_us"] = mn;
        j["tflops"] = tflops;
        j["weight_gbs"] = wgbs;
        j["experts_hit"] = experts_hit;
        j["local_slots"] = local_slots;
        j["weight_bytes_hit"] = wbytes;
        j["t_mem_us"] = t_mem;
        j["t_math_bf16_us"] = t_bf16;
        j["t_math_fp8_us"] = t_fp8;
        j["floor_us"] = floor_us;
        j["fraction_of_floor"] = floor_us / med;
        j["fraction_of_fp8_floor"] = std::max(t_mem, t_fp8) / med;
        j["copy_tbs"] = ceil.copy_tbs;
        j["bf16_gemm_tflops"] = ceil.bf16_tflops;
        j["input_sets"] = num_sets;
        j["weight_copies"] = num_weight_copies;
        j["replays"] = o.replays;
        j["calls_per_replay"] = rotation;
        j["stages_us"] = stage_json;
        std::fprintf(json_file, "%s\n", j.dump().c_str());
        std::fflush(json_file);
      }
    }
  }
  if (json_file != nullptr) std::fclose(json_file);
  MEGAMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  return kExitOk;
}
#endif  // MEGAMOE_WITH_CUDA

const Command kBench{
    "bench", "Time the Hopper MoE layer (targets.md protocol): us, TFLOP/s, GB/s, floors, stages",
    [](CLI::App& app) -> CommandMain {
      auto o = std::make_shared<BenchOptions>();
      app.add_option("--shape", o->shapes, "comma-separated shape presets")->capture_default_str();
      app.add_option("--tokens", o->tokens, "comma-separated token counts per rank")->capture_default_str();
      app.add_option("--routing", o->routing, "uniform | skewed | adversarial")->capture_default_str();
      app.add_option("--activation", o->activation, "activation spec (default: the shape's preset)");
      app.add_flag("--exact", o->exact, "fast_math off (exact exp and division in the epilogue)");
      o->precision.add_to(app);
      app.add_option("--ep-size", o->ep_size, "expert-parallel size; rank 0's share is timed")->capture_default_str();
      app.add_option("--replays", o->replays, "timed graph replays per point")->capture_default_str();
      app.add_option("--warmup", o->warmup, "untimed replays first")->capture_default_str();
      app.add_flag("!--no-stages", o->stages, "skip the per-stage breakdown");
      app.add_flag("!--no-ceilings", o->ceilings, "use the targets.md ceilings instead of measuring");
      app.add_option("--json", o->json_path, "append JSON lines to this file");
      app.add_option("--git-rev", o->git_rev, "revision recorded in the JSON (default: git rev-parse)");
      app.add_option("--seed", o->seed, "seed of weights, inputs and routing")->capture_default_str();
      o->sm90.add_to(app);
      app.add_flag("--list-tiles", o->list_tiles, "print the GEMM tile table and exit");
      return [o]() -> int {
        if (o->list_tiles) return list_tiles();
#if defined(MEGAMOE_WITH_CUDA)
        return run_bench(*o);
#else
        fail(ErrorCode::kUnsupported, "bench: megamoe was built without CUDA");
#endif
      };
    }};

}  // namespace
}  // namespace megamoe::cli
