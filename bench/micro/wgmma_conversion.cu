// wgmma_conversion.cu: how busy the tensor pipe stays when the prefill mainloop's A fragments
// are produced between a unit's wgmma issue and its wait (readings: docs/tuning-log.md).
//
// Two math warpgroups per CTA, one CTA per SM, the overlapped loop's shape: unit u issues four
// RS wgmmas m64nNk16 on accumulator u & 1, commits, produces the next unit's 16 A registers
// (KIND), then waits for group 0. No TMA and no barriers: the B tile, the weight words and the
// scale words sit in shared memory for the whole run. Prints cycles per unit and the tensor-pipe
// utilization = ideal cycles / measured cycles, ideal = MACs / 2048 per SM cycle (dense BF16).
// SS = the wgmmas read A from shared memory and the produced registers are only kept alive.
//
// Build: the CMake target megamoe_micro_wgmma_conversion (with the tools, when CUDA is enabled), or
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Ikernels -Iinclude bench/micro/wgmma_conversion.cu -o wgmma_conversion
#include "micro_common.cuh"

using namespace megamoe;

// wgmma m64nNk16 with A and B both from shared memory (K-major, 128-byte swizzle descriptors).
template <int N> struct WgSS;
template <> struct WgSS<80> {
  __device__ __forceinline__ static void mma(float* d, uint32_t da, uint32_t db) {
    asm volatile("{\n .reg .b64 a, b;\n mov.b64 a, {%40, %42};\n mov.b64 b, {%41, %42};\n"
      " wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, a, b, 1, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]) : "r"(da), "r"(db), "n"(megamoe::ptx::kSmemDescK128bHi));
  }
};
template <> struct WgSS<192> {
  __device__ __forceinline__ static void mma(float* d, uint32_t da, uint32_t db) {
    asm volatile("{\n .reg .b64 a, b;\n mov.b64 a, {%96, %98};\n mov.b64 b, {%97, %98};\n"
      " wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, a, b, 1, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]) : "r"(da), "r"(db), "n"(megamoe::ptx::kSmemDescK128bHi));
  }
};
constexpr int NWG = 2;

__device__ __forceinline__ void keep(uint32_t& x) { asm volatile("" : "+r"(x)); }

template <int N, int KIND, bool SS>
__global__ void __launch_bounds__(128 * NWG, 1) kern(const uint32_t* gw, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* b_tile = smem;                                // N x 128 B
  uint8_t* a_tile = smem + micro::b_tile_bytes(N);       // NWG x 8 KiB (SS only)
  uint32_t* words = reinterpret_cast<uint32_t*>(a_tile + NWG * 8192);
  micro::fill(b_tile, N, words, NWG, gw);
  for (int i = threadIdx.x; i < NWG * 2048; i += blockDim.x) {
    reinterpret_cast<uint32_t*>(a_tile)[i] = 0x3C003C00u ^ (gw[(i * 3) % micro::kRandomWords] & 0x00FF00FFu);
  }
  __syncthreads();
  const int tid = threadIdx.x;
  const int wg = tid / 128, t = tid % 128;
  const micro::Addrs addrs = micro::thread_addrs(words, NWG, wg, t);
  const uint32_t desc_b = ptx::smem_desc_k128b_lo(b_tile);
  const uint32_t desc_a = ptx::smem_desc_k128b_lo(a_tile + wg * 8192);
  float acc[2][N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) { acc[0][i] = 0.f; acc[1][i] = 0.f; }
  uint32_t fr[2][4][4];
  auto produce = [&](int set, int blk) {
    if constexpr (KIND == 0) {  // the kernels' conversion itself
      micro::convert_block(addrs.words + blk * 2048, addrs.sf, fr[set]);
      return;
    }
    const uint4 wv = ptx::ld_shared_v4_at(addrs.words + blk * 2048);
    const uint32_t sfw = ptx::ld_shared_u32_at(addrs.sf);
    const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
    uint32_t sc[2];
    micro::scales(sfw, sc);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t bits[4];
      if constexpr (KIND == 1) sm90_layout::decode_word_bits(ws[s], bits);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t v;
        if constexpr (KIND == 1) {
          v = bits[i];
        } else if constexpr (KIND == 2) {
          v = (i >> 1) ? ptx::mul_bf16x2_by_half<true>(ws[s], sc[i & 1]) : ptx::mul_bf16x2_by_half<false>(ws[s], sc[i & 1]);
        } else if constexpr (KIND == 3) {
          v = ws[s];
        } else if constexpr (KIND == 4) {  // 3 dependent FFMAs per register
          float f = __uint_as_float(ws[s]);
          const float c = __uint_as_float(sc[i & 1]) + (float)i;
          f = fmaf(f, c, 1.0f); f = fmaf(f, c, 2.0f); f = fmaf(f, c, 3.0f);
          v = __float_as_uint(f);
        } else if constexpr (KIND == 6) {  // the same decode with v7's IMAD.WIDE rotations
          auto rot = [](uint32_t w, int n) {
            uint64_t p;
            asm("mul.wide.u32 %0, %1, %2;" : "=l"(p) : "r"(w), "r"(1u << (32 - n)));
            return static_cast<uint32_t>(p) | static_cast<uint32_t>(p >> 32);
          };
          uint32_t b;
          const uint32_t w = ws[s];
          if (i == 0) b = (w << 4) & sm90_layout::kE2m1Bits;
          else if (i == 1) b = rot(w, 2) & sm90_layout::kE2m1Bits;
          else if (i == 2) b = rot(w, 6) & sm90_layout::kE2m1Bits;
          else b = (w & sm90_layout::kA3InPlace) | ((w << 8) & sm90_layout::kA3Shifted);
          v = s < 2 ? ptx::mul_bf16x2_by_half<false>(b, sc[i & 1]) : ptx::mul_bf16x2_by_half<true>(b, sc[i & 1]);
        } else if constexpr (KIND >= 7 && KIND <= 12) {  // 3 dependent ops of one kind per register
          uint32_t x = ws[s] ^ sc[i & 1];
          const uint32_t c = sc[(i + 1) & 1] + i;
#pragma unroll
          for (int r = 0; r < 3; ++r) {
            if constexpr (KIND == 7) { uint64_t p; asm("mul.wide.u32 %0, %1, %2;" : "=l"(p) : "r"(x), "r"(c)); x = (uint32_t)p ^ (uint32_t)(p >> 32); }
            else if constexpr (KIND == 8) asm("shf.r.wrap.b32 %0, %1, %1, %2;" : "=r"(x) : "r"(x), "r"(c));
            else if constexpr (KIND == 9) asm("prmt.b32 %0, %1, %2, 0x3276;" : "=r"(x) : "r"(x), "r"(c));
            else if constexpr (KIND == 10) asm("mad.lo.u32 %0, %1, %2, %1;" : "=r"(x) : "r"(x), "r"(c));
            else if constexpr (KIND == 11) asm("add.u32 %0, %1, %2;" : "=r"(x) : "r"(x), "r"(c));
            else asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(x) : "r"(x), "r"(c));
          }
          v = x;
        } else {  // KIND 5: 3 dependent 3-source LOP3s per register
          uint32_t x = ws[s];
          const uint32_t c = sc[i & 1];
          asm("lop3.b32 %0, %0, %1, %2, 0x96;" : "+r"(x) : "r"(c), "r"(sfw));
          asm("lop3.b32 %0, %0, %1, %2, 0xE8;" : "+r"(x) : "r"(c), "r"(ws[(s + 1) & 3]));
          asm("lop3.b32 %0, %0, %1, %2, 0x6A;" : "+r"(x) : "r"(sc[(i + 1) & 1]), "r"(ws[(s + 2) & 3]));
          v = x + i;
        }
        fr[set][s][i] = v;
      }
    }
  };
  auto issue = [&](int set, int a) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      if constexpr (SS) WgSS<N>::mma(acc[a], desc_a + 2 * s, desc_b + 2 * s);
      else ptx::WgmmaBf16RS<N>::template mma_lo<ptx::kSmemDescK128bHi>(acc[a], fr[set][s], desc_b + 2 * s, 1);
    }
  };
  auto sinkset = [&](int set) {
    if constexpr (SS) {
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) keep(fr[set][s][i]);
    }
  };
  produce(0, 0);
  produce(1, 1);
  asm volatile("bar.sync %0, %1;" ::"r"(1 + wg), "r"(128));
  const long long t0 = clock64();
#pragma unroll 1
  for (int u = 0; u < micro::kUnits; u += 2) {
    ptx::wgmma_fence();
    issue(0, 0);
    ptx::wgmma_commit();
    produce(1, 1);
    sinkset(1);
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence();
    issue(1, 1);
    ptx::wgmma_commit();
    produce(0, 0);
    sinkset(0);
    ptx::wgmma_wait<0>();
  }
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += acc[0][i] + acc[1][i];
  uint32_t x = 0;
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) x ^= fr[a][b][c];
  if (s == 1234.5f || x == 0x12345u) sink[tid] = s;
  if (t == 0) cycles[blockIdx.x * NWG + wg] = t1 - t0;
}

template <int N, int KIND, bool SS>
void run(const char* name) {
  char label[64];
  std::snprintf(label, sizeof label, "%s %s", name, SS ? "SS" : "RS");
  micro::report(kern<N, KIND, SS>, micro::b_tile_bytes(N) + NWG * 8192 + micro::word_bytes(NWG), NWG, N, label);
}

int main() {
  const char* names[] = {"convert (load_convert_block)", "decode, no HMUL2", "HMUL2 only (16)", "no ALU (copy)", "FFMA x48", "LOP3 x48 (3 src)", "convert, IMAD.WIDE rotations", "mul.wide x48 (+xor)", "shf.r.wrap x48", "prmt x48", "mad.lo x48", "add x48", "bf16x2 mul x48"};
#define R(N, K, S) run<N, K, S>(names[K])
  for (int rep = 0; rep < 2; ++rep) {
    R(80, 0, false); R(80, 6, false); R(80, 1, false); R(80, 2, false); R(80, 3, false);
    R(80, 4, false); R(80, 5, false); R(80, 7, false); R(80, 8, false); R(80, 9, false);
    R(80, 10, false); R(80, 11, false); R(80, 12, false);
    R(80, 0, true); R(80, 1, true); R(80, 3, true);
    R(192, 0, false); R(192, 6, false); R(192, 3, false); R(192, 0, true);
  }
  return 0;
}
