// fmha_bwd: one backward problem through fmha::bwd, with the flags of CK-Tile's
// tile_example_fmha_bwd for everything fmha.h offers. Runs fmha::fwd (with the log-sum-exp)
// on random inputs, then fmha::bwd on a random dO; prints the problem, the backward's median
// time and TFLOP/s; with -v=1 also checks dQ, dK, dV (and dBias) against a float64 CPU
// reference (fmha_bwd_reference.h). Exit status: 0 done (and valid), 1 a failed call or a wrong
// result, 2 bad flags.
//
//   fmha_bwd -b=2 -h=16 -s=4096 -d=128 -prec=bf16 -mask=1
//   fmha_bwd -mode=1 -b=3 -s=100,200,0 -mask=b:64,0 -bias=e -dbias=1 -deterministic=1
//   fmha_bwd -? lists the flags
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fmha/fmha.h"
#include "fmha_bwd_reference.h"
#include "fmha_example_common.h"
#include "fmha_fwd_reference.h"

namespace {

using namespace fmha_example;

const char* kUsage = R"(usage: fmha_bwd [-flag=value ...]
  -v              1: check dQ, dK, dV (and dBias) against a float64 CPU reference (default 1)
  -mode           0: batch, 1: group (varlen: sequences of their own lengths, packed) (default 0)
  -b              batch size: sequences (default 2)
  -h              query heads (default 8)
  -h_k            key/value heads, a divisor of -h (MQA/GQA); -1: -h (default -1)
  -s              query length (default 1024). Group mode: the longest of random lengths in
                  [1, s], or one length per sequence: -s=100,200,0
  -s_k            key length, as -s; -1: as -s (group mode: each sequence's query length)
                  (default -1)
  -s_qpad         group mode: each sequence's stride in query rows (>= its length), one value
                  for all or one per sequence; -1: packed (default -1)
  -s_kpad         group mode: the same for keys and values (default -1)
  -q_eff_lens     batch mode: the query rows each sequence uses (<= -s), one per sequence
                  (default: all)
  -kv_eff_lens    batch mode: the keys each sequence uses (<= -s_k) (default: all)
  -d              head dim of q and k (default 128)
  -d_v            head dim of v; -1: -d (default -1)
  -scale_s        softmax scale, > 0; 0: 1/sqrt(d) (default 0)
  -bias           n or 0: none
                  e or 1: elementwise bias, one 1*1*s*s for all (e:1 1*h*s*s, e:2 b*h*s*s)
                  a or 2: ALiBi, one slope per head (a:1 one per sequence and head) (default n)
  -dbias          1: also write (and check) the gradient of the elementwise bias, as a full
                  b*h*s*s tensor (default 0)
  -mask           0 or n: none; 1 or t: causal, top-left; 2 or b: causal, bottom-right
                  t:l,r / b:l,r: sliding window, l keys left and r right of the top-left /
                  bottom-right aligned diagonal, -1 unbounded (t:-1,0 is causal)
                  xt:w / xb:w: xformers' window of w keys (default 0)
  -p_drop         dropout probability, in [0, 1) (default 0)
  -drop_seed      dropout seed (default 1)
  -drop_offset    dropout offset (default 0)
  -softcap        > 0: logits become softcap * tanh(logits / softcap) (default 0)
  -deterministic  1: dQ summed in a fixed order, gradients bitwise identical from run to run
                  (checked: the last timed run's against the checked one's) (default 0)
  -prec           fp16 or bf16 (default fp16)
  -kname          1: print the instances that ran, forward and backward (default 0)
  -json           1: print the results as one JSON object (default 0)
  -warmup         untimed backward runs before timing (default 5)
  -repeat         timed backward runs; the median is reported (default 20)
  -seed           input RNG seed; 0: nondeterministic (default 11939)
Inputs and dO are random in [-1, 1); Q, K, V, O, dO and the gradients are (batch, seqlen, head,
hdim), packed tokens in group mode. ALiBi without a mask is aligned bottom-right.
)";

struct BwdOptions {
  bool dbias = false, deterministic = false;
};

Problem parse(int argc, char** argv, Settings* run, BwdOptions* options, std::mt19937* rng) {
  Flags flags(argc, argv);
  Problem p = parse_problem(flags, run, rng);
  p.lse = true;  // the backward reads the forward's log-sum-exp
  options->dbias = flags.integer("dbias", 0, 0, 1);
  options->deterministic = flags.integer("deterministic", 0, 0, 1);
  if (options->dbias && p.bias != fmha::BiasType::kElementwise) {
    throw UsageError("-dbias=1 is the gradient of an elementwise bias: give -bias=e (or e:1, e:2)");
  }
  flags.finish();
  return p;
}

// A failed call ends the program with its message, and fmha::explain's on a miss.
template <class Args>
void exit_on_error(const char* what, const fmha::Status& st, const Args& args) {
  if (st.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, st.message.c_str());
  std::string why;
  if (st.code == fmha::Status::Code::kNoInstance && fmha::explain(args, &why).ok() && !why.empty()) {
    std::fprintf(stderr, "%s\n", why.c_str());
  }
  std::exit(1);
}

void launch(const fmha::BwdArgs& a, std::string* chosen) {
  exit_on_error("fmha::bwd", fmha::bwd(a, nullptr, chosen), a);
  CHECK_CUDA(cudaGetLastError());
}

// Median milliseconds of `repeat` backward calls, each timed with CUDA events after `warmup`
// untimed ones.
double time_ms(const fmha::BwdArgs& a, int warmup, int repeat) {
  for (int i = 0; i < warmup; ++i) launch(a, nullptr);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < repeat; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    launch(a, nullptr);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times.empty() ? NAN : times[times.size() / 2];
}

int64_t dbias_elements(const Problem& p) { return int64_t(p.batch) * p.nhead_q * p.bias_rows * p.bias_ld; }

// The backward of the forward call `fwd` (which has run): dO random (its values in `dout`), dQ,
// dK, dV (and dBias: the full tensor, zeroed, since a caller sums it over the dimensions its
// bias broadcasts and rows past a sequence's end are not written) in the layouts of Q, K, V,
// and a workspace of the size fmha::bwd_workspace_size asks for.
fmha::BwdArgs make_bwd_args(const Problem& p, const fmha::FwdArgs& fwd, const BwdOptions& options,
                            std::mt19937& rng, DeviceMemory* mem, std::vector<float>* dout) {
  fmha::BwdArgs a;
  a.fwd = fwd;
  a.dout = mem->upload(random_tensor(p.tokens_q() * p.nhead_q * p.hdim_v, p.dtype, rng, dout));
  a.dout_batch_stride = fwd.o_batch_stride, a.dout_seq_stride = fwd.o_seq_stride, a.dout_head_stride = fwd.o_head_stride;
  a.dq = mem->alloc(p.tokens_q() * p.nhead_q * p.hdim_q * 2);
  a.dk = mem->alloc(p.tokens_k() * p.nhead_k * p.hdim_q * 2);
  a.dv = mem->alloc(p.tokens_k() * p.nhead_k * p.hdim_v * 2);
  a.dq_batch_stride = fwd.q_batch_stride, a.dq_seq_stride = fwd.q_seq_stride, a.dq_head_stride = fwd.q_head_stride;
  a.dk_batch_stride = fwd.k_batch_stride, a.dk_seq_stride = fwd.k_seq_stride, a.dk_head_stride = fwd.k_head_stride;
  a.dv_batch_stride = fwd.v_batch_stride, a.dv_seq_stride = fwd.v_seq_stride, a.dv_head_stride = fwd.v_head_stride;
  if (options.dbias) {
    a.dbias = mem->alloc(dbias_elements(p) * 2);
    CHECK_CUDA(cudaMemset(a.dbias, 0, dbias_elements(p) * 2));
    a.dbias_seq_stride = p.bias_ld;
    a.dbias_head_stride = int64_t(p.bias_rows) * p.bias_ld;
    a.dbias_batch_stride = p.nhead_q * a.dbias_head_stride;
  }
  a.deterministic = options.deterministic;
  size_t bytes = 0;
  exit_on_error("fmha::bwd_workspace_size", fmha::bwd_workspace_size(a, &bytes), a);
  a.workspace = mem->alloc(bytes);
  a.workspace_bytes = bytes;
  return a;
}

// The gradients the backward wrote, as floats.
Gradients download_grads(const Problem& p, const fmha::BwdArgs& a) {
  Gradients g;
  g.dq = download(a.dq, p.tokens_q() * p.nhead_q * p.hdim_q, p.dtype);
  g.dk = download(a.dk, p.tokens_k() * p.nhead_k * p.hdim_q, p.dtype);
  g.dv = download(a.dv, p.tokens_k() * p.nhead_k * p.hdim_v, p.dtype);
  if (a.dbias) g.dbias = download(a.dbias, dbias_elements(p), p.dtype);
  return g;
}

// Bitwise equality of two runs' gradients (NaN payloads included).
bool same_bits(const Gradients& x, const Gradients& y) {
  auto eq = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  return eq(x.dq, y.dq) && eq(x.dk, y.dk) && eq(x.dv, y.dv) && eq(x.dbias, y.dbias);
}

// The program, but for running out of host memory: its exit status.
int run_program(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "-?") || !std::strcmp(argv[i], "--help")) {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  Settings run;
  BwdOptions options;
  std::mt19937 rng;
  Problem p;
  try {
    p = parse(argc, argv, &run, &options, &rng);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "fmha_bwd: %s (fmha_bwd -? lists the flags)\n", e.what());
    return 2;
  }
  // The library's checks of the forward call's sizes and options (the backward's sizes are
  // its), before any buffer is allocated: a problem past its limits would otherwise first fill
  // host buffers of its size. Which instances run (or that none does), and whether there is a
  // GPU, the calls themselves say.
  const fmha::Status checked = fmha::select(describe_fwd(p), nullptr);
  if (checked.code == fmha::Status::Code::kInvalidArgument) {
    std::fprintf(stderr, "%s\n", checked.message.c_str());
    return 1;
  }
  const bool bf16 = p.dtype == fmha::DataType::kBF16;

  DeviceMemory mem;
  HostInputs in;
  const fmha::FwdArgs fwd = make_fwd_args(p, rng, &mem, &in);
  std::string fwd_instance, bwd_instance;
  exit_on_error("fmha::fwd", fmha::fwd(fwd, nullptr, &fwd_instance), fwd);
  const std::vector<float> out = download(fwd.o, p.tokens_q() * p.nhead_q * p.hdim_v, p.dtype);
  std::vector<float> dout;
  const fmha::BwdArgs a = make_bwd_args(p, fwd, options, rng, &mem, &dout);

  // The checked run, on gradients and a workspace poisoned with NaN (0xffff in fp16 and bf16,
  // 0xffffffff in fp32): whatever the backward leaves unwritten or reads uncleared shows.
  CHECK_CUDA(cudaMemset(a.dq, 0xff, p.tokens_q() * p.nhead_q * p.hdim_q * 2));
  CHECK_CUDA(cudaMemset(a.dk, 0xff, p.tokens_k() * p.nhead_k * p.hdim_q * 2));
  CHECK_CUDA(cudaMemset(a.dv, 0xff, p.tokens_k() * p.nhead_k * p.hdim_v * 2));
  CHECK_CUDA(cudaMemset(a.workspace, 0xff, a.workspace_bytes));
  launch(a, &bwd_instance);
  CHECK_CUDA(cudaDeviceSynchronize());
  const Gradients got = download_grads(p, a);

  const double ms = time_ms(a, run.warmup, run.repeat);
  // Five GEMMs over the (query, key) pairs the mask leaves visible: S = QK^T, dP = dO V^T and
  // dV, dK, dQ; 2.5x the forward's FLOPs when hdim_q = hdim_v (FlashAttention's convention).
  const double flops =
      2.0 * p.nhead_q * (3.0 * p.hdim_q + 2.0 * p.hdim_v) * double(visible_pairs(p));
  const double tflops = flops / ms * 1e-9;

  // Deterministic mode: the last run's gradients (a timed run's, or one more) have the checked
  // run's bits.
  bool reproducible = true;
  if (options.deterministic) {
    if (run.warmup + run.repeat == 0) launch(a, nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
    reproducible = same_bits(got, download_grads(p, a));
  }

  // Each gradient's error relative to its largest value (or to 1): its rounding to the dtype
  // costs 2^-9 (bf16) or 2^-12 (fp16), P and dS rounded for their GEMMs as much again several
  // times over (device_check.sh's problems at d64 on an H100: up to 4.2e-3 in bf16, 4.2e-4 in
  // fp16); dropout scales by 1 / (1 - p). Soft-capping allows for a hardware tanh on each
  // logit, as fmha_fwd does.
  const double logit_tol = p.softcap * 1e-3;
  const double tol = ((bf16 ? 1e-2 : 2e-3) + 2 * logit_tol) / (1.0 - p.p_drop);
  BwdErrors err;
  bool valid = reproducible;
  if (run.verify) {
    err = check_bwd(p, in, out, dout, got, options.dbias);
    for (const GradError* g : {&err.dq, &err.dk, &err.dv, &err.dbias}) valid = valid && g->relative() <= tol;
  }

  const char* prec = bf16 ? "bf16" : "fp16";
  const char* mode = p.mode == fmha::Mode::kBatch ? "batch" : "group";
  if (run.json) {
    Json j;
    j.text("prec", prec).text("mode", mode).integer("b", p.batch).integer("h", p.nhead_q).integer("h_k", p.nhead_k);
    j.integers("seqlens_q", p.len_q).integers("seqlens_k", p.len_k);
    j.integers("rows_q", p.rows_q).integers("rows_k", p.rows_k);
    j.integer("d", p.hdim_q).integer("d_v", p.hdim_v).number("scale_s", p.scale);
    j.text("bias", bias_name(p)).boolean("dbias", options.dbias).text("mask", mask_name(p));
    j.number("p_drop", p.p_drop).integer("drop_seed", int64_t(p.drop_seed)).integer("drop_offset", p.drop_offset);
    j.number("softcap", p.softcap).boolean("deterministic", options.deterministic).integer("seed", run.seed);
    j.text("fwd_instance", fwd_instance).text("instance", bwd_instance);
    j.integer("workspace_bytes", int64_t(a.workspace_bytes));
    j.number("ms", ms).number("tflops", tflops).number("flops", flops);
    if (options.deterministic) j.boolean("reproducible", reproducible);
    if (run.verify) {
      j.boolean("valid", valid).number("tolerance", tol);
      j.number("dq_rel_err", err.dq.relative()).number("dk_rel_err", err.dk.relative());
      j.number("dv_rel_err", err.dv.relative());
      if (options.dbias) j.number("dbias_rel_err", err.dbias.relative());
    } else {
      j.raw("valid", "null");
    }
    std::printf("%s\n", j.str().c_str());
  } else {
    std::printf("[%s|%s] b:%d, h:%d/%d, ", prec, mode, p.batch, p.nhead_q, p.nhead_k);
    if (p.mode == fmha::Mode::kGroup) {
      std::printf("s:%d/%d (longest), tokens:%lld/%lld, ", *std::max_element(p.len_q.begin(), p.len_q.end()),
                  *std::max_element(p.len_k.begin(), p.len_k.end()), (long long)sum(p.len_q),
                  (long long)sum(p.len_k));
    } else {
      std::printf("s:%d/%d, ", p.rows_q[0], p.rows_k[0]);
      if (p.seqused_q || p.seqused_k) std::printf("eff_tokens:%lld/%lld, ", (long long)sum(p.len_q), (long long)sum(p.len_k));
    }
    std::printf("d:%d/%d, scale_s:%g, bias:%s, dbias:%d, p_drop:%g, softcap:%g, mask:%s, deterministic:%d, "
                "workspace:%.1f MiB, ",
                p.hdim_q, p.hdim_v, p.scale, bias_name(p).c_str(), int(options.dbias), p.p_drop, p.softcap,
                mask_name(p).c_str(), int(options.deterministic), double(a.workspace_bytes) / (1 << 20));
    if (run.kname) std::printf("%s, %s, ", fwd_instance.c_str(), bwd_instance.c_str());
    if (run.repeat > 0) std::printf("%.4f ms, %.2f TFlops, ", ms, tflops);
    std::printf("valid:%s\n", run.verify ? (valid ? "y" : "n") : "-");
  }
  const std::pair<const char*, const GradError*> grads[] = {
      {"dq", &err.dq}, {"dk", &err.dk}, {"dv", &err.dv}, {"dbias", &err.dbias}};
  for (const auto& [name, g] : grads) {
    if (g->relative() > tol) {
      std::fprintf(stderr, "%s: max_err %.3g (%.3g of its largest value %.3g) above the tolerance %.3g, at "
                   "batch %d head %d row %d\n", name, g->err, g->relative(), g->ref_max, tol, g->worst_b,
                   g->worst_h, g->worst_row);
    }
  }
  if (!reproducible) std::fprintf(stderr, "deterministic mode: a later run's gradients differ in their bits\n");
  return valid ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // The host may not hold what the flags ask for: the per-sequence lengths, the inputs, dO and
  // the gradients drawn there and kept as floats for the reference.
  try {
    return run_program(argc, argv);
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {  // a std::vector longer than any allocation
  }
  std::fprintf(stderr, "fmha_bwd: out of host memory for the problem's buffers; choose smaller "
               "sizes\n");
  return 1;
}
