// The public entry points of every operation (fwd, bwd, kvcache): argument checks, then the
// dispatcher, then the instance's launch.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "compile_on_demand.h"
#include "dispatcher.h"
#include "fmha/fmha.h"
#include "instance_tables.h"
#include "fmha/registry.h"

namespace fmha {
namespace {

// The kernels move every row in 16-byte pieces: 8 elements of a 16-bit type, 16 of e4m3 (an
// e4m3 KV cache, KvCacheDtype::kE4M3, or the forward's e4m3 inputs, DataType::kE4M3).
constexpr int64_t kAlignElements = 8;
constexpr int64_t kE4m3AlignElements = 16;

// The elements of 16 bytes of a forward input of `dtype` (Q, K, V, an elementwise bias). The
// output is never e4m3: O of an e4m3 call is bf16 or fp16, 8 elements of 16 bytes
// (kAlignElements).
int64_t align_elements(DataType dtype) {
  return dtype == DataType::kE4M3 ? kE4m3AlignElements : kAlignElements;
}
constexpr uintptr_t kAlignBytes = 16;
// CUDA's limit on gridDim.y and gridDim.z, which carry heads and batches.
constexpr int kMaxGridYZ = 65535;
// A causal grid is 1-D, one CTA per (query tile, head, sequence): gridDim.x allows 2^31 - 1,
// and the kernel decodes blockIdx.x as an int.
constexpr int64_t kMaxCausalCtas = INT32_MAX;
// The kernels' key arithmetic (row + offset + window size, with windows clamped to
// seqlen_q + seqlen_k) is in int: it stays below 2 (seqlen_q + seqlen_k) plus a tile.
constexpr int64_t kMaxSeqlenSum = int64_t{1} << 30;
// No kernel comes near it; the bound keeps the dispatcher's head-dim arithmetic (distances
// between head dims, rounding up for a suggestion) far from int overflow.
constexpr int kMaxHeadDim = 1 << 16;
// The scratch the kernels share is handed over by the caller: cudaMalloc per call would cost
// more host time than the whole launch.
constexpr uintptr_t kWorkspaceAlignBytes = 256;

constexpr char kFwdPrefix[] = "fmha::fwd: ";

Status invalid(const std::string& message) {
  return {Status::Code::kInvalidArgument, kFwdPrefix + message};
}

// A failed status of the checks below, which speak as fmha::fwd, said by another entry point
// ("fmha::bwd").
Status said_by(const char* entry_point, Status st) {
  const std::string fwd_prefix = kFwdPrefix;
  if (!st.ok() && st.message.compare(0, fwd_prefix.size(), fwd_prefix) == 0) {
    st.message = std::string(entry_point) + ": " + st.message.substr(fwd_prefix.size());
  }
  return st;
}

Status launch_failed(const char* entry_point, const char* instance, cudaError_t err) {
  return {Status::Code::kCudaError, std::string(entry_point) + ": launching " + instance +
                                        " failed: " + cudaGetErrorName(err) + ": " +
                                        cudaGetErrorString(err)};
}

// The entry a call runs: the named instance, or the dispatcher's choice, which on a miss
// compiles the instances that run the call on demand (compile_on_demand.h) and chooses again.
// `stream`: the call's, which must not be capturing a CUDA graph for a compile.
template <class Args, class Entry>
Status entry_for_call(const Args& args, int cc, const std::string* instance, Stream stream,
                      const Entry** entry) {
  if (instance != nullptr) return detail::find_instance(*instance, args, cc, entry);
  const Status found = detail::select_instance(args, cc, entry);
  if (found.code != Status::Code::kNoInstance) return found;
  if (Status compiled = detail::compile_on_demand(instance_recipe(args, cc), stream, found);
      !compiled.ok()) {
    return compiled;
  }
  return detail::select_instance(args, cc, entry);
}

bool is_empty(const FwdArgs& a) { return a.batch == 0 || a.seqlen_q == 0 || a.nhead_q == 0; }

bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// An enum's value, checked against its enumerators 0..last: an int cast into the enum (as the
// bindings do) can hold anything, and the dispatcher indexes token tables with it.
template <typename Enum>
Status check_enum(const char* name, Enum value, Enum last, const char* valid) {
  const int v = static_cast<int>(value);
  if (v >= 0 && v <= static_cast<int>(last)) return Status::Ok();
  return invalid("unknown " + std::string(name) + " " + std::to_string(v) + "; valid: " + valid);
}

struct Stride {
  const char* name;
  int64_t value;
};

// A Q/K/V/O operand: present, 16-byte aligned, and each of `strides` a non-negative multiple of
// the elements of 16 bytes (8 of a 16-bit type, `align_elements` where it is another size), so
// that every row starts on a 16-byte boundary.
Status check_operand(const char* name, const void* ptr, std::initializer_list<Stride> strides,
                     int64_t align_elements = kAlignElements) {
  if (ptr == nullptr) return invalid(std::string(name) + " is a null pointer");
  if (!aligned(ptr, kAlignBytes)) return invalid(std::string(name) + " must be 16-byte aligned");
  for (const Stride& stride : strides) {
    if (stride.value < 0 || stride.value % align_elements != 0) {
      std::ostringstream s;
      s << name << " " << stride.name << " stride is " << stride.value
        << "; it must be a non-negative multiple of " << align_elements
        << " elements (rows move in 16-byte pieces)";
      return invalid(s.str());
    }
  }
  return Status::Ok();
}

// The causal grid of an instance with query tiles of `block_m` rows (`whose`: which instance, for
// the message). Sizes are within their bounds, so the product fits int64.
Status check_causal_grid(const FwdArgs& a, int block_m, const std::string& whose) {
  if (a.mask != MaskType::kCausal || block_m <= 0) return Status::Ok();
  const int64_t m_blocks = (static_cast<int64_t>(a.seqlen_q) + block_m - 1) / block_m;
  const int64_t ctas = m_blocks * a.batch * a.nhead_q;
  if (ctas <= kMaxCausalCtas) return Status::Ok();
  std::ostringstream s;
  s << "a causal call launches ceil(seqlen_q / block_m) * batch * nhead_q CTAs in a 1-D grid, "
    << "at most 2^31 - 1; with " << whose << " block_m of " << block_m << " that is ceil("
    << a.seqlen_q << " / " << block_m << ") * " << a.batch << " * " << a.nhead_q << " = " << ctas
    << "; split the call over fewer sequences or heads";
  return invalid(s.str());
}

// The largest query tile of the forward instances: the fewest CTAs any of them launches.
int largest_fwd_block_m() {
  int block_m = 0;
  for (const auto& e : detail::fwd_entries()) block_m = std::max(block_m, e.block_m);
  return block_m;
}

Status check_non_negative(std::initializer_list<Stride> strides) {
  for (const Stride& stride : strides) {
    if (stride.value < 0) {
      return invalid(std::string(stride.name) + " is " + std::to_string(stride.value) +
                     "; it must be non-negative");
    }
  }
  return Status::Ok();
}

Status check_head_dims(int hdim_q, int hdim_v) {
  if (hdim_q <= 0 || hdim_v <= 0) return invalid("hdim_q and hdim_v must be positive");
  if (hdim_q > kMaxHeadDim || hdim_v > kMaxHeadDim) {
    return invalid("hdim_q and hdim_v must be at most " + std::to_string(kMaxHeadDim));
  }
  return Status::Ok();
}

// MQA/GQA: every K/V head serves as many query heads. Both counts are non-negative here.
Status check_heads(int nhead_q, int nhead_k) {
  if (nhead_k > 0 && nhead_q % nhead_k == 0) return Status::Ok();
  std::ostringstream s;
  s << "nhead_q (" << nhead_q << ") must be a positive multiple of nhead_k (" << nhead_k << ")";
  return invalid(s.str());
}

// Sequences and heads ride on gridDim.y and gridDim.z.
Status check_grid_yz(int batch, int nhead_q) {
  if (batch > kMaxGridYZ || nhead_q > kMaxGridYZ) {
    return invalid("batch and nhead_q must be at most 65535");
  }
  return Status::Ok();
}

// The key arithmetic of the kernels is in int.
Status check_seqlen_sum(int seqlen_q, const char* keys, int seqlen_k) {
  if (static_cast<int64_t>(seqlen_q) + seqlen_k < kMaxSeqlenSum) return Status::Ok();
  std::ostringstream s;
  s << "seqlen_q + " << keys << " must be below 2^30, got " << seqlen_q << " + " << seqlen_k
    << " (the kernels' key arithmetic is in int)";
  return invalid(s.str());
}

Status check_softmax_scale(float softmax_scale) {
  if (std::isfinite(softmax_scale) && softmax_scale > 0.f) return Status::Ok();
  return invalid("softmax_scale must be finite and positive");
}

// MaskType::kWindow's sizes.
Status check_window(int window_left, int window_right) {
  if (window_left >= -1 && window_right >= -1) return Status::Ok();
  std::ostringstream s;
  s << "window_left and window_right must be -1 (unbounded) or non-negative, got ("
    << window_left << ", " << window_right << ")";
  return invalid(s.str());
}

Status check_softcap(float softcap) {
  if (std::isfinite(softcap) && softcap >= 0.f) return Status::Ok();
  return invalid("softcap must be finite and non-negative (0 turns soft-capping off)");
}

// ALiBi's slopes: fp32, one per head or per (batch, head).
Status check_alibi_slopes(const float* slopes, int64_t batch_stride) {
  if (slopes == nullptr) return invalid("BiasType::kAlibi needs alibi_slopes");
  if (!aligned(slopes, alignof(float))) {
    return invalid("alibi_slopes must be 4-byte aligned (fp32)");
  }
  return check_non_negative({{"alibi_batch_stride", batch_stride}});
}

// The optional log-sum-exp output: fp32, (batch, nhead_q, seqlen_q) through its strides.
Status check_lse(const float* lse, int64_t batch_stride, int64_t head_stride) {
  if (lse == nullptr) return Status::Ok();
  if (!aligned(lse, alignof(float))) return invalid("lse must be 4-byte aligned (fp32)");
  return check_non_negative({{"lse_batch_stride", batch_stride}, {"lse_head_stride", head_stride}});
}

// The caller's scratch for an instance that needs `needed` bytes, which `size_function` tells
// the caller: present, large enough and 256-byte aligned.
Status check_workspace(const void* workspace, size_t bytes, size_t needed,
                       const char* size_function) {
  if (needed == 0) return Status::Ok();
  if (workspace == nullptr || bytes < needed) {
    return invalid("the workspace holds " + std::to_string(bytes) + " bytes" +
                   (workspace == nullptr ? " (a null pointer)" : "") + "; this call needs " +
                   std::to_string(needed) + " (fmha::" + size_function + ")");
  }
  if (!aligned(workspace, kWorkspaceAlignBytes)) {
    return invalid("the workspace must be 256-byte aligned");
  }
  return Status::Ok();
}

// A device int32 array: present when `needed`, and 4-byte aligned. Its values live on the
// device, so they are the caller's contract (non-decreasing cu_seqlens from 0, seqused within
// the lengths): reading them here would synchronize with the stream.
Status check_int_array(const char* name, const int32_t* ptr, bool needed, const char* why) {
  if (ptr == nullptr) {
    return needed ? invalid(std::string(name) + " is a null pointer; " + why) : Status::Ok();
  }
  if (!aligned(ptr, alignof(int32_t))) {
    return invalid(std::string(name) + " must be 4-byte aligned");
  }
  return Status::Ok();
}

// The descale factors of e4m3 inputs (FwdArgs::q_descale, k_descale, v_descale): a kE4M3
// call's only, their strides non-negative and, with `check_memory`, each pointer given 4-byte
// aligned (fp32). A 16-bit call has none, and strides of 0: a caller that sets them means
// something this dtype does not do.
Status check_descales(const FwdArgs& a, bool check_memory) {
  const std::initializer_list<Stride> strides = {
      {"q_descale_batch_stride", a.q_descale_batch_stride},
      {"q_descale_head_stride", a.q_descale_head_stride},
      {"k_descale_batch_stride", a.k_descale_batch_stride},
      {"k_descale_head_stride", a.k_descale_head_stride},
      {"v_descale_batch_stride", a.v_descale_batch_stride},
      {"v_descale_head_stride", a.v_descale_head_stride}};
  if (a.dtype != DataType::kE4M3) {
    const char* dtype = a.dtype == DataType::kFP16 ? "kFP16" : "kBF16";
    if (a.q_descale != nullptr || a.k_descale != nullptr || a.v_descale != nullptr) {
      return invalid(std::string("q_descale/k_descale/v_descale are for dtype kE4M3 (they "
                                 "dequantize e4m3 inputs); a ") +
                     dtype + " call takes none");
    }
    for (const Stride& stride : strides) {
      if (stride.value != 0) {
        return invalid(std::string(stride.name) + " is " + std::to_string(stride.value) +
                       "; the descale strides are for dtype kE4M3, and a " + dtype +
                       " call must leave them 0");
      }
    }
    return Status::Ok();
  }
  if (Status st = check_non_negative(strides); !st.ok()) return st;
  if (!check_memory) return Status::Ok();
  for (const auto& [name, descale] : {std::pair{"q_descale", a.q_descale},
                                      std::pair{"k_descale", a.k_descale},
                                      std::pair{"v_descale", a.v_descale}}) {
    if (descale != nullptr && !aligned(descale, alignof(float))) {
      return invalid(std::string(name) + " must be 4-byte aligned (fp32)");
    }
  }
  return Status::Ok();
}

// FwdArgs::o_dtype: unset, or a 16-bit call's own dtype, or kBF16 or kFP16 for kE4M3 (the
// instance is the same; the kernel's fp32 -> 16-bit rounding follows the choice). O's dtype is
// no trait, so no dispatcher miss would say it: checked here, before any launch.
Status check_o_dtype(const FwdArgs& a) {
  if (!a.o_dtype) return Status::Ok();
  const DataType o = *a.o_dtype;
  if (a.dtype == DataType::kE4M3) {
    if (o == DataType::kBF16 || o == DataType::kFP16) return Status::Ok();
  } else if (o == a.dtype) {
    return Status::Ok();
  }
  // An int cast into the enum (as the bindings do) may name no enumerator.
  auto name = [](DataType t) {
    switch (t) {
      case DataType::kFP16: return std::string("kFP16");
      case DataType::kBF16: return std::string("kBF16");
      case DataType::kE4M3: return std::string("kE4M3");
    }
    return std::to_string(static_cast<int>(t));
  };
  if (a.dtype == DataType::kE4M3) {
    return invalid("o_dtype " + name(o) +
                   " for dtype kE4M3: valid: kBF16 (unset means it) or kFP16");
  }
  return invalid("o_dtype " + name(o) + " for dtype " + name(a.dtype) + ": valid: " +
                 name(a.dtype) + " (unset means it); kBF16 or kFP16 are for dtype kE4M3 only");
}

// Shapes, traits and options always; pointers, alignment and strides only when `check_memory`
// (select() and explain() describe a problem without tensors). The window sizes are read only
// for MaskType::kWindow: the other masks ignore them, as fmha.h says.
Status check_fwd_args(const FwdArgs& a, bool check_memory) {
  for (const Status& st :
       {check_enum("dtype", a.dtype, DataType::kE4M3, "kFP16, kBF16, kE4M3"),
        check_enum("mode", a.mode, Mode::kGroup, "kBatch, kGroup"),
        check_enum("mask type", a.mask, MaskType::kWindow, "kNone, kCausal, kWindow"),
        check_enum("mask alignment", a.mask_align, MaskAlign::kBottomRight,
                   "kTopLeft, kBottomRight"),
        check_enum("bias type", a.bias, BiasType::kAlibi, "kNone, kElementwise, kAlibi"),
        check_enum("V layout", a.vlayout, VLayout::kColMajor, "kRowMajor, kColMajor")}) {
    if (!st.ok()) return st;
  }
  if (Status st = check_o_dtype(a); !st.ok()) return st;
  if (a.batch < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 || a.nhead_q < 0 || a.nhead_k < 0) {
    return invalid("batch, seqlen_q, seqlen_k, nhead_q and nhead_k must be non-negative");
  }
  for (const Status& st :
       {check_head_dims(a.hdim_q, a.hdim_v), check_seqlen_sum(a.seqlen_q, "seqlen_k", a.seqlen_k),
        check_heads(a.nhead_q, a.nhead_k), check_grid_yz(a.batch, a.nhead_q)}) {
    if (!st.ok()) return st;
  }
  // Before an instance is chosen, with the tile that launches the fewest CTAs: too many for it
  // is too many for every instance. run_fwd() and select() check the chosen one's.
  if (Status st = check_causal_grid(a, largest_fwd_block_m(), "the largest compiled"); !st.ok()) {
    return st;
  }
  for (const Status& st :
       {check_softmax_scale(a.softmax_scale),
        a.mask == MaskType::kWindow ? check_window(a.window_left, a.window_right) : Status::Ok(),
        check_softcap(a.softcap)}) {
    if (!st.ok()) return st;
  }
  if (!(std::isfinite(a.dropout_p) && a.dropout_p >= 0.f && a.dropout_p < 1.f)) {
    return invalid("dropout_p must be in [0, 1)");
  }
  // Operands the problem's traits would ignore are a caller's mistake, not something to drop.
  if (a.mode == Mode::kBatch && (a.cu_seqlens_q != nullptr || a.cu_seqlens_k != nullptr)) {
    return invalid("cu_seqlens_q/cu_seqlens_k are for Mode::kGroup; batch mode must not get them");
  }
  if (a.mode == Mode::kBatch && (a.total_q != 0 || a.total_k != 0)) {
    return invalid("total_q/total_k are for Mode::kGroup; batch mode must leave them 0");
  }
  if (a.bias != BiasType::kElementwise && a.bias_ptr != nullptr) {
    return invalid("bias_ptr is set but the bias type is not BiasType::kElementwise");
  }
  if (a.bias != BiasType::kAlibi && a.alibi_slopes != nullptr) {
    return invalid("alibi_slopes is set but the bias type is not BiasType::kAlibi");
  }
  if (Status st = check_descales(a, check_memory); !st.ok()) return st;
  // Refused before any launch, as the copy would trap on the device (fmha.h's VLayout).
  if (a.dtype == DataType::kE4M3 && a.vlayout == VLayout::kColMajor && a.mode == Mode::kGroup) {
    return invalid("dtype kE4M3 takes V^T (VLayout::kColMajor) in Mode::kBatch only: TMA copies "
                   "V^T tiles with the keys innermost, and a packed sequence whose first key "
                   "(cu_seqlens_k) is not a multiple of 16 cannot be copied; in Mode::kGroup pass "
                   "V row-major (VLayout::kRowMajor), which the kernel transposes");
  }
  if (is_empty(a) || !check_memory) return Status::Ok();

  // Group mode ignores the batch strides: a sequence starts at its cu_seqlens entry.
  const bool batch_mode = a.mode == Mode::kBatch;
  auto batch_stride = [&](int64_t stride) { return batch_mode ? stride : 0; };
  // Q, K and V in the dtype's 16-byte pieces; O is 16-bit whatever the dtype (o_dtype).
  const int64_t input_align = align_elements(a.dtype);
  if (Status st = check_operand("q", a.q, {{"batch", batch_stride(a.q_batch_stride)},
                                           {"seq", a.q_seq_stride},
                                           {"head", a.q_head_stride}},
                                input_align);
      !st.ok()) {
    return st;
  }
  if (Status st = check_operand("o", a.o, {{"batch", batch_stride(a.o_batch_stride)},
                                           {"seq", a.o_seq_stride},
                                           {"head", a.o_head_stride}});
      !st.ok()) {
    return st;
  }
  if (a.seqlen_k > 0) {
    if (Status st = check_operand("k", a.k, {{"batch", batch_stride(a.k_batch_stride)},
                                             {"seq", a.k_seq_stride},
                                             {"head", a.k_head_stride}},
                                  input_align);
        !st.ok()) {
      return st;
    }
    // V moves in 16-byte pieces along its contiguous dimension, hdim or seqlen.
    const bool row_major = a.vlayout == VLayout::kRowMajor;
    if (row_major && a.v_dim_stride != 1) {
      return invalid("v_dim_stride is " + std::to_string(a.v_dim_stride) +
                     "; VLayout::kRowMajor needs 1 (the head dim contiguous)");
    }
    if (!row_major && a.v_seq_stride != 1) {
      return invalid("v_seq_stride is " + std::to_string(a.v_seq_stride) +
                     "; VLayout::kColMajor needs 1 (the sequence contiguous)");
    }
    if (!row_major && (a.v_dim_stride <= 0 || a.v_dim_stride % input_align != 0)) {
      return invalid("v_dim_stride is " + std::to_string(a.v_dim_stride) +
                     "; VLayout::kColMajor needs a positive multiple of " +
                     std::to_string(input_align) + " elements");
    }
    if (Status st = check_operand(
            "v", a.v,
            {{"batch", batch_stride(a.v_batch_stride)},
             {row_major ? "seq" : "dim", row_major ? a.v_seq_stride : a.v_dim_stride},
             {"head", a.v_head_stride}},
            input_align);
        !st.ok()) {
      return st;
    }
  }

  const char* group_why = "Mode::kGroup needs cu_seqlens_q and cu_seqlens_k";
  for (const Status& st :
       {check_int_array("cu_seqlens_q", a.cu_seqlens_q, !batch_mode, group_why),
        check_int_array("cu_seqlens_k", a.cu_seqlens_k, !batch_mode, group_why),
        check_int_array("seqused_q", a.seqused_q, false, ""),
        check_int_array("seqused_k", a.seqused_k, false, "")}) {
    if (!st.ok()) return st;
  }
  // A group has at least its longest sequence's rows; the sm90a pipeline's tensor maps are
  // bounded by these totals, so they must be the packed tensors' true row counts.
  if (a.mode == Mode::kGroup && (a.total_q < a.seqlen_q || a.total_k < a.seqlen_k)) {
    return invalid("Mode::kGroup needs total_q >= seqlen_q and total_k >= seqlen_k (the rows of "
                   "the packed Q/O and K/V tensors); got total_q=" + std::to_string(a.total_q) +
                   ", total_k=" + std::to_string(a.total_k));
  }

  if (a.bias == BiasType::kElementwise) {
    if (a.bias_ptr == nullptr) return invalid("BiasType::kElementwise needs bias_ptr");
    // The bias is of the dtype: 2-byte elements, 1-byte ones of e4m3.
    const uintptr_t bias_bytes = kAlignBytes / align_elements(a.dtype);
    if (!aligned(a.bias_ptr, bias_bytes)) {
      return invalid("bias_ptr must be aligned to its " + std::to_string(bias_bytes) +
                     "-byte elements");
    }
    if (Status st = check_non_negative({{"bias_batch_stride", a.bias_batch_stride},
                                        {"bias_head_stride", a.bias_head_stride},
                                        {"bias_seq_stride", a.bias_seq_stride}});
        !st.ok()) {
      return st;
    }
  }
  if (a.bias == BiasType::kAlibi) {
    if (Status st = check_alibi_slopes(a.alibi_slopes, a.alibi_batch_stride); !st.ok()) {
      return st;
    }
  }
  return check_lse(a.lse, batch_stride(a.lse_batch_stride), a.lse_head_stride);
}

// Checks, picks an entry (the named one, or the dispatcher's choice) and launches it.
Status run_fwd(const FwdArgs& args, Stream stream, const std::string* instance,
               std::string* chosen) {
  if (Status st = check_fwd_args(args, /*check_memory=*/true); !st.ok()) return st;
  int cc = 0;
  if (Status st = detail::launch_device_cc(&cc); !st.ok()) return st;
  const detail::FwdInstanceEntry* entry = nullptr;
  if (Status st = entry_for_call(args, cc, instance, stream, &entry); !st.ok()) return st;
  if (Status st = check_causal_grid(args, entry->block_m, entry->name + std::string("'s"));
      !st.ok()) {
    return st;
  }
  if (chosen != nullptr) *chosen = entry->name;
  if (is_empty(args)) return Status::Ok();  // nothing to compute, nothing launched

  const cudaError_t err = entry->launch(args, stream);
  if (err != cudaSuccess) return launch_failed("fmha::fwd", entry->name, err);
  return Status::Ok();
}

// ---- the backward ------------------------------------------------------------------------

// The forward problem's checks, said as the backward's.
Status as_bwd(Status st) { return said_by("fmha::bwd", std::move(st)); }

Status invalid_bwd(const std::string& message) { return as_bwd(invalid(message)); }

// The forward's problem as it ran (o and lse are read), then what only the backward has. An
// empty problem (no sequence or no head) writes nothing, so it needs no pointers.
Status check_bwd_args(const BwdArgs& a, bool check_memory) {
  const FwdArgs& f = a.fwd;
  if (f.dtype == DataType::kE4M3) {
    return invalid_bwd("dtype kE4M3 (float8 e4m3) is an input type of the forward only: there "
                       "is no FP8 backward; differentiate a kFP16 or kBF16 forward");
  }
  if (Status st = as_bwd(check_fwd_args(f, check_memory)); !st.ok()) return st;
  if (f.vlayout != VLayout::kRowMajor) {
    return invalid_bwd("the backward takes row-major V (VLayout::kRowMajor) only; pass V with "
                       "its head dim contiguous");
  }
  if (a.dbias != nullptr && f.bias != BiasType::kElementwise) {
    return invalid_bwd("dbias is set but the bias type is not BiasType::kElementwise (only an "
                       "elementwise bias has a gradient)");
  }
  if (!check_memory || f.batch == 0 || f.nhead_q == 0) return Status::Ok();
  if (f.lse == nullptr) {
    return invalid_bwd("fwd.lse is a null pointer: the backward reads the forward's "
                       "log-sum-exp; run the forward with it (return_lse)");
  }
  const bool batch_mode = f.mode == Mode::kBatch;
  auto batch_stride = [&](int64_t stride) { return batch_mode ? stride : 0; };
  struct Operand {
    const char* name;
    const void* ptr;
    int64_t batch, seq, head;
    bool present;  // a problem without rows or keys leaves the gradients of that side alone
  };
  const bool rows = f.seqlen_q > 0, keys = f.seqlen_k > 0;
  for (const Operand& o :
       {Operand{"dout", a.dout, a.dout_batch_stride, a.dout_seq_stride, a.dout_head_stride, rows},
        Operand{"dq", a.dq, a.dq_batch_stride, a.dq_seq_stride, a.dq_head_stride, rows},
        Operand{"dk", a.dk, a.dk_batch_stride, a.dk_seq_stride, a.dk_head_stride, keys},
        Operand{"dv", a.dv, a.dv_batch_stride, a.dv_seq_stride, a.dv_head_stride, keys}}) {
    if (!o.present) continue;
    if (Status st = as_bwd(check_operand(
            o.name, o.ptr, {{"batch", batch_stride(o.batch)}, {"seq", o.seq}, {"head", o.head}}));
        !st.ok()) {
      return st;
    }
  }
  if (a.dbias != nullptr) {
    if (!aligned(a.dbias, 2)) return invalid_bwd("dbias must be aligned to its 2-byte elements");
    if (Status st = as_bwd(check_non_negative({{"dbias_batch_stride", a.dbias_batch_stride},
                                               {"dbias_head_stride", a.dbias_head_stride},
                                               {"dbias_seq_stride", a.dbias_seq_stride}}));
        !st.ok()) {
      return st;
    }
  }
  return Status::Ok();
}

Status run_bwd(const BwdArgs& args, Stream stream, const std::string* instance,
               std::string* chosen) {
  if (Status st = check_bwd_args(args, /*check_memory=*/true); !st.ok()) return st;
  int cc = 0;
  if (Status st = detail::launch_device_cc(&cc); !st.ok()) return st;
  const detail::BwdInstanceEntry* entry = nullptr;
  if (Status st = entry_for_call(args, cc, instance, stream, &entry); !st.ok()) return st;
  if (chosen != nullptr) *chosen = entry->name;
  if (args.fwd.batch == 0 || args.fwd.nhead_q == 0) return Status::Ok();  // nothing to write
  if (Status st = as_bwd(check_workspace(args.workspace, args.workspace_bytes,
                                         entry->workspace(args), "bwd_workspace_size"));
      !st.ok()) {
    return st;
  }
  const cudaError_t err = entry->launch(args, stream);
  if (err != cudaSuccess) return launch_failed("fmha::bwd", entry->name, err);
  return Status::Ok();
}

// ---- KV-cache attention --------------------------------------------------------------------

// The shared checks, said as fwd_kvcache's.
Status as_kvcache(Status st) { return said_by("fmha::fwd_kvcache", std::move(st)); }

Status invalid_kvcache(const std::string& message) { return as_kvcache(invalid(message)); }

// Shapes, traits and options always; with `check_memory` also the pointers, their alignment
// and the strides. select(), explain() and kvcache_workspace_size() describe a call without
// tensors, where a null pointer may stand for one not known yet: so a pointer that must be
// there is checked only with `check_memory`, while one that must not (a paged cache's
// cache_batch_idx, ALiBi's slopes without ALiBi) is an error either way.
Status check_kvcache_args(const KvcacheArgs& a, bool check_memory) {
  if (a.dtype == DataType::kE4M3) {
    return invalid_kvcache("dtype is the queries' (q, k_new, v_new and o): kFP16 or kBF16; "
                           "DataType::kE4M3 is an input type of fmha::fwd only. An FP8 cache "
                           "is kv_dtype KvCacheDtype::kE4M3, with 16-bit queries");
  }
  for (const Status& st :
       {check_enum("dtype", a.dtype, DataType::kBF16, "kFP16, kBF16"),
        check_enum("KV cache dtype", a.kv_dtype, KvCacheDtype::kE4M3, "kSame, kE4M3"),
        check_enum("mask type", a.mask, MaskType::kWindow, "kNone, kCausal, kWindow"),
        check_enum("bias type", a.bias, BiasType::kAlibi, "kNone, kAlibi")}) {
    if (!st.ok()) return as_kvcache(st);
  }
  if (a.bias == BiasType::kElementwise) {
    return invalid_kvcache("a KV-cache call has no bias tensor: the bias type must be "
                           "BiasType::kNone or kAlibi");
  }
  if (a.batch <= 0 || a.seqlen_q <= 0 || a.nhead_q <= 0 || a.nhead_k <= 0) {
    std::ostringstream s;
    s << "batch, seqlen_q, nhead_q and nhead_k must be positive, got " << a.batch << ", "
      << a.seqlen_q << ", " << a.nhead_q << ", " << a.nhead_k;
    return invalid_kvcache(s.str());
  }
  if (a.seqlen_cache <= 0 || a.batch_cache <= 0) {
    std::ostringstream s;
    s << "seqlen_cache and batch_cache must be positive (the keys a sequence's cache holds, and "
      << "the cache's sequences or pages), got " << a.seqlen_cache << ", " << a.batch_cache;
    return invalid_kvcache(s.str());
  }
  if (a.seqlen_new < 0 || a.seqlen_new > a.seqlen_cache) {
    std::ostringstream s;
    s << "seqlen_new must be in [0, seqlen_cache=" << a.seqlen_cache << "] (the new keys go "
      << "into the cache), got " << a.seqlen_new;
    return invalid_kvcache(s.str());
  }
  for (const Status& st :
       {check_head_dims(a.hdim_q, a.hdim_v),
        check_seqlen_sum(a.seqlen_q, "seqlen_cache", a.seqlen_cache),
        check_heads(a.nhead_q, a.nhead_k), check_grid_yz(a.batch, a.nhead_q),
        check_softmax_scale(a.softmax_scale), check_softcap(a.softcap)}) {
    if (!st.ok()) return as_kvcache(st);
  }
  if (a.mask == MaskType::kWindow) {
    if (Status st = check_window(a.window_left, a.window_right); !st.ok()) return as_kvcache(st);
  } else if (a.window_left != -1 || a.window_right != -1) {
    std::ostringstream s;
    s << "window_left and window_right are MaskType::kWindow's; with another mask they must be "
      << "-1, got (" << a.window_left << ", " << a.window_right << ")";
    return invalid_kvcache(s.str());
  }
  if (a.num_splits < 0) {
    return invalid_kvcache("num_splits must be non-negative (0 picks it from the shapes and the "
                           "GPU), got " + std::to_string(a.num_splits));
  }
  if (a.rotary_dim < 0 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.hdim_q) {
    std::ostringstream s;
    s << "rotary_dim must be 0 (no rotary embedding) or even and at most hdim_q=" << a.hdim_q
      << ", got " << a.rotary_dim;
    return invalid_kvcache(s.str());
  }
  if (a.rotary_dim > 0 && a.seqlen_rotary < a.seqlen_cache) {
    std::ostringstream s;
    s << "rotary_cos/rotary_sin have seqlen_rotary=" << a.seqlen_rotary << " rows; keys reach "
      << "position seqlen_cache=" << a.seqlen_cache << ", which needs at least as many";
    return invalid_kvcache(s.str());
  }
  if (a.rotary_dim == 0 && (a.rotary_cos != nullptr || a.rotary_sin != nullptr)) {
    return invalid_kvcache("rotary_cos/rotary_sin are set but rotary_dim is 0");
  }
  if (a.k_new != nullptr && a.seqlen_new == 0) {
    return invalid_kvcache("k_new is set but seqlen_new, its rows, is 0");
  }
  const bool paged = a.block_table != nullptr;
  if (paged && a.page_size <= 0) {
    return invalid_kvcache("a paged cache (block_table set) needs page_size >= 1, got " +
                           std::to_string(a.page_size));
  }
  if (paged && a.seqlen_cache % a.page_size != 0) {
    std::ostringstream s;
    s << "seqlen_cache (" << a.seqlen_cache << ") must be a multiple of page_size ("
      << a.page_size << "): block_table's columns times page_size";
    return invalid_kvcache(s.str());
  }
  if (paged && a.cache_batch_idx != nullptr) {
    return invalid_kvcache("cache_batch_idx selects rows of a contiguous cache; a paged cache "
                           "(block_table set) must not get it");
  }
  if (paged && a.cache_leftpad != nullptr) {
    return invalid_kvcache("cache_leftpad offsets the keys of a contiguous cache's rows; a "
                           "paged cache (block_table set) must not get it (as FlashAttention's)");
  }
  if (!paged && a.page_size != 0) {
    return invalid_kvcache("page_size is " + std::to_string(a.page_size) + " but block_table "
                           "is null: a paged cache needs block_table, a contiguous one "
                           "page_size 0");
  }
  if (a.bias != BiasType::kAlibi && a.alibi_slopes != nullptr) {
    return invalid_kvcache("alibi_slopes is set but the bias type is not BiasType::kAlibi");
  }
  // An e4m3 cache: its scales (where they are, with check_memory), and rows of whole 16-byte
  // pieces of 16 elements. A cache of the queries' dtype has no scales.
  const bool e4m3 = a.kv_dtype == KvCacheDtype::kE4M3;
  if (!e4m3) {
    if (a.k_scale != nullptr || a.v_scale != nullptr) {
      return invalid_kvcache(
          "k_scale/v_scale are set but kv_dtype is KvCacheDtype::kSame: they dequantize a "
          "KvCacheDtype::kE4M3 cache; a cache of the queries' dtype takes none");
    }
    if (a.k_scale_batch_stride != 0 || a.k_scale_head_stride != 0 ||
        a.v_scale_batch_stride != 0 || a.v_scale_head_stride != 0) {
      return invalid_kvcache(
          "k_scale/v_scale strides are set but kv_dtype is KvCacheDtype::kSame, whose cache "
          "has no scales; they must be 0");
    }
  } else {
    if (Status st = check_non_negative({{"k_scale_batch_stride", a.k_scale_batch_stride},
                                        {"k_scale_head_stride", a.k_scale_head_stride},
                                        {"v_scale_batch_stride", a.v_scale_batch_stride},
                                        {"v_scale_head_stride", a.v_scale_head_stride}});
        !st.ok()) {
      return as_kvcache(st);
    }
    if (a.hdim_q % kE4m3AlignElements != 0 || a.hdim_v % kE4m3AlignElements != 0) {
      std::ostringstream s;
      s << "an e4m3 cache (KvCacheDtype::kE4M3) needs head dims that are multiples of "
        << kE4m3AlignElements << " (its rows move in whole 16-byte pieces of "
        << kE4m3AlignElements << " elements), got hdim_q=" << a.hdim_q << ", hdim_v=" << a.hdim_v;
      return invalid_kvcache(s.str());
    }
  }
  if (!check_memory) return Status::Ok();

  struct Operand {
    const char* name;
    const void* ptr;
    int64_t batch, seq, head;
    int64_t align_elements = kAlignElements;
  };
  const int64_t cache_align = e4m3 ? kE4m3AlignElements : kAlignElements;
  std::vector<Operand> operands = {
      {"q", a.q, a.q_batch_stride, a.q_seq_stride, a.q_head_stride},
      {"k_cache", a.k_cache, a.k_cache_batch_stride, a.k_cache_seq_stride, a.k_cache_head_stride,
       cache_align},
      {"v_cache", a.v_cache, a.v_cache_batch_stride, a.v_cache_seq_stride, a.v_cache_head_stride,
       cache_align},
      {"o", a.o, a.o_batch_stride, a.o_seq_stride, a.o_head_stride}};
  if (a.k_new != nullptr || a.v_new != nullptr) {
    if (a.k_new == nullptr || a.v_new == nullptr) {
      return invalid_kvcache("k_new and v_new are appended together: set both or neither");
    }
    operands.push_back(
        {"k_new", a.k_new, a.k_new_batch_stride, a.k_new_seq_stride, a.k_new_head_stride});
    operands.push_back(
        {"v_new", a.v_new, a.v_new_batch_stride, a.v_new_seq_stride, a.v_new_head_stride});
  } else if (a.seqlen_new > 0) {
    return invalid_kvcache("seqlen_new is " + std::to_string(a.seqlen_new) +
                           " but k_new/v_new are null; without new keys it must be 0");
  }
  for (const Operand& o : operands) {
    if (Status st = check_operand(o.name, o.ptr,
                                  {{"batch", o.batch}, {"seq", o.seq}, {"head", o.head}},
                                  o.align_elements);
        !st.ok()) {
      return as_kvcache(st);
    }
  }
  if (e4m3) {
    for (const auto& [name, scale] :
         {std::pair{"k_scale", a.k_scale}, std::pair{"v_scale", a.v_scale}}) {
      if (scale == nullptr) {
        return invalid_kvcache(std::string(name) +
                               " is a null pointer; an e4m3 cache (KvCacheDtype::kE4M3) needs "
                               "k_scale and v_scale: device fp32 dequantization factors, one "
                               "for the tensor, per K/V head, or per sequence and K/V head");
      }
      if (!aligned(scale, alignof(float))) {
        return invalid_kvcache(std::string(name) + " must be 4-byte aligned (fp32)");
      }
    }
  }
  for (const Status& st :
       {check_int_array("cache_seqlens", a.cache_seqlens, true,
                        "every call needs the keys each sequence's cache holds (device int32, "
                        "one per sequence)"),
        check_int_array("cache_batch_idx", a.cache_batch_idx, false, ""),
        check_int_array("cache_leftpad", a.cache_leftpad, false, ""),
        check_int_array("block_table", a.block_table, false, ""),
        check_non_negative({{"block_table_batch_stride", a.block_table_batch_stride}}),
        check_lse(a.lse, a.lse_batch_stride, a.lse_head_stride)}) {
    if (!st.ok()) return as_kvcache(st);
  }
  if (!paged && a.cache_batch_idx == nullptr && a.batch_cache < a.batch) {
    std::ostringstream s;
    s << "the cache holds batch_cache=" << a.batch_cache << " sequences, fewer than batch="
      << a.batch << "; set cache_batch_idx to map sequences to cache rows";
    return invalid_kvcache(s.str());
  }
  if (a.rotary_dim > 0) {
    if (a.k_new == nullptr) {
      return invalid_kvcache("a rotary embedding rotates q and k_new: rotary_dim " +
                             std::to_string(a.rotary_dim) + " needs k_new and v_new");
    }
    for (const auto& [name, table] :
         {std::pair{"rotary_cos", a.rotary_cos}, std::pair{"rotary_sin", a.rotary_sin}}) {
      if (table == nullptr) {
        return invalid_kvcache(std::string(name) + " is a null pointer; rotary_dim " +
                               std::to_string(a.rotary_dim) + " needs rotary_cos and rotary_sin");
      }
      if (!aligned(table, 2)) {
        return invalid_kvcache(std::string(name) + " must be aligned to its 2-byte elements");
      }
    }
  }
  if (a.bias == BiasType::kAlibi) {
    if (Status st = check_alibi_slopes(a.alibi_slopes, a.alibi_batch_stride); !st.ok()) {
      return as_kvcache(st);
    }
  }
  return Status::Ok();
}

// Checks (the workspace's size included), picks an entry (the named one, or the dispatcher's
// choice) and launches it.
Status run_kvcache(const KvcacheArgs& args, Stream stream, const std::string* instance,
                   std::string* chosen) {
  if (Status st = check_kvcache_args(args, /*check_memory=*/true); !st.ok()) return st;
  int cc = 0;
  if (Status st = detail::launch_device_cc(&cc); !st.ok()) return st;
  const detail::KvcacheInstanceEntry* entry = nullptr;
  if (Status st = entry_for_call(args, cc, instance, stream, &entry); !st.ok()) return st;
  if (Status st = as_kvcache(check_workspace(args.workspace, args.workspace_bytes,
                                             entry->workspace(args), "kvcache_workspace_size"));
      !st.ok()) {
    return st;
  }
  if (chosen != nullptr) *chosen = entry->name;
  const cudaError_t err = entry->launch(args, stream);
  if (err != cudaSuccess) return launch_failed("fmha::fwd_kvcache", entry->name, err);
  return Status::Ok();
}

// ---- what select(), explain() and the instance lists of every operation share ---------------

// select() and explain() without a compute capability ask for the current device's.
constexpr int kCurrentDevice = 0;

// The compute capability a select() or explain() is for: `requested`, or the current device's
// for kCurrentDevice.
Status query_cc(int requested, const char* api, int* cc) {
  if (requested == kCurrentDevice) return detail::current_device_cc(cc);
  if (requested < 10) {
    return {Status::Code::kInvalidArgument,
            std::string(api) + ": cc must be a compute capability, major * 10 + minor (80 for "
            "an A100, 90 for an H100), got " + std::to_string(requested)};
  }
  *cc = requested;
  return Status::Ok();
}

// The dispatcher's choice for `args` on a GPU of compute capability `requested_cc`, whose
// checks without memory gave `checked`.
template <class Entry, class Args>
Status select_checked(const Status& checked, const Args& args, int requested_cc,
                      const Entry** entry) {
  if (!checked.ok()) return checked;
  int cc = 0;
  if (Status st = query_cc(requested_cc, "fmha::select", &cc); !st.ok()) return st;
  return detail::select_instance(args, cc, entry);
}

// A miss is what explain() is for, so it is explained, not returned as an error: the status
// fails only for invalid arguments (`checked`, `requested_cc`) or a device that cannot be
// queried.
template <class Args>
Status explain_checked(const Status& checked, const Args& args, int requested_cc,
                       std::string* explanation) {
  if (!checked.ok()) return checked;
  int cc = 0;
  if (Status st = query_cc(requested_cc, "fmha::explain", &cc); !st.ok()) return st;
  if (explanation != nullptr) *explanation = detail::explain_selection(args, cc);
  return Status::Ok();
}

// An operation's table as its public rows, in the dispatcher's order.
template <class Info, class Entry>
std::vector<Info> infos(detail::EntryList<Entry> entries) {
  std::vector<Info> out;
  out.reserve(entries.size);
  for (const Entry& e : entries) out.push_back(detail::to_info(e));
  return out;
}

}  // namespace

FwdTraits FwdArgs::traits() const {
  FwdTraits t;
  t.dtype = dtype;
  t.hdim_q = hdim_q;
  t.hdim_v = hdim_v;
  t.mask = mask;
  t.bias = bias;
  t.vlayout = vlayout;
  t.mode = mode;
  t.lse = lse != nullptr;
  t.dropout = dropout_p > 0.f;
  t.softcap = softcap > 0.f;
  return t;
}

Status select(const FwdArgs& args, InstanceInfo* chosen) {
  return select(args, kCurrentDevice, chosen);
}

Status select(const FwdArgs& args, int cc, InstanceInfo* chosen) {
  const detail::FwdInstanceEntry* entry = nullptr;
  if (Status st = select_checked(check_fwd_args(args, /*check_memory=*/false), args, cc, &entry);
      !st.ok()) {
    return st;
  }
  if (Status st = check_causal_grid(args, entry->block_m, entry->name + std::string("'s"));
      !st.ok()) {
    return st;
  }
  if (chosen != nullptr) *chosen = detail::to_info(*entry);
  return Status::Ok();
}

Status explain(const FwdArgs& args, std::string* explanation) {
  return explain(args, kCurrentDevice, explanation);
}

Status explain(const FwdArgs& args, int cc, std::string* explanation) {
  return explain_checked(check_fwd_args(args, /*check_memory=*/false), args, cc, explanation);
}

Status fwd(const FwdArgs& args, Stream stream, std::string* chosen) {
  return run_fwd(args, stream, nullptr, chosen);
}

Status fwd_instance(const std::string& instance, const FwdArgs& args, Stream stream) {
  return run_fwd(args, stream, &instance, nullptr);
}

std::vector<InstanceInfo> instances() {
  return infos<InstanceInfo>(detail::fwd_entries());
}

BwdTraits BwdArgs::traits() const {
  BwdTraits t;
  t.dtype = fwd.dtype;
  t.hdim_q = fwd.hdim_q;
  t.hdim_v = fwd.hdim_v;
  t.mask = fwd.mask;
  t.bias = fwd.bias;
  t.mode = fwd.mode;
  t.dbias = dbias != nullptr;
  t.dropout = fwd.dropout_p > 0.f;
  t.softcap = fwd.softcap > 0.f;
  return t;
}

Status bwd(const BwdArgs& args, Stream stream, std::string* chosen) {
  return run_bwd(args, stream, nullptr, chosen);
}

Status bwd_instance(const std::string& instance, const BwdArgs& args, Stream stream) {
  return run_bwd(args, stream, &instance, nullptr);
}

namespace {

// bwd_workspace_size() of the dispatcher's choice, or of `instance` where one is named.
Status workspace_size(const BwdArgs& args, const std::string* instance, Stream stream,
                      size_t* bytes) {
  if (Status st = check_bwd_args(args, /*check_memory=*/false); !st.ok()) return st;
  int cc = 0;
  if (Status st = detail::current_device_cc(&cc); !st.ok()) return st;
  const detail::BwdInstanceEntry* entry = nullptr;
  if (Status st = entry_for_call(args, cc, instance, stream, &entry); !st.ok()) return st;
  if (bytes != nullptr) {
    *bytes = args.fwd.batch == 0 || args.fwd.nhead_q == 0 ? 0 : entry->workspace(args);
  }
  return Status::Ok();
}

}  // namespace

Status bwd_workspace_size(const BwdArgs& args, size_t* bytes, Stream stream) {
  return workspace_size(args, nullptr, stream, bytes);
}

Status bwd_workspace_size(const std::string& instance, const BwdArgs& args, size_t* bytes) {
  return workspace_size(args, &instance, nullptr, bytes);
}

Status select(const BwdArgs& args, BwdInstanceInfo* chosen) {
  return select(args, kCurrentDevice, chosen);
}

Status select(const BwdArgs& args, int cc, BwdInstanceInfo* chosen) {
  const detail::BwdInstanceEntry* entry = nullptr;
  if (Status st = select_checked(check_bwd_args(args, /*check_memory=*/false), args, cc, &entry);
      !st.ok()) {
    return st;
  }
  if (chosen != nullptr) *chosen = detail::to_info(*entry);
  return Status::Ok();
}

Status explain(const BwdArgs& args, std::string* explanation) {
  return explain(args, kCurrentDevice, explanation);
}

Status explain(const BwdArgs& args, int cc, std::string* explanation) {
  return explain_checked(check_bwd_args(args, /*check_memory=*/false), args, cc, explanation);
}

std::vector<BwdInstanceInfo> bwd_instances() {
  return infos<BwdInstanceInfo>(detail::bwd_entries());
}

KvcacheTraits KvcacheArgs::traits() const {
  KvcacheTraits t;
  t.dtype = dtype;
  t.kv_dtype = kv_dtype;
  t.hdim_q = hdim_q;
  t.hdim_v = hdim_v;
  t.mask = mask;
  t.bias = bias;
  t.paged = block_table != nullptr;
  t.softcap = softcap > 0.f;
  return t;
}

Status fwd_kvcache(const KvcacheArgs& args, Stream stream, std::string* chosen) {
  return run_kvcache(args, stream, nullptr, chosen);
}

Status fwd_kvcache_instance(const std::string& instance, const KvcacheArgs& args,
                            Stream stream) {
  return run_kvcache(args, stream, &instance, nullptr);
}

namespace {

// kvcache_workspace_size() of the dispatcher's choice, or of `instance` where one is named.
Status workspace_size(const KvcacheArgs& args, const std::string* instance, Stream stream,
                      size_t* bytes) {
  if (Status st = check_kvcache_args(args, /*check_memory=*/false); !st.ok()) return st;
  int cc = 0;
  if (Status st = detail::current_device_cc(&cc); !st.ok()) return st;
  const detail::KvcacheInstanceEntry* entry = nullptr;
  if (Status st = entry_for_call(args, cc, instance, stream, &entry); !st.ok()) return st;
  if (bytes != nullptr) *bytes = entry->workspace(args);
  return Status::Ok();
}

}  // namespace

Status kvcache_workspace_size(const KvcacheArgs& args, size_t* bytes, Stream stream) {
  return workspace_size(args, nullptr, stream, bytes);
}

Status kvcache_workspace_size(const std::string& instance, const KvcacheArgs& args,
                              size_t* bytes) {
  return workspace_size(args, &instance, nullptr, bytes);
}

Status select(const KvcacheArgs& args, KvcacheInstanceInfo* chosen) {
  return select(args, kCurrentDevice, chosen);
}

Status select(const KvcacheArgs& args, int cc, KvcacheInstanceInfo* chosen) {
  const detail::KvcacheInstanceEntry* entry = nullptr;
  if (Status st =
          select_checked(check_kvcache_args(args, /*check_memory=*/false), args, cc, &entry);
      !st.ok()) {
    return st;
  }
  if (chosen != nullptr) *chosen = detail::to_info(*entry);
  return Status::Ok();
}

Status explain(const KvcacheArgs& args, std::string* explanation) {
  return explain(args, kCurrentDevice, explanation);
}

Status explain(const KvcacheArgs& args, int cc, std::string* explanation) {
  return explain_checked(check_kvcache_args(args, /*check_memory=*/false), args, cc, explanation);
}

std::vector<KvcacheInstanceInfo> kvcache_instances() {
  return infos<KvcacheInstanceInfo>(detail::kvcache_entries());
}

std::vector<std::string> compiled_targets() {
  return {detail::kCompiledTargets, detail::kCompiledTargets + detail::kNumCompiledTargets};
}

const char* to_string(DataType t) { return detail::kDataTypeTokens[static_cast<int>(t)]; }
const char* to_string(KvCacheDtype t) {
  return detail::kKvCacheDtypeTokens[static_cast<int>(t)];
}
const char* to_string(MaskType t) { return detail::kMaskTokens[static_cast<int>(t)]; }
const char* to_string(BiasType t) { return detail::kBiasTokens[static_cast<int>(t)]; }
const char* to_string(VLayout t) { return detail::kVLayoutTokens[static_cast<int>(t)]; }
const char* to_string(Mode t) { return detail::kModeTokens[static_cast<int>(t)]; }

}  // namespace fmha
