// ep_group.hpp: the inside of an EpGroup (megamoe/ep.hpp): one rank's view of the symmetric
// windows, the host side of the error protocol, and the transports that make the windows.
//
//   virtual  R ranks in one process on one GPU: one allocation, rank r's window at r * bytes
//   nccl     one rank per process: ncclMemAlloc + ncclCommWindowRegister, peers' windows through
//            LSA pointers read once by a kernel (src/ep/ep_nccl.cu)
//
// Both hand the kernels the same EpParams (kernels/ep/ep_protocol.hpp), so the protocol code is
// one. The error record lives in the window's EpLocal; a mapped host word per rank says that one
// is pending without synchronizing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ep/ep_protocol.hpp"
#include "megamoe/config.hpp"
#include "megamoe/ep.hpp"

namespace megamoe::detail {

class EpGroupImpl {
 public:
  virtual ~EpGroupImpl();

  int rank = 0, size = 1, device = 0;
  std::string transport;
  EpOptions options;
  LayerConfig config;          // the configuration the window was sized for
  ep::WindowLayout layout;
  int64_t max_recv_rows = 0;
  uint8_t* peers[ep::kMaxRanks] = {};
  bool broken = false;         // host copy of EpLocal::broken, set when a timeout is reported

  // The parameter block of one call of this rank with T = num_tokens (called_tokens: T as the
  // caller passed it; it differs when the call exceeded the capacity).
  ep::EpParams params(int64_t num_tokens, int64_t called_tokens, int64_t num_experts) const;
  // Whether a kernel has recorded an error that no check has reported yet (no wait).
  bool error_pending() const;
  // Synchronizes `stream`; throws the recorded error (kTimeout or kOutOfRange) and clears it.
  void check_errors(void* stream);
  // Checks that a layer of `layer_config` fits this group's window (kInvalidArgument naming the
  // field otherwise).
  void check_layer(const LayerConfig& layer_config) const;

 protected:
  // Sizes the window for `config` and makes the mapped error word; the transport then allocates
  // and fills `peers`, zeroes its own window and makes sure every rank has done so.
  void init(int rank, int size, const LayerConfig& config, const EpOptions& options,
            std::string transport);
  volatile int32_t* flag_host_ = nullptr;
  int32_t* flag_dev_ = nullptr;
};

// Bytes of one rank's window and the receive-row capacity for `config` on `size` ranks.
int64_t ep_window_bytes(int size, const LayerConfig& config);
int64_t ep_max_recv_rows(int size, const LayerConfig& config, const EpOptions& options);

#if defined(MEGAMOE_WITH_CUDA)
// src/ep/ep_nccl.cu
std::unique_ptr<EpGroupImpl> make_nccl_group(const NcclUniqueId* id, void* comm, int size,
                                              int rank, const LayerConfig& config,
                                              const EpOptions& options);
NcclUniqueId make_nccl_unique_id();
int loaded_nccl_version();
#endif

}  // namespace megamoe::detail
