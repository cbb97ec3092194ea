// megamoe/layer.hpp: one MoE layer call, on the best available backend.
//
//   MoeLayer layer(config, std::move(weights));          // canonical weights; backend "auto"
//   layer.forward(x, topk_idx, topk_weights, y);          // y = MoE(x), numerics.md
//
// Tensors (TensorView, contiguous, on the backend's device):
//   x            bf16  [T, H]
//   topk_idx     int32 [T, K]   global expert ids in [0, E) or -1 (empty slot)
//   topk_weights fp32  [T, K]
//   y            bf16  [T, H]   written in full (zeros for tokens without a valid slot)
// T may be 0 and may not exceed config.max_tokens_per_rank (kOutOfRange; under expert
// parallelism the call still takes part, as T = 0, before it throws).
//
// The layer takes ownership of the weights and prepares them for its backend in place.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/ep.hpp"
#include "megamoe/tensor.hpp"
#include "megamoe/weights.hpp"

namespace megamoe {

namespace detail {
class LayerBackend;
}

class MoeLayer {
 public:
  // backend: "auto" (sm90 when built with CUDA and an sm_90 device is present, else "cpu"),
  // "cpu" or "sm90". Throws kInvalidArgument for an unknown name, kUnsupported when the backend
  // cannot run here, and when the weights do not match the config.
  MoeLayer(const LayerConfig& config, MoeWeights weights, std::string_view backend = "auto");
  // One rank of an EP group (megamoe/ep.hpp): `weights` are this rank's experts
  // (config.ep_size/ep_rank = the group's size/rank), and forward() exchanges tokens and results
  // with the other ranks. Needs a GPU backend ("auto" or "sm90"); the cpu backend throws
  // kUnsupported. Every rank must call forward() for every layer call, T = 0 included.
  MoeLayer(const LayerConfig& config, MoeWeights weights, std::shared_ptr<EpGroup> group,
           std::string_view backend = "auto");
  ~MoeLayer();
  MoeLayer(MoeLayer&&) noexcept;
  MoeLayer& operator=(MoeLayer&&) noexcept;

  // stream: a cudaStream_t for GPU backends (nullptr = legacy default stream); ignored on CPU.
  void forward(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
               const TensorView& y, void* stream = nullptr);

  // GPU backends run forward asynchronously on `stream` and record invalid expert ids found on
  // the device; check_errors waits for `stream` and throws kOutOfRange naming the first bad
  // token/slot since the last check. The cpu backend throws from forward itself (no-op here).
  void check_errors(void* stream = nullptr);

  // Rows (token, slot) each local expert received in the last call, waiting for `stream`
  // (under expert parallelism: from every rank). Empty for the cpu backend.
  std::vector<int64_t> expert_rows(void* stream = nullptr);
  // The layer's EP group, or null.
  std::shared_ptr<EpGroup> ep_group() const;
  // Which kernels ran the expert GEMMs of the last call (host-side record, no wait): "cpu"; sm90:
  // "chain" (the GEMM launches) or "mega" (the MegaMoE kernel), the latter with "+dispatch" when
  // it gathered the received rows (LayerConfig::sm90.mega_dispatch) and "+combine" when it also
  // summed y (LayerConfig::sm90.mega_combine). For tests and benchmarks.
  std::string last_call_kernels() const;

  const LayerConfig& config() const;
  const std::string& backend() const;
  Device device() const;
  const MoeWeights& weights() const;

 private:
  std::unique_ptr<detail::LayerBackend> impl_;
};

// Backends usable in this process, best first ("cpu" is always last).
std::vector<std::string> available_backends();

}  // namespace megamoe
