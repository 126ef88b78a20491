// fmha._C: the C++ API for Python. It takes plain integers (pointers, shapes, strides, the
// stream handle), not torch tensors, so it builds against no torch C++ headers; the Python
// package turns tensors into an FwdArgs (a BwdArgs for the backward, a KvcacheArgs for
// KV-cache attention) after checking them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "fmha/fmha.h"

namespace py = pybind11;

namespace {

using Args = py::class_<fmha::FwdArgs>;
using BwdArgsClass = py::class_<fmha::BwdArgs>;
using KvcacheArgsClass = py::class_<fmha::KvcacheArgs>;

// A pointer field as an integer property: a tensor's data_ptr(), 0 for none.
template <typename Struct, typename Ptr>
void pointer_property(py::class_<Struct>& cls, const char* name, Ptr Struct::*field) {
  cls.def_property(
      name, [field](const Struct& a) { return reinterpret_cast<uintptr_t>(a.*field); },
      [field](Struct& a, uintptr_t value) { a.*field = reinterpret_cast<Ptr>(value); });
}

// An enum field as an int property (the module's *_ constants); the C++ checks reject values
// outside the enum.
template <typename Struct, typename Enum>
void enum_property(py::class_<Struct>& cls, const char* name, Enum Struct::*field) {
  cls.def_property(
      name, [field](const Struct& a) { return static_cast<int>(a.*field); },
      [field](Struct& a, int value) { a.*field = static_cast<Enum>(value); });
}

// What every operation's instance info has after its traits: how and for which GPU it is built.
template <class Info>
void add_build_fields(py::dict& d, const Info& i) {
  d["pipeline"] = i.pipeline;
  d["arch"] = i.arch;
  d["arch_cc"] = i.arch_cc;
  d["arch_exact"] = i.arch_exact;
  d["block_m"] = i.block_m;
  d["block_n"] = i.block_n;
  d["pad_seqlen"] = i.pad_seqlen;
  d["pad_hdim"] = i.pad_hdim;
  // None: compiled into this build; else the shared object compile on demand loaded it from.
  d["origin"] = i.origin.empty() ? py::object(py::none()) : py::object(py::str(i.origin));
}

py::dict info_dict(const fmha::InstanceInfo& i) {
  py::dict d;
  d["name"] = i.name;
  d["dtype"] = fmha::to_string(i.traits.dtype);
  d["hdim_q"] = i.traits.hdim_q;
  d["hdim_v"] = i.traits.hdim_v;
  d["mask"] = fmha::to_string(i.traits.mask);
  d["bias"] = fmha::to_string(i.traits.bias);
  d["vlayout"] = fmha::to_string(i.traits.vlayout);
  d["mode"] = fmha::to_string(i.traits.mode);
  d["lse"] = i.traits.lse;
  d["dropout"] = i.traits.dropout;
  d["softcap"] = i.traits.softcap;
  add_build_fields(d, i);
  return d;
}

// FwdArgs::traits() with enums as ints, like the FwdArgs properties: the args may hold values
// outside the enums, which have no token.
py::dict traits_dict(const fmha::FwdTraits& t) {
  py::dict d;
  d["dtype"] = static_cast<int>(t.dtype);
  d["hdim_q"] = t.hdim_q;
  d["hdim_v"] = t.hdim_v;
  d["mask"] = static_cast<int>(t.mask);
  d["bias"] = static_cast<int>(t.bias);
  d["vlayout"] = static_cast<int>(t.vlayout);
  d["mode"] = static_cast<int>(t.mode);
  d["lse"] = t.lse;
  d["dropout"] = t.dropout;
  d["softcap"] = t.softcap;
  return d;
}

// A backward instance: InstanceInfo's keys, with the backward's traits (no vlayout or lse;
// dbias).
py::dict bwd_info_dict(const fmha::BwdInstanceInfo& i) {
  py::dict d;
  d["name"] = i.name;
  d["dtype"] = fmha::to_string(i.traits.dtype);
  d["hdim_q"] = i.traits.hdim_q;
  d["hdim_v"] = i.traits.hdim_v;
  d["mask"] = fmha::to_string(i.traits.mask);
  d["bias"] = fmha::to_string(i.traits.bias);
  d["mode"] = fmha::to_string(i.traits.mode);
  d["dbias"] = i.traits.dbias;
  d["dropout"] = i.traits.dropout;
  d["softcap"] = i.traits.softcap;
  add_build_fields(d, i);
  return d;
}

// BwdArgs::traits() with enums as ints, as traits_dict.
py::dict bwd_traits_dict(const fmha::BwdTraits& t) {
  py::dict d;
  d["dtype"] = static_cast<int>(t.dtype);
  d["hdim_q"] = t.hdim_q;
  d["hdim_v"] = t.hdim_v;
  d["mask"] = static_cast<int>(t.mask);
  d["bias"] = static_cast<int>(t.bias);
  d["mode"] = static_cast<int>(t.mode);
  d["dbias"] = t.dbias;
  d["dropout"] = t.dropout;
  d["softcap"] = t.softcap;
  return d;
}

// A KV-cache instance: InstanceInfo's keys, with KV-cache attention's traits (kv_dtype, paged;
// no vlayout, mode, lse or dropout).
py::dict kvcache_info_dict(const fmha::KvcacheInstanceInfo& i) {
  py::dict d;
  d["name"] = i.name;
  d["dtype"] = fmha::to_string(i.traits.dtype);
  d["kv_dtype"] = fmha::to_string(i.traits.kv_dtype);
  d["hdim_q"] = i.traits.hdim_q;
  d["hdim_v"] = i.traits.hdim_v;
  d["mask"] = fmha::to_string(i.traits.mask);
  d["bias"] = fmha::to_string(i.traits.bias);
  d["paged"] = i.traits.paged;
  d["softcap"] = i.traits.softcap;
  add_build_fields(d, i);
  d["prefill"] = i.prefill;
  d["full_grid_block_n"] = i.full_grid_block_n;
  return d;
}

// KvcacheArgs::traits() with enums as ints, as traits_dict.
py::dict kvcache_traits_dict(const fmha::KvcacheTraits& t) {
  py::dict d;
  d["dtype"] = static_cast<int>(t.dtype);
  d["kv_dtype"] = static_cast<int>(t.kv_dtype);
  d["hdim_q"] = t.hdim_q;
  d["hdim_v"] = t.hdim_v;
  d["mask"] = static_cast<int>(t.mask);
  d["bias"] = static_cast<int>(t.bias);
  d["paged"] = t.paged;
  d["softcap"] = t.softcap;
  return d;
}

int code(const fmha::Status& st) { return static_cast<int>(st.code); }

// explain() of any operation's args on the current device (cc 0) or a GPU of compute
// capability cc: (status code, message, text).
template <class Args>
std::tuple<int, std::string, std::string> explain_args(const Args& args, int cc) {
  std::string text;
  const fmha::Status st = fmha::explain(args, cc, &text);
  return {code(st), st.message, text};
}

// select() of any operation's args, as explain_args: (status code, message, the chosen
// instance as `to_dict` makes it, or None).
template <class Info, class Args>
std::tuple<int, std::string, py::object> select_args(const Args& args, int cc,
                                                     py::dict (*to_dict)(const Info&)) {
  Info info;
  const fmha::Status st = fmha::select(args, cc, &info);
  py::object chosen = st.ok() ? py::object(to_dict(info)) : py::none();
  return {code(st), st.message, chosen};
}

// (status code, message, instance name): the Python side maps codes to exception types.
std::tuple<int, std::string, std::string> fwd(const fmha::FwdArgs& args, uintptr_t stream,
                                              std::optional<std::string> instance) {
  std::string chosen;
  fmha::Status st;
  {
    py::gil_scoped_release release;  // the launch is asynchronous, but argument checks and
                                     // the first launch's module load can take a while
    const auto s = reinterpret_cast<fmha::Stream>(stream);
    if (instance) {
      st = fmha::fwd_instance(*instance, args, s);
      if (st.ok()) chosen = *instance;
    } else {
      st = fmha::fwd(args, s, &chosen);
    }
  }
  return {code(st), st.message, chosen};
}

// The sizes a planned group-mode (varlen) call brings: negative keeps the plan's.
void set_sizes(fmha::FwdArgs& a, int seqlen_q, int seqlen_k, int64_t total_q, int64_t total_k) {
  if (seqlen_q >= 0) a.seqlen_q = seqlen_q;
  if (seqlen_k >= 0) a.seqlen_k = seqlen_k;
  if (total_q >= 0) a.total_q = total_q;
  if (total_k >= 0) a.total_k = total_k;
}

// A planned call (fmha/_plans.py): `plan` holds a checked call's shapes, strides and options,
// and this call's tensors bring their pointers, the dropout seed and offset, and in group mode
// (varlen) the lengths and token counts, which change from one batch to the next (negative:
// the plan's); an e4m3 call's descale factors are device tensors like the others (0: none).
// Runs on the current device; returns None, or (status code, message) when nothing was
// launched. One Python-to-C++ crossing per call, where setting FwdArgs' fields one property at
// a time cost ~16 us of fwd's host time (docs/perf-notes.md v5).
py::object run_planned(const fmha::FwdArgs& plan, uintptr_t q, uintptr_t k, uintptr_t v,
                       uintptr_t o, uintptr_t lse, uintptr_t bias, uintptr_t alibi_slopes,
                       uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, uintptr_t seqused_q,
                       uintptr_t seqused_k, uintptr_t q_descale, uintptr_t k_descale,
                       uintptr_t v_descale, uint64_t dropout_seed, uint32_t dropout_offset,
                       int seqlen_q, int seqlen_k, int64_t total_q, int64_t total_k,
                       int64_t lse_head_stride, uintptr_t stream,
                       std::optional<std::string> instance) {
  fmha::FwdArgs args = plan;
  args.q = reinterpret_cast<const void*>(q);
  args.k = reinterpret_cast<const void*>(k);
  args.v = reinterpret_cast<const void*>(v);
  args.o = reinterpret_cast<void*>(o);
  args.lse = reinterpret_cast<float*>(lse);
  args.bias_ptr = reinterpret_cast<const void*>(bias);
  args.alibi_slopes = reinterpret_cast<const float*>(alibi_slopes);
  args.cu_seqlens_q = reinterpret_cast<const int32_t*>(cu_seqlens_q);
  args.cu_seqlens_k = reinterpret_cast<const int32_t*>(cu_seqlens_k);
  args.seqused_q = reinterpret_cast<const int32_t*>(seqused_q);
  args.seqused_k = reinterpret_cast<const int32_t*>(seqused_k);
  args.q_descale = reinterpret_cast<const float*>(q_descale);
  args.k_descale = reinterpret_cast<const float*>(k_descale);
  args.v_descale = reinterpret_cast<const float*>(v_descale);
  args.dropout_seed = dropout_seed;
  args.dropout_offset = dropout_offset;
  set_sizes(args, seqlen_q, seqlen_k, total_q, total_k);
  if (lse_head_stride >= 0) args.lse_head_stride = lse_head_stride;
  fmha::Status st;
  {
    py::gil_scoped_release release;  // a launch blocks while the GPU's queue is full
    const auto s = reinterpret_cast<fmha::Stream>(stream);
    st = instance ? fmha::fwd_instance(*instance, args, s) : fmha::fwd(args, s);
  }
  if (st.ok()) return py::none();
  return py::make_tuple(code(st), st.message);
}

std::tuple<int, std::string> dropout_mask(uint64_t seed, uint32_t offset, float dropout_p,
                                          int batch, int nhead, int seqlen_q, int seqlen_k,
                                          uintptr_t keep, uintptr_t stream) {
  fmha::Status st;
  {
    py::gil_scoped_release release;
    st = fmha::dropout_mask(seed, offset, dropout_p, batch, nhead, seqlen_q, seqlen_k,
                            reinterpret_cast<uint8_t*>(keep),
                            reinterpret_cast<fmha::Stream>(stream));
  }
  return {code(st), st.message};
}

// The backward's fwd(): (status code, message, instance name).
std::tuple<int, std::string, std::string> bwd(const fmha::BwdArgs& args, uintptr_t stream,
                                              std::optional<std::string> instance) {
  std::string chosen;
  fmha::Status st;
  {
    py::gil_scoped_release release;
    const auto s = reinterpret_cast<fmha::Stream>(stream);
    if (instance) {
      st = fmha::bwd_instance(*instance, args, s);
      if (st.ok()) chosen = *instance;
    } else {
      st = fmha::bwd(args, s, &chosen);
    }
  }
  return {code(st), st.message, chosen};
}

// (status code, message, bytes): the workspace bwd() needs for args on the current device, with
// the dispatcher's backward instance or the one named.
// A miss compiles on demand (minutes at worst) with the GIL released; `stream` is the one the
// call will run on, which must not be capturing for that.
std::tuple<int, std::string, size_t> bwd_workspace_size(const fmha::BwdArgs& args,
                                                        std::optional<std::string> instance,
                                                        uintptr_t stream) {
  size_t bytes = 0;
  fmha::Status st;
  {
    py::gil_scoped_release release;
    st = instance ? fmha::bwd_workspace_size(*instance, args, &bytes)
                  : fmha::bwd_workspace_size(args, &bytes, reinterpret_cast<fmha::Stream>(stream));
  }
  return {code(st), st.message, bytes};
}

// A planned backward call (fmha/_plans.py's BwdPlan), as run_planned is for the forward: `plan`
// holds a checked call's shapes, strides and options; this call brings its pointers (the
// forward's operands, its out and log-sum-exp, dO, the gradients, the workspace), the dropout
// seed and offset, and in group mode the lengths, token counts and the log-sum-exp's head
// stride (negative: the plan's). Runs on the current device; returns None, or (status code,
// message) when nothing was launched. One crossing into C++ per call.
py::object run_bwd_planned(const fmha::BwdArgs& plan, uintptr_t dout, uintptr_t q, uintptr_t k,
                           uintptr_t v, uintptr_t o, uintptr_t lse, uintptr_t bias,
                           uintptr_t alibi_slopes, uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k,
                           uintptr_t seqused_q, uintptr_t seqused_k, uint64_t dropout_seed,
                           uint32_t dropout_offset, uintptr_t dq, uintptr_t dk, uintptr_t dv,
                           uintptr_t dbias, uintptr_t workspace, size_t workspace_bytes,
                           int seqlen_q, int seqlen_k, int64_t total_q, int64_t total_k,
                           int64_t lse_head_stride, uintptr_t stream,
                           std::optional<std::string> instance) {
  fmha::BwdArgs args = plan;
  fmha::FwdArgs& f = args.fwd;
  f.q = reinterpret_cast<const void*>(q);
  f.k = reinterpret_cast<const void*>(k);
  f.v = reinterpret_cast<const void*>(v);
  f.o = reinterpret_cast<void*>(o);
  f.lse = reinterpret_cast<float*>(lse);
  f.bias_ptr = reinterpret_cast<const void*>(bias);
  f.alibi_slopes = reinterpret_cast<const float*>(alibi_slopes);
  f.cu_seqlens_q = reinterpret_cast<const int32_t*>(cu_seqlens_q);
  f.cu_seqlens_k = reinterpret_cast<const int32_t*>(cu_seqlens_k);
  f.seqused_q = reinterpret_cast<const int32_t*>(seqused_q);
  f.seqused_k = reinterpret_cast<const int32_t*>(seqused_k);
  f.dropout_seed = dropout_seed;
  f.dropout_offset = dropout_offset;
  set_sizes(f, seqlen_q, seqlen_k, total_q, total_k);
  if (lse_head_stride >= 0) f.lse_head_stride = lse_head_stride;
  args.dout = reinterpret_cast<const void*>(dout);
  args.dq = reinterpret_cast<void*>(dq);
  args.dk = reinterpret_cast<void*>(dk);
  args.dv = reinterpret_cast<void*>(dv);
  args.dbias = reinterpret_cast<void*>(dbias);
  args.workspace = reinterpret_cast<void*>(workspace);
  args.workspace_bytes = workspace_bytes;
  fmha::Status st;
  {
    py::gil_scoped_release release;  // a launch blocks while the GPU's queue is full
    const auto s = reinterpret_cast<fmha::Stream>(stream);
    st = instance ? fmha::bwd_instance(*instance, args, s) : fmha::bwd(args, s);
  }
  if (st.ok()) return py::none();
  return py::make_tuple(code(st), st.message);
}

// bwd_workspace_size() of a plan with a group-mode call's sizes (negative: the plan's), the
// one value a varlen call must ask for before it allocates: (status code, message, bytes).
std::tuple<int, std::string, size_t> planned_workspace_size(const fmha::BwdArgs& plan,
                                                            int seqlen_q, int seqlen_k,
                                                            int64_t total_q, int64_t total_k,
                                                            std::optional<std::string> instance,
                                                            uintptr_t stream) {
  fmha::BwdArgs args = plan;
  set_sizes(args.fwd, seqlen_q, seqlen_k, total_q, total_k);
  return bwd_workspace_size(args, std::move(instance), stream);
}

// KV-cache attention's fwd(): (status code, message, instance name).
std::tuple<int, std::string, std::string> fwd_kvcache(const fmha::KvcacheArgs& args,
                                                      uintptr_t stream,
                                                      std::optional<std::string> instance) {
  std::string chosen;
  fmha::Status st;
  {
    py::gil_scoped_release release;
    const auto s = reinterpret_cast<fmha::Stream>(stream);
    if (instance) {
      st = fmha::fwd_kvcache_instance(*instance, args, s);
      if (st.ok()) chosen = *instance;
    } else {
      st = fmha::fwd_kvcache(args, s, &chosen);
    }
  }
  return {code(st), st.message, chosen};
}

// (status code, message, bytes): the workspace fwd_kvcache() needs for args on the current
// device (pointers are not read, but a non-null one says the call has that operand), with the
// dispatcher's KV-cache instance or the one named; a miss compiles as bwd_workspace_size's.
std::tuple<int, std::string, size_t> kvcache_workspace_size(const fmha::KvcacheArgs& args,
                                                            std::optional<std::string> instance,
                                                            uintptr_t stream) {
  size_t bytes = 0;
  fmha::Status st;
  {
    py::gil_scoped_release release;
    st = instance ? fmha::kvcache_workspace_size(*instance, args, &bytes)
                  : fmha::kvcache_workspace_size(args, &bytes,
                                                 reinterpret_cast<fmha::Stream>(stream));
  }
  return {code(st), st.message, bytes};
}

// A planned KV-cache call (fmha/_kvcache.py), as run_planned is for the forward: `plan` holds a
// checked call's shapes, strides, options and workspace size; this call brings its pointers (0
// for none: an e4m3 cache's k_scale and v_scale too, device tensors like the others) and
// stream, and the instance when one is named. A decode step's GPU work takes
// microseconds, so its host cost is one crossing into C++. Runs on the current device; returns
// None, or (status code, message) when nothing was launched.
py::object run_kvcache_planned(const fmha::KvcacheArgs& plan, uintptr_t q, uintptr_t k_cache,
                               uintptr_t v_cache, uintptr_t k_new, uintptr_t v_new, uintptr_t o,
                               uintptr_t lse, uintptr_t cache_seqlens, uintptr_t cache_batch_idx,
                               uintptr_t cache_leftpad, uintptr_t block_table,
                               uintptr_t rotary_cos, uintptr_t rotary_sin,
                               uintptr_t alibi_slopes, uintptr_t k_scale, uintptr_t v_scale,
                               uintptr_t workspace, uintptr_t stream,
                               std::optional<std::string> instance) {
  fmha::KvcacheArgs args = plan;
  args.q = reinterpret_cast<const void*>(q);
  args.k_cache = reinterpret_cast<void*>(k_cache);
  args.v_cache = reinterpret_cast<void*>(v_cache);
  args.k_new = reinterpret_cast<const void*>(k_new);
  args.v_new = reinterpret_cast<const void*>(v_new);
  args.o = reinterpret_cast<void*>(o);
  args.lse = reinterpret_cast<float*>(lse);
  args.cache_seqlens = reinterpret_cast<const int32_t*>(cache_seqlens);
  args.cache_batch_idx = reinterpret_cast<const int32_t*>(cache_batch_idx);
  args.cache_leftpad = reinterpret_cast<const int32_t*>(cache_leftpad);
  args.block_table = reinterpret_cast<const int32_t*>(block_table);
  args.rotary_cos = reinterpret_cast<const void*>(rotary_cos);
  args.rotary_sin = reinterpret_cast<const void*>(rotary_sin);
  args.alibi_slopes = reinterpret_cast<const float*>(alibi_slopes);
  args.k_scale = reinterpret_cast<const float*>(k_scale);
  args.v_scale = reinterpret_cast<const float*>(v_scale);
  args.workspace = reinterpret_cast<void*>(workspace);
  fmha::Status st;
  {
    py::gil_scoped_release release;  // a launch blocks while the GPU's queue is full
    const auto s = reinterpret_cast<fmha::Stream>(stream);
    st = instance ? fmha::fwd_kvcache_instance(*instance, args, s) : fmha::fwd_kvcache(args, s);
  }
  if (st.ok()) return py::none();
  return py::make_tuple(code(st), st.message);
}

void bind_kvcache_args(py::module_& m) {
  KvcacheArgsClass cls(
      m, "KvcacheArgs",
      "fmha::KvcacheArgs: one KV-cache attention call. Pointers are integers (data_ptr(), 0 for "
      "none), enums are ints (the module's DTYPE_*, KV_DTYPE_*, MASK_*, BIAS_* constants), "
      "strides are in elements (of an e4m3 cache: bytes).");
  cls.def(py::init<>());
  enum_property(cls, "dtype", &fmha::KvcacheArgs::dtype);
  enum_property(cls, "kv_dtype", &fmha::KvcacheArgs::kv_dtype);
  pointer_property(cls, "k_scale", &fmha::KvcacheArgs::k_scale);
  pointer_property(cls, "v_scale", &fmha::KvcacheArgs::v_scale);
  cls.def_readwrite("k_scale_batch_stride", &fmha::KvcacheArgs::k_scale_batch_stride)
      .def_readwrite("k_scale_head_stride", &fmha::KvcacheArgs::k_scale_head_stride)
      .def_readwrite("v_scale_batch_stride", &fmha::KvcacheArgs::v_scale_batch_stride)
      .def_readwrite("v_scale_head_stride", &fmha::KvcacheArgs::v_scale_head_stride);
  pointer_property(cls, "q", &fmha::KvcacheArgs::q);
  pointer_property(cls, "k_cache", &fmha::KvcacheArgs::k_cache);
  pointer_property(cls, "v_cache", &fmha::KvcacheArgs::v_cache);
  pointer_property(cls, "k_new", &fmha::KvcacheArgs::k_new);
  pointer_property(cls, "v_new", &fmha::KvcacheArgs::v_new);
  pointer_property(cls, "o", &fmha::KvcacheArgs::o);
  pointer_property(cls, "lse", &fmha::KvcacheArgs::lse);
  cls.def_readwrite("batch", &fmha::KvcacheArgs::batch)
      .def_readwrite("seqlen_q", &fmha::KvcacheArgs::seqlen_q)
      .def_readwrite("seqlen_new", &fmha::KvcacheArgs::seqlen_new)
      .def_readwrite("seqlen_cache", &fmha::KvcacheArgs::seqlen_cache)
      .def_readwrite("batch_cache", &fmha::KvcacheArgs::batch_cache)
      .def_readwrite("nhead_q", &fmha::KvcacheArgs::nhead_q)
      .def_readwrite("nhead_k", &fmha::KvcacheArgs::nhead_k)
      .def_readwrite("hdim_q", &fmha::KvcacheArgs::hdim_q)
      .def_readwrite("hdim_v", &fmha::KvcacheArgs::hdim_v)
      .def_readwrite("q_batch_stride", &fmha::KvcacheArgs::q_batch_stride)
      .def_readwrite("q_seq_stride", &fmha::KvcacheArgs::q_seq_stride)
      .def_readwrite("q_head_stride", &fmha::KvcacheArgs::q_head_stride)
      .def_readwrite("k_cache_batch_stride", &fmha::KvcacheArgs::k_cache_batch_stride)
      .def_readwrite("k_cache_seq_stride", &fmha::KvcacheArgs::k_cache_seq_stride)
      .def_readwrite("k_cache_head_stride", &fmha::KvcacheArgs::k_cache_head_stride)
      .def_readwrite("v_cache_batch_stride", &fmha::KvcacheArgs::v_cache_batch_stride)
      .def_readwrite("v_cache_seq_stride", &fmha::KvcacheArgs::v_cache_seq_stride)
      .def_readwrite("v_cache_head_stride", &fmha::KvcacheArgs::v_cache_head_stride)
      .def_readwrite("k_new_batch_stride", &fmha::KvcacheArgs::k_new_batch_stride)
      .def_readwrite("k_new_seq_stride", &fmha::KvcacheArgs::k_new_seq_stride)
      .def_readwrite("k_new_head_stride", &fmha::KvcacheArgs::k_new_head_stride)
      .def_readwrite("v_new_batch_stride", &fmha::KvcacheArgs::v_new_batch_stride)
      .def_readwrite("v_new_seq_stride", &fmha::KvcacheArgs::v_new_seq_stride)
      .def_readwrite("v_new_head_stride", &fmha::KvcacheArgs::v_new_head_stride)
      .def_readwrite("o_batch_stride", &fmha::KvcacheArgs::o_batch_stride)
      .def_readwrite("o_seq_stride", &fmha::KvcacheArgs::o_seq_stride)
      .def_readwrite("o_head_stride", &fmha::KvcacheArgs::o_head_stride)
      .def_readwrite("lse_batch_stride", &fmha::KvcacheArgs::lse_batch_stride)
      .def_readwrite("lse_head_stride", &fmha::KvcacheArgs::lse_head_stride);
  pointer_property(cls, "cache_seqlens", &fmha::KvcacheArgs::cache_seqlens);
  pointer_property(cls, "cache_batch_idx", &fmha::KvcacheArgs::cache_batch_idx);
  pointer_property(cls, "cache_leftpad", &fmha::KvcacheArgs::cache_leftpad);
  pointer_property(cls, "block_table", &fmha::KvcacheArgs::block_table);
  cls.def_readwrite("block_table_batch_stride", &fmha::KvcacheArgs::block_table_batch_stride)
      .def_readwrite("page_size", &fmha::KvcacheArgs::page_size);
  pointer_property(cls, "rotary_cos", &fmha::KvcacheArgs::rotary_cos);
  pointer_property(cls, "rotary_sin", &fmha::KvcacheArgs::rotary_sin);
  cls.def_readwrite("rotary_dim", &fmha::KvcacheArgs::rotary_dim)
      .def_readwrite("seqlen_rotary", &fmha::KvcacheArgs::seqlen_rotary)
      .def_readwrite("rotary_interleaved", &fmha::KvcacheArgs::rotary_interleaved)
      .def_readwrite("softmax_scale", &fmha::KvcacheArgs::softmax_scale);
  enum_property(cls, "mask", &fmha::KvcacheArgs::mask);
  cls.def_readwrite("window_left", &fmha::KvcacheArgs::window_left)
      .def_readwrite("window_right", &fmha::KvcacheArgs::window_right);
  enum_property(cls, "bias", &fmha::KvcacheArgs::bias);
  pointer_property(cls, "alibi_slopes", &fmha::KvcacheArgs::alibi_slopes);
  cls.def_readwrite("alibi_batch_stride", &fmha::KvcacheArgs::alibi_batch_stride)
      .def_readwrite("softcap", &fmha::KvcacheArgs::softcap)
      .def_readwrite("num_splits", &fmha::KvcacheArgs::num_splits);
  pointer_property(cls, "workspace", &fmha::KvcacheArgs::workspace);
  cls.def_readwrite("workspace_bytes", &fmha::KvcacheArgs::workspace_bytes);
  cls.def(
      "traits", [](const fmha::KvcacheArgs& a) { return kvcache_traits_dict(a.traits()); },
      "KvcacheArgs::traits(): what a KV-cache instance must match, enums as ints.");
  cls.def("run", &run_kvcache_planned, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
          py::arg("k_new"), py::arg("v_new"), py::arg("o"), py::arg("lse"),
          py::arg("cache_seqlens"), py::arg("cache_batch_idx"), py::arg("cache_leftpad"),
          py::arg("block_table"),
          py::arg("rotary_cos"), py::arg("rotary_sin"), py::arg("alibi_slopes"),
          py::arg("k_scale"), py::arg("v_scale"), py::arg("workspace"), py::arg("stream"),
          py::arg("instance") = py::none(),
          "Run these args with the pointers given (0 for none; the workspace of these args' "
          "workspace_bytes) on the stream, through the dispatcher or the named KV-cache "
          "instance; returns None, or (status code, message) when nothing was launched.");
}

void bind_bwd_args(py::module_& m) {
  BwdArgsClass cls(
      m, "BwdArgs",
      "fmha::BwdArgs: one backward problem. `fwd` is the forward call it differentiates (an "
      "FwdArgs, edited in place: a.fwd.q = ptr), with its o and lse; pointers are integers, "
      "strides are in elements.");
  cls.def(py::init<>());
  // def_readwrite of a class member returns a reference into this BwdArgs (pybind11's
  // reference_internal), so a.fwd.q = ptr sets this BwdArgs' field; assigning a.fwd copies.
  cls.def_readwrite("fwd", &fmha::BwdArgs::fwd);
  pointer_property(cls, "dout", &fmha::BwdArgs::dout);
  pointer_property(cls, "dq", &fmha::BwdArgs::dq);
  pointer_property(cls, "dk", &fmha::BwdArgs::dk);
  pointer_property(cls, "dv", &fmha::BwdArgs::dv);
  cls.def_readwrite("dout_batch_stride", &fmha::BwdArgs::dout_batch_stride)
      .def_readwrite("dout_seq_stride", &fmha::BwdArgs::dout_seq_stride)
      .def_readwrite("dout_head_stride", &fmha::BwdArgs::dout_head_stride)
      .def_readwrite("dq_batch_stride", &fmha::BwdArgs::dq_batch_stride)
      .def_readwrite("dq_seq_stride", &fmha::BwdArgs::dq_seq_stride)
      .def_readwrite("dq_head_stride", &fmha::BwdArgs::dq_head_stride)
      .def_readwrite("dk_batch_stride", &fmha::BwdArgs::dk_batch_stride)
      .def_readwrite("dk_seq_stride", &fmha::BwdArgs::dk_seq_stride)
      .def_readwrite("dk_head_stride", &fmha::BwdArgs::dk_head_stride)
      .def_readwrite("dv_batch_stride", &fmha::BwdArgs::dv_batch_stride)
      .def_readwrite("dv_seq_stride", &fmha::BwdArgs::dv_seq_stride)
      .def_readwrite("dv_head_stride", &fmha::BwdArgs::dv_head_stride);
  pointer_property(cls, "dbias", &fmha::BwdArgs::dbias);
  cls.def_readwrite("dbias_batch_stride", &fmha::BwdArgs::dbias_batch_stride)
      .def_readwrite("dbias_head_stride", &fmha::BwdArgs::dbias_head_stride)
      .def_readwrite("dbias_seq_stride", &fmha::BwdArgs::dbias_seq_stride)
      .def_readwrite("deterministic", &fmha::BwdArgs::deterministic);
  pointer_property(cls, "workspace", &fmha::BwdArgs::workspace);
  cls.def_readwrite("workspace_bytes", &fmha::BwdArgs::workspace_bytes);
  cls.def(
      "traits", [](const fmha::BwdArgs& a) { return bwd_traits_dict(a.traits()); },
      "BwdArgs::traits(): what a backward instance must match, enums as ints.");
  cls.def("run", &run_bwd_planned, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("o"), py::arg("lse"), py::arg("bias"), py::arg("alibi_slopes"),
          py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("seqused_q"),
          py::arg("seqused_k"), py::arg("dropout_seed"), py::arg("dropout_offset"),
          py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("dbias"), py::arg("workspace"),
          py::arg("workspace_bytes"), py::arg("seqlen_q"), py::arg("seqlen_k"),
          py::arg("total_q"), py::arg("total_k"), py::arg("lse_head_stride"), py::arg("stream"),
          py::arg("instance"),
          "Run these args with the pointers (0 for none), dropout seed and offset, workspace "
          "and sizes given (negative: these args') on the stream, through the dispatcher or "
          "the named backward instance; returns None, or (status code, message) when nothing "
          "was launched.");
  cls.def("workspace_size", &planned_workspace_size, py::arg("seqlen_q"), py::arg("seqlen_k"),
          py::arg("total_q"), py::arg("total_k"), py::arg("instance") = py::none(),
          py::arg("stream") = 0,
          "bwd_workspace_size of these args with the sizes given (negative: these args') on "
          "the current device, for the dispatcher's backward instance or the one named (a miss "
          "compiles on demand unless the stream captures); returns (code, message, bytes).");
}

void bind_args(py::module_& m) {
  Args cls(m, "FwdArgs",
           "fmha::FwdArgs: one forward problem. Pointers are integers (data_ptr(), 0 for none), "
           "enums are ints (the module's DTYPE_*, MODE_*, MASK_*, ALIGN_*, BIAS_*, VLAYOUT_* "
           "constants), strides are in elements; q_descale, k_descale and v_descale (DTYPE_E4M3 "
           "only) are fp32 device pointers with (batch, K/V head) strides.");
  cls.def(py::init<>());
  enum_property(cls, "dtype", &fmha::FwdArgs::dtype);
  enum_property(cls, "mode", &fmha::FwdArgs::mode);
  pointer_property(cls, "q", &fmha::FwdArgs::q);
  pointer_property(cls, "k", &fmha::FwdArgs::k);
  pointer_property(cls, "v", &fmha::FwdArgs::v);
  pointer_property(cls, "o", &fmha::FwdArgs::o);
  // None (unset: the dtype's default O) or a DTYPE_* int; the C++ checks say which are valid.
  cls.def_property(
      "o_dtype",
      [](const fmha::FwdArgs& a) -> std::optional<int> {
        if (!a.o_dtype) return std::nullopt;
        return static_cast<int>(*a.o_dtype);
      },
      [](fmha::FwdArgs& a, std::optional<int> value) {
        a.o_dtype.reset();
        if (value) a.o_dtype = static_cast<fmha::DataType>(*value);
      });
  cls.def_readwrite("batch", &fmha::FwdArgs::batch)
      .def_readwrite("seqlen_q", &fmha::FwdArgs::seqlen_q)
      .def_readwrite("seqlen_k", &fmha::FwdArgs::seqlen_k)
      .def_readwrite("nhead_q", &fmha::FwdArgs::nhead_q)
      .def_readwrite("nhead_k", &fmha::FwdArgs::nhead_k)
      .def_readwrite("hdim_q", &fmha::FwdArgs::hdim_q)
      .def_readwrite("hdim_v", &fmha::FwdArgs::hdim_v)
      .def_readwrite("q_batch_stride", &fmha::FwdArgs::q_batch_stride)
      .def_readwrite("q_seq_stride", &fmha::FwdArgs::q_seq_stride)
      .def_readwrite("q_head_stride", &fmha::FwdArgs::q_head_stride)
      .def_readwrite("k_batch_stride", &fmha::FwdArgs::k_batch_stride)
      .def_readwrite("k_seq_stride", &fmha::FwdArgs::k_seq_stride)
      .def_readwrite("k_head_stride", &fmha::FwdArgs::k_head_stride)
      .def_readwrite("v_batch_stride", &fmha::FwdArgs::v_batch_stride)
      .def_readwrite("v_seq_stride", &fmha::FwdArgs::v_seq_stride)
      .def_readwrite("v_head_stride", &fmha::FwdArgs::v_head_stride)
      .def_readwrite("o_batch_stride", &fmha::FwdArgs::o_batch_stride)
      .def_readwrite("o_seq_stride", &fmha::FwdArgs::o_seq_stride)
      .def_readwrite("o_head_stride", &fmha::FwdArgs::o_head_stride)
      .def_readwrite("v_dim_stride", &fmha::FwdArgs::v_dim_stride);
  enum_property(cls, "vlayout", &fmha::FwdArgs::vlayout);
  pointer_property(cls, "cu_seqlens_q", &fmha::FwdArgs::cu_seqlens_q);
  pointer_property(cls, "cu_seqlens_k", &fmha::FwdArgs::cu_seqlens_k);
  cls.def_readwrite("total_q", &fmha::FwdArgs::total_q)
      .def_readwrite("total_k", &fmha::FwdArgs::total_k);
  pointer_property(cls, "seqused_q", &fmha::FwdArgs::seqused_q);
  pointer_property(cls, "seqused_k", &fmha::FwdArgs::seqused_k);
  cls.def_readwrite("softmax_scale", &fmha::FwdArgs::softmax_scale);
  enum_property(cls, "mask", &fmha::FwdArgs::mask);
  enum_property(cls, "mask_align", &fmha::FwdArgs::mask_align);
  cls.def_readwrite("window_left", &fmha::FwdArgs::window_left)
      .def_readwrite("window_right", &fmha::FwdArgs::window_right);
  enum_property(cls, "bias", &fmha::FwdArgs::bias);
  pointer_property(cls, "bias_ptr", &fmha::FwdArgs::bias_ptr);
  cls.def_readwrite("bias_batch_stride", &fmha::FwdArgs::bias_batch_stride)
      .def_readwrite("bias_head_stride", &fmha::FwdArgs::bias_head_stride)
      .def_readwrite("bias_seq_stride", &fmha::FwdArgs::bias_seq_stride);
  pointer_property(cls, "alibi_slopes", &fmha::FwdArgs::alibi_slopes);
  cls.def_readwrite("alibi_batch_stride", &fmha::FwdArgs::alibi_batch_stride)
      .def_readwrite("softcap", &fmha::FwdArgs::softcap)
      .def_readwrite("dropout_p", &fmha::FwdArgs::dropout_p)
      .def_readwrite("dropout_seed", &fmha::FwdArgs::dropout_seed)
      .def_readwrite("dropout_offset", &fmha::FwdArgs::dropout_offset);
  pointer_property(cls, "lse", &fmha::FwdArgs::lse);
  cls.def_readwrite("lse_batch_stride", &fmha::FwdArgs::lse_batch_stride)
      .def_readwrite("lse_head_stride", &fmha::FwdArgs::lse_head_stride);
  pointer_property(cls, "q_descale", &fmha::FwdArgs::q_descale);
  pointer_property(cls, "k_descale", &fmha::FwdArgs::k_descale);
  pointer_property(cls, "v_descale", &fmha::FwdArgs::v_descale);
  cls.def_readwrite("q_descale_batch_stride", &fmha::FwdArgs::q_descale_batch_stride)
      .def_readwrite("q_descale_head_stride", &fmha::FwdArgs::q_descale_head_stride)
      .def_readwrite("k_descale_batch_stride", &fmha::FwdArgs::k_descale_batch_stride)
      .def_readwrite("k_descale_head_stride", &fmha::FwdArgs::k_descale_head_stride)
      .def_readwrite("v_descale_batch_stride", &fmha::FwdArgs::v_descale_batch_stride)
      .def_readwrite("v_descale_head_stride", &fmha::FwdArgs::v_descale_head_stride);
  cls.def(
      "traits", [](const fmha::FwdArgs& a) { return traits_dict(a.traits()); },
      "FwdArgs::traits(): what an instance must match, enums as ints.");
  cls.def("run", &run_planned, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
          py::arg("lse"), py::arg("bias"), py::arg("alibi_slopes"), py::arg("cu_seqlens_q"),
          py::arg("cu_seqlens_k"), py::arg("seqused_q"), py::arg("seqused_k"),
          py::arg("q_descale"), py::arg("k_descale"), py::arg("v_descale"),
          py::arg("dropout_seed"), py::arg("dropout_offset"), py::arg("seqlen_q"),
          py::arg("seqlen_k"), py::arg("total_q"), py::arg("total_k"),
          py::arg("lse_head_stride"), py::arg("stream"), py::arg("instance"),
          "Run these args with the pointers (0 for none), dropout seed and offset given, and "
          "the sizes given (negative: these args') on the stream, through the dispatcher or "
          "the named instance; returns None, or (status code, message) when nothing was "
          "launched.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "libfmha bindings: an FwdArgs (or BwdArgs, KvcacheArgs) of pointers, shapes and strides "
      "in; see the fmha package";

  m.attr("STATUS_OK") = static_cast<int>(fmha::Status::Code::kOk);
  m.attr("STATUS_INVALID_ARGUMENT") = static_cast<int>(fmha::Status::Code::kInvalidArgument);
  m.attr("STATUS_NO_INSTANCE") = static_cast<int>(fmha::Status::Code::kNoInstance);
  m.attr("STATUS_CUDA_ERROR") = static_cast<int>(fmha::Status::Code::kCudaError);
  m.attr("DTYPE_FP16") = static_cast<int>(fmha::DataType::kFP16);
  m.attr("DTYPE_BF16") = static_cast<int>(fmha::DataType::kBF16);
  m.attr("DTYPE_E4M3") = static_cast<int>(fmha::DataType::kE4M3);
  m.attr("KV_DTYPE_SAME") = static_cast<int>(fmha::KvCacheDtype::kSame);
  m.attr("KV_DTYPE_E4M3") = static_cast<int>(fmha::KvCacheDtype::kE4M3);
  m.attr("MODE_BATCH") = static_cast<int>(fmha::Mode::kBatch);
  m.attr("MODE_GROUP") = static_cast<int>(fmha::Mode::kGroup);
  m.attr("MASK_NONE") = static_cast<int>(fmha::MaskType::kNone);
  m.attr("MASK_CAUSAL") = static_cast<int>(fmha::MaskType::kCausal);
  m.attr("MASK_WINDOW") = static_cast<int>(fmha::MaskType::kWindow);
  m.attr("ALIGN_TOP_LEFT") = static_cast<int>(fmha::MaskAlign::kTopLeft);
  m.attr("ALIGN_BOTTOM_RIGHT") = static_cast<int>(fmha::MaskAlign::kBottomRight);
  m.attr("BIAS_NONE") = static_cast<int>(fmha::BiasType::kNone);
  m.attr("BIAS_ELEMENTWISE") = static_cast<int>(fmha::BiasType::kElementwise);
  m.attr("BIAS_ALIBI") = static_cast<int>(fmha::BiasType::kAlibi);
  m.attr("VLAYOUT_ROW_MAJOR") = static_cast<int>(fmha::VLayout::kRowMajor);
  m.attr("VLAYOUT_COL_MAJOR") = static_cast<int>(fmha::VLayout::kColMajor);

  bind_args(m);
  m.def("fwd", &fwd, py::arg("args"), py::arg("stream"), py::arg("instance") = py::none(),
        "Run the forward pass on the stream (a cudaStream_t as an int), with the dispatcher's "
        "instance or the one named; returns (status code, message, instance name).");
  m.def("select", [](const fmha::FwdArgs& args, int cc) {
    return select_args<fmha::InstanceInfo>(args, cc, &info_dict);
  }, py::arg("args"), py::arg("cc") = 0,
        "The instance fwd would run on the current device (cc 0) or on a GPU of compute "
        "capability cc (major * 10 + minor, no GPU needed); returns (code, message, info dict "
        "or None).");
  m.def("explain", &explain_args<fmha::FwdArgs>, py::arg("args"), py::arg("cc") = 0,
        "Why select chooses what it chooses, or what would build an instance on a miss, for "
        "the current device (cc 0) or compute capability cc; returns (code, message, text).");
  m.def("dropout_mask", &dropout_mask, py::arg("seed"), py::arg("offset"), py::arg("dropout_p"),
        py::arg("batch"), py::arg("nhead"), py::arg("seqlen_q"), py::arg("seqlen_k"),
        py::arg("keep"), py::arg("stream"),
        "Write fwd's dropout keep pattern (uint8, contiguous (batch, nhead, seqlen_q, "
        "seqlen_k)) to the device pointer `keep`; returns (code, message).");
  m.def("instances", [] {
    py::list out;
    for (const auto& i : fmha::instances()) out.append(info_dict(i));
    return out;
  }, "Every compiled instance, in the dispatcher's order of preference.");
  m.def("compiled_targets", &fmha::compiled_targets, "GPU targets this library holds code for.");
  m.def("load_instances", [](const std::string& path) {
    int added = 0;
    const fmha::Status st = fmha::load_instances(path, &added);
    return py::make_tuple(static_cast<int>(st.code), st.message, added);
  }, py::arg("path"),
        "Load a shared object of instances compiled on demand into the dispatcher; returns "
        "(status code, message, instances added).");

  bind_bwd_args(m);
  m.def("bwd", &bwd, py::arg("args"), py::arg("stream"), py::arg("instance") = py::none(),
        "Run the backward pass on the stream (a cudaStream_t as an int), with the dispatcher's "
        "backward instance or the one named; returns (status code, message, instance name).");
  m.def("bwd_workspace_size", &bwd_workspace_size, py::arg("args"),
        py::arg("instance") = py::none(), py::arg("stream") = 0,
        "The workspace bwd needs for args on the current device (pointers are not read), with "
        "the dispatcher's backward instance or the one named (a miss compiles on demand unless "
        "the stream captures); returns (code, message, bytes).");
  m.def("select_bwd", [](const fmha::BwdArgs& args, int cc) {
    return select_args<fmha::BwdInstanceInfo>(args, cc, &bwd_info_dict);
  }, py::arg("args"), py::arg("cc") = 0,
        "The backward instance bwd would run on the current device (cc 0) or compute "
        "capability cc; returns (code, message, info dict or None).");
  m.def("explain_bwd", &explain_args<fmha::BwdArgs>, py::arg("args"), py::arg("cc") = 0,
        "Why select_bwd chooses what it chooses, or what would build an instance on a miss; "
        "returns (code, message, text).");
  m.def("bwd_instances", [] {
    py::list out;
    for (const auto& i : fmha::bwd_instances()) out.append(bwd_info_dict(i));
    return out;
  }, "Every compiled backward instance, in the dispatcher's order of preference.");

  bind_kvcache_args(m);
  m.def("fwd_kvcache", &fwd_kvcache, py::arg("args"), py::arg("stream"),
        py::arg("instance") = py::none(),
        "Run KV-cache attention on the stream (a cudaStream_t as an int), with the "
        "dispatcher's KV-cache instance or the one named; returns (status code, message, "
        "instance name).");
  m.def("kvcache_workspace_size", &kvcache_workspace_size, py::arg("args"),
        py::arg("instance") = py::none(), py::arg("stream") = 0,
        "The workspace fwd_kvcache needs for args on the current device, with the dispatcher's "
        "KV-cache instance or the one named (pointers are not read; a non-zero one says the "
        "call has that operand; a miss compiles on demand unless the stream captures); "
        "returns (code, message, bytes).");
  m.def("select_kvcache", [](const fmha::KvcacheArgs& args, int cc) {
    return select_args<fmha::KvcacheInstanceInfo>(args, cc, &kvcache_info_dict);
  }, py::arg("args"), py::arg("cc") = 0,
        "The KV-cache instance fwd_kvcache would run on the current device (cc 0) or compute "
        "capability cc; returns (code, message, info dict or None).");
  m.def("explain_kvcache", &explain_args<fmha::KvcacheArgs>, py::arg("args"),
        py::arg("cc") = 0,
        "Why select_kvcache chooses what it chooses, or what would build an instance on a miss; "
        "returns (code, message, text).");
  m.def("kvcache_instances", [] {
    py::list out;
    for (const auto& i : fmha::kvcache_instances()) out.append(kvcache_info_dict(i));
    return out;
  }, "Every compiled KV-cache instance, in the dispatcher's order of preference.");

  // Compile on demand (fmha.jit): what to build for a miss.
  auto recipe = [](const fmha::InstanceRecipe& r) { return py::make_tuple(r.filter, r.target); };
  m.def("instance_recipe", [recipe](const fmha::FwdArgs& a, int cc) {
    return recipe(fmha::instance_recipe(a, cc));
  }, py::arg("args"), py::arg("cc"));
  m.def("instance_recipe", [recipe](const fmha::BwdArgs& a, int cc) {
    return recipe(fmha::instance_recipe(a, cc));
  }, py::arg("args"), py::arg("cc"));
  m.def("instance_recipe", [recipe](const fmha::KvcacheArgs& a, int cc) {
    return recipe(fmha::instance_recipe(a, cc));
  }, py::arg("args"), py::arg("cc"),
        "(generator --filter, target token) that build instances able to run the problem on a "
        "device of compute capability cc (target '' when none runs there).");
}
