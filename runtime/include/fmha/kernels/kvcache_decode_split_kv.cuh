// KV-cache attention's decode kernel: split-KV (Flash-Decoding), paged or contiguous, on
// mma.sync, for sm80-class GPUs and built natively for sm90a (the kvcache operation's "fa2"
// pipeline, generator/operations.py). Decode reads every cached key once per step and does
// little arithmetic on it, so the kernel is built for memory bandwidth: enough bytes in flight
// on every SM.
//
// Up to three kernels on one stream:
//   append (when k_new is given): kvcache_append.cuh's, k_new/v_new into the cache at
//     cache_seqlens[b], rotating k (and q, into the workspace) when rotary tables are given;
//   attention: one CTA per (16 packed query rows, K/V head, sequence, key split). The packed
//     rows are the query tokens times the query heads sharing one K/V head (GQA), so every
//     K/V byte is read once per step however many query heads use it. Each of the 4 warps
//     takes its own 16-key slice of every key tile, runs its own online softmax on it, and the
//     warps merge their (max, sum, O) at the end; K and V stream through a cp.async ring,
//     page by page through the block table when the cache is paged;
//   combine (when there are several splits): the splits' partial outputs weighted by their
//     log-sum-exp.
// On sm90 each is a programmatic dependent of the kernel before it (dependent_launch.cuh): it
// waits for that kernel before its first read, and lets the next one launch as it starts.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "fmha/fmha.h"
#include "fmha/kernels/dependent_launch.cuh"
#include "fmha/kernels/device_facts.cuh"
#include "fmha/kernels/e4m3_cache.cuh"
#include "fmha/kernels/fast_divisor.cuh"
#include "fmha/kernels/kvcache_append.cuh"
#include "fmha/kernels/mask.cuh"
#include "fmha/kernels/sm80_primitives.cuh"
#include "fmha/kernels/smem_tile.cuh"

namespace fmha::kvcache::decode {

template <typename Element_, typename KvElement_, int kHeadDimQK_, int kHeadDimV_, int kBlockM_,
          int kBlockN_, int kNumWarps_, int kStages_, MaskType kMask_, BiasType kBias_,
          bool kPaged_, bool kSoftcap_, bool kPadSeqlen_, bool kPadHdim_, int kSmemLimit>
struct Config {
  using Element = Element_;      // q's, k_new's, v_new's and the output's
  using KvElement = KvElement_;  // the caches': Element, or __nv_fp8_e4m3
  // An e4m3 cache: its tiles are widened to fp16 in registers (e4m3_cache.cuh), and the
  // products run in fp16 whatever Element is (bf16 queries are converted once per CTA).
  static constexpr bool kE4m3Cache = std::is_same_v<KvElement, __nv_fp8_e4m3>;
  using MmaElement = std::conditional_t<kE4m3Cache, __half, Element>;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNumWarps = kNumWarps_;
  static constexpr int kStages = kStages_;
  static constexpr MaskType kMask = kMask_;
  static constexpr BiasType kBias = kBias_;
  static constexpr bool kPaged = kPaged_;
  static constexpr bool kSoftcap = kSoftcap_;
  // The call's head dims may be below the tile's (KvcacheParams::hdim_qk/hdim_v): the last
  // 16-byte piece of a row may be partial, and the pieces past the head dim are zero-filled.
  static constexpr bool kPadHdim = kPadHdim_;

  static constexpr int kThreads = kNumWarps * 32;
  static constexpr int kWarpKeys = kBlockN / kNumWarps;  // each warp's slice of a key tile
  // Soft-cap and ALiBi act on scaled logits; otherwise the scale folds into exp2's argument.
  static constexpr bool kLogitsInScores = kSoftcap || kBias == BiasType::kAlibi;
  // Up to d128 a warp keeps Q's fragments (32 registers); at d256 they would join 128 of O's
  // accumulators, so Q is re-read from shared memory each step.
  static constexpr bool kQInRegisters = kHeadDimQK <= 128;

  static_assert(sizeof(Element) == 2, "decode takes 16-bit inputs");
  static_assert(kE4m3Cache || std::is_same_v<KvElement, Element>,
                "a cache holds the queries' dtype or e4m3");
  static_assert(!(kE4m3Cache && kPadHdim_),
                "an e4m3 cache moves rows in whole 16-byte pieces: exact head dims only");
  static_assert(kBlockM == 16, "kvcache: the packed query rows are one m16 fragment");
  static_assert(kWarpKeys % 16 == 0 && kWarpKeys * kNumWarps == kBlockN,
                "kvcache: each warp takes a multiple of 16 keys of every key tile");
  static_assert(kStages >= 2, "kvcache: the K/V ring loads one tile while another is read");
  static_assert(kBias != BiasType::kElementwise, "kvcache: no bias tensor, ALiBi only");
  static_assert(kPadSeqlen_, "kvcache: the lengths live on the device");

  using QTile = SmemTile<kBlockM, kHeadDimQK>;
  // Cache tiles in 16-bit columns: an e4m3 row of d elements is d / 2 of them.
  static constexpr int kCacheElementsPer16Bit = 2 / sizeof(KvElement);
  using KTile = SmemTile<kBlockN, kHeadDimQK / kCacheElementsPer16Bit>;
  using VTile = SmemTile<kBlockN, kHeadDimV / kCacheElementsPer16Bit>;
  static constexpr int kPieceElements = 16 / sizeof(KvElement);  // a cache row's 16 bytes
  static constexpr int kRingBytes = kStages * (KTile::kBytes + VTile::kBytes);
  // Paged: the block-table entries of kPageSlots key tiles (PageSlots below), after the ring.
  static constexpr int kPageSlots = kStages + 1;
  static constexpr int kPageSlotBytes = kPaged ? kPageSlots * kBlockN * 4 : 0;
  static constexpr int kSmemBytes = QTile::kBytes + kRingBytes + kPageSlotBytes;
  static_assert(kSmemBytes <= kSmemLimit, "the tile does not fit the target's shared memory");
  // The warps' merge reuses the ring: each warp's fp32 O (rows padded by 4 words) and the
  // running max and sum of its 16 rows.
  static constexpr int kMergeBytes =
      (kNumWarps * kBlockM * (kHeadDimV + 4) + 2 * kNumWarps * kBlockM) * 4;
  // ...or, of an e4m3 cache, whose ring is half as large, the Q tile and the ring (sm80's two
  // d256 stages: 64 KB).
  static constexpr int kMergeOffset = kE4m3Cache ? 0 : QTile::kBytes;
  static_assert(kMergeBytes <= QTile::kBytes + kRingBytes - kMergeOffset,
                "the warps' merge must fit the K/V ring");
  // As many CTAs an SM as its shared memory holds (2 at d128 on sm90a, 4 at d64), which caps
  // the registers: decode streams keys, and bytes in flight scale with CTAs. An e4m3 cache
  // counts the 16-bit ring it widens into registers: its half-size ring would cap d128 at 128
  // registers a thread, where O, Q's fragments and the widened pairs need more.
  static constexpr int kRingBytesAs16Bit = kRingBytes * kCacheElementsPer16Bit;
  static constexpr int kMinCtasPerSm =
      std::min(kSmemLimit / (QTile::kBytes + kRingBytesAs16Bit + kPageSlotBytes + 1024),
               65536 / (kThreads * 64));
};

// The keys sequence `batch` attends to: its cache plus the appended tokens, clamped to what the
// cache holds (past that nothing was written, so nothing is read).
__device__ __forceinline__ int attended_keys(const KvcacheParams& p, int batch) {
  return min(p.cache_seqlens[batch] + p.seqlen_new, p.seqlen_cache);
}

// ---- a row's 16-byte pieces (kvcache_append.cuh), as the attention moves them -------------

// The bytes of piece `chunk` a cp.async copies (it zero-fills the rest of the 16): always 16
// in an exact instance, whose code is what it was before padding. kPartialPieces: the
// head dim may end inside a piece. Without it a copy moves 0 or 16 bytes, which is one
// predicate; a source size known only at run time also costs an address adjustment and a
// predicate of its own a copy (ptxas's general zero-fill: the padded d128 kernel's step took
// 540 instructions against 430, perf notes v20).
template <class Cfg, bool kPartialPieces = true>
__device__ __forceinline__ int piece_bytes(int chunk, int dim) {
  if constexpr (!Cfg::kPadHdim) {
    return 16;
  } else if constexpr (kPartialPieces) {
    return piece_elements(chunk, dim) * 2;
  } else {
    return chunk * 8 < dim ? 16 : 0;
  }
}

// Output columns d..d+3 of a row: 8 bytes at once, or with Cfg::kPadHdim those below the call's
// head dim `dim` one by one.
template <class Cfg>
__device__ __forceinline__ void store_quad(typename Cfg::Element* row, int d, const float4& x,
                                           int dim) {
  using Element = typename Cfg::Element;
  if (!Cfg::kPadHdim || d + 4 <= dim) {
    *reinterpret_cast<uint2*>(row + d) =
        make_uint2(sm80::pack2<Element>(x.x, x.y), sm80::pack2<Element>(x.z, x.w));
  } else {
    const float v[4] = {x.x, x.y, x.z, x.w};
    for (int e = 0; e < 4 && d + e < dim; ++e) row[d + e] = static_cast<Element>(v[e]);
  }
}

// ---- attention ----------------------------------------------------------------------------

// The rows of a key tile one thread copies, 16 bytes per cp.async. Where the threads divide a
// row's chunks (d64, d128, d256) each thread copies one chunk of a run of kCount consecutive
// rows: thread t, rows (t / kChunks) * kCount + i. A run then sits in one page whenever the
// page size is a multiple of kCount, so a paged thread looks its page up once a tile and walks
// the run as a contiguous one does (per-row lookups, ~20 instructions a row, held one CTA an SM
// at 60% of the contiguous bandwidth, docs/perf-notes.md v17). A warp's copy i still reads 256
// contiguous bytes per row. Otherwise (d96, d192) copy i is chunk (t + i * kThreads) % kChunks of
// row (t + i * kThreads) / kChunks. K and V tiles have the same chunks (hdim_q == hdim_v).
template <class Cfg>
struct TileCopies {
  static constexpr int kChunks = Cfg::KTile::kChunks;
  static constexpr int kCount = Cfg::kBlockN * kChunks / Cfg::kThreads;
  static constexpr bool kRuns = Cfg::kThreads % kChunks == 0;
  static_assert(Cfg::kBlockN * kChunks % Cfg::kThreads == 0,
                "a key tile must split evenly over the CTA's threads");
  static_assert(Cfg::KTile::kChunks == Cfg::VTile::kChunks, "kvcache: hdim_q == hdim_v");
  __device__ __forceinline__ static int row(int i) {
    const int t = static_cast<int>(threadIdx.x);
    return kRuns ? t / kChunks * kCount + i : (t + i * Cfg::kThreads) / kChunks;
  }
  __device__ __forceinline__ static int chunk(int i) {
    const int t = static_cast<int>(threadIdx.x);
    return kRuns ? t % kChunks : (t + i * Cfg::kThreads) % kChunks;
  }
};

// A paged cache's block-table entries reach shared memory by cp.async two tiles ahead of the
// copies that read them: the entries of a split's step j travel in the commit group of step
// j - 2, so the wait the loop makes for a tile's keys also covers the entries of the tile it
// issues next. Before, each thread loaded its rows' entries into registers one step ahead;
// under a full memory system those loads came back after the step, and the next tile's copies
// waited on them (batch 1 x 8k keys, pages of 16: 21.2 us at 16 splits against 10.5
// contiguous, docs/perf-notes.md v17). Slot j % kPageSlots holds the entries of step j's tile
// from page key0 / page_size on: at most kBlockN of them (pages of one key). A tile's entries
// are read up to the table row's last column, not the sequence's last page, so which entries
// a step needs never waits on the sequence's length; those past its pages are never used.
template <class Cfg>
struct PageSlots {
  static constexpr int kLead = Cfg::kStages - 1;  // tiles between a slot's fill and its use
  static_assert(Cfg::kPageSlots >= kLead + 2,
                "a slot is refilled only after every thread has read it");

  int32_t* slots;         // in shared memory (Cfg::kPageSlotBytes)
  const int32_t* table;   // the sequence's row of the block table
  int last_column;        // the row's last entry

  __device__ __forceinline__ int32_t* entries(int step) const {
    return slots + (step % Cfg::kPageSlots) * Cfg::kBlockN;
  }
  // Starts the copies of the entries of step `step`'s tile n_block, one a thread.
  __device__ __forceinline__ void fetch(int step, int n_block, const FastDivisor& page_size) const {
    const int first = page_size.quotient(n_block * Cfg::kBlockN);
    const int count =
        min(page_size.quotient(n_block * Cfg::kBlockN + Cfg::kBlockN - 1), last_column) - first + 1;
    for (int e = threadIdx.x; e < count; e += Cfg::kThreads) {
      sm80::cp_async_4(sm80::smem_addr(entries(step) + e), table + first + e);
    }
  }
};

// Copies key rows [n_block * kBlockN, + kBlockN) of one cache into a ring stage: the rows of
// cache row `cache_index` from row `key_begin` on when contiguous, of the pages whose table
// entries `entries` holds when paged, `dim` columns of each. Rows past `keys` are zero-filled
// (masked anyway, and zero V rows keep 0 * garbage from becoming NaN), as are columns past
// `dim` (zero K columns add nothing to Q K^T, zero V columns make output columns not stored).
// kRunsInPage: the page size is a multiple of a thread's run (TileCopies), so each run is
// walked by one pointer; a contiguous cache is one page. kPartialPieces: piece_bytes'.
template <class Cfg, class Tile, bool kRunsInPage, bool kPartialPieces>
__device__ __forceinline__ void load_cache_tile(uint32_t smem_tile,
                                                const typename Cfg::KvElement* cache,
                                                const int32_t* entries,
                                                const FastDivisor& page_size,
                                                int64_t batch_stride, int64_t seq_stride,
                                                int64_t head_stride, int cache_index,
                                                int key_begin, int head, int n_block, int keys,
                                                int dim) {
  using Copies = TileCopies<Cfg>;
  using KvElement = typename Cfg::KvElement;
  // Contiguous: key 0 is row key_begin of cache row cache_index (paged caches have neither).
  const int64_t sequence_offset =
      Cfg::kPaged ? 0 : cache_index * batch_stride + static_cast<int64_t>(key_begin) * seq_stride;
  const auto* head_cache = cache + head * head_stride + sequence_offset;
  const int key0 = n_block * Cfg::kBlockN;
  const int first_page = Cfg::kPaged ? page_size.quotient(key0) : 0;  // entries[0]'s page index
  // Where key `key` of this head starts (a valid key's page is in `entries`).
  auto row_start = [&](int key) {
    if constexpr (Cfg::kPaged) {
      const int index = page_size.quotient(key);
      const int page = key < keys ? entries[index - first_page] : 0;
      return head_cache + page * batch_stride +
             static_cast<int64_t>(key - index * page_size.divisor) * seq_stride;
    } else {
      return head_cache + static_cast<int64_t>(key) * seq_stride;
    }
  };
  auto copy = [&](int i, const KvElement* src) {
    const int bytes = key0 + Copies::row(i) < keys
                          ? piece_bytes<Cfg, kPartialPieces>(Copies::chunk(i), dim)
                          : 0;
    sm80::cp_async_16(smem_tile + Tile::offset(Copies::row(i), Copies::chunk(i)),
                      bytes > 0 ? src : cache, bytes);
  };
  // A run in one page is walked by one pointer; a 64-bit product per row, which the compiler
  // hoists out of the key loop, took d128 from 156 to 220 registers.
  if constexpr (Copies::kRuns && (!Cfg::kPaged || kRunsInPage)) {
    const auto* walk = row_start(key0 + Copies::row(0)) + Copies::chunk(0) * Cfg::kPieceElements;
#pragma unroll
    for (int i = 0; i < Copies::kCount; ++i) {
      copy(i, walk);
      walk += seq_stride;
    }
  } else {
#pragma unroll
    for (int i = 0; i < Copies::kCount; ++i) {
      copy(i, row_start(key0 + Copies::row(i)) + Copies::chunk(i) * Cfg::kPieceElements);
    }
  }
}

// Grid: (m_blocks * num_splits, nhead_k, batch). kRunsInPage as load_cache_tile's: a kernel of
// its own, as the paged kernel that decided it per tile ran 20% more instructions than the
// contiguous one at batch 1 x 8k keys (docs/perf-notes.md v17). kPartialPieces as
// piece_bytes': a kernel of its own too, for head dims that are no multiple of 8.
template <class Cfg, bool kRunsInPage, bool kPartialPieces>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinCtasPerSm) kvcache_kernel(const __grid_constant__ KvcacheParams p) {
  using Element = typename Cfg::Element;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  using VTile = typename Cfg::VTile;
  using Mask = TileMask<Cfg::kMask, /*kPadSeqlen=*/true, Cfg::kBlockM, Cfg::kBlockN>;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kStages = Cfg::kStages;
  constexpr int kDimQK = Cfg::kHeadDimQK;
  constexpr int kDimV = Cfg::kHeadDimV;
  constexpr int kWarpKeys = Cfg::kWarpKeys;
  constexpr int kNTiles = kWarpKeys / 8;  // n8 tiles of this warp's S
  constexpr int kDTiles = kDimV / 8;      // n8 tiles of O

  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int m_block = blockIdx.x / p.num_splits;
  const int split = blockIdx.x % p.num_splits;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  // The stream's next kernel may launch now where it is this call's combine (a few small CTAs
  // that wait for this grid), else only once every CTA has left its main loop (below): the
  // next call's attention kernel launched now would take the SMs' free slots while this grid
  // runs, two CTAs on some SMs and none on others once this grid ends. bf16 d64 decode, batch
  // 16 x 32k keys (128 CTAs, one split), H100: 344 us a call alone, 391 back to back launched
  // at the start, 354 launched after the main loop (docs/perf-notes.md v22).
  if (p.num_splits > 1) let_dependents_launch();
  wait_for_previous_grids();  // q, the cache and its lengths may come from the append kernel

  // Packed row r is query token r / group of query head kv_head * group + r % group.
  const int row0 = m_block * kBlockM;
  const int rows_here = min(kBlockM, p.rows - row0);
  const int first_token = row0 / p.group;
  const int last_token = (row0 + rows_here - 1) / p.group;

  const auto* q = static_cast<const Element*>(p.q);
  const auto* k_cache = static_cast<const typename Cfg::KvElement*>(p.k_cache);
  const auto* v_cache = static_cast<const typename Cfg::KvElement*>(p.v_cache);
  const uint32_t s_q = sm80::smem_addr(smem);
  const uint32_t s_k = s_q + QTile::kBytes;
  const uint32_t s_v = s_k + kStages * KTile::kBytes;

  // Step i of this split takes key tile begin + split + i * num_splits, begin being the first
  // tile the rows see (below). Without a window begin is 0, so a paged split's first tiles
  // are known before the sequence's length: their block-table entries go out now, with the
  // length's and Q's reads, and the prologue waits on two round trips before the first keys,
  // as a contiguous cache's does, not three (length, entries, keys).
  auto tile_at = [&](int begin, int step) { return begin + split + step * p.num_splits; };
  using Pages = PageSlots<Cfg>;
  const Pages pages{reinterpret_cast<int32_t*>(smem + QTile::kBytes + Cfg::kRingBytes),
                    p.block_table + batch * p.block_table_batch_stride,
                    Cfg::kPaged ? p.page_size.quotient(p.seqlen_cache - 1) : 0};
  constexpr bool kEntriesBeforeLength = Cfg::kPaged && !Mask::kHasLeft;
  if constexpr (kEntriesBeforeLength) {
    for (int s = 0; s < Pages::kLead; ++s) pages.fetch(s, tile_at(0, s), p.page_size);
  }

  // Q: the 16 packed rows (zeros past the last).
  {
    constexpr int kChunks = QTile::kChunks;
    for (int idx = threadIdx.x; idx < kBlockM * kChunks; idx += Cfg::kThreads) {
      const int r = idx / kChunks;
      const int chunk = idx % kChunks;
      const int bytes = r < rows_here ? piece_bytes<Cfg, kPartialPieces>(chunk, p.hdim_qk) : 0;
      const int token = (row0 + r) / p.group;
      const int head = kv_head * p.group + (row0 + r) % p.group;
      const auto* src = q + batch * p.q_batch_stride + token * p.q_seq_stride +
                        head * p.q_head_stride + chunk * 8;
      sm80::cp_async_16(s_q + QTile::offset(r, chunk), bytes > 0 ? src : q, bytes);
    }
  }

  // The sequence's keys, counted from key_begin: a left-padded row's start (cache_leftpad),
  // clamped to the keys there are. Masks and ALiBi read key distances, which the shift keeps.
  const int keys_end = attended_keys(p, batch);
  const int key_begin =
      p.cache_leftpad != nullptr ? min(max(p.cache_leftpad[batch], 0), keys_end) : 0;
  const int keys = keys_end - key_begin;
  const Mask mask(p.seqlen_q, keys, /*bottom_right=*/true, p.window_left, p.window_right);

  // The logits' scales, and the output's factor. An e4m3 cache's k_scale and the powers of two
  // of its widening (e4m3_cache.cuh) fold into the multiply that scales the logits; v_scale
  // and the values' power of two into the output's 1/rowsum, in the merge below. One K/V head
  // a CTA: a scalar each.
  float softmax_mul = p.softmax_mul, logit_scale = p.scale, softcap_scale = p.softcap_scale;
  float out_scale = 1.f;
  // The one of them k_scale (and the queries' fp16 shift, below) multiplies.
  [[maybe_unused]] float& logit_factor =
      Cfg::kLogitsInScores ? (Cfg::kSoftcap ? softcap_scale : logit_scale) : softmax_mul;
  if constexpr (Cfg::kE4m3Cache) {
    logit_factor *= p.k_scale[batch * p.k_scale_batch_stride + kv_head * p.k_scale_head_stride];
    out_scale = p.v_scale[batch * p.v_scale_batch_stride + kv_head * p.v_scale_head_stride];
  }
  // exp2's argument gains it, so that P is 2^kPLog2Scale times the probabilities: an e4m3
  // cache's P is fp16, whose normal range ends at 2^-14; at 2^15 it ends at 2^-29 instead, and
  // P stays below fp16's largest value. The row sums carry the same factor.
  constexpr float kPLog2Scale = Cfg::kE4m3Cache ? 15.f : 0.f;

  // This split's share of the key tiles the rows see, every num_splits-th of this sequence's
  // own range (an even share, so short sequences of a batch do not leave splits idle).
  // Interleaved rather than in one run, a split's tiles depend on the length only through
  // where they end (the entries above).
  const int n_begin_all = mask.n_block_begin(first_token);
  const int n_end_all = max(mask.n_block_end(last_token), n_begin_all);
  const int n_steps = max(n_end_all - n_begin_all - split + p.num_splits - 1, 0) / p.num_splits;
  auto tile_of = [&](int step) { return tile_at(n_begin_all, step); };

  const int cache_index =
      !Cfg::kPaged && p.cache_batch_idx != nullptr ? p.cache_batch_idx[batch] : batch;
  auto fetch_pages = [&](int step) {
    if constexpr (Cfg::kPaged) {
      if (step < n_steps) pages.fetch(step, tile_of(step), p.page_size);
    }
  };
  auto load_kv = [&](int step, int stage) {
    const int n_block = tile_of(step);
    const int32_t* entries = pages.entries(step);
    load_cache_tile<Cfg, KTile, kRunsInPage, kPartialPieces>(
        s_k + stage * KTile::kBytes, k_cache, entries, p.page_size, p.kc_batch_stride,
        p.kc_seq_stride, p.kc_head_stride, cache_index, key_begin, kv_head, n_block, keys,
        p.hdim_qk);
    load_cache_tile<Cfg, VTile, kRunsInPage, kPartialPieces>(
        s_v + stage * VTile::kBytes, v_cache, entries, p.page_size, p.vc_batch_stride,
        p.vc_seq_stride, p.vc_head_stride, cache_index, key_begin, kv_head, n_block, keys,
        p.hdim_v);
  };
  // Prologue: kStages - 1 tiles in flight (Q joins the first group), each group carrying the
  // block-table entries of the tile kStages - 1 after it (PageSlots). The first tiles' entries
  // (with Q) land before any key is copied. One commit group per tile, empty where there is
  // none, so the wait counts stay uniform.
  if constexpr (Cfg::kPaged) {
    if constexpr (!kEntriesBeforeLength) {
      for (int s = 0; s < Pages::kLead; ++s) fetch_pages(s);
    }
    sm80::cp_async_commit();
    sm80::cp_async_wait<0>();
    __syncthreads();
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_steps) load_kv(s, s);
    fetch_pages(s + Pages::kLead);
    sm80::cp_async_commit();
  }

  // Per-lane ldmatrix bases (SmemTile::step): Q and row-major V, lanes 0-15 rows 0-15 at the
  // low chunk, 16-31 at the high one; K, lanes 8i..8i+7 matrix i (rows +0/+8, chunk lo/hi).
  // A warp's keys start at row warp * kWarpKeys of the K and V tiles.
  const uint32_t q_lane = QTile::offset(lane % 16, lane / 16);
  // An e4m3 cache's K and V: lanes 8i..8i+7 matrix i, keys 8 (i % 2).., 16-byte chunk i / 2.
  const uint32_t k_lane = Cfg::kE4m3Cache
                              ? KTile::offset((lane / 8) % 2 * 8 + lane % 8, lane / 16)
                              : KTile::offset((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const uint32_t v_lane = Cfg::kE4m3Cache
                              ? VTile::offset((lane / 8) % 2 * 8 + lane % 8, lane / 16)
                              : VTile::offset(lane % 16, lane / 16);
  constexpr int kWarpKeyGroups = kWarpKeys / 16;
  const int warp_group0 = warp * kWarpKeyGroups;  // first 16-key group of this warp

  float o_acc[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o_acc[dt][e] = 0.f;
  }
  // Each lane holds rows lane / 4 (accumulator elements 0, 1) and lane / 4 + 8 (2, 3).
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  int token_of[2], head_of[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + lane / 4 + 8 * h;
    token_of[h] = r / p.group;
    head_of[h] = kv_head * p.group + r % p.group;
  }
  float alibi_slope[2] = {0.f, 0.f};
  if constexpr (Cfg::kBias == BiasType::kAlibi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (token_of[h] < p.seqlen_q) {
        alibi_slope[h] = p.alibi_slopes[batch * p.alibi_batch_stride + head_of[h]];
      }
    }
  }
  uint32_t q_frag[Cfg::kQInRegisters ? kDimQK / 16 : 1][4];
  // Q's A fragment of head-dim columns 16 kt.. in the order an e4m3 cache's widened K pairs
  // take them: ldmatrix gives a lane bytes 4t..4t+3 of a key row (t = lane % 4), which widen
  // to the pairs of k-slots 2t and 2t + 8, so those slots of Q hold its columns 4t, 4t + 1 and
  // 4t + 2, 4t + 3 (a permutation of the reduction, the same on both sides).
  auto load_q_e4m3_order = [&](uint32_t(&a)[4], int kt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint2 x = *reinterpret_cast<const uint2*>(
          smem + QTile::offset(lane / 4 + 8 * h, 2 * kt + (lane % 4) / 2) + 8 * (lane % 2));
      a[h] = x.x;
      a[2 + h] = x.y;
    }
  };
  // bf16 queries as fp16 in place in the Q tile, times 2^-shift where their largest magnitude
  // needs it (e4m3::query_shift), the logits' scale times 2^shift: once, after Q has landed
  // and before any thread reads a fragment of it.
  auto queries_to_half = [&]() {
    __shared__ float warp_amax[Cfg::kNumWarps];
    constexpr int kChunks = QTile::kChunks;
    float amax = 0.f;
    for (int idx = threadIdx.x; idx < kBlockM * kChunks; idx += Cfg::kThreads) {
      const auto* x = reinterpret_cast<const __nv_bfloat162*>(
          smem + QTile::offset(idx / kChunks, idx % kChunks));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(x[e]);
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, offset));
    }
    if (lane == 0) warp_amax[warp] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < Cfg::kNumWarps; ++w) amax = fmaxf(amax, warp_amax[w]);
    const int shift = e4m3::query_shift(amax);
    const float down = __int_as_float((127 - shift) << 23);  // 2^-shift
    for (int idx = threadIdx.x; idx < kBlockM * kChunks; idx += Cfg::kThreads) {
      auto* x = reinterpret_cast<uint32_t*>(smem + QTile::offset(idx / kChunks, idx % kChunks));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x + e));
        const __half2 h = __floats2half2_rn(f.x * down, f.y * down);
        x[e] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    logit_factor *= __int_as_float((127 + shift) << 23);
    __syncthreads();
  };

  for (int it = 0; it < n_steps; ++it) {
    const int n_block = tile_of(it);
    const int stage = it % kStages;
    // This step's tile (with Q, and the entries of the tile issued next) has landed...
    sm80::cp_async_wait<kStages - 2>();
    __syncthreads();  // ...for every thread, and every warp is done with the stage reloaded next
    if (it + kStages - 1 < n_steps) load_kv(it + kStages - 1, (it + kStages - 1) % kStages);
    fetch_pages(it + kStages - 1 + Pages::kLead);
    sm80::cp_async_commit();
    if constexpr (Cfg::kE4m3Cache && std::is_same_v<Element, __nv_bfloat16>) {
      if (it == 0) queries_to_half();
    }
    if constexpr (Cfg::kQInRegisters) {
      if (it == 0) {
#pragma unroll
        for (int kt = 0; kt < kDimQK / 16; ++kt) {
          if constexpr (Cfg::kE4m3Cache) {
            load_q_e4m3_order(q_frag[kt], kt);
          } else {
            sm80::ldmatrix_x4(q_frag[kt], s_q + QTile::step(q_lane, 0, kt));
          }
        }
      }
    }

    // S = Q K^T over this warp's keys: (16, kWarpKeys) in n8 tiles.
    float s[kNTiles][4];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
    }
    const uint32_t s_k_stage = s_k + stage * KTile::kBytes;
    if constexpr (Cfg::kE4m3Cache) {
      // One ldmatrix: keys 0-7 and 8-15 of a group at head-dim columns 32 kc.. (b[0], b[1])
      // and 32 kc + 16.. (b[2], b[3]); each word widens to the B fragment of one n8 tile.
#pragma unroll
      for (int kc = 0; kc < kDimQK / 32; ++kc) {
        uint32_t a[2][4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          if constexpr (Cfg::kQInRegisters) {
#pragma unroll
            for (int r = 0; r < 4; ++r) a[half][r] = q_frag[2 * kc + half][r];
          } else {
            load_q_e4m3_order(a[half], 2 * kc + half);
          }
        }
#pragma unroll
        for (int g = 0; g < kWarpKeyGroups; ++g) {
          uint32_t b[4];
          sm80::ldmatrix_x4(b, s_k_stage + KTile::step(k_lane, warp_group0 + g, kc));
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            sm80::mma_16816<__half>(s[2 * g + i % 2], a[i / 2], e4m3::widen_pair<false>(b[i]),
                                    e4m3::widen_pair<true>(b[i]));
          }
        }
      }
    } else {
#pragma unroll
      for (int kt = 0; kt < kDimQK / 16; ++kt) {
        uint32_t a[4];
        if constexpr (Cfg::kQInRegisters) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[r] = q_frag[kt][r];
        } else {
          sm80::ldmatrix_x4(a, s_q + QTile::step(q_lane, 0, kt));
        }
#pragma unroll
        for (int g = 0; g < kWarpKeyGroups; ++g) {
          uint32_t b[4];
          sm80::ldmatrix_x4(b, s_k_stage + KTile::step(k_lane, warp_group0 + g, kt));
          sm80::mma_16816<Element>(s[2 * g], a, b[0], b[1]);
          sm80::mma_16816<Element>(s[2 * g + 1], a, b[2], b[3]);
        }
      }
    }

    // Element (nt, e) of S is row lane / 4 + 8 * (e / 2), key col0 + nt * 8 + e % 2.
    const int col0 = n_block * kBlockN + warp * kWarpKeys + (lane % 4) * 2;
    if constexpr (Cfg::kLogitsInScores) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[nt][e];
          x = Cfg::kSoftcap ? p.softcap * sm80::tanh_fast(x * softcap_scale) : x * logit_scale;
          if constexpr (Cfg::kBias == BiasType::kAlibi) {
            const int col = col0 + nt * 8 + e % 2;
            x -= alibi_slope[e / 2] * fabsf(static_cast<float>(token_of[e / 2] + mask.offset - col));
          }
          s[nt][e] = x;
        }
      }
    }
    if (mask.is_edge_tile(first_token, last_token, n_block)) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (!mask.is_visible(token_of[e / 2], col0 + nt * 8 + e % 2)) s[nt][e] = -INFINITY;
        }
      }
    }

    // Online softmax of this warp's slice.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = row_max[h];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) m = fmaxf(m, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
      // Nothing visible yet: subtract 0 rather than -inf, so exp2 gives 0 and not NaN.
      const float m_scaled = m == -INFINITY ? 0.f : m * softmax_mul;
      const float correction = sm80::fast_exp2(row_max[h] * softmax_mul - m_scaled);
      const float p_offset = Cfg::kE4m3Cache ? m_scaled - kPLog2Scale : m_scaled;
      row_max[h] = m;
      row_sum[h] *= correction;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o_acc[dt][2 * h] *= correction;
        o_acc[dt][2 * h + 1] *= correction;
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[nt][e] = sm80::fast_exp2(s[nt][e] * softmax_mul - p_offset);
          row_sum[h] += s[nt][e];
        }
      }
    }

    // O += P V: P's accumulators of n-tiles 2g, 2g + 1 are the A fragment of key group g.
    const uint32_t s_v_stage = s_v + stage * VTile::kBytes;
#pragma unroll
    for (int g = 0; g < kWarpKeyGroups; ++g) {
      uint32_t a[4];
      using MmaElement = typename Cfg::MmaElement;
      a[0] = sm80::pack2<MmaElement>(s[2 * g][0], s[2 * g][1]);
      a[1] = sm80::pack2<MmaElement>(s[2 * g][2], s[2 * g][3]);
      a[2] = sm80::pack2<MmaElement>(s[2 * g + 1][0], s[2 * g + 1][1]);
      a[3] = sm80::pack2<MmaElement>(s[2 * g + 1][2], s[2 * g + 1][3]);
      if constexpr (Cfg::kE4m3Cache) {
        // Keys 0-7 and 8-15 at head-dim columns 32 dc.. (b[0], b[1]) and 32 dc + 16.. (b[2],
        // b[3]), transposed: a lane's word holds keys 2t, 2t + 1 at columns 2c, 2c + 1 (c =
        // lane / 4), so its bytes 0, 2 are the B pair of column 2c and 1, 3 of 2c + 1. O's n8
        // tile 2j takes the even columns of 16-column block j, 2j + 1 the odd ones.
#pragma unroll
        for (int dc = 0; dc < kDimV / 32; ++dc) {
          uint32_t b[4];
          sm80::ldmatrix_x4_trans(b, s_v_stage + VTile::step(v_lane, warp_group0 + g, dc));
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const uint32_t low_keys = e4m3::pair_interleaved_bytes(b[2 * j]);
            const uint32_t high_keys = e4m3::pair_interleaved_bytes(b[2 * j + 1]);
            sm80::mma_16816<__half>(o_acc[4 * dc + 2 * j], a, e4m3::widen_pair<false>(low_keys),
                                    e4m3::widen_pair<false>(high_keys));
            sm80::mma_16816<__half>(o_acc[4 * dc + 2 * j + 1], a,
                                    e4m3::widen_pair<true>(low_keys),
                                    e4m3::widen_pair<true>(high_keys));
          }
        }
      } else {
#pragma unroll
        for (int dp = 0; dp < kDTiles / 2; ++dp) {
          uint32_t b[4];
          sm80::ldmatrix_x4_trans(b, s_v_stage + VTile::step(v_lane, warp_group0 + g, dp));
          sm80::mma_16816<Element>(o_acc[2 * dp], a, b[0], b[1]);
          sm80::mma_16816<Element>(o_acc[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }
  }

  // Merge the warps: each stages its unnormalized O and its rows' running max (in exp2's units)
  // and sum in the ring (free once every copy has landed and every warp left the loop); after
  // one barrier each row's threads weigh the warps themselves, exp2(m_w - m) a warp, and sum
  // the warps' rows over their columns. The merge is every CTA's tail, after its last tile
  // lands: with three barriers (a thread a row turning the warps' log-sum-exps into weights
  // between two of them) and the weights re-read for every 4 columns, a decode step's attention
  // kernel (bf16 d128, 64 query heads on 8 K/V heads, batch 1 x 8k keys, H100) took 14.8 us
  // against 14.4 now, and batch 1 x 1k keys read 587 GB/s against 621 (docs/perf-notes.md v26).
  if (p.num_splits == 1) let_dependents_launch();
  sm80::cp_async_wait<0>();
  __syncthreads();
  constexpr int kWarps = Cfg::kNumWarps;
  // fp32 words per staged row: 16-byte rows for the float4 reads, 4 banks apart.
  constexpr int kOStride = kDimV + 4;
  float* merge_o = reinterpret_cast<float*>(smem + Cfg::kMergeOffset);
  float2* merge_state = reinterpret_cast<float2*>(merge_o + kWarps * kBlockM * kOStride);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    const int r = lane / 4 + 8 * h;
    if constexpr (Cfg::kE4m3Cache) {
      // Tiles 2j and 2j + 1 hold columns 16 j + 4t + {0, 2} and {1, 3} (the P V loop).
      float* o_row = merge_o + (warp * kBlockM + r) * kOStride + (lane % 4) * 4;
#pragma unroll
      for (int j = 0; j < kDTiles / 2; ++j) {
        *reinterpret_cast<float4*>(o_row + j * 16) =
            make_float4(o_acc[2 * j][2 * h], o_acc[2 * j + 1][2 * h], o_acc[2 * j][2 * h + 1],
                        o_acc[2 * j + 1][2 * h + 1]);
      }
    } else {
      float* o_row = merge_o + (warp * kBlockM + r) * kOStride + (lane % 4) * 2;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<float2*>(o_row + dt * 8) =
            make_float2(o_acc[dt][2 * h], o_acc[dt][2 * h + 1]);
      }
    }
    // The max in exp2's units (0 where nothing was visible, as the loop subtracted), less
    // P's scale, which the sum carries.
    const float m_scaled =
        (row_max[h] == -INFINITY ? 0.f : row_max[h] * softmax_mul) - kPLog2Scale;
    if (lane % 4 == 0) merge_state[warp * kBlockM + r] = make_float2(m_scaled, sum);
  }
  __syncthreads();

  // kRowThreads threads a row, each weighing the warps once and taking every kRowThreads-th
  // 4 columns of it: its float4 reads are independent, and a row's threads read adjacent
  // 16-byte pieces of it.
  constexpr int kQuads = kDimV / 4;
  constexpr int kRowThreads = Cfg::kThreads / kBlockM;
  static_assert(kQuads % kRowThreads == 0, "a row's columns split evenly over its threads");
  const int r = threadIdx.x / kRowThreads;
  if (r < rows_here) {
    // A warp that saw no key of the row has sum 0 and weighs 0; a NaN sum (NaN or +inf among
    // the logits) makes the row NaN, its log-sum-exp too; no key in any warp: output 0 and
    // log-sum-exp -inf.
    float2 state[kWarps];
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      state[w] = merge_state[w * kBlockM + r];
      if (state[w].y > 0.f) m = fmaxf(m, state[w].x);
    }
    float weight[kWarps];
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      weight[w] = state[w].y > 0.f ? sm80::fast_exp2(state[w].x - m) : 0.f;
      sum += isnan(state[w].y) ? NAN : weight[w] * state[w].y;
    }
    const float inv = sum > 0.f ? 1.f / sum : isnan(sum) ? NAN : 0.f;
    const float out_inv = Cfg::kE4m3Cache ? inv * out_scale : inv;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) weight[w] *= out_inv;
    const float lse = sum > 0.f    ? (m + log2f(sum)) * static_cast<float>(M_LN2)
                      : sum == 0.f ? -INFINITY
                                   : NAN;
    const int token = (row0 + r) / p.group;
    const int head = kv_head * p.group + (row0 + r) % p.group;
    const int first_d = threadIdx.x % kRowThreads * 4;
    const bool final_output = p.num_splits == 1;
    auto* o = static_cast<Element*>(p.o) + batch * p.o_batch_stride + token * p.o_seq_stride +
              head * p.o_head_stride;
    const int64_t partial_row =
        ((static_cast<int64_t>(split) * p.batch + batch) * p.nhead_q + head) * p.seqlen_q + token;
#pragma unroll
    for (int q = 0; q < kQuads / kRowThreads; ++q) {
      const int d = first_d + q * kRowThreads * 4;
      float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float4 x =
            *reinterpret_cast<const float4*>(merge_o + (w * kBlockM + r) * kOStride + d);
        out.x += weight[w] * x.x, out.y += weight[w] * x.y;
        out.z += weight[w] * x.z, out.w += weight[w] * x.w;
      }
      if (final_output) {
        store_quad<Cfg>(o, d, out, p.hdim_v);
      } else {
        *reinterpret_cast<float4*>(p.o_partial + partial_row * kDimV + d) = out;
      }
    }
    if (first_d == 0) {
      if (!final_output) {
        p.lse_partial[partial_row] = lse;
      } else if (p.lse != nullptr) {
        p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + token] = lse;
      }
    }
  }
}

// ---- combine: the splits' partial outputs, weighted by their log-sum-exp ---------------------

// One warp per output row (sequence, query head, token); 4 rows per CTA. Lane i owns columns
// 4 (i + 32 v) .. + 3 for v < kVecs (16-byte loads of the fp32 partials), and holds split s's
// log-sum-exp and weight for s = i, i + 32, ...: the first 32 in registers, later ones re-read.
// The partials of the first kPrefetch splits are loaded before the log-sum-exps, so a decode
// step of up to 16 splits waits on one round trip to L2, not three: a loop that read each
// split's log-sum-exp before its partial waited on one a split (21 us against 17 for a step
// of 32 splits, docs/perf-notes.md v14), and one that reduced the log-sum-exps before loading
// any partial left 3.3-4.3 us after the attention kernel at batch 1 (v16).
template <class Cfg>
__global__ void __launch_bounds__(128) kvcache_combine_kernel(const __grid_constant__ KvcacheParams p) {
  using Element = typename Cfg::Element;
  constexpr int kDimV = Cfg::kHeadDimV;
  static_assert(kDimV % 4 == 0, "combine reads O in float4s");
  constexpr int kVecs = (kDimV + 127) / 128;
  constexpr int kPrefetch = 16 / kVecs;
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.nhead_q * p.seqlen_q;
  if (row >= rows) return;
  const int token = row % p.seqlen_q;
  const int head = row / p.seqlen_q % p.nhead_q;
  const int batch = row / p.seqlen_q / p.nhead_q;
  const int64_t split_stride = rows;
  const int splits = p.num_splits;
  wait_for_previous_grids();  // the attention kernel's partial outputs

  // Every lane runs every step (the shuffles need the whole warp); below d128 the lanes past
  // the head dim only pass weights on.
  const float* part = p.o_partial + row * kDimV;  // split s at + s * split_stride * kDimV
  auto owns = [&](int v) { return (lane + 32 * v) * 4 < kDimV; };
  auto load = [&](int s, int v) {
    return *reinterpret_cast<const float4*>(part + s * split_stride * kDimV + (lane + 32 * v) * 4);
  };
  float4 first[kPrefetch][kVecs];
#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (s < splits && owns(v)) first[s][v] = load(s, v);
    }
  }
  auto lse_of = [&](int s) {
    return s < splits ? p.lse_partial[s * split_stride + row] : -INFINITY;
  };
  const float lse_lane = lse_of(lane);
  float lse_max = lse_lane;
  bool nan = isnan(lse_lane);
  for (int s = 32 + lane; s - lane < splits; s += 32) {
    const float l = lse_of(s);
    lse_max = fmaxf(lse_max, l);
    nan |= isnan(l);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffff, lse_max, offset));
  }
  nan = __any_sync(0xffffffff, nan);
  // An empty split (log-sum-exp -inf, partial output zeros) weighs 0.
  auto weight_of = [&](float l, float base) { return l == -INFINITY ? 0.f : __expf(l - base); };
  float weight_sum = 0.f;
  if (lse_max != -INFINITY) {
    weight_sum = weight_of(lse_lane, lse_max);
    for (int s = 32 + lane; s - lane < splits; s += 32) weight_sum += weight_of(lse_of(s), lse_max);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    weight_sum += __shfl_xor_sync(0xffffffff, weight_sum, offset);
  }
  const float lse = nan                    ? NAN
                    : lse_max == -INFINITY ? -INFINITY
                                           : lse_max + __logf(weight_sum);

  float4 acc[kVecs];
#pragma unroll
  for (int v = 0; v < kVecs; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  auto add = [&](float4& a, float w, const float4& x) {
    a.x += w * x.x, a.y += w * x.y, a.z += w * x.z, a.w += w * x.w;
  };
  const float weight_lane = weight_of(lse_lane, lse);
#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
    const float w = __shfl_sync(0xffffffff, weight_lane, s);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (s < splits && owns(v)) add(acc[v], w, first[s][v]);
    }
  }
  for (int s0 = 0; s0 < splits; s0 += 32) {
    const float weight = s0 == 0 ? weight_lane : weight_of(lse_of(s0 + lane), lse);
    const int from = s0 == 0 ? kPrefetch : s0;
    const int to = min(splits, s0 + 32);
#pragma unroll 8
    for (int s = from; s < to; ++s) {
      const float w = __shfl_sync(0xffffffff, weight, s - s0);
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        if (owns(v)) add(acc[v], w, load(s, v));
      }
    }
  }

  auto* o = static_cast<Element*>(p.o) + batch * p.o_batch_stride + token * p.o_seq_stride +
            head * p.o_head_stride;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    if (!owns(v)) continue;
    if (nan) acc[v] = make_float4(NAN, NAN, NAN, NAN);
    store_quad<Cfg>(o, (lane + 32 * v) * 4, acc[v], p.hdim_v);
  }
  if (lane == 0 && p.lse != nullptr) {
    p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + token] = lse;
  }
}

// ---- host --------------------------------------------------------------------------------

// Past 48 KB a kernel must opt in to dynamic shared memory, once per device.
template <class Cfg, bool kRunsInPage, bool kPartialPieces>
cudaError_t allow_kvcache_smem() {
  if constexpr (Cfg::kSmemBytes > 48 * 1024) {
    static std::atomic<uint64_t> smem_raised{0};
    return allow_dynamic_smem(
        reinterpret_cast<const void*>(kvcache_kernel<Cfg, kRunsInPage, kPartialPieces>),
        Cfg::kSmemBytes, smem_raised);
  }
  return cudaSuccess;
}

template <class Cfg, bool kRunsInPage, bool kPartialPieces>
cudaError_t launch_attention_kernel(const KvcacheParams& p, dim3 grid, cudaStream_t stream) {
  if (const cudaError_t err = allow_kvcache_smem<Cfg, kRunsInPage, kPartialPieces>();
      err != cudaSuccess) {
    return err;
  }
  return launch_dependent<kvcache_kernel<Cfg, kRunsInPage, kPartialPieces>>(
      grid, Cfg::kThreads, Cfg::kSmemBytes, stream, p);
}

// The attention kernel: the one whose runs lie in a page where they do (every contiguous call),
// else the one that looks each row's page up (page sizes that are no multiple of a run); of a
// head-dim-padded instance, the one for partial pieces where a head dim is no multiple of 8.
template <class Cfg, bool kRunsInPage>
cudaError_t launch_attention(const KvcacheParams& p, dim3 grid, cudaStream_t stream) {
  if constexpr (Cfg::kPadHdim) {
    if (p.hdim_qk % 8 != 0 || p.hdim_v % 8 != 0) {
      return launch_attention_kernel<Cfg, kRunsInPage, true>(p, grid, stream);
    }
  }
  return launch_attention_kernel<Cfg, kRunsInPage, false>(p, grid, stream);
}

// The call's (sequence, K/V head, row block) units: its CTAs before any split.
template <class Cfg>
int64_t kvcache_units(const KvcacheArgs& a) {
  const int64_t rows = static_cast<int64_t>(a.seqlen_q) * (a.nhead_q / a.nhead_k);
  return static_cast<int64_t>(a.batch) * a.nhead_k * ((rows + Cfg::kBlockM - 1) / Cfg::kBlockM);
}

// Whether the call's units alone put a CTA on every SM: it runs one split, and an instance
// with a full-grid tile runs that one (`launch`).
template <class Cfg>
bool kvcache_fills_grid(const KvcacheArgs& a) {
  return kvcache_units<Cfg>(a) >= std::max(1, multiprocessor_count());
}

// Splits per (sequence, K/V head, row block): args.num_splits when given, else as many as put
// one CTA on each SM, and one split where the sequences and heads alone fill that. Measured on
// an H100 (bf16 d128, 8 K/V heads, batch 1-16 x 8k-128k keys, counts from 1 to 128): on a
// contiguous cache the best count made 128 CTAs on the 132 SMs in every case, e.g. batch 1 x
// 8k keys 2357 GB/s at 16 splits against 1972 at 17 (136 CTAs: some SMs take two) and 2031 at
// the 32 that filled both CTA slots of every SM; one CTA an SM keeps enough bytes in flight,
// and more splits only add prologues and fp32 partial outputs (docs/perf-notes.md v14). Paged
// caches too, since a thread looks its pages up once a tile (TileCopies): batch 1 x 8k keys,
// pages of 16, 14.8 us a step at 16 splits against 15.6 at 32, 32k keys 53.2 against 56.6,
// batch 8 x 8k 97.2 against 98.3 at 2 splits and 4 (v17). A split may be a single key tile:
// with the combine in one round trip, batch 1 x 1k keys took 8.5 us at 16 splits against 9.5
// at 4 (a split of at least 4 tiles, the rule before), 2k keys 9.0 against 9.7 at 8 (v16).
// kMaxSplits bounds the combine's reads. An e4m3 cache's CTA keeps half the bytes in flight of a
// 16-bit one of the same keys, and two fit an SM: where the units fill more than half the SMs
// but not all, two splits put a second CTA on each (bf16 queries, d128, 128-key tiles, batch 16
// x 8 K/V heads on an H200's 132 SMs: 84.9 -> 69.8 us a step at 8k keys, 307 -> 254 at 32k).
// Below that it keeps one CTA an SM, as more splits only shorten them: batch 1 x 8k keys took
// 11.4 us at 16 splits and 13.6 at 32, batch 8 x 8k 38.6 at 2 and at 4 (docs/perf-notes.md v27).
template <class Cfg>
int kvcache_num_splits(const KvcacheArgs& a) {
  constexpr int kMaxSplits = 128;
  const int key_tiles = (a.seqlen_cache + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (a.num_splits > 0) return std::min(a.num_splits, std::max(1, key_tiles));
  if (kvcache_fills_grid<Cfg>(a)) return 1;
  const int most = std::max(1, std::min(kMaxSplits, key_tiles));
  const int sms = std::max(1, multiprocessor_count());
  if (Cfg::kE4m3Cache && 2 * kvcache_units<Cfg>(a) > sms) return std::min(most, 2);
  return static_cast<int>(std::min<int64_t>(most, sms / kvcache_units<Cfg>(a)));
}

template <class Cfg>
size_t tile_workspace_bytes(const KvcacheArgs& a) {
  const int splits = kvcache_num_splits<Cfg>(a);
  const size_t rows = static_cast<size_t>(a.batch) * a.nhead_q * a.seqlen_q;
  size_t bytes = 0;
  if (splits > 1) {
    bytes += round_up_256(splits * rows * Cfg::kHeadDimV * sizeof(float));
    bytes += round_up_256(splits * rows * sizeof(float));
  }
  return bytes + rotated_q_bytes(a, Cfg::kHeadDimQK);
}

// One call on one tile: the append, the attention and the combine.
template <class Cfg>
cudaError_t launch_tile(const KvcacheArgs& a, cudaStream_t stream) {
  KvcacheParams p = kvcache_params(a);
  p.m_blocks = (p.rows + Cfg::kBlockM - 1) / Cfg::kBlockM;
  p.num_splits = kvcache_num_splits<Cfg>(a);
  p.softmax_mul = Cfg::kLogitsInScores ? static_cast<float>(M_LOG2E)
                                       : a.softmax_scale * static_cast<float>(M_LOG2E);

  // The workspace, in tile_workspace_bytes()'s order.
  auto* workspace = static_cast<unsigned char*>(a.workspace);
  const size_t rows = static_cast<size_t>(a.batch) * a.nhead_q * a.seqlen_q;
  if (p.num_splits > 1) {
    p.o_partial = reinterpret_cast<float*>(workspace);
    workspace += round_up_256(p.num_splits * rows * Cfg::kHeadDimV * sizeof(float));
    p.lse_partial = reinterpret_cast<float*>(workspace);
    workspace += round_up_256(p.num_splits * rows * sizeof(float));
  }
  if (a.rotary_dim > 0) p.q_rotated = workspace;
  if (const cudaError_t err = launch_append<Cfg>(p, stream); err != cudaSuccess) return err;

  const dim3 grid(static_cast<unsigned>(p.m_blocks * p.num_splits), a.nhead_k, a.batch);
  cudaError_t err = cudaSuccess;
  if constexpr (Cfg::kPaged && TileCopies<Cfg>::kRuns) {
    const bool runs_in_page = a.page_size % TileCopies<Cfg>::kCount == 0;
    err = runs_in_page ? launch_attention<Cfg, true>(p, grid, stream)
                       : launch_attention<Cfg, false>(p, grid, stream);
  } else {
    err = launch_attention<Cfg, true>(p, grid, stream);
  }
  if (err != cudaSuccess || p.num_splits == 1) return err;

  const auto combine_ctas = static_cast<unsigned>((static_cast<int64_t>(rows) + 3) / 4);
  return launch_dependent<kvcache_combine_kernel<Cfg>>(combine_ctas, 128, 0, stream, p);
}

// An instance's tile, or its full-grid tile (instances.yaml's `full_grid`) for calls whose units
// alone fill every SM: a tile for few CTAs (8 warps on 128 keys, one CTA an SM: its warps
// issue more of a step's copies and MMAs at once) loses where the CTAs come in waves, whose
// prologues and merges then run with nothing beside them (bf16 d64, GQA 8:1, H100: batch 32 x
// 1k/8k/32k keys 2550/2894/2921 GB/s on it against 2595/3042/3045 on 4 warps of 64 keys, two
// CTAs an SM, where batch 8 x 8k/32k reads 2-9% more on it on pages; docs/perf-notes.md v22,
// v23). FullGridCfg = Cfg: one tile for every call.
template <class Cfg, class FullGridCfg = Cfg>
cudaError_t launch(const KvcacheArgs& a, cudaStream_t stream) {
  if constexpr (!std::is_same_v<Cfg, FullGridCfg>) {
    if (kvcache_fills_grid<Cfg>(a)) return launch_tile<FullGridCfg>(a, stream);
  }
  return launch_tile<Cfg>(a, stream);
}

// The scratch of the tile `launch` runs for the call.
template <class Cfg, class FullGridCfg = Cfg>
size_t workspace_bytes(const KvcacheArgs& a) {
  if constexpr (!std::is_same_v<Cfg, FullGridCfg>) {
    if (kvcache_fills_grid<Cfg>(a)) return tile_workspace_bytes<FullGridCfg>(a);
  }
  return tile_workspace_bytes<Cfg>(a);
}

}  // namespace fmha::kvcache::decode
