#include "megamoe/tensor.hpp"

#include <sstream>

#include "megamoe/error.hpp"

namespace megamoe {

int64_t dtype_bytes(DType dtype) {
  switch (dtype) {
    case DType::kU8: return 1;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kF32: return 4;
    case DType::kF64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kU8: return "uint8";
    case DType::kBF16: return "bfloat16";
    case DType::kI32: return "int32";
    case DType::kF32: return "float32";
    case DType::kF64: return "float64";
  }
  return "unknown";
}

std::string device_name(Device device) {
  if (device.type == DeviceType::kCPU) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

static std::string shape_string(const int64_t* shape, int ndim) {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim; ++d) {
    if (d) os << ", ";
    if (shape[d] < 0) os << "*"; else os << shape[d];
  }
  os << "]";
  return os.str();
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  MEGAMOE_CHECK_ARG(static_cast<int>(shape.size()) <= kMaxDims, "TensorView: at most ", kMaxDims,
                    " dims, got ", shape.size());
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  // The outermost extent never enters a stride; the inner ones must not overflow int64.
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    if (d > 0)
      MEGAMOE_CHECK_ARG(!__builtin_mul_overflow(stride, v.shape[d], &stride),
                        "TensorView: the strides of shape ", shape_string(v.shape, v.ndim),
                        " overflow int64");
  }
  return v;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  // NOTES: an empty tensor has no element to address, so any strides describe it (numpy/DLPack
  // export shape [0, H] with strides [0, 0] or similar).
  if (numel() == 0) return true;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  return std::string(dtype_name(dtype)) + shape_string(shape, ndim) + " on " + device_name(device);
}

void check_tensor(const char* arg, const TensorView& view, DType dtype,
                  std::initializer_list<int64_t> shape, Device device) {
  // A hand-built view may carry any ndim: check it before anything loops over the dims.
  MEGAMOE_CHECK_ARG(view.ndim >= 0 && view.ndim <= TensorView::kMaxDims, arg,
                    ": expected a view with 0..", TensorView::kMaxDims, " dims, got ndim ",
                    view.ndim);
  MEGAMOE_CHECK_ARG(view.dtype == dtype, arg, ": expected dtype ", dtype_name(dtype), ", got ",
                    dtype_name(view.dtype));
  int64_t expected[TensorView::kMaxDims] = {0, 0, 0, 0};
  int i = 0;
  for (int64_t s : shape) expected[i++] = s;
  bool ok = view.ndim == static_cast<int>(shape.size());
  for (int d = 0; ok && d < view.ndim; ++d) ok = expected[d] < 0 || expected[d] == view.shape[d];
  MEGAMOE_CHECK_ARG(ok, arg, ": expected shape ", shape_string(expected, static_cast<int>(shape.size())),
                    ", got ", shape_string(view.shape, view.ndim));
  for (int d = 0; d < view.ndim; ++d)
    MEGAMOE_CHECK_ARG(view.shape[d] >= 0, arg, ": negative extent in dim ", d);
  // Byte sizes must fit int64 (numel(), nbytes() and the contiguity check multiply extents).
  int64_t bytes = dtype_bytes(view.dtype);
  for (int d = 0; d < view.ndim; ++d)
    MEGAMOE_CHECK_ARG(!__builtin_mul_overflow(bytes, view.shape[d], &bytes), arg, ": shape ",
                      shape_string(view.shape, view.ndim), " has more bytes than int64 can count");
  MEGAMOE_CHECK_ARG(view.is_contiguous(), arg, ": expected a contiguous (row-major) tensor, got strides ",
                    shape_string(view.strides, view.ndim));
  MEGAMOE_CHECK_ARG(view.device == device, arg, ": expected a tensor on ", device_name(device),
                    ", got one on ", device_name(view.device));
  MEGAMOE_CHECK_ARG(view.numel() == 0 || view.data != nullptr, arg, ": null data pointer for ",
                    view.describe());
}

}  // namespace megamoe
