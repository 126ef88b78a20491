// Host cost of fmha::fwd itself, a C++ caller's whole path (perf notes v7): the checks and the
// dispatcher's choice alone (fmha::select), and the call with its launch, on the small shape
// of python -m bench (b=1, s=128, h=16, d=128, bf16), timed over calls the GPU keeps up with.
//
//   g++ -O2 -std=c++17 scripts/host_costs_api.cpp -Iruntime/include -I$CUDA/include \
//     -Lbuild/dev/python/fmha -lfmha -L$CUDA/lib64 -lcudart -Wl,-rpath,'$ORIGIN/dev/python/fmha' \
//     -o build/host_costs_api && build/host_costs_api
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "fmha/fmha.h"
#include "host_timing.h"

namespace {

void require(const fmha::Status& st) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.message.c_str());
    std::exit(1);
  }
}

}  // namespace

int main() {
  const int b = 1, s = 128, h = 16, d = 128;
  const size_t bytes = size_t{2} * b * s * h * d;
  void *q, *k, *v, *o;
  for (void** p : {&q, &k, &v, &o}) {
    if (cudaMalloc(p, bytes) != cudaSuccess) return 1;
  }
  cudaMemset(q, 0x3c, bytes);  // 1.0 in bf16 pairs: finite inputs
  cudaMemset(k, 0x3c, bytes);
  cudaMemset(v, 0x3c, bytes);
  fmha::FwdArgs a;
  a.dtype = fmha::DataType::kBF16;
  a.q = q, a.k = k, a.v = v, a.o = o;
  a.batch = b, a.seqlen_q = s, a.seqlen_k = s, a.nhead_q = h, a.nhead_k = h;
  a.hdim_q = d, a.hdim_v = d;
  const int64_t seq = int64_t{h} * d, batch = seq * s;
  a.q_batch_stride = a.k_batch_stride = a.v_batch_stride = a.o_batch_stride = batch;
  a.q_seq_stride = a.k_seq_stride = a.v_seq_stride = a.o_seq_stride = seq;
  a.q_head_stride = a.k_head_stride = a.v_head_stride = a.o_head_stride = d;
  a.softmax_scale = 0.088f;
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  fmha::InstanceInfo info;
  require(fmha::select(a, &info));
  require(fmha::fwd(a, stream));
  std::printf("instance %s\n", info.name.c_str());
  std::printf("%-40s %7.2f us\n", "fmha::select (checks + dispatch)",
              us_per_call([&] { fmha::select(a, &info); }, 20000));
  fmha::FwdArgs empty = a;
  empty.batch = 0;
  std::printf("%-40s %7.2f us\n", "fmha::fwd, empty problem (no launch)",
              us_per_call([&] { fmha::fwd(empty, stream); }, 20000));
  std::printf("%-40s %7.2f us\n", "fmha::fwd",
              us_per_call([&] { fmha::fwd(a, stream); }, 500));
  std::printf("%-40s %7.2f us\n", "fmha::fwd_instance (by name)",
              us_per_call([&] { fmha::fwd_instance(info.name, a, stream); }, 500));
  return cudaStreamSynchronize(stream) == cudaSuccess ? 0 : 1;
}
