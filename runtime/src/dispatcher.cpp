#include "dispatcher.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace fmha::detail {
namespace {

// How far an entry gets towards running a problem: the conditions of the matching rule, which
// generator/dispatch.py mirrors (REQUIREMENTS) to order the table and prove every row reachable.
// They are checked in this order, and a miss is described by the furthest stage any entry
// reached.
enum class Stage : int { kTraits = 0, kHeadDims, kArch, kLengths, kRuns };

const char* token(bool b) { return b ? "true" : "false"; }
const char* token(DataType t) { return kDataTypeTokens[static_cast<int>(t)]; }
const char* token(MaskType t) { return kMaskTokens[static_cast<int>(t)]; }
const char* token(BiasType t) { return kBiasTokens[static_cast<int>(t)]; }
const char* token(VLayout t) { return kVLayoutTokens[static_cast<int>(t)]; }
const char* token(Mode t) { return kModeTokens[static_cast<int>(t)]; }

std::string extent(int rows, int cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}

std::string sm(int cc) { return "sm" + std::to_string(cc); }

bool multiple_of_8(int d) { return d > 0 && d % 8 == 0; }

int round_up(int value, int multiple) { return (value + multiple - 1) / multiple * multiple; }

// ---- the matching rule, one condition per stage ----------------------------------------------

// Functional traits: equal, except that an instance writing the log-sum-exp also serves a
// problem that does not ask for it (it skips the store).
bool traits_fit(const FwdTraits& e, const FwdTraits& w) {
  return e.dtype == w.dtype && e.mask == w.mask && e.bias == w.bias && e.vlayout == w.vlayout &&
         e.mode == w.mode && e.dropout == w.dropout && e.softcap == w.softcap && (e.lse || !w.lse);
}

// An unpadded entry runs exactly its head dims; a head-dim-padded one also runs smaller ones
// that are multiples of 8 (its loads and stores move rows in 16-byte pieces of 8 elements).
bool head_dims_fit(const InstanceEntry& e, const FwdTraits& w) {
  if (!e.pad_hdim) return e.traits.hdim_q == w.hdim_q && e.traits.hdim_v == w.hdim_v;
  return multiple_of_8(w.hdim_q) && multiple_of_8(w.hdim_v) && w.hdim_q <= e.traits.hdim_q &&
         w.hdim_v <= e.traits.hdim_v;
}

bool runs_on(const InstanceEntry& e, int cc) {
  return e.arch_exact ? cc == e.arch_cc : cc >= e.arch_cc;
}

// An unpadded entry skips every bounds check, so it needs lengths that are whole tiles and
// known on the host: batch mode without seqused_*.
bool lengths_fit(const InstanceEntry& e, const FwdArgs& a) {
  return e.pad_seqlen ||
         (a.mode == Mode::kBatch && a.seqused_q == nullptr && a.seqused_k == nullptr &&
          a.seqlen_q % e.block_m == 0 && a.seqlen_k % e.block_n == 0);
}

Stage fit(const InstanceEntry& e, const FwdArgs& a, const FwdTraits& w, int cc) {
  if (!traits_fit(e.traits, w)) return Stage::kTraits;
  if (!head_dims_fit(e, w)) return Stage::kHeadDims;
  if (!runs_on(e, cc)) return Stage::kArch;
  if (!lengths_fit(e, a)) return Stage::kLengths;
  return Stage::kRuns;
}

// ---- the same conditions in words, for an entry known to fail them ----------------------------

std::string traits_reason(const FwdTraits& e, const FwdTraits& w) {
  std::string has, wants;
  auto differ = [&](const char* axis, const char* entry_value, const char* problem_value) {
    const char* sep = has.empty() ? "" : " ";
    has += sep + std::string(axis) + "=" + entry_value;
    wants += sep + std::string(axis) + "=" + problem_value;
  };
  if (e.dtype != w.dtype) differ("dtype", token(e.dtype), token(w.dtype));
  if (e.mask != w.mask) differ("mask", token(e.mask), token(w.mask));
  if (e.bias != w.bias) differ("bias", token(e.bias), token(w.bias));
  if (e.vlayout != w.vlayout) differ("vlayout", token(e.vlayout), token(w.vlayout));
  if (e.mode != w.mode) differ("mode", token(e.mode), token(w.mode));
  if (w.lse && !e.lse) differ("lse", "false", "true");
  if (e.dropout != w.dropout) differ("dropout", token(e.dropout), token(w.dropout));
  if (e.softcap != w.softcap) differ("softcap", token(e.softcap), token(w.softcap));
  return "it has " + has + " where the problem has " + wants;
}

std::string head_dims_reason(const InstanceEntry& e, const FwdTraits& w) {
  const std::string own = extent(e.traits.hdim_q, e.traits.hdim_v);
  const std::string problem = ", the problem's are " + extent(w.hdim_q, w.hdim_v);
  if (!e.pad_hdim) return "it runs head dims " + own + " only (pad_hdim=false)" + problem;
  if (w.hdim_q > e.traits.hdim_q || w.hdim_v > e.traits.hdim_v) {
    return "it runs head dims up to " + own + " (pad_hdim=true)" + problem;
  }
  return "it runs head dims below " + own + " only when they are multiples of 8" + problem;
}

std::string arch_reason(const InstanceEntry& e, int cc) {
  if (e.arch_exact) {
    return std::string("it is compiled for ") + e.arch + ", which runs only on " + sm(e.arch_cc) +
           " GPUs; this one is " + sm(cc);
  }
  return std::string("it is compiled for ") + e.arch + ", newer than this " + sm(cc) + " GPU";
}

// Why the lengths need a padded (pad_seqlen=true) instance.
std::string lengths_reason(const InstanceEntry& e, const FwdArgs& a) {
  if (a.mode != Mode::kBatch) return "group mode's sequence lengths are known only on the device";
  if (a.seqused_q != nullptr || a.seqused_k != nullptr) {
    return "seqused_q/seqused_k set per-sequence lengths known only on the device";
  }
  if (a.seqlen_q % e.block_m != 0) {
    return "seqlen_q=" + std::to_string(a.seqlen_q) + " is not a multiple of its block_m=" +
           std::to_string(e.block_m);
  }
  return "seqlen_k=" + std::to_string(a.seqlen_k) + " is not a multiple of its block_n=" +
         std::to_string(e.block_n);
}

std::string reason(Stage stage, const InstanceEntry& e, const FwdArgs& a, const FwdTraits& w,
                   int cc) {
  switch (stage) {
    case Stage::kTraits: return traits_reason(e.traits, w);
    case Stage::kHeadDims: return head_dims_reason(e, w);
    case Stage::kArch: return arch_reason(e, cc);
    case Stage::kLengths: return "it is unpadded (pad_seqlen=false) and " + lengths_reason(e, a);
    case Stage::kRuns: break;
  }
  return "it runs the problem";
}

// ---- what to build on a miss -----------------------------------------------------------------

bool runs_on(const TargetInfo& t, int cc) { return t.exact ? cc == t.cc : cc >= t.cc; }

// The generator target that builds the best code for a device (the first known one it runs).
const TargetInfo* target_for(int cc) {
  for (int i = 0; i < kNumKnownTargets; ++i) {
    if (runs_on(kKnownTargets[i], cc)) return &kKnownTargets[i];
  }
  return nullptr;
}

std::string describe(const FwdTraits& t) {
  std::ostringstream s;
  s << "dtype=" << token(t.dtype) << " hdim_q=" << t.hdim_q << " hdim_v=" << t.hdim_v
    << " mask=" << token(t.mask) << " bias=" << token(t.bias) << " vlayout=" << token(t.vlayout)
    << " mode=" << token(t.mode) << " lse=" << token(t.lse) << " dropout=" << token(t.dropout)
    << " softcap=" << token(t.softcap);
  return s.str();
}

struct Suggestion {
  std::string filter;  // the generator --filter that selects instances able to run the problem
  std::string note;    // what to check in instances.yaml first, if anything
};

// The head dims to build for `w`: its own when some compiled instance has them (so the matrix
// lists them); else, for multiples of 8, the smallest compiled head dims above them, run
// padded, or failing that the next multiples of 32, which fa2's tiles come in (fa2 is the
// pipeline that pads head dims; fa3 runs exact multiples of 64 only).
Suggestion suggest(const FwdArgs& a, int cc) {
  const FwdTraits w = a.traits();
  int hdim_q = w.hdim_q, hdim_v = w.hdim_v;
  bool exact_compiled = false, covered = false;
  for (int i = 0; i < kNumInstances; ++i) {
    const FwdTraits& t = kInstances[i].traits;
    if (t.hdim_q == w.hdim_q && t.hdim_v == w.hdim_v) exact_compiled = true;
    const bool covers = t.hdim_q >= w.hdim_q && t.hdim_v >= w.hdim_v;
    if (covers && (!covered || t.hdim_q + t.hdim_v < hdim_q + hdim_v)) {
      hdim_q = t.hdim_q;
      hdim_v = t.hdim_v;
      covered = true;
    }
  }
  Suggestion s;
  const bool paddable = multiple_of_8(w.hdim_q) && multiple_of_8(w.hdim_v);
  if (exact_compiled || !paddable) {
    hdim_q = w.hdim_q;
    hdim_v = w.hdim_v;
    if (!exact_compiled) {
      s.note = "head dims that are not multiples of 8 need an instance of exactly those head "
               "dims: instances.yaml's matrix.hdim must list [" + std::to_string(hdim_q) + ", " +
               std::to_string(hdim_v) + "], if its pipeline's tiles allow them";
    }
  } else if (!covered) {
    hdim_q = round_up(w.hdim_q, 32);
    hdim_v = round_up(w.hdim_v, 32);
    s.note = "no compiled instance has head dims of at least " + extent(w.hdim_q, w.hdim_v) +
             ", so instances.yaml's matrix.hdim may need [" + std::to_string(hdim_q) + ", " +
             std::to_string(hdim_v) + "]";
  }
  const bool pad_hdim = hdim_q != w.hdim_q || hdim_v != w.hdim_v;

  // `pad` only where no unpadded instance could serve: without it the filter selects both
  // variants, and the padded one covers every length.
  bool pad = a.mode != Mode::kBatch || a.seqused_q != nullptr || a.seqused_k != nullptr;
  if (!pad) {
    bool tile_known = false, tile_fits = false;
    for (int i = 0; i < kNumInstances; ++i) {
      const InstanceEntry& e = kInstances[i];
      if (e.traits.hdim_q != hdim_q || e.traits.hdim_v != hdim_v) continue;
      tile_known = true;
      tile_fits = tile_fits || (a.seqlen_q % e.block_m == 0 && a.seqlen_k % e.block_n == 0);
    }
    pad = tile_known && !tile_fits;
  }

  std::ostringstream f;
  f << token(w.dtype) << ",hdim" << hdim_q;
  if (hdim_v != hdim_q) f << "x" << hdim_v;
  f << ",mask=" << token(w.mask) << ",bias=" << token(w.bias) << ",vlayout=" << token(w.vlayout)
    << ",mode=" << token(w.mode);
  if (w.lse) f << ",lse=true";  // without it, both serve
  f << ",dropout=" << token(w.dropout) << ",softcap=" << token(w.softcap);
  if (pad_hdim) f << ",hpad";
  if (pad) f << ",pad";
  if (const TargetInfo* target = target_for(cc)) f << "," << target->token;
  s.filter = f.str();
  return s;
}

// Entries ranked by how close they come to running the problem: the furthest stage, then the
// most shared traits, then the nearest head dims; ties keep the table's order.
std::vector<const InstanceEntry*> nearest(const FwdArgs& a, int cc, size_t count) {
  const FwdTraits w = a.traits();
  auto closeness = [&](const InstanceEntry& e) {
    const FwdTraits& t = e.traits;
    const int shared = (t.dtype == w.dtype) + (t.hdim_q == w.hdim_q) + (t.hdim_v == w.hdim_v) +
                       (t.mask == w.mask) + (t.bias == w.bias) + (t.vlayout == w.vlayout) +
                       (t.mode == w.mode) + (t.lse || !w.lse) + (t.dropout == w.dropout) +
                       (t.softcap == w.softcap);
    const int hdim_distance = std::abs(t.hdim_q - w.hdim_q) + std::abs(t.hdim_v - w.hdim_v);
    return std::make_tuple(static_cast<int>(fit(e, a, w, cc)), shared, -hdim_distance);
  };
  std::vector<const InstanceEntry*> entries;
  for (int i = 0; i < kNumInstances; ++i) entries.push_back(&kInstances[i]);
  std::stable_sort(entries.begin(), entries.end(), [&](auto* x, auto* y) {
    return closeness(*x) > closeness(*y);
  });
  entries.resize(std::min(entries.size(), count));
  return entries;
}

std::string miss_message(const FwdArgs& a, int cc, Stage furthest) {
  const FwdTraits w = a.traits();
  std::ostringstream s;
  s << "no compiled fmha instance runs " << describe(w) << " on this GPU (" << sm(cc) << "): ";
  switch (furthest) {
    case Stage::kTraits: s << "no instance has these traits"; break;
    case Stage::kHeadDims:
      s << "instances with these traits exist, but none runs head dims "
        << extent(w.hdim_q, w.hdim_v)
        << " (an instance runs its own head dims, or smaller multiples of 8 when it pads them)";
      break;
    case Stage::kArch: s << "instances with these traits exist only for other GPUs"; break;
    case Stage::kLengths:
      s << "only unpadded instances fit, and the problem needs a padded one";
      break;
    case Stage::kRuns: break;
  }
  s << ". Nearest compiled:";
  const char* sep = " ";
  for (const InstanceEntry* e : nearest(a, cc, 3)) {
    s << sep << e->name << " (" << reason(fit(*e, a, w, cc), *e, a, w, cc) << ")";
    sep = "; ";
  }
  if (kNumInstances == 0) s << " none";
  // The `all` preset: the filter alone says what to build, whatever the default preset omits.
  const Suggestion build = suggest(a, cc);
  if (const TargetInfo* target = target_for(cc)) {
    s << ". Build one with FMHA_PRESET=all FMHA_FILTER='" << build.filter
      << "' and FMHA_ARCHS including " << target->token << " (python -m generator --preset all "
      << "--filter '" << build.filter << "')";
  } else {
    s << ". No generator target runs on " << sm(cc) << "; the filter for a newer GPU would be "
      << "python -m generator --preset all --filter '" << build.filter << "'";
  }
  if (!build.note.empty()) s << "; " << build.note;
  s << ".";
  return s.str();
}

// A pipeline's place in kPipelineTokens, 0 for the newest; one the table does not list (the
// generator lists every pipeline) ranks after all.
int pipeline_rank(const char* pipeline) {
  for (int i = 0; i < kNumPipelines; ++i) {
    if (std::strcmp(kPipelineTokens[i], pipeline) == 0) return i;
  }
  return kNumPipelines;
}

// Why `chosen` precedes `other` in the table: the first rule of the generator's order of
// preference (generator/dispatch.py, PREFERENCE) that tells them apart. Empty when that rule
// does not favour `chosen`, i.e. when the generator ranks by something this does not mirror.
std::string rank_reason(const InstanceEntry& chosen, const InstanceEntry& other) {
  const FwdTraits &c = chosen.traits, &o = other.traits;
  if (chosen.arch_cc != other.arch_cc) {
    if (chosen.arch_cc < other.arch_cc) return "";
    return std::string(chosen.arch) + " before " + other.arch +
           ": code for the newest architecture the GPU runs";
  }
  if (chosen.arch_exact != other.arch_exact) {
    if (!chosen.arch_exact) return "";
    return std::string(chosen.arch) + " before " + other.arch + ": code for exactly this GPU";
  }
  const int chosen_rank = pipeline_rank(chosen.pipeline);
  const int other_rank = pipeline_rank(other.pipeline);
  if (chosen_rank != other_rank) {
    if (chosen_rank > other_rank) return "";
    return std::string(chosen.pipeline) + " before " + other.pipeline + ": the newer pipeline";
  }
  if (chosen.pad_seqlen != other.pad_seqlen) {
    if (chosen.pad_seqlen) return "";
    return "unpadded fast path, because the sequence lengths are multiples of its " +
           extent(chosen.block_m, chosen.block_n) + " tile";
  }
  if (chosen.pad_hdim != other.pad_hdim) {
    if (chosen.pad_hdim) return "";
    return "exact head dims before padded ones: no zero-filled lanes";
  }
  if (chosen.pad_hdim && (c.hdim_q != o.hdim_q || c.hdim_v != o.hdim_v)) {
    if (std::make_pair(c.hdim_q, c.hdim_v) > std::make_pair(o.hdim_q, o.hdim_v)) return "";
    return "tightest padded head dims: " + extent(c.hdim_q, c.hdim_v) + " before " +
           extent(o.hdim_q, o.hdim_v);
  }
  if (c.lse != o.lse) {
    if (c.lse) return "";
    return "skips the log-sum-exp store the problem does not ask for";
  }
  const int chosen_area = chosen.block_m * chosen.block_n;
  const int other_area = other.block_m * other.block_n;
  if (chosen_area != other_area) {
    if (chosen_area < other_area) return "";
    return "larger tile: " + extent(chosen.block_m, chosen.block_n) + " before " +
           extent(other.block_m, other.block_n);
  }
  return "";
}

// A problem's value on one trait a PipelineGap names, as the generator spells it:
// "bias=elementwise", "hdim=120x120".
std::string trait_text(const std::string& trait, const FwdTraits& t) {
  std::string value;
  if (trait == "dtype") value = token(t.dtype);
  else if (trait == "hdim") value = extent(t.hdim_q, t.hdim_v);
  else if (trait == "hdim_q") value = std::to_string(t.hdim_q);
  else if (trait == "hdim_v") value = std::to_string(t.hdim_v);
  else if (trait == "mask") value = token(t.mask);
  else if (trait == "bias") value = token(t.bias);
  else if (trait == "vlayout") value = token(t.vlayout);
  else if (trait == "mode") value = token(t.mode);
  else if (trait == "lse") value = token(t.lse);
  else if (trait == "dropout") value = token(t.dropout);
  else if (trait == "softcap") value = token(t.softcap);
  return trait + "=" + value;
}

// Why no newer pipeline than the chosen entry's runs the problem on its arch: one line per
// rule of instances.yaml (kPipelineGaps) that leaves the newer pipeline without the problem's
// traits there, with the rule's reason; empty when none does.
std::string fallback_notes(const InstanceEntry& chosen, const FwdTraits& w) {
  std::ostringstream s;
  const int chosen_rank = pipeline_rank(chosen.pipeline);
  for (int i = 0; i < kNumPipelineGaps; ++i) {
    const PipelineGap& gap = kPipelineGaps[i];
    if (pipeline_rank(gap.pipeline) >= chosen_rank || std::strcmp(gap.arch, chosen.arch) != 0 ||
        !gap.matches(w)) {
      continue;
    }
    s << gap.pipeline << " (" << gap.arch << ") has no instance for ";
    std::istringstream traits(gap.traits);
    const char* sep = "";
    for (std::string trait; std::getline(traits, trait, ',');) {
      s << sep << trait_text(trait, w);
      sep = ", ";
    }
    s << ": " << gap.reason << "; falling back to " << chosen.pipeline << ".\n";
  }
  return s.str();
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
  Stage furthest = Stage::kTraits;
  for (int i = 0; i < kNumInstances; ++i) {
    const Stage stage = fit(kInstances[i], args, wanted, cc);
    if (stage == Stage::kRuns) {
      *chosen = &kInstances[i];
      return Status::Ok();
    }
    furthest = std::max(furthest, stage);
  }
  return {Status::Code::kNoInstance, miss_message(args, cc, furthest)};
}

Status find_instance(const std::string& name, const FwdArgs& args, int cc,
                     const InstanceEntry** chosen) {
  for (int i = 0; i < kNumInstances; ++i) {
    const InstanceEntry& e = kInstances[i];
    if (name != e.name) continue;
    const FwdTraits wanted = args.traits();
    const Stage stage = fit(e, args, wanted, cc);
    if (stage == Stage::kRuns) {
      *chosen = &e;
      return Status::Ok();
    }
    return {Status::Code::kInvalidArgument,
            "instance " + name + " cannot run this problem: " + reason(stage, e, args, wanted, cc)};
  }
  return {Status::Code::kNoInstance, "no compiled instance is called '" + name +
                                         "' (fmha::instances() lists them)"};
}

std::string explain_selection(const FwdArgs& args, int cc) {
  const FwdTraits wanted = args.traits();
  std::vector<const InstanceEntry*> runs, near_misses;
  Stage furthest = Stage::kTraits;
  for (int i = 0; i < kNumInstances; ++i) {
    const Stage stage = fit(kInstances[i], args, wanted, cc);
    if (stage == Stage::kRuns) runs.push_back(&kInstances[i]);
    if (stage == Stage::kArch || stage == Stage::kLengths) near_misses.push_back(&kInstances[i]);
    furthest = std::max(furthest, stage);
  }
  std::ostringstream s;
  s << "Problem: " << describe(wanted) << "; " << token(args.mode) << " mode, seqlen_q="
    << args.seqlen_q << " seqlen_k=" << args.seqlen_k;
  if (args.seqused_q != nullptr || args.seqused_k != nullptr) s << " (seqused_q/seqused_k given)";
  s << "; this GPU is " << sm(cc) << ".\n";
  if (runs.empty()) {
    s << miss_message(args, cc, furthest) << "\n";
    return s.str();
  }
  const InstanceEntry& chosen = *runs.front();
  s << "Runs " << chosen.name << " (" << chosen.pipeline << ", " << chosen.arch << ", tile "
    << extent(chosen.block_m, chosen.block_n) << ", head dims "
    << extent(chosen.traits.hdim_q, chosen.traits.hdim_v)
    << ", pad_seqlen=" << token(chosen.pad_seqlen) << ", pad_hdim=" << token(chosen.pad_hdim)
    << ").\n";
  if (runs.size() == 1) {
    s << "It is the only compiled instance that can run this problem.\n";
  } else {
    s << "It is the first of the " << runs.size() << " compiled instances that can run this "
      << "problem, in the generator's order of preference; it ranks before:\n";
    for (size_t i = 1; i < runs.size(); ++i) {
      std::string why = rank_reason(chosen, *runs[i]);
      if (why.empty()) why = "earlier in the generator's order of preference";
      s << "  " << runs[i]->name << ": " << why << "\n";
    }
  }
  s << fallback_notes(chosen, wanted);
  if (!near_misses.empty()) {
    s << "Instances with these traits and head dims that cannot run it:\n";
    for (const InstanceEntry* e : near_misses) {
      s << "  " << e->name << ": " << reason(fit(*e, args, wanted, cc), *e, args, wanted, cc)
        << "\n";
    }
  }
  return s.str();
}

InstanceInfo to_info(const InstanceEntry& e) {
  InstanceInfo info;
  info.name = e.name;
  info.traits = e.traits;
  info.pipeline = e.pipeline;
  info.arch = e.arch;
  info.arch_cc = e.arch_cc;
  info.arch_exact = e.arch_exact;
  info.block_m = e.block_m;
  info.block_n = e.block_n;
  info.pad_seqlen = e.pad_seqlen;
  info.pad_hdim = e.pad_hdim;
  return info;
}

}  // namespace fmha::detail
