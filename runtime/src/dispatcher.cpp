#include "dispatcher.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

namespace fmha::detail {
namespace {

bool same_traits(const FwdTraits& a, const FwdTraits& b) {
  return a.dtype == b.dtype && a.hdim_q == b.hdim_q && a.hdim_v == b.hdim_v && a.mask == b.mask &&
         a.bias == b.bias && a.vlayout == b.vlayout && a.mode == b.mode;
}

// How many functional traits two problems share: ranks the "nearest" instances of a miss.
int shared_traits(const FwdTraits& a, const FwdTraits& b) {
  return (a.dtype == b.dtype) + (a.hdim_q == b.hdim_q) + (a.hdim_v == b.hdim_v) +
         (a.mask == b.mask) + (a.bias == b.bias) + (a.vlayout == b.vlayout) + (a.mode == b.mode);
}

bool runs_on(const InstanceEntry& e, int cc) {
  return e.arch_exact ? cc == e.arch_cc : cc >= e.arch_cc;
}

bool fits_tiles(const InstanceEntry& e, const FwdArgs& args) {
  return e.pad_seqlen || (args.seqlen_q % e.block_m == 0 && args.seqlen_k % e.block_n == 0);
}

bool runs_on(const TargetInfo& t, int cc) { return t.exact ? cc == t.cc : cc >= t.cc; }

// The generator target that builds the best code for a device (the first known one it runs).
const char* target_for(int cc) {
  for (int i = 0; i < kNumKnownTargets; ++i) {
    if (runs_on(kKnownTargets[i], cc)) return kKnownTargets[i].token;
  }
  return "(none: this GPU is older than every target)";
}

std::string describe(const FwdTraits& t) {
  std::ostringstream s;
  s << "dtype=" << kDataTypeTokens[int(t.dtype)] << " hdim_q=" << t.hdim_q
    << " hdim_v=" << t.hdim_v << " mask=" << kMaskTokens[int(t.mask)]
    << " bias=" << kBiasTokens[int(t.bias)] << " vlayout=" << kVLayoutTokens[int(t.vlayout)]
    << " mode=" << kModeTokens[int(t.mode)];
  return s.str();
}

// The generator filter that selects exactly the instances able to run `t` on `cc`.
std::string filter_for(const FwdTraits& t, int cc) {
  std::ostringstream s;
  s << kDataTypeTokens[int(t.dtype)] << ",hdim_q=" << t.hdim_q << ",hdim_v=" << t.hdim_v
    << ",mask=" << kMaskTokens[int(t.mask)] << ",bias=" << kBiasTokens[int(t.bias)]
    << ",vlayout=" << kVLayoutTokens[int(t.vlayout)] << ",mode=" << kModeTokens[int(t.mode)]
    << "," << target_for(cc);
  return s.str();
}

Status miss(const FwdArgs& args, int cc, const char* why) {
  const FwdTraits wanted = args.traits();
  std::vector<const InstanceEntry*> nearest;
  for (int i = 0; i < kNumInstances; ++i) nearest.push_back(&kInstances[i]);
  std::stable_sort(nearest.begin(), nearest.end(), [&](auto* a, auto* b) {
    return shared_traits(a->traits, wanted) > shared_traits(b->traits, wanted);
  });
  nearest.resize(std::min<size_t>(nearest.size(), 3));

  std::ostringstream s;
  s << "no compiled fmha instance runs " << describe(wanted) << " on this GPU (sm" << cc << "): "
    << why << ". Nearest compiled:";
  for (const auto* e : nearest) s << " " << e->name;
  s << ". Build one with FMHA_FILTER='" << filter_for(wanted, cc) << "' and FMHA_ARCHS including "
    << target_for(cc) << " (python -m generator --filter '" << filter_for(wanted, cc) << "').";
  return {Status::Code::kNoInstance, s.str()};
}

}  // namespace

Status current_device_cc(int* cc) {
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) {
    return {Status::Code::kCudaError,
            std::string("cannot query the current CUDA device: ") + cudaGetErrorString(err)};
  }
  *cc = major * 10 + minor;
  return Status::Ok();
}

Status select_instance(const FwdArgs& args, int cc, const InstanceEntry** chosen) {
  const FwdTraits wanted = args.traits();
  bool traits_compiled = false, arch_compiled = false;
  for (int i = 0; i < kNumInstances; ++i) {
    const InstanceEntry& e = kInstances[i];
    if (!same_traits(e.traits, wanted)) continue;
    traits_compiled = true;
    if (!runs_on(e, cc)) continue;
    arch_compiled = true;
    if (!fits_tiles(e, args)) continue;
    *chosen = &e;
    return Status::Ok();
  }
  if (!traits_compiled) return miss(args, cc, "no instance has these traits");
  if (!arch_compiled) return miss(args, cc, "instances with these traits exist only for other GPUs");
  return miss(args, cc,
              "only unpadded instances have these traits, and the sequence lengths are not "
              "multiples of their tiles");
}

Status find_instance(const std::string& name, const FwdArgs& args, int cc,
                     const InstanceEntry** chosen) {
  for (int i = 0; i < kNumInstances; ++i) {
    const InstanceEntry& e = kInstances[i];
    if (name != e.name) continue;
    std::string why;
    if (!same_traits(e.traits, args.traits())) {
      why = "it computes " + describe(e.traits) + ", the problem is " + describe(args.traits());
    } else if (!runs_on(e, cc)) {
      why = std::string("it is compiled for ") + e.arch + ", the device is sm" + std::to_string(cc);
    } else if (!fits_tiles(e, args)) {
      why = "it is unpadded and the sequence lengths are not multiples of its " +
            std::to_string(e.block_m) + "x" + std::to_string(e.block_n) + " tile";
    } else {
      *chosen = &e;
      return Status::Ok();
    }
    return {Status::Code::kInvalidArgument, "instance " + name + " cannot run this problem: " + why};
  }
  return {Status::Code::kNoInstance, "no compiled instance is called '" + name +
                                         "' (fmha::instances() lists them)"};
}

InstanceInfo to_info(const InstanceEntry& e) {
  InstanceInfo info;
  info.name = e.name;
  info.traits = e.traits;
  info.pipeline = e.pipeline;
  info.arch = e.arch;
  info.block_m = e.block_m;
  info.block_n = e.block_n;
  info.pad_seqlen = e.pad_seqlen;
  return info;
}

}  // namespace fmha::detail
