// sm90_diag_timeline.cuh: MEGAMOE_DIAG_TIMELINE (measurement builds only; sm90_diag.hpp): the
// grouped GEMM kernel stamps %globaltimer at fixed points of every CTA's life into a
// device table that the GEMM benchmark reads back (sm90::diag_read_timeline), to see where a short
// launch loses its time: the launch spread, the schedule, the first stage, the spread of the CTAs'
// ends. In the default build the stamps compile to nothing.
#pragma once

#include <cstdint>

#include "sm90/sm90_diag.hpp"

namespace megamoe::sm90::diag {

constexpr int kTimelineCtas = 1024;  // CTAs recorded (the persistent grids have at most 4 x SMs)
enum TimelineEvent : int {
  kEntry = 0,         // thread 0, first instruction
  kScheduleBuilt,     // thread 0, after build_schedule
  kFirstUnitDone,     // math thread 0, after the first work unit's mainloop
  kMathDone,          // math thread 0, after its last epilogue
  kProducerDone,      // producer thread, after its last copy was issued
  kSmid,              // not a time: the SM the CTA ran on
  kUnits,             // not a time: work units the math warpgroup ran
  // Sums over the CTA's split-K hand-offs (math thread 0, ns): storing the part and the fence,
  // the barrier + arrival, the sum of the parts (last arrivals only); and over its epilogues.
  kReduceStoreNs,
  kReduceArriveNs,
  kReduceSumNs,
  kEpilogueNs,
  kLastArrivals,      // not a time: hand-offs this CTA finished as the last part
  kNumEvents
};

#if MEGAMOE_DIAG_TIMELINE
static __device__ uint64_t g_timeline[kTimelineCtas][kNumEvents];
#endif

// %globaltimer in a measurement build, 0 otherwise.
__device__ __forceinline__ uint64_t now() {
#if MEGAMOE_DIAG_TIMELINE
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return 0;
#endif
}

// Sets the CTA's slot to value (call from one thread).
__device__ __forceinline__ void record(TimelineEvent slot, uint64_t value) {
#if MEGAMOE_DIAG_TIMELINE
  if (blockIdx.x < kTimelineCtas) g_timeline[blockIdx.x][slot] = value;
#else
  (void)slot;
  (void)value;
#endif
}

// Adds value to the CTA's slot (call from one thread).
__device__ __forceinline__ void add(TimelineEvent slot, uint64_t value) {
#if MEGAMOE_DIAG_TIMELINE
  if (blockIdx.x < kTimelineCtas) g_timeline[blockIdx.x][slot] += value;
#else
  (void)slot;
  (void)value;
#endif
}

__device__ __forceinline__ void stamp(TimelineEvent event) { record(event, now()); }

__device__ __forceinline__ void record_smid() {
#if MEGAMOE_DIAG_TIMELINE
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  record(kSmid, id);
#endif
}

}  // namespace megamoe::sm90::diag
