// megamoe/ep.hpp: expert parallelism with communication: an EP group of R ranks, each owning
// E/R experts, over which one MoE layer call sends every token to the ranks that own its top-k
// experts and sums the results back on the token's own rank (docs/design.md, "Expert
// parallelism").
//
//   // one process per GPU (NCCL; rank 0 makes the id and hands it to the others):
//   NcclUniqueId id = nccl_unique_id();                           // rank 0, then broadcast
//   auto group = EpGroup::create_nccl(id, R, r, config);          // collective
//   MoeLayer layer(config, std::move(rank_weights), group);       // config.ep_size = R, ep_rank = r
//   layer.forward(x, topk_idx, topk_weights, y, stream);          // every rank calls, T may be 0
//   layer.check_errors(stream);                                   // device-side errors, if any
//
//   // R ranks in one process on the current GPU (tests, `megamoe run --ep-size R`):
//   auto ranks = EpGroup::create_virtual(R, config);              // ranks[r]: rank r's handle
//
// A group owns one symmetric window sized for a layer configuration (shape, capacity,
// max_recv_rows): every layer built on the group must fit it, and layers sharing a group run
// their calls in one stream order per rank (they share the window and its call counter). Every
// rank must call every layer the same number of times, in the same order.
//
// Errors found on the device are reported by MoeLayer::check_errors (and at the next forward):
//   a rank called with T > max_tokens_per_rank   kOutOfRange on that rank at once, on every other
//                                                 rank naming it (its tokens count as T = 0)
//   a rank received more rows than max_recv_rows  kOutOfRange on every rank, naming it
//   a peer did not arrive within the timeout      kTimeout naming this rank, the stage, the peer
//                                                 and the call number waited for; the group is
//                                                 unusable afterwards (every later call throws)
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/config.hpp"

namespace megamoe {

namespace detail {
class EpGroupImpl;
}

// The opaque 128-byte id a set of NCCL ranks meet at (ncclUniqueId), made by one rank and handed
// to the others by the caller (a file, torch.distributed, MPI...).
using NcclUniqueId = std::array<uint8_t, 128>;

struct EpOptions {
  // Every wait on another rank gives up after this long and reports kTimeout (naming the rank,
  // stage and call number) instead of hanging. (The MegaMoE kernel's wait for one received row,
  // LayerConfig::sm90.mega_dispatch, gives up after at most 2 s: the row follows its source's
  // slot ids at once.)
  double timeout_s = 10.0;
  // Rows (token, expert slot) one rank may receive per call; 0 = the worst case
  // R * max_tokens_per_rank * min(top_k, E/R), which never overflows. A smaller value saves
  // workspace memory; a call that exceeds it fails on every rank (nothing is dropped silently).
  int64_t max_recv_rows = 0;
};

class EpGroup {
 public:
  // R ranks in this process on the current CUDA device: the same kernels and protocol as the
  // NCCL path, the windows slices of one allocation. Element r is rank r's handle. Run each rank's
  // calls on its own stream; all ranks' calls of one layer call must be in flight together.
  static std::vector<std::shared_ptr<EpGroup>> create_virtual(int size, const LayerConfig& config,
                                                              const EpOptions& options = {});

  // One rank of an NCCL group (one process per GPU, the current device), collective over the R
  // ranks: makes the communicator from `id`, allocates and registers the symmetric window
  // (ncclMemAlloc + ncclCommWindowRegister) and creates the device communicator. All ranks must
  // be load/store reachable (one NVLink domain). Throws kUnsupported in a build without NCCL.
  static std::shared_ptr<EpGroup> create_nccl(const NcclUniqueId& id, int size, int rank,
                                              const LayerConfig& config,
                                              const EpOptions& options = {});
  // The same on a communicator the caller already has (an ncclComm_t, borrowed: it must outlive
  // the group). Rank and size are the communicator's.
  static std::shared_ptr<EpGroup> create_nccl_from_comm(void* nccl_comm, const LayerConfig& config,
                                                        const EpOptions& options = {});

  ~EpGroup();
  EpGroup(const EpGroup&) = delete;
  EpGroup& operator=(const EpGroup&) = delete;

  int rank() const;
  int size() const;
  const std::string& transport() const;  // "virtual" or "nccl"
  const EpOptions& options() const;
  int device() const;
  // Bytes of this rank's symmetric window, and the receive-row capacity of a layer on it.
  int64_t window_bytes() const;
  int64_t max_recv_rows() const;
  // Whether a timeout has made the group unusable.
  bool broken() const;

  detail::EpGroupImpl& impl() { return *impl_; }

  explicit EpGroup(std::unique_ptr<detail::EpGroupImpl> impl);

 private:
  std::unique_ptr<detail::EpGroupImpl> impl_;
};

// A fresh NCCL unique id (ncclGetUniqueId). Throws kUnsupported in a build without NCCL.
NcclUniqueId nccl_unique_id();
// Whether this build can make NCCL groups, and the loaded libnccl's version (0 when none loads).
bool nccl_available();
int nccl_version();

}  // namespace megamoe
