// KV-cache attention for many query tokens (chunked prefill) on sm90a: the kvcache operation's
// "fa3" pipeline (generator/operations.py), which runs the fa3 forward's kernel. It serves
// fwd_kvcache's calls of at least a tile of query tokens, whose arithmetic the decode kernel
// (kvcache_decode_split_kv.cuh, 16 packed rows on mma.sync) would run far below the tensor
// cores' rate.
//
// Two kernels on one stream:
//   append (when k_new or rotary tables are given): kvcache_append.cuh's, the one the decode
//     pipeline runs: k_new and v_new into the cache, rotated, and the rotated q into the
//     workspace;
//   attention: fwd_fa3_sm90.cuh's persistent kernel in batch mode, with K and V read from the
//     cache by TMA, page by page (cached_kv_sm90.cuh), each sequence's keys counted from
//     cache_seqlens plus the appended tokens, and the causal mask (or window) aligned
//     bottom-right, so query token i sits at key cache_seqlens[b] + seqlen_new - seqlen_q + i.
// Traits: what the fa3 forward has (no mask, causal, sliding windows; fp16/bf16; head dims of
// whole swizzle atoms) on a cache of the queries' dtype; ALiBi, soft-capping and e4m3 caches
// run the decode pipeline (instances.yaml).
#pragma once

#include <type_traits>

#include "fmha/kernels/cached_kv_sm90.cuh"
#include "fmha/kernels/fast_divisor.cuh"
#include "fmha/kernels/fwd_fa3_sm90.cuh"
#include "fmha/kernels/kvcache_append.cuh"

namespace fmha::kvcache::chunked_prefill {

// KvElement_: the cache's element type, the generator's kv_element (the decode Config's
// parameter too); the same as Element_ here, as instances.yaml builds no chunked prefill from an
// e4m3 cache yet.
template <typename Element_, typename KvElement_, int kHeadDimQK_, int kHeadDimV_, int kBlockM_,
          int kBlockN_, int kNumWarps_, int kStages_, MaskType kMask_, BiasType kBias_,
          bool kPaged_, bool kSoftcap_, bool kPadSeqlen_, bool kPadHdim_, int kSmemLimit_>
struct Config
    : fa3::FwdConfig<Element_, kHeadDimQK_, kHeadDimV_, kBlockM_, kBlockN_, kNumWarps_,
                     kStages_, kMask_, kBias_, VLayout::kRowMajor, Mode::kBatch, /*kLse=*/true,
                     /*kDropout=*/false, kSoftcap_, kPadSeqlen_, kPadHdim_, kSmemLimit_> {
  static_assert(std::is_same_v<KvElement_, Element_>,
                "chunked prefill reads a cache of the queries' dtype only: an e4m3 cache runs "
                "the decode kernel (instances.yaml prunes kv_dtype=e4m3 on pipeline fa3)");
  using Base = typename Config::FwdConfig;  // the base above, by its injected name
  using KvElement = KvElement_;
  static constexpr bool kPaged = kPaged_;
  // K and V from the cache's pages (cached_kv_sm90.cuh), in place of the call's own tensors.
  using KvLoad = fa3::CachedKvLoad<Config>;
  // The cache's boxes are a few rows by every column (cached_kv_sm90.cuh); the stages keep the
  // forward's size, so its SharedStorage holds them.
  using SmemLayoutK = typename Base::template KvStageLayouts<true>::K;
  using SmemLayoutV = typename Base::template KvStageLayouts<true>::V;
  using SmemLayoutVt = typename Base::template KvStageLayouts<true>::Vt;
  static_assert(cute::cosize_v<SmemLayoutK> == cute::cosize_v<typename Base::SmemLayoutK> &&
                cute::cosize_v<SmemLayoutV> == cute::cosize_v<typename Base::SmemLayoutV>);

  // What the append kernel (kvcache_append.cuh) reads of a config.
  struct Append {
    using Element = Element_;
    using KvElement = KvElement_;
    static constexpr int kHeadDimQK = kHeadDimQK_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr bool kPaged = kPaged_;
    static constexpr bool kPadHdim = kPadHdim_;  // false: FwdConfig static_asserts it
  };

  // The forward's parameters with the cache's tensor maps in place of K's and V's.
  struct KernelParams {
    FwdParams p;
    typename Base::TmaLoadQ tma_q;
    typename Base::TmaStoreO tma_o;
    typename Base::GmemShape q_shape, o_shape;
    int total_tiles;
    bool spread_heads;
    fa3::CachedKv cache;
  };
};

// The rotated q's bytes when the call rotates it; the attention needs no scratch of its own.
template <class Cfg>
size_t workspace_bytes(const KvcacheArgs& a) {
  return rotated_q_bytes(a, Cfg::kHeadDimQK);
}

template <class Cfg>
cudaError_t launch(const KvcacheArgs& a, cudaStream_t stream) {
  using Element = typename Cfg::Element;
  const bool paged = a.block_table != nullptr;
  const int page_size = paged ? a.page_size : a.seqlen_cache;
  const fa3::CacheTensor k_cache{a.k_cache, a.hdim_q, a.k_cache_seq_stride,
                                 a.k_cache_head_stride, a.k_cache_batch_stride};
  const fa3::CacheTensor v_cache{a.v_cache, a.hdim_v, a.v_cache_seq_stride,
                                 a.v_cache_head_stride, a.v_cache_batch_stride};
  fa3::CachedKv cache;
  cache.k.fold = fa3::cache_fold(k_cache, page_size, a.nhead_k, a.batch_cache);
  cache.v.fold = fa3::cache_fold(v_cache, page_size, a.nhead_k, a.batch_cache);
  cache.box_rows = fa3::cache_box_rows<Cfg::kBlockN>(a.page_size, cache.k.fold, cache.v.fold);
  // The dispatcher runs this pipeline on pages of multiples of 8 keys only.
  if (cache.box_rows == 0) return cudaErrorInvalidValue;
  cache.boxes_per_tile = Cfg::kBlockN / cache.box_rows;

  KvcacheParams append = kvcache_params(a);
  if (a.rotary_dim > 0) append.q_rotated = a.workspace;
  if (const cudaError_t err = launch_append<typename Cfg::Append>(append, stream);
      err != cudaSuccess) {
    return err;
  }

  // The attention as the forward sees it: batch mode over the cache's rows, the lengths on
  // the device.
  FwdArgs f;
  f.dtype = a.dtype;
  f.q = append.q;
  f.o = a.o;
  f.lse = a.lse;
  f.batch = a.batch;
  f.seqlen_q = a.seqlen_q;
  f.seqlen_k = a.seqlen_cache;
  f.nhead_q = a.nhead_q;
  f.nhead_k = a.nhead_k;
  f.hdim_q = a.hdim_q;
  f.hdim_v = a.hdim_v;
  f.q_batch_stride = append.q_batch_stride;
  f.q_seq_stride = append.q_seq_stride;
  f.q_head_stride = append.q_head_stride;
  f.o_batch_stride = a.o_batch_stride;
  f.o_seq_stride = a.o_seq_stride;
  f.o_head_stride = a.o_head_stride;
  f.lse_batch_stride = a.lse_batch_stride;
  f.lse_head_stride = a.lse_head_stride;
  f.mode = Mode::kBatch;
  f.seqused_k = a.cache_seqlens;
  f.mask = a.mask;
  f.mask_align = MaskAlign::kBottomRight;
  f.window_left = a.window_left;
  f.window_right = a.window_right;
  f.softmax_scale = a.softmax_scale;

  typename Cfg::KernelParams kp;
  if (const cudaError_t err = fa3::make_kernel_params<Cfg>(f, kp); err != cudaSuccess) {
    return err;
  }
  kp.p.keys_appended = append.seqlen_new;

  cache.block_table = a.block_table;
  cache.cache_batch_idx = a.cache_batch_idx;
  cache.block_table_batch_stride = a.block_table_batch_stride;
  cache.page_size = page_size;
  cache.page_shift = -1;  // read by paged kernels only
  if (paged) {
    const FastDivisor pages(page_size);  // its shift is ceil(log2(page_size))
    if ((1 << pages.shift) == page_size) cache.page_shift = pages.shift;
  }
  cache.pages_per_seq = paged ? a.seqlen_cache / a.page_size : 1;
  cache.heads = a.nhead_k;
  cache.absent_page = a.batch_cache;
  const bool maps_made =
      fa3::encode_cache_map<Element>(&cache.k, k_cache, page_size, a.nhead_k, a.batch_cache,
                                     cache.box_rows) &&
      fa3::encode_cache_map<Element>(&cache.v, v_cache, page_size, a.nhead_k, a.batch_cache,
                                     cache.box_rows);
  if (!maps_made) return cudaErrorInvalidValue;
  kp.cache = cache;
  return fa3::launch_fwd_kernel<Cfg>(kp, static_cast<int64_t>(a.batch) * a.nhead_q, stream);
}

}  // namespace fmha::kvcache::chunked_prefill
