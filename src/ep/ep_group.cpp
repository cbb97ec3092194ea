// ep_group.cpp: EpGroup (megamoe/ep.hpp), the host side of the EP error protocol, and the
// virtual transport (R ranks on one GPU). The NCCL transport is in ep_nccl.cu.
#include "ep/ep_group.hpp"

#include <algorithm>
#include <cmath>

#include "megamoe/error.hpp"
#include "runtime/cuda_device.hpp"

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>

#include "runtime/cuda_check.hpp"
#endif

namespace megamoe {
namespace detail {

namespace {

void check_group_args(int size, const LayerConfig& config, const EpOptions& options) {
  config.shape.validate();
  MEGAMOE_CHECK_ARG(size >= 1 && size <= ep::kMaxRanks, "EpGroup: expected 1 <= size <= ",
                    ep::kMaxRanks, ", got ", size);
  MEGAMOE_CHECK_ARG(config.shape.num_experts % size == 0, "EpGroup: size ", size,
                    " must divide the number of experts ", config.shape.num_experts);
  MEGAMOE_CHECK_ARG(config.max_tokens_per_rank >= 1, "EpGroup: expected max_tokens_per_rank >= 1, got ",
                    config.max_tokens_per_rank);
  MEGAMOE_CHECK_ARG(std::isfinite(options.timeout_s) && options.timeout_s > 0 &&
                        options.timeout_s <= 3600,
                    "EpOptions.timeout_s: expected a value in (0, 3600] seconds, got ",
                    options.timeout_s);
  MEGAMOE_CHECK_ARG(options.max_recv_rows >= 0, "EpOptions.max_recv_rows: expected >= 0 (0 = the "
                    "worst case), got ", options.max_recv_rows);
  const int64_t tokens = int64_t{size} * config.max_tokens_per_rank;
  MEGAMOE_CHECK_ARG(tokens * config.shape.top_k <= INT32_MAX, "EpGroup: size * max_tokens_per_rank "
                    "* top_k = ", tokens * config.shape.top_k, " exceeds the int32 slot range");
}

}  // namespace

int64_t ep_window_bytes(int size, const LayerConfig& config) {
  return ep::WindowLayout::make(size, config.max_tokens_per_rank, config.shape.hidden,
                                config.shape.top_k)
      .bytes;
}

int64_t ep_max_recv_rows(int size, const LayerConfig& config, const EpOptions& options) {
  const int64_t local = config.shape.num_experts / size;
  const int64_t worst =
      int64_t{size} * config.max_tokens_per_rank * std::min(config.shape.top_k, local);
  return options.max_recv_rows > 0 ? std::min(options.max_recv_rows, worst) : worst;
}

EpGroupImpl::~EpGroupImpl() {
#if defined(MEGAMOE_WITH_CUDA)
  if (flag_host_ != nullptr) cudaFreeHost(const_cast<int32_t*>(flag_host_));
#endif
}

void EpGroupImpl::init(int rank_, int size_, const LayerConfig& config_, const EpOptions& options_,
                       std::string transport_) {
  check_group_args(size_, config_, options_);
  MEGAMOE_CHECK_ARG(rank_ >= 0 && rank_ < size_, "EpGroup: expected 0 <= rank < ", size_, ", got ",
                    rank_);
  rank = rank_;
  size = size_;
  config = config_;
  config.ep_size = size_;
  config.ep_rank = rank_;
  options = options_;
  transport = std::move(transport_);
  layout = ep::WindowLayout::make(size, config.max_tokens_per_rank, config.shape.hidden,
                                  config.shape.top_k);
  max_recv_rows = ep_max_recv_rows(size, config, options);
#if defined(MEGAMOE_WITH_CUDA)
  device = cuda::current_device();
  void* flag = nullptr;
  MEGAMOE_CUDA_CHECK(cudaHostAlloc(&flag, sizeof(int32_t), cudaHostAllocMapped));
  flag_host_ = static_cast<volatile int32_t*>(flag);
  *flag_host_ = 0;
  void* flag_dev = nullptr;
  MEGAMOE_CUDA_CHECK(cudaHostGetDevicePointer(&flag_dev, flag, 0));
  flag_dev_ = static_cast<int32_t*>(flag_dev);
#endif
}

ep::EpParams EpGroupImpl::params(int64_t num_tokens, int64_t called_tokens,
                                 int64_t num_experts) const {
  ep::EpParams p;
  std::copy(std::begin(peers), std::end(peers), std::begin(p.peers));
  p.layout = layout;
  p.rank = rank;
  p.size = size;
  p.num_tokens = static_cast<int32_t>(num_tokens);
  p.called_tokens = static_cast<int32_t>(std::min<int64_t>(called_tokens, ep::kPayloadMask));
  p.num_experts = static_cast<int32_t>(num_experts);
  p.num_local = static_cast<int32_t>(num_experts / size);
  p.max_rows = max_recv_rows;
  p.timeout_ns = static_cast<uint64_t>(options.timeout_s * 1e9);
  p.error_flag = flag_dev_;
  p.early_launch = (transport == "nccl" || size == 1) ? 1 : 0;  // no other rank on this GPU
  return p;
}

bool EpGroupImpl::error_pending() const { return flag_host_ != nullptr && *flag_host_ != 0; }

void EpGroupImpl::check_layer(const LayerConfig& c) const {
  MEGAMOE_CHECK_ARG(c.ep_size == size && c.ep_rank == rank, "EpGroup: the layer's ep_size/ep_rank (",
                    c.ep_size, "/", c.ep_rank, ") must be the group's size/rank (", size, "/", rank,
                    ")");
  MEGAMOE_CHECK_ARG(c.shape.hidden == config.shape.hidden && c.shape.top_k == config.shape.top_k &&
                        c.shape.num_experts == config.shape.num_experts,
                    "EpGroup: the layer's shape (", c.shape.to_string(),
                    ") does not match the shape the group's window was made for (",
                    config.shape.to_string(), ")");
  MEGAMOE_CHECK_ARG(c.max_tokens_per_rank <= config.max_tokens_per_rank,
                    "EpGroup: the layer's max_tokens_per_rank ", c.max_tokens_per_rank,
                    " exceeds the group's window capacity ", config.max_tokens_per_rank);
}

void EpGroupImpl::check_errors(void* stream) {
#if defined(MEGAMOE_WITH_CUDA)
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  *flag_host_ = 0;
  ep::EpStatus st{};
  uint8_t* status = peers[rank] + layout.local + offsetof(ep::EpLocal, status);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(&st, status, sizeof st, cudaMemcpyDeviceToHost));
  if (st.code == 0) return;
  const ep::EpStatus clean{};
  MEGAMOE_CUDA_CHECK(cudaMemcpy(status, &clean, sizeof clean, cudaMemcpyHostToDevice));
  const char* stage = st.stage == static_cast<int32_t>(ep::Stage::kDispatch) ? "dispatch"
                                                                             : "combine";
  const std::string more =
      st.count > 1 ? " (" + std::to_string(st.count - 1) + " more error(s) in the same window)" : "";
  switch (static_cast<ep::StatusCode>(st.code)) {
    case ep::StatusCode::kTimeout:
      broken = true;
      fail(ErrorCode::kTimeout, "EP rank ", rank, " of ", size, ": timed out after ",
           options.timeout_s, " s in stage '", stage, "' waiting for rank ", st.peer,
           " to publish call #", st.expected, " (its last signal word holds call #",
           st.observed >> 32, "); the group is unusable, recreate it", more);
    case ep::StatusCode::kPeerCapacity:
      fail(ErrorCode::kOutOfRange, "EP rank ", rank, " of ", size, ": rank ", st.peer,
           " called the layer with T = ", st.observed, " tokens, above max_tokens_per_rank = ",
           config.max_tokens_per_rank, "; its tokens were not computed and this call's output "
           "is invalid on every rank", more);
    case ep::StatusCode::kRecvOverflow:
      fail(ErrorCode::kOutOfRange, "EP rank ", rank, " of ", size, ": rank ", st.peer,
           " received more rows than its max_recv_rows = ", max_recv_rows,
           st.peer == rank && st.observed > 0 ? " (" + std::to_string(st.observed) + " rows)" : "",
           "; it computed none and this call's output is invalid on every rank (raise "
           "EpOptions.max_recv_rows; 0 is the worst case)", more);
    default:
      fail(ErrorCode::kInternal, "EP rank ", rank, ": unknown status code ", st.code);
  }
#else
  (void)stream;
#endif
}

#if defined(MEGAMOE_WITH_CUDA)
namespace {

// R ranks on the current GPU: one allocation holds every rank's window. The allocation is shared
// by the R handles and freed with the last.
struct VirtualWindows {
  void* base = nullptr;
  ~VirtualWindows() {
    if (base != nullptr) cudaFree(base);
  }
};

class VirtualGroup final : public EpGroupImpl {
 public:
  VirtualGroup(int r, int n, const LayerConfig& c, const EpOptions& o,
               std::shared_ptr<VirtualWindows> windows)
      : windows_(std::move(windows)) {
    init(r, n, c, o, "virtual");
    for (int p = 0; p < n; ++p)
      peers[p] = static_cast<uint8_t*>(windows_->base) + static_cast<int64_t>(p) * layout.bytes;
  }

 private:
  std::shared_ptr<VirtualWindows> windows_;
};

}  // namespace
#endif

}  // namespace detail

EpGroup::EpGroup(std::unique_ptr<detail::EpGroupImpl> impl) : impl_(std::move(impl)) {}
EpGroup::~EpGroup() = default;

int EpGroup::rank() const { return impl_->rank; }
int EpGroup::size() const { return impl_->size; }
const std::string& EpGroup::transport() const { return impl_->transport; }
const EpOptions& EpGroup::options() const { return impl_->options; }
int EpGroup::device() const { return impl_->device; }
int64_t EpGroup::window_bytes() const { return impl_->layout.bytes; }
int64_t EpGroup::max_recv_rows() const { return impl_->max_recv_rows; }
bool EpGroup::broken() const { return impl_->broken; }

std::vector<std::shared_ptr<EpGroup>> EpGroup::create_virtual(int size, const LayerConfig& config,
                                                             const EpOptions& options) {
  detail::check_group_args(size, config, options);
#if defined(MEGAMOE_WITH_CUDA)
  MEGAMOE_CHECK(cuda_available(), ErrorCode::kUnsupported,
                "EpGroup::create_virtual: needs a CUDA device (the ranks share one GPU)");
  const int64_t bytes = detail::ep_window_bytes(size, config);
  auto windows = std::make_shared<detail::VirtualWindows>();
  const size_t total = static_cast<size_t>(bytes) * static_cast<size_t>(size);
  const cudaError_t err = cudaMalloc(&windows->base, total);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail(ErrorCode::kCuda, "EpGroup::create_virtual: cannot allocate ", size, " windows of ", bytes,
         " bytes: ", cudaGetErrorString(err), " (lower max_tokens_per_rank)");
  }
  MEGAMOE_CUDA_CHECK(cudaMemset(windows->base, 0, total));
  std::vector<std::shared_ptr<EpGroup>> ranks;
  for (int r = 0; r < size; ++r)
    ranks.push_back(std::make_shared<EpGroup>(
        std::make_unique<detail::VirtualGroup>(r, size, config, options, windows)));
  return ranks;
#else
  fail(ErrorCode::kUnsupported, "EpGroup::create_virtual: megamoe was built without CUDA");
#endif
}

std::shared_ptr<EpGroup> EpGroup::create_nccl(const NcclUniqueId& id, int size, int rank,
                                              const LayerConfig& config, const EpOptions& options) {
  detail::check_group_args(size, config, options);
#if defined(MEGAMOE_WITH_CUDA)
  return std::make_shared<EpGroup>(detail::make_nccl_group(&id, nullptr, size, rank, config, options));
#else
  fail(ErrorCode::kUnsupported, "EpGroup::create_nccl: megamoe was built without CUDA");
#endif
}

std::shared_ptr<EpGroup> EpGroup::create_nccl_from_comm(void* comm, const LayerConfig& config,
                                                        const EpOptions& options) {
  MEGAMOE_CHECK_ARG(comm != nullptr, "EpGroup::create_nccl_from_comm: the communicator is null");
#if defined(MEGAMOE_WITH_CUDA)
  return std::make_shared<EpGroup>(detail::make_nccl_group(nullptr, comm, 0, 0, config, options));
#else
  fail(ErrorCode::kUnsupported, "EpGroup::create_nccl_from_comm: megamoe was built without CUDA");
#endif
}

NcclUniqueId nccl_unique_id() {
#if defined(MEGAMOE_WITH_CUDA)
  return detail::make_nccl_unique_id();
#else
  fail(ErrorCode::kUnsupported, "nccl_unique_id: megamoe was built without CUDA");
#endif
}

int nccl_version() {
#if defined(MEGAMOE_WITH_CUDA)
  return detail::loaded_nccl_version();
#else
  return 0;
#endif
}

bool nccl_available() { return nccl_version() > 0; }

}  // namespace megamoe
