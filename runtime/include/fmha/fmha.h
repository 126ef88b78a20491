// Public C++ API of libfmha: fused multi-head attention, forward and backward, and KV-cache
// attention (decode).
//
// The library holds one kernel instance per row of the generated matrix (instances.yaml) and a
// dispatcher that picks the instance fitting a problem. Nothing here needs CUDA headers beyond
// the stream type, and nothing needs torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

struct CUstream_st;

// libfmha is built with hidden visibility; the public API is what this marks.
#define FMHA_API __attribute__((visibility("default")))

namespace fmha {

using Stream = CUstream_st*;  // a cudaStream_t; nullptr is the legacy default stream

// kE4M3 is float8 e4m3 (OCP, torch.float8_e4m3fn: no infinities, largest finite 448), a forward
// input type only (fa3, sm90a): Q, K and V are e4m3 with descale factors (FwdArgs::q_descale and
// the like) and O is bf16, or fp16 (FwdArgs::o_dtype). V is row-major (transposed in the
// kernel) in either mode, or V^T (VLayout::kColMajor) in batch mode only.
enum class DataType : int { kFP16 = 0, kBF16 = 1, kE4M3 = 2 };

// Which keys a query row sees. Query row i is aligned with key row i + offset, where the
// offset is 0 for MaskAlign::kTopLeft (torch SDPA's is_causal) and seqlen_k - seqlen_q for
// kBottomRight (FlashAttention-2's causal since 2.1); in group mode the lengths are the
// sequence's own.
//   kCausal: row i sees keys j <= i + offset.
//   kWindow: row i sees keys i + offset - window_left <= j <= i + offset + window_right; a
//            negative size leaves that side unbounded, so (-1, 0) is causal.
// A row that sees no key gets output 0 and log-sum-exp -inf.
enum class MaskType : int { kNone = 0, kCausal = 1, kWindow = 2 };
enum class MaskAlign : int { kTopLeft = 0, kBottomRight = 1 };

// kElementwise: an additive bias of the input dtype, broadcast to (batch, nhead_q, seqlen_q,
// seqlen_k) through its strides (a stride of 0 broadcasts). kAlibi: ALiBi, the logit of (i, j)
// gets -slope * |i + offset - j| (offset as for the mask), with fp32 slopes per head or per
// (batch, head).
enum class BiasType : int { kNone = 0, kElementwise = 1, kAlibi = 2 };

// V per (batch, head): kRowMajor is (seqlen_k, hdim_v) with hdim contiguous, like K;
// kColMajor is (hdim_v, seqlen_k) with seqlen contiguous (V^T stored). DataType::kE4M3 takes
// kColMajor in Mode::kBatch only: TMA copies its tiles with the keys innermost, and a packed
// sequence whose first key (cu_seqlens_k) is not a multiple of 16 cannot be copied (the copy
// traps); a row-major e4m3 V serves both modes.
enum class VLayout : int { kRowMajor = 0, kColMajor = 1 };

// kBatch: every sequence of the batch has seqlen_q / seqlen_k rows (fewer when seqused_*
// says so). kGroup (FlashAttention's varlen): sequences of different lengths packed along one
// token dimension, delimited by cu_seqlens_q / cu_seqlens_k.
enum class Mode : int { kBatch = 0, kGroup = 1 };

// The functional traits of a problem: an instance runs a problem only when all of them match
// (head dims may also be smaller than a head-dim-padded instance's, see InstanceInfo).
struct FwdTraits {
  DataType dtype = DataType::kFP16;
  int hdim_q = 0;
  int hdim_v = 0;
  MaskType mask = MaskType::kNone;
  BiasType bias = BiasType::kNone;
  VLayout vlayout = VLayout::kRowMajor;
  Mode mode = Mode::kBatch;
  bool lse = false;      // writes the log-sum-exp of every row
  bool dropout = false;  // dropout_p > 0
  bool softcap = false;  // softcap > 0
};

// One forward problem. Q, K, V and O are (batch, seqlen, nhead, hdim) in any stride order whose
// hdim dimension is contiguous (V: see VLayout); strides are in elements. Pointers must be
// 16-byte aligned and every stride of Q, K, V and O (other than the contiguous one) a multiple
// of 8 elements, so that each row moves in 16-byte pieces: of 16 elements for the e4m3 inputs
// of DataType::kE4M3 (Q, K, V), whose O is 16-bit (8). Offsets are 64-bit, so tensors may
// hold more than 2^31 elements; the limits are batch and nhead_q <= 65535, seqlen_q + seqlen_k
// < 2^30 (the kernels' row and key arithmetic), and for a causal mask at most 2^31 - 1 query
// tiles in all (ceil(seqlen_q / block_m) * batch * nhead_q).
struct FMHA_API FwdArgs {
  DataType dtype = DataType::kFP16;
  Mode mode = Mode::kBatch;

  const void* q = nullptr;  // (batch, seqlen_q, nhead_q, hdim_q)
  const void* k = nullptr;  // (batch, seqlen_k, nhead_k, hdim_q)
  const void* v = nullptr;  // (batch, seqlen_k, nhead_k, hdim_v), in vlayout
  void* o = nullptr;        // (batch, seqlen_q, nhead_q, hdim_v), in o_dtype
  // O's elements. Unset: dtype's for kFP16 and kBF16 (the only choice there), kBF16 for kE4M3,
  // which also takes kFP16: one e4m3 instance serves both (only its fp32 -> 16-bit rounding
  // differs).
  std::optional<DataType> o_dtype;

  int batch = 0;
  int seqlen_q = 0;  // group mode: the longest sequence's length (it sizes the grid)
  int seqlen_k = 0;
  int nhead_q = 0;
  int nhead_k = 0;  // nhead_q must be a multiple of it (MQA/GQA share K/V heads)
  int hdim_q = 0;
  int hdim_v = 0;

  // Group mode ignores the batch strides: a sequence's rows start at its cu_seqlens entry.
  int64_t q_batch_stride = 0, q_seq_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_seq_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_seq_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_seq_stride = 0, o_head_stride = 0;
  VLayout vlayout = VLayout::kRowMajor;
  int64_t v_dim_stride = 1;  // 1 for kRowMajor; for kColMajor v_seq_stride is 1 and this is not

  // Group mode: sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of Q and O (and
  // likewise of K and V); device int32 arrays of batch + 1 non-decreasing entries from 0.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  // Group mode: the rows of the packed Q/O and K/V tensors (at least cu_seqlens_*[batch]). The
  // sm90a pipeline's tensor maps bound every read and write by them.
  int64_t total_q = 0;
  int64_t total_k = 0;
  // Optional in both modes: sequence b uses only its first seqused_q[b] query rows and
  // seqused_k[b] keys (batch mode's effective lengths, or group mode's physical padding after
  // each sequence); device int32 arrays of batch entries. Output rows past seqused_q are left
  // untouched.
  const int32_t* seqused_q = nullptr;
  const int32_t* seqused_k = nullptr;

  float softmax_scale = 0.f;  // applied to QK^T; callers usually pass 1/sqrt(hdim_q)

  MaskType mask = MaskType::kNone;
  MaskAlign mask_align = MaskAlign::kTopLeft;
  int window_left = -1;  // kWindow only; negative: unbounded
  int window_right = -1;

  BiasType bias = BiasType::kNone;
  const void* bias_ptr = nullptr;  // kElementwise: dtype elements, the key dimension contiguous
  int64_t bias_batch_stride = 0, bias_head_stride = 0, bias_seq_stride = 0;  // group mode: per
                                                                             // sequence b
  const float* alibi_slopes = nullptr;  // kAlibi: slope of (b, h) at b * alibi_batch_stride + h
  int64_t alibi_batch_stride = 0;       // 0: one slope per head

  float softcap = 0.f;  // > 0: logits become softcap * tanh(logits / softcap)

  // Dropout on the attention probabilities: each is kept with probability 1 - dropout_p and
  // scaled by 1 / (1 - dropout_p). The pattern is a function of (seed, offset, batch, head,
  // row, key) only, so a call is reproducible; dropout_mask() writes it out.
  float dropout_p = 0.f;
  uint64_t dropout_seed = 0;
  uint32_t dropout_offset = 0;

  // Optional: the natural-log log-sum-exp of every row's (scaled, biased) logits, fp32;
  // (batch, nhead_q, seqlen_q) with the row dimension contiguous. In group mode row i of
  // sequence b is at lse[h * lse_head_stride + cu_seqlens_q[b] + i] (batch stride ignored).
  float* lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  // dtype kE4M3 only: what dequantizes Q, K and V (FlashAttention-3's q/k/v_descale), device
  // fp32. The factor of sequence b and K/V head g is at ptr[b * batch_stride + g * head_stride]
  // (query head h reads g = h / (nhead_q / nhead_k)); strides of 0 broadcast, so one factor per
  // tensor is a pointer with both strides 0. nullptr: 1. A logit is q * k * q_descale *
  // k_descale * softmax_scale, an output row sum(p * v) * v_descale / sum(p).
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int64_t q_descale_batch_stride = 0, q_descale_head_stride = 0;
  int64_t k_descale_batch_stride = 0, k_descale_head_stride = 0;
  int64_t v_descale_batch_stride = 0, v_descale_head_stride = 0;

  FwdTraits traits() const;
};

// The functional traits of a backward problem: the forward's, less the V layout (the backward
// takes row-major V) and the log-sum-exp (it always reads it), plus dbias.
struct BwdTraits {
  DataType dtype = DataType::kFP16;
  int hdim_q = 0;
  int hdim_v = 0;
  MaskType mask = MaskType::kNone;
  BiasType bias = BiasType::kNone;
  Mode mode = Mode::kBatch;
  bool dbias = false;    // writes the gradient of an elementwise bias
  bool dropout = false;  // dropout_p > 0
  bool softcap = false;  // softcap > 0
};

// One backward problem: the forward call it differentiates (`fwd`, with its o and lse, which
// the backward reads), the gradient of its output, and where the gradients go. dout, dq, dk and
// dv take the layouts of o, q, k and v (any strides with the head dim contiguous, multiples of
// 8 elements); fwd.vlayout must be kRowMajor and fwd.lse must be set. With MQA/GQA dk and dv
// are (batch, seqlen_k, nhead_k, hdim): the gradient summed over the query heads sharing a K/V
// head.
struct FMHA_API BwdArgs {
  FwdArgs fwd;

  const void* dout = nullptr;  // (batch, seqlen_q, nhead_q, hdim_v)
  void* dq = nullptr;          // (batch, seqlen_q, nhead_q, hdim_q)
  void* dk = nullptr;          // (batch, seqlen_k, nhead_k, hdim_q)
  void* dv = nullptr;          // (batch, seqlen_k, nhead_k, hdim_v)
  int64_t dout_batch_stride = 0, dout_seq_stride = 0, dout_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_seq_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_seq_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_seq_stride = 0, dv_head_stride = 0;

  // Elementwise bias only, optional: the gradient of the bias, of the input dtype, written as a
  // full (batch, nhead_q, seqlen_q, seqlen_k) tensor (group mode: per sequence b, as the bias is
  // read), the key dimension contiguous. A caller whose bias broadcasts sums it over those
  // dimensions. Set, it needs an instance with dbias.
  void* dbias = nullptr;
  int64_t dbias_batch_stride = 0, dbias_head_stride = 0, dbias_seq_stride = 0;

  // true: gradients bitwise identical from run to run (dQ is summed in a fixed order), at a
  // cost bwd_workspace_size() and docs/performance.md quantify.
  bool deterministic = false;

  // Scratch of bwd_workspace_size() bytes, 256-byte aligned, for the instance bwd() runs (fp32
  // dQ accumulators and dO.O row sums); its contents need not be initialized.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  BwdTraits traits() const;
};

// What a KV cache holds. kSame: elements of the queries' dtype. kE4M3: float8 e4m3 (torch's
// float8_e4m3fn: no infinities, largest finite 448), a key element being k_cache[..] * k_scale
// and a value element v_cache[..] * v_scale (KvcacheArgs): half the bytes a decode step reads.
enum class KvCacheDtype : int { kSame = 0, kE4M3 = 1 };

// The functional traits of a KV-cache attention problem (fwd_kvcache): decode and chunked
// prefill, a few new query tokens against the keys a cache holds.
struct KvcacheTraits {
  DataType dtype = DataType::kFP16;  // q's, k_new's, v_new's and the output's
  KvCacheDtype kv_dtype = KvCacheDtype::kSame;
  int hdim_q = 0;
  int hdim_v = 0;
  MaskType mask = MaskType::kNone;  // always aligned bottom-right: the new tokens are the last
  BiasType bias = BiasType::kNone;  // kNone or kAlibi
  bool paged = false;               // the cache is in pages reached through a block table
  bool softcap = false;             // softcap > 0
};

// One KV-cache attention problem, with FlashAttention's flash_attn_with_kvcache conventions.
// Sequence b attends with its seqlen_q query rows to the first cache_seqlens[b] + seqlen_new
// keys of its cache: the cached ones, then the new k/v (when given), which are first written
// into the cache in place at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1.
// The lengths live on the device, so one captured CUDA graph replays with new lengths.
// Layouts are (.., seqlen, nhead, hdim) with the head dim contiguous, strides in elements,
// multiples of 8, pointers 16-byte aligned, as for FwdArgs. The head dims may be any up to 256
// (head-dim-padded instances run those below their own, reading and writing nothing past a
// row's head dim), so a head dim that is no multiple of 8 needs rows of a larger pitch.
struct FMHA_API KvcacheArgs {
  DataType dtype = DataType::kFP16;  // q's, k_new's, v_new's and o's
  // The caches' elements. kE4M3: strides and page pitches stay in elements (bytes), multiples
  // of 16 so that rows move in 16-byte pieces; k_new/v_new (in dtype) are divided by the
  // scales, saturated to +-448 and rounded to nearest even as they are appended.
  KvCacheDtype kv_dtype = KvCacheDtype::kSame;
  // kE4M3 only (null otherwise): device fp32 dequantization factors, element (b, h) at
  // scale[b * batch_stride + h * head_stride] for sequence b and K/V head h; zero strides
  // broadcast, so (0, 0) is one scale for the tensor, (0, 1) one per head and (nhead_k, 1) one
  // per sequence and head (FlashAttention-3's k_descale/v_descale).
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t k_scale_batch_stride = 0, k_scale_head_stride = 0;
  int64_t v_scale_batch_stride = 0, v_scale_head_stride = 0;

  const void* q = nullptr;  // (batch, seqlen_q, nhead_q, hdim_q)
  // Contiguous: (batch_cache, seqlen_cache, nhead_k, hdim); sequence b uses cache row
  // cache_batch_idx[b] (b without it). Paged: (num_pages, page_size, nhead_k, hdim), and the
  // batch strides below step from page to page.
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const void* k_new = nullptr;  // optional (batch, seqlen_new, nhead_k, hdim_q)
  const void* v_new = nullptr;  // with k_new (batch, seqlen_new, nhead_k, hdim_v)
  void* o = nullptr;            // (batch, seqlen_q, nhead_q, hdim_v)
  float* lse = nullptr;         // optional, fp32 (batch, nhead_q, seqlen_q), rows contiguous

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_new = 0;    // rows of k_new/v_new; 0 without them
  int seqlen_cache = 0;  // keys a sequence can hold: contiguous, the cache's seqlen; paged,
                         // block_table's columns * page_size
  int batch_cache = 0;   // contiguous: the cache's batch dimension; paged: num_pages
  int nhead_q = 0;
  int nhead_k = 0;  // nhead_q must be a multiple of it (MQA/GQA)
  int hdim_q = 0;
  int hdim_v = 0;

  int64_t q_batch_stride = 0, q_seq_stride = 0, q_head_stride = 0;
  int64_t k_cache_batch_stride = 0, k_cache_seq_stride = 0, k_cache_head_stride = 0;
  int64_t v_cache_batch_stride = 0, v_cache_seq_stride = 0, v_cache_head_stride = 0;
  int64_t k_new_batch_stride = 0, k_new_seq_stride = 0, k_new_head_stride = 0;
  int64_t v_new_batch_stride = 0, v_new_seq_stride = 0, v_new_head_stride = 0;
  int64_t o_batch_stride = 0, o_seq_stride = 0, o_head_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  // Device int32 (batch): the keys in sequence b's cache before k_new is appended.
  const int32_t* cache_seqlens = nullptr;
  // Contiguous only, optional: device int32 (batch), the cache row of sequence b.
  const int32_t* cache_batch_idx = nullptr;
  // Contiguous only, optional: device int32 (batch), where sequence b's keys start in its cache
  // row (FlashAttention's cache_leftpad: a left-padded batch). Sequence b attends to keys
  // [cache_leftpad[b], cache_seqlens[b] + seqlen_new); masks align with its last key as
  // without it, and rotary positions stay the cache's row indices. Decode pipeline only: a
  // call with it never runs a prefill instance.
  const int32_t* cache_leftpad = nullptr;
  // Paged only: device int32 (batch, pages_per_seq), the page holding a sequence's keys
  // [p * page_size, (p + 1) * page_size); any page size >= 1 (vLLM uses 16).
  const int32_t* block_table = nullptr;
  int64_t block_table_batch_stride = 0;
  int page_size = 0;  // paged only (seqlen_cache is a multiple of it); 0 for a contiguous cache

  // Optional rotary embedding of q and k_new (needs k_new): cos and sin of the input dtype,
  // (seqlen_rotary, rotary_dim / 2) with rows contiguous. Token i of sequence b is rotated by
  // row cache_seqlens[b] + i; with no mask, every query token by row cache_seqlens[b]
  // (FlashAttention's convention). A query token past the cache's end (cache_seqlens[b] + i >=
  // seqlen_cache, which only the device knows) takes the table's last row. Interleaved rotates pairs (2j, 2j + 1) (GPT-J), else pairs (j, j + rotary_dim /
  // 2) (GPT-NeoX); dims past rotary_dim pass through.
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int rotary_dim = 0;     // 0: no rotary; else even, at most hdim_q
  int seqlen_rotary = 0;  // at least seqlen_cache: a row per position a key can take
  bool rotary_interleaved = false;

  float softmax_scale = 0.f;
  MaskType mask = MaskType::kNone;  // bottom-right aligned: query i sits at key
                                    // cache_seqlens[b] + seqlen_new - seqlen_q + i
  int window_left = -1;             // kWindow only (-1 with the other masks); -1: unbounded
  int window_right = -1;
  BiasType bias = BiasType::kNone;  // kAlibi only
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  float softcap = 0.f;

  // Key splits per (sequence, K/V head), each a CTA whose partial results a second kernel
  // combines by their log-sum-exp; 0 picks them from batch, heads, seqlen_cache and the SM
  // count. Fixed by the shapes, so a captured graph keeps its launch.
  int num_splits = 0;

  // Scratch of kvcache_workspace_size() bytes, 256-byte aligned (partial outputs of the
  // splits, the rotated q); its contents need not be initialized.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  KvcacheTraits traits() const;
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
  int arch_cc = 0;   // its compute capability as major*10+minor, e.g. 90
  bool arch_exact = false;  // runs only on exactly arch_cc (sm90a); else on arch_cc and newer
  int block_m = 0;
  int block_n = 0;
  bool pad_seqlen = false;  // handles sequence lengths that are not multiples of the tile
  bool pad_hdim = false;    // also runs head dims below its own that are multiples of 8
  std::string origin;       // "" when compiled into this library, else the shared object
                            // load_instances loaded it from
};

// A compiled backward instance (one row of the generator's bwd matrix).
struct BwdInstanceInfo {
  std::string name;
  BwdTraits traits;
  std::string pipeline;
  std::string arch;
  int arch_cc = 0;
  bool arch_exact = false;
  int block_m = 0;  // query rows per step of the inner loop
  int block_n = 0;  // keys per CTA (K, V, dK and dV stay on chip)
  bool pad_seqlen = false;
  bool pad_hdim = false;
  std::string origin;  // as InstanceInfo's
};

// Compile on demand. When no instance of the library (or loaded into it) runs a call of fwd(),
// bwd() or fwd_kvcache(), or the workspace query of bwd() or fwd_kvcache(), the call compiles
// the instances that run it and loads them (load_instances), then dispatches again: the first
// call of a missing instance takes the compile (about 5 s for an fa2 instance, 25-60 s for an
// fa3 one; stderr says what it compiles), later ones and other processes find it in the cache
// (FMHA_CACHE_DIR, default ~/.cache/fmha). The compiling is the Python package's: fmha/jit.py
// beside libfmha, run with FMHA_PYTHON (or the Python the build was configured with), with the
// generator, templates and compiler the build used; a library built without the package
// (FMHA_BUILD_PYTHON off) does not compile. FMHA_JIT=0 turns it off. A call whose stream is
// capturing a CUDA graph does not compile: its miss says so. A miss that cannot compile (no
// CUDA compiler, nothing in the matrix runs the call) is the plain kNoInstance; one whose
// compile failed carries the compiler's message. The calls that name an instance never compile.

// Runs the forward pass on `stream`. Checks the arguments and picks an instance first; on any
// error nothing is launched. On success `chosen`, when given, receives the instance's name.
FMHA_API Status fwd(const FwdArgs& args, Stream stream, std::string* chosen = nullptr);

// As fwd(), but runs the compiled instance called `instance` instead of the dispatcher's
// choice; fails (nothing launched) when that instance does not fit the problem or the device.
// For tests and benchmarks that must cover every instance on one GPU.
FMHA_API Status fwd_instance(const std::string& instance, const FwdArgs& args, Stream stream);

// The instance fwd() would run for `args` on the current device, without launching; on a miss
// the status names the traits asked for and the generator filter that would build one.
// Pointers are not read (they may be null).
FMHA_API Status select(const FwdArgs& args, InstanceInfo* chosen);

// Why select() chooses what it chooses, in words: the instance and the rule that ranked it
// first, or the nearest compiled instances and the generator filter that would build one.
FMHA_API Status explain(const FwdArgs& args, std::string* explanation);

// select() and explain() (of every operation) for a GPU of compute capability `cc`, major * 10
// + minor (80 for an A100, 90 for an H100 or H200), instead of the current device. The choice
// depends only on the problem and the target, so these make no CUDA call and need no GPU: a
// build's coverage, or the filter that builds a missing instance, can be asked on any machine.
// cc 0 asks for the current device, as the overloads without it do.
FMHA_API Status select(const FwdArgs& args, int cc, InstanceInfo* chosen);
FMHA_API Status explain(const FwdArgs& args, int cc, std::string* explanation);

// Writes the dropout keep pattern fwd() applies for (seed, offset, p): keep[b][h][i][j] is 1
// where the probability of query row i and key j of head h of sequence b is kept, else 0;
// uint8, contiguous (batch, nhead, seqlen_q, seqlen_k). For tests and for reproducing a run.
FMHA_API Status dropout_mask(uint64_t seed, uint32_t offset, float dropout_p, int batch,
                             int nhead, int seqlen_q, int seqlen_k, uint8_t* keep, Stream stream);

// The backward pass on `stream`: dq, dk, dv (and dbias) of the forward call args.fwd describes.
// Checks the arguments (the workspace's size included) and picks an instance first; on any
// error nothing is launched. dq, dk and dv are overwritten, never accumulated into: every row of
// dq, and every key a sequence owns in dk and dv (zeros where no query sees it, past seqused_k
// too); in group mode, rows past cu_seqlens_k[batch] belong to no sequence and are left alone.
// dbias is written where the mask lets a query see a key; the rest is left alone.
FMHA_API Status bwd(const BwdArgs& args, Stream stream, std::string* chosen = nullptr);

// As bwd(), with the compiled backward instance called `instance`.
FMHA_API Status bwd_instance(const std::string& instance, const BwdArgs& args, Stream stream);

// The workspace bwd() needs for `args` on the current device (pointers are not read).
// `stream`: the one bwd() will run on, which a miss's compile on demand checks is not capturing.
FMHA_API Status bwd_workspace_size(const BwdArgs& args, size_t* bytes, Stream stream = nullptr);

// The workspace bwd_instance() needs: an instance of larger head dims than the dispatcher's
// choice sizes its dQ accumulator by its own.
FMHA_API Status bwd_workspace_size(const std::string& instance, const BwdArgs& args,
                                   size_t* bytes);

// select() and explain() of the backward.
FMHA_API Status select(const BwdArgs& args, BwdInstanceInfo* chosen);
FMHA_API Status explain(const BwdArgs& args, std::string* explanation);
FMHA_API Status select(const BwdArgs& args, int cc, BwdInstanceInfo* chosen);
FMHA_API Status explain(const BwdArgs& args, int cc, std::string* explanation);

// Every compiled backward instance, in the dispatcher's order of preference.
FMHA_API std::vector<BwdInstanceInfo> bwd_instances();

// Every instance compiled into this library or loaded (load_instances), in the dispatcher's
// order of preference.
FMHA_API std::vector<InstanceInfo> instances();

// What builds instances for a problem: the generator --filter that selects the instances able
// to run `args` (with the `all` preset), and the target (e.g. "sm90a") whose code runs on a
// device of compute capability `cc`, empty when no target does. A miss message suggests it;
// compile on demand (above) builds it.
struct InstanceRecipe {
  std::string filter;
  std::string target;
};
FMHA_API InstanceRecipe instance_recipe(const FwdArgs& args, int cc);
FMHA_API InstanceRecipe instance_recipe(const BwdArgs& args, int cc);
FMHA_API InstanceRecipe instance_recipe(const KvcacheArgs& args, int cc);

// Loads a shared object of instances compiled on demand (fmha/jit.py makes them) and adds its
// instances to the dispatcher, each at the place the generator's order of preference gives
// it: where a build with every instance would have put it, so it never shadows a better
// compiled-in instance. The object stays loaded for the life of the process;
// loading it again adds nothing. *added, if given, gets how many instances were new.
// kInvalidArgument when the file cannot be loaded or was compiled against another layout of
// the instance tables; the message says which.
FMHA_API Status load_instances(const std::string& path, int* added = nullptr);

// The GPU architectures this library holds machine code for, e.g. {"sm80", "sm90a"}.
FMHA_API std::vector<std::string> compiled_targets();

// A compiled KV-cache instance.
struct KvcacheInstanceInfo {
  std::string name;
  KvcacheTraits traits;
  std::string pipeline;
  std::string arch;
  int arch_cc = 0;
  bool arch_exact = false;
  int block_m = 0;  // decode: query rows (query tokens x the query heads of one K/V head) per
                    // CTA; prefill: query tokens per CTA (a call has as many, or 256 rows)
  int block_n = 0;  // keys per step
  bool pad_seqlen = false;
  bool pad_hdim = false;  // also runs every head dim below its own, multiple of 8 or not
  bool prefill = false;  // a tile for many query tokens (fa3 on sm90a): chunked prefill
  int full_grid_block_n = 0;  // the keys per step of the calls whose sequences x K/V heads
                              // fill every SM, where they run another tile; 0: block_n
  std::string origin;         // as InstanceInfo's
};

// KV-cache attention on `stream`: appends k_new/v_new (rotated, when asked) to the cache, then
// attends. Checks the arguments (the workspace's size included) and picks an instance first;
// on any error nothing is launched and nothing is written.
FMHA_API Status fwd_kvcache(const KvcacheArgs& args, Stream stream, std::string* chosen = nullptr);
FMHA_API Status fwd_kvcache_instance(const std::string& instance, const KvcacheArgs& args,
                                     Stream stream);
// The workspace fwd_kvcache() needs for `args` on the current device (pointers are not read);
// `stream` as bwd_workspace_size()'s.
FMHA_API Status kvcache_workspace_size(const KvcacheArgs& args, size_t* bytes,
                                       Stream stream = nullptr);
// The workspace fwd_kvcache_instance() needs: instances of other pipelines need other scratch
// (the decode kernel's split partials, the prefill kernel's none but the rotated q).
FMHA_API Status kvcache_workspace_size(const std::string& instance, const KvcacheArgs& args,
                                       size_t* bytes);
FMHA_API Status select(const KvcacheArgs& args, KvcacheInstanceInfo* chosen);
FMHA_API Status explain(const KvcacheArgs& args, std::string* explanation);
FMHA_API Status select(const KvcacheArgs& args, int cc, KvcacheInstanceInfo* chosen);
FMHA_API Status explain(const KvcacheArgs& args, int cc, std::string* explanation);
FMHA_API std::vector<KvcacheInstanceInfo> kvcache_instances();

FMHA_API const char* to_string(DataType);
FMHA_API const char* to_string(KvCacheDtype);
FMHA_API const char* to_string(MaskType);
FMHA_API const char* to_string(BiasType);
FMHA_API const char* to_string(VLayout);
FMHA_API const char* to_string(Mode);

}  // namespace fmha
