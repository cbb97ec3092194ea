// ep_bench.cu: what expert parallelism costs on one GPU (megamoe_ep_bench; docs/perf.md, "Expert
// parallelism"). Prints one JSON object per line.
//
//   overhead   the layer of one rank with an EP group (NCCL when a usable libnccl loads, else one
//              virtual rank) against the same layer without a group, at every token count of
//              targets.md: CUDA-graph replays, same weights, same inputs, same run
//   exchange   R virtual ranks' dispatch (send + row lists) and dispatch + return, without the
//              GEMMs: bytes moved per second against the copy ceiling of the same run
//   ranks      (MEGAMOE_BENCH_VIRTUAL_TOKENS set) R virtual ranks' whole layer calls in one
//              graph, per EP config, each rank T tokens: the time of all R calls
//
// Environment: MEGAMOE_BENCH_SHAPES (default "kimi-k3,deepseek-v3"), MEGAMOE_BENCH_TOKENS (default
// "1,8,64,512,4096,8192"), MEGAMOE_BENCH_RANKS (exchange and ranks, default 8),
// MEGAMOE_BENCH_EXCHANGE_TOKENS (default "64,512,4096"), MEGAMOE_BENCH_TRANSPORTS (overhead,
// default "nccl,virtual"), MEGAMOE_BENCH_EP_CONFIGS (overhead and ranks: the EP layer's configs,
// default "chain"; any of chain, mega, mega_dispatch, mega_combine, mega_dispatch_combine:
// LayerConfig::sm90.mega_kernel, mega_dispatch and mega_combine), MEGAMOE_BENCH_TILE (default "auto": LayerConfig::sm90.gemm_tile),
// MEGAMOE_BENCH_VIRTUAL_TOKENS (ranks: tokens per rank, default none: not run).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ep/ep_group.hpp"
#include "ep/ep_launch.hpp"
#include "gpu_timing.hpp"
#include "megamoe/ep.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/weights.hpp"
#include "ep_test_util.hpp"
#include "runtime/random.hpp"
#include "sm90_test_util.hpp"

namespace megamoe::bench {
namespace {

std::vector<std::string> list_env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  std::stringstream ss(v != nullptr && *v != '\0' ? v : fallback);
  std::vector<std::string> out;
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

LayerConfig config_for(const std::string& shape, int64_t capacity) {
  LayerConfig c;
  c.shape = shape_preset(shape);
  c.activation = activation_preset(shape);
  c.max_tokens_per_rank = capacity;
  return c;
}

// An EP layer's config by name (MEGAMOE_BENCH_EP_CONFIGS) and the tile of MEGAMOE_BENCH_TILE.
LayerConfig ep_variant(LayerConfig c, const std::string& name) {
  c.sm90.gemm_tile = list_env("MEGAMOE_BENCH_TILE", "auto").front();
  c.sm90.mega_kernel = name.rfind("mega", 0) == 0;
  c.sm90.mega_dispatch = name.find("dispatch") != std::string::npos;
  c.sm90.mega_combine = name.find("combine") != std::string::npos;
  return c;
}

struct Inputs {
  test::DeviceArray<uint16_t> x, y;
  test::DeviceArray<int32_t> idx;
  test::DeviceArray<float> w;
};

Inputs make_inputs(const LayerConfig& c, int64_t t, uint64_t seed) {
  const test::RoutingData r =
      test::make_routing(test::Routing::kUniform, t, c.shape.num_experts, c.shape.top_k, seed);
  Inputs in;
  in.x = test::DeviceArray<uint16_t>(test::make_inputs(t, c.shape.hidden, seed));
  in.y = test::DeviceArray<uint16_t>(t * c.shape.hidden);
  in.idx = test::DeviceArray<int32_t>(r.idx);
  in.w = test::DeviceArray<float>(r.weights);
  return in;
}

double time_layer(MoeLayer& layer, const LayerConfig& c, Inputs& in, int64_t t) {
  Stream stream;
  const Device dev = Device::cuda();
  const int64_t h = c.shape.hidden, k = c.shape.top_k;
  auto call = [&] {
    layer.forward(TensorView::contiguous(in.x.get(), DType::kBF16, {t, h}, dev),
                  TensorView::contiguous(in.idx.get(), DType::kI32, {t, k}, dev),
                  TensorView::contiguous(in.w.get(), DType::kF32, {t, k}, dev),
                  TensorView::contiguous(in.y.get(), DType::kBF16, {t, h}, dev), stream);
  };
  call();
  layer.check_errors(stream);
  StreamGraph graph(stream, call);
  const GraphTiming timing = time_graph_launches(graph, stream, 1, 7);
  layer.check_errors(stream);
  return timing.median_us;
}

// The EP layer of one rank against the plain layer, same weights (generated twice from one seed),
// on each transport of MEGAMOE_BENCH_TRANSPORTS ("nccl" needs a usable libnccl). The plain layer
// is timed before and after the EP layer, so drift shows as a difference between the two.
void overhead(const std::string& shape, const std::vector<int64_t>& tokens) {
  const int64_t cap = *std::max_element(tokens.begin(), tokens.end());
  const LayerConfig c = config_for(shape, cap);
  MoeLayer plain(c, synthetic_weights(c, 1), "sm90");
  for (const auto& transport : list_env("MEGAMOE_BENCH_TRANSPORTS", "nccl,virtual")) {
    std::shared_ptr<EpGroup> group;
    if (transport == "nccl") {
      if (!nccl_available()) {
        std::printf("{\"bench\": \"ep_overhead\", \"transport\": \"nccl\", \"skipped\": "
                    "\"no usable libnccl\"}\n");
        continue;
      }
      group = EpGroup::create_nccl(nccl_unique_id(), 1, 0, c);
    } else {
      group = EpGroup::create_virtual(1, c).front();
    }
    for (const auto& variant : list_env("MEGAMOE_BENCH_EP_CONFIGS", "chain")) {
      const LayerConfig cv = ep_variant(c, variant);
      MoeLayer with_ep(cv, synthetic_weights(cv, 1), group, "sm90");
      for (int64_t t : tokens) {
        Inputs in = make_inputs(c, t, 100 + t);
        const double plain_us = time_layer(plain, c, in, t);
        const std::vector<uint16_t> y_plain = in.y.download();
        const double ep_us = time_layer(with_ep, cv, in, t);
        const std::vector<uint16_t> y_ep = in.y.download();
        const double plain_again_us = time_layer(plain, c, in, t);
        int64_t mismatches = 0;
        for (size_t i = 0; i < y_plain.size(); ++i) mismatches += y_plain[i] != y_ep[i];
        std::printf("{\"bench\": \"ep_overhead\", \"shape\": \"%s\", \"tokens\": %lld, "
                    "\"transport\": \"%s\", \"config\": \"%s\", \"kernels\": \"%s\", "
                    "\"plain_us\": %.2f, \"plain_again_us\": %.2f, \"ep_us\": %.2f, "
                    "\"overhead_us\": %.2f, \"mismatches\": %lld}\n",
                    shape.c_str(), static_cast<long long>(t), transport.c_str(), variant.c_str(),
                    with_ep.last_call_kernels().c_str(), plain_us, plain_again_us, ep_us,
                    ep_us - std::min(plain_us, plain_again_us), static_cast<long long>(mismatches));
        std::fflush(stdout);
      }
    }
  }
}

// R virtual ranks' layer calls (T tokens each, uniform routing) captured in one graph (a fork /
// join over their streams), per EP config: the time of the R calls sharing the GPU, and whether
// every config gives the first one's outputs.
void virtual_ranks(const std::string& shape, int ranks, int64_t t) {
  std::vector<uint16_t> first;
  for (const auto& variant : list_env("MEGAMOE_BENCH_EP_CONFIGS", "chain")) {
    const LayerConfig c = ep_variant(config_for(shape, t), variant);
    test::EpRanks ep(c, ranks, 1);
    ep.upload(test::make_ep_inputs(c, std::vector<int64_t>(static_cast<size_t>(ranks), t),
                                   test::Routing::kUniform, 700));
    ep.forward();
    ep.sync();
    const std::string kernels = ep.layer(0).last_call_kernels();
    Stream origin;
    std::vector<cudaEvent_t> ev(static_cast<size_t>(ranks) + 1);
    for (auto& x : ev) MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&x, cudaEventDisableTiming));
    StreamGraph graph(origin, [&] {
      MEGAMOE_CUDA_CHECK(cudaEventRecord(ev[ranks], origin));
      for (int r = 0; r < ranks; ++r) {
        MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(ep.stream(r), ev[ranks]));
        ep.forward_rank(r);
        MEGAMOE_CUDA_CHECK(cudaEventRecord(ev[r], ep.stream(r)));
      }
      for (int r = 0; r < ranks; ++r) MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(origin, ev[r]));
    });
    const double us = time_graph_launches(graph, origin, 1, 7).median_us;
    for (int r = 0; r < ranks; ++r) ep.layer(r).check_errors(ep.stream(r));
    const std::vector<uint16_t> y = ep.output();
    if (first.empty()) first = y;
    int64_t mismatches = 0;
    for (size_t i = 0; i < y.size(); ++i) mismatches += y[i] != first[i];
    for (auto& x : ev) cudaEventDestroy(x);
    std::printf("{\"bench\": \"ep_virtual_ranks\", \"shape\": \"%s\", \"ranks\": %d, "
                "\"tokens_per_rank\": %lld, \"config\": \"%s\", \"kernels\": \"%s\", "
                "\"us\": %.2f, \"mismatches_vs_first\": %lld}\n",
                shape.c_str(), ranks, static_cast<long long>(t), variant.c_str(), kernels.c_str(),
                us, static_cast<long long>(mismatches));
    std::fflush(stdout);
  }
}

// One rank's buffers for the exchange alone (the GEMMs' input/output rows stand in as bytes).
struct RankExchange {
  test::DeviceArray<uint16_t> x;  // bf16: what a fused call (ep::fused_send) quantizes and sends
  test::DeviceArray<uint8_t> x_q, x_sf;
  test::DeviceArray<int32_t> idx, slot_map, row_offsets, row_slot;
  test::DeviceArray<float> w, row_weights;
  test::DeviceArray<uint16_t> out;
  test::DeviceArray<sm90::DispatchError> error;
  std::unique_ptr<Stream> stream;
};

void exchange(const std::string& shape, int ranks, int64_t t, double copy_tbs) {
  const LayerConfig c = config_for(shape, t);
  const int64_t h = c.shape.hidden, k = c.shape.top_k, e = c.shape.num_experts;
  EpOptions options;
  options.max_recv_rows = 2 * t * k;  // uniform routing: about t*k rows per rank
  const std::vector<std::shared_ptr<EpGroup>> groups = EpGroup::create_virtual(ranks, c, options);
  ep::configure_dispatch(e / ranks);
  ep::load_kernels();
  std::vector<RankExchange> rx(static_cast<size_t>(ranks));
  double dispatch_bytes = 0;
  for (int r = 0; r < ranks; ++r) {
    RankExchange& b = rx[r];
    const test::RoutingData rd = test::make_routing(test::Routing::kUniform, t, e, k, 500 + r);
    std::vector<uint8_t> xq(static_cast<size_t>(t * h), 0x38), sf(static_cast<size_t>(t * h / 32), 127);
    b.x = test::DeviceArray<uint16_t>(std::vector<uint16_t>(static_cast<size_t>(t * h), 0x3F80));
    b.x_q = test::DeviceArray<uint8_t>(xq);
    b.x_sf = test::DeviceArray<uint8_t>(sf);
    b.idx = test::DeviceArray<int32_t>(rd.idx);
    b.w = test::DeviceArray<float>(rd.weights);
    b.slot_map = test::DeviceArray<int32_t>(t * k);
    b.row_offsets = test::DeviceArray<int32_t>(e / ranks + 1);
    b.row_slot = test::DeviceArray<int32_t>(options.max_recv_rows);
    b.row_weights = test::DeviceArray<float>(options.max_recv_rows);
    b.out = test::DeviceArray<uint16_t>(options.max_recv_rows * h);
    b.out.fill_bytes(0);
    b.error = test::DeviceArray<sm90::DispatchError>(std::vector<sm90::DispatchError>{{~0ull, 0}});
    b.stream = std::make_unique<Stream>();
    for (int64_t tok = 0; tok < t; ++tok) {
      uint64_t mask = 0;
      for (int64_t j = 0; j < k; ++j) mask |= 1ull << (rd.idx[tok * k + j] / (e / ranks));
      dispatch_bytes += static_cast<double>(__builtin_popcountll(mask)) * (h + h / 32);
    }
    dispatch_bytes += static_cast<double>(t * k) * 8 * ranks;  // ids and weights to every rank
  }
  const double combine_bytes = static_cast<double>(ranks) * t * k * h * 2;

  std::vector<cudaEvent_t> ev(static_cast<size_t>(ranks) + 1);
  for (auto& x : ev) MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&x, cudaEventDisableTiming));
  auto issue = [&](bool with_return) {
    Stream& origin = *rx[0].stream;
    MEGAMOE_CUDA_CHECK(cudaEventRecord(ev[ranks], origin));
    for (int r = 0; r < ranks; ++r) {
      RankExchange& b = rx[r];
      const ep::EpParams p = groups[r]->impl().params(t, t, e);
      if (r > 0) MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(*b.stream, ev[ranks]));
      ep::SendInputs send;
      send.x = b.x.get();
      send.x_q = b.x_q.get();
      send.x_sf = b.x_sf.get();
      send.topk_idx = b.idx.get();
      send.topk_weights = b.w.get();
      send.slot_map = b.slot_map.get();
      send.error = b.error.get();
      if (!ep::fused_send(p)) ep::launch_send(p, send, *b.stream, true);
      ep::launch_dispatch(p, send, b.row_offsets.get(), b.row_slot.get(), b.row_weights.get(),
                          nullptr, *b.stream, true);
      if (with_return)
        ep::launch_return(p, b.out.get(), b.row_offsets.get(), b.row_slot.get(), *b.stream, true);
      MEGAMOE_CUDA_CHECK(cudaEventRecord(ev[r], *b.stream));
    }
    for (int r = 1; r < ranks; ++r) MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(origin, ev[r]));
  };
  double us[2];
  for (int with_return = 0; with_return < 2; ++with_return) {
    StreamGraph graph(*rx[0].stream, [&] { issue(with_return != 0); });
    us[with_return] = time_graph_launches(graph, *rx[0].stream, 1, 7).median_us;
  }
  for (auto& x : ev) cudaEventDestroy(x);
  for (int r = 0; r < ranks; ++r) groups[r]->impl().check_errors(*rx[r].stream);
  const double dispatch_gbs = dispatch_bytes / us[0] * 1e-3;
  const double combine_us = us[1] - us[0];
  const double combine_gbs = combine_bytes / combine_us * 1e-3;
  std::printf("{\"bench\": \"ep_exchange\", \"shape\": \"%s\", \"ranks\": %d, \"tokens_per_rank\": "
              "%lld, \"dispatch_us\": %.2f, \"dispatch_and_return_us\": %.2f, \"dispatch_bytes\": "
              "%.0f, \"return_bytes\": %.0f, \"dispatch_gbs\": %.1f, \"return_gbs\": %.1f, "
              "\"copy_ceiling_tbs\": %.3f, \"dispatch_of_ceiling\": %.3f, \"return_of_ceiling\": "
              "%.3f}\n",
              shape.c_str(), ranks, static_cast<long long>(t), us[0], us[1], dispatch_bytes,
              combine_bytes, dispatch_gbs, combine_gbs, copy_tbs,
              2 * dispatch_gbs * 1e-3 / copy_tbs, 2 * combine_gbs * 1e-3 / copy_tbs);
  std::fflush(stdout);
}

}  // namespace
}  // namespace megamoe::bench

int main() {
  using namespace megamoe;
  if (!sm90_available()) {
    std::printf("megamoe_ep_bench: needs an sm_90 GPU\n");
    return 0;
  }
  std::vector<int64_t> tokens;
  for (const auto& s : bench::list_env("MEGAMOE_BENCH_TOKENS", "1,8,64,512,4096,8192"))
    tokens.push_back(std::stoll(s));
  const double copy_tbs = bench::device_copy_tbs();
  std::printf("{\"bench\": \"copy_ceiling\", \"tbs\": %.3f, \"nccl_version\": %d}\n", copy_tbs,
              nccl_version());
  const int ranks = std::stoi(bench::list_env("MEGAMOE_BENCH_RANKS", "8").front());
  for (const auto& shape : bench::list_env("MEGAMOE_BENCH_SHAPES", "kimi-k3,deepseek-v3")) {
    bench::overhead(shape, tokens);
    for (const auto& t : bench::list_env("MEGAMOE_BENCH_EXCHANGE_TOKENS", "64,512,4096"))
      bench::exchange(shape, ranks, std::stoll(t), copy_tbs);
    for (const auto& t : bench::list_env("MEGAMOE_BENCH_VIRTUAL_TOKENS", ""))
      bench::virtual_ranks(shape, ranks, std::stoll(t));
  }
  return 0;
}
