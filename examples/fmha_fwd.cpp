// fmha_fwd: runs one forward problem through the dispatcher, in the style of CK-Tile's
// tile_example_fmha_fwd. Prints the chosen instance, the median time and TFLOP/s; with -v=1
// also checks the output against a float64 CPU reference.
//
//   fmha_fwd -b=2 -h=16 -s=4096 -d=128 -prec=bf16 -mask=1 -v=1
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "fmha/fmha.h"

namespace {

#define CHECK_CUDA(call)                                                                 \
  do {                                                                                   \
    const cudaError_t err_ = (call);                                                     \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                   cudaGetErrorString(err_));                                            \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

struct Options {
  int b = 2, h = 8, h_k = -1, s = 1024, s_k = -1, d = 128, d_v = -1;
  std::string prec = "fp16";
  int mask = 0;  // 0: none, 1: causal (top-left)
  float scale = 0.f;
  int validate = 1, warmup = 5, repeat = 20, seed = 11939;
};

const char* kUsage =
    "usage: fmha_fwd [-b=2] [-h=8] [-h_k=h] [-s=1024] [-s_k=s] [-d=128] [-d_v=d]\n"
    "                [-prec=fp16|bf16] [-mask=0|1] [-scale=1/sqrt(d)] [-v=1]\n"
    "                [-warmup=5] [-repeat=20] [-seed=11939]\n"
    "  -mask: 0 no mask, 1 causal (top-left: query i sees keys 0..i)\n"
    "  -v:    1 checks the output against a float64 CPU reference\n";

bool parse(int argc, char** argv, Options* o) {
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* eq = std::strchr(a, '=');
    if (a[0] != '-' || eq == nullptr) {
      std::fprintf(stderr, "unrecognized argument '%s'\n%s", a, kUsage);
      return false;
    }
    kv[std::string(a + 1, eq)] = eq + 1;
  }
  auto take_int = [&](const char* key, int* dst) {
    if (auto it = kv.find(key); it != kv.end()) {
      *dst = std::atoi(it->second.c_str());
      kv.erase(it);
    }
  };
  take_int("b", &o->b);
  take_int("h", &o->h);
  take_int("h_k", &o->h_k);
  take_int("s", &o->s);
  take_int("s_k", &o->s_k);
  take_int("d", &o->d);
  take_int("d_v", &o->d_v);
  take_int("mask", &o->mask);
  take_int("v", &o->validate);
  take_int("warmup", &o->warmup);
  take_int("repeat", &o->repeat);
  take_int("seed", &o->seed);
  if (auto it = kv.find("prec"); it != kv.end()) o->prec = it->second, kv.erase(it);
  if (auto it = kv.find("scale"); it != kv.end()) o->scale = std::atof(it->second.c_str()), kv.erase(it);
  if (!kv.empty()) {
    std::fprintf(stderr, "unknown option -%s\n%s", kv.begin()->first.c_str(), kUsage);
    return false;
  }
  if (o->prec != "fp16" && o->prec != "bf16") {
    std::fprintf(stderr, "-prec must be fp16 or bf16, not '%s'\n", o->prec.c_str());
    return false;
  }
  if (o->mask != 0 && o->mask != 1) {
    std::fprintf(stderr, "-mask must be 0 (none) or 1 (causal)\n");
    return false;
  }
  if (o->h_k < 0) o->h_k = o->h;
  if (o->s_k < 0) o->s_k = o->s;
  if (o->d_v < 0) o->d_v = o->d;
  if (o->scale == 0.f) o->scale = 1.f / std::sqrt(static_cast<float>(o->d));
  return true;
}

uint16_t to_bits(float x, bool bf16) {
  uint16_t bits;
  if (bf16) {
    __nv_bfloat16 y = __float2bfloat16(x);
    std::memcpy(&bits, &y, 2);
  } else {
    __half y = __float2half(x);
    std::memcpy(&bits, &y, 2);
  }
  return bits;
}

float from_bits(uint16_t bits, bool bf16) {
  if (bf16) {
    __nv_bfloat16 y;
    std::memcpy(&y, &bits, 2);
    return __bfloat162float(y);
  }
  __half y;
  std::memcpy(&y, &bits, 2);
  return __half2float(y);
}

// Contiguous (b, s, h, d) tensor of random values in [-1, 1), rounded to the input precision;
// `values` keeps the rounded values for the reference.
std::vector<uint16_t> random_tensor(size_t n, bool bf16, std::mt19937& rng, std::vector<float>* values) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<uint16_t> bits(n);
  values->resize(n);
  for (size_t i = 0; i < n; ++i) {
    bits[i] = to_bits(dist(rng), bf16);
    (*values)[i] = from_bits(bits[i], bf16);
  }
  return bits;
}

// float64 attention for one (batch, head); returns max |out - ref| over its rows.
double check_head(const Options& o, const std::vector<float>& q, const std::vector<float>& k,
                  const std::vector<float>& v, const std::vector<float>& out, int bi, int hi) {
  const int hk = hi / (o.h / o.h_k);
  std::vector<double> scores(o.s_k);
  double worst = 0.0;
  for (int i = 0; i < o.s; ++i) {
    const float* qi = &q[((size_t(bi) * o.s + i) * o.h + hi) * o.d];
    double row_max = -INFINITY;
    for (int j = 0; j < o.s_k; ++j) {
      if (o.mask == 1 && j > i) {
        scores[j] = -INFINITY;
        continue;
      }
      const float* kj = &k[((size_t(bi) * o.s_k + j) * o.h_k + hk) * o.d];
      double dot = 0.0;
      for (int c = 0; c < o.d; ++c) dot += double(qi[c]) * kj[c];
      scores[j] = dot * o.scale;
      row_max = std::max(row_max, scores[j]);
    }
    double sum = 0.0;
    for (int j = 0; j < o.s_k; ++j) {
      scores[j] = std::isinf(scores[j]) ? 0.0 : std::exp(scores[j] - row_max);
      sum += scores[j];
    }
    for (int c = 0; c < o.d_v; ++c) {
      double acc = 0.0;
      for (int j = 0; j < o.s_k; ++j) acc += scores[j] * v[((size_t(bi) * o.s_k + j) * o.h_k + hk) * o.d_v + c];
      const double ref = sum > 0.0 ? acc / sum : 0.0;
      const double got = out[((size_t(bi) * o.s + i) * o.h + hi) * o.d_v + c];
      const double err = std::isnan(got) ? INFINITY : std::abs(got - ref);
      worst = std::max(worst, err);
    }
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, &o)) return 2;
  const bool bf16 = o.prec == "bf16";
  const size_t nq = size_t(o.b) * o.s * o.h * o.d, nk = size_t(o.b) * o.s_k * o.h_k * o.d;
  const size_t nv = size_t(o.b) * o.s_k * o.h_k * o.d_v, no = size_t(o.b) * o.s * o.h * o.d_v;

  std::mt19937 rng(o.seed);
  std::vector<float> qf, kf, vf;
  const auto qh = random_tensor(nq, bf16, rng, &qf);
  const auto kh = random_tensor(nk, bf16, rng, &kf);
  const auto vh = random_tensor(nv, bf16, rng, &vf);

  void *q, *k, *v, *out;
  CHECK_CUDA(cudaMalloc(&q, nq * 2));
  CHECK_CUDA(cudaMalloc(&k, nk * 2));
  CHECK_CUDA(cudaMalloc(&v, nv * 2));
  CHECK_CUDA(cudaMalloc(&out, no * 2));
  CHECK_CUDA(cudaMemcpy(q, qh.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(k, kh.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(v, vh.data(), nv * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(out, 0xff, no * 2));  // NaN in both fp16 and bf16: unwritten shows up

  fmha::FwdArgs a;
  a.dtype = bf16 ? fmha::DataType::kBF16 : fmha::DataType::kFP16;
  a.mask = o.mask == 1 ? fmha::MaskType::kCausalTopLeft : fmha::MaskType::kNone;
  a.q = q, a.k = k, a.v = v, a.o = out;
  a.batch = o.b, a.seqlen_q = o.s, a.seqlen_k = o.s_k, a.nhead_q = o.h, a.nhead_k = o.h_k;
  a.hdim_q = o.d, a.hdim_v = o.d_v;
  a.q_batch_stride = int64_t(o.s) * o.h * o.d, a.q_seq_stride = int64_t(o.h) * o.d, a.q_head_stride = o.d;
  a.k_batch_stride = int64_t(o.s_k) * o.h_k * o.d, a.k_seq_stride = int64_t(o.h_k) * o.d, a.k_head_stride = o.d;
  a.v_batch_stride = int64_t(o.s_k) * o.h_k * o.d_v, a.v_seq_stride = int64_t(o.h_k) * o.d_v, a.v_head_stride = o.d_v;
  a.o_batch_stride = int64_t(o.s) * o.h * o.d_v, a.o_seq_stride = int64_t(o.h) * o.d_v, a.o_head_stride = o.d_v;
  a.softmax_scale = o.scale;

  std::string instance;
  fmha::Status st = fmha::fwd(a, nullptr, &instance);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.message.c_str());
    return 1;
  }
  CHECK_CUDA(cudaDeviceSynchronize());

  bool valid = true;
  double max_err = 0.0;
  if (o.validate) {
    std::vector<uint16_t> oh(no);
    CHECK_CUDA(cudaMemcpy(oh.data(), out, no * 2, cudaMemcpyDeviceToHost));
    std::vector<float> of(no);
    for (size_t i = 0; i < no; ++i) of[i] = from_bits(oh[i], bf16);
    for (int bi = 0; bi < o.b; ++bi) {
      for (int hi = 0; hi < o.h; ++hi) max_err = std::max(max_err, check_head(o, qf, kf, vf, of, bi, hi));
    }
    // Outputs are averages of values in [-1, 1): rounding the output alone costs up to 2^-11
    // (fp16) or 2^-8 (bf16); P rounded for the second product adds about as much again.
    const double tolerance = bf16 ? 2e-2 : 4e-3;
    valid = max_err <= tolerance;
  }

  for (int i = 0; i < o.warmup; ++i) {
    if (!(st = fmha::fwd(a, nullptr)).ok()) break;
  }
  std::vector<float> times;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < o.repeat && st.ok(); ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    st = fmha::fwd(a, nullptr);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.message.c_str());
    return 1;
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(times.begin(), times.end());
  const double ms = times.empty() ? 0.0 : times[times.size() / 2];
  // FlashAttention's count: 2 GEMMs of 2*s*s_k*d each, halved for causal.
  const double flops = 2.0 * o.b * o.h * double(o.s) * o.s_k * (o.d + o.d_v) / (o.mask == 1 ? 2.0 : 1.0);
  std::printf("[%s] b:%d, h:%d/%d, s:%d/%d, d:%d/%d, mask:%s, instance:%s, %.4f ms, %.1f TFlops",
              o.prec.c_str(), o.b, o.h, o.h_k, o.s, o.s_k, o.d, o.d_v, o.mask ? "causal" : "none",
              instance.c_str(), ms, ms > 0 ? flops / ms * 1e-9 : 0.0);
  if (o.validate) std::printf(", max_err:%.3g, valid:%s", max_err, valid ? "y" : "n");
  std::printf("\n");

  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(out);
  return valid ? 0 : 1;
}
