// A C++ program's call of an instance the library lacks: fmha::fwd compiles it on demand, runs
// it, and the output matches a float64 reference. tests/test_misses_gpu.py builds and runs it
// against the installed package's libfmha.
//
//   compile_on_demand <softcap>    prints "INSTANCE <name>" and "ERROR <max abs error>"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "fmha/fmha.h"

namespace {

constexpr int kSeqlen = 200;  // no multiple of any tile: the padded instances' path
constexpr int kHeads = 2;
constexpr int kHeadDim = 128;

int fail(const char* what, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", what, message.c_str());
  return 1;
}

bool check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
  return false;
}

// softmax(softcap * tanh(q.k * scale / softcap)) v of one head, causal (top-left), in float64.
std::vector<double> reference(const std::vector<float>& q, const std::vector<float>& k,
                              const std::vector<float>& v, int head, double scale,
                              double softcap) {
  std::vector<double> out(size_t(kSeqlen) * kHeadDim, 0.0);
  auto at = [&](const std::vector<float>& t, int row, int d) {
    return double(t[(size_t(row) * kHeads + head) * kHeadDim + d]);
  };
  for (int i = 0; i < kSeqlen; ++i) {
    std::vector<double> logits(i + 1);
    double top = -INFINITY;
    for (int j = 0; j <= i; ++j) {
      double dot = 0.0;
      for (int d = 0; d < kHeadDim; ++d) dot += at(q, i, d) * at(k, j, d);
      logits[j] = softcap * std::tanh(dot * scale / softcap);
      top = std::max(top, logits[j]);
    }
    double sum = 0.0;
    for (double& l : logits) sum += (l = std::exp(l - top));
    for (int j = 0; j <= i; ++j) {
      for (int d = 0; d < kHeadDim; ++d) out[size_t(i) * kHeadDim + d] += logits[j] / sum * at(v, j, d);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const float softcap = argc > 1 ? std::strtof(argv[1], nullptr) : 30.f;
  const size_t elements = size_t(kSeqlen) * kHeads * kHeadDim;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> host[3];
  std::vector<__nv_bfloat16> packed[3];
  for (int t = 0; t < 3; ++t) {
    for (size_t i = 0; i < elements; ++i) {
      const __nv_bfloat16 value = __float2bfloat16(normal(rng));
      packed[t].push_back(value);
      host[t].push_back(__bfloat162float(value));  // the reference sees the rounded inputs
    }
  }
  void* device[4] = {};
  for (int t = 0; t < 4; ++t) {
    if (!check(cudaMalloc(&device[t], elements * sizeof(__nv_bfloat16)), "cudaMalloc")) return 1;
  }
  for (int t = 0; t < 3; ++t) {
    if (!check(cudaMemcpy(device[t], packed[t].data(), elements * sizeof(__nv_bfloat16),
                          cudaMemcpyHostToDevice), "cudaMemcpy")) {
      return 1;
    }
  }
  // Poisoned: a kernel that skips rows leaves NaNs behind.
  if (!check(cudaMemset(device[3], 0xff, elements * sizeof(__nv_bfloat16)), "cudaMemset")) {
    return 1;
  }

  fmha::FwdArgs a;
  a.dtype = fmha::DataType::kBF16;
  a.q = device[0];
  a.k = device[1];
  a.v = device[2];
  a.o = device[3];
  a.batch = 1;
  a.seqlen_q = a.seqlen_k = kSeqlen;
  a.nhead_q = a.nhead_k = kHeads;
  a.hdim_q = a.hdim_v = kHeadDim;
  const int64_t row = int64_t(kHeads) * kHeadDim;
  a.q_batch_stride = a.k_batch_stride = a.v_batch_stride = a.o_batch_stride = row * kSeqlen;
  a.q_seq_stride = a.k_seq_stride = a.v_seq_stride = a.o_seq_stride = row;
  a.q_head_stride = a.k_head_stride = a.v_head_stride = a.o_head_stride = kHeadDim;
  a.softmax_scale = 1.f / std::sqrt(float(kHeadDim));
  a.mask = fmha::MaskType::kCausal;
  a.softcap = softcap;

  std::string chosen;
  if (fmha::Status st = fmha::fwd(a, nullptr, &chosen); !st.ok()) return fail("fmha::fwd", st.message);
  if (!check(cudaGetLastError(), "launch") || !check(cudaDeviceSynchronize(), "run")) return 1;
  std::vector<__nv_bfloat16> out(elements);
  if (!check(cudaMemcpy(out.data(), device[3], elements * sizeof(__nv_bfloat16),
                        cudaMemcpyDeviceToHost), "cudaMemcpy")) {
    return 1;
  }
  double error = 0.0;
  for (int head = 0; head < kHeads; ++head) {
    const std::vector<double> want =
        reference(host[0], host[1], host[2], head, a.softmax_scale, softcap);
    for (int i = 0; i < kSeqlen; ++i) {
      for (int d = 0; d < kHeadDim; ++d) {
        const double got = __bfloat162float(out[(size_t(i) * kHeads + head) * kHeadDim + d]);
        const double diff = std::fabs(got - want[size_t(i) * kHeadDim + d]);
        error = std::isnan(diff) ? INFINITY : std::max(error, diff);
      }
    }
  }
  std::printf("INSTANCE %s\nERROR %g\n", chosen.c_str(), error);
  return 0;
}
