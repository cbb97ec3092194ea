// test_sm90_read_ceiling.cu: what one launch can read from device memory at the sizes of the
// decode GEMMs' weight streams (the read ceiling by size), to set the T = 1 bar of issue 4 (>= 60 %
// of the copy ceiling) against what a kernel that does nothing but read reaches.
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
//   megamoe_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='Sm90ReadCeilingBench.*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "megamoe/buffer.hpp"
#include "megamoe/error.hpp"
#include "ptx/sm90_ptx.cuh"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "runtime/cuda_launch.hpp"
#include "sm90_test_util.hpp"

namespace megamoe {
namespace {

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

int read_grid(const ReadConfig& c) { return cuda::device_info().sm_count * c.ctas_per_sm; }

// unit_bytes = 0: one unit per CTA (the buffer split evenly); else units of unit_bytes, CTA b
// taking units b, b + grid, ... (the decode GEMMs' first units at T = 1, one tile of 128 weight
// rows x K each).
StageMap read_map(const ReadConfig& c, int64_t bytes, int64_t unit_bytes) {
  const int grid = read_grid(c);
  StageMap m{bytes, unit_bytes, 0, c.stage_bytes};
  if (unit_bytes == 0) m.unit_bytes = ((bytes + grid - 1) / grid + 15) / 16 * 16;
  m.num_units = static_cast<int>((bytes + m.unit_bytes - 1) / m.unit_bytes);
  return m;
}

// Launches one read of `bytes` from src: the grid is sm_count x ctas_per_sm, each CTA requesting
// the shared memory that leaves room for exactly ctas_per_sm CTAs per SM.
void launch_read(const ReadConfig& c, const uint8_t* src, int64_t bytes, int64_t unit_bytes,
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

TEST(Sm90ReadCeiling, ChecksumCoversEveryStage) {
  MEGAMOE_REQUIRE_SM90();
  const int64_t bytes = (int64_t(3) << 20) + 4096 + 48;  // a partial last stage
  std::vector<uint32_t> host(static_cast<size_t>(bytes / 4));
  uint64_t z = 0x2545F4914F6CDD1Dull;
  for (auto& w : host) { z ^= z << 13; z ^= z >> 7; z ^= z << 17; w = static_cast<uint32_t>(z); }
  test::DeviceArray<uint32_t> src(host);
  struct Case { ReadConfig c; int64_t unit_bytes; };
  for (const Case& k : {Case{{1, 16384, 8}, 0}, Case{{4, 8192, 4}, 0}, Case{{4, 8192, 4}, 12336},
                        Case{{2, 16384, 3}, 5008}}) {
    const int grid = read_grid(k.c);
    test::DeviceArray<uint32_t> sink(grid);
    launch_read(k.c, reinterpret_cast<const uint8_t*>(src.get()), bytes, k.unit_bytes, sink.get(),
                false, nullptr);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint32_t> got = sink.download();
    const StageMap map = read_map(k.c, bytes, k.unit_bytes);
    int64_t covered = 0;
    for (int b = 0; b < grid; ++b) {
      uint32_t want = 0;
      for (int64_t i = 0; i < map.count(b, grid); ++i) {
        int64_t off;
        uint32_t len;
        map.stage(b, grid, i, &off, &len);
        want ^= host[static_cast<size_t>(off / 4)];
        covered += len;
      }
      ASSERT_EQ(got[static_cast<size_t>(b)], want)
          << "CTA " << b << " of " << grid << ", " << k.c.ctas_per_sm << " per SM, unit "
          << k.unit_bytes;
    }
    EXPECT_EQ(covered, bytes) << "the stages cover the buffer exactly once";
  }
}

TEST(Sm90ReadCeilingBench, DISABLED_Sizes) {
  MEGAMOE_REQUIRE_SM90();
  const auto& dev = cuda::device_info();
  // Copy ceiling as the GEMM benchmark measures it (bytes read + written).
  const double copy_tbs = test::device_copy_tbs();
  printf("[read] %s: device copy %.2f TB/s (read + write)\n", dev.name.c_str(), copy_tbs);
  // The weight bytes of one decode GEMM launch at T = 1 (E2M1 + UE8M0: 17/32 byte per weight)
  // and its units (128 weight rows x K): DeepSeek-V3 L2 (8 experts x 7168 x 2048: 448 units),
  // Kimi-K3 L2 (16 x 3584 x 3072: 448), DeepSeek-V3 L1 (8 x 4096 x 7168: 256 tiles in 2 K parts),
  // Kimi-K3 L1 (16 x 6144 x 3584: 768); then 512 MiB.
  struct Size { const char* what; int64_t bytes, unit_bytes; };
  const Size sizes[] = {{"deepseek-v3 L2", 8LL * 7168 * 2048 * 17 / 32, 128LL * 2048 * 17 / 32},
                        {"kimi-k3 L2", 16LL * 3584 * 3072 * 17 / 32, 128LL * 3072 * 17 / 32},
                        {"deepseek-v3 L1", 8LL * 4096 * 7168 * 17 / 32, 128LL * 3584 * 17 / 32},
                        {"kimi-k3 L1", 16LL * 6144 * 3584 * 17 / 32, 128LL * 3584 * 17 / 32},
                        {"512 MiB", int64_t(512) << 20, 0}};
  const ReadConfig configs[] = {{4, 8192, 4},  {4, 16384, 3}, {2, 16384, 6}, {2, 32768, 3},
                                {1, 32768, 6}, {1, 16384, 8}, {8, 8192, 2},  {8, 4096, 4},
                                {3, 16384, 4}, {1, 24576, 8}};
  constexpr int kRot = 4;  // buffers rotated per graph, as the GEMM benchmark's routing seeds
  Buffer sink(int64_t(dev.sm_count) * 8 * 4, Device::cuda());
  for (const Size& size : sizes) {
    const int64_t bytes = size.bytes;
    std::vector<Buffer> bufs;
    for (int r = 0; r < kRot; ++r) {
      bufs.emplace_back(bytes, Device::cuda());
      MEGAMOE_CUDA_CHECK(cudaMemset(bufs.back().data(), 0x5A + r, bytes));
    }
    for (const int64_t unit_bytes : {int64_t(0), size.unit_bytes}) {
      for (const ReadConfig& c : configs)
      for (int programmatic = 0; programmatic < 2; ++programmatic) {
        auto issue = [&](cudaStream_t st) {
          for (int r = 0; r < kRot; ++r)
            launch_read(c, bufs[r].as<uint8_t>(), bytes, unit_bytes, sink.as<uint32_t>(),
                        programmatic != 0, st);
        };
        const test::Stream st;
        issue(st);
        MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(st));
        const test::StreamGraph graph(st, [&] { issue(st); });
        const test::GraphTiming t = test::time_graph_launches(graph, st, kRot, 20);
        const double tbs = bytes / (t.median_us * 1e-6) / 1e12;
        printf("[read] %-14s %7.1f MB  units %6lld B  %d CTA/SM  stage %5d B x %d  %-5s  median %7.1f us "
               "(min %7.1f)  %5.2f TB/s = %.3f of copy  single %7.1f us\n",
               size.what, bytes / 1e6, (long long)read_map(c, bytes, unit_bytes).unit_bytes,
               c.ctas_per_sm, c.stage_bytes, c.stages, programmatic ? "pdl" : "plain", t.median_us,
               t.min_us, tbs, tbs / copy_tbs, t.single_median_us);
      }
      if (size.unit_bytes == 0) break;
    }
  }
}

}  // namespace
}  // namespace megamoe
