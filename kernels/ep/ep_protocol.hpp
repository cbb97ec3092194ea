// ep_protocol.hpp: the expert-parallel window layout and the device-side protocol ABI, shared by
// host sizing (src/ep/) and the kernels (kernels/ep/ep_kernels.cuh). docs/design.md, "Expert
// parallelism", describes the protocol.
//
// Every rank has one window of the same size and layout (symmetric memory); `peers[p]` is the
// address of rank p's window as this rank reaches it (an NCCL LSA pointer, or a slice of one
// allocation with virtual ranks). Offsets, in bytes from the window base:
//
//   local        EpLocal              this rank's own state: call counter, CTA tickets, status
//   dispatch_sig uint64 [R]           [s]: written by source rank s when its slot ids (recv_idx,
//                                     recv_w) are in place; its rows may still be arriving
//   rows_sig     uint64 [R]           [s]: written by source rank s when its rows are in place
//   return_sig   uint64 [R]           [d]: written by owner rank d when its results are in place
//   recv_flag    uint64 [R][T_max]    [s][t]: the call number, written by s once its token t's row
//                                     and scales are in place here (rows sent to this rank only;
//                                     with EpParams::row_flags)
//   recv_idx     int32  [R][T_max][K] [s][t][k]: source s's token t's expert ids (-1: empty or
//                                     invalid), written by s for every token and every rank
//   recv_w       fp32   [R][T_max][K] the matching top-k weights
//   recv_sf      uint8  [R][T_max][H/32] UE8M0 scales of the token rows below
//   recv_xq      uint8  [R][T_max][H] E4M3 rows: source s's token t, sent once per destination
//                                     rank that owns one of its experts
//   combine      bf16   [T_max*K][H]  [t*K + k]: the expert output o_{t,k} of this rank's token t,
//                                     written by the rank that owns expert topk_idx[t, k]
//
// A signal word is (call << 32) | payload: `call` counts this window's layer calls from 1, so a
// word from an earlier call never passes for the current one. Payload of dispatch_sig: the
// source's T; with kEpPayloadError set, the source was called above its capacity (low bits: its
// T). Payload of rows_sig: the source's T. Payload of return_sig: rows the owner received; with kEpPayloadError set, more than its
// max_recv_rows (nothing was computed).
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"  // MEGAMOE_HD

namespace megamoe::ep {

constexpr int kMaxRanks = 64;  // one NVLink domain (NVL72 has 72 GPUs: one bit word per mask)
constexpr int64_t kWindowAlign = 4096;  // NCCL_WIN_REQUIRED_ALIGNMENT, also for every region
constexpr uint32_t kPayloadError = 0x80000000u;
constexpr uint32_t kPayloadMask = 0x7FFFFFFFu;
// The longest wait for one received row inside the MegaMoE kernel (its gather units), whatever
// the group's timeout: below the kernels' trap deadline (ptx::kWaitTimeoutCycles, ~10 s), which
// the GEMM waits behind a late row would otherwise reach first. A row is sent right after its
// source's slot ids, so a row this late means a failed source.
constexpr uint64_t kMaxRowWaitNs = 2'000'000'000ull;

enum class Stage : int32_t { kNone = 0, kDispatch = 1, kCombine = 2 };

enum class StatusCode : int32_t {
  kOk = 0,
  kTimeout = 1,        // peer did not publish call `expected` within the timeout
  kPeerCapacity = 2,   // peer was called with T = value > max_tokens_per_rank
  kRecvOverflow = 3,   // peer (maybe this rank) received value rows > max_recv_rows
};

// The first error of a window since the host last cleared it (the host reads it after
// synchronizing; later errors only count).
struct EpStatus {
  int32_t code;         // StatusCode
  int32_t stage;        // Stage
  int32_t peer;
  int32_t count;        // errors recorded since the last clear
  uint64_t expected;    // kTimeout: the call number waited for
  uint64_t observed;    // kTimeout: the signal word seen last; else the payload value
};

struct EpLocal {
  uint64_t dispatched;      // layer calls whose dispatch ran here: a call's number is one more
                            // before its dispatch (the send) and this after it (the later kernels)
  uint32_t send_ticket;     // CTAs of the send kernel done (the last one publishes, resets)
  uint32_t rows_ticket;     // CTAs of the send kernel done with their rows (the same, rows_sig)
  uint32_t return_ticket;   // the same for the return kernel (or the MegaMoE kernel's combine)
  uint32_t recv_rows;       // rows received in the current call (payload of return_sig)
  uint32_t broken;          // 1 after a timeout: later waits do not spin
  EpStatus status;
};

struct WindowLayout {
  int32_t ranks = 0;
  int64_t t_max = 0, hidden = 0, top_k = 0;
  int64_t local = 0, dispatch_sig = 0, rows_sig = 0, return_sig = 0, recv_flag = 0, recv_idx = 0,
          recv_w = 0, recv_sf = 0, recv_xq = 0, combine = 0, bytes = 0;

  // Region offsets for R ranks, capacity t_max tokens per rank, hidden H, top-k K.
  static WindowLayout make(int32_t ranks, int64_t t_max, int64_t hidden, int64_t top_k) {
    WindowLayout l;
    l.ranks = ranks;
    l.t_max = t_max;
    l.hidden = hidden;
    l.top_k = top_k;
    int64_t at = 0;
    auto take = [&at](int64_t bytes) {
      const int64_t o = at;
      at = (at + bytes + kWindowAlign - 1) / kWindowAlign * kWindowAlign;
      return o;
    };
    const int64_t tokens = static_cast<int64_t>(ranks) * t_max;
    l.local = take(sizeof(EpLocal));
    l.dispatch_sig = take(ranks * 8);
    l.rows_sig = take(ranks * 8);
    l.return_sig = take(ranks * 8);
    l.recv_flag = take(tokens * 8);
    l.recv_idx = take(tokens * top_k * 4);
    l.recv_w = take(tokens * top_k * 4);
    l.recv_sf = take(tokens * (hidden / 32));
    l.recv_xq = take(tokens * hidden);
    l.combine = take(t_max * top_k * hidden * 2);
    l.bytes = at;
    return l;
  }
};

// Where a computed row goes back: its place among the received slots, (s * t_max + t) * K + k
// (the EP dispatch's row_slot), names combine slot t * K + k of source rank s. ep_return's copy
// and the MegaMoE kernel's L2 epilogue use it (int32 places: 32-bit arithmetic).
struct ReturnSlot {
  uint32_t rank;
  uint32_t slot;
};
MEGAMOE_HD ReturnSlot return_slot(uint32_t place, uint32_t top_k, uint32_t t_max) {
  const uint32_t token = place / top_k;  // s * t_max + t
  const uint32_t s = token / t_max;
  return {s, (token - s * t_max) * top_k + place % top_k};
}

// What the wait for one received row needs (ep_device.cuh's wait_row; the MegaMoE kernel's gather
// units under expert parallelism).
struct RowArrival {
  const uint64_t* flags = nullptr;  // this rank's recv_flag [R][T_max]
  EpLocal* local = nullptr;         // this rank's state: the call number, the error record
  int32_t* error_flag = nullptr;    // mapped host word (may be null)
  uint64_t timeout_ns = 0;
  int32_t t_max = 0;
};

// The parameter block of every EP kernel (passed by value).
struct EpParams {
  uint8_t* peers[kMaxRanks];  // window base of every rank; peers[rank] is this rank's own
  WindowLayout layout;
  int32_t rank = 0, size = 1;
  int32_t num_tokens = 0;     // T of this rank's call (0 when it was called above capacity)
  int32_t called_tokens = 0;  // T as called (> layout.t_max: reported to the peers as an error)
  int32_t num_experts = 0;    // E
  int32_t num_local = 0;      // E_l = E / R
  int64_t max_rows = 0;       // receive-row capacity of the layer
  uint64_t timeout_ns = 0;
  // 1 when no other rank shares this GPU (NCCL, or a single rank): the waiting kernels then let
  // their successors launch at once (PDL), so the GEMMs start streaming weights during the waits.
  // With several ranks on one GPU the successors launch only after the waits (the ranks waited
  // for must find room to run).
  int32_t early_launch = 0;
  // 1: the send writes an arrival word (recv_flag) after each row, for receivers that gather
  // inside the MegaMoE kernel (LayerConfig::sm90.mega_dispatch; every rank of a group must
  // agree: a receiver waiting for words that never come times out, loudly).
  int32_t row_flags = 0;
  int32_t* error_flag = nullptr;  // mapped host word: set to 1 when an error is recorded
};

}  // namespace megamoe::ep
