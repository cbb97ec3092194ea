// ep_test_util.hpp: expert parallelism with R virtual ranks on one GPU, for the GPU tests
// (test_ep.cu) and the EP benchmark (bench/ep_bench.cu).
//
//   EpRanks ranks(config, R, weight_seed);           // R groups + R layers (rank r: its experts)
//   EpInputs in = make_ep_inputs(config, tokens_per_rank, routing, seed);
//   ranks.upload(in);  ranks.forward();  ranks.sync();
//   std::vector<uint16_t> y = ranks.output();        // every rank's y, rank order
//
// The same global problem on one GPU: OneGpu one(config, total_tokens, weight_seed), fed the
// concatenation of the ranks' inputs (in.all_*).
#pragma once

#include <memory>
#include <numeric>
#include <vector>

#include "megamoe/ep.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/weights.hpp"
#include "sm90_test_util.hpp"

namespace megamoe::test {

struct EpInputs {
  std::vector<int64_t> tokens;                 // per rank
  std::vector<std::vector<uint16_t>> x;        // per rank [T_r, H]
  std::vector<std::vector<int32_t>> idx;       // per rank [T_r, K]
  std::vector<std::vector<float>> weights;     // per rank [T_r, K]
  std::vector<uint16_t> all_x;                 // concatenated in rank order
  std::vector<int32_t> all_idx;
  std::vector<float> all_weights;
  int64_t total() const { return std::accumulate(tokens.begin(), tokens.end(), int64_t{0}); }
};

inline EpInputs make_ep_inputs(const LayerConfig& c, const std::vector<int64_t>& tokens,
                               Routing routing, uint64_t seed, double empty_fraction = 0.0) {
  EpInputs in;
  in.tokens = tokens;
  const int64_t h = c.shape.hidden, e = c.shape.num_experts, k = c.shape.top_k;
  for (size_t r = 0; r < tokens.size(); ++r) {
    // Adversarial: every rank's tokens pick the same K experts (all on the first ranks).
    RoutingData rd = make_routing(routing, tokens[r], e, k, seed + 101 * r, empty_fraction);
    in.x.push_back(make_inputs(tokens[r], h, seed + 7 * r + 1));
    in.idx.push_back(std::move(rd.idx));
    in.weights.push_back(std::move(rd.weights));
    in.all_x.insert(in.all_x.end(), in.x.back().begin(), in.x.back().end());
    in.all_idx.insert(in.all_idx.end(), in.idx.back().begin(), in.idx.back().end());
    in.all_weights.insert(in.all_weights.end(), in.weights.back().begin(), in.weights.back().end());
  }
  return in;
}

// One rank's device tensors (sized for the capacity, so any T up to it can be uploaded).
struct EpRankBuffers {
  DeviceArray<uint16_t> x, y;
  DeviceArray<int32_t> idx;
  DeviceArray<float> w;
  int64_t tokens = 0;
};

class EpRanks {
 public:
  // config: the global layer (ep_size 1); its max_tokens_per_rank is every rank's capacity.
  EpRanks(const LayerConfig& config, int ranks, uint64_t weight_seed, const EpOptions& options = {},
          int64_t buffer_tokens = -1)
      : config_(config) {
    groups_ = EpGroup::create_virtual(ranks, config, options);
    const int64_t cap = buffer_tokens >= 0 ? buffer_tokens : config.max_tokens_per_rank;
    const int64_t h = config.shape.hidden, k = config.shape.top_k;
    for (int r = 0; r < ranks; ++r) {
      LayerConfig cr = config;
      cr.ep_size = ranks;
      cr.ep_rank = r;
      layers_.push_back(
          std::make_unique<MoeLayer>(cr, synthetic_weights(cr, weight_seed), groups_[r], "sm90"));
      streams_.push_back(std::make_unique<Stream>());
      EpRankBuffers b;
      b.x = DeviceArray<uint16_t>(cap * h);
      b.y = DeviceArray<uint16_t>(cap * h);
      b.idx = DeviceArray<int32_t>(cap * k);
      b.w = DeviceArray<float>(cap * k);
      buffers_.push_back(std::move(b));
    }
  }

  int size() const { return static_cast<int>(layers_.size()); }
  MoeLayer& layer(int r) { return *layers_[r]; }
  EpGroup& group(int r) { return *groups_[r]; }
  cudaStream_t stream(int r) const { return *streams_[r]; }
  EpRankBuffers& buffers(int r) { return buffers_[r]; }

  void upload(const EpInputs& in) {
    for (int r = 0; r < size(); ++r) {
      EpRankBuffers& b = buffers_[r];
      b.tokens = in.tokens[r];
      b.x.upload(in.x[r]);
      b.idx.upload(in.idx[r]);
      b.w.upload(in.weights[r]);
    }
  }

  // Rank r's call with its uploaded inputs (T = tokens_override when >= 0; the buffers must
  // hold that many rows).
  void forward_rank(int r, int64_t tokens_override = -1) {
    EpRankBuffers& b = buffers_[r];
    const int64_t t = tokens_override >= 0 ? tokens_override : b.tokens;
    const int64_t h = config_.shape.hidden, k = config_.shape.top_k;
    const Device dev = Device::cuda();
    layers_[r]->forward(TensorView::contiguous(b.x.get(), DType::kBF16, {t, h}, dev),
                        TensorView::contiguous(b.idx.get(), DType::kI32, {t, k}, dev),
                        TensorView::contiguous(b.w.get(), DType::kF32, {t, k}, dev),
                        TensorView::contiguous(b.y.get(), DType::kBF16, {t, h}, dev), stream(r));
  }
  // Every rank's call, launched in rank order without waiting (they wait for each other on the
  // device).
  void forward() {
    for (int r = 0; r < size(); ++r) forward_rank(r);
  }
  void sync() {
    for (int r = 0; r < size(); ++r) MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream(r)));
  }
  std::vector<uint16_t> output() {
    std::vector<uint16_t> y;
    for (int r = 0; r < size(); ++r) {
      const std::vector<uint16_t> yr = buffers_[r].y.download(buffers_[r].tokens * config_.shape.hidden);
      y.insert(y.end(), yr.begin(), yr.end());
    }
    return y;
  }

 private:
  LayerConfig config_;
  std::vector<std::shared_ptr<EpGroup>> groups_;
  std::vector<std::unique_ptr<MoeLayer>> layers_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<EpRankBuffers> buffers_;
};

// The same global layer on one GPU without communication.
class OneGpu {
 public:
  OneGpu(LayerConfig config, int64_t capacity, uint64_t weight_seed) : config_(config) {
    config_.ep_size = 1;
    config_.ep_rank = 0;
    config_.max_tokens_per_rank = std::max<int64_t>(capacity, 1);
    layer_ = std::make_unique<MoeLayer>(config_, synthetic_weights(config_, weight_seed), "sm90");
  }
  std::vector<uint16_t> run(const EpInputs& in, cudaStream_t stream = nullptr) {
    const int64_t t = in.total(), h = config_.shape.hidden, k = config_.shape.top_k;
    DeviceArray<uint16_t> x(in.all_x), y(t * h);
    DeviceArray<int32_t> idx(in.all_idx);
    DeviceArray<float> w(in.all_weights);
    const Device dev = Device::cuda();
    layer_->forward(TensorView::contiguous(x.get(), DType::kBF16, {t, h}, dev),
                    TensorView::contiguous(idx.get(), DType::kI32, {t, k}, dev),
                    TensorView::contiguous(w.get(), DType::kF32, {t, k}, dev),
                    TensorView::contiguous(y.get(), DType::kBF16, {t, h}, dev), stream);
    layer_->check_errors(stream);
    return y.download(t * h);
  }
  MoeLayer& layer() { return *layer_; }

 private:
  LayerConfig config_;
  std::unique_ptr<MoeLayer> layer_;
};

}  // namespace megamoe::test
