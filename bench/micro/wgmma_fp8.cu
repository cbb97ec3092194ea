// wgmma_fp8.cu: what an FP8 (e4m3) mainloop for MXFP4 weights could sustain on the tensor pipe
// (issue "FP8 tensor cores"; readings: docs/tuning-log.md). The loop of wgmma_conversion.cu with
// FP8 RS wgmmas m64nNk32 (two per 64 x 64 weight block) instead of four BF16 m64nNk16:
//
//   CONV 0  no ALU: the 16 loaded bytes reused as the 8 A registers (the tensor pipe's ceiling
//           with RS wgmmas, shared-memory loads and the unit loop);
//   CONV 1  from today's sm90 word layout: decode_word_bits (BF16 bit positions), moved to FP16
//           positions (E2M1 x 2^-14), one HMUL2 by the folded scale pair 2^(14 + d), then
//           cvt.rn.satfinite.e4m3x2.f16x2 and a pack (no new weight layout);
//   CONV 2  a layout made for the conversion: each 16-bit half of a word holds 4 E2M1 codes of one
//           row (sign in bit 3 of each nibble); a PRMT table lookup per half (the table: the 8
//           E4M3 magnitudes of the codes at the block's scale offset d, OR 0x80, read from a
//           256-entry table in shared memory by scale byte), a second PRMT whose sign mode gives
//           0xFF / 0x80 per byte, and one LOP3 that keeps the magnitude and sets the sign.
//   PROMO 0 no promotion: one accumulator over the whole K (Hopper's FP8 MMA keeps about 14 bits
//           while accumulating: not accurate enough; the ceiling of the promotion variants);
//   PROMO 1 per 128 of K (two blocks): the wgmmas of a group start from zero, then
//           total += acc * token_scale (FFMA per accumulator, the scale of each token column from
//           shared memory): per-128 activation scales;
//   PROMO 2 per 32 of K (each wgmma): the same after every k32 step: the contract's per-32
//           activation scales kept as they are;
//   PROMO 4 per 512 of K (eight blocks), total += acc (FADD): one scale per token row, promotion
//           only for the accumulator's precision;
//   PROMO 5 per 128 of K, FADD (the same with one scale per token row);
//   PROMO 3 per 128 of K with two accumulator sets: group g's wgmmas go to set g % 2 while the
//           FFMAs promote set (g - 1) % 2 (the promotion overlaps the warpgroup's own wgmmas,
//           N / 2 more registers).
//
// Tensor util = ideal / measured cycles, ideal = MACs / 4096 per SM cycle (dense FP8). Build:
// the CMake target megamoe_micro_wgmma_fp8, or
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Ikernels -Iinclude bench/micro/wgmma_fp8.cu -o wgmma_fp8
#include "micro_common.cuh"
#include "ptx/sm90_wgmma_e4m3_rs.cuh"

using namespace megamoe;

namespace {

constexpr int NWG = 2;

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ uint32_t hmul2_f16(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Two FP16 values (one f16x2 register) to two E4M3 bytes (low 16 bits).
__device__ __forceinline__ uint32_t cvt_e4m3x2(uint32_t f16x2) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d) : "r"(f16x2));
  return d;
}

template <int N, int CONV, int PROMO>
__global__ void __launch_bounds__(128 * NWG, 1) kern(const uint32_t* gw, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* b_tile = smem;  // N rows x 128 B: k128 of FP8 (two units' worth)
  uint32_t* words = reinterpret_cast<uint32_t*>(smem + micro::b_tile_bytes(N));
  uint32_t* tables = words + micro::word_bytes(NWG) / 4;  // [256][2]
  float* token_scales = reinterpret_cast<float*>(tables + 512);  // [4][N]
  micro::fill(b_tile, N, words, NWG, gw);
  for (int i = threadIdx.x; i < 512; i += blockDim.x) tables[i] = (gw[i] & 0x7F7F7F7Fu) | 0x80808080u;
  for (int i = threadIdx.x; i < 4 * N; i += blockDim.x) token_scales[i] = 1.0f + (gw[i] & 7) * 0.125f;
  __syncthreads();
  const int tid = threadIdx.x;
  const int wg = tid / 128, t = tid % 128;
  const micro::Addrs addrs = micro::thread_addrs(words, NWG, wg, t);
  const uint32_t desc_b = ptx::smem_desc_k128b_lo(b_tile);
  const uint32_t tab_base = ptx::smem_addr(tables);
  const float* tsc = token_scales + 2 * (t % 4);
  constexpr int kAccSets = PROMO == 3 ? 2 : 1;
  float accs[kAccSets][N / 2];
  float* acc = accs[0];
  float tot[PROMO ? N / 2 : 1];
#pragma unroll
  for (int a = 0; a < kAccSets; ++a)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) accs[a][i] = 0.f;
#pragma unroll
  for (int i = 0; i < (PROMO ? N / 2 : 1); ++i) tot[i] = 0.f;
  uint32_t fr[2][2][4];  // [set][k32 step][register]

  auto produce = [&](int set, int blk) {
    const uint4 wv = ptx::ld_shared_v4_at(addrs.words + blk * 2048);
    const uint32_t sfw = ptx::ld_shared_u32_at(addrs.sf);
    const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
    if constexpr (CONV == 0) {
#pragma unroll
      for (int r = 0; r < 8; ++r) fr[set][r / 4][r % 4] = ws[r % 4];
    } else if constexpr (CONV == 1) {
      // Folded FP16 scale pairs 2^(14 + d) per (row half, scale group); d from the scale byte.
      uint32_t sc[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t e = ((sfw >> (8 * (2 * h + j))) & 7u) + 20u;  // exponent field 20..27
          sc[h][j] = (e << 10) | (e << 26);
        }
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t bits[4], h16[4];
        sm90_layout::decode_word_bits(ws[w], bits);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t f = (bits[i] & 0x80008000u) | ((bits[i] << 3) & 0x0E000E00u);
          h16[i] = cvt_e4m3x2(hmul2_f16(f, sc[i & 1][w / 2]));
        }
        // word w (k16 step w of the BF16 layout) -> registers 2 (w % 2), 2 (w % 2) + 1 of k32 step w / 2
        fr[set][w / 2][2 * (w % 2)] = h16[0] | (h16[2] << 16);
        fr[set][w / 2][2 * (w % 2) + 1] = h16[1] | (h16[3] << 16);
      }
    } else {
      // Tables per (row half, scale group): 8 bytes from the 256-entry table by scale byte.
      uint32_t tab[2][2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t byte = (sfw >> (8 * (2 * h + j))) & 0xFFu;
          const uint2 v = ptx::ld_shared_v2_at(tab_base + byte * 8);
          tab[h][j][0] = v.x;
          tab[h][j][1] = v.y;
        }
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int j = w / 2;
        const uint32_t lo = ws[w], hi = ws[w] >> 16;
        const uint32_t z0 = prmt(tab[0][j][0], tab[0][j][1], lo & 0x7777u);
        const uint32_t z1 = prmt(tab[1][j][0], tab[1][j][1], hi & 0x7777u);
        const uint32_t p0 = prmt(0x80808080u, 0x80808080u, lo);
        const uint32_t p1 = prmt(0x80808080u, 0x80808080u, hi);
        // bits 0..6: the magnitude; bit 7: 0x80 of z and the sign (bit 6 of p, 0xFF / 0x80)
        uint32_t r0, r1;
        asm("lop3.b32 %0, %1, %2, %3, 0xE0;" : "=r"(r0) : "r"(z0), "r"(p0 << 1), "r"(0x7F7F7F7Fu));
        asm("lop3.b32 %0, %1, %2, %3, 0xE0;" : "=r"(r1) : "r"(z1), "r"(p1 << 1), "r"(0x7F7F7F7Fu));
        fr[set][j][2 * (w % 2)] = r0;
        fr[set][j][2 * (w % 2) + 1] = r1;
      }
    }
  };
  // k32 step s of unit u: 32 bytes (2 descriptor units) into the 128-byte rows, 64 per unit.
  auto issue_to = [&](float* d, int set, int u, int s, uint32_t scale_d) {
    ptx::WgmmaE4m3RS<N>::template mma_lo<ptx::kSmemDescK128bHi>(
        d, fr[set][s], desc_b + static_cast<uint32_t>(4 * (u & 1) + 2 * s), scale_d);
  };
  auto issue = [&](int set, int u, int s, uint32_t scale_d) { issue_to(acc, set, u, s, scale_d); };
  auto promote_from = [&](const float* acc, int group) {
    if constexpr (PROMO != 0) {
      const float* g = tsc + (group & 3) * N;
#pragma unroll
      for (int p = 0; p < N / 8; ++p) {
        const float2 s2 = *reinterpret_cast<const float2*>(g + 8 * p);
        tot[4 * p + 0] = fmaf(acc[4 * p + 0], s2.x, tot[4 * p + 0]);
        tot[4 * p + 1] = fmaf(acc[4 * p + 1], s2.y, tot[4 * p + 1]);
        tot[4 * p + 2] = fmaf(acc[4 * p + 2], s2.x, tot[4 * p + 2]);
        tot[4 * p + 3] = fmaf(acc[4 * p + 3], s2.y, tot[4 * p + 3]);
      }
    }
  };
  auto promote = [&](int group) {
    if constexpr (PROMO == 4 || PROMO == 5) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) tot[i] += acc[i];
    } else {
      promote_from(acc, group);
    }
  };
  // PROMO 3: unit u of a group on accumulator set a; the group's first unit also promotes the
  // other set (the previous group's finished sums) while its own wgmmas run.
  auto unit_db = [&](int set, int u, float* mine, const float* other) {
    ptx::wgmma_fence();
    const uint32_t first = (u & 1) == 0 ? 0u : 1u;
    issue_to(mine, set, u, 0, first);
    issue_to(mine, set, u, 1, 1u);
    ptx::wgmma_commit();
    if ((u & 1) == 0) promote_from(other, u / 2 + 1);
    produce(set ^ 1, (u + 1) & 1);
    ptx::wgmma_wait<0>();
  };
  // One unit (a 64 x 64 block: two k32 wgmmas) on register set `set`, the next unit's registers
  // produced into the other set while they run.
  auto unit = [&](int set, int u) {
    if constexpr (PROMO == 2) {
      ptx::wgmma_fence();
      issue(set, u, 0, 0u);
      ptx::wgmma_commit();
      produce(set ^ 1, (u + 1) & 1);
      ptx::wgmma_wait<0>();
      promote(2 * u);
      ptx::wgmma_fence();
      issue(set, u, 1, 0u);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      promote(2 * u + 1);
    } else {
      // Units per promotion group: 2 (k128) or 8 (k512).
      constexpr int kGroup = PROMO == 4 ? 8 : 2;
      ptx::wgmma_fence();
      const uint32_t first = PROMO != 0 && (u % kGroup) == 0 ? 0u : 1u;
      issue(set, u, 0, first);
      issue(set, u, 1, 1u);
      ptx::wgmma_commit();
      produce(set ^ 1, (u + 1) & 1);
      ptx::wgmma_wait<0>();
      if (PROMO != 0 && (u % kGroup) == kGroup - 1) promote(u / kGroup);
    }
  };
  produce(0, 0);
  asm volatile("bar.sync %0, %1;" ::"r"(1 + wg), "r"(128));
  const long long t0 = clock64();
  if constexpr (PROMO == 3) {
#pragma unroll 1
    for (int u = 0; u < micro::kUnits; u += 4) {
      unit_db(0, u, accs[0], accs[kAccSets - 1]);
      unit_db(1, u + 1, accs[0], accs[kAccSets - 1]);
      unit_db(0, u + 2, accs[kAccSets - 1], accs[0]);
      unit_db(1, u + 3, accs[kAccSets - 1], accs[0]);
    }
  } else {
#pragma unroll 1
    for (int u = 0; u < micro::kUnits; u += 2) {
      unit(0, u);
      unit(1, u + 1);
    }
  }
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += accs[0][i] + accs[kAccSets - 1][i];
#pragma unroll
  for (int i = 0; i < (PROMO ? N / 2 : 1); ++i) s += tot[i];
  uint32_t x = 0;
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) x ^= fr[a][b][c];
  if (s == 1234.5f || x == 0x12345u) sink[tid] = s;
  if (t == 0) cycles[blockIdx.x * NWG + wg] = t1 - t0;
}

template <int N, int CONV, int PROMO>
void run() {
  static const char* conv[] = {"no ALU", "f16+cvt (sm90 layout)", "prmt table (new layout)"};
  static const char* promo[] = {"no promotion", "promote/128", "promote/32", "promote/128 2 acc",
                                "FADD/512", "FADD/128"};
  char label[96];
  std::snprintf(label, sizeof label, "e4m3 %s, %s", conv[CONV], promo[PROMO]);
  const int smem = micro::b_tile_bytes(N) + micro::word_bytes(NWG) + 512 * 4 + 4 * N * 4;
  micro::report(kern<N, CONV, PROMO>, smem, NWG, N, label, micro::kUnits, 4096.0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && argv[1][0] == 'f') {  // one scale per token row: FADD promotion
    for (int rep = 0; rep < 2; ++rep) {
      run<128, 0, 4>(); run<128, 1, 4>(); run<128, 2, 4>(); run<128, 1, 5>();
      run<192, 0, 4>(); run<192, 1, 4>(); run<192, 2, 4>(); run<192, 1, 5>(); run<192, 1, 0>();
      run<256, 0, 4>(); run<256, 1, 4>(); run<256, 2, 4>();
    }
    return 0;
  }
  if (argc > 1) {  // the double-buffered promotion only
    for (int rep = 0; rep < 2; ++rep) {
      run<96, 0, 1>(); run<96, 0, 3>(); run<96, 1, 3>(); run<96, 2, 3>();
      run<128, 0, 3>(); run<128, 1, 3>(); run<128, 2, 3>();
      run<160, 0, 3>(); run<160, 1, 3>(); run<160, 2, 3>();
      run<160, 0, 1>(); run<160, 1, 1>(); run<160, 2, 1>();
    }
    return 0;
  }
  for (int rep = 0; rep < 2; ++rep) {
    run<128, 0, 0>(); run<128, 1, 0>(); run<128, 2, 0>();
    run<128, 0, 1>(); run<128, 1, 1>(); run<128, 2, 1>();
    run<128, 0, 2>(); run<128, 1, 2>(); run<128, 2, 2>();
    run<192, 0, 0>(); run<192, 1, 0>(); run<192, 2, 0>();
    run<192, 0, 1>(); run<192, 1, 1>(); run<192, 2, 1>();
    run<192, 0, 2>(); run<192, 2, 2>();
    run<256, 0, 0>(); run<256, 1, 0>(); run<256, 2, 0>();
  }
  return 0;
}
