// "blackwell-interop": the layout DeepGEMM's SM100 fp8_fp4_mega_moe kernel consumes
// (weights.md section 3; diagrams and formulas in docs/layouts.md).
//
//   w13      rows interleaved in groups of 8 (rule 2)
//   w13_sf   rows interleaved (rule 2), then transposed within 128-row blocks (rule 3), then
//            packed 4 K-groups per int32, MN-major (rule 1)
//   w2       unchanged (rule 4)
//   w2_sf    rows transposed within 128-row blocks (rule 3), packed MN-major (rule 1)
//   w13_bias rows interleaved like w13 (the kernel takes no bias; this keeps rows matched)
//   w2_bias  unchanged
//
// Padding: rule 3 works on whole 128-row blocks, so the scale rows (N = 2I for L1, N = H for L2;
// GPT-OSS has H = 2880) are padded to align(N, 128) with zero bytes, as rule 1 already pads K
// to whole int32 of 4 groups. The inverse reads only the real rows back, so it stays exact.
//
// Every transform below is written as "prepared row p reads canonical row source_row(p)"; the
// forward copies canonical -> prepared along that map and the inverse copies back along the
// same map, so the two are exact inverses of each other by construction. The tests check both
// against an independently written formula (tests/cpp/test_prep_layouts.cpp).
#include <cstring>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "prep/layouts.hpp"

namespace megamoe::prep {

namespace {

constexpr int64_t kInterleaveRows = 8;      // rule 2: gate/up alternate in groups of 8 rows
constexpr int64_t kUtccpBlockRows = 128;    // rule 3: scale rows transposed in 128-row blocks
constexpr int64_t kUtccpRowGroups = 4;      //   old row 32a + b -> new row 4b + a, a < 4
constexpr int64_t kUtccpRowsPerGroup = 32;  //   b < 32
constexpr int64_t kGroupsPerPack = 4;       // rule 1: 4 UE8M0 bytes per int32, group 4j lowest
constexpr int64_t kPackBytes = 4;           //   sizeof(int32)
constexpr int64_t kMnAlignment = 4;         //   MN-major stride align(N, 4)
constexpr int64_t kE2m1PerByte = 2;
constexpr int64_t kBf16Bytes = 2;
static_assert(kUtccpRowGroups * kUtccpRowsPerGroup == kUtccpBlockRows);
static_assert(kGroupsPerPack == kPackBytes);

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Rule 2: prepared row p of the interleaved L1 reads canonical row (gate [0, I), up [I, 2I)).
int64_t interleaved_source_row(int64_t p, int64_t intermediate) {
  const int64_t pair = p / (2 * kInterleaveRows);
  const int64_t r = p % (2 * kInterleaveRows);
  return r < kInterleaveRows ? pair * kInterleaveRows + r
                             : intermediate + pair * kInterleaveRows + (r - kInterleaveRows);
}

// Rule 3: prepared row p = 4b + a of a 128-row block reads row 32a + b of the same block.
int64_t utccp_source_row(int64_t p) {
  const int64_t block = p / kUtccpBlockRows;
  const int64_t within = p % kUtccpBlockRows;
  const int64_t a = within % kUtccpRowGroups;
  const int64_t b = within / kUtccpRowGroups;
  return block * kUtccpBlockRows + a * kUtccpRowsPerGroup + b;
}

// ---------------------------------------------------------------------------------------------
// Row permutations (w13, w13_bias)
// ---------------------------------------------------------------------------------------------
template <bool kForward>
void permute_l1_rows(const uint8_t* src, uint8_t* dst, int64_t num_experts, int64_t row_bytes,
                     int64_t intermediate) {
  const int64_t rows = 2 * intermediate;
  const int64_t expert_bytes = rows * row_bytes;
  for (int64_t e = 0; e < num_experts; ++e) {
    const uint8_t* s = src + e * expert_bytes;
    uint8_t* d = dst + e * expert_bytes;
    for (int64_t p = 0; p < rows; ++p) {
      const int64_t c = interleaved_source_row(p, intermediate);
      if (kForward) std::memcpy(d + p * row_bytes, s + c * row_bytes, row_bytes);
      else std::memcpy(d + c * row_bytes, s + p * row_bytes, row_bytes);
    }
  }
}

void w13_forward(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  permute_l1_rows<true>(src, dst, n, d.hidden / kE2m1PerByte, d.intermediate);
}
void w13_inverse(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  permute_l1_rows<false>(src, dst, n, d.hidden / kE2m1PerByte, d.intermediate);
}
void w13_bias_forward(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  permute_l1_rows<true>(src, dst, n, kBf16Bytes, d.intermediate);
}
void w13_bias_inverse(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  permute_l1_rows<false>(src, dst, n, kBf16Bytes, d.intermediate);
}

// ---------------------------------------------------------------------------------------------
// Scales (w13_sf, w2_sf): rows permuted, then packed MN-major as int32 of 4 K-groups
// ---------------------------------------------------------------------------------------------
// Canonical expert: uint8 [N, G] (G = K/32). Prepared expert: int32 [ceil(G/4), align(Np, 4)]
// with Np = align(N, 128) (i.e. the int32 tensor [Np, ceil(G/4)] with strides
// (1, align(Np, 4))); byte g % 4 of int32 (g / 4, p) holds group g of canonical row
// source_row(p). Padding bytes (groups >= G, rows whose source is >= N) are zero.
int64_t padded_scale_rows(int64_t rows) { return align_up(rows, kUtccpBlockRows); }

int64_t packed_scale_bytes(int64_t rows, int64_t groups) {
  return ceil_div(groups, kGroupsPerPack) * align_up(padded_scale_rows(rows), kMnAlignment) *
         kPackBytes;
}

template <bool kForward, bool kInterleave>
void pack_scales(const uint8_t* src, uint8_t* dst, int64_t num_experts, int64_t rows,
                 int64_t groups, int64_t intermediate) {
  const int64_t canonical_bytes = rows * groups;
  const int64_t prepared_bytes = packed_scale_bytes(rows, groups);
  const int64_t padded_rows = padded_scale_rows(rows);
  const int64_t mn_stride = align_up(padded_rows, kMnAlignment);
  for (int64_t e = 0; e < num_experts; ++e) {
    const uint8_t* s = src + e * (kForward ? canonical_bytes : prepared_bytes);
    uint8_t* d = dst + e * (kForward ? prepared_bytes : canonical_bytes);
    if (kForward) std::memset(d, 0, prepared_bytes);
    for (int64_t p = 0; p < padded_rows; ++p) {
      const int64_t t = utccp_source_row(p);
      if (t >= rows) continue;  // a padding row: zero bytes, nothing to read back
      const int64_t c = kInterleave ? interleaved_source_row(t, intermediate) : t;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t packed = ((g / kGroupsPerPack) * mn_stride + p) * kPackBytes + g % kGroupsPerPack;
        if (kForward) d[packed] = s[c * groups + g];
        else d[c * groups + g] = s[packed];
      }
    }
  }
}

int64_t w13_sf_bytes(const ExpertDims& d) {
  return packed_scale_bytes(2 * d.intermediate, d.hidden / kScaleBlock);
}
int64_t w2_sf_bytes(const ExpertDims& d) {
  return packed_scale_bytes(d.hidden, d.intermediate / kScaleBlock);
}
void w13_sf_forward(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  pack_scales<true, true>(src, dst, n, 2 * d.intermediate, d.hidden / kScaleBlock, d.intermediate);
}
void w13_sf_inverse(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  pack_scales<false, true>(src, dst, n, 2 * d.intermediate, d.hidden / kScaleBlock, d.intermediate);
}
void w2_sf_forward(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  pack_scales<true, false>(src, dst, n, d.hidden, d.intermediate / kScaleBlock, d.intermediate);
}
void w2_sf_inverse(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  pack_scales<false, false>(src, dst, n, d.hidden, d.intermediate / kScaleBlock, d.intermediate);
}

}  // namespace

WeightLayout blackwell_interop_weight_layout() {
  WeightLayout layout;
  layout.name = "blackwell-interop";
  layout.description =
      "DeepGEMM SM100 fp8_fp4_mega_moe (weights.md section 3): L1 rows interleaved by 8, scales "
      "as MN-major int32 of 4 K-groups, transposed in 128-row blocks (rows padded to 128)";
  // NOTES: DeepGEMM's transform asserts mn % 128 == 0 (the kernel copies scales to tensor
  // memory 128 rows at a time); padding the scale rows serves any H, I (GPT-OSS: H = 2880).
  layout.check_dims = nullptr;
  auto& b = layout.buffers;
  b[static_cast<int>(WeightBufferKind::kW13)] = {nullptr, w13_forward, w13_inverse, nullptr, nullptr};
  b[static_cast<int>(WeightBufferKind::kW13Sf)] = {w13_sf_bytes, w13_sf_forward, w13_sf_inverse,
                                                    nullptr, nullptr};
  b[static_cast<int>(WeightBufferKind::kW2Sf)] = {w2_sf_bytes, w2_sf_forward, w2_sf_inverse,
                                                   nullptr, nullptr};
  b[static_cast<int>(WeightBufferKind::kW13Bias)] = {nullptr, w13_bias_forward, w13_bias_inverse,
                                                      nullptr, nullptr};
  // w2, w2_bias: identity (rule 4).
  return layout;
}

}  // namespace megamoe::prep
