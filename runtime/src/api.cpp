// The public entry points: argument checks, then the dispatcher, then one launch.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "dispatcher.h"
#include "fmha/fmha.h"
#include "fmha/registry.h"

namespace fmha {
namespace {

// The kernels move every row in 16-byte pieces: 8 elements of a 16-bit type.
constexpr int64_t kAlignElements = 8;
constexpr uintptr_t kAlignBytes = 16;
// CUDA's limit on gridDim.y and gridDim.z, which carry heads and batches.
constexpr int kMaxGridYZ = 65535;

Status invalid(const std::string& message) {
  return {Status::Code::kInvalidArgument, "fmha::fwd: " + message};
}

bool is_empty(const FwdArgs& a) { return a.batch == 0 || a.seqlen_q == 0 || a.nhead_q == 0; }

Status check_tensor(const char* name, const void* ptr, int64_t batch_stride, int64_t seq_stride,
                    int64_t head_stride) {
  if (ptr == nullptr) return invalid(std::string(name) + " is a null pointer");
  if (reinterpret_cast<uintptr_t>(ptr) % kAlignBytes != 0) {
    return invalid(std::string(name) + " must be 16-byte aligned");
  }
  const int64_t strides[] = {batch_stride, seq_stride, head_stride};
  const char* stride_names[] = {"batch", "seq", "head"};
  for (int i = 0; i < 3; ++i) {
    if (strides[i] < 0 || strides[i] % kAlignElements != 0) {
      std::ostringstream s;
      s << name << " " << stride_names[i] << " stride is " << strides[i]
        << "; it must be a non-negative multiple of " << kAlignElements
        << " elements (rows move in 16-byte pieces)";
      return invalid(s.str());
    }
  }
  return Status::Ok();
}

// Shapes, traits and scale always; pointers, alignment and strides only when `check_memory`
// (select() describes a problem without tensors).
Status check_args(const FwdArgs& a, bool check_memory) {
  if (a.batch < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 || a.nhead_q < 0 || a.nhead_k < 0) {
    return invalid("batch, seqlen_q, seqlen_k, nhead_q and nhead_k must be non-negative");
  }
  if (a.hdim_q <= 0 || a.hdim_v <= 0) return invalid("hdim_q and hdim_v must be positive");
  if (a.nhead_k == 0 || a.nhead_q % a.nhead_k != 0) {
    std::ostringstream s;
    s << "nhead_q (" << a.nhead_q << ") must be a positive multiple of nhead_k (" << a.nhead_k
      << ")";
    return invalid(s.str());
  }
  if (!(std::isfinite(a.softmax_scale) && a.softmax_scale > 0.f)) {
    return invalid("softmax_scale must be finite and positive");
  }
  if (a.dtype != DataType::kFP16 && a.dtype != DataType::kBF16) return invalid("unknown dtype");
  if (a.mask != MaskType::kNone && a.mask != MaskType::kCausalTopLeft) {
    return invalid("unknown mask type");
  }
  if (a.batch > kMaxGridYZ || a.nhead_q > kMaxGridYZ) {
    return invalid("batch and nhead_q must be at most 65535");
  }
  if (is_empty(a) || !check_memory) return Status::Ok();
  for (auto [name, ptr, bs, ss, hs] :
       {std::tuple{"q", a.q, a.q_batch_stride, a.q_seq_stride, a.q_head_stride},
        std::tuple{"o", static_cast<const void*>(a.o), a.o_batch_stride, a.o_seq_stride,
                   a.o_head_stride}}) {
    if (Status st = check_tensor(name, ptr, bs, ss, hs); !st.ok()) return st;
  }
  if (a.seqlen_k > 0) {
    for (auto [name, ptr, bs, ss, hs] :
         {std::tuple{"k", a.k, a.k_batch_stride, a.k_seq_stride, a.k_head_stride},
          std::tuple{"v", a.v, a.v_batch_stride, a.v_seq_stride, a.v_head_stride}}) {
      if (Status st = check_tensor(name, ptr, bs, ss, hs); !st.ok()) return st;
    }
  }
  return Status::Ok();
}

// Checks, picks an entry (the named one, or the dispatcher's choice) and launches it.
Status run(const FwdArgs& args, Stream stream, const std::string* instance, std::string* chosen) {
  if (Status st = check_args(args, /*check_memory=*/true); !st.ok()) return st;
  int cc = 0;
  if (Status st = detail::current_device_cc(&cc); !st.ok()) return st;
  const detail::InstanceEntry* entry = nullptr;
  const Status found = instance != nullptr ? detail::find_instance(*instance, args, cc, &entry)
                                           : detail::select_instance(args, cc, &entry);
  if (!found.ok()) return found;
  if (chosen != nullptr) *chosen = entry->name;
  if (is_empty(args)) return Status::Ok();  // nothing to compute, nothing launched

  const cudaError_t err = entry->launch(args, stream);
  if (err != cudaSuccess) {
    return {Status::Code::kCudaError, std::string("fmha::fwd: launching ") + entry->name +
                                          " failed: " + cudaGetErrorName(err) + ": " +
                                          cudaGetErrorString(err)};
  }
  return Status::Ok();
}

}  // namespace

FwdTraits FwdArgs::traits() const {
  FwdTraits t;
  t.dtype = dtype;
  t.hdim_q = hdim_q;
  t.hdim_v = hdim_v;
  t.mask = mask;
  return t;
}

Status select(const FwdArgs& args, InstanceInfo* chosen) {
  if (Status st = check_args(args, /*check_memory=*/false); !st.ok()) return st;
  int cc = 0;
  if (Status st = detail::current_device_cc(&cc); !st.ok()) return st;
  const detail::InstanceEntry* entry = nullptr;
  if (Status st = detail::select_instance(args, cc, &entry); !st.ok()) return st;
  if (chosen != nullptr) *chosen = detail::to_info(*entry);
  return Status::Ok();
}

Status fwd(const FwdArgs& args, Stream stream, std::string* chosen) {
  return run(args, stream, nullptr, chosen);
}

Status fwd_instance(const std::string& instance, const FwdArgs& args, Stream stream) {
  return run(args, stream, &instance, nullptr);
}

std::vector<InstanceInfo> instances() {
  std::vector<InstanceInfo> out;
  out.reserve(detail::kNumInstances);
  for (int i = 0; i < detail::kNumInstances; ++i) out.push_back(detail::to_info(detail::kInstances[i]));
  return out;
}

std::vector<std::string> compiled_targets() {
  return {detail::kCompiledTargets, detail::kCompiledTargets + detail::kNumCompiledTargets};
}

const char* to_string(DataType t) { return detail::kDataTypeTokens[static_cast<int>(t)]; }
const char* to_string(MaskType t) { return detail::kMaskTokens[static_cast<int>(t)]; }

}  // namespace fmha
