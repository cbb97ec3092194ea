// ep_device.cuh: the device side of the expert-parallel protocol that both the EP kernels
// (ep_kernels.cuh) and the MegaMoE kernel (its gather units under expert parallelism) use:
// system-scope acquire / release of signal words, the error record, and the wait for one received
// row (recv_flag). The window layout is ep_protocol.hpp.
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

// One thread: waits until source token `token` (s * t_max + t) of call `call` has arrived
// (recv_flag[token] == call), with acquire semantics at system scope. After the timeout (or at
// once on a window broken by an earlier timeout) it records kTimeout in stage dispatch naming the
// source, and returns: the row is then invalid and the host reports the error.
__device__ inline void wait_row(const RowArrival& a, int64_t token, uint64_t call) {
  const uint64_t* flag = a.flags + token;
  if (ld_acquire_sys(flag) == call) return;
  const bool broken = *reinterpret_cast<volatile uint32_t*>(&a.local->broken) != 0;
  const uint64_t start = global_time_ns();
  for (;;) {
    const uint64_t v = ld_acquire_sys(flag);
    if (v == call) return;
    if (broken || global_time_ns() - start > a.timeout_ns) {
      record_error_at(a.local, a.error_flag, StatusCode::kTimeout, Stage::kDispatch,
                      static_cast<int32_t>(token / a.t_max), call, v);
      return;
    }
    __nanosleep(64);
  }
}

}  // namespace megamoe::ep
