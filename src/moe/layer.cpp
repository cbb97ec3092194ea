// MoeLayer: picks a backend, checks every call's tensors, and forwards raw pointers.
#include "megamoe/layer.hpp"

#include "megamoe/error.hpp"
#include "moe/backend.hpp"
#include "runtime/cuda_device.hpp"

// NOTES: the sm90 backend is compiled from src/moe/sm90_layer.cu, which CMake globs into the
// library whenever CUDA is enabled. Testing for that file (rather than registering backends
// through static objects) keeps the dependency explicit and link-safe: a static-registration
// object in a static library is dropped by the linker unless the library is linked whole, while
// an explicit call here always pulls the object in. The check also lets CUDA builds link while
// sm90_layer.cu is being written. (A build configured before the file appeared must recompile
// this file once: touch it or reconfigure.)
#if defined(MEGAMOE_WITH_CUDA) && __has_include("sm90_layer.cu")
#define MEGAMOE_HAS_SM90_BACKEND 1
#else
#define MEGAMOE_HAS_SM90_BACKEND 0
#endif

namespace megamoe {

namespace {

constexpr const char* kBackendAuto = "auto";
constexpr const char* kBackendCpu = "cpu";
constexpr const char* kBackendSm90 = "sm90";

// Why the sm90 backend cannot run in this process, or "" when it can.
std::string sm90_unavailable_reason() {
#if MEGAMOE_HAS_SM90_BACKEND
  if (!cuda_available()) return "no usable CUDA device (driver or device missing)";
  if (!sm90_available(cuda::current_device())) {
    const auto& info = cuda::device_info(-1);
    return "the current CUDA device " + info.name + " has compute capability " +
           std::to_string(info.cc_major) + "." + std::to_string(info.cc_minor) +
           ", the sm90 kernels need 9.0";
  }
  return "";
#elif defined(MEGAMOE_WITH_CUDA)
  return "this build has no sm90 layer (src/moe/sm90_layer.cu was absent when it was compiled)";
#else
  return "megamoe was built without CUDA (nvcc was not found or MEGAMOE_ENABLE_CUDA=OFF)";
#endif
}

std::unique_ptr<detail::LayerBackend> make_backend(std::string_view name, const LayerConfig& config,
                                                   MoeWeights&& weights,
                                                   std::shared_ptr<EpGroup> group = nullptr) {
  if (name == kBackendCpu) {
    MEGAMOE_CHECK(group == nullptr, ErrorCode::kUnsupported, "MoeLayer: the cpu backend has no "
                  "expert-parallel communication; an EP group needs the sm90 backend");
    return detail::make_cpu_backend(config, std::move(weights));
  }
  if (name == kBackendSm90) {
    const std::string reason = sm90_unavailable_reason();
    MEGAMOE_CHECK(reason.empty(), ErrorCode::kUnsupported, "backend sm90 cannot run here: ", reason);
#if MEGAMOE_HAS_SM90_BACKEND
    return detail::make_sm90_backend(config, std::move(weights), std::move(group));
#endif
  }
  fail(ErrorCode::kInvalidArgument, "MoeLayer: unknown backend '", name, "' (expected ",
       kBackendAuto, ", ", kBackendSm90, " or ", kBackendCpu, ")");
}

}  // namespace

std::vector<std::string> available_backends() {
  std::vector<std::string> names;
  if (sm90_unavailable_reason().empty()) names.emplace_back(kBackendSm90);
  names.emplace_back(kBackendCpu);
  return names;
}

MoeLayer::MoeLayer(const LayerConfig& config, MoeWeights weights, std::string_view backend) {
  config.validate();
  weights.check_matches(config);
  const std::string chosen = backend == kBackendAuto ? available_backends().front()
                                                     : std::string(backend);
  impl_ = make_backend(chosen, config, std::move(weights));
}

MoeLayer::MoeLayer(const LayerConfig& config, MoeWeights weights, std::shared_ptr<EpGroup> group,
                   std::string_view backend) {
  MEGAMOE_CHECK_ARG(group != nullptr, "MoeLayer: the EP group is null");
  config.validate();
  weights.check_matches(config);
  const std::string chosen = backend == kBackendAuto ? available_backends().front()
                                                     : std::string(backend);
  impl_ = make_backend(chosen, config, std::move(weights), std::move(group));
}

MoeLayer::~MoeLayer() = default;
MoeLayer::MoeLayer(MoeLayer&&) noexcept = default;
MoeLayer& MoeLayer::operator=(MoeLayer&&) noexcept = default;

void MoeLayer::forward(const TensorView& x, const TensorView& topk_idx,
                       const TensorView& topk_weights, const TensorView& y, void* stream) {
  MEGAMOE_CHECK_ARG(impl_ != nullptr, "MoeLayer::forward: this layer was moved from");
  const LayerConfig& cfg = impl_->config();
  const Device dev = impl_->device();
  const int64_t h = cfg.shape.hidden, k = cfg.shape.top_k;
  check_tensor("x", x, DType::kBF16, {-1, h}, dev);
  const int64_t num_tokens = x.shape[0];
  check_tensor("topk_idx", topk_idx, DType::kI32, {num_tokens, k}, dev);
  check_tensor("topk_weights", topk_weights, DType::kF32, {num_tokens, k}, dev);
  check_tensor("y", y, DType::kBF16, {num_tokens, h}, dev);
  // An EP layer takes part in the call above the capacity too (the other ranks wait for it),
  // then throws the same error.
  MEGAMOE_CHECK(num_tokens <= cfg.max_tokens_per_rank || impl_->ep_group() != nullptr,
                ErrorCode::kOutOfRange,
                "MoeLayer::forward: num_tokens ", num_tokens,
                " exceeds the layer capacity max_tokens_per_rank = ", cfg.max_tokens_per_rank);
  impl_->forward(x.ptr<const uint16_t>(), topk_idx.ptr<const int32_t>(),
                 topk_weights.ptr<const float>(), num_tokens, y.ptr<uint16_t>(), stream);
}

void MoeLayer::check_errors(void* stream) {
  MEGAMOE_CHECK_ARG(impl_ != nullptr, "MoeLayer::check_errors: this layer was moved from");
  impl_->check_errors(stream);
}

std::vector<int64_t> MoeLayer::expert_rows(void* stream) {
  MEGAMOE_CHECK_ARG(impl_ != nullptr, "MoeLayer::expert_rows: this layer was moved from");
  return impl_->expert_rows(stream);
}

std::string MoeLayer::last_call_kernels() const {
  MEGAMOE_CHECK_ARG(impl_ != nullptr, "MoeLayer: this layer was moved from");
  return impl_->last_call_kernels();
}

std::shared_ptr<EpGroup> MoeLayer::ep_group() const {
  MEGAMOE_CHECK_ARG(impl_ != nullptr, "MoeLayer: this layer was moved from");
  return impl_->ep_group();
}

const LayerConfig& MoeLayer::config() const {
  MEGAMOE_CHECK_ARG(impl_ != nullptr, "MoeLayer: this layer was moved from");
  return impl_->config();
}
const std::string& MoeLayer::backend() const {
  MEGAMOE_CHECK_ARG(impl_ != nullptr, "MoeLayer: this layer was moved from");
  return impl_->name();
}
Device MoeLayer::device() const {
  MEGAMOE_CHECK_ARG(impl_ != nullptr, "MoeLayer: this layer was moved from");
  return impl_->device();
}
const MoeWeights& MoeLayer::weights() const {
  MEGAMOE_CHECK_ARG(impl_ != nullptr, "MoeLayer: this layer was moved from");
  return impl_->weights();
}

}  // namespace megamoe
