// sm90_weight_layout.hpp: the "sm90" prepared layout of MXFP4 expert weights, shared by the host
// preparation (src/prep/sm90_layout.*) and the Hopper GEMM kernels (kernels/sm90/).
//
// The kernels compute D[M, N] = W[M, K] * X[N, K]^T with wgmma m64nNk16, the weight as the A
// operand FROM REGISTERS (converted E2M1 x 2^s -> BF16 in registers) and the token rows as the B
// operand from shared memory (swap A/B, as for mixed-input GEMMs). The layout puts every A
// fragment a thread needs for one 64x64 (rows x k) block in 16 consecutive bytes:
//
//   matrix [M, K] of one expert (M % 64 == 0, K % 64 == 0)
//   -> blocks [M/64 (mb)][K/64 (kb)], each 2048 bytes = 128 threads x 16 bytes
//      thread (0..127) = 32 * warp + 4 * g + t  (warp of the warpgroup, g = lane/4, t = lane%4)
//      its 16 bytes = 4 words, word s = the k16 step s of the block (k = 64 kb + 16 s + ...)
//      word s holds the 8 E2M1 codes of the thread's 4 A registers i (0..3), elements e (0/1):
//         register i: row  16 warp + g + 8 (i & 1)      (wgmma A fragment, m64k16 bf16)
//                     cols 16 s + 2 t + 8 (i >> 1) + e
//      with the code bits scattered over the word so that one shift (or rotation) and one mask
//      put each register's sign and magnitude bits at their BF16 positions (decode_word_bits,
//      the bit table is in docs/layouts-sm90.md).
//   scales [M/64][K/64], each 128 bytes: byte 4 (8 warp + g) + 2 half + j = scale of
//      row 16 warp + g + 8 half, k group 2 kb + j. A thread reads its 4 scale bytes as one word.
//
// L1 (w13, M = 2I): rows are first interleaved in groups of 8 so one warp's 16-row slice holds
// gate rows 8q..8q+7 (rows g) and the matching up rows (rows g + 8): prepared row 16q + r is
// gate row 8q + r (r < 8), prepared row 16q + 8 + r is up row 8q + r. One 64-row block then
// holds exactly the 32 intermediate channels [32 mb, 32 mb + 32): one requantization group.
// L2 (w2, M = H): no row permutation.
//
// Everything here is a pure index permutation of nibbles and scale bytes: the prepared buffers
// have exactly the canonical byte sizes and the transform has an exact inverse.
#pragma once

#include <cstdint>

#include "megamoe/formats.hpp"

namespace megamoe::sm90_layout {

constexpr int kBlockRows = 64;                                  // wgmma M: one warpgroup
constexpr int kBlockK = 64;                                     // 4 wgmma k16 steps
constexpr int kStepK = 16;                                      // wgmma K for bf16
constexpr int kStepsPerBlock = kBlockK / kStepK;                // 4 words per thread
constexpr int kThreadsPerBlock = 128;                           // one warpgroup
constexpr int kThreadBytes = kStepsPerBlock * 4;                // 16: one 128-bit load
constexpr int kBlockBytes = kBlockRows * kBlockK / 2;           // 2048
constexpr int kSfBlockBytes = kBlockRows * kBlockK / kScaleBlock;  // 128
constexpr int kInterleave = 8;                                  // gate/up group size
constexpr int kRowAlign = 64;                                   // M % 64 == 0
constexpr int kColAlign = 64;                                   // K % 64 == 0

static_assert(kThreadsPerBlock * kThreadBytes == kBlockBytes, "one 16-byte load per thread");
static_assert(kBlockK == 2 * kScaleBlock, "a block spans two scale groups (j = 0, 1)");

// FP8 mode: where column k (0..31) of a 32-group of a token row is stored in the E4M3 rows the
// FP8 tiles read (the slot of the wgmma k32 step). The weights' A registers come from the BF16
// fragment layout above, in which thread t holds columns 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of each
// 16 (sm90_gemm_mainloop.cuh, load_convert_block_fp8); the k32 A fragment gives it slots
// 4 t .. 4 t + 3, so slot 4 t + b holds column 2 t + (b & 1) + 8 (b >> 1) (and + 16). Both operands
// are permuted alike, so the products pair up as in the unpermuted GEMM.
MEGAMOE_HD int fp8_row_slot(int k) {
  return (k & 16) | (((k & 7) >> 1) << 2) | (((k >> 3) & 1) << 1) | (k & 1);
}

// ---------------------------------------------------------------------------------------------
// Row permutation of L1 (gate/up interleave) and its inverse. I = intermediate.
// ---------------------------------------------------------------------------------------------
MEGAMOE_HD int64_t w13_canonical_row(int64_t prepared_row, int64_t intermediate) {
  const int64_t q = prepared_row / (2 * kInterleave);
  const int64_t r = prepared_row % (2 * kInterleave);
  return r < kInterleave ? q * kInterleave + r : intermediate + q * kInterleave + (r - kInterleave);
}

MEGAMOE_HD int64_t w13_prepared_row(int64_t canonical_row, int64_t intermediate) {
  const bool up = canonical_row >= intermediate;
  const int64_t j = up ? canonical_row - intermediate : canonical_row;
  return (j / kInterleave) * 2 * kInterleave + (up ? kInterleave : 0) + j % kInterleave;
}

// Canonical row of prepared row p for either matrix.
MEGAMOE_HD int64_t canonical_row(bool interleave, int64_t p, int64_t intermediate) {
  return interleave ? w13_canonical_row(p, intermediate) : p;
}

// ---------------------------------------------------------------------------------------------
// Word-level description: prepared word index -> the 4 canonical bytes it is built from.
// Word index within one expert's matrix: ((mb * KB + kb) * 128 + thread) * 4 + s, KB = K / 64.
// Canonical byte (row, k/2) holds k (low nibble) and k+1 (high nibble): elements e = 0, 1 of one
// A register.
// ---------------------------------------------------------------------------------------------
struct WordSource {
  int64_t row[4];        // canonical row of register i
  int64_t byte_col[4];   // canonical byte column (k / 2) of register i
};

MEGAMOE_HD WordSource word_source(int64_t word, int64_t cols, bool interleave,
                                  int64_t intermediate) {
  const int64_t kb_count = cols / kBlockK;
  const int s = static_cast<int>(word % kStepsPerBlock);
  const int thread = static_cast<int>((word / kStepsPerBlock) % kThreadsPerBlock);
  const int64_t block = word / (kStepsPerBlock * kThreadsPerBlock);
  const int64_t mb = block / kb_count;
  const int64_t kb = block % kb_count;
  const int warp = thread / 32, g = (thread % 32) / 4, t = thread % 4;
  WordSource src;
  for (int i = 0; i < 4; ++i) {
    const int64_t p = mb * kBlockRows + 16 * warp + g + 8 * (i & 1);
    const int64_t k = kb * kBlockK + kStepK * s + 2 * t + 8 * (i >> 1);  // even: element e = 0
    src.row[i] = canonical_row(interleave, p, intermediate);
    src.byte_col[i] = k / 2;
  }
  return src;
}

// ---------------------------------------------------------------------------------------------
// Bits of a prepared word. The decoded form of A register i is a BF16x2 bit pattern with each
// half's E2M1 sign at bit 15 and its magnitude bits e1 e0 m at bits 8..6 (kE2m1Bits): read as
// BF16 it equals the E2M1 value times 2^-126 (codes 0/1 become BF16 subnormals, which BF16
// arithmetic keeps), and one exact multiply by the block scale (see below) finishes it.
// The word stores those 32 bits so that each register takes 2 integer instructions (register 3
// takes 3): no single translate of the 8-bit pattern per register tiles a word (exhaustive
// search), three translates do (shift left 4, rotate right 2, rotate right 6) and the remaining
// 8 bits are in place but for one bit per half (shift left 8).
//   a0 = (w << 4) & kE2m1Bits
//   a1 = rotr(w, 2) & kE2m1Bits
//   a2 = rotr(w, 6) & kE2m1Bits
//   a3 = (w & kA3InPlace) | ((w << 8) & kA3Shifted)
// NOTES: why: the previous placement (nibble i + 4e whole) took ~19 integer and multiply
// instructions per word where this takes 13 with the multiplies; in decode the conversion's
// integer instructions are the busiest pipe (docs/perf.md).
// ---------------------------------------------------------------------------------------------
constexpr uint32_t kE2m1Bits = 0x81C081C0u;   // BF16 bits 15, 8..6 of both halves
constexpr uint32_t kA3InPlace = 0x80C080C0u;  // a3: sign, e0, m stored where they decode
constexpr uint32_t kA3Shifted = 0x01000100u;  // a3: e1, stored 8 bits lower (bits 0 and 16)

// rotr(w, n), 0 < n < 32. On the GPU one funnel shift (SHF.R.W).
// NOTES: why not a 32 x 32 -> 64-bit multiply by 2^(32 - n) (IMAD.WIDE, high word | low word in
// the caller's LOP3), chosen earlier to move work from the integer to the FMA pipe: with RS
// wgmmas in flight, a micro-benchmark of the prefill loop (bench/micro/wgmma_conversion.cu, two
// math warpgroups, m64n80k16) keeps the tensor pipe 65-67 % busy with the IMAD.WIDE rotations and
// 73-83 % with funnel shifts (by the order ptxas gives the same instructions); 48 IMAD.WIDE per
// unit alone hold it at 39-40 %. The GEMMs: 1.02-1.12x at every shape and token count
// (docs/tuning-log.md).
MEGAMOE_HD uint32_t rotr32(uint32_t w, int n) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(w, w, n);
#else
  return (w >> n) | (w << (32 - n));
#endif
}

// The four A registers of a word as kE2m1Bits patterns (the GEMM mainloop's decoding).
MEGAMOE_HD void decode_word_bits(uint32_t w, uint32_t (&a)[4]) {
  a[0] = (w << 4) & kE2m1Bits;
  a[1] = rotr32(w, 2) & kE2m1Bits;
  a[2] = rotr32(w, 6) & kE2m1Bits;
  a[3] = (w & kA3InPlace) | ((w << 8) & kA3Shifted);
}

// The kE2m1Bits pattern of one E2M1 code (one BF16 half) and back.
MEGAMOE_HD uint32_t e2m1_code_bits(uint32_t code) {
  return ((code & 7u) << 6) | ((code & 8u) << 12);
}
MEGAMOE_HD uint32_t e2m1_bits_code(uint32_t bits) {
  return ((bits >> 6) & 7u) | ((bits >> 12) & 8u);
}

// Word of the 4 canonical bytes of registers 0..3 (the inverse of decode_word_bits).
MEGAMOE_HD uint32_t pack_word(const uint8_t bytes[4]) {
  uint32_t a[4];
  for (int i = 0; i < 4; ++i) {
    a[i] = e2m1_code_bits(bytes[i] & 0xFu) | (e2m1_code_bits(bytes[i] >> 4) << 16);
  }
  const uint32_t a1 = (a[1] << 2) | (a[1] >> 30);  // rotl(a1, 2)
  const uint32_t a2 = (a[2] << 6) | (a[2] >> 26);  // rotl(a2, 6)
  return (a[0] >> 4) | a1 | a2 | (a[3] & kA3InPlace) | ((a[3] & kA3Shifted) >> 8);
}

// Canonical byte of register i (low nibble = element 0).
MEGAMOE_HD uint8_t unpack_word_byte(uint32_t w, int i) {
  uint32_t a[4];
  decode_word_bits(w, a);
  return static_cast<uint8_t>(e2m1_bits_code(a[i] & 0xFFFFu) | (e2m1_bits_code(a[i] >> 16) << 4));
}

// Prepared scale byte index (within one expert) -> canonical (row, k group).
MEGAMOE_HD void scale_source(int64_t index, int64_t cols, bool interleave, int64_t intermediate,
                             int64_t* row, int64_t* group) {
  const int64_t kb_count = cols / kBlockK;
  const int within = static_cast<int>(index % kSfBlockBytes);
  const int64_t block = index / kSfBlockBytes;
  const int64_t mb = block / kb_count, kb = block % kb_count;
  const int lane_group = within / 4;  // 8 warp + g
  const int warp = lane_group / 8, g = lane_group % 8;
  const int half = (within % 4) / 2, j = within % 2;
  const int64_t p = mb * kBlockRows + 16 * warp + g + 8 * half;
  *row = canonical_row(interleave, p, intermediate);
  *group = kb * 2 + j;
}

// ---------------------------------------------------------------------------------------------
// Scaling the decoded registers (the GEMM mainloops): the overlapped configs take weights whose
// scale bytes are all < 128 (GemmParams::small_scales), where one exact multiply by 2^(b - 1)
// gives E2M1 x 2^(b - 127); the serial configs multiply twice, by 2^126 and then by the scale
// 2^(b - 127) (2^(b - 1) exceeds the BF16 range for b > 128: legal, if unusual, weight scales).
// ---------------------------------------------------------------------------------------------
constexpr uint32_t kDecodeUnscale = 0x7E807E80u;  // BF16x2 (2^126, 2^126)
// Folded decoding for scale bytes b < 128 (every real checkpoint's weights are far below 6):
// one multiply by the BF16 2^(b - 1) = 2^126 x 2^(b - 127), exponent field b + 126.
constexpr uint32_t kScaleHighBits = 0x80808080u;   // set in a scale byte >= 128 (not foldable)
constexpr uint32_t kFoldedScaleBias = 0x3F003F00u; // (126 << 7) in both BF16 halves

// BF16 bits of the UE8M0 scale 2^(b - 127) (exact for every b; 0xFF -> NaN).
MEGAMOE_HD uint32_t scale_bf16_bits(uint32_t b) {
  if (b == kUe8m0NaN) return 0x7FC0u;
  if (b >= 1) return b << 7;
  return 0x0040u;  // 2^-127: a BF16 subnormal
}

}  // namespace megamoe::sm90_layout
