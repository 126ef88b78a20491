// Programmatic dependent launch (sm90 and newer): a kernel launched with launch_dependent() may
// start while the stream's previous kernel is still running, as soon as every CTA of that
// kernel has called let_dependents_launch() (or exited), so its CTAs are resident and past
// their setup when the previous kernel's last CTA exits, instead of the launch starting then.
// Before it reads anything an earlier kernel of the stream writes, or writes anything an
// earlier kernel reads, it calls wait_for_previous_grids(), which returns once the previous
// kernel has completed and its memory operations are visible. A decode step is two or three
// short kernels (append, attention, combine) of a few microseconds each, so the gaps between
// them weigh (docs/perf-notes.md v16).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "fmha/kernels/device_facts.cuh"

namespace fmha {

__device__ __forceinline__ void wait_for_previous_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" : : : "memory");
#endif
}

__device__ __forceinline__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" : : :);
#endif
}

// Whether `kernel`'s code on the current device was compiled from sm90+ PTX, so that it has
// the griddepcontrol instructions above: sm80 code JIT-compiled for an H100 from its compute_80
// PTX has none, and launched early it would race with the kernel before it. Asked once per
// device (cudaFuncGetAttributes costs host time); `known` and `yes` are the kernel's own
// records, statics of its launcher, a bit per device.
inline bool waits_for_previous_grids(const void* kernel, std::atomic<uint64_t>& known,
                                     std::atomic<uint64_t>& yes) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  const uint64_t bit = device >= 0 && device < kMaxCachedDevices ? uint64_t{1} << device : 0;
  if (bit != 0 && (known.load(std::memory_order_relaxed) & bit)) {
    return (yes.load(std::memory_order_relaxed) & bit) != 0;
  }
  cudaFuncAttributes attributes{};
  const bool waits =
      cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess && attributes.ptxVersion >= 90;
  if (bit != 0) {
    if (waits) yes.fetch_or(bit, std::memory_order_relaxed);
    known.fetch_or(bit, std::memory_order_relaxed);
  }
  return waits;
}

// Launches kKernel on `stream` as a programmatic dependent of the stream's previous kernel where
// its code waits for it (waits_for_previous_grids), as an ordinary launch elsewhere. Like
// <<<>>>, it returns the launch's error; CUDA graphs capture the dependency as it is. The
// kernel is a template argument so that each kernel keeps its own record.
template <auto kKernel, typename... Args>
cudaError_t launch_dependent(dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                             Args&&... args) {
  static std::atomic<uint64_t> known{0}, yes{0};
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs =
      waits_for_previous_grids(reinterpret_cast<const void*>(kKernel), known, yes) ? 1 : 0;
  return cudaLaunchKernelEx(&config, kKernel, std::forward<Args>(args)...);
}

}  // namespace fmha
