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

// The forward call a problem describes: itself, or the one a backward problem differentiates.
const FwdArgs& forward_of(const FwdArgs& a) { return a; }
const FwdArgs& forward_of(const BwdArgs& a) { return a.fwd; }

// Each operation's table of compiled instances and of its pipelines' gaps.
struct FwdTable {
  using Entry = InstanceEntry;
  using Gap = PipelineGap;
  static const char* op() { return "fwd"; }
  static const Entry* entries() { return kInstances; }
  static int count() { return kNumInstances; }
  static const Gap* gaps() { return kPipelineGaps; }
  static int gap_count() { return kNumPipelineGaps; }
};
struct BwdTable {
  using Entry = BwdInstanceEntry;
  using Gap = BwdPipelineGap;
  static const char* op() { return "bwd"; }
  static const Entry* entries() { return kBwdInstances; }
  static int count() { return kNumBwdInstances; }
  static const Gap* gaps() { return kBwdPipelineGaps; }
  static int gap_count() { return kNumBwdPipelineGaps; }
};
template <class Args> struct TableOf;
template <> struct TableOf<FwdArgs> { using type = FwdTable; };
template <> struct TableOf<BwdArgs> { using type = BwdTable; };

int round_up(int value, int multiple) { return (value + multiple - 1) / multiple * multiple; }

// ---- the matching rule, one condition per stage ----------------------------------------------

// Functional traits: equal, except that an instance writing the log-sum-exp also serves a
// problem that does not ask for it (it skips the store).
bool traits_fit(const FwdTraits& e, const FwdTraits& w) {
  return e.dtype == w.dtype && e.mask == w.mask && e.bias == w.bias && e.vlayout == w.vlayout &&
         e.mode == w.mode && e.dropout == w.dropout && e.softcap == w.softcap && (e.lse || !w.lse);
}

// The backward's traits: all equal (it always reads the log-sum-exp).
bool traits_fit(const BwdTraits& e, const BwdTraits& w) {
  return e.dtype == w.dtype && e.mask == w.mask && e.bias == w.bias && e.mode == w.mode &&
         e.dbias == w.dbias && e.dropout == w.dropout && e.softcap == w.softcap;
}

// An unpadded entry runs exactly its head dims; a head-dim-padded one also runs smaller ones
// that are multiples of 8 (its loads and stores move rows in 16-byte pieces of 8 elements).
template <class Entry, class Traits>
bool head_dims_fit(const Entry& e, const Traits& w) {
  if (!e.pad_hdim) return e.traits.hdim_q == w.hdim_q && e.traits.hdim_v == w.hdim_v;
  return multiple_of_8(w.hdim_q) && multiple_of_8(w.hdim_v) && w.hdim_q <= e.traits.hdim_q &&
         w.hdim_v <= e.traits.hdim_v;
}

template <class Entry>
bool runs_on(const Entry& e, int cc) {
  return e.arch_exact ? cc == e.arch_cc : cc >= e.arch_cc;
}

// An unpadded entry skips every bounds check, so it needs lengths that are whole tiles and
// known on the host: batch mode without seqused_*.
template <class Entry>
bool lengths_fit(const Entry& e, const FwdArgs& a) {
  return e.pad_seqlen ||
         (a.mode == Mode::kBatch && a.seqused_q == nullptr && a.seqused_k == nullptr &&
          a.seqlen_q % e.block_m == 0 && a.seqlen_k % e.block_n == 0);
}

template <class Entry, class Args, class Traits>
Stage fit(const Entry& e, const Args& a, const Traits& w, int cc) {
  if (!traits_fit(e.traits, w)) return Stage::kTraits;
  if (!head_dims_fit(e, w)) return Stage::kHeadDims;
  if (!runs_on(e, cc)) return Stage::kArch;
  if (!lengths_fit(e, forward_of(a))) return Stage::kLengths;
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

std::string traits_reason(const BwdTraits& e, const BwdTraits& w) {
  std::string has, wants;
  auto differ = [&](const char* axis, const char* entry_value, const char* problem_value) {
    const char* sep = has.empty() ? "" : " ";
    has += sep + std::string(axis) + "=" + entry_value;
    wants += sep + std::string(axis) + "=" + problem_value;
  };
  if (e.dtype != w.dtype) differ("dtype", token(e.dtype), token(w.dtype));
  if (e.mask != w.mask) differ("mask", token(e.mask), token(w.mask));
  if (e.bias != w.bias) differ("bias", token(e.bias), token(w.bias));
  if (e.mode != w.mode) differ("mode", token(e.mode), token(w.mode));
  if (e.dbias != w.dbias) differ("dbias", token(e.dbias), token(w.dbias));
  if (e.dropout != w.dropout) differ("dropout", token(e.dropout), token(w.dropout));
  if (e.softcap != w.softcap) differ("softcap", token(e.softcap), token(w.softcap));
  return "it has " + has + " where the problem has " + wants;
}

template <class Entry, class Traits>
std::string head_dims_reason(const Entry& e, const Traits& w) {
  const std::string own = extent(e.traits.hdim_q, e.traits.hdim_v);
  const std::string problem = ", the problem's are " + extent(w.hdim_q, w.hdim_v);
  if (!e.pad_hdim) return "it runs head dims " + own + " only (pad_hdim=false)" + problem;
  if (w.hdim_q > e.traits.hdim_q || w.hdim_v > e.traits.hdim_v) {
    return "it runs head dims up to " + own + " (pad_hdim=true)" + problem;
  }
  return "it runs head dims below " + own + " only when they are multiples of 8" + problem;
}

template <class Entry>
std::string arch_reason(const Entry& e, int cc) {
  if (e.arch_exact) {
    return std::string("it is compiled for ") + e.arch + ", which runs only on " + sm(e.arch_cc) +
           " GPUs; this one is " + sm(cc);
  }
  return std::string("it is compiled for ") + e.arch + ", newer than this " + sm(cc) + " GPU";
}

// Why the lengths need a padded (pad_seqlen=true) instance.
template <class Entry>
std::string lengths_reason(const Entry& e, const FwdArgs& a) {
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

template <class Entry, class Args, class Traits>
std::string reason(Stage stage, const Entry& e, const Args& a, const Traits& w, int cc) {
  switch (stage) {
    case Stage::kTraits: return traits_reason(e.traits, w);
    case Stage::kHeadDims: return head_dims_reason(e, w);
    case Stage::kArch: return arch_reason(e, cc);
    case Stage::kLengths:
      return "it is unpadded (pad_seqlen=false) and " + lengths_reason(e, forward_of(a));
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

std::string describe(const BwdTraits& t) {
  std::ostringstream s;
  s << "dtype=" << token(t.dtype) << " hdim_q=" << t.hdim_q << " hdim_v=" << t.hdim_v
    << " mask=" << token(t.mask) << " bias=" << token(t.bias) << " mode=" << token(t.mode)
    << " dbias=" << token(t.dbias) << " dropout=" << token(t.dropout)
    << " softcap=" << token(t.softcap);
  return s.str();
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
// The filter tokens of a problem's traits after its head dims.
void filter_traits(std::ostream& f, const FwdTraits& w) {
  f << ",mask=" << token(w.mask) << ",bias=" << token(w.bias) << ",vlayout=" << token(w.vlayout)
    << ",mode=" << token(w.mode);
  if (w.lse) f << ",lse=true";  // without it, both serve
  f << ",dropout=" << token(w.dropout) << ",softcap=" << token(w.softcap);
}
void filter_traits(std::ostream& f, const BwdTraits& w) {
  f << ",mask=" << token(w.mask) << ",bias=" << token(w.bias) << ",mode=" << token(w.mode)
    << ",dbias=" << token(w.dbias) << ",dropout=" << token(w.dropout)
    << ",softcap=" << token(w.softcap);
}

// The filter's first token: the backward's instances are selected by their operation; the
// forward's filters predate operations and need none.
const char* filter_op(const FwdTraits&) { return ""; }
const char* filter_op(const BwdTraits&) { return "bwd,"; }

template <class Args>
Suggestion suggest(const Args& a, int cc) {
  using Table = typename TableOf<Args>::type;
  const auto w = a.traits();
  const FwdArgs& f = forward_of(a);
  int hdim_q = w.hdim_q, hdim_v = w.hdim_v;
  bool exact_compiled = false, covered = false;
  for (int i = 0; i < Table::count(); ++i) {
    const auto& t = Table::entries()[i].traits;
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
  bool pad = f.mode != Mode::kBatch || f.seqused_q != nullptr || f.seqused_k != nullptr;
  if (!pad) {
    bool tile_known = false, tile_fits = false;
    for (int i = 0; i < Table::count(); ++i) {
      const auto& e = Table::entries()[i];
      if (e.traits.hdim_q != hdim_q || e.traits.hdim_v != hdim_v) continue;
      tile_known = true;
      tile_fits = tile_fits || (f.seqlen_q % e.block_m == 0 && f.seqlen_k % e.block_n == 0);
    }
    pad = tile_known && !tile_fits;
  }

  std::ostringstream filter;
  filter << filter_op(w) << token(w.dtype) << ",hdim" << hdim_q;
  if (hdim_v != hdim_q) filter << "x" << hdim_v;
  filter_traits(filter, w);
  if (pad_hdim) filter << ",hpad";
  if (pad) filter << ",pad";
  if (const TargetInfo* target = target_for(cc)) filter << "," << target->token;
  s.filter = filter.str();
  return s;
}

// Entries ranked by how close they come to running the problem: the furthest stage, then the
// most shared traits, then the nearest head dims; ties keep the table's order.
// How many of a problem's traits an entry shares.
int shared_traits(const FwdTraits& t, const FwdTraits& w) {
  return (t.dtype == w.dtype) + (t.hdim_q == w.hdim_q) + (t.hdim_v == w.hdim_v) +
         (t.mask == w.mask) + (t.bias == w.bias) + (t.vlayout == w.vlayout) +
         (t.mode == w.mode) + (t.lse || !w.lse) + (t.dropout == w.dropout) +
         (t.softcap == w.softcap);
}
int shared_traits(const BwdTraits& t, const BwdTraits& w) {
  return (t.dtype == w.dtype) + (t.hdim_q == w.hdim_q) + (t.hdim_v == w.hdim_v) +
         (t.mask == w.mask) + (t.bias == w.bias) + (t.mode == w.mode) + (t.dbias == w.dbias) +
         (t.dropout == w.dropout) + (t.softcap == w.softcap);
}

template <class Args, class Entry = typename TableOf<Args>::type::Entry>
std::vector<const Entry*> nearest(const Args& a, int cc, size_t count) {
  using Table = typename TableOf<Args>::type;
  const auto w = a.traits();
  auto closeness = [&](const Entry& e) {
    const auto& t = e.traits;
    const int hdim_distance = std::abs(t.hdim_q - w.hdim_q) + std::abs(t.hdim_v - w.hdim_v);
    return std::make_tuple(static_cast<int>(fit(e, a, w, cc)), shared_traits(t, w),
                           -hdim_distance);
  };
  std::vector<const Entry*> entries;
  for (int i = 0; i < Table::count(); ++i) entries.push_back(&Table::entries()[i]);
  std::stable_sort(entries.begin(), entries.end(), [&](auto* x, auto* y) {
    return closeness(*x) > closeness(*y);
  });
  entries.resize(std::min(entries.size(), count));
  return entries;
}

template <class Args>
std::string miss_message(const Args& a, int cc, Stage furthest) {
  using Table = typename TableOf<Args>::type;
  const auto w = a.traits();
  std::ostringstream s;
  s << "no compiled fmha " << (Table::op() == std::string("fwd") ? "" : "bwd ") << "instance runs " << describe(w) << " on this GPU (" << sm(cc) << "): ";
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
  for (const auto* e : nearest(a, cc, 3)) {
    s << sep << e->name << " (" << reason(fit(*e, a, w, cc), *e, a, w, cc) << ")";
    sep = "; ";
  }
  if (Table::count() == 0) s << " none";
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
// The forward's last trait rule: an instance without the log-sum-exp store first. The backward
// has no such trait.
bool lse_differs(const FwdTraits& c, const FwdTraits& o) { return c.lse != o.lse; }
bool lse_differs(const BwdTraits&, const BwdTraits&) { return false; }
std::string lse_rank_reason(const FwdTraits& c, const FwdTraits&) {
  return c.lse ? "" : "skips the log-sum-exp store the problem does not ask for";
}
std::string lse_rank_reason(const BwdTraits&, const BwdTraits&) { return ""; }

template <class Entry>
std::string rank_reason(const Entry& chosen, const Entry& other) {
  const auto &c = chosen.traits, &o = other.traits;
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
  if (lse_differs(c, o)) return lse_rank_reason(c, o);
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
// "bias=elementwise", "hdim=120x120". The traits both operations have, then each one's own.
template <class Traits>
std::string common_trait_value(const std::string& trait, const Traits& t) {
  if (trait == "dtype") return token(t.dtype);
  if (trait == "hdim") return extent(t.hdim_q, t.hdim_v);
  if (trait == "hdim_q") return std::to_string(t.hdim_q);
  if (trait == "hdim_v") return std::to_string(t.hdim_v);
  if (trait == "mask") return token(t.mask);
  if (trait == "bias") return token(t.bias);
  if (trait == "mode") return token(t.mode);
  if (trait == "dropout") return token(t.dropout);
  if (trait == "softcap") return token(t.softcap);
  return "";
}
std::string trait_text(const std::string& trait, const FwdTraits& t) {
  std::string value = common_trait_value(trait, t);
  if (trait == "vlayout") value = token(t.vlayout);
  else if (trait == "lse") value = token(t.lse);
  return trait + "=" + value;
}
std::string trait_text(const std::string& trait, const BwdTraits& t) {
  std::string value = common_trait_value(trait, t);
  if (trait == "dbias") value = token(t.dbias);
  return trait + "=" + value;
}

// Why no newer pipeline than the chosen entry's runs the problem on its arch: one line per
// rule of instances.yaml (the operation's pipeline gaps) that leaves the newer pipeline without
// the problem's traits there, with the rule's reason; empty when none does.
template <class Table, class Traits>
std::string fallback_notes(const typename Table::Entry& chosen, const Traits& w) {
  std::ostringstream s;
  const int chosen_rank = pipeline_rank(chosen.pipeline);
  for (int i = 0; i < Table::gap_count(); ++i) {
    const auto& gap = Table::gaps()[i];
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

template <class Args, class Entry>
Status select_in_table(const Args& args, int cc, const Entry** chosen) {
  using Table = typename TableOf<Args>::type;
  const auto wanted = args.traits();
  Stage furthest = Stage::kTraits;
  for (int i = 0; i < Table::count(); ++i) {
    const Stage stage = fit(Table::entries()[i], args, wanted, cc);
    if (stage == Stage::kRuns) {
      *chosen = &Table::entries()[i];
      return Status::Ok();
    }
    furthest = std::max(furthest, stage);
  }
  return {Status::Code::kNoInstance, miss_message(args, cc, furthest)};
}

template <class Args, class Entry>
Status find_in_table(const std::string& name, const Args& args, int cc, const Entry** chosen) {
  using Table = typename TableOf<Args>::type;
  for (int i = 0; i < Table::count(); ++i) {
    const Entry& e = Table::entries()[i];
    if (name != e.name) continue;
    const auto wanted = args.traits();
    const Stage stage = fit(e, args, wanted, cc);
    if (stage == Stage::kRuns) {
      *chosen = &e;
      return Status::Ok();
    }
    return {Status::Code::kInvalidArgument,
            "instance " + name + " cannot run this problem: " + reason(stage, e, args, wanted, cc)};
  }
  const bool fwd = Table::op() == std::string("fwd");
  return {Status::Code::kNoInstance, "no compiled " + std::string(fwd ? "" : "bwd ") +
                                         "instance is called '" + name + "' (fmha::" +
                                         (fwd ? "instances" : "bwd_instances") +
                                         "() lists them)"};
}

template <class Args>
std::string explain_in_table(const Args& args, int cc) {
  using Table = typename TableOf<Args>::type;
  using Entry = typename Table::Entry;
  const auto wanted = args.traits();
  const FwdArgs& f = forward_of(args);
  std::vector<const Entry*> runs, near_misses;
  Stage furthest = Stage::kTraits;
  for (int i = 0; i < Table::count(); ++i) {
    const Entry& e = Table::entries()[i];
    const Stage stage = fit(e, args, wanted, cc);
    if (stage == Stage::kRuns) runs.push_back(&e);
    if (stage == Stage::kArch || stage == Stage::kLengths) near_misses.push_back(&e);
    furthest = std::max(furthest, stage);
  }
  std::ostringstream s;
  s << (Table::op() == std::string("fwd") ? "Problem: " : "Backward problem: ")
    << describe(wanted) << "; " << token(f.mode) << " mode, seqlen_q=" << f.seqlen_q
    << " seqlen_k=" << f.seqlen_k;
  if (f.seqused_q != nullptr || f.seqused_k != nullptr) s << " (seqused_q/seqused_k given)";
  s << "; this GPU is " << sm(cc) << ".\n";
  if (runs.empty()) {
    s << miss_message(args, cc, furthest) << "\n";
    return s.str();
  }
  const Entry& chosen = *runs.front();
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
  s << fallback_notes<Table>(chosen, wanted);
  if (!near_misses.empty()) {
    s << "Instances with these traits and head dims that cannot run it:\n";
    for (const Entry* e : near_misses) {
      s << "  " << e->name << ": " << reason(fit(*e, args, wanted, cc), *e, args, wanted, cc)
        << "\n";
    }
  }
  return s.str();
}

template <class Info, class Entry>
Info info_of(const Entry& e) {
  Info info;
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
  return select_in_table(args, cc, chosen);
}
Status select_instance(const BwdArgs& args, int cc, const BwdInstanceEntry** chosen) {
  return select_in_table(args, cc, chosen);
}

Status find_instance(const std::string& name, const FwdArgs& args, int cc,
                     const InstanceEntry** chosen) {
  return find_in_table(name, args, cc, chosen);
}
Status find_instance(const std::string& name, const BwdArgs& args, int cc,
                     const BwdInstanceEntry** chosen) {
  return find_in_table(name, args, cc, chosen);
}

std::string explain_selection(const FwdArgs& args, int cc) { return explain_in_table(args, cc); }
std::string explain_selection(const BwdArgs& args, int cc) { return explain_in_table(args, cc); }

InstanceInfo to_info(const InstanceEntry& e) { return info_of<InstanceInfo>(e); }
BwdInstanceInfo to_info(const BwdInstanceEntry& e) { return info_of<BwdInstanceInfo>(e); }

}  // namespace fmha::detail
