// ep_nccl.cu: the NCCL transport of EpGroup (src/ep/ep_group.hpp): one rank per process.
//
//   communicator    ncclCommInitRank from the caller's unique id (or the caller's communicator)
//   window          ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC), one per group
//   device comm     ncclDevCommCreate with one LSA barrier and no multimem (NVLink SHARP unused)
//   peers           a one-CTA kernel reads ncclGetLsaPointer(window, 0, p) for every rank once;
//                   the protocol kernels then load and store through those addresses
//   start / end     every rank zeroes its window, then an LSA barrier (so no peer writes into a
//                   window that is not ready); the same barrier before the window is released
//
// libnccl is loaded at run time (dlopen "libnccl.so.2"), so megamoe's binaries run without it
// and only an NCCL group needs it. The device API must come from the library version of the
// headers megamoe was compiled with (NCCL_VERSION_CODE); another one is refused by name
// (docs/design.md: the GPU machine's system libnccl and headers differ from torch's).
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "ep/ep_group.hpp"
#include "megamoe/error.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"

#if __has_include(<nccl.h>) && __has_include(<nccl_device.h>)
#define MEGAMOE_HAS_NCCL_HEADERS 1
#include <nccl.h>
#include <nccl_device.h>
#else
#define MEGAMOE_HAS_NCCL_HEADERS 0
#endif

namespace megamoe::detail {

#if MEGAMOE_HAS_NCCL_HEADERS
namespace {

// The host functions megamoe calls, resolved from the loaded library.
struct NcclApi {
  void* handle = nullptr;
  int version = 0;
  std::string error;  // why it could not be loaded
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommCount) comm_count = nullptr;
  decltype(&ncclCommUserRank) comm_user_rank = nullptr;
  decltype(&ncclMemAlloc) mem_alloc = nullptr;
  decltype(&ncclMemFree) mem_free = nullptr;
  decltype(&ncclCommWindowRegister) window_register = nullptr;
  decltype(&ncclCommWindowDeregister) window_deregister = nullptr;
  decltype(&ncclDevCommCreate) dev_comm_create = nullptr;
  decltype(&ncclDevCommDestroy) dev_comm_destroy = nullptr;
};

template <class F>
void resolve(NcclApi& api, F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(api.handle, name));
  if (fn == nullptr && api.error.empty()) api.error = std::string("libnccl has no ") + name;
}

const NcclApi& nccl() {
  static NcclApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    api.handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (api.handle == nullptr) {
      const char* why = dlerror();
      api.error = std::string("cannot load libnccl.so.2: ") + (why ? why : "unknown error");
      return;
    }
    resolve(api, api.get_version, "ncclGetVersion");
    resolve(api, api.error_string, "ncclGetErrorString");
    resolve(api, api.get_unique_id, "ncclGetUniqueId");
    resolve(api, api.comm_init_rank, "ncclCommInitRank");
    resolve(api, api.comm_destroy, "ncclCommDestroy");
    resolve(api, api.comm_count, "ncclCommCount");
    resolve(api, api.comm_user_rank, "ncclCommUserRank");
    resolve(api, api.mem_alloc, "ncclMemAlloc");
    resolve(api, api.mem_free, "ncclMemFree");
    resolve(api, api.window_register, "ncclCommWindowRegister");
    resolve(api, api.window_deregister, "ncclCommWindowDeregister");
    resolve(api, api.dev_comm_create, "ncclDevCommCreate");
    resolve(api, api.dev_comm_destroy, "ncclDevCommDestroy");
    if (!api.error.empty()) return;
    int v = 0;
    if (api.get_version(&v) != ncclSuccess) {
      api.error = "ncclGetVersion failed";
      return;
    }
    // The device API's structures (ncclDevCommRequirements, ncclDevComm) carry no version, and
    // they changed between patch releases: a library of another version than the headers
    // refuses the device communicator ("invalid usage") or worse.
    if (v != NCCL_VERSION_CODE) {
      api.error = "the loaded libnccl is version " + std::to_string(v) +
                  ", megamoe was compiled against the headers of " +
                  std::to_string(NCCL_VERSION_CODE) +
                  " and NCCL's device API needs the same version: put the matching "
                  "libnccl.so.2 first on LD_LIBRARY_PATH (e.g. the nvidia-nccl wheel's lib) or "
                  "build megamoe with its headers (-DMEGAMOE_NCCL_INCLUDE_DIR)";
      return;
    }
    api.version = v;
  });
  return api;
}

const NcclApi& require_nccl(const char* what) {
  const NcclApi& api = nccl();
  MEGAMOE_CHECK(api.version > 0, ErrorCode::kUnsupported, what, ": ", api.error);
  return api;
}

#define MEGAMOE_NCCL_CHECK(api, expr)                                                   \
  do {                                                                                  \
    const ncclResult_t megamoe_nccl_res_ = (expr);                                      \
    if (megamoe_nccl_res_ != ncclSuccess)                                               \
      ::megamoe::fail(::megamoe::ErrorCode::kCuda, "NCCL call failed: ", #expr, ": ",   \
                      (api).error_string(megamoe_nccl_res_), " (", __FILE__, ":", __LINE__, ")"); \
  } while (0)

// Reads every rank's window address (LSA pointers) into out[], then waits on the LSA barrier so
// every rank has zeroed its window before any peer uses it.
__global__ void nccl_window_setup_kernel(ncclDevComm comm, ncclWindow_t window, int size,
                                         uint8_t** out) {
  if (threadIdx.x < size)
    out[threadIdx.x] = static_cast<uint8_t*>(ncclGetLsaPointer(window, 0, threadIdx.x));
  ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), comm, ncclTeamTagLsa(), 0);
  bar.sync(ncclCoopCta(), ::cuda::memory_order_seq_cst);
}

__global__ void nccl_barrier_kernel(ncclDevComm comm) {
  ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), comm, ncclTeamTagLsa(), 0);
  bar.sync(ncclCoopCta(), ::cuda::memory_order_seq_cst);
}

class NcclGroup final : public EpGroupImpl {
 public:
  NcclGroup(const NcclUniqueId* id, void* borrowed, int size_, int rank_, const LayerConfig& c,
            const EpOptions& o)
      : api_(require_nccl("EpGroup::create_nccl")) {
    // No NVLink multicast (NVLS): megamoe never asks for it, and the communicator should not set
    // it up either unless the caller chose otherwise.
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    if (borrowed != nullptr) {
      comm_ = static_cast<ncclComm_t>(borrowed);
      MEGAMOE_NCCL_CHECK(api_, api_.comm_count(comm_, &size_));
      MEGAMOE_NCCL_CHECK(api_, api_.comm_user_rank(comm_, &rank_));
    } else {
      ncclUniqueId uid;
      static_assert(sizeof(uid) == sizeof(NcclUniqueId), "ncclUniqueId is 128 bytes");
      std::memcpy(&uid, id->data(), sizeof uid);
      MEGAMOE_NCCL_CHECK(api_, api_.comm_init_rank(&comm_, size_, uid, rank_));
      owns_comm_ = true;
    }
    init(rank_, size_, c, o, "nccl");
    const size_t bytes = static_cast<size_t>(layout.bytes);
    MEGAMOE_NCCL_CHECK(api_, api_.mem_alloc(&window_mem_, bytes));
    MEGAMOE_NCCL_CHECK(api_, api_.window_register(comm_, window_mem_, bytes, &window_,
                                                  NCCL_WIN_COLL_SYMMETRIC));
    ncclDevCommRequirements reqs{};
    reqs.lsaBarrierCount = 1;
    reqs.lsaMultimem = false;
    MEGAMOE_NCCL_CHECK(api_, api_.dev_comm_create(comm_, &reqs, &dev_comm_));
    has_dev_comm_ = true;
    MEGAMOE_CHECK(dev_comm_.lsaSize == size, ErrorCode::kUnsupported, "EpGroup::create_nccl: ",
                  size, " ranks, of which only ", dev_comm_.lsaSize,
                  " are load/store reachable from rank ", rank,
                  ": megamoe's EP needs one NVLink domain (docs/design.md: multi-node)");
    MEGAMOE_CUDA_CHECK(cudaMemset(window_mem_, 0, bytes));
    uint8_t** out = nullptr;
    MEGAMOE_CUDA_CHECK(cudaMalloc(&out, sizeof(uint8_t*) * size));
    nccl_window_setup_kernel<<<1, ep::kMaxRanks>>>(dev_comm_, window_, size, out);
    MEGAMOE_CUDA_CHECK_LAUNCH();
    const cudaError_t sync = cudaDeviceSynchronize();
    if (sync == cudaSuccess)
      MEGAMOE_CUDA_CHECK(cudaMemcpy(peers, out, sizeof(uint8_t*) * size, cudaMemcpyDeviceToHost));
    cudaFree(out);
    MEGAMOE_CUDA_CHECK(sync);
  }

  ~NcclGroup() override {
    // Nobody may still write into this window: every rank passes the barrier first.
    if (has_dev_comm_) {
      nccl_barrier_kernel<<<1, ep::kMaxRanks>>>(dev_comm_);
      cudaDeviceSynchronize();
      api_.dev_comm_destroy(comm_, &dev_comm_);
    }
    if (window_ != nullptr) api_.window_deregister(comm_, window_);
    if (window_mem_ != nullptr) api_.mem_free(window_mem_);
    if (owns_comm_ && comm_ != nullptr) api_.comm_destroy(comm_);
  }

 private:
  const NcclApi& api_;
  ncclComm_t comm_ = nullptr;
  bool owns_comm_ = false;
  void* window_mem_ = nullptr;
  ncclWindow_t window_ = nullptr;
  ncclDevComm dev_comm_{};
  bool has_dev_comm_ = false;
};

}  // namespace

std::unique_ptr<EpGroupImpl> make_nccl_group(const NcclUniqueId* id, void* comm, int size,
                                              int rank, const LayerConfig& config,
                                              const EpOptions& options) {
  return std::make_unique<NcclGroup>(id, comm, size, rank, config, options);
}

NcclUniqueId make_nccl_unique_id() {
  const NcclApi& api = require_nccl("nccl_unique_id");
  ncclUniqueId uid;
  MEGAMOE_NCCL_CHECK(api, api.get_unique_id(&uid));
  NcclUniqueId out;
  std::memcpy(out.data(), &uid, sizeof uid);
  return out;
}

int loaded_nccl_version() { return nccl().version; }

#else  // no NCCL headers in this toolkit

std::unique_ptr<EpGroupImpl> make_nccl_group(const NcclUniqueId*, void*, int, int,
                                              const LayerConfig&, const EpOptions&) {
  fail(ErrorCode::kUnsupported, "EpGroup::create_nccl: megamoe was built without NCCL headers");
}
NcclUniqueId make_nccl_unique_id() {
  fail(ErrorCode::kUnsupported, "nccl_unique_id: megamoe was built without NCCL headers");
}
int loaded_nccl_version() { return 0; }

#endif

}  // namespace megamoe::detail
