// What the example programs share (fmha_bwd.cpp; fmha_fwd.cpp holds the same code in its own
// file): CK-Tile's -name=value flags and the problem they describe, random inputs on the device
// with their rounded values on the host for the reference, the forward's FwdArgs, and the
// one-line JSON output.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fmha/fmha.h"
#include "fmha_fwd_reference.h"

#define CHECK_CUDA(call)                                                                 \
  do {                                                                                   \
    const cudaError_t err_ = (call);                                                     \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                   cudaGetErrorString(err_));                                            \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

namespace fmha_example {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline int64_t parse_int(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
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

inline double parse_float(const std::string& flag, const std::string& text, double lo, double hi_excl) {
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

// The -name=value arguments, a later one overriding an earlier; each take() (or integer(),
// real(), one_of()) consumes one and finish() rejects what is left.
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
  int64_t integer(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
    const auto text = take(name);
    return text ? parse_int(name, *text, lo, hi) : fallback;
  }
  double real(const char* name, double lo, double hi_excl) {
    const auto text = take(name);
    return text ? parse_float(name, *text, lo, hi_excl) : 0.0;
  }
  std::string one_of(const char* name, const char* fallback, const std::vector<std::string>& choices) {
    const std::string value = take(name).value_or(fallback);
    if (std::find(choices.begin(), choices.end(), value) == choices.end()) {
      std::string list;
      for (const auto& c : choices) list += " " + c;
      throw UsageError("-" + std::string(name) + "=" + value + " is none of" + list);
    }
    return value;
  }
  void finish() const {
    if (!values_.empty()) throw UsageError("unknown flag -" + values_.begin()->first);
  }

 private:
  std::map<std::string, std::string> values_;
};

inline std::vector<int> parse_ints(const std::string& flag, const std::string& text, int lo, int hi) {
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
inline std::vector<int> per_sequence(const std::string& flag, const std::string& text, int batch, int lo, int hi) {
  std::vector<int> values = parse_ints(flag, text, lo, hi);
  if (int(values.size()) != batch) {
    throw UsageError("-" + flag + " needs one value per sequence (-b=" + std::to_string(batch) + "), got " +
                     std::to_string(values.size()));
  }
  return values;
}

// Group mode's lengths: one value per sequence as given, or one value for all that is the
// longest of random lengths in [1, value].
inline std::vector<int> group_lengths(const std::string& flag, const std::string& text, int batch,
                                      std::mt19937& rng) {
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
inline std::vector<int> group_rows(const std::string& flag, const std::optional<std::string>& text,
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

inline std::vector<int64_t> prefix_sums(const std::vector<int>& rows) {
  std::vector<int64_t> sums{0};
  for (int r : rows) sums.push_back(sums.back() + r);
  if (sums.back() > INT32_MAX) throw UsageError("more than 2^31 - 1 tokens");
  return sums;
}

// -mask in CK's spellings, as fmha.h's (type, alignment, window). A window that is causal or
// unbounded on both sides becomes kCausal or kNone, as CK's dispatch does.
inline void parse_mask(const std::string& text, Problem* p) {
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

inline void parse_bias(const std::string& text, Problem* p) {
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

// The flags of the run (-v -kname -json -warmup -repeat -seed, which also seeds `rng`) and of
// the forward problem (all of fmha_fwd's but -vlayout and -lse), taken from `flags`.
inline Problem parse_problem(Flags& flags, Settings* run, std::mt19937* rng) {
  run->verify = flags.integer("v", 1, 0, 1);
  run->kname = flags.integer("kname", 0, 0, 1);
  run->json = flags.integer("json", 0, 0, 1);
  run->warmup = int(flags.integer("warmup", 5, 0, INT_MAX));
  run->repeat = int(flags.integer("repeat", 20, 0, INT_MAX));
  run->seed = uint32_t(flags.integer("seed", 11939, 0, UINT32_MAX));
  rng->seed(run->seed != 0 ? run->seed : std::random_device{}());

  Problem p;
  p.mode = flags.integer("mode", 0, 0, 1) ? fmha::Mode::kGroup : fmha::Mode::kBatch;
  p.dtype = flags.one_of("prec", "fp16", {"fp16", "bf16"}) == "bf16" ? fmha::DataType::kBF16 : fmha::DataType::kFP16;
  p.batch = int(flags.integer("b", 2, 1, INT_MAX));
  p.nhead_q = int(flags.integer("h", 8, 1, INT_MAX));
  p.nhead_k = int(flags.integer("h_k", -1, -1, INT_MAX));
  if (p.nhead_k <= 0) p.nhead_k = p.nhead_q;
  if (p.nhead_q % p.nhead_k != 0) throw UsageError("-h_k must divide -h (MQA/GQA)");
  p.hdim_q = int(flags.integer("d", 128, 1, INT_MAX));
  p.hdim_v = int(flags.integer("d_v", -1, -1, INT_MAX));
  if (p.hdim_v <= 0) p.hdim_v = p.hdim_q;
  p.scale = float(flags.real("scale_s", 0.0, HUGE_VAL));
  if (p.scale == 0.f) p.scale = 1.f / std::sqrt(float(p.hdim_q));
  parse_mask(flags.take("mask").value_or("0"), &p);
  parse_bias(flags.take("bias").value_or("n"), &p);
  p.p_drop = float(flags.real("p_drop", 0.0, 1.0));
  p.drop_seed = uint64_t(flags.integer("drop_seed", 1, 0, INT64_MAX));
  p.drop_offset = uint32_t(flags.integer("drop_offset", 0, 0, UINT32_MAX));
  p.softcap = float(flags.real("softcap", 0.0, HUGE_VAL));

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
  return p;
}

inline uint16_t to_bits(float x, fmha::DataType dtype) {
  if (dtype == fmha::DataType::kBF16) return __nv_bfloat16_raw(__float2bfloat16(x)).x;
  return __half_raw(__float2half(x)).x;
}

inline float from_bits(uint16_t bits, fmha::DataType dtype) {
  if (dtype == fmha::DataType::kBF16) return __bfloat162float(__nv_bfloat16(__nv_bfloat16_raw{bits}));
  return __half2float(__half(__half_raw{bits}));
}

// n random values in [-1, 1) rounded to the dtype: the bits for the device and, in `values`,
// the rounded values for the reference.
inline std::vector<uint16_t> random_tensor(int64_t n, fmha::DataType dtype, std::mt19937& rng,
                                           std::vector<float>* values) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<uint16_t> bits(n);
  values->resize(n);
  for (int64_t i = 0; i < n; ++i) {
    bits[i] = to_bits(dist(rng), dtype);
    (*values)[i] = from_bits(bits[i], dtype);
  }
  return bits;
}

// n fp16/bf16 values of a device buffer, as floats.
inline std::vector<float> download(const void* device, int64_t n, fmha::DataType dtype) {
  std::vector<uint16_t> bits(n);
  CHECK_CUDA(cudaMemcpy(bits.data(), device, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = from_bits(bits[i], dtype);
  return values;
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

// The forward call's sizes and options, V row-major, without memory (no pointer, no stride):
// what the library checks before it reads a pointer (fmha::select reads none), and
// make_fwd_args starts from.
inline fmha::FwdArgs describe_fwd(const Problem& p) {
  fmha::FwdArgs a;
  a.dtype = p.dtype;
  a.mode = p.mode;
  a.batch = p.batch;
  a.seqlen_q = *std::max_element(p.rows_q.begin(), p.rows_q.end());
  a.seqlen_k = *std::max_element(p.rows_k.begin(), p.rows_k.end());
  a.nhead_q = p.nhead_q, a.nhead_k = p.nhead_k, a.hdim_q = p.hdim_q, a.hdim_v = p.hdim_v;
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

// The forward call of the problem, V row-major: random Q, K, V (and bias or ALiBi slopes) on
// the device, their values in `in`, O (and with p.lse the log-sum-exp) allocated.
inline fmha::FwdArgs make_fwd_args(const Problem& p, std::mt19937& rng, DeviceMemory* mem, HostInputs* in) {
  fmha::FwdArgs a = describe_fwd(p);
  const bool batch_mode = p.mode == fmha::Mode::kBatch;

  // Q, K, V and O: (batch, seqlen, head, hdim), or (token, head, hdim) packed.
  a.q = mem->upload(random_tensor(p.tokens_q() * p.nhead_q * p.hdim_q, p.dtype, rng, &in->q));
  a.k = mem->upload(random_tensor(p.tokens_k() * p.nhead_k * p.hdim_q, p.dtype, rng, &in->k));
  a.v = mem->upload(random_tensor(p.tokens_k() * p.nhead_k * p.hdim_v, p.dtype, rng, &in->v));
  a.o = mem->alloc(p.tokens_q() * p.nhead_q * p.hdim_v * 2);
  a.q_seq_stride = int64_t(p.nhead_q) * p.hdim_q, a.q_head_stride = p.hdim_q;
  a.k_seq_stride = int64_t(p.nhead_k) * p.hdim_q, a.k_head_stride = p.hdim_q;
  a.v_seq_stride = int64_t(p.nhead_k) * p.hdim_v, a.v_head_stride = p.hdim_v;
  a.o_seq_stride = int64_t(p.nhead_q) * p.hdim_v, a.o_head_stride = p.hdim_v;
  if (batch_mode) {
    a.q_batch_stride = p.rows_q[0] * a.q_seq_stride;
    a.k_batch_stride = p.rows_k[0] * a.k_seq_stride;
    a.v_batch_stride = p.rows_k[0] * a.v_seq_stride;
    a.o_batch_stride = p.rows_q[0] * a.o_seq_stride;
  } else {
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
    const std::vector<float> slopes = alibi_slopes(p.nhead_q);
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

inline std::string mask_name(const Problem& p) {
  const std::string side = p.align == fmha::MaskAlign::kTopLeft ? "t" : "b";
  switch (p.mask) {
    case fmha::MaskType::kCausal: return side;
    case fmha::MaskType::kWindow:
      return side + "(" + std::to_string(p.window_left) + "," + std::to_string(p.window_right) + ")";
    default: return "n";
  }
}

inline std::string bias_name(const Problem& p) {
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

inline int64_t sum(const std::vector<int>& v) {
  int64_t total = 0;
  for (int x : v) total += x;
  return total;
}

}  // namespace fmha_example
