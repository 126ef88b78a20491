// Host cost of the fa3 launcher's parts (perf notes v7), one instance (bf16 d128, no mask, batch,
// LSE) on the small shape of python -m bench (b=1, s=128, h=16, d=128): the kernel parameters
// with their four TMA descriptors, the bare launch of the kernel with those parameters, and
// the whole launch_fwd, each over calls the GPU keeps up with.
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -I$CUTLASS_INCLUDE -Iruntime/include scripts/host_costs_fa3.cu -o build/host_costs_fa3
#include <cuda_runtime.h>

#include <cstdio>

#include "fmha/kernels/fwd_fa3_sm90.cuh"
#include "host_timing.h"

namespace {

using Config = fmha::fa3::FwdConfig<
    /*Element=*/__nv_bfloat16, /*kHeadDimQK=*/128, /*kHeadDimV=*/128, /*kBlockM=*/128,
    /*kBlockN=*/128, /*kNumWarps=*/12, /*kStages=*/2, /*kMask=*/fmha::MaskType::kNone,
    /*kBias=*/fmha::BiasType::kNone, /*kVLayout=*/fmha::VLayout::kRowMajor,
    /*kMode=*/fmha::Mode::kBatch, /*kLse=*/true, /*kDropout=*/false, /*kSoftcap=*/false,
    /*kPadSeqlen=*/true, /*kPadHdim=*/false, /*kSmemLimit=*/232448>;

}  // namespace

int main() {
  const int b = 1, s = 128, h = 16, d = 128;
  const size_t elements = size_t{1} * b * s * h * d;
  void *q, *k, *v, *o;
  float* lse;
  for (void** p : {&q, &k, &v, &o}) {
    if (cudaMalloc(p, elements * 2) != cudaSuccess) return 1;
    cudaMemset(*p, 0x3c, elements * 2);  // finite bf16 inputs
  }
  if (cudaMalloc(&lse, sizeof(float) * b * h * s) != cudaSuccess) return 1;
  fmha::FwdArgs a;
  a.dtype = fmha::DataType::kBF16;
  a.q = q, a.k = k, a.v = v, a.o = o, a.lse = lse;
  a.batch = b, a.seqlen_q = s, a.seqlen_k = s, a.nhead_q = h, a.nhead_k = h;
  a.hdim_q = d, a.hdim_v = d;
  a.q_batch_stride = a.k_batch_stride = a.v_batch_stride = a.o_batch_stride = int64_t{s} * h * d;
  a.q_seq_stride = a.k_seq_stride = a.v_seq_stride = a.o_seq_stride = int64_t{h} * d;
  a.q_head_stride = a.k_head_stride = a.v_head_stride = a.o_head_stride = d;
  a.softmax_scale = 0.088f;
  a.lse_head_stride = s, a.lse_batch_stride = int64_t{h} * s;
  cudaStream_t stream;
  cudaStreamCreate(&stream);

  Config::KernelParams kp;
  if (fmha::fa3::make_kernel_params<Config>(a, kp) != cudaSuccess) return 2;
  if (fmha::fa3::launch_fwd<Config>(a, stream) != cudaSuccess) return 3;
  const int grid = fmha::multiprocessor_count();
  std::printf("%-44s %7.2f us\n", "make_kernel_params (4 TMA descriptors)",
              us_per_call([&] { fmha::fa3::make_kernel_params<Config>(a, kp); }, 20000));
  std::printf("%-44s %7.2f us\n", "kernel<<<>>> with those parameters",
              us_per_call([&] {
                fmha::fa3::fwd_kernel<Config><<<grid, Config::kThreads, Config::kSmemBytes,
                                                stream>>>(kp);
              }, 500));
  std::printf("%-44s %7.2f us\n", "launch_fwd (all of the above)",
              us_per_call([&] { fmha::fa3::launch_fwd<Config>(a, stream); }, 500));
  std::printf("%-44s %7zu bytes\n", "kernel parameters", sizeof(Config::KernelParams));
  const cudaError_t err = cudaStreamSynchronize(stream);
  std::printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
