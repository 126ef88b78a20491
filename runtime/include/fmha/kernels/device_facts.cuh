// What a launch asks the CUDA runtime about its device, asked once per device and process
// instead of on every call: on the H100 machine a cudaFuncSetAttribute costs 0.47 us and a
// cudaDeviceGetAttribute 0.05 us of host time (scripts/host_costs.cu), where a whole planned
// fmha.fwd call takes ~20 us. Devices past kMaxCachedDevices are asked every time.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace fmha {

constexpr int kMaxCachedDevices = 64;

// A device attribute of the current device, read once per device and attribute (the caller's
// `cache`, a static of its own), or 0 when it cannot be read.
inline int cached_device_attribute(cudaDeviceAttr attribute,
                                   std::atomic<int> (&cache)[kMaxCachedDevices]) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const bool cacheable = device >= 0 && device < kMaxCachedDevices;
  if (cacheable) {
    const int value = cache[device].load(std::memory_order_relaxed);
    if (value > 0) return value;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) return 0;
  if (cacheable) cache[device].store(value, std::memory_order_relaxed);
  return value;
}

// The current device's multiprocessor count, or 0 when it cannot be read.
inline int multiprocessor_count() {
  static std::atomic<int> counts[kMaxCachedDevices] = {};
  return cached_device_attribute(cudaDevAttrMultiProcessorCount, counts);
}

// The shared memory one multiprocessor holds for all its CTAs (228 KB on H100, 164 KB on
// A100), or 0 when it cannot be read.
inline int shared_memory_per_multiprocessor() {
  static std::atomic<int> bytes[kMaxCachedDevices] = {};
  return cached_device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, bytes);
}

// Raises `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once per
// device: `raised` is the kernel's own record (a static of its launcher, one bit per device),
// since the limit is a property of the kernel on a device.
inline cudaError_t allow_dynamic_smem(const void* kernel, int bytes,
                                      std::atomic<uint64_t>& raised) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device >= 0 && device < kMaxCachedDevices ? uint64_t{1} << device : 0;
  if (bit != 0 && (raised.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && bit != 0) raised.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

}  // namespace fmha
