// sm90_ptx.cuh: thin inline-PTX wrappers for the Hopper features the GEMM kernels use:
// mbarriers, bulk copies (1D cp.async.bulk and 2D tensor TMA), wgmma fences/commit/wait,
// setmaxnreg, named barriers and BF16x2 arithmetic. Written against the PTX ISA (sm_90a).
#pragma once

#include <cstdint>
#if defined(MEGAMOE_DIAG_WAIT_PRINT) && MEGAMOE_DIAG_WAIT_PRINT
#include <cstdio>
#endif

#include <cuda.h>  // CUtensorMap (a 128-byte opaque struct; no driver call is made here)

namespace megamoe::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------------------------------------
// mbarrier
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Makes initialized barriers visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// NOTES: a lost arrival would hang the GPU until the machine's command limit; instead every wait
// gives up after ~kWaitTimeoutCycles (seconds, far above any legitimate wait) and traps, so a
// broken pipeline fails loudly (the launch reports an unspecified launch failure / illegal
// instruction). No printf: any function call in a kernel that uses wgmma makes ptxas serialize
// every wgmma (C7510) and save registers around the call.
constexpr long long kWaitTimeoutCycles = 20'000'000'000ll;

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const long long start = clock64();
#if defined(MEGAMOE_DIAG_WAIT_PRINT) && MEGAMOE_DIAG_WAIT_PRINT
  bool said = false;
#endif
  while (!mbar_try_wait(bar, parity)) {
#if defined(MEGAMOE_DIAG_WAIT_PRINT) && MEGAMOE_DIAG_WAIT_PRINT
    // Diagnosis builds only: who waits where, once, after ~1 s.
    if (!said && clock64() - start > 2'000'000'000ll) {
      said = true;
      printf("[wait] block %d thread %d: mbarrier smem 0x%x parity %u\n", blockIdx.x, threadIdx.x,
             smem_addr(bar), parity);
    }
#endif
    if (clock64() - start > kWaitTimeoutCycles) __trap();
  }
}

// ---------------------------------------------------------------------------------------------
// Bulk copies, completing on an mbarrier (transaction bytes)
// ---------------------------------------------------------------------------------------------
// Contiguous global -> shared copy; bytes % 16 == 0, both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

// 2D tensor tile (box) global -> shared, coordinates {c0 (inner), c1}.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int32_t c0,
                                            int32_t c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (griddepcontrol). Both are no-ops in a grid that was not launched
// with cudaLaunchAttributeProgrammaticStreamSerialization.
// ---------------------------------------------------------------------------------------------
// Waits until the previous grid of the stream has completed and its memory operations are
// visible to this grid. Nothing written by that grid may be read, and nothing it reads may be
// written, before this returns.
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Lets the next grid of the stream (if launched programmatically) be scheduled once every CTA of
// this grid has executed it or exited; the first call in a CTA counts, later ones are no-ops.
// NOTES: every megamoe kernel that calls it does so only after its own grid_dependency_wait(),
// so a grid that starts running knows that its predecessor's predecessor has completed: the
// layer's GEMMs read row_offsets (written by dispatch, two launches back) before their own wait.
__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// L2 policy for data read exactly once (streamed weights).
__device__ __forceinline__ uint64_t policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// ---------------------------------------------------------------------------------------------
// wgmma bookkeeping (the mma instructions themselves: sm90_wgmma_bf16_rs.cuh)
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Shared-memory matrix descriptor of a K-major tile written by TMA with 128-byte swizzle:
// rows of 128 bytes (64 bf16), 8-row groups 1024 bytes apart. Bits: start address >> 4 [0,14),
// leading byte offset >> 4 [16,30) (unused for swizzled K-major; 1), stride byte offset >> 4
// [32,46), layout type [62,64) = 1 (128B swizzle).
constexpr uint32_t kSwizzleRowBytes = 128;
constexpr uint32_t kSwizzleAtomBytes = 8 * kSwizzleRowBytes;

// The two words of smem_desc_k128b: the low one depends on the address, the high one is constant.
__device__ __forceinline__ uint32_t smem_desc_k128b_lo(const void* tile) {
  return ((smem_addr(tile) & 0x3FFFFu) >> 4) | (1u << 16);
}
constexpr uint32_t kSmemDescK128bHi = (kSwizzleAtomBytes >> 4) | (1u << 30);

__device__ __forceinline__ uint64_t smem_desc_k128b(const void* tile) {
  return (static_cast<uint64_t>(kSmemDescK128bHi) << 32) | smem_desc_k128b_lo(tile);
}

// ---------------------------------------------------------------------------------------------
// Registers, barriers, fences
// ---------------------------------------------------------------------------------------------
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at named barrier `id` without waiting (the producer side of a bar.arrive / bar.sync
// pair: this thread's prior shared-memory writes are visible to the threads that sync on it).
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Device-scope counters between CTAs of one grid (the MegaMoE kernel's ready counters): a
// release add after a CTA-scope barrier publishes the stores the barrier ordered before it; an
// acquire load that sees the count makes them visible to this thread.
__device__ __forceinline__ void red_release_gpu_add(int32_t* p, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Orders this thread's generic-proxy view of global memory before its later async-proxy
// operations (TMA reads of rows that other CTAs wrote with ordinary stores).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// BF16x2 of (lo, hi), each rounded to nearest even (cvt.rn: the bits of megamoe::bf16_from_f32
// for every non-NaN input; NaN gives the canonical NaN 0x7FFF, docs/numerics.md).
__device__ __forceinline__ uint32_t cvt_bf16x2_rn(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));  // a -> upper half
  return d;
}

// E4M3x2 of (lo, hi) (lo in the low byte), round to nearest even, finite values beyond 448 and
// +-Inf saturated to +-448: the codes of megamoe::e4m3_from_f32 for every non-NaN input.
__device__ __forceinline__ uint16_t cvt_e4m3x2_satfinite(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));  // a -> upper byte
  return d;
}

// The two E4M3 codes of q (low byte first) as FP32 values (exact: E4M3 -> F16 -> F32).
__device__ __forceinline__ void e4m3x2_to_f32x2(uint16_t q, float& lo, float& hi) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(q));
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi) : "r"(h2));
}

// Stores four 8x8 b16 matrices, transposed, from the mma fragment layout (lane l holds row
// l / 4, columns 2 (l % 4) + {0, 1} of matrix j in register j): row c of the stored matrix j
// (16 bytes, 16-byte aligned) goes to the address given by lane 8 j + c.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t smem_row_addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(smem_row_addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// Loads four 8x8 b16 matrices in the mma fragment layout (lane l gets row l / 4, columns
// 2 (l % 4) + {0, 1} of matrix j in register j); lane 8 j + r gives the 16-byte aligned address
// of row r of matrix j. Volatile: never moved above the barrier wait that makes the rows valid.
__device__ __forceinline__ void ldmatrix_x4(uint32_t smem_row_addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row_addr));
}

// d += a x b, the warp-level tensor-core MMA m16n8k16 with BF16 operands and FP32 accumulators.
// Fragments: a[0..3] rows g / g + 8 (odd registers) and k 2t + {0, 1} / + 8 (registers 2, 3), the
// wgmma RS A layout of one warp's 16 rows; b0 / b1 column g, k 2t + {0, 1} / + 8; d[0..3] rows
// g / g + 8 (d[2], d[3]), columns 2t + {0, 1}, the wgmma accumulator layout of one n8 chunk.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Loads at a shared-window address (smem_addr): the mainloop keeps its per-thread offsets as
// such addresses and adds only compile-time and stage offsets per load.
__device__ __forceinline__ uint4 ld_shared_v4_at(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 ld_shared_v2_at(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t ld_shared_u32_at(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(const void* p) { return ld_shared_v4_at(smem_addr(p)); }
__device__ __forceinline__ uint32_t ld_shared_u32(const void* p) {
  return ld_shared_u32_at(smem_addr(p));
}

// The value of x, hidden from the optimizer (a volatile move is never hoisted out of a loop):
// keeps loop-invariant arithmetic on x where it is used instead of in live registers.
__device__ __forceinline__ int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// BF16x2 multiply, round to nearest (exact here: one factor is a power of two). BF16 arithmetic
// has no flush-to-zero mode, so subnormal operands and results are kept.
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// a * (h, h) where h is the low (kHigh = false) or high half of b: the broadcast is an operand
// modifier of the multiply (HMUL2 ... R.H0_H0 / R.H1_H1), not an instruction. One PTX text for
// both element types (TYPE bf16x2 or f16x2, HALF lo or hi).
#define MEGAMOE_PTX_MUL_X2_BY_HALF(TYPE, HALF)                                              \
  "{\n .reg .b16 lo, hi;\n .reg .b32 bb;\n mov.b32 {lo, hi}, %2;\n mov.b32 bb, {" HALF ", " HALF \
  "};\n mul.rn." TYPE " %0, %1, bb;\n}"

template <bool kHigh>
__device__ __forceinline__ uint32_t mul_bf16x2_by_half(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (kHigh) {
    asm(MEGAMOE_PTX_MUL_X2_BY_HALF("bf16x2", "hi") : "=r"(d) : "r"(a), "r"(b));
  } else {
    asm(MEGAMOE_PTX_MUL_X2_BY_HALF("bf16x2", "lo") : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}

// The same in f16x2 (the FP8 mode's weight conversion).
template <bool kHigh>
__device__ __forceinline__ uint32_t mul_f16x2_by_half(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (kHigh) {
    asm(MEGAMOE_PTX_MUL_X2_BY_HALF("f16x2", "hi") : "=r"(d) : "r"(a), "r"(b));
  } else {
    asm(MEGAMOE_PTX_MUL_X2_BY_HALF("f16x2", "lo") : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}

// Two FP16 values (low half first) to two E4M3 bytes in the low 16 bits, round to nearest even,
// saturating to +-448.
__device__ __forceinline__ uint32_t cvt_e4m3x2_f16x2(uint32_t f16x2) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d) : "r"(f16x2));
  return d;
}

}  // namespace megamoe::ptx
