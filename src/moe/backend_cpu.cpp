// The "cpu" layer backend: the CPU reference of the contract (reference/moe_reference.cpp).
#include "megamoe/error.hpp"
#include "megamoe/reference.hpp"
#include "moe/backend.hpp"

namespace megamoe::detail {

namespace {

class CpuBackend final : public LayerBackend {
 public:
  CpuBackend(const LayerConfig& config, MoeWeights weights)
      : LayerBackend("cpu", config, std::move(weights), Device::cpu()) {}

  void forward(const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
               int64_t num_tokens, uint16_t* y, void* /*stream: the CPU path is synchronous*/) override {
    reference_forward(config_, weights_, x, topk_idx, topk_weights, num_tokens, y);
  }
};

// Weights given on a device are copied to the host, buffer by buffer.
MoeWeights to_host(MoeWeights&& w) {
  if (w.device().type == DeviceType::kCPU) return std::move(w);
  return w.to(Device::cpu());
}

}  // namespace

std::unique_ptr<LayerBackend> make_cpu_backend(const LayerConfig& config, MoeWeights&& weights) {
  MEGAMOE_CHECK_ARG(weights.layout == kCanonicalLayout, "backend cpu: needs weights in the '",
                    kCanonicalLayout, "' layout, got '", weights.layout, "'");
  MoeWeights host = to_host(std::move(weights));
  host.validate_canonical();
  host.check_matches(config);
  return std::make_unique<CpuBackend>(config, std::move(host));
}

}  // namespace megamoe::detail
