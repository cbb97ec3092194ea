// read_ceiling.cuh: what one launch can read from device memory at the sizes of the decode GEMMs'
// weight streams (the read ceiling by size): the kernel and its launcher, shared by the benchmark
// (bench/read_ceiling.cu) and its correctness test (tests/gpu/test_sm90_read_ceiling.cu).
//
// The kernel is the GEMMs' copy pipeline without the math: one warp per CTA, bulk copies
// (cp.async.bulk, as the GEMMs' producers issue them) of `stage_bytes` into a ring of kStages
// shared-memory slots; each CTA reads an even share of the buffer or, as the GEMMs, units of one
// tile (CTA b: units b, b + grid, ...); the CTAs per SM are fixed by the shared memory each
// requests. Lane 0 folds the first word of every stage into a checksum, so
// the copies are observed (Sm90ReadCeiling.ChecksumCoversEveryStage checks it against the host).
// With `programmatic`, a CTA issues its first kStages copies before griddepcontrol.wait, as the
// decode GEMMs do under programmatic dependent launch.
//
// Include it from one translation unit per program (it defines a kernel).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "ptx/sm90_ptx.cuh"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "runtime/cuda_launch.hpp"

namespace megamoe::bench {

constexpr int kMaxStages = 8;

// The stages a CTA reads: its units b, b + grid, ... (each contiguous, unit_bytes long, the last
// one of the buffer possibly shorter), each cut into ceil(unit_bytes / stage_bytes) stages.
struct StageMap {
  int64_t bytes, unit_bytes;
  int num_units, stage_bytes;
  MEGAMOE_HD int64_t stages_per_unit() const { return (unit_bytes + stage_bytes - 1) / stage_bytes; }
  // Stages of CTA b (grid CTAs).
  MEGAMOE_HD int64_t count(int b, int grid) const {
    int64_t n = 0;
    for (int64_t u = b; u < num_units && u * unit_bytes < bytes; u += grid) {
      const int64_t len = (u + 1) * unit_bytes < bytes ? unit_bytes : bytes - u * unit_bytes;
      n += (len + stage_bytes - 1) / stage_bytes;
    }
    return n;
  }
  // Offset and length of stage i of CTA b.
  MEGAMOE_HD void stage(int b, int grid, int64_t i, int64_t* off, uint32_t* len) const {
    const int64_t spu = stages_per_unit();
    const int64_t u = b + (i / spu) * grid;
    const int64_t end = (u + 1) * unit_bytes < bytes ? (u + 1) * unit_bytes : bytes;
    *off = u * unit_bytes + (i % spu) * stage_bytes;
    *len = static_cast<uint32_t>(end - *off < stage_bytes ? end - *off : stage_bytes);
  }
};

__global__ void __launch_bounds__(32) read_stream_kernel(const uint8_t* __restrict__ src,
                                                         StageMap map, int stages,
                                                         uint32_t* __restrict__ sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ uint64_t full[kMaxStages];
  if (threadIdx.x != 0) return;
  const int b = static_cast<int>(blockIdx.x), grid = static_cast<int>(gridDim.x);
  const int64_t n = map.count(b, grid);
  for (int s = 0; s < stages; ++s) ptx::mbar_init(&full[s], 1);
  ptx::mbar_init_fence();
  const uint64_t policy = ptx::policy_evict_first();
  auto issue = [&](int64_t i) {
    const int slot = static_cast<int>(i % stages);
    int64_t off;
    uint32_t len;
    map.stage(b, grid, i, &off, &len);
    ptx::mbar_arrive_expect_tx(&full[slot], len);
    ptx::bulk_copy_g2s(smem + slot * map.stage_bytes, src + off, len, &full[slot], policy);
  };
  for (int64_t i = 0; i < (n < stages ? n : stages); ++i) issue(i);
  ptx::grid_dependency_wait();  // a no-op in a plainly launched grid
  ptx::launch_dependents();
  uint32_t acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int slot = static_cast<int>(i % stages);
    ptx::mbar_wait(&full[slot], static_cast<uint32_t>((i / stages) & 1));
    acc ^= *reinterpret_cast<const uint32_t*>(smem + slot * map.stage_bytes);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the read before the next copy
    if (i + stages < n) issue(i + stages);
  }
  sink[b] = acc;
}

struct ReadConfig {
  int ctas_per_sm;
  int stage_bytes;
  int stages;
};

inline int read_grid(const ReadConfig& c) { return cuda::device_info().sm_count * c.ctas_per_sm; }

// unit_bytes = 0: one unit per CTA (the buffer split evenly); else units of unit_bytes, CTA b
// taking units b, b + grid, ... (the decode GEMMs' first units at T = 1, one tile of 128 weight
// rows x K each).
inline StageMap read_map(const ReadConfig& c, int64_t bytes, int64_t unit_bytes) {
  const int grid = read_grid(c);
  StageMap m{bytes, unit_bytes, 0, c.stage_bytes};
  if (unit_bytes == 0) m.unit_bytes = ((bytes + grid - 1) / grid + 15) / 16 * 16;
  m.num_units = static_cast<int>((bytes + m.unit_bytes - 1) / m.unit_bytes);
  return m;
}

// Launches one read of `bytes` from src: the grid is sm_count x ctas_per_sm, each CTA requesting
// the shared memory that leaves room for exactly ctas_per_sm CTAs per SM.
inline void launch_read(const ReadConfig& c, const uint8_t* src, int64_t bytes, int64_t unit_bytes,
                 uint32_t* sink, bool programmatic, cudaStream_t stream) {
  MEGAMOE_CHECK_ARG(bytes % 16 == 0 && unit_bytes % 16 == 0 && c.stage_bytes % 16 == 0 &&
                        c.stages >= 1 && c.stages <= kMaxStages,
                    "read ceiling: bulk copies need 16-byte multiples and 1..", kMaxStages,
                    " stages; got bytes ", bytes, ", unit ", unit_bytes, ", stage ", c.stage_bytes,
                    " x ", c.stages);
  const size_t smem = std::max<size_t>(static_cast<size_t>(c.stages) * c.stage_bytes,
                                       (227u * 1024u) / c.ctas_per_sm - 2048u);
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(read_stream_kernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  cuda::launch(read_stream_kernel, dim3(read_grid(c)), dim3(32), smem, stream, programmatic, src,
               read_map(c, bytes, unit_bytes), c.stages, sink);
}

}  // namespace megamoe::bench
