// Public C++ API of libfmha: fused multi-head attention forward.
//
// The library holds one kernel instance per row of the generated matrix (instances.yaml) and a
// dispatcher that picks the instance fitting a problem. Nothing here needs CUDA headers beyond
// the stream type, and nothing needs torch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct CUstream_st;

// libfmha is built with hidden visibility; the public API is what this marks.
#define FMHA_API __attribute__((visibility("default")))

namespace fmha {

using Stream = CUstream_st*;  // a cudaStream_t; nullptr is the legacy default stream

enum class DataType : int { kFP16 = 0, kBF16 = 1 };

// Top-left aligned causal mask: query i sees keys j <= i (FlashAttention-2's convention
// when seqlen_q == seqlen_k).
enum class MaskType : int { kNone = 0, kCausalTopLeft = 1 };

enum class BiasType : int { kNone = 0 };
enum class VLayout : int { kRowMajor = 0 };  // V is (seqlen_k, hdim_v) per head
enum class Mode : int { kBatch = 0 };

// The functional traits of a problem: an instance runs a problem only when all of them match.
struct FwdTraits {
  DataType dtype = DataType::kFP16;
  int hdim_q = 0;
  int hdim_v = 0;
  MaskType mask = MaskType::kNone;
  BiasType bias = BiasType::kNone;
  VLayout vlayout = VLayout::kRowMajor;
  Mode mode = Mode::kBatch;
};

// One forward problem. Tensors are (batch, seqlen, nhead, hdim) in any stride order whose last
// (hdim) dimension is contiguous; strides are in elements. Pointers must be 16-byte aligned and
// every stride a multiple of 8 elements, so that each row moves in 16-byte pieces.
struct FMHA_API FwdArgs {
  DataType dtype = DataType::kFP16;
  MaskType mask = MaskType::kNone;

  const void* q = nullptr;  // (batch, seqlen_q, nhead_q, hdim_q)
  const void* k = nullptr;  // (batch, seqlen_k, nhead_k, hdim_q)
  const void* v = nullptr;  // (batch, seqlen_k, nhead_k, hdim_v)
  void* o = nullptr;        // (batch, seqlen_q, nhead_q, hdim_v)

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int nhead_q = 0;
  int nhead_k = 0;  // nhead_q must be a multiple of it (MQA/GQA share K/V heads)
  int hdim_q = 0;
  int hdim_v = 0;

  int64_t q_batch_stride = 0, q_seq_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_seq_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_seq_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_seq_stride = 0, o_head_stride = 0;

  float softmax_scale = 0.f;  // applied to QK^T; callers usually pass 1/sqrt(hdim_q)

  FwdTraits traits() const;
};

struct Status {
  enum class Code : int { kOk = 0, kInvalidArgument, kNoInstance, kCudaError };
  Code code = Code::kOk;
  std::string message;

  bool ok() const { return code == Code::kOk; }
  static Status Ok() { return {}; }
};

// What the build compiled, one row per kernel instance (the generator's manifest, at run time).
struct InstanceInfo {
  std::string name;
  FwdTraits traits;
  std::string pipeline;
  std::string arch;  // "sm80", "sm90a": the architecture the instance was compiled for
  int block_m = 0;
  int block_n = 0;
  bool pad_seqlen = false;  // handles sequence lengths that are not multiples of the tile
};

// Runs the forward pass on `stream`. Checks the arguments and picks an instance first; on any
// error nothing is launched. On success `chosen`, when given, receives the instance's name.
FMHA_API Status fwd(const FwdArgs& args, Stream stream, std::string* chosen = nullptr);

// As fwd(), but runs the compiled instance called `instance` instead of the dispatcher's
// choice; fails (nothing launched) when that instance does not fit the problem or the device.
// For tests and benchmarks that must cover every instance on one GPU.
FMHA_API Status fwd_instance(const std::string& instance, const FwdArgs& args, Stream stream);

// The instance fwd() would run for `args` on the current device, without launching; on a miss
// the status names the traits asked for and the generator filter that would build one.
FMHA_API Status select(const FwdArgs& args, InstanceInfo* chosen);

// Every instance compiled into this library, in the dispatcher's order of preference.
FMHA_API std::vector<InstanceInfo> instances();

// The GPU architectures this library holds machine code for, e.g. {"sm80", "sm90a"}.
FMHA_API std::vector<std::string> compiled_targets();

FMHA_API const char* to_string(DataType);
FMHA_API const char* to_string(MaskType);

}  // namespace fmha
