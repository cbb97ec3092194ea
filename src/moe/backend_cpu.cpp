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
  MoeWeights h;
  h.num_local_experts = w.num_local_experts;
  h.first_expert = w.first_expert;
  h.hidden = w.hidden;
  h.intermediate = w.intermediate;
  h.layout = w.layout;
  h.w13 = w.w13.to(Device::cpu());
  h.w13_sf = w.w13_sf.to(Device::cpu());
  h.w2 = w.w2.to(Device::cpu());
  h.w2_sf = w.w2_sf.to(Device::cpu());
  if (w.has_bias()) {
    h.w13_bias = w.w13_bias.to(Device::cpu());
    h.w2_bias = w.w2_bias.to(Device::cpu());
  }
  return h;
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
