// ep_device.cuh: the device side of the expert-parallel protocol that both the EP kernels
// (ep_kernels.cuh) and the MegaMoE kernel (its gather units and its combine under expert
// parallelism) use: system-scope acquire / release of signal words, the error record, the waits
// for a signal or one received row (recv_flag), and the return's signal words. The window
// layout is ep_protocol.hpp.
#pragma once

#include <cstdint>

#include "ep/ep_protocol.hpp"

namespace megamoe::ep {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <class T>
__device__ __forceinline__ T* region(uint8_t* base, int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// Records the window's first error (later ones only count) and raises the host-visible flag
// (error_flag: mapped host memory, may be null).
__device__ inline void record_error_at(EpLocal* local, int32_t* error_flag, StatusCode code,
                                       Stage stage, int32_t peer, uint64_t expected,
                                       uint64_t observed) {
  EpStatus* st = &local->status;
  if (atomicCAS(&st->code, 0, static_cast<int32_t>(code)) == 0) {
    st->stage = static_cast<int32_t>(stage);
    st->peer = peer;
    st->expected = expected;
    st->observed = observed;
  }
  atomicAdd(&st->count, 1);
  if (code == StatusCode::kTimeout) atomicExch(&local->broken, 1u);
  if (error_flag != nullptr) {
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(error_flag) = 1;
  }
}

__device__ __forceinline__ EpLocal* local_state(const EpParams& p) {
  return region<EpLocal>(p.peers[p.rank], p.layout.local);
}

// Records the window's first error (later ones only count) and raises the host-visible flag.
__device__ inline void record_error(const EpParams& p, StatusCode code, Stage stage, int32_t peer,
                                    uint64_t expected, uint64_t observed) {
  record_error_at(local_state(p), p.error_flag, code, stage, peer, expected, observed);
}

// Where a wait reports a timeout: the window's state and host word, the limit, and the stage and
// peer its record names.
struct WaitSite {
  EpLocal* local;
  int32_t* error_flag;
  uint64_t timeout_ns;
  Stage stage;
  int32_t peer;
};

// One thread: waits until `*word` carries call number `call` (kWholeWord: an arrival word, the
// call number itself; otherwise a signal word, the call number in its high 32 bits beside a
// payload), with acquire semantics at system scope; returns the word. After the timeout (or at
// once on a window broken by an earlier timeout) it records kTimeout and returns the word it saw
// last, which does not carry the call.
template <bool kWholeWord>
__device__ inline uint64_t wait_word(const uint64_t* word, uint64_t call, const WaitSite& at,
                                     uint32_t sleep_ns) {
  auto carries = [call](uint64_t v) { return (kWholeWord ? v : v >> 32) == call; };
  uint64_t v = ld_acquire_sys(word);
  if (carries(v)) return v;
  const bool broken = *reinterpret_cast<volatile uint32_t*>(&at.local->broken) != 0;
  const uint64_t start = global_time_ns();
  for (;;) {
    v = ld_acquire_sys(word);
    if (carries(v)) return v;
    if (broken || global_time_ns() - start > at.timeout_ns) {
      record_error_at(at.local, at.error_flag, StatusCode::kTimeout, at.stage, at.peer, call, v);
      return v;
    }
    if (sleep_ns != 0) __nanosleep(sleep_ns);
  }
}

// Waits until signal word `*sig` carries call number `call`; returns its payload, or 0 (and
// records kTimeout) when the timeout passes first.
__device__ inline uint32_t wait_signal(const EpParams& p, const uint64_t* sig, uint64_t call,
                                       Stage stage, int32_t peer) {
  const uint64_t v =
      wait_word<false>(sig, call, {local_state(p), p.error_flag, p.timeout_ns, stage, peer}, 0);
  return (v >> 32) == call ? static_cast<uint32_t>(v) : 0;
}

// One thread: waits until source token `token` (s * t_max + t) of call `call` has arrived
// (recv_flag[token] == call). A missing row is recorded in stage dispatch naming the source; the
// row is then invalid and the host reports the error.
__device__ inline void wait_row(const RowArrival& a, int64_t token, uint64_t call) {
  (void)wait_word<true>(a.flags + token, call,
                        {a.local, a.error_flag, a.timeout_ns, Stage::kDispatch,
                         static_cast<int32_t>(token / a.t_max)},
                        64);
}

// The last CTA of a grid to call this (after its writes) returns true, with every other CTA's
// writes ordered before what it does next; it also resets the ticket for the next call.
// One thread fences for the CTA: the barrier orders the other threads' writes before its fence,
// and fences are cumulative (a system fence by every thread cost microseconds per call). A grid
// of one CTA needs neither the ticket nor the fences: the barrier orders its threads' writes
// before thread 0's release store that publishes them (cumulative, as the fence).
__device__ inline bool last_cta(uint32_t* ticket) {
  __shared__ bool last;
  __syncthreads();
  if (gridDim.x == 1) return true;
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    if (last) {
      *ticket = 0;
      __threadfence_system();
    }
  }
  __syncthreads();
  return last;
}

// One thread, once every row this rank computed in call `call` is in its source's combine slot
// (ordered before it at system scope): every rank's return_sig[rank] gets (call, rows received).
__device__ inline void publish_return(const EpParams& p, uint64_t call) {
  const uint64_t word = (call << 32) | local_state(p)->recv_rows;
  for (int d = 0; d < p.size; ++d)
    st_release_sys(region<uint64_t>(p.peers[d], p.layout.return_sig) + p.rank, word);
}

// Threads 0 .. R of a CTA (the others return at once): thread d < R waits for rank d's
// return_sig of call `call` (every rank's rows are in this rank's combine slots; an overflowing
// peer is recorded), thread kMaxRanks for this rank's own rows_sig (its send's last CTA is done:
// the next call's send reuses its tickets and signal words).
__device__ inline void wait_returns(const EpParams& p, uint64_t call, int thread) {
  const WindowLayout& L = p.layout;
  if (thread < p.size) {
    const int d = thread;
    const uint32_t payload = wait_signal(p, region<uint64_t>(p.peers[p.rank], L.return_sig) + d,
                                         call, Stage::kCombine, d);
    // The overflowing rank has recorded its own error already.
    if ((payload & kPayloadError) && d != p.rank)
      record_error(p, StatusCode::kRecvOverflow, Stage::kCombine, d, 0, 0);
  } else if (thread == kMaxRanks) {
    (void)wait_signal(p, region<uint64_t>(p.peers[p.rank], L.rows_sig) + p.rank, call,
                      Stage::kCombine, p.rank);
  }
}

}  // namespace megamoe::ep
