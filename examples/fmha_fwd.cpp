// fmha_fwd: one forward problem through fmha::fwd, with the flags of CK-Tile's
// tile_example_fmha_fwd for everything fmha.h offers. Prints the problem, the median time and
// TFLOP/s; with -v=1 also checks the output (and the log-sum-exp) against a float64 CPU
// reference (fmha_fwd_reference.h). Exit status: 0 done (and valid), 1 a failed call or a wrong
// result, 2 bad flags.
//
//   fmha_fwd -b=2 -h=16 -s=4096 -d=128 -prec=bf16 -mask=1
//   fmha_fwd -b=2 -h=16 -s=4096 -d=128 -prec=fp8 -mask=1     (H100/H200)
//   fmha_fwd -mode=1 -b=3 -s=100,200,0 -mask=b:64,0 -bias=a -lse=1
//   fmha_fwd -? lists the flags
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fmha/fmha.h"
#include "fmha_fwd_reference.h"

namespace {

using fmha_example::HostInputs;
using fmha_example::Problem;

#define CHECK_CUDA(call)                                                                 \
  do {                                                                                   \
    const cudaError_t err_ = (call);                                                     \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                   cudaGetErrorString(err_));                                            \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

const char* kUsage = R"(usage: fmha_fwd [-flag=value ...]
  -v            1: check against a float64 CPU reference (default 1)
  -mode         0: batch, 1: group (varlen: sequences of their own lengths, packed) (default 0)
  -b            batch size: sequences (default 2)
  -h            query heads (default 8)
  -h_k          key/value heads, a divisor of -h (MQA/GQA); -1: -h (default -1)
  -s            query length (default 1024). Group mode: the longest of random lengths in
                [1, s], or one length per sequence: -s=100,200,0
  -s_k          key length, as -s; -1: as -s (group mode: each sequence's query length)
                (default -1)
  -s_qpad       group mode: each sequence's stride in query rows (>= its length), one value
                for all or one per sequence; -1: packed (default -1)
  -s_kpad       group mode: the same for keys and values (default -1)
  -q_eff_lens   batch mode: the query rows each sequence uses (<= -s), one per sequence:
                -q_eff_lens=1024,1536 (default: all)
  -kv_eff_lens  batch mode: the keys each sequence uses (<= -s_k) (default: all)
  -d            head dim of q and k (default 128)
  -d_v          head dim of v; -1: -d (default -1)
  -scale_s      softmax scale, > 0; 0: 1/sqrt(d) (default 0)
  -bias         n or 0: none
                e or 1: elementwise bias, one 1*1*s*s for all (e:1 1*h*s*s, e:2 b*h*s*s)
                a or 2: ALiBi, one slope per head (a:1 one per sequence and head) (default n)
  -mask         0 or n: none; 1 or t: causal, top-left; 2 or b: causal, bottom-right
                t:l,r / b:l,r: sliding window, l keys left and r right of the top-left /
                bottom-right aligned diagonal, -1 unbounded (t:-1,0 is causal)
                xt:w / xb:w: xformers' window of w keys (left w/2, right w-1-w/2; w <= 0:
                causal) (default 0)
  -vlayout      r: V is (s_k, d_v) per head, row-major; c: (d_v, s_k) (default r)
  -lse          1: also write (and check) the log-sum-exp (default 0)
  -p_drop       dropout probability, in [0, 1) (default 0)
  -drop_seed    dropout seed (default 1)
  -drop_offset  dropout offset (default 0)
  -softcap      > 0: logits become softcap * tanh(logits / softcap) (default 0)
  -prec         fp16, bf16, or fp8: float8 e4m3 Q, K and V (descales 1), O in bf16; the fa3
                pipeline, H100/H200 (default fp16)
  -kname        1: print the instance that ran (default 0)
  -json         1: print the results as one JSON object (default 0)
  -warmup       untimed runs before timing (default 5)
  -repeat       timed runs; the median is reported (default 20)
  -seed         input RNG seed; 0: nondeterministic (default 11939)
Inputs are random in [-1, 1); Q, K, V, O are (batch, seqlen, head, hdim), packed tokens in
group mode. ALiBi without a mask is aligned bottom-right, as in CK and FlashAttention.
)";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The -name=value arguments, a later one overriding an earlier; each take() consumes one and
// finish() rejects what is left.
class Flags {
 public:
  Flags(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const size_t eq = arg.find('=');
      if (arg.size() < 3 || arg[0] != '-' || eq == std::string::npos || eq == 1) {
        throw UsageError("expected -name=value, got '" + arg + "'");
      }
      values_[arg.substr(1, eq - 1)] = arg.substr(eq + 1);
    }
  }
  std::optional<std::string> take(const std::string& name) {
    const auto it = values_.find(name);
    if (it == values_.end()) return std::nullopt;
    std::string value = it->second;
    values_.erase(it);
    return value;
  }
  void finish() const {
    if (!values_.empty()) throw UsageError("unknown flag -" + values_.begin()->first);
  }

 private:
  std::map<std::string, std::string> values_;
};

int64_t parse_int(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0) {
    throw UsageError("-" + flag + ": '" + text + "' is not an integer");
  }
  if (value < lo || value > hi) {
    throw UsageError("-" + flag + "=" + text + " is outside [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  }
  return value;
}

double parse_float(const std::string& flag, const std::string& text, double lo, double hi_excl) {
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno != 0 || !std::isfinite(value)) {
    throw UsageError("-" + flag + ": '" + text + "' is not a number");
  }
  if (value < lo || value >= hi_excl) {
    char range[64];
    std::snprintf(range, sizeof range, " is outside [%g, %g)", lo, hi_excl);
    throw UsageError("-" + flag + "=" + text + range);
  }
  return value;
}

std::vector<int> parse_ints(const std::string& flag, const std::string& text, int lo, int hi) {
  std::vector<int> values;
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    values.push_back(int(parse_int(flag, text.substr(start, comma - start), lo, hi)));
    if (comma == std::string::npos) return values;
    start = comma + 1;
  }
}

// A per-sequence list: exactly one value per sequence.
std::vector<int> per_sequence(const std::string& flag, const std::string& text, int batch, int lo, int hi) {
  std::vector<int> values = parse_ints(flag, text, lo, hi);
  if (int(values.size()) != batch) {
    throw UsageError("-" + flag + " needs one value per sequence (-b=" + std::to_string(batch) + "), got " +
                     std::to_string(values.size()));
  }
  return values;
}

// Group mode's lengths: one value per sequence as given, or one value for all that is the
// longest of random lengths in [1, value].
std::vector<int> group_lengths(const std::string& flag, const std::string& text, int batch, std::mt19937& rng) {
  const std::vector<int> values = parse_ints(flag, text, 0, INT_MAX);
  if (int(values.size()) == batch) return values;
  if (values.size() != 1 || values[0] < 1) {
    throw UsageError("-" + flag + "=" + text + ": give one length per sequence (-b=" + std::to_string(batch) +
                     ") or one longest length >= 1");
  }
  std::uniform_int_distribution<int> length(1, values[0]);
  std::vector<int> lengths(batch);
  for (int& l : lengths) l = length(rng);
  return lengths;
}

// Group mode's strides (-s_qpad, -s_kpad): one per sequence or one for all; -1 packed.
std::vector<int> group_rows(const std::string& flag, const std::optional<std::string>& text,
                            const std::vector<int>& lengths) {
  if (!text) return lengths;
  const int batch = int(lengths.size());
  std::vector<int> rows = parse_ints(flag, *text, -1, INT_MAX);
  if (rows.size() == 1) rows.assign(batch, rows[0]);
  if (int(rows.size()) != batch) {
    throw UsageError("-" + flag + " needs one stride for all or one per sequence (-b=" +
                     std::to_string(batch) + "), got " + std::to_string(rows.size()));
  }
  for (int b = 0; b < batch; ++b) {
    if (rows[b] < 0) {
      rows[b] = lengths[b];
    } else if (rows[b] < lengths[b]) {
      throw UsageError("-" + flag + ": sequence " + std::to_string(b) + " has length " +
                       std::to_string(lengths[b]) + ", above its stride " + std::to_string(rows[b]));
    }
  }
  return rows;
}

std::vector<int64_t> prefix_sums(const std::vector<int>& rows) {
  std::vector<int64_t> sums{0};
  for (int r : rows) sums.push_back(sums.back() + r);
  if (sums.back() > INT32_MAX) throw UsageError("more than 2^31 - 1 tokens");
  return sums;
}

// -mask in CK's spellings, as fmha.h's (type, alignment, window). A window that is causal or
// unbounded on both sides becomes kCausal or kNone, as CK's dispatch does.
void parse_mask(const std::string& text, Problem* p) {
  using fmha::MaskAlign;
  using fmha::MaskType;
  p->align = MaskAlign::kTopLeft;
  if (text == "0" || text == "n") {
    p->mask = MaskType::kNone;
    p->align = MaskAlign::kBottomRight;  // only ALiBi reads it then
    return;
  }
  if (text == "1" || text == "t" || text == "2" || text == "b") {
    p->mask = MaskType::kCausal;
    if (text == "2" || text == "b") p->align = MaskAlign::kBottomRight;
    return;
  }
  const size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon), value = colon == std::string::npos ? "" : text.substr(colon + 1);
  if (kind == "t" || kind == "b") {
    const size_t comma = value.find(',');
    if (comma == std::string::npos) throw UsageError("-mask=" + text + ": a window is t:left,right or b:left,right");
    p->window_left = int(parse_int("mask", value.substr(0, comma), INT_MIN, INT_MAX));
    p->window_right = int(parse_int("mask", value.substr(comma + 1), INT_MIN, INT_MAX));
  } else if (kind == "xt" || kind == "xb") {
    const int size = int(parse_int("mask", value, INT_MIN, INT_MAX));
    p->window_left = size > 0 ? size / 2 : -1;
    p->window_right = size > 0 ? size - 1 - size / 2 : 0;
  } else if (kind == "g") {
    throw UsageError("-mask=" + text + ": CK's generic mask coordinates are not in fmha.h; "
                     "use t:left,right or b:left,right");
  } else {
    throw UsageError("-mask=" + text + " is none of 0 n 1 t 2 b t:l,r b:l,r xt:w xb:w");
  }
  if (kind.back() == 'b') p->align = MaskAlign::kBottomRight;
  p->window_left = std::max(p->window_left, -1);  // any negative size is unbounded: fmha.h's -1
  p->window_right = std::max(p->window_right, -1);
  p->mask = MaskType::kWindow;
  if (p->window_left < 0 && p->window_right < 0) {
    p->mask = MaskType::kNone;
  } else if (p->window_left < 0 && p->window_right == 0) {
    p->mask = MaskType::kCausal;
  }
  if (p->mask != MaskType::kWindow) p->window_left = p->window_right = -1;
}

void parse_bias(const std::string& text, Problem* p) {
  p->bias_per_batch = p->bias_per_head = false;
  if (text == "n" || text == "0") {
    p->bias = fmha::BiasType::kNone;
  } else if (text == "e" || text == "1" || text == "e:0" || text == "e:1" || text == "e:2") {
    p->bias = fmha::BiasType::kElementwise;
    p->bias_per_head = text == "e:1" || text == "e:2";
    p->bias_per_batch = text == "e:2";
  } else if (text == "a" || text == "2" || text == "a:0" || text == "a:1") {
    p->bias = fmha::BiasType::kAlibi;
    p->bias_per_batch = text == "a:1";
  } else {
    throw UsageError("-bias=" + text + " is none of n e e:1 e:2 a a:1 (or 0 1 2)");
  }
}

struct Settings {
  bool verify = true, kname = false, json = false;
  int warmup = 5, repeat = 20;
  uint32_t seed = 0;
};

Problem parse(int argc, char** argv, Settings* run, std::mt19937* rng) {
  Flags flags(argc, argv);
  auto integer = [&](const char* name, int64_t fallback, int64_t lo, int64_t hi) {
    const auto text = flags.take(name);
    return text ? parse_int(name, *text, lo, hi) : fallback;
  };
  auto real = [&](const char* name, double lo, double hi_excl) {
    const auto text = flags.take(name);
    return text ? parse_float(name, *text, lo, hi_excl) : 0.0;
  };
  auto one_of = [&](const char* name, const char* fallback, std::vector<std::string> choices) {
    const std::string value = flags.take(name).value_or(fallback);
    if (std::find(choices.begin(), choices.end(), value) == choices.end()) {
      std::string list;
      for (const auto& c : choices) list += " " + c;
      throw UsageError("-" + std::string(name) + "=" + value + " is none of" + list);
    }
    return value;
  };

  run->verify = integer("v", 1, 0, 1);
  run->kname = integer("kname", 0, 0, 1);
  run->json = integer("json", 0, 0, 1);
  run->warmup = int(integer("warmup", 5, 0, INT_MAX));
  run->repeat = int(integer("repeat", 20, 0, INT_MAX));
  run->seed = uint32_t(integer("seed", 11939, 0, UINT32_MAX));
  rng->seed(run->seed != 0 ? run->seed : std::random_device{}());

  Problem p;
  p.mode = integer("mode", 0, 0, 1) ? fmha::Mode::kGroup : fmha::Mode::kBatch;
  const std::string prec = one_of("prec", "fp16", {"fp16", "bf16", "fp8"});
  p.dtype = prec == "fp8"    ? fmha::DataType::kE4M3
            : prec == "bf16" ? fmha::DataType::kBF16
                             : fmha::DataType::kFP16;
  p.batch = int(integer("b", 2, 1, INT_MAX));
  p.nhead_q = int(integer("h", 8, 1, INT_MAX));
  p.nhead_k = int(integer("h_k", -1, -1, INT_MAX));
  if (p.nhead_k <= 0) p.nhead_k = p.nhead_q;
  if (p.nhead_q % p.nhead_k != 0) throw UsageError("-h_k must divide -h (MQA/GQA)");
  p.hdim_q = int(integer("d", 128, 1, INT_MAX));
  p.hdim_v = int(integer("d_v", -1, -1, INT_MAX));
  if (p.hdim_v <= 0) p.hdim_v = p.hdim_q;
  p.scale = float(real("scale_s", 0.0, HUGE_VAL));
  if (p.scale == 0.f) p.scale = 1.f / std::sqrt(float(p.hdim_q));
  parse_mask(flags.take("mask").value_or("0"), &p);
  parse_bias(flags.take("bias").value_or("n"), &p);
  p.vlayout = one_of("vlayout", "r", {"r", "c"}) == "c" ? fmha::VLayout::kColMajor : fmha::VLayout::kRowMajor;
  p.lse = integer("lse", 0, 0, 1);
  p.p_drop = float(real("p_drop", 0.0, 1.0));
  p.drop_seed = uint64_t(integer("drop_seed", 1, 0, INT64_MAX));
  p.drop_offset = uint32_t(integer("drop_offset", 0, 0, UINT32_MAX));
  p.softcap = float(real("softcap", 0.0, HUGE_VAL));

  const std::string s = flags.take("s").value_or("1024");
  const std::optional<std::string> s_k = flags.take("s_k"), s_qpad = flags.take("s_qpad"),
                                   s_kpad = flags.take("s_kpad"), q_eff = flags.take("q_eff_lens"),
                                   kv_eff = flags.take("kv_eff_lens");
  const bool s_k_given = s_k && *s_k != "-1";
  if (p.mode == fmha::Mode::kBatch) {
    if (s_qpad || s_kpad) {
      throw UsageError("-s_qpad and -s_kpad are for group mode (-mode=1); batch mode takes "
                       "-q_eff_lens and -kv_eff_lens");
    }
    if (s.find(',') != std::string::npos || (s_k && s_k->find(',') != std::string::npos)) {
      throw UsageError("-s and -s_k take one length in batch mode; per-sequence lengths are "
                       "group mode's (-mode=1) or -q_eff_lens/-kv_eff_lens");
    }
    const int seqlen_q = int(parse_int("s", s, 1, INT_MAX));
    const int seqlen_k = s_k_given ? int(parse_int("s_k", *s_k, 1, INT_MAX)) : seqlen_q;
    p.rows_q.assign(p.batch, seqlen_q);
    p.rows_k.assign(p.batch, seqlen_k);
    p.len_q = q_eff ? per_sequence("q_eff_lens", *q_eff, p.batch, 0, seqlen_q) : p.rows_q;
    p.len_k = kv_eff ? per_sequence("kv_eff_lens", *kv_eff, p.batch, 0, seqlen_k) : p.rows_k;
    p.seqused_q = bool(q_eff);
    p.seqused_k = bool(kv_eff);
  } else {
    if (q_eff || kv_eff) {
      throw UsageError("-q_eff_lens and -kv_eff_lens are for batch mode (-mode=0); group mode "
                       "pads sequences with -s_qpad and -s_kpad");
    }
    p.len_q = group_lengths("s", s, p.batch, *rng);
    p.len_k = s_k_given ? group_lengths("s_k", *s_k, p.batch, *rng) : p.len_q;
    p.rows_q = group_rows("s_qpad", s_qpad, p.len_q);
    p.rows_k = group_rows("s_kpad", s_kpad, p.len_k);
    p.seqused_q = p.rows_q != p.len_q;
    p.seqused_k = p.rows_k != p.len_k;
  }
  p.cu_q = prefix_sums(p.rows_q);
  p.cu_k = prefix_sums(p.rows_k);
  // An elementwise bias covers the longest sequence; rows 16-byte aligned like Q, K, V and O.
  p.bias_rows = *std::max_element(p.rows_q.begin(), p.rows_q.end());
  p.bias_ld = (*std::max_element(p.rows_k.begin(), p.rows_k.end()) + 7) / 8 * 8;
  flags.finish();
  return p;
}

uint16_t to_bits(float x, fmha::DataType dtype) {
  if (dtype == fmha::DataType::kBF16) return __nv_bfloat16_raw(__float2bfloat16(x)).x;
  return __half_raw(__float2half(x)).x;
}

float from_bits(uint16_t bits, fmha::DataType dtype) {
  if (dtype == fmha::DataType::kBF16) return __bfloat162float(__nv_bfloat16(__nv_bfloat16_raw{bits}));
  return __half2float(__half(__half_raw{bits}));
}

// An input element's bytes: an e4m3 code, or 16-bit bits.
int element_bytes(fmha::DataType dtype) { return dtype == fmha::DataType::kE4M3 ? 1 : 2; }

// x rounded to the dtype: its bytes appended to `bytes` (little-endian), its value returned.
float append_rounded(float x, fmha::DataType dtype, std::vector<uint8_t>* bytes) {
  if (dtype == fmha::DataType::kE4M3) {
    const __nv_fp8_e4m3 e(x);
    bytes->push_back(e.__x);
    return float(e);
  }
  const uint16_t bits = to_bits(x, dtype);
  bytes->push_back(uint8_t(bits & 0xff));
  bytes->push_back(uint8_t(bits >> 8));
  return from_bits(bits, dtype);
}

// n random values in [-1, 1) rounded to the dtype: the bytes for the device and, in `values`,
// the rounded values for the reference.
std::vector<uint8_t> random_tensor(int64_t n, fmha::DataType dtype, std::mt19937& rng, std::vector<float>* values) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<uint8_t> bytes;
  bytes.reserve(n * element_bytes(dtype));
  values->resize(n);
  for (int64_t i = 0; i < n; ++i) (*values)[i] = append_rounded(dist(rng), dtype, &bytes);
  return bytes;
}

// V^T for -vlayout=c, seqlen contiguous with rows of `ld` (16 bytes' elements a multiple):
// (batch, nhead_k, hdim_v, ld) in batch mode, (nhead_k, hdim_v, ld) over all tokens in group
// mode.
std::vector<uint8_t> transpose_v(const Problem& p, const std::vector<uint8_t>& v, int64_t* ld) {
  const bool batch_mode = p.mode == fmha::Mode::kBatch;
  const int groups = batch_mode ? p.batch : 1;
  const int64_t keys = batch_mode ? p.rows_k[0] : p.tokens_k();
  const int es = element_bytes(p.dtype);
  const int64_t align = 16 / es;
  *ld = (keys + align - 1) / align * align;
  std::vector<uint8_t> pad;  // finite padding
  append_rounded(0.5f, p.dtype, &pad);
  std::vector<uint8_t> vt;
  vt.reserve(int64_t(groups) * p.nhead_k * p.hdim_v * *ld * es);
  for (int64_t i = 0; i < int64_t(groups) * p.nhead_k * p.hdim_v * *ld; ++i) {
    vt.insert(vt.end(), pad.begin(), pad.end());
  }
  for (int g = 0; g < groups; ++g) {
    for (int h = 0; h < p.nhead_k; ++h) {
      for (int c = 0; c < p.hdim_v; ++c) {
        for (int64_t j = 0; j < keys; ++j) {
          const int64_t to = ((int64_t(g) * p.nhead_k + h) * p.hdim_v + c) * *ld + j;
          const int64_t from = ((g * keys + j) * p.nhead_k + h) * p.hdim_v + c;
          std::copy_n(v.begin() + from * es, es, vt.begin() + to * es);
        }
      }
    }
  }
  return vt;
}

// Device allocations, freed (and checked) at the end.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    for (void* block : blocks_) CHECK_CUDA(cudaFree(block));
  }
  void* alloc(size_t bytes) {
    void* block = nullptr;
    CHECK_CUDA(cudaMalloc(&block, std::max<size_t>(bytes, 16)));
    blocks_.push_back(block);
    return block;
  }
  template <class T>
  T* upload(const std::vector<T>& host) {
    T* block = static_cast<T*>(alloc(host.size() * sizeof(T)));
    CHECK_CUDA(cudaMemcpy(block, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return block;
  }

 private:
  std::vector<void*> blocks_;
};

template <class T>
std::vector<int32_t> to_int32(const std::vector<T>& v) { return std::vector<int32_t>(v.begin(), v.end()); }

// The problem's sizes, layout and options, without memory (no pointer, no stride): what the
// library checks before it reads a pointer (fmha::select reads none), and make_args starts
// from.
fmha::FwdArgs describe(const Problem& p) {
  fmha::FwdArgs a;
  a.dtype = p.dtype;
  a.mode = p.mode;
  a.batch = p.batch;
  a.seqlen_q = *std::max_element(p.rows_q.begin(), p.rows_q.end());
  a.seqlen_k = *std::max_element(p.rows_k.begin(), p.rows_k.end());
  a.nhead_q = p.nhead_q, a.nhead_k = p.nhead_k, a.hdim_q = p.hdim_q, a.hdim_v = p.hdim_v;
  a.vlayout = p.vlayout;
  a.softmax_scale = p.scale;
  a.mask = p.mask;
  a.mask_align = p.align;
  a.window_left = p.window_left;
  a.window_right = p.window_right;
  a.bias = p.bias;
  a.softcap = p.softcap;
  a.dropout_p = p.p_drop;
  a.dropout_seed = p.drop_seed;
  a.dropout_offset = p.drop_offset;
  return a;
}

// Random inputs on the device (and their values in `in`), poison-ready outputs, and the
// arguments describing them.
fmha::FwdArgs make_args(const Problem& p, std::mt19937& rng, DeviceMemory* mem, HostInputs* in) {
  fmha::FwdArgs a = describe(p);
  const bool batch_mode = p.mode == fmha::Mode::kBatch;

  // Q, K, V (row-major) and O: (batch, seqlen, head, hdim), or (token, head, hdim) packed. O is
  // 16-bit (bf16 for e4m3 inputs).
  a.q = mem->upload(random_tensor(p.tokens_q() * p.nhead_q * p.hdim_q, p.dtype, rng, &in->q));
  a.k = mem->upload(random_tensor(p.tokens_k() * p.nhead_k * p.hdim_q, p.dtype, rng, &in->k));
  const std::vector<uint8_t> v = random_tensor(p.tokens_k() * p.nhead_k * p.hdim_v, p.dtype, rng, &in->v);
  a.o = mem->alloc(p.tokens_q() * p.nhead_q * p.hdim_v * 2);
  a.q_seq_stride = int64_t(p.nhead_q) * p.hdim_q, a.q_head_stride = p.hdim_q;
  a.k_seq_stride = int64_t(p.nhead_k) * p.hdim_q, a.k_head_stride = p.hdim_q;
  a.o_seq_stride = int64_t(p.nhead_q) * p.hdim_v, a.o_head_stride = p.hdim_v;
  if (batch_mode) {
    a.q_batch_stride = p.rows_q[0] * a.q_seq_stride;
    a.k_batch_stride = p.rows_k[0] * a.k_seq_stride;
    a.o_batch_stride = p.rows_q[0] * a.o_seq_stride;
  }
  if (p.vlayout == fmha::VLayout::kRowMajor) {
    a.v = mem->upload(v);
    a.v_seq_stride = int64_t(p.nhead_k) * p.hdim_v, a.v_head_stride = p.hdim_v, a.v_dim_stride = 1;
    if (batch_mode) a.v_batch_stride = p.rows_k[0] * a.v_seq_stride;
  } else {
    int64_t ld = 0;
    a.v = mem->upload(transpose_v(p, v, &ld));
    a.v_seq_stride = 1, a.v_dim_stride = ld, a.v_head_stride = p.hdim_v * ld;
    if (batch_mode) a.v_batch_stride = p.nhead_k * a.v_head_stride;
  }

  if (!batch_mode) {
    a.cu_seqlens_q = mem->upload(to_int32(p.cu_q));
    a.cu_seqlens_k = mem->upload(to_int32(p.cu_k));
    a.total_q = p.cu_q.back();
    a.total_k = p.cu_k.back();
  }
  if (p.seqused_q) a.seqused_q = mem->upload(to_int32(p.len_q));
  if (p.seqused_k) a.seqused_k = mem->upload(to_int32(p.len_k));

  if (p.bias == fmha::BiasType::kElementwise) {
    a.bias_ptr = mem->upload(random_tensor(p.bias_elements(), p.dtype, rng, &in->bias));
    a.bias_batch_stride = p.bias_batch_stride();
    a.bias_head_stride = p.bias_head_stride();
    a.bias_seq_stride = p.bias_seq_stride();
  } else if (p.bias == fmha::BiasType::kAlibi) {
    // The standard slopes; with a:1, sequence b's are those divided by b + 1.
    const std::vector<float> slopes = fmha_example::alibi_slopes(p.nhead_q);
    for (int b = 0; b < (p.bias_per_batch ? p.batch : 1); ++b) {
      for (float s : slopes) in->slopes.push_back(s / float(b + 1));
    }
    a.alibi_slopes = mem->upload(in->slopes);
    a.alibi_batch_stride = p.alibi_batch_stride();
  }
  if (p.lse) {
    a.lse = static_cast<float*>(mem->alloc(p.lse_elements() * sizeof(float)));
    a.lse_batch_stride = p.lse_batch_stride();
    a.lse_head_stride = p.lse_head_stride();
  }
  return a;
}

// One fmha::fwd call; a failed call ends the program with its message.
void launch(const fmha::FwdArgs& a, std::string* chosen) {
  const fmha::Status st = fmha::fwd(a, nullptr, chosen);
  if (!st.ok()) {
    std::fprintf(stderr, "fmha::fwd: %s\n", st.message.c_str());
    std::string why;
    if (st.code == fmha::Status::Code::kNoInstance && fmha::explain(a, &why).ok() && !why.empty()) {
      std::fprintf(stderr, "%s\n", why.c_str());
    }
    std::exit(1);
  }
  CHECK_CUDA(cudaGetLastError());
}

// Median milliseconds of `repeat` calls, each timed with CUDA events after `warmup` untimed ones.
double time_ms(const fmha::FwdArgs& a, int warmup, int repeat) {
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

std::string mask_name(const Problem& p) {
  const std::string side = p.align == fmha::MaskAlign::kTopLeft ? "t" : "b";
  switch (p.mask) {
    case fmha::MaskType::kCausal: return side;
    case fmha::MaskType::kWindow:
      return side + "(" + std::to_string(p.window_left) + "," + std::to_string(p.window_right) + ")";
    default: return "n";
  }
}

std::string bias_name(const Problem& p) {
  if (p.bias == fmha::BiasType::kElementwise) return p.bias_per_batch ? "e:2" : p.bias_per_head ? "e:1" : "e:0";
  if (p.bias == fmha::BiasType::kAlibi) return p.bias_per_batch ? "a:1" : "a:0";
  return "n";
}

// One JSON object, built field by field.
class Json {
 public:
  Json& text(const char* key, const std::string& value) {
    std::string quoted = "\"";
    for (char c : value) quoted += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
    return raw(key, quoted + "\"");
  }
  Json& number(const char* key, double value) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", value);
    return raw(key, std::isfinite(value) ? buf : "null");
  }
  Json& integer(const char* key, int64_t value) { return raw(key, std::to_string(value)); }
  Json& boolean(const char* key, bool value) { return raw(key, value ? "true" : "false"); }
  Json& integers(const char* key, const std::vector<int>& values) {
    std::string list = "[";
    for (size_t i = 0; i < values.size(); ++i) list += (i ? "," : "") + std::to_string(values[i]);
    return raw(key, list + "]");
  }
  Json& raw(const char* key, const std::string& value) {
    body_ += (body_.empty() ? "\"" : ", \"") + std::string(key) + "\": " + value;
    return *this;
  }
  std::string str() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

int64_t sum(const std::vector<int>& v) {
  int64_t total = 0;
  for (int x : v) total += x;
  return total;
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
  std::mt19937 rng;
  Problem p;
  try {
    p = parse(argc, argv, &run, &rng);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "fmha_fwd: %s (fmha_fwd -? lists the flags)\n", e.what());
    return 2;
  }
  // The library's checks of the sizes and options, before any buffer is allocated: a problem
  // past its limits would otherwise first fill host buffers of its size. Which instance runs
  // (or that none does), and whether there is a GPU, the call itself says.
  const fmha::Status checked = fmha::select(describe(p), nullptr);
  if (checked.code == fmha::Status::Code::kInvalidArgument) {
    std::fprintf(stderr, "%s\n", checked.message.c_str());
    return 1;
  }
  const bool fp8 = p.dtype == fmha::DataType::kE4M3;
  const fmha::DataType out_dtype = fp8 ? fmha::DataType::kBF16 : p.dtype;
  const bool bf16 = out_dtype == fmha::DataType::kBF16;

  DeviceMemory mem;
  HostInputs in;
  const fmha::FwdArgs a = make_args(p, rng, &mem, &in);
  const int64_t out_elements = p.tokens_q() * p.nhead_q * p.hdim_v;

  // The checked run, on outputs poisoned with NaN (0xffff in fp16 and bf16, 0xffffffff in fp32)
  // so that anything left unwritten shows.
  CHECK_CUDA(cudaMemset(a.o, 0xff, out_elements * 2));
  if (p.lse) CHECK_CUDA(cudaMemset(a.lse, 0xff, p.lse_elements() * sizeof(float)));
  std::string instance;
  launch(a, &instance);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> out, lse;
  if (run.verify) {
    std::vector<uint16_t> bits(out_elements);
    CHECK_CUDA(cudaMemcpy(bits.data(), a.o, out_elements * 2, cudaMemcpyDeviceToHost));
    for (uint16_t b : bits) out.push_back(from_bits(b, out_dtype));
    if (p.lse) {
      lse.resize(p.lse_elements());
      CHECK_CUDA(cudaMemcpy(lse.data(), a.lse, lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    }
  }

  const double ms = time_ms(a, run.warmup, run.repeat);
  // Two GEMMs over the (query, key) pairs the mask leaves visible, counted exactly.
  const double flops = 2.0 * p.nhead_q * (p.hdim_q + p.hdim_v) * double(fmha_example::visible_pairs(p));
  const double tflops = flops / ms * 1e-9;

  // Outputs are averages of values in [-1, 1): rounding O costs up to 2^-11 (fp16) or 2^-8
  // (bf16), P rounded for the second GEMM about as much again; dropout scales both by
  // 1 / (1 - p). Soft-capping allows for a hardware tanh (2^-11 relative) on each logit, which
  // moves an output by up to twice a logit's error.
  const double logit_tol = p.softcap * 1e-3;
  // e4m3 inputs are exact in the reference (it takes their values), but P is rounded to e4m3
  // for the second GEMM: 3 mantissa bits, up to 2^-4 of each weight, so an output moves by up
  // to about that share of the largest |v| it averages (1) where few keys carry the weight.
  const double out_tol = ((fp8 ? 6.25e-2 : bf16 ? 2e-2 : 4e-3) + 2 * logit_tol) / (1.0 - p.p_drop);
  const double lse_tol = 1e-3 + logit_tol;
  fmha_example::Errors err;
  bool valid = true;
  if (run.verify) {
    err = fmha_example::check(p, in, out, lse);
    valid = err.out <= out_tol && err.lse <= lse_tol && err.written_padding == 0;
  }

  const char* prec = fp8 ? "fp8" : bf16 ? "bf16" : "fp16";
  const char* mode = p.mode == fmha::Mode::kBatch ? "batch" : "group";
  const char* vlayout = p.vlayout == fmha::VLayout::kRowMajor ? "r" : "c";
  if (run.json) {
    Json j;
    j.text("prec", prec).text("mode", mode).integer("b", p.batch).integer("h", p.nhead_q).integer("h_k", p.nhead_k);
    j.integers("seqlens_q", p.len_q).integers("seqlens_k", p.len_k);
    j.integers("rows_q", p.rows_q).integers("rows_k", p.rows_k);
    j.integer("d", p.hdim_q).integer("d_v", p.hdim_v).number("scale_s", p.scale);
    j.text("bias", bias_name(p)).text("mask", mask_name(p)).text("vlayout", vlayout);
    j.boolean("lse", p.lse).number("p_drop", p.p_drop);
    j.integer("drop_seed", int64_t(p.drop_seed)).integer("drop_offset", p.drop_offset);
    j.number("softcap", p.softcap).integer("seed", run.seed).text("instance", instance);
    j.number("ms", ms).number("tflops", tflops).number("flops", flops);
    if (run.verify) {
      j.boolean("valid", valid).number("max_err", err.out).number("tolerance", out_tol);
      if (p.lse) j.number("lse_max_err", err.lse).number("lse_tolerance", lse_tol);
      j.integer("written_padding", err.written_padding);
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
    std::printf("d:%d/%d, scale_s:%g, bias:%s, p_drop:%g, lse:%d, softcap:%g, mask:%s, v:%s, ", p.hdim_q,
                p.hdim_v, p.scale, bias_name(p).c_str(), p.p_drop, int(p.lse), p.softcap, mask_name(p).c_str(),
                vlayout);
    if (run.kname) std::printf("%s, ", instance.c_str());
    if (run.repeat > 0) std::printf("%.4f ms, %.2f TFlops, ", ms, tflops);
    std::printf("valid:%s\n", run.verify ? (valid ? "y" : "n") : "-");
  }
  if (err.out > out_tol) {
    std::fprintf(stderr, "max_err %.3g above the tolerance %.3g, at batch %d head %d row %d\n", err.out,
                 out_tol, err.worst_b, err.worst_h, err.worst_row);
  }
  if (err.lse > lse_tol) std::fprintf(stderr, "lse max_err %.3g above the tolerance %.3g\n", err.lse, lse_tol);
  if (err.written_padding) {
    std::fprintf(stderr, "%lld output elements past seqused_q were written\n", (long long)err.written_padding);
  }
  return valid ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // The host may not hold what the flags ask for: the per-sequence lengths, and the inputs,
  // drawn there and kept as floats for the reference.
  try {
    return run_program(argc, argv);
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {  // a std::vector longer than any allocation
  }
  std::fprintf(stderr, "fmha_fwd: out of host memory for the problem's buffers; choose smaller "
               "sizes\n");
  return 1;
}
