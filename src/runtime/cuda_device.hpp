// runtime/cuda_device.hpp: what the host needs to know about the CUDA device, read once.
//
// Kernels are sized from these values at run time (SM count for persistent grids, the opt-in
// shared-memory limit for dynamic shared memory, L2 size for the benchmark's buffer rotation);
// no launcher hard-codes 132 SMs or 50 MB of L2. Values are cached per device on first use
// (cudaGetDeviceProperties costs milliseconds).
//
// Without a CUDA build, cuda_available() is false and device_info() throws kUnsupported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace megamoe {

// True when megamoe was built with CUDA and at least one device is usable (driver present).
bool cuda_available();

// True when cuda_available() and device `index` has compute capability 9.0 (sm_90a kernels).
bool sm90_available(int index = 0);

namespace cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;                    // "NVIDIA H200"
  int cc_major = 0, cc_minor = 0;      // compute capability
  int sm_count = 0;                    // multiprocessors
  int64_t l2_bytes = 0;
  int64_t smem_per_block_optin = 0;    // dynamic shared memory limit after cudaFuncSetAttribute
  int64_t global_mem_bytes = 0;
  int max_clock_khz = 0;               // peak SM clock
  int mem_clock_khz = 0;               // peak memory clock
  int mem_bus_bits = 0;
  int driver_version = 0;              // e.g. 13000
  int runtime_version = 0;
};

// Cached properties of device `index` (-1: the current device). Throws kUnsupported without CUDA
// or when the device does not exist.
const DeviceInfo& device_info(int index = -1);

// The current device (cudaGetDevice). Throws kUnsupported without CUDA.
int current_device();

// Raises `kernel`'s opt-in dynamic shared-memory limit on the current device to at least `bytes`
// (cudaFuncSetAttribute; the attribute belongs to the function on one device, so it is tracked
// per (device, kernel) and set again only for a larger size). Thread-safe; a host call, not a
// stream operation: layers call it at construction, so a captured forward() makes none.
void raise_max_dynamic_smem(const void* kernel, size_t bytes);

// The CTAs of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) that one SM of
// the current device holds at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor), asked once
// per (device, kernel, threads, smem) and remembered: launchers call it on every launch.
// Thread-safe; a host call, not a stream operation.
int resident_ctas_per_sm(const void* kernel, int threads, size_t smem);

}  // namespace cuda
}  // namespace megamoe
