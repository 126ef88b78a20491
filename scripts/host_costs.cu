// Host cost of the CUDA calls one fmha::fwd launch makes, each timed alone on the device
// machine (perf notes v7): what a per-call path can afford, and which calls to cache.
//
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a scripts/host_costs.cu \
//     -o build/host_costs && build/host_costs
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

__global__ void empty_kernel(int) {}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// Mean nanoseconds per call of fn over `calls` calls, after as many warm-up calls.
template <class Fn>
double ns_per_call(Fn fn, int calls = 20000) {
  for (int i = 0; i < calls; ++i) fn();
  const auto begin = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) fn();
  const auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(end - begin).count() / calls;
}

}  // namespace

int main() {
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "context");
  void* buffer = nullptr;
  check(cudaMalloc(&buffer, 64 << 20), "cudaMalloc");
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");

  void* pfn = nullptr;
  cudaDriverEntryPointQueryResult status;
  auto lookup = [&] {
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pfn, 12000,
                                           cudaEnableDefault, &status),
          "cudaGetDriverEntryPointByVersion");
  };
  lookup();
  auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(pfn);
  CUtensorMap map;
  // A (seq 4096, head dim 128, heads 16, batch 4) bf16 tensor, a 128 x 64 box: fa3's K load.
  cuuint64_t dims[4] = {128, 4096, 16, 4};
  cuuint64_t strides[3] = {128 * 16 * 2, 128 * 2, 128 * 16 * 4096 * 2};
  cuuint32_t box[4] = {64, 128, 1, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  auto encode_map = [&] {
    CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, buffer, dims, strides, box,
                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) std::exit(2);
  };
  int device = 0, value = 0;
  auto func_attribute = [&] {
    check(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               100000),
          "cudaFuncSetAttribute");
  };
  auto launch = [&] {
    empty_kernel<<<132, 384, 0, stream>>>(1);
    check(cudaGetLastError(), "launch");
  };

  std::printf("%-44s %8.0f ns\n", "cudaGetDevice", ns_per_call([&] { cudaGetDevice(&device); }));
  std::printf("%-44s %8.0f ns\n", "cudaDeviceGetAttribute(SM count)", ns_per_call([&] {
                cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device);
              }));
  std::printf("%-44s %8.0f ns\n", "getenv", ns_per_call([&] {
                volatile bool set = std::getenv("FMHA_FA3_SPREAD_HEADS") != nullptr;
                (void)set;
              }));
  std::printf("%-44s %8.0f ns\n", "cudaGetDriverEntryPointByVersion", ns_per_call(lookup));
  std::printf("%-44s %8.0f ns\n", "cuTensorMapEncodeTiled", ns_per_call(encode_map));
  std::printf("%-44s %8.0f ns\n", "cudaFuncSetAttribute(max dynamic smem)",
              ns_per_call(func_attribute));
  // Launches queue up: time fewer, and drain the queue between the two passes.
  const double launch_ns = ns_per_call(launch, 2000);
  check(cudaStreamSynchronize(stream), "sync");
  std::printf("%-44s %8.0f ns\n", "kernel launch (<<<>>> + cudaGetLastError)", launch_ns);
  check(cudaStreamSynchronize(stream), "sync");
  return 0;
}
