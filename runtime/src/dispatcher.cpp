#include "dispatcher.h"

#include "instance_tables.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
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
const char* token(KvCacheDtype t) { return kKvCacheDtypeTokens[static_cast<int>(t)]; }
const char* token(MaskType t) { return kMaskTokens[static_cast<int>(t)]; }
const char* token(BiasType t) { return kBiasTokens[static_cast<int>(t)]; }
const char* token(VLayout t) { return kVLayoutTokens[static_cast<int>(t)]; }
const char* token(Mode t) { return kModeTokens[static_cast<int>(t)]; }

std::string extent(int rows, int cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}

// An instance's tile as explain() names it; a decode instance with a full-grid tile names both.
template <class Entry>
std::string tile_text(const Entry& e) {
  return extent(e.block_m, e.block_n);
}
std::string tile_text(const KvcacheInstanceEntry& e) {
  std::string text = extent(e.block_m, e.block_n);
  if (e.full_grid_block_n > 0) {
    text += " (" + extent(e.block_m, e.full_grid_block_n) +
            " where the sequences and K/V heads fill every SM)";
  }
  return text;
}

std::string sm(int cc) { return "sm" + std::to_string(cc); }

// Each operation's table of compiled instances and of its pipelines' gaps, and how messages
// name it: `kind` goes before "instance" ("no compiled fmha bwd instance runs ..."), `listing`
// is the API function that lists its instances, `problem` starts explain()'s first line,
// `entry_point` is the call whose messages these are (the prefix its argument checks have).
// padded_hdim_step: the step of the head dims its head-dim-padded entries run (registry.h), so
// that a miss may suggest one; 0 where its kernels take exact head dims only. matrix_head_dims:
// the head dims its whole matrix has, which a miss suggests building.
struct FwdTable {
  using Entry = FwdInstanceEntry;
  using Gap = FwdPipelineGap;
  static const char* kind() { return ""; }
  static const char* listing() { return "instances"; }
  static const char* entry_point() { return "fmha::fwd"; }
  static const char* problem() { return "Problem"; }
  static int padded_hdim_step() { return kFwdPaddedHeadDimStep; }
  static const MatrixHeadDims* matrix_head_dims() { return kFwdMatrixHeadDims; }
  static int matrix_head_dim_count() { return kNumFwdMatrixHeadDims; }
  static EntryList<Entry> list() { return fwd_entries(); }
  static const Gap* gaps() { return kFwdPipelineGaps; }
  static int gap_count() { return kNumFwdPipelineGaps; }
};
struct BwdTable {
  using Entry = BwdInstanceEntry;
  using Gap = BwdPipelineGap;
  static const char* kind() { return "bwd "; }
  static const char* listing() { return "bwd_instances"; }
  static const char* entry_point() { return "fmha::bwd"; }
  static const char* problem() { return "Backward problem"; }
  static int padded_hdim_step() { return kBwdPaddedHeadDimStep; }
  static const MatrixHeadDims* matrix_head_dims() { return kBwdMatrixHeadDims; }
  static int matrix_head_dim_count() { return kNumBwdMatrixHeadDims; }
  static EntryList<Entry> list() { return bwd_entries(); }
  static const Gap* gaps() { return kBwdPipelineGaps; }
  static int gap_count() { return kNumBwdPipelineGaps; }
};
struct KvcacheTable {
  using Entry = KvcacheInstanceEntry;
  using Gap = KvcachePipelineGap;
  static const char* kind() { return "kvcache "; }
  static const char* listing() { return "kvcache_instances"; }
  static const char* entry_point() { return "fmha::fwd_kvcache"; }
  static const char* problem() { return "KV-cache problem"; }
  static int padded_hdim_step() { return kKvcachePaddedHeadDimStep; }
  static const MatrixHeadDims* matrix_head_dims() { return kKvcacheMatrixHeadDims; }
  static int matrix_head_dim_count() { return kNumKvcacheMatrixHeadDims; }
  static EntryList<Entry> list() { return kvcache_entries(); }
  static const Gap* gaps() { return kKvcachePipelineGaps; }
  static int gap_count() { return kNumKvcachePipelineGaps; }
};
template <class Args> struct TableOf;
template <> struct TableOf<FwdArgs> { using type = FwdTable; };
template <> struct TableOf<BwdArgs> { using type = BwdTable; };
template <> struct TableOf<KvcacheArgs> { using type = KvcacheTable; };
template <class Entry> struct TableOfEntry;
template <> struct TableOfEntry<FwdInstanceEntry> { using type = FwdTable; };
template <> struct TableOfEntry<BwdInstanceEntry> { using type = BwdTable; };
template <> struct TableOfEntry<KvcacheInstanceEntry> { using type = KvcacheTable; };

// Whether a head-dim-padded entry of `Table` may run head dim d: a positive multiple of its
// step (8 where rows move in whole 16-byte pieces).
template <class Table>
bool in_padded_step(int d) {
  const int step = Table::padded_hdim_step();
  return d > 0 && step > 0 && d % step == 0;
}

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

// KV-cache attention's traits: all equal.
bool traits_fit(const KvcacheTraits& e, const KvcacheTraits& w) {
  return e.dtype == w.dtype && e.kv_dtype == w.kv_dtype && e.mask == w.mask &&
         e.bias == w.bias && e.paged == w.paged && e.softcap == w.softcap;
}

// An unpadded entry runs exactly its head dims; a head-dim-padded one also runs smaller ones
// in its operation's step (multiples of 8 where its loads and stores move rows in whole
// 16-byte pieces of 8 elements; any where its kernel takes a partial last piece).
template <class Entry, class Traits>
bool head_dims_fit(const Entry& e, const Traits& w) {
  if (!e.pad_hdim) return e.traits.hdim_q == w.hdim_q && e.traits.hdim_v == w.hdim_v;
  using Table = typename TableOfEntry<Entry>::type;
  return in_padded_step<Table>(w.hdim_q) && in_padded_step<Table>(w.hdim_v) &&
         w.hdim_q <= e.traits.hdim_q && w.hdim_v <= e.traits.hdim_v;
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
template <class Entry>
bool lengths_fit(const Entry& e, const BwdArgs& a) {
  return lengths_fit(e, a.fwd);
}
// The cache lengths live on the device (cache_seqlens): every kvcache instance pads them. A
// prefill instance takes chunks of at least a tile of query tokens, or of at least
// kPrefillMinPackedRows packed rows (query tokens x query heads per K/V head, the decode
// kernel's rows), on pages of a multiple of kPrefillPageMultiple keys (registry.h; the
// generator writes both, generator/operations.py says why), without cache_leftpad (the decode
// kernel's alone).
int64_t packed_rows(const KvcacheArgs& a) {
  return static_cast<int64_t>(a.seqlen_q) * (a.nhead_k > 0 ? a.nhead_q / a.nhead_k : 1);
}
template <class Entry>
bool lengths_fit(const Entry& e, const KvcacheArgs& a) {
  if (e.prefill) {
    return (a.seqlen_q >= e.block_m || packed_rows(a) >= kPrefillMinPackedRows) &&
           a.page_size % kPrefillPageMultiple == 0 && a.cache_leftpad == nullptr;
  }
  return e.pad_seqlen;
}

template <class Entry, class Args, class Traits>
Stage fit(const Entry& e, const Args& a, const Traits& w, int cc) {
  if (!traits_fit(e.traits, w)) return Stage::kTraits;
  if (!head_dims_fit(e, w)) return Stage::kHeadDims;
  if (!runs_on(e, cc)) return Stage::kArch;
  if (!lengths_fit(e, a)) return Stage::kLengths;
  return Stage::kRuns;
}

// ---- the same conditions in words, for an entry known to fail them ----------------------------

// The traits an entry and a problem differ in, in words: "it has mask=none where the problem
// has mask=causal".
class TraitDifference {
 public:
  template <class Value>
  void check(const char* axis, Value entry_value, Value problem_value) {
    if (entry_value != problem_value) add(axis, token(entry_value), token(problem_value));
  }
  void add(const char* axis, const char* entry_value, const char* problem_value) {
    const char* sep = has_.empty() ? "" : " ";
    has_ += sep + std::string(axis) + "=" + entry_value;
    wants_ += sep + std::string(axis) + "=" + problem_value;
  }
  std::string text() const { return "it has " + has_ + " where the problem has " + wants_; }

 private:
  std::string has_, wants_;
};

std::string traits_reason(const FwdTraits& e, const FwdTraits& w) {
  TraitDifference d;
  d.check("dtype", e.dtype, w.dtype);
  d.check("mask", e.mask, w.mask);
  d.check("bias", e.bias, w.bias);
  d.check("vlayout", e.vlayout, w.vlayout);
  d.check("mode", e.mode, w.mode);
  if (w.lse && !e.lse) d.add("lse", "false", "true");
  d.check("dropout", e.dropout, w.dropout);
  d.check("softcap", e.softcap, w.softcap);
  return d.text();
}

std::string traits_reason(const BwdTraits& e, const BwdTraits& w) {
  TraitDifference d;
  d.check("dtype", e.dtype, w.dtype);
  d.check("mask", e.mask, w.mask);
  d.check("bias", e.bias, w.bias);
  d.check("mode", e.mode, w.mode);
  d.check("dbias", e.dbias, w.dbias);
  d.check("dropout", e.dropout, w.dropout);
  d.check("softcap", e.softcap, w.softcap);
  return d.text();
}

std::string traits_reason(const KvcacheTraits& e, const KvcacheTraits& w) {
  TraitDifference d;
  d.check("dtype", e.dtype, w.dtype);
  d.check("kv_dtype", e.kv_dtype, w.kv_dtype);
  d.check("mask", e.mask, w.mask);
  d.check("bias", e.bias, w.bias);
  d.check("paged", e.paged, w.paged);
  d.check("softcap", e.softcap, w.softcap);
  return d.text();
}

template <class Entry, class Traits>
std::string head_dims_reason(const Entry& e, const Traits& w) {
  const std::string own = extent(e.traits.hdim_q, e.traits.hdim_v);
  const std::string problem = ", the problem's are " + extent(w.hdim_q, w.hdim_v);
  if (!e.pad_hdim) return "it runs head dims " + own + " only (pad_hdim=false)" + problem;
  if (w.hdim_q > e.traits.hdim_q || w.hdim_v > e.traits.hdim_v) {
    return "it runs head dims up to " + own + " (pad_hdim=true)" + problem;
  }
  return "it runs head dims below " + own + " only when they are multiples of " +
         std::to_string(TableOfEntry<Entry>::type::padded_hdim_step()) + problem;
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
  const std::string unpadded = "it is unpadded (pad_seqlen=false) and ";
  if (a.mode != Mode::kBatch) {
    return unpadded + "group mode's sequence lengths are known only on the device";
  }
  if (a.seqused_q != nullptr || a.seqused_k != nullptr) {
    return unpadded + "seqused_q/seqused_k set per-sequence lengths known only on the device";
  }
  if (a.seqlen_q % e.block_m != 0) {
    return unpadded + "seqlen_q=" + std::to_string(a.seqlen_q) +
           " is not a multiple of its block_m=" + std::to_string(e.block_m);
  }
  return unpadded + "seqlen_k=" + std::to_string(a.seqlen_k) +
         " is not a multiple of its block_n=" + std::to_string(e.block_n);
}
template <class Entry>
std::string lengths_reason(const Entry& e, const BwdArgs& a) {
  return lengths_reason(e, a.fwd);
}
template <class Entry>
std::string lengths_reason(const Entry& e, const KvcacheArgs& a) {
  if (!e.prefill) {
    return "it is unpadded (pad_seqlen=false) and the cache lengths (cache_seqlens) are known "
           "only on the device";
  }
  if (a.seqlen_q < e.block_m && packed_rows(a) < kPrefillMinPackedRows) {
    return "it is a prefill instance, for chunks of at least block_m=" +
           std::to_string(e.block_m) + " query tokens or " +
           std::to_string(kPrefillMinPackedRows) +
           " packed rows (query tokens x query heads per K/V head), and seqlen_q=" +
           std::to_string(a.seqlen_q) + " makes " + std::to_string(packed_rows(a)) +
           ": a decode step";
  }
  if (a.page_size % kPrefillPageMultiple != 0) {
    return "it is a prefill instance, whose TMA boxes take pages of a multiple of " +
           std::to_string(kPrefillPageMultiple) + " keys, and page_size=" +
           std::to_string(a.page_size);
  }
  return "it is a prefill instance, and cache_leftpad (left-padded sequences) is the decode "
         "kernel's alone";
}

template <class Entry, class Args, class Traits>
std::string reason(Stage stage, const Entry& e, const Args& a, const Traits& w, int cc) {
  switch (stage) {
    case Stage::kTraits: return traits_reason(e.traits, w);
    case Stage::kHeadDims: return head_dims_reason(e, w);
    case Stage::kArch: return arch_reason(e, cc);
    case Stage::kLengths:
      return lengths_reason(e, a);
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

std::string describe(const KvcacheTraits& t) {
  std::ostringstream s;
  s << "dtype=" << token(t.dtype) << " kv_dtype=" << token(t.kv_dtype) << " hdim_q=" << t.hdim_q
    << " hdim_v=" << t.hdim_v
    << " mask=" << token(t.mask) << " bias=" << token(t.bias) << " paged=" << token(t.paged)
    << " softcap=" << token(t.softcap);
  return s.str();
}

// A problem's lengths, as explain() states them.
std::string describe_lengths(const FwdArgs& f) {
  std::ostringstream s;
  s << token(f.mode) << " mode, seqlen_q=" << f.seqlen_q << " seqlen_k=" << f.seqlen_k;
  if (f.seqused_q != nullptr || f.seqused_k != nullptr) s << " (seqused_q/seqused_k given)";
  return s.str();
}
std::string describe_lengths(const BwdArgs& a) { return describe_lengths(a.fwd); }
std::string describe_lengths(const KvcacheArgs& a) {
  std::ostringstream s;
  s << "seqlen_q=" << a.seqlen_q << " seqlen_new=" << a.seqlen_new
    << " seqlen_cache=" << a.seqlen_cache << " (the cache lengths are on the device)";
  return s.str();
}

struct Suggestion {
  std::string filter;  // the generator --filter that selects instances able to run the problem
  std::string note;    // what to check in instances.yaml first, if anything
};

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
void filter_traits(std::ostream& f, const KvcacheTraits& w) {
  f << ",kv_dtype=" << token(w.kv_dtype) << ",mask=" << token(w.mask) << ",bias=" << token(w.bias) << ",paged=" << token(w.paged)
    << ",softcap=" << token(w.softcap);
}

// The filter's first token: the other operations' instances are selected by their operation;
// the forward's filters predate operations and need none.
const char* filter_op(const FwdTraits&) { return ""; }
const char* filter_op(const BwdTraits&) { return "bwd,"; }
const char* filter_op(const KvcacheTraits&) { return "kvcache,"; }

// Whether the problem needs a padded (pad_seqlen=true) instance of Table with head dims
// (hdim_q, hdim_v): its lengths are known only on the device, or are not whole tiles of the
// compiled instances with those head dims (when there are any).
template <class Table>
bool needs_padded_lengths(const FwdArgs& f, int hdim_q, int hdim_v) {
  if (f.mode != Mode::kBatch || f.seqused_q != nullptr || f.seqused_k != nullptr) return true;
  bool tile_known = false, tile_fits = false;
  for (const auto& e : Table::list()) {
    if (e.traits.hdim_q != hdim_q || e.traits.hdim_v != hdim_v) continue;
    tile_known = true;
    tile_fits = tile_fits || (f.seqlen_q % e.block_m == 0 && f.seqlen_k % e.block_n == 0);
  }
  return tile_known && !tile_fits;
}
template <class Table>
bool needs_padded_lengths(const BwdArgs& a, int hdim_q, int hdim_v) {
  return needs_padded_lengths<Table>(a.fwd, hdim_q, hdim_v);
}
template <class Table>
bool needs_padded_lengths(const KvcacheArgs&, int, int) {
  return true;
}

// Why no instance of `w`'s traits pads head dims, or null where the operation's padded ones
// may: an e4m3 cache's rows move in whole 16-byte pieces of 16 elements (instances.yaml's rule
// {kv_dtype: e4m3, pad_hdim: true} prunes its padded instances), and the e4m3 forward runs on
// fa3, whose instances take exact head dims.
template <class Traits>
const char* exact_head_dims_only(const Traits&) {
  return nullptr;
}
const char* exact_head_dims_only(const FwdTraits& w) {
  return w.dtype == DataType::kE4M3
             ? "the e4m3 forward's instances (fa3) run exactly their own head dims"
             : nullptr;
}
const char* exact_head_dims_only(const KvcacheTraits& w) {
  return w.kv_dtype == KvCacheDtype::kE4M3
             ? "an e4m3 cache's instances run exactly their own head dims (its rows move in "
               "whole 16-byte pieces of 16 elements)"
             : nullptr;
}

// What to check before building for `w`, where the matrix keeps its traits to a few instances
// of another shape (the e4m3 forward); null for the others.
template <class Traits>
const char* traits_note(const Traits&) {
  return nullptr;
}
const char* traits_note(const FwdTraits& w) {
  return w.dtype == DataType::kE4M3
             ? "the e4m3 (FP8) forward has instances on fa3 (sm90a) only, for row-major V in "
               "batch and group mode and V^T (VLayout::kColMajor) in batch mode, and not every "
               "trait: python -m generator --preset all --filter e4m3 --list names them"
             : nullptr;
}

// The head dims to build for `w`: its own when the operation's matrix has them (whether or not
// this build compiled any); else, for head dims in the step of the operation's padded kernels,
// the matrix's smallest head dims above them, run padded, or failing that the next multiples
// of 32, which fa2's tiles come in (fa2 is the pipeline that pads head dims; fa3 runs exact
// multiples of 64 only). So compile on demand builds what a full build would run the call with
// (a d64 call on a build of d128 alone gets d64's fa3 instance, not d128's padded fa2 one).
template <class Args>
Suggestion suggest(const Args& a, int cc) {
  using Table = typename TableOf<Args>::type;
  const auto w = a.traits();
  int hdim_q = w.hdim_q, hdim_v = w.hdim_v;
  bool in_matrix = false, covered = false;
  for (int i = 0; i < Table::matrix_head_dim_count(); ++i) {
    const MatrixHeadDims& m = Table::matrix_head_dims()[i];
    if (m.hdim_q == w.hdim_q && m.hdim_v == w.hdim_v) in_matrix = true;
    const bool covers = m.hdim_q >= w.hdim_q && m.hdim_v >= w.hdim_v;
    if (covers && (!covered || m.hdim_q + m.hdim_v < hdim_q + hdim_v)) {
      hdim_q = m.hdim_q;
      hdim_v = m.hdim_v;
      covered = true;
    }
  }
  Suggestion s;
  const char* exact_only = exact_head_dims_only(w);
  const bool paddable = in_padded_step<Table>(w.hdim_q) && in_padded_step<Table>(w.hdim_v) &&
                        exact_only == nullptr;
  if (in_matrix || !paddable) {
    hdim_q = w.hdim_q;
    hdim_v = w.hdim_v;
    if (!in_matrix) {
      const int step = Table::padded_hdim_step();
      const std::string why =
          exact_only != nullptr ? std::string(exact_only)
          : step > 0 ? "head dims that are not multiples of " + std::to_string(step) +
                           " need an instance of exactly those head dims"
                     : Table::kind() + std::string("instances run exactly their own head dims");
      s.note = why + ": instances.yaml's matrix.hdim must list [" + std::to_string(hdim_q) +
               ", " + std::to_string(hdim_v) + "], if its pipeline's tiles allow them";
    }
  } else if (!covered) {
    hdim_q = round_up(w.hdim_q, 32);
    hdim_v = round_up(w.hdim_v, 32);
    s.note = "the matrix has no head dims of at least " + extent(w.hdim_q, w.hdim_v) +
             ", so instances.yaml's matrix.hdim may need [" + std::to_string(hdim_q) + ", " +
             std::to_string(hdim_v) + "]";
  }
  if (const char* note = traits_note(w)) s.note = s.note.empty() ? note : s.note + "; " + note;
  const bool pad_hdim = hdim_q != w.hdim_q || hdim_v != w.hdim_v;

  // `pad` only where no unpadded instance could serve: without it the filter selects both
  // variants, and the padded one covers every length.
  const bool pad = needs_padded_lengths<Table>(a, hdim_q, hdim_v);

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
int shared_traits(const KvcacheTraits& t, const KvcacheTraits& w) {
  return (t.dtype == w.dtype) + (t.kv_dtype == w.kv_dtype) + (t.hdim_q == w.hdim_q) +
         (t.hdim_v == w.hdim_v) + (t.mask == w.mask) + (t.bias == w.bias) +
         (t.paged == w.paged) + (t.softcap == w.softcap);
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
  for (const Entry& e : Table::list()) entries.push_back(&e);
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
  s << "no compiled fmha " << Table::kind() << "instance runs " << describe(w) << " on this GPU ("
    << sm(cc) << "): ";
  switch (furthest) {
    case Stage::kTraits: s << "no instance has these traits"; break;
    case Stage::kHeadDims:
      s << "instances with these traits exist, but none runs head dims "
        << extent(w.hdim_q, w.hdim_v)
        << " (an instance runs its own head dims, or smaller multiples of 8 when it pads them)";
      break;
    case Stage::kArch: s << "instances with these traits exist only for other GPUs"; break;
    case Stage::kLengths:
      s << "the instances that fit otherwise take other lengths (unpadded ones whole tiles, "
           "prefill ones chunks of many query tokens)";
      break;
    case Stage::kRuns: break;
  }
  s << ". Nearest compiled:";
  const char* sep = " ";
  for (const auto* e : nearest(a, cc, 3)) {
    s << sep << e->name << " (" << reason(fit(*e, a, w, cc), *e, a, w, cc) << ")";
    sep = "; ";
  }
  if (Table::list().size == 0) s << " none";
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
// The forward's last trait rule: an instance without the log-sum-exp store first; nothing
// where it does not tell the two apart. The other operations have no such trait.
template <class Traits>
std::optional<std::string> lse_rank_reason(const Traits&, const Traits&) {
  return std::nullopt;
}
std::optional<std::string> lse_rank_reason(const FwdTraits& c, const FwdTraits& o) {
  if (c.lse == o.lse) return std::nullopt;
  return c.lse ? "" : "skips the log-sum-exp store the problem does not ask for";
}

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
  if (const std::optional<std::string> why = lse_rank_reason(c, o)) return *why;
  const int chosen_area = chosen.block_m * chosen.block_n;
  const int other_area = other.block_m * other.block_n;
  if (chosen_area != other_area) {
    if (chosen_area < other_area) return "";
    return "larger tile: " + extent(chosen.block_m, chosen.block_n) + " before " +
           extent(other.block_m, other.block_n);
  }
  return "";
}

// A problem's value on one trait a FwdPipelineGap names, as the generator spells it:
// "bias=elementwise", "hdim=120x120". The traits every operation has, then those of the
// forward and the backward, then each one's own.
template <class Traits>
std::string common_trait_value(const std::string& trait, const Traits& t) {
  if (trait == "dtype") return token(t.dtype);
  if (trait == "hdim") return extent(t.hdim_q, t.hdim_v);
  if (trait == "hdim_q") return std::to_string(t.hdim_q);
  if (trait == "hdim_v") return std::to_string(t.hdim_v);
  if (trait == "mask") return token(t.mask);
  if (trait == "bias") return token(t.bias);
  if (trait == "softcap") return token(t.softcap);
  return "";
}
template <class Traits>
std::string fwd_bwd_trait_value(const std::string& trait, const Traits& t) {
  if (trait == "mode") return token(t.mode);
  if (trait == "dropout") return token(t.dropout);
  return common_trait_value(trait, t);
}
std::string trait_text(const std::string& trait, const FwdTraits& t) {
  std::string value = fwd_bwd_trait_value(trait, t);
  if (trait == "vlayout") value = token(t.vlayout);
  else if (trait == "lse") value = token(t.lse);
  return trait + "=" + value;
}
std::string trait_text(const std::string& trait, const BwdTraits& t) {
  std::string value = fwd_bwd_trait_value(trait, t);
  if (trait == "dbias") value = token(t.dbias);
  return trait + "=" + value;
}
std::string trait_text(const std::string& trait, const KvcacheTraits& t) {
  std::string value = common_trait_value(trait, t);
  if (trait == "kv_dtype") value = token(t.kv_dtype);
  else if (trait == "paged") value = token(t.paged);
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
  for (const Entry& e : Table::list()) {
    const Stage stage = fit(e, args, wanted, cc);
    if (stage == Stage::kRuns) {
      *chosen = &e;
      return Status::Ok();
    }
    furthest = std::max(furthest, stage);
  }
  return {Status::Code::kNoInstance, miss_message(args, cc, furthest)};
}

template <class Args, class Entry>
Status find_in_table(const std::string& name, const Args& args, int cc, const Entry** chosen) {
  using Table = typename TableOf<Args>::type;
  for (const Entry& e : Table::list()) {
    if (name != e.name) continue;
    const auto wanted = args.traits();
    const Stage stage = fit(e, args, wanted, cc);
    if (stage == Stage::kRuns) {
      *chosen = &e;
      return Status::Ok();
    }
    return {Status::Code::kInvalidArgument,
            std::string(Table::entry_point()) + ": instance " + name +
                " cannot run this problem: " + reason(stage, e, args, wanted, cc)};
  }
  return {Status::Code::kNoInstance, "no compiled " + std::string(Table::kind()) +
                                         "instance is called '" + name + "' (fmha::" +
                                         Table::listing() + "() lists them)"};
}

template <class Args>
std::string explain_in_table(const Args& args, int cc) {
  using Table = typename TableOf<Args>::type;
  using Entry = typename Table::Entry;
  const auto wanted = args.traits();
  std::vector<const Entry*> runs, near_misses;
  Stage furthest = Stage::kTraits;
  for (const Entry& e : Table::list()) {
    const Stage stage = fit(e, args, wanted, cc);
    if (stage == Stage::kRuns) runs.push_back(&e);
    if (stage == Stage::kArch || stage == Stage::kLengths) near_misses.push_back(&e);
    furthest = std::max(furthest, stage);
  }
  std::ostringstream s;
  s << Table::problem() << ": " << describe(wanted) << "; " << describe_lengths(args)
    << "; this GPU is " << sm(cc) << ".\n";
  if (runs.empty()) {
    s << miss_message(args, cc, furthest) << "\n";
    return s.str();
  }
  const Entry& chosen = *runs.front();
  s << "Runs " << chosen.name << " (" << chosen.pipeline << ", " << chosen.arch << ", tile "
    << tile_text(chosen) << ", head dims "
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
  info.origin = origin_of(e.name);
  return info;
}

}  // namespace

namespace {

Status device_cc(int* cc, bool bind_context) {
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  // CUDA 12 and newer: cudaSetDevice binds the device's primary context to this thread now.
  if (err == cudaSuccess && bind_context) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    return {Status::Code::kCudaError,
            std::string("cannot query the current CUDA device: ") + cudaGetErrorString(err)};
  }
  *cc = major * 10 + minor;
  return Status::Ok();
}

}  // namespace

Status current_device_cc(int* cc) { return device_cc(cc, /*bind_context=*/false); }

Status launch_device_cc(int* cc) { return device_cc(cc, /*bind_context=*/true); }

Status select_instance(const FwdArgs& args, int cc, const FwdInstanceEntry** chosen) {
  return select_in_table(args, cc, chosen);
}
Status select_instance(const BwdArgs& args, int cc, const BwdInstanceEntry** chosen) {
  return select_in_table(args, cc, chosen);
}
Status select_instance(const KvcacheArgs& args, int cc, const KvcacheInstanceEntry** chosen) {
  return select_in_table(args, cc, chosen);
}

Status find_instance(const std::string& name, const FwdArgs& args, int cc,
                     const FwdInstanceEntry** chosen) {
  return find_in_table(name, args, cc, chosen);
}
Status find_instance(const std::string& name, const BwdArgs& args, int cc,
                     const BwdInstanceEntry** chosen) {
  return find_in_table(name, args, cc, chosen);
}
Status find_instance(const std::string& name, const KvcacheArgs& args, int cc,
                     const KvcacheInstanceEntry** chosen) {
  return find_in_table(name, args, cc, chosen);
}

std::string explain_selection(const FwdArgs& args, int cc) { return explain_in_table(args, cc); }
std::string explain_selection(const BwdArgs& args, int cc) { return explain_in_table(args, cc); }
std::string explain_selection(const KvcacheArgs& args, int cc) {
  return explain_in_table(args, cc);
}

InstanceInfo to_info(const FwdInstanceEntry& e) { return info_of<InstanceInfo>(e); }
BwdInstanceInfo to_info(const BwdInstanceEntry& e) { return info_of<BwdInstanceInfo>(e); }
KvcacheInstanceInfo to_info(const KvcacheInstanceEntry& e) {
  KvcacheInstanceInfo info = info_of<KvcacheInstanceInfo>(e);
  info.prefill = e.prefill;
  info.full_grid_block_n = e.full_grid_block_n;
  return info;
}

}  // namespace fmha::detail

namespace fmha {
namespace {
template <class Args>
InstanceRecipe recipe(const Args& args, int cc) {
  const detail::TargetInfo* target = detail::target_for(cc);
  return {detail::suggest(args, cc).filter, target != nullptr ? target->token : ""};
}
}  // namespace

InstanceRecipe instance_recipe(const FwdArgs& args, int cc) { return recipe(args, cc); }
InstanceRecipe instance_recipe(const BwdArgs& args, int cc) { return recipe(args, cc); }
InstanceRecipe instance_recipe(const KvcacheArgs& args, int cc) { return recipe(args, cc); }

}  // namespace fmha
