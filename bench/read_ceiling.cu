// read_ceiling.cu: the read ceiling by size (megamoe_bench_read_ceiling): what one launch of the
// GEMMs' copy pipeline without the math (bench/read_ceiling.cuh) reads from device memory at the
// sizes of the decode GEMMs' weight streams, for several CTA and stage shapes, plainly launched
// and as a programmatic dependent; the T = 1 bar of issue 4 (>= 60 % of the copy ceiling) is set
// against it. Prints one "[read]" line per case. Needs an sm_90 GPU (exit code 2 without one).
//
//   build/megamoe_bench_read_ceiling
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include "bench/gpu_timing.hpp"
#include "bench/read_ceiling.cuh"
#include "megamoe/buffer.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"

namespace megamoe::bench {
namespace {

void run() {
  const auto& dev = cuda::device_info();
  // Copy ceiling as the GEMM benchmark measures it (bytes read + written).
  const double copy_tbs = device_copy_tbs();
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
        const Stream st;
        issue(st);
        MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(st));
        const StreamGraph graph(st, [&] { issue(st); });
        const GraphTiming t = time_graph_launches(graph, st, kRot, 20);
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
}  // namespace megamoe::bench

int main() {
  if (!megamoe::sm90_available()) {
    std::fprintf(stderr, "megamoe_bench_read_ceiling: needs an sm_90 GPU (%s)\n",
                 megamoe::cuda_available() ? "the GPU is not compute capability 9.0"
                                           : "no CUDA device");
    return 2;
  }
  try {
    megamoe::bench::run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megamoe_bench_read_ceiling: %s\n", e.what());
    return 1;
  }
  return 0;
}
