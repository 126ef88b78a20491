// fmha._C: the C++ API for Python. It takes plain integers (pointers, shapes, strides, the
// stream handle), not torch tensors, so it builds against no torch C++ headers; the Python
// package turns tensors into these arguments after checking them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "fmha/fmha.h"

namespace py = pybind11;

namespace {

using Strides = std::array<int64_t, 3>;  // batch, seq, head (in elements)

fmha::FwdArgs make_args(int dtype, int mask, int batch, int seqlen_q, int seqlen_k, int nhead_q,
                        int nhead_k, int hdim_q, int hdim_v, float softmax_scale) {
  fmha::FwdArgs a;
  a.dtype = static_cast<fmha::DataType>(dtype);
  a.mask = static_cast<fmha::MaskType>(mask);
  a.batch = batch;
  a.seqlen_q = seqlen_q;
  a.seqlen_k = seqlen_k;
  a.nhead_q = nhead_q;
  a.nhead_k = nhead_k;
  a.hdim_q = hdim_q;
  a.hdim_v = hdim_v;
  a.softmax_scale = softmax_scale;
  return a;
}

py::dict info_dict(const fmha::InstanceInfo& i) {
  py::dict d;
  d["name"] = i.name;
  d["dtype"] = fmha::to_string(i.traits.dtype);
  d["hdim_q"] = i.traits.hdim_q;
  d["hdim_v"] = i.traits.hdim_v;
  d["mask"] = fmha::to_string(i.traits.mask);
  d["pipeline"] = i.pipeline;
  d["arch"] = i.arch;
  d["block_m"] = i.block_m;
  d["block_n"] = i.block_n;
  d["pad_seqlen"] = i.pad_seqlen;
  return d;
}

// (status code, message, instance name): the Python side maps codes to exception types.
using Result = std::tuple<int, std::string, std::string>;

Result fwd(int dtype, int mask, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, int batch,
           int seqlen_q, int seqlen_k, int nhead_q, int nhead_k, int hdim_q, int hdim_v,
           Strides q_strides, Strides k_strides, Strides v_strides, Strides o_strides,
           float softmax_scale, uintptr_t stream, std::optional<std::string> instance) {
  fmha::FwdArgs a = make_args(dtype, mask, batch, seqlen_q, seqlen_k, nhead_q, nhead_k, hdim_q,
                              hdim_v, softmax_scale);
  a.q = reinterpret_cast<const void*>(q);
  a.k = reinterpret_cast<const void*>(k);
  a.v = reinterpret_cast<const void*>(v);
  a.o = reinterpret_cast<void*>(o);
  std::tie(a.q_batch_stride, a.q_seq_stride, a.q_head_stride) = std::tuple_cat(q_strides);
  std::tie(a.k_batch_stride, a.k_seq_stride, a.k_head_stride) = std::tuple_cat(k_strides);
  std::tie(a.v_batch_stride, a.v_seq_stride, a.v_head_stride) = std::tuple_cat(v_strides);
  std::tie(a.o_batch_stride, a.o_seq_stride, a.o_head_stride) = std::tuple_cat(o_strides);
  std::string chosen;
  fmha::Status st;
  {
    py::gil_scoped_release release;  // the launch is asynchronous, but argument checks and
                                     // the first launch's module load can take a while
    const auto s = reinterpret_cast<fmha::Stream>(stream);
    if (instance) {
      st = fmha::fwd_instance(*instance, a, s);
      chosen = *instance;
    } else {
      st = fmha::fwd(a, s, &chosen);
    }
  }
  return {static_cast<int>(st.code), st.message, chosen};
}

std::tuple<int, std::string, py::object> select_instance(int dtype, int mask, int batch, int seqlen_q,
                                                int seqlen_k, int nhead_q, int nhead_k,
                                                int hdim_q, int hdim_v, float softmax_scale) {
  const fmha::FwdArgs a = make_args(dtype, mask, batch, seqlen_q, seqlen_k, nhead_q, nhead_k,
                                    hdim_q, hdim_v, softmax_scale);
  fmha::InstanceInfo info;
  const fmha::Status st = fmha::select(a, &info);
  py::object chosen = st.ok() ? py::object(info_dict(info)) : py::none();
  return {static_cast<int>(st.code), st.message, chosen};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "libfmha bindings: pointers, shapes and strides in; see the fmha package";

  m.attr("STATUS_OK") = static_cast<int>(fmha::Status::Code::kOk);
  m.attr("STATUS_INVALID_ARGUMENT") = static_cast<int>(fmha::Status::Code::kInvalidArgument);
  m.attr("STATUS_NO_INSTANCE") = static_cast<int>(fmha::Status::Code::kNoInstance);
  m.attr("STATUS_CUDA_ERROR") = static_cast<int>(fmha::Status::Code::kCudaError);
  m.attr("DTYPE_FP16") = static_cast<int>(fmha::DataType::kFP16);
  m.attr("DTYPE_BF16") = static_cast<int>(fmha::DataType::kBF16);
  m.attr("MASK_NONE") = static_cast<int>(fmha::MaskType::kNone);
  m.attr("MASK_CAUSAL") = static_cast<int>(fmha::MaskType::kCausalTopLeft);

  m.def("fwd", &fwd,
        "Run the forward pass, with the dispatcher's instance or the one named; returns "
        "(status code, message, instance name).");
  m.def("select", &select_instance,
        "The instance fwd would run on the current device; returns (code, message, info).");
  m.def("instances", [] {
    py::list out;
    for (const auto& i : fmha::instances()) out.append(info_dict(i));
    return out;
  }, "Every compiled instance, in the dispatcher's order of preference.");
  m.def("compiled_targets", &fmha::compiled_targets, "GPU targets this library holds code for.");
}
