// The table of compiled instances, as the generator renders it (build/gen/dispatch_table.cpp).
//
// Internal to libfmha: the dispatcher (runtime/src/dispatcher.cpp) reads it, the generated
// dispatch table defines it (one table per operation: fwd, bwd, kvcache), and each generated
// instance TU defines its entry's functions. This header includes only declarations, so the
// dispatch TU stays a light host-compiler TU.
#pragma once

#include <cuda_runtime_api.h>

#include "fmha/fmha.h"

namespace fmha::detail {

// Launches one forward instance's kernel; arguments were checked and the instance selected before.
using FwdLaunchFn = cudaError_t (*)(const FwdArgs& args, cudaStream_t stream);

struct FwdInstanceEntry {
  const char* name;
  FwdTraits traits;
  const char* pipeline;
  const char* arch;  // generator token, e.g. "sm90a"
  int arch_cc;       // compute capability as major*10+minor, e.g. 90
  bool arch_exact;   // an 'a' target (sm90a) runs only on that exact compute capability
  int block_m;       // query rows per CTA
  int block_n;       // key rows per main-loop step
  bool pad_seqlen;   // false: needs seqlen_q % block_m == 0 and seqlen_k % block_n == 0
  bool pad_hdim;     // true: also runs hdim_q <= traits.hdim_q and hdim_v <= traits.hdim_v
                     // in steps of kFwdPaddedHeadDimStep; false: exactly the traits' head dims
  FwdLaunchFn launch;
};

// The forward instances, sorted by the generator in the order of preference: the dispatcher
// runs the first entry whose traits match and whose constraints hold. kNumFwdInstances rows (a
// pointer, as a selection may have none, e.g. --filter bwd).
extern const FwdInstanceEntry* const kFwdInstances;
extern const int kNumFwdInstances;

// The head dims an operation's pad_hdim entries run come in steps of this (generator/
// operations.py's Operation.padded_hdim_step): 8 for the forward and the backward, whose
// kernels move rows in whole 16-byte pieces, 1 for KV-cache attention, whose decode kernel
// takes a partial last piece; 0 for an operation whose kernels take exact head dims only.
extern const int kFwdPaddedHeadDimStep;
extern const int kBwdPaddedHeadDimStep;
extern const int kKvcachePaddedHeadDimStep;

// The head dims (hdim_q, hdim_v) each operation's whole matrix has (instances.yaml, every
// preset's, compiled here or not), smallest first: a miss suggests building these, and compile
// on demand builds them, rather than the padded head dims of an instance compiled here.
struct MatrixHeadDims {
  int hdim_q;
  int hdim_v;
};
extern const MatrixHeadDims* const kFwdMatrixHeadDims;
extern const int kNumFwdMatrixHeadDims;
extern const MatrixHeadDims* const kBwdMatrixHeadDims;
extern const int kNumBwdMatrixHeadDims;
extern const MatrixHeadDims* const kKvcacheMatrixHeadDims;
extern const int kNumKvcacheMatrixHeadDims;

// Targets this build compiled machine code for (generator tokens, e.g. "sm80").
extern const char* const kCompiledTargets[];
extern const int kNumCompiledTargets;

// Every target the generator knows (compiled here or not), best first for a device that could
// run several, e.g. sm90a before sm80 on an H100.
struct TargetInfo {
  const char* token;
  int cc;
  bool exact;
};
extern const TargetInfo kKnownTargets[];
extern const int kNumKnownTargets;

// The generator's filter token for each enum value, indexed by the enum's integer value, so a
// miss can name the --filter that would build the missing instance.
extern const char* const kDataTypeTokens[];
extern const char* const kKvCacheDtypeTokens[];
extern const char* const kMaskTokens[];
extern const char* const kBiasTokens[];
extern const char* const kVLayoutTokens[];
extern const char* const kModeTokens[];

// The pipelines the generator knows (generator tokens, e.g. "fa3"), newest first: where two
// instances for the same architecture both run a problem, the newer pipeline's comes first.
extern const char* const kPipelineTokens[];
extern const int kNumPipelines;

// The backward instances, as the generator renders them from the bwd operation's matrix. An
// instance is the set of kernels its algorithm needs (for fa2: dO.O row sums, the main
// dQ/dK/dV kernel, the fp32 dQ conversion); `launch` runs them in order on the stream and
// `workspace` sizes the scratch they share.
using BwdLaunchFn = cudaError_t (*)(const BwdArgs& args, cudaStream_t stream);
using BwdWorkspaceFn = size_t (*)(const BwdArgs& args);

struct BwdInstanceEntry {
  const char* name;
  BwdTraits traits;
  const char* pipeline;
  const char* arch;
  int arch_cc;
  bool arch_exact;
  int block_m;      // query rows per step of the inner loop
  int block_n;      // keys per CTA
  bool pad_seqlen;  // as FwdInstanceEntry's
  bool pad_hdim;
  BwdLaunchFn launch;
  BwdWorkspaceFn workspace;
};

// kNumBwdInstances rows (a pointer, as a selection may have none).
extern const BwdInstanceEntry* const kBwdInstances;
extern const int kNumBwdInstances;

// A rule of instances.yaml that leaves `pipeline` without instances on `arch` for the traits
// it matches (generator/gaps.py). When an older pipeline runs such a problem on that arch,
// explain says so and quotes the reason.
struct FwdPipelineGap {
  const char* pipeline;
  const char* arch;
  const char* traits;  // the traits the rule names, comma-separated, e.g. "bias" or "mask,mode"
  const char* reason;
  bool (*matches)(const FwdTraits& traits);
};
// kNumFwdPipelineGaps rows (a pointer, as there may be none).
extern const FwdPipelineGap* const kFwdPipelineGaps;
extern const int kNumFwdPipelineGaps;

// As FwdPipelineGap, for the backward's traits: the rules of the bwd operation that leave a
// pipeline without instances.
struct BwdPipelineGap {
  const char* pipeline;
  const char* arch;
  const char* traits;
  const char* reason;
  bool (*matches)(const BwdTraits& traits);
};
extern const BwdPipelineGap* const kBwdPipelineGaps;
extern const int kNumBwdPipelineGaps;

// The KV-cache instances, as the generator renders them from the kvcache operation's matrix.
// `launch` runs an instance's kernels in order on the stream (appending k_new/v_new to the
// cache, attention per key split, the combination of the splits) and `workspace` sizes the
// scratch they share on the current device.
using KvcacheLaunchFn = cudaError_t (*)(const KvcacheArgs& args, cudaStream_t stream);
using KvcacheWorkspaceFn = size_t (*)(const KvcacheArgs& args);

struct KvcacheInstanceEntry {
  const char* name;
  KvcacheTraits traits;
  const char* pipeline;
  const char* arch;
  int arch_cc;
  bool arch_exact;
  int block_m;      // query rows per CTA: the query tokens times the query heads of a K/V head
  int block_n;      // keys per step of the loop over the cache
  bool pad_seqlen;  // as FwdInstanceEntry's; true for every kvcache instance (the cache lengths
                    // live on the device)
  bool pad_hdim;
  bool prefill;  // a tile for many query tokens (fa3): it runs the calls kPrefill* below allow;
                 // the decode kernel the others
  int full_grid_block_n;  // keys per step of the tile that runs the calls whose units
                          // (sequence, K/V head, row block) alone fill every SM (instances.yaml's
                          // full_grid); 0: block_n's tile runs every call
  KvcacheLaunchFn launch;
  KvcacheWorkspaceFn workspace;
};

// kNumKvcacheInstances rows (a pointer, as a selection may have none).
extern const KvcacheInstanceEntry* const kKvcacheInstances;
extern const int kNumKvcacheInstances;

// A prefill instance's calls, as generator/operations.py states them (with the measurements
// behind them): at least block_m query tokens or kPrefillMinPackedRows packed rows (query
// tokens x query heads per K/V head), on pages of a multiple of kPrefillPageMultiple keys.
extern const int kPrefillMinPackedRows;
extern const int kPrefillPageMultiple;

// As FwdPipelineGap, for KV-cache attention's traits.
struct KvcachePipelineGap {
  const char* pipeline;
  const char* arch;
  const char* traits;
  const char* reason;
  bool (*matches)(const KvcacheTraits& traits);
};
extern const KvcachePipelineGap* const kKvcachePipelineGaps;
extern const int kNumKvcachePipelineGaps;

// What a shared object of instances compiled on demand holds (fmha::load_instances): its
// entries per operation, returned by the function it exports as kLoadableSymbol. `abi` is the
// kRegistryAbi it was compiled against: the entries' layout above, which a library of another
// layout must not read. Raise kRegistryAbi with any change to the layout of the entry structs
// or of the argument structs of fmha/fmha.h that the launch functions take. Their names are
// not part of it: a loaded object shares with libfmha only kLoadableSymbol (extern "C") and
// these layouts, its kernels and launchers being its own, so renaming a struct or a kernel's
// namespace leaves objects compiled before it loadable.
// 2: KvcacheTraits::kv_dtype and KvcacheArgs' kv_dtype, k_scale/v_scale and their strides.
inline constexpr int kRegistryAbi = 2;
inline constexpr const char* kLoadableSymbol = "fmha_loadable_instances";

struct LoadableInstances {
  int abi;
  const FwdInstanceEntry* fwd;
  int num_fwd;
  const BwdInstanceEntry* bwd;
  int num_bwd;
  const KvcacheInstanceEntry* kvcache;
  int num_kvcache;
};
using LoadableFn = const LoadableInstances* (*)();

}  // namespace fmha::detail
