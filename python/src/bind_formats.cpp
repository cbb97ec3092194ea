// python/src/bind_formats.cpp: the number-format codecs and quantizers (numerics.md sections 1,
// 2, 5 and the MXFP4 weight quantizer), as whole-array host functions.
//
// Every function takes its outputs as arguments (the Python layer allocates them in the caller's
// framework). Row-wise functions treat the last dim as the row (K) and all leading dims as rows,
// so a [E, N, K] weight tensor quantizes in one call.
#include <cstdint>

#include "bindings.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/quantize.hpp"

namespace megamoe::python {

namespace {

// Elements packed per E2M1 byte.
constexpr int64_t kE2M1PerByte = 2;
// Largest valid E2M1 code (4 bits).
constexpr uint8_t kE2M1MaxCode = 0xF;

// ---------------------------------------------------------------------------------------------
// Argument checks
// ---------------------------------------------------------------------------------------------
TensorView host_input(const char* arg, const InArray& a, std::initializer_list<DType> dtypes) {
  TensorView v = view_of(arg, a);
  expect_dtype(arg, v, dtypes);
  expect_host_contiguous(arg, v);
  return v;
}

TensorView host_output(const char* arg, const OutArray& a, DType dtype) {
  TensorView v = view_of(arg, a);
  expect_dtype(arg, v, {dtype});
  expect_host_contiguous(arg, v);
  return v;
}

// Extent of the last dim (the row length); the array must have at least one dim.
int64_t row_length(const char* arg, const TensorView& v) {
  MEGAMOE_CHECK_ARG(v.ndim >= 1, arg, ": expected at least 1 dim, got a 0-dim array");
  return v.shape[v.ndim - 1];
}

// `out` must have the leading dims of `in` and a last dim of `last`.
void expect_rowwise_shape(const char* arg, const TensorView& out, const char* in_arg,
                          const TensorView& in, int64_t last) {
  bool ok = out.ndim == in.ndim;
  for (int d = 0; ok && d + 1 < in.ndim; ++d) ok = out.shape[d] == in.shape[d];
  ok = ok && out.shape[out.ndim - 1] == last;
  if (ok) return;
  TensorView expected = in;
  expected.shape[in.ndim - 1] = last;
  fail(ErrorCode::kInvalidArgument, arg, ": expected shape ", shape_string(expected),
       " (from ", in_arg, " ", shape_string(in), "), got ", shape_string(out));
}

void expect_multiple(const char* arg, int64_t extent, int64_t multiple, const char* what) {
  MEGAMOE_CHECK_ARG(extent % multiple == 0, arg, ": last dim ", extent, " must be a multiple of ",
                    multiple, " (", what, ")");
}

// ---------------------------------------------------------------------------------------------
// Elementwise codecs
// ---------------------------------------------------------------------------------------------
template <typename Src, typename Dst, typename Fn>
void map_elements(const char* src_arg, const InArray& src, DType src_dtype, const char* dst_arg,
                  const OutArray& dst, DType dst_dtype, Fn fn) {
  const TensorView s = host_input(src_arg, src, {src_dtype});
  const TensorView d = host_output(dst_arg, dst, dst_dtype);
  expect_same_shape(dst_arg, d, src_arg, s);
  const Src* in = s.ptr<const Src>();
  Dst* out = d.ptr<Dst>();
  const int64_t n = s.numel();
  without_gil([&] {
    for (int64_t i = 0; i < n; ++i) out[i] = fn(in[i]);
  });
}

void e4m3_encode(const InArray& src, const OutArray& dst) {
  map_elements<float, uint8_t>("src", src, DType::kF32, "dst", dst, DType::kU8,
                               [](float f) { return e4m3_from_f32(f); });
}
void e4m3_decode(const InArray& src, const OutArray& dst) {
  map_elements<uint8_t, float>("src", src, DType::kU8, "dst", dst, DType::kF32,
                               [](uint8_t c) { return e4m3_to_f32(c); });
}
void e2m1_encode(const InArray& src, const OutArray& dst) {
  map_elements<float, uint8_t>("src", src, DType::kF32, "dst", dst, DType::kU8,
                               [](float f) { return e2m1_from_f32(f); });
}
void e2m1_decode(const InArray& src, const OutArray& dst) {
  const TensorView s = host_input("codes", src, {DType::kU8});
  const uint8_t* codes = s.ptr<const uint8_t>();
  for (int64_t i = 0; i < s.numel(); ++i) {
    MEGAMOE_CHECK_ARG(codes[i] <= kE2M1MaxCode, "codes: E2M1 codes are 4-bit (0..15), got ",
                      static_cast<int>(codes[i]), " at flat index ", i);
  }
  map_elements<uint8_t, float>("codes", src, DType::kU8, "dst", dst, DType::kF32,
                               [](uint8_t c) { return e2m1_to_f32(c); });
}
void bf16_encode(const InArray& src, const OutArray& dst) {
  map_elements<float, uint16_t>("src", src, DType::kF32, "dst", dst, DType::kBF16,
                                [](float f) { return bf16_from_f32(f); });
}
void bf16_decode(const InArray& src, const OutArray& dst) {
  map_elements<uint16_t, float>("src", src, DType::kBF16, "dst", dst, DType::kF32,
                                [](uint16_t h) { return bf16_to_f32(h); });
}
void ue8m0_decode(const InArray& src, const OutArray& dst) {
  map_elements<uint8_t, float>("src", src, DType::kU8, "dst", dst, DType::kF32,
                               [](uint8_t b) { return ue8m0_to_f32(b); });
}

void e2m1_pack(const InArray& codes, const OutArray& packed) {
  const TensorView c = host_input("codes", codes, {DType::kU8});
  const TensorView p = host_output("packed", packed, DType::kU8);
  const int64_t k = row_length("codes", c);
  expect_multiple("codes", k, kE2M1PerByte, "two E2M1 codes per byte");
  expect_rowwise_shape("packed", p, "codes", c, k / kE2M1PerByte);
  const uint8_t* in = c.ptr<const uint8_t>();
  for (int64_t i = 0; i < c.numel(); ++i) {
    MEGAMOE_CHECK_ARG(in[i] <= kE2M1MaxCode, "codes: E2M1 codes are 4-bit (0..15), got ",
                      static_cast<int>(in[i]), " at flat index ", i);
  }
  uint8_t* out = p.ptr<uint8_t>();
  for (int64_t i = 0; i < p.numel(); ++i) out[i] = megamoe::e2m1_pack(in[2 * i], in[2 * i + 1]);
}

void e2m1_unpack(const InArray& packed, const OutArray& codes) {
  const TensorView p = host_input("packed", packed, {DType::kU8});
  const TensorView c = host_output("codes", codes, DType::kU8);
  expect_rowwise_shape("codes", c, "packed", p, row_length("packed", p) * kE2M1PerByte);
  const uint8_t* in = p.ptr<const uint8_t>();
  uint8_t* out = c.ptr<uint8_t>();
  for (int64_t i = 0; i < c.numel(); ++i) out[i] = megamoe::e2m1_unpack(in, i);
}

// ---------------------------------------------------------------------------------------------
// Row-wise quantizers (numerics.md sections 2 and 5, MXFP4 weights) and their inverses
// ---------------------------------------------------------------------------------------------
void quantize_input(const InArray& x, const OutArray& q, const OutArray& sf) {
  const TensorView xv = host_input("x", x, {DType::kBF16});
  const TensorView qv = host_output("q", q, DType::kU8);
  const TensorView sv = host_output("sf", sf, DType::kU8);
  const int64_t cols = row_length("x", xv);
  expect_multiple("x", cols, kScaleBlock, "one UE8M0 scale per 32 channels");
  expect_rowwise_shape("q", qv, "x", xv, cols);
  expect_rowwise_shape("sf", sv, "x", xv, cols / kScaleBlock);
  const int64_t rows = cols == 0 ? 0 : xv.numel() / cols;
  without_gil([&] {
    megamoe::quantize_input(xv.ptr<const uint16_t>(), rows, cols, qv.ptr<uint8_t>(),
                            sv.ptr<uint8_t>());
  });
}

void requantize(const InArray& v, const OutArray& q, const OutArray& sf) {
  const TensorView vv = host_input("v", v, {DType::kF32});
  const TensorView qv = host_output("q", q, DType::kU8);
  const TensorView sv = host_output("sf", sf, DType::kU8);
  const int64_t cols = row_length("v", vv);
  expect_multiple("v", cols, kScaleBlock, "one UE8M0 scale per 32 channels");
  expect_rowwise_shape("q", qv, "v", vv, cols);
  expect_rowwise_shape("sf", sv, "v", vv, cols / kScaleBlock);
  const int64_t rows = cols == 0 ? 0 : vv.numel() / cols;
  without_gil([&] {
    megamoe::requantize_intermediate(vv.ptr<const float>(), rows, cols, qv.ptr<uint8_t>(),
                                     sv.ptr<uint8_t>());
  });
}

void quantize_mxfp4(const InArray& w, const OutArray& packed, const OutArray& sf) {
  const TensorView wv = host_input("w", w, {DType::kF32, DType::kBF16});
  const TensorView pv = host_output("packed", packed, DType::kU8);
  const TensorView sv = host_output("sf", sf, DType::kU8);
  const int64_t cols = row_length("w", wv);
  expect_multiple("w", cols, kScaleBlock, "one UE8M0 scale per 32 weights along K");
  expect_rowwise_shape("packed", pv, "w", wv, cols / kE2M1PerByte);
  expect_rowwise_shape("sf", sv, "w", wv, cols / kScaleBlock);
  const int64_t rows = cols == 0 ? 0 : wv.numel() / cols;
  without_gil([&] {
    if (wv.dtype == DType::kF32) {
      megamoe::quantize_mxfp4(wv.ptr<const float>(), rows, cols, pv.ptr<uint8_t>(),
                              sv.ptr<uint8_t>());
    } else {
      megamoe::quantize_mxfp4_bf16(wv.ptr<const uint16_t>(), rows, cols, pv.ptr<uint8_t>(),
                                   sv.ptr<uint8_t>());
    }
  });
}

void dequantize_fp8(const InArray& q, const InArray& sf, const OutArray& out) {
  const TensorView qv = host_input("q", q, {DType::kU8});
  const TensorView sv = host_input("sf", sf, {DType::kU8});
  const TensorView ov = host_output("out", out, DType::kF32);
  const int64_t cols = row_length("q", qv);
  expect_multiple("q", cols, kScaleBlock, "one UE8M0 scale per 32 channels");
  expect_rowwise_shape("sf", sv, "q", qv, cols / kScaleBlock);
  expect_rowwise_shape("out", ov, "q", qv, cols);
  const int64_t rows = cols == 0 ? 0 : qv.numel() / cols;
  without_gil([&] {
    megamoe::dequantize_fp8(qv.ptr<const uint8_t>(), sv.ptr<const uint8_t>(), rows, cols,
                            ov.ptr<float>());
  });
}

void dequantize_mxfp4(const InArray& packed, const InArray& sf, const OutArray& out) {
  const TensorView pv = host_input("packed", packed, {DType::kU8});
  const TensorView sv = host_input("sf", sf, {DType::kU8});
  const TensorView ov = host_output("out", out, DType::kF32);
  const int64_t cols = row_length("packed", pv) * kE2M1PerByte;
  expect_multiple("packed", cols, kScaleBlock, "K = 2 * packed bytes, one scale per 32");
  expect_rowwise_shape("sf", sv, "packed", pv, cols / kScaleBlock);
  expect_rowwise_shape("out", ov, "packed", pv, cols);
  const int64_t rows = cols == 0 ? 0 : ov.numel() / cols;
  without_gil([&] {
    megamoe::dequantize_mxfp4(pv.ptr<const uint8_t>(), sv.ptr<const uint8_t>(), rows, cols,
                              ov.ptr<float>());
  });
}

}  // namespace

void register_formats(nb::module_& m) {
  // Raw entry points: the documented API is megamoe.formats (python/megamoe/formats.py), which
  // allocates the outputs. Here: (inputs..., outputs...) -> None.
  m.def("e4m3_encode", &e4m3_encode, nb::arg("src"), nb::arg("dst"));
  m.def("e4m3_decode", &e4m3_decode, nb::arg("src"), nb::arg("dst"));
  m.def("e2m1_encode", &e2m1_encode, nb::arg("src"), nb::arg("dst"));
  m.def("e2m1_decode", &e2m1_decode, nb::arg("codes"), nb::arg("dst"));
  m.def("bf16_encode", &bf16_encode, nb::arg("src"), nb::arg("dst"));
  m.def("bf16_decode", &bf16_decode, nb::arg("src"), nb::arg("dst"));
  m.def("ue8m0_decode", &ue8m0_decode, nb::arg("src"), nb::arg("dst"));
  m.def("e2m1_pack", &e2m1_pack, nb::arg("codes"), nb::arg("packed"));
  m.def("e2m1_unpack", &e2m1_unpack, nb::arg("packed"), nb::arg("codes"));
  m.def("quantize_input", &quantize_input, nb::arg("x"), nb::arg("q"), nb::arg("sf"));
  m.def("requantize", &requantize, nb::arg("v"), nb::arg("q"), nb::arg("sf"));
  m.def("quantize_mxfp4", &quantize_mxfp4, nb::arg("w"), nb::arg("packed"), nb::arg("sf"));
  m.def("dequantize_fp8", &dequantize_fp8, nb::arg("q"), nb::arg("sf"), nb::arg("out"));
  m.def("dequantize_mxfp4", &dequantize_mxfp4, nb::arg("packed"), nb::arg("sf"), nb::arg("out"));
  m.attr("SCALE_BLOCK") = kScaleBlock;
  m.attr("E4M3_MAX") = kE4M3Max;
  m.attr("E2M1_MAX") = kE2M1Max;
}

}  // namespace megamoe::python
