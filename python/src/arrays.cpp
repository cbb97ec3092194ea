// python/src/arrays.cpp: DLPack arrays -> megamoe::TensorView, and the argument checks the
// bindings run before calling into the library.
#include <sstream>

#include "bindings.hpp"

namespace megamoe::python {

namespace {

namespace dl = nb::dlpack;

std::string dlpack_dtype_name(dl::dtype dt) {
  const char* prefix = "unknown";
  switch (static_cast<dl::dtype_code>(dt.code)) {
    case dl::dtype_code::Int: prefix = "int"; break;
    case dl::dtype_code::UInt: prefix = "uint"; break;
    case dl::dtype_code::Float: prefix = "float"; break;
    case dl::dtype_code::Bfloat: prefix = "bfloat"; break;
    case dl::dtype_code::Complex: prefix = "complex"; break;
    case dl::dtype_code::Bool: return "bool";
    default: return "dlpack dtype code " + std::to_string(dt.code);
  }
  std::string name = prefix + std::to_string(dt.bits);
  if (dt.lanes != 1) name += "x" + std::to_string(dt.lanes);
  return name;
}

bool to_megamoe_dtype(dl::dtype dt, DType* out) {
  if (dt.lanes != 1) return false;
  const auto code = static_cast<dl::dtype_code>(dt.code);
  if (code == dl::dtype_code::UInt && dt.bits == 8) *out = DType::kU8;
  else if (code == dl::dtype_code::Int && dt.bits == 32) *out = DType::kI32;
  else if (code == dl::dtype_code::Float && dt.bits == 32) *out = DType::kF32;
  else if (code == dl::dtype_code::Float && dt.bits == 64) *out = DType::kF64;
  else if (code == dl::dtype_code::Bfloat && dt.bits == 16) *out = DType::kBF16;
  // NOTES: numpy has no bfloat16; uint16 arrays carry raw BF16 bits (the upper half of an FP32).
  else if (code == dl::dtype_code::UInt && dt.bits == 16) *out = DType::kBF16;
  else return false;
  return true;
}

Device to_megamoe_device(const char* arg, int device_type, int device_id) {
  if (device_type == nb::device::cpu::value) return Device::cpu();
  if (device_type == nb::device::cuda::value) return Device::cuda(device_id);
  fail(ErrorCode::kInvalidArgument, arg, ": expected a cpu or cuda array, got DLPack device type ",
       device_type, " (cuda_host, managed and other devices are not supported)");
}

template <typename Array>
TensorView make_view(const char* arg, const Array& array) {
  TensorView view;
  const int ndim = static_cast<int>(array.ndim());
  MEGAMOE_CHECK_ARG(ndim <= TensorView::kMaxDims, arg, ": expected at most ", TensorView::kMaxDims,
                    " dims, got ", ndim);
  if (!to_megamoe_dtype(array.dtype(), &view.dtype)) {
    throw DTypeMismatch(detail::concat(
        arg, ": unsupported dtype ", dlpack_dtype_name(array.dtype()),
        " (megamoe takes uint8, int32, float32, float64, bfloat16, or uint16 as raw BF16 bits)"));
  }
  view.ndim = ndim;
  for (int d = 0; d < ndim; ++d) {
    view.shape[d] = static_cast<int64_t>(array.shape(d));
    view.strides[d] = array.stride(d);
  }
  // NOTES: an array without elements has no meaningful strides (numpy exports zeros for them);
  // it is given row-major ones so that it passes every contiguity check.
  if (view.numel() == 0) {
    int64_t stride = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      view.strides[d] = stride;
      stride *= view.shape[d];
    }
  }
  view.device = to_megamoe_device(arg, array.device_type(), array.device_id());
  view.data = const_cast<void*>(static_cast<const void*>(array.data()));
  return view;
}

}  // namespace

TensorView view_of(const char* arg, const InArray& array) { return make_view(arg, array); }
TensorView view_of(const char* arg, const OutArray& array) { return make_view(arg, array); }

std::string shape_string(const TensorView& view) {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < view.ndim; ++d) os << (d ? ", " : "") << view.shape[d];
  os << "]";
  return os.str();
}

void expect_dtype(const char* arg, const TensorView& view, std::initializer_list<DType> allowed) {
  std::string expected;
  for (DType dtype : allowed) {
    if (view.dtype == dtype) return;
    if (!expected.empty()) expected += " or ";
    expected += dtype_name(dtype);
    if (dtype == DType::kBF16) expected += " (or uint16 raw BF16 bits)";
  }
  throw DTypeMismatch(detail::concat(arg, ": expected dtype ", expected, ", got ",
                                     dtype_name(view.dtype)));
}

void expect_host_contiguous(const char* arg, const TensorView& view) {
  MEGAMOE_CHECK_ARG(view.device.type == DeviceType::kCPU, arg,
                    ": expected a cpu array (this function runs on the host), got one on ",
                    device_name(view.device));
  MEGAMOE_CHECK_ARG(view.is_contiguous(), arg, ": expected a contiguous (row-major) array, got ",
                    view.describe(), " with non-contiguous strides");
}

void expect_same_shape(const char* arg, const TensorView& view, const char* other_arg,
                       const TensorView& other) {
  bool same = view.ndim == other.ndim;
  for (int d = 0; same && d < view.ndim; ++d) same = view.shape[d] == other.shape[d];
  MEGAMOE_CHECK_ARG(same, arg, ": expected shape ", shape_string(other), " (the shape of ",
                    other_arg, "), got ", shape_string(view));
}

}  // namespace megamoe::python
