#include "runtime/cuda_device.hpp"

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

#include "megamoe/error.hpp"
#include "runtime/cuda_check.hpp"

namespace megamoe {

namespace cuda {

#if defined(MEGAMOE_WITH_CUDA)
void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  fail(ErrorCode::kCuda, expr, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
       ") at ", file, ":", line);
}

int current_device() {
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void raise_max_dynamic_smem(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, size_t> configured;
  const std::pair<int, const void*> key{current_device(), kernel};
  std::lock_guard<std::mutex> lock(mutex);
  size_t& have = configured[key];
  if (bytes <= have) return;
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)));
  have = bytes;
}

int resident_ctas_per_sm(const void* kernel, int threads, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, size_t>, int> known;
  const std::tuple<int, const void*, int, size_t> key{current_device(), kernel, threads, smem};
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  int ctas = 0;
  MEGAMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem));
  known.emplace(key, ctas);
  return ctas;
}

const DeviceInfo& device_info(int index) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<DeviceInfo>> cache;
  if (index < 0) index = current_device();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(index);
  if (it != cache.end()) return *it->second;

  int count = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDeviceCount(&count));
  MEGAMOE_CHECK(index < count, ErrorCode::kUnsupported, "device_info: expected a device index < ",
                count, ", got ", index);
  auto info = std::make_unique<DeviceInfo>();
  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  info->index = index;
  info->name = prop.name;
  info->cc_major = prop.major;
  info->cc_minor = prop.minor;
  info->sm_count = prop.multiProcessorCount;
  info->l2_bytes = prop.l2CacheSize;
  info->smem_per_block_optin = static_cast<int64_t>(prop.sharedMemPerBlockOptin);
  info->global_mem_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  info->mem_bus_bits = prop.memoryBusWidth;
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&info->max_clock_khz, cudaDevAttrClockRate, index));
  MEGAMOE_CUDA_CHECK(
      cudaDeviceGetAttribute(&info->mem_clock_khz, cudaDevAttrMemoryClockRate, index));
  MEGAMOE_CUDA_CHECK(cudaDriverGetVersion(&info->driver_version));
  MEGAMOE_CUDA_CHECK(cudaRuntimeGetVersion(&info->runtime_version));
  const DeviceInfo& ref = *info;
  cache.emplace(index, std::move(info));
  return ref;
}
#else
int current_device() {
  fail(ErrorCode::kUnsupported, "current_device: megamoe was built without CUDA");
}
const DeviceInfo& device_info(int) {
  fail(ErrorCode::kUnsupported, "device_info: megamoe was built without CUDA");
}
void raise_max_dynamic_smem(const void*, size_t) {
  fail(ErrorCode::kUnsupported, "raise_max_dynamic_smem: megamoe was built without CUDA");
}
int resident_ctas_per_sm(const void*, int, size_t) {
  fail(ErrorCode::kUnsupported, "resident_ctas_per_sm: megamoe was built without CUDA");
}
#endif

}  // namespace cuda

bool cuda_available() {
#if defined(MEGAMOE_WITH_CUDA)
  int count = 0;
  // NOTES: a machine without a driver answers cudaErrorNoDevice or cudaErrorInsufficientDriver;
  // either means "no GPU here", not a failure. The sticky error is cleared for later calls.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
#else
  return false;
#endif
}

bool sm90_available(int index) {
  if (!cuda_available()) return false;
#if defined(MEGAMOE_WITH_CUDA)
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || index >= count) return false;
  const cuda::DeviceInfo& info = cuda::device_info(index);
  return info.cc_major == 9 && info.cc_minor == 0;
#else
  return false;
#endif
}

}  // namespace megamoe
