// ep_kernels.cuh: the expert-parallel stages of a layer call (docs/design.md, "Expert
// parallelism"); the window layout and parameter block are in ep/ep_protocol.hpp.
//
//   ep_send         every source token's slot ids to every rank, then dispatch_sig; its row to the
//                   ranks owning its experts (and, EpParams::row_flags, an arrival word per row),
//                   then rows_sig (small calls: ep_dispatch quantizes and sends, the layer's
//                   quantize launch and this one are not made)
//   ep_dispatch     waits for every rank's dispatch_sig (not for ep_send's end: it sorts while the
//                   rows travel), then the per-local-expert row lists of the received slots (the
//                   counting sort of sm90_dispatch.cuh), then (wait_rows) every rank's rows_sig
//   (gather, L1, L2 of the layer, reading the received rows; or the MegaMoE kernel gathering
//   each row once its arrival word is in)
//   ep_return       every computed row to its source rank's combine slot; publishes return_sig;
//                   its last CTA then waits for every rank's return_sig and this rank's rows_sig
//   (combine of the layer, over this rank's combine slots)
//
// Ordering: data is written with plain stores (to a peer: over NVLink), then each CTA fences at
// system scope and takes a ticket; the CTA that takes the last ticket fences again and publishes
// the signal words with release stores. A waiter reads a signal with acquire loads. Only one CTA
// of these kernels ever spins (ep_dispatch's, ep_return's last). With several ranks on one GPU it
// lets the successor launch (PDL) only after its wait for the other ranks' dispatch_sig (or
// return_sig), so a waiting rank never holds more than one CTA's resources while a rank it waits
// for may still have to start; the later wait for rows_sig may hold the successor's CTAs on the
// SMs, which is safe: every ep_send CTA took its first ticket before dispatch_sig was published,
// so every CTA that writes a row is already running. Alone on its GPU (EpParams::early_launch) it
// lets the successor launch at once.
#pragma once

#include <cstdint>

#include "ep/ep_device.cuh"
#include "ep/ep_protocol.hpp"
#include "ptx/sm90_ptx.cuh"
#include "sm90/sm90_dispatch_sort.cuh"
#include "sm90/sm90_quantize_chunk.cuh"

namespace megamoe::ep {

// The combine slot (bf16 [H]) in its source rank's window of the received row whose place in the
// received slots is `place` ((s * t_max + t) * K + k: the dispatch's row_slot).
__device__ __forceinline__ uint16_t* combine_row(const EpParams& p, int32_t place) {
  const WindowLayout& L = p.layout;
  const ReturnSlot to = return_slot(static_cast<uint32_t>(place), static_cast<uint32_t>(L.top_k),
                                    static_cast<uint32_t>(L.t_max));
  return region<uint16_t>(p.peers[to.rank], L.combine) + static_cast<int64_t>(to.slot) * L.hidden;
}

constexpr int kSendThreads = 256;
constexpr int kSendWarps = kSendThreads / 32;
// Calls with at most this many tokens are quantized and sent by ep_dispatch's CTAs, one per token
// (two launches less: the layer's quantize and ep_send).
constexpr int kFusedSendMaxTokens = 32;

// What the send reads (this call's input and the caller's top-k) and writes locally.
struct SendArgs {
  const uint16_t* x;              // bf16 [T, H]: the fused send quantizes it
  const uint8_t* x_q;             // ep_send: this call's quantized input
  const uint8_t* x_sf;
  const int32_t* topk_idx;
  const float* topk_weights;
  int32_t* slot_map;              // [T*K]: t*K + k for a valid slot, else -1 (the combine's map)
  sm90::DispatchParams errors;    // invalid ids are recorded as the one-GPU dispatch does
};

// n elements from src to dst by the 32 lanes of a warp, each lane issuing kBatch loads before
// its stores.
// NOTES: why: with a load and a store per element (the store may alias the next load) each lane
// waited one memory latency per element, which a small call's single row per warp pays in full
// (docs/tuning-log.md).
template <int kBatch, class T>
__device__ __forceinline__ void warp_copy(T* __restrict__ dst, const T* __restrict__ src, int64_t n,
                                          int lane) {
  for (int64_t base = lane; base < n; base += 32 * kBatch) {
    T v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t c = base + 32 * i;
      if (c < n) v[i] = __ldg(src + c);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t c = base + 32 * i;
      if (c < n) dst[c] = v[i];
    }
  }
}
// 16-byte elements in flight per lane: a 7168-byte row in one round.
constexpr int kCopyBatch = 16;

// Slot k of this rank's token t (both sends): its expert id (invalid ids recorded, as the one-GPU
// dispatch records them) and weight into every rank's recv_idx / recv_w (so no rank reads a stale
// id) and its entry of the combine's slot map. Returns the global id, or -1.
__device__ __forceinline__ int32_t send_slot(const EpParams& p, const SendArgs& a, int64_t t,
                                             int64_t k) {
  const WindowLayout& L = p.layout;
  const int64_t slot = t * L.top_k + k;
  // With errors.num_local = E, dispatch_local_expert returns the global id (or -1).
  const int32_t id = sm90::dispatch_local_expert<true>(a.errors, __ldg(a.topk_idx + slot), slot);
  const float w = __ldg(a.topk_weights + slot);
  a.slot_map[slot] = id >= 0 ? static_cast<int32_t>(slot) : -1;
  const int64_t at = (static_cast<int64_t>(p.rank) * L.t_max + t) * L.top_k + k;
  for (int d = 0; d < p.size; ++d) {
    region<int32_t>(p.peers[d], L.recv_idx)[at] = id;
    region<float>(p.peers[d], L.recv_w)[at] = w;
  }
  return id;
}

// The ranks owning an expert of this rank's token t (bit d: rank d), from its slots as send_slot
// wrote them: by the 32 lanes of a warp, every lane gets the mask.
__device__ inline uint64_t token_owners(const EpParams& p, const SendArgs& a, int64_t t,
                                        bool write_slots) {
  const int64_t K = p.layout.top_k;
  const int lane = threadIdx.x % 32;
  uint64_t mask = 0;
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const int64_t k = k0 + lane;
    if (k >= K) continue;
    int32_t id;
    if (write_slots) {
      id = send_slot(p, a, t, k);
    } else {  // the validity send_slot applied (it recorded the invalid ids)
      id = __ldg(a.topk_idx + t * K + k);
      if (id >= p.num_experts) id = -1;
    }
    if (id >= 0) mask |= 1ull << (id / p.num_local);
  }
  const uint32_t lo = __reduce_or_sync(0xFFFFFFFFu, static_cast<uint32_t>(mask));
  const uint32_t hi = __reduce_or_sync(0xFFFFFFFFu, static_cast<uint32_t>(mask >> 32));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Tokens warp, warp + num_warps, ... of this rank (ep_send: calls above kFusedSendMaxTokens), one
// warp each: the token's slots (send_slot) into every rank's recv_idx / recv_w.
__device__ inline void send_token_slots(const EpParams& p, const SendArgs& a, int64_t warp,
                                        int64_t num_warps) {
  for (int64_t t = warp; t < p.num_tokens; t += num_warps) (void)token_owners(p, a, t, true);
}

// The same tokens' rows and scales into rank d's recv_xq / recv_sf when d owns one of their
// experts (once per rank, not per expert), each followed by its arrival word there:
// recv_flag[rank][t] = call, a release at system scope by lane 0 after the warp's stores (the
// warp barrier orders the other lanes' stores before it; the release is cumulative).
__device__ inline void send_token_rows(const EpParams& p, const SendArgs& a, int64_t warp,
                                       int64_t num_warps, uint64_t call) {
  const WindowLayout& L = p.layout;
  const int lane = threadIdx.x % 32;
  const int64_t H = L.hidden, sf_row = H / 32;
  const int64_t src_token0 = static_cast<int64_t>(p.rank) * L.t_max;  // our rows in peers' recv
  for (int64_t t = warp; t < p.num_tokens; t += num_warps) {
    uint64_t mask = token_owners(p, a, t, false);
    const uint4* row = reinterpret_cast<const uint4*>(a.x_q + t * H);
    const uint8_t* sf = a.x_sf + t * sf_row;
    while (mask != 0) {
      const int d = __ffsll(static_cast<long long>(mask)) - 1;
      mask &= mask - 1;
      uint4* dst = reinterpret_cast<uint4*>(region<uint8_t>(p.peers[d], L.recv_xq) +
                                            (src_token0 + t) * H);
      warp_copy<kCopyBatch>(dst, row, H / 16, lane);
      uint8_t* dst_sf = region<uint8_t>(p.peers[d], L.recv_sf) + (src_token0 + t) * sf_row;
      warp_copy<kCopyBatch>(dst_sf, sf, sf_row, lane);
      if (p.row_flags) {
        __syncwarp();
        if (lane == 0)
          st_release_sys(region<uint64_t>(p.peers[d], L.recv_flag) + src_token0 + t, call);
      }
    }
  }
}

// Token t of this call, by the whole CTA (ep_dispatch's fused send): its slots (send_slot), then
// its row of x quantized (each thread kQuantVec channels, the quantize kernel's
// quantize_chunk: the same codes) and the codes and scales stored from registers into the
// recv_xq / recv_sf rows of every rank owning one of its experts. s_mask: shared memory.
// NOTES: why: the layer's quantize launch wrote x_q and ep_dispatch's single CTA then copied
// every row to its owners, two dependent passes and a launch before the send's signal; here the
// token's CTA quantizes and stores once per owner (docs/tuning-log.md v28).
__device__ inline void quantize_send_token(const EpParams& p, const SendArgs& a, int64_t t,
                                           uint64_t call, unsigned long long* s_mask) {
  const WindowLayout& L = p.layout;
  const int64_t K = L.top_k, H = L.hidden, sf_row = H / kScaleBlock;
  const int64_t at = static_cast<int64_t>(p.rank) * L.t_max + t;  // our row in peers' recv
  const int chunks = static_cast<int>(H / sm90::kQuantVec);
  // Whole warps: every lane of a warp reaches quantize_chunk's shuffles.
  const int bound = (chunks + 31) / 32 * 32;
  const uint4* x_row = reinterpret_cast<const uint4*>(a.x + t * H);
  const int c_first = static_cast<int>(threadIdx.x);
  // The row's first chunks are requested before the ids are read: their latencies overlap.
  uint4 raw = c_first < chunks ? __ldg(x_row + c_first) : make_uint4(0, 0, 0, 0);
  if (threadIdx.x == 0) *s_mask = 0;
  __syncthreads();
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const int32_t id = send_slot(p, a, t, k);
    if (id >= 0) atomicOr(s_mask, 1ull << (id / p.num_local));
  }
  __syncthreads();
  const unsigned long long mask = *s_mask;
  for (int c = c_first; c < bound; c += blockDim.x) {
    if (c != c_first) raw = c < chunks ? __ldg(x_row + c) : make_uint4(0, 0, 0, 0);
    uint32_t packed[2];
    const int b = sm90::quantize_chunk(raw, packed);
    if (c >= chunks) continue;
    for (unsigned long long m = mask; m != 0; m &= m - 1) {
      const int d = __ffsll(static_cast<long long>(m)) - 1;
      reinterpret_cast<uint2*>(region<uint8_t>(p.peers[d], L.recv_xq) + at * H)[c] =
          make_uint2(packed[0], packed[1]);
      if (c % sm90::kQuantThreadsPerGroup == 0)
        region<uint8_t>(p.peers[d], L.recv_sf)[at * sf_row + c / sm90::kQuantThreadsPerGroup] =
            static_cast<uint8_t>(b);
    }
  }
  // The token's arrival word on every owner (recv_flag, as send_token_rows): the barrier orders
  // the CTA's stores before thread 0's release (p.row_flags is the same for every thread).
  if (p.row_flags) {
    __syncthreads();
    if (threadIdx.x == 0) {
      for (unsigned long long m = mask; m != 0; m &= m - 1) {
        const int d = __ffsll(static_cast<long long>(m)) - 1;
        st_release_sys(region<uint64_t>(p.peers[d], L.recv_flag) + at, call);
      }
    }
  }
  __syncthreads();  // every thread has read *s_mask before the next token resets it
}

// One thread, after every slot id of call `call` is ordered before it: every rank's
// dispatch_sig[rank] gets (call, T) (or the capacity error with the T called).
__device__ inline void publish_dispatch(const EpParams& p, uint64_t call) {
  const uint32_t payload =
      p.called_tokens != p.num_tokens
          ? kPayloadError | (static_cast<uint32_t>(p.called_tokens) & kPayloadMask)
          : static_cast<uint32_t>(p.num_tokens);
  for (int d = 0; d < p.size; ++d)
    st_release_sys(region<uint64_t>(p.peers[d], p.layout.dispatch_sig) + p.rank,
                   (call << 32) | payload);
}

// One thread, after every row of this call is ordered before it: every rank's rows_sig[rank]
// gets (call, T).
__device__ inline void publish_rows(const EpParams& p, uint64_t call) {
  for (int d = 0; d < p.size; ++d)
    st_release_sys(region<uint64_t>(p.peers[d], p.layout.rows_sig) + p.rank,
                   (call << 32) | static_cast<uint32_t>(p.num_tokens));
}

// One warp per token (grid-stride), in two passes: the slot ids, after which the last CTA
// publishes dispatch_sig (the receivers sort while the rows travel), then the rows with their
// arrival words, after which the last CTA publishes rows_sig. Every CTA has started before
// dispatch_sig is published (each took a ticket), and nothing in the second pass waits: a
// receiver that waits for these rows (its GEMM kernel's gather units, with several ranks on one
// GPU) never waits for a CTA that has no room to run.
__global__ void __launch_bounds__(kSendThreads)
ep_send_kernel(const EpParams p, const SendArgs a) {
  ptx::grid_dependency_wait();  // PDL: the quantized input is complete
  ptx::launch_dependents();     // the successor (ep_dispatch) is one CTA
  EpLocal* me = local_state(p);
  // This call's number: one more than the last dispatch's (the previous call's kernels have ended:
  // the quantize launch before this one waited for them; this call's dispatch advances it only
  // after this rank's dispatch_sig, so after every CTA here has read it).
  const uint64_t call = me->dispatched + 1;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kSendWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kSendWarps;
  send_token_slots(p, a, warp, num_warps);
  if (last_cta(&me->send_ticket) && threadIdx.x == 0) publish_dispatch(p, call);
  send_token_rows(p, a, warp, num_warps, call);
  if (last_cta(&me->rows_ticket) && threadIdx.x == 0) publish_rows(p, call);
}

// The received slots of the current call. Source-major (the chained gather): source s's tokens
// [0, T_s) with K slots each, v = (prefix[s] + t) * K + k. Token-major (token_major: the MegaMoE
// kernel gathers as rows arrive): v = (t * R + s) * K + k for t below the largest T of the call,
// id -1 where s sent fewer tokens, so each expert's rows come in ascending token order across the
// sources, roughly the order in which the senders' warps deliver them. A slot's row_slot value
// is its place in recv_idx, (s*T_max + t)*K + k, so row_slot / K is the token's row in recv_xq
// and recv_flag (what the gather reads). R * T_max * K < 2^31 (EpGroup).
struct ReceivedSlots {
  static constexpr bool kRecord = false;  // sources send only valid ids or -1
  const int32_t* recv_idx;
  const float* recv_w;
  const int32_t* token_prefix;  // shared memory [R + 1]: received tokens before source s
  const int32_t* tokens;        // shared memory [R]: tokens received from source s
  uint32_t ranks;
  uint32_t t_max, top_k;
  bool token_major;
  __device__ __forceinline__ uint32_t place(int64_t v, bool* sent) const {
    const uint32_t u = static_cast<uint32_t>(v) / top_k;
    const uint32_t k = static_cast<uint32_t>(v) - u * top_k;
    uint32_t s, t;
    if (token_major) {  // u = t * R + s
      t = u / ranks;
      s = u - t * ranks;
      *sent = t < static_cast<uint32_t>(tokens[s]);
    } else {  // the source s with token_prefix[s] <= u < token_prefix[s + 1]
      int lo = 0, hi = static_cast<int>(ranks) - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (static_cast<uint32_t>(token_prefix[mid]) <= u) lo = mid; else hi = mid - 1;
      }
      s = static_cast<uint32_t>(lo);
      t = u - static_cast<uint32_t>(token_prefix[lo]);
      *sent = true;
    }
    return (s * t_max + t) * top_k + k;
  }
  __device__ __forceinline__ int32_t id(int64_t v) const {
    bool sent;
    const uint32_t at = place(v, &sent);
    return sent ? recv_idx[at] : -1;
  }
  __device__ __forceinline__ float weight(int64_t v) const {
    bool sent;
    const uint32_t at = place(v, &sent);
    return sent ? recv_w[at] : 0.0f;
  }
  __device__ __forceinline__ int32_t row_slot(int64_t v) const {
    bool sent;
    return static_cast<int32_t>(place(v, &sent));
  }
};

// CTAs of kDispatchMaxWarps warps; dynamic shared memory as sm90_dispatch_topk_kernel. `d`
// carries the row-list outputs (num_slots is set here from the received counts).
// fused_send (calls of at most kFusedSendMaxTokens tokens; no quantize or ep_send launch): CTA b
// quantizes and sends tokens b, b + grid, ... (quantize_send_token); the last CTA to finish
// publishes, and only it goes on to wait and sort (one spinning CTA, as with a grid of one).
// Without it the grid is one CTA and ep_send has published.
// row_dst (optional, [max_rows]): each placed row's destination, its source rank's combine slot
// (GemmParams::out_rows: the L2 epilogue returns the rows).
// wait_rows: after the sort, wait for every rank's rows_sig too (the next kernel reads the rows);
// without it the reader waits for each row itself (the MegaMoE kernel's gather units, recv_flag),
// and the slots are sorted token-major (ReceivedSlots).
// Without fused_send the predecessor is this rank's ep_send: no grid-dependency wait, so the
// dispatch runs (and, alone on the GPU, lets the next kernel launch) while ep_send still sends
// its rows; it reads nothing ep_send wrote except through dispatch_sig, and every kernel before
// ep_send has ended (ep_send lets it launch only after its own grid-dependency wait).
__global__ void __launch_bounds__(sm90::kDispatchMaxWarps * sm90::kDispatchWarpSize)
ep_dispatch_kernel(const EpParams p, sm90::DispatchParams d, int num_warps, const SendArgs a,
                   bool fused_send, uint16_t** row_dst, bool wait_rows) {
  extern __shared__ int32_t hist[];
  __shared__ int32_t warp_totals[sm90::kDispatchMaxWarps];
  __shared__ int32_t tokens[kMaxRanks + 1];
  __shared__ int32_t prefix[kMaxRanks + 1];
  __shared__ int32_t max_tokens;
  __shared__ unsigned long long s_mask;
  // PDL, fused: the previous layer call is done with this rank's peers' rows (its return waited
  // for every rank).
  if (fused_send) ptx::grid_dependency_wait();
  if (p.early_launch) ptx::launch_dependents();
  const WindowLayout& L = p.layout;
  EpLocal* me = local_state(p);
  // This call's number: one more than the last dispatch's (written below by the CTA that waits,
  // after every CTA of this grid read it; the next call's dispatch runs after this call's
  // kernels, each of which waited for its predecessor).
  const uint64_t call = me->dispatched + 1;
  if (fused_send) {
    for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x)
      quantize_send_token(p, a, t, call, &s_mask);
    if (!last_cta(&me->send_ticket)) return;  // the others exit: one CTA waits below
    if (threadIdx.x == 0) {  // after last_cta's fence: the slot ids and the rows are in place
      publish_dispatch(p, call);
      publish_rows(p, call);
    }
    __syncthreads();
  }
  if (threadIdx.x < p.size) {
    const int s = threadIdx.x;
    const uint32_t payload = wait_signal(p, region<uint64_t>(p.peers[p.rank], L.dispatch_sig) + s,
                                         call, Stage::kDispatch, s);
    if (payload & kPayloadError) {
      // The rank called above its capacity has thrown already; the others record it.
      if (s != p.rank)
        record_error(p, StatusCode::kPeerCapacity, Stage::kDispatch, s, 0, payload & kPayloadMask);
      tokens[s] = 0;
    } else {
      tokens[s] = static_cast<int32_t>(payload < L.t_max ? payload : L.t_max);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    me->dispatched = call;  // the call number of this call's later kernels
    prefix[0] = 0;
    max_tokens = 0;
    for (int s = 0; s < p.size; ++s) {
      prefix[s + 1] = prefix[s] + tokens[s];
      max_tokens = max(max_tokens, tokens[s]);
    }
  }
  __syncthreads();
  // The waits for the other ranks are over: the gather may launch now (PDL), its CTAs wait for
  // this kernel's end.
  if (!p.early_launch) ptx::launch_dependents();
  const bool token_major = !wait_rows;
  d.num_slots = token_major ? static_cast<int64_t>(max_tokens) * p.size * L.top_k
                            : static_cast<int64_t>(prefix[p.size]) * L.top_k;
  const ReceivedSlots slots{region<int32_t>(p.peers[p.rank], L.recv_idx),
                            region<float>(p.peers[p.rank], L.recv_w), prefix, tokens,
                            static_cast<uint32_t>(p.size), static_cast<uint32_t>(L.t_max),
                            static_cast<uint32_t>(L.top_k), token_major};
  // The sort's total rows, also when it placed none.
  int32_t rows = 0;
  bool placed;
  if (d.num_slots <= sm90::kDispatchSmallSlots) {
    __shared__ int32_t s_local[sm90::kDispatchSmallSlots];
    placed = sm90::dispatch_sort_small(d, slots, s_local, &rows);
  } else {
    placed = sm90::dispatch_sort(d, slots, num_warps, hist, warp_totals);
    rows = warp_totals[blockDim.x / sm90::kDispatchWarpSize - 1];  // the last inclusive total
  }
  if (threadIdx.x == 0) {
    me->recv_rows = placed ? static_cast<uint32_t>(rows) : kPayloadError;
    if (!placed) record_error(p, StatusCode::kRecvOverflow, Stage::kDispatch, p.rank, 0, rows);
  }
  if (row_dst != nullptr && placed) {
    __syncthreads();  // the sort's row_slot stores, made by every thread of the CTA
    for (int32_t r = threadIdx.x; r < rows; r += blockDim.x)
      row_dst[r] = combine_row(p, d.row_slot[r]);
  }
  // The rows themselves (ep_send publishes dispatch_sig before them): the sort above overlapped
  // their arrival. (A source above its capacity published rows_sig with T = 0.)
  if (wait_rows && threadIdx.x < p.size) {
    const int s = threadIdx.x;
    (void)wait_signal(p, region<uint64_t>(p.peers[p.rank], L.rows_sig) + s, call, Stage::kDispatch, s);
  }
}

// 16 warps: the rows of a one-token call of top-16 in one CTA (no ticket: last_cta).
constexpr int kReturnThreads = 512;
constexpr int kReturnWarps = kReturnThreads / 32;

// One warp per computed row (grid-stride): out[r] (bf16 [H]) to the combine slot t*K + k of the
// row's source rank (none with out == nullptr: the layer's L2 epilogue wrote them there, through
// ep_dispatch's row_dst). The last CTA publishes return_sig on every rank, then waits for every
// rank's return_sig of this call, and for this rank's own rows_sig: ep_send's last CTA is done
// (nothing in the chain waits for ep_send's end since the dispatch does not, and the next call's
// send reuses its tickets and signal words); only then may the combine launch (PDL): its CTAs
// must not sit on the GPU while a rank it waits for still needs room to run.
// Ordering of rows written by the previous kernel: that grid's stores happen before everything
// after this kernel's grid-dependency wait (stream order), and thread 0's release store of the
// signal is cumulative over them, as it is over this CTA's own copies after the barrier.
__global__ void __launch_bounds__(kReturnThreads)
ep_return_kernel(const EpParams p, const uint16_t* __restrict__ out,
                 const int32_t* __restrict__ row_offsets, const int32_t* __restrict__ row_slot) {
  ptx::grid_dependency_wait();  // PDL: L2's rows are complete
  if (p.early_launch) ptx::launch_dependents();
  const WindowLayout& L = p.layout;
  const int lane = threadIdx.x % 32;
  const int64_t H = L.hidden;
  // out == nullptr: L2 wrote the rows to their combine slots already; only the signals remain.
  const int64_t rows = out != nullptr ? __ldg(row_offsets + p.num_local) : 0;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kReturnWarps + threadIdx.x / 32; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kReturnWarps) {
    const uint4* src = reinterpret_cast<const uint4*>(out + r * H);
    uint4* dst = reinterpret_cast<uint4*>(combine_row(p, __ldg(row_slot + r)));
    warp_copy<kCopyBatch>(dst, src, H / 8, lane);
  }
  EpLocal* me = local_state(p);
  if (!last_cta(&me->return_ticket)) return;
  const uint64_t call = me->dispatched;
  if (threadIdx.x == 0) publish_return(p, call);
  static_assert(kReturnThreads > kMaxRanks, "a thread beside the return waits for rows_sig");
  wait_returns(p, call, threadIdx.x);
  __syncthreads();
  if (!p.early_launch) ptx::launch_dependents();
}

}  // namespace megamoe::ep
