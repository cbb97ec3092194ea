// megamoe/tensor.hpp: non-owning tensor views and the checks every entry point runs on them.
//
// A TensorView is what crosses the public API (C++ callers, the CLI, the Python bindings through
// DLPack): a raw pointer, a dtype, up to 4 dims with element strides, and the device it lives on.
// Kernels never see this type; launchers check views and pass raw pointers.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

namespace megamoe {

enum class DType : uint8_t { kU8, kI32, kF32, kBF16, kF64 };
enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

int64_t dtype_bytes(DType dtype);
const char* dtype_name(DType dtype);
std::string device_name(Device device);

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kU8;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0, 0};  // in elements
  Device device = Device::cpu();

  // A contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu());
  int64_t numel() const;
  int64_t nbytes() const { return numel() * dtype_bytes(dtype); }
  bool is_contiguous() const;
  std::string describe() const;  // "bfloat16[8, 1024] on cpu"

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Throws megamoe::Error (kInvalidArgument) naming `arg` unless `view` has this dtype, this shape
// (-1 = any extent), is contiguous, lives on `device` and is non-null when it has elements.
void check_tensor(const char* arg, const TensorView& view, DType dtype,
                  std::initializer_list<int64_t> shape, Device device);

}  // namespace megamoe
