// backend.hpp: what a MoeLayer backend implements, and the factories layer.cpp knows.
//
// MoeLayer (src/moe/layer.cpp) checks every TensorView (dtype, shape, contiguity, device, null
// data) and the capacity, then calls LayerBackend::forward with raw pointers:
//   x            bf16  [T, H]   on device()
//   topk_idx     int32 [T, K]   ids not yet checked: a backend must never index with an invalid
//                               one and must report it (kOutOfRange naming token and slot)
//   topk_weights fp32  [T, K]
//   y            bf16  [T, H]   written in full
//   0 <= T <= config().max_tokens_per_rank (T = 0 is a valid call: EP ranks all take part)
//
// Backends, best first:
//   sm90  src/moe/sm90_layer.cu   Hopper kernels; needs a CUDA build and a compute-capability 9.0
//                                 device (megamoe::sm90_available())
//   cpu   src/moe/backend_cpu.cpp the reference of the contract (reference/), any machine
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/ep.hpp"
#include "megamoe/tensor.hpp"
#include "megamoe/weights.hpp"

namespace megamoe::detail {

class LayerBackend {
 public:
  LayerBackend(std::string name, const LayerConfig& config, MoeWeights weights, Device device)
      : name_(std::move(name)), config_(config), weights_(std::move(weights)), device_(device) {}
  virtual ~LayerBackend() = default;
  LayerBackend(const LayerBackend&) = delete;
  LayerBackend& operator=(const LayerBackend&) = delete;

  // stream: a cudaStream_t for GPU backends (nullptr = legacy default stream).
  virtual void forward(const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
                       int64_t num_tokens, uint16_t* y, void* stream) = 0;

  // Asynchronous backends record errors found on the device (invalid expert ids) instead of
  // throwing from forward: this waits for `stream` and throws them (kOutOfRange naming token and
  // slot), clearing the record. Synchronous backends throw from forward and need nothing here.
  virtual void check_errors(void* stream) { (void)stream; }

  // Rows each local expert received in the last call (waits for `stream`); empty when the
  // backend does not keep them.
  virtual std::vector<int64_t> expert_rows(void* stream) { return {}; }
  // The EP group the layer communicates over (null: none). forward() of a layer with a group
  // also takes calls above the capacity (it must still take part) and throws afterwards.
  virtual const std::shared_ptr<EpGroup>& ep_group() const {
    static const std::shared_ptr<EpGroup> none;
    return none;
  }

  // MoeLayer::last_call_kernels.
  virtual std::string last_call_kernels() const { return name_; }

  const std::string& name() const { return name_; }
  const LayerConfig& config() const { return config_; }
  const MoeWeights& weights() const { return weights_; }
  Device device() const { return device_; }

 protected:
  std::string name_;
  LayerConfig config_;
  MoeWeights weights_;  // in the backend's layout, on device_ (after preparation)
  Device device_;
};

// The CPU backend: canonical weights on the host (copied there if given on a device).
std::unique_ptr<LayerBackend> make_cpu_backend(const LayerConfig& config, MoeWeights&& weights);

#if defined(MEGAMOE_WITH_CUDA)
// Defined in src/moe/sm90_layer.cu. Prepares `weights` for the sm90 layout on the current
// device; throws kUnsupported when no compute-capability 9.0 device is present.
// With `ep` non-null the layer is that rank of the EP group (megamoe/ep.hpp).
std::unique_ptr<LayerBackend> make_sm90_backend(const LayerConfig& config, MoeWeights&& weights,
                                                std::shared_ptr<EpGroup> ep = nullptr);
#endif

}  // namespace megamoe::detail
