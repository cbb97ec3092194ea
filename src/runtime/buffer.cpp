#include "megamoe/buffer.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "megamoe/error.hpp"

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace megamoe {

namespace {

constexpr int64_t kHostAlignment = 64;

struct Accountant {
  std::mutex mutex;
  MemoryStats stats;

  void add(Device device, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    ++stats.allocations;
    if (device.type == DeviceType::kCPU) {
      stats.host_bytes += bytes;
      if (stats.host_bytes > stats.host_peak_bytes) stats.host_peak_bytes = stats.host_bytes;
    } else {
      stats.device_bytes += bytes;
      if (stats.device_bytes > stats.device_peak_bytes) stats.device_peak_bytes = stats.device_bytes;
    }
  }
  void remove(Device device, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    if (device.type == DeviceType::kCPU) stats.host_bytes -= bytes;
    else stats.device_bytes -= bytes;
  }
};

Accountant& accountant() {
  static Accountant a;
  return a;
}

#if defined(MEGAMOE_WITH_CUDA)
void cuda_check(cudaError_t err, const char* what) {
  MEGAMOE_CHECK(err == cudaSuccess, ErrorCode::kCuda, what, ": ", cudaGetErrorString(err));
}
#endif

}  // namespace

Buffer::Buffer(int64_t bytes, Device device) : device_(device) {
  MEGAMOE_CHECK_ARG(bytes >= 0, "Buffer: negative size ", bytes);
  if (bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    const int64_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
    data_ = std::aligned_alloc(kHostAlignment, static_cast<size_t>(rounded));
    MEGAMOE_CHECK(data_ != nullptr, ErrorCode::kIo, "Buffer: host allocation of ", bytes,
                  " bytes failed");
  } else {
#if defined(MEGAMOE_WITH_CUDA)
    int prev = 0;
    cuda_check(cudaGetDevice(&prev), "cudaGetDevice");
    cuda_check(cudaSetDevice(device.index), "cudaSetDevice");
    const cudaError_t err = cudaMalloc(&data_, static_cast<size_t>(bytes));
    cudaSetDevice(prev);
    cuda_check(err, "Buffer: cudaMalloc");
#else
    fail(ErrorCode::kUnsupported, "Buffer: ", device_name(device),
         " requested but megamoe was built without CUDA");
#endif
  }
  bytes_ = capacity_ = bytes;
  accountant().add(device_, capacity_);
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_), capacity_(other.capacity_), device_(other.device_) {
  other.data_ = nullptr;
  other.bytes_ = other.capacity_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    bytes_ = other.bytes_;
    capacity_ = other.capacity_;
    device_ = other.device_;
    other.data_ = nullptr;
    other.bytes_ = other.capacity_ = 0;
  }
  return *this;
}

void Buffer::shrink(int64_t bytes) {
  MEGAMOE_CHECK_ARG(bytes >= 0 && bytes <= bytes_, "Buffer::shrink: ", bytes,
                    " is outside [0, ", bytes_, "]");
  bytes_ = bytes;
}

void Buffer::release() {
  if (data_ == nullptr) return;
  if (device_.type == DeviceType::kCPU) {
    std::free(data_);
  } else {
#if defined(MEGAMOE_WITH_CUDA)
    cudaFree(data_);
#endif
  }
  accountant().remove(device_, capacity_);
  data_ = nullptr;
  bytes_ = capacity_ = 0;
}

Buffer Buffer::to(Device device) const {
  Buffer out(bytes_, device);
  if (bytes_ > 0) copy_bytes(out.data(), device, data_, device_, bytes_);
  return out;
}

MemoryStats memory_stats() {
  std::lock_guard<std::mutex> lock(accountant().mutex);
  return accountant().stats;
}

void reset_memory_peak() {
  std::lock_guard<std::mutex> lock(accountant().mutex);
  auto& s = accountant().stats;
  s.host_peak_bytes = s.host_bytes;
  s.device_peak_bytes = s.device_bytes;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes) {
  if (bytes == 0) return;
  if (dst_device.type == DeviceType::kCPU && src_device.type == DeviceType::kCPU) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return;
  }
#if defined(MEGAMOE_WITH_CUDA)
  cuda_check(cudaMemcpy(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault), "copy_bytes: cudaMemcpy");
#else
  fail(ErrorCode::kUnsupported, "copy_bytes: ", device_name(src_device), " -> ",
       device_name(dst_device), " needs a CUDA build");
#endif
}

}  // namespace megamoe
