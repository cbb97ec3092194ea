// Micro-benchmark: how busy can the tensor pipe be with RS wgmma m64nNk16 (BF16) issued the way
// the prefill mainloop issues them, with and without the E2M1 conversion between issue and wait?
// One CTA per SM, NWG math warpgroups, no TMA and no barriers: the B tile and the weight words sit
// in shared memory for the whole run. Prints tensor-pipe utilization = ideal cycles / cycles,
// ideal = MACs / 2048 per SM cycle (dense BF16). Modes: 0 the prefill loop (unit u: 4 wgmmas,
// commit, the next unit's A registers, wait 0), 1 two accumulator chains per wait, 2 wait_group 1
// with three register sets, 3 the wgmmas alone. "convert" is the kernels' own conversion
// (Mainloop::load_convert_block, through micro::convert_block); docs/tuning-log.md has the
// readings.
//
// Build: the CMake target megamoe_micro_wgmma_chain (with the tools, when CUDA is enabled), or
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Ikernels -Iinclude bench/micro/wgmma_chain.cu -o wgmma_chain
#include "micro_common.cuh"

using namespace megamoe;

// MODE 0: unit u: 4 wgmmas on acc[u & 1] from set u & 1; commit; convert u + 1 into the other set; wait 0
// MODE 1: pair: 8 wgmmas interleaved acc0 / acc1 (two chains) from sets p & 1; commit; convert both next
//         blocks into the other sets; wait 0 (one wait per two units)
// MODE 2: unit u: 4 wgmmas on acc[u & 1] from set u % 3; commit; convert u + 1 into set (u + 1) % 3; wait 1
// MODE 3: like 0 but no conversion at all (A registers constant): the wgmma chain alone
// Units per warpgroup: mode 2 runs three per iteration.
template <int MODE>
constexpr int kModeUnits = MODE == 2 ? micro::kUnits / 3 * 3 : micro::kUnits;

template <int N, int NWG, int MODE, bool CONVERT>
__global__ void __launch_bounds__(128 * NWG, 1) kern(const uint32_t* gw, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* b_tile = smem;
  uint32_t* words = reinterpret_cast<uint32_t*>(smem + micro::b_tile_bytes(N));
  micro::fill(b_tile, N, words, NWG, gw);
  __syncthreads();
  const int tid = threadIdx.x;
  const int wg = tid / 128, t = tid % 128;
  const micro::Addrs addrs = micro::thread_addrs(words, NWG, wg, t);
  const uint32_t desc_lo = ptx::smem_desc_k128b_lo(b_tile);
  float acc[2][N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) { acc[0][i] = 0.f; acc[1][i] = 0.f; }
  constexpr int kSets = MODE == 2 ? 3 : MODE == 1 ? 4 : 2;
  uint32_t fr[kSets][4][4];
  auto convert = [&](int set, int blk) {
    if constexpr (CONVERT) {
      micro::convert_block(addrs.words + blk * 2048, addrs.sf, fr[set]);
    } else {  // the words themselves, no instructions
      const uint4 wv = ptx::ld_shared_v4_at(addrs.words + blk * 2048);
      const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) fr[set][s][i] = ws[s];
    }
  };
  auto issue = [&](int set, int a) {
#pragma unroll
    for (int s = 0; s < 4; ++s)
      ptx::WgmmaBf16RS<N>::template mma_lo<ptx::kSmemDescK128bHi>(acc[a], fr[set][s], desc_lo + 2 * s, 1);
  };
  convert(0, 0);
  convert(1, 1);
  if constexpr (MODE == 2) convert(2, 0);
  asm volatile("bar.sync %0, %1;" ::"r"(1 + wg), "r"(128));
  const long long t0 = clock64();
  if constexpr (MODE == 0 || MODE == 3) {
#pragma unroll 1
    for (int u = 0; u < kModeUnits<MODE>; u += 2) {
      ptx::wgmma_fence();
      issue(0, 0);
      ptx::wgmma_commit();
      if constexpr (MODE == 0) convert(1, 1);
      ptx::wgmma_wait<0>();
      ptx::wgmma_fence();
      issue(1, 1);
      ptx::wgmma_commit();
      if constexpr (MODE == 0) convert(0, 0);
      ptx::wgmma_wait<0>();
    }
  } else if constexpr (MODE == 1) {
    // Sets cur, cur + 1 hold blocks 0, 1 of this pair; the next pair goes into nxt, nxt + 1.
    auto pair = [&](int cur, int nxt) {
      ptx::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        ptx::WgmmaBf16RS<N>::template mma_lo<ptx::kSmemDescK128bHi>(acc[0], fr[cur][s], desc_lo + 2 * s, 1);
        ptx::WgmmaBf16RS<N>::template mma_lo<ptx::kSmemDescK128bHi>(acc[1], fr[cur + 1][s], desc_lo + 2 * s, 1);
      }
      ptx::wgmma_commit();
      convert(nxt, 0);
      convert(nxt + 1, 1);
      ptx::wgmma_wait<0>();
    };
    convert(2, 0);
    convert(3, 1);
#pragma unroll 1
    for (int u = 0; u < kModeUnits<MODE>; u += 4) {
      pair(0, 2);
      pair(2, 0);
    }
  } else {
#pragma unroll 1
    for (int u = 0; u < kModeUnits<MODE>; u += 3) {
      ptx::wgmma_fence(); issue(0, 0); ptx::wgmma_commit(); convert(1, 1); ptx::wgmma_wait<1>();
      ptx::wgmma_fence(); issue(1, 1); ptx::wgmma_commit(); convert(2, 0); ptx::wgmma_wait<1>();
      ptx::wgmma_fence(); issue(2, 0); ptx::wgmma_commit(); convert(0, 1); ptx::wgmma_wait<1>();
    }
    ptx::wgmma_wait<0>();
  }
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += acc[0][i] + acc[1][i];
  if (s == 1234.5f) sink[tid] = s;
  if (t == 0) cycles[blockIdx.x * NWG + wg] = t1 - t0;
}

template <int N, int NWG, int MODE, bool CONVERT>
void run(const char* name) {
  micro::report(kern<N, NWG, MODE, CONVERT>, micro::b_tile_bytes(N) + micro::word_bytes(NWG), NWG, N, name,
                kModeUnits<MODE>);
}

int main() {
#define R(N, W, M, C) run<N, W, M, C>(C ? "mode " #M " convert" : "mode " #M " copy")
  R(80, 1, 3, false); R(80, 2, 3, false); R(80, 3, 3, false);
  R(80, 1, 0, false); R(80, 2, 0, false);
  R(80, 1, 0, true);  R(80, 2, 0, true); R(80, 3, 0, true);
  R(80, 1, 1, true);  R(80, 2, 1, true);
  R(80, 1, 2, true);  R(80, 2, 2, true);
  R(80, 2, 1, false); R(80, 2, 2, false);
  R(192, 1, 3, false); R(192, 2, 3, false);
  R(192, 2, 0, true);  // mode 2 at N = 192: ptxas serializes its wgmmas (C7512), not a reading
  R(128, 2, 3, false); R(128, 2, 0, true);
  R(96, 2, 3, false); R(96, 2, 0, true); R(96, 2, 2, true);
  return 0;
}
