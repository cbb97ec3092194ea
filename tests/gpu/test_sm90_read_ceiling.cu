// test_sm90_read_ceiling.cu: the read-ceiling benchmark's kernel (bench/read_ceiling.cuh) reads
// every byte of its buffer exactly once: each CTA's checksum of the first word of its stages
// matches the host's, and the stages cover the buffer. The benchmark itself is
// bench/read_ceiling.cu (megamoe_bench_read_ceiling).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "bench/read_ceiling.cuh"
#include "runtime/cuda_check.hpp"
#include "sm90_test_util.hpp"

namespace megamoe {
namespace {

using bench::launch_read;
using bench::read_grid;
using bench::read_map;
using bench::ReadConfig;
using bench::StageMap;

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

}  // namespace
}  // namespace megamoe
