// megamoe/buffer.hpp: owning byte buffers on the host or a CUDA device, with accounting.
//
// Every large allocation megamoe makes (weights, scratch, workspaces) goes through Buffer, so
// the bytes held and the peak are known. Weight preparation is measured with this: a test fails
// if preparing a layer ever holds a second full copy of it (weights.md section 3).
#pragma once

#include <cstddef>
#include <cstdint>

#include "megamoe/tensor.hpp"

namespace megamoe {

class Buffer {
 public:
  Buffer() = default;
  // Uninitialised storage of `bytes` on `device` (64-byte aligned on the host).
  Buffer(int64_t bytes, Device device = Device::cpu());
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  int64_t size() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }
  Device device() const { return device_; }

  // Shrinks the logical size without reallocating (the bytes stay counted until release()).
  void shrink(int64_t bytes);
  void release();

  // A copy of this buffer on `device` (host<->device copies need a CUDA build).
  Buffer to(Device device) const;

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  int64_t capacity_ = 0;
  Device device_ = Device::cpu();
};

struct MemoryStats {
  int64_t host_bytes = 0;        // held now through Buffer
  int64_t host_peak_bytes = 0;   // since the last reset_peak
  int64_t device_bytes = 0;
  int64_t device_peak_bytes = 0;
  int64_t allocations = 0;       // Buffer allocations since start
};

MemoryStats memory_stats();
void reset_memory_peak();

// Copy bytes between any two devices (host<->device needs a CUDA build).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes);

}  // namespace megamoe
