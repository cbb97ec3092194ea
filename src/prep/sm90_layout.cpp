// sm90_layout.cpp: host side of the "sm90" layout (see sm90_layout.hpp) and its registration.
#include "prep/sm90_layout.hpp"

#include <cstring>

#include "layout/sm90_weight_layout.hpp"
#include "megamoe/error.hpp"

namespace megamoe {
namespace {

namespace L = sm90_layout;

struct MatrixShape {
  int64_t rows, cols;
  bool interleave;
};

MatrixShape shape_of(Sm90Matrix which, const ExpertDims& d) {
  if (which == Sm90Matrix::kW13) return {2 * d.intermediate, d.hidden, true};
  return {d.hidden, d.intermediate, false};
}

// Canonical -> prepared (forward) or back, for num_experts consecutive experts.
void host_weights(bool forward, const MatrixShape& m, int64_t intermediate, const uint8_t* src,
                  uint8_t* dst, int64_t num_experts) {
  const int64_t expert_bytes = m.rows * m.cols / 2;
  const int64_t words = expert_bytes / 4;
  for (int64_t e = 0; e < num_experts; ++e) {
    const uint8_t* s = src + e * expert_bytes;
    uint8_t* d = dst + e * expert_bytes;
    for (int64_t wi = 0; wi < words; ++wi) {
      const L::WordSource ws = L::word_source(wi, m.cols, m.interleave, intermediate);
      if (forward) {
        uint8_t bytes[4];
        for (int i = 0; i < 4; ++i) bytes[i] = s[ws.row[i] * (m.cols / 2) + ws.byte_col[i]];
        const uint32_t w = L::pack_word(bytes);
        std::memcpy(d + 4 * wi, &w, 4);  // little endian, as the GPU reads it
      } else {
        uint32_t w;
        std::memcpy(&w, s + 4 * wi, 4);
        for (int i = 0; i < 4; ++i) d[ws.row[i] * (m.cols / 2) + ws.byte_col[i]] = L::unpack_word_byte(w, i);
      }
    }
  }
}

void host_scales(bool forward, const MatrixShape& m, int64_t intermediate, const uint8_t* src,
                 uint8_t* dst, int64_t num_experts) {
  const int64_t groups = m.cols / kScaleBlock;
  const int64_t expert_bytes = m.rows * groups;
  for (int64_t e = 0; e < num_experts; ++e) {
    const uint8_t* s = src + e * expert_bytes;
    uint8_t* d = dst + e * expert_bytes;
    for (int64_t idx = 0; idx < expert_bytes; ++idx) {
      int64_t row, group;
      L::scale_source(idx, m.cols, m.interleave, intermediate, &row, &group);
      if (forward) d[idx] = s[row * groups + group];
      else d[row * groups + group] = s[idx];
    }
  }
}

void check_sm90_dims(const ExpertDims& d) {
  MEGAMOE_CHECK(d.hidden > 0 && d.hidden % L::kColAlign == 0, ErrorCode::kUnsupported,
                "sm90 layout: hidden: expected a positive multiple of ", L::kColAlign, ", got ",
                d.hidden);
  MEGAMOE_CHECK(d.intermediate > 0 && d.intermediate % L::kColAlign == 0,
                ErrorCode::kUnsupported, "sm90 layout: intermediate: expected a positive multiple of ",
                L::kColAlign, ", got ", d.intermediate);
}

template <Sm90Matrix kWhich, bool kForward>
void weights_transform(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  host_weights(kForward, shape_of(kWhich, d), d.intermediate, src, dst, n);
}
template <Sm90Matrix kWhich, bool kForward>
void scales_transform(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d) {
  host_scales(kForward, shape_of(kWhich, d), d.intermediate, src, dst, n);
}

#if defined(MEGAMOE_WITH_CUDA)
template <Sm90Matrix kWhich, bool kForward>
void weights_transform_device(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d,
                              void* stream) {
  const MatrixShape m = shape_of(kWhich, d);
  sm90_prep_detail::device_weights(kForward, m.interleave, src, dst, n, m.rows, m.cols,
                                   d.intermediate, stream);
}
template <Sm90Matrix kWhich, bool kForward>
void scales_transform_device(const uint8_t* src, uint8_t* dst, int64_t n, const ExpertDims& d,
                             void* stream) {
  const MatrixShape m = shape_of(kWhich, d);
  sm90_prep_detail::device_scales(kForward, m.interleave, src, dst, n, m.rows, m.cols,
                                  d.intermediate, stream);
}
#endif

template <Sm90Matrix kWhich>
BufferTransform weight_buffer_transform() {
  BufferTransform t;
  t.forward = &weights_transform<kWhich, true>;
  t.inverse = &weights_transform<kWhich, false>;
#if defined(MEGAMOE_WITH_CUDA)
  t.forward_device = &weights_transform_device<kWhich, true>;
  t.inverse_device = &weights_transform_device<kWhich, false>;
#endif
  return t;
}

template <Sm90Matrix kWhich>
BufferTransform scale_buffer_transform() {
  BufferTransform t;
  t.forward = &scales_transform<kWhich, true>;
  t.inverse = &scales_transform<kWhich, false>;
#if defined(MEGAMOE_WITH_CUDA)
  t.forward_device = &scales_transform_device<kWhich, true>;
  t.inverse_device = &scales_transform_device<kWhich, false>;
#endif
  return t;
}

}  // namespace

void sm90_prepare_expert(Sm90Matrix which, const ExpertDims& dims, const uint8_t* w,
                         const uint8_t* sf, uint8_t* w_out, uint8_t* sf_out) {
  check_sm90_dims(dims);
  host_weights(true, shape_of(which, dims), dims.intermediate, w, w_out, 1);
  host_scales(true, shape_of(which, dims), dims.intermediate, sf, sf_out, 1);
}

void sm90_unprepare_expert(Sm90Matrix which, const ExpertDims& dims, const uint8_t* w,
                           const uint8_t* sf, uint8_t* w_out, uint8_t* sf_out) {
  check_sm90_dims(dims);
  host_weights(false, shape_of(which, dims), dims.intermediate, w, w_out, 1);
  host_scales(false, shape_of(which, dims), dims.intermediate, sf, sf_out, 1);
}

namespace prep {

WeightLayout sm90_weight_layout() {
  WeightLayout l;
  l.name = kSm90LayoutName;
  l.description =
      "Hopper sm90 grouped GEMMs: wgmma A fragments per thread (16 B per 64x64 block), gate/up "
      "interleaved by 8; same sizes as canonical";
  l.check_dims = &check_sm90_dims;
  l.buffers[static_cast<int>(WeightBufferKind::kW13)] = weight_buffer_transform<Sm90Matrix::kW13>();
  l.buffers[static_cast<int>(WeightBufferKind::kW13Sf)] = scale_buffer_transform<Sm90Matrix::kW13>();
  l.buffers[static_cast<int>(WeightBufferKind::kW2)] = weight_buffer_transform<Sm90Matrix::kW2>();
  l.buffers[static_cast<int>(WeightBufferKind::kW2Sf)] = scale_buffer_transform<Sm90Matrix::kW2>();
  return l;
}

}  // namespace prep
}  // namespace megamoe
