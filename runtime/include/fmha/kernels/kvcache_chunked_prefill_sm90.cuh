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
// whole swizzle atoms) on a cache of the queries' dtype or an e4m3 one (head dims 64 and 128:
// its staging stages do not fit beside d256's); ALiBi and soft-capping run the decode pipeline
// (instances.yaml).
//
// An e4m3 cache (the Config specialization below): the cache's tiles land in staging stages, a
// byte an element, and two producer warps widen them to fp16 (fwd_fa3_kv_widen_sm90.cuh); the
// products run in fp16, bf16 queries converted in the kernel, and O leaves in the queries'
// dtype. k_scale folds into the logits' scale and v_scale into O's, as the decode kernel's do.
#pragma once

#include <type_traits>

#include "fmha/kernels/cached_kv_sm90.cuh"
#include "fmha/kernels/fast_divisor.cuh"
#include "fmha/kernels/fwd_fa3_sm90.cuh"
#include "fmha/kernels/kvcache_append.cuh"

namespace fmha::kvcache::chunked_prefill {

// What the append kernel (kvcache_append.cuh) reads of a config.
template <typename Element_, typename KvElement_, int kHeadDimQK_, int kHeadDimV_, bool kPaged_,
          bool kPadHdim_>
struct AppendConfig {
  using Element = Element_;
  using KvElement = KvElement_;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kPaged = kPaged_;
  static constexpr bool kPadHdim = kPadHdim_;  // false: FwdConfig static_asserts it
};

// The forward's parameters with the cache's tensor maps in place of K's and V's; O's store is
// the config's (an e4m3 cache's O is the queries' dtype, not its fp16 products').
template <class Base, class TmaStoreO>
struct CacheKernelParams {
  FwdParams p;
  typename Base::TmaLoadQ tma_q;
  TmaStoreO tma_o;
  typename Base::GmemShape q_shape, o_shape;
  int total_tiles;
  bool spread_heads;
  fa3::CachedKv cache;
};

// KvElement_: the cache's element type, the generator's kv_element (the decode Config's
// parameter too): Element_ here; __nv_fp8_e4m3 takes the specialization below.
template <typename Element_, typename KvElement_, int kHeadDimQK_, int kHeadDimV_, int kBlockM_,
          int kBlockN_, int kNumWarps_, int kStages_, MaskType kMask_, BiasType kBias_,
          bool kPaged_, bool kSoftcap_, bool kPadSeqlen_, bool kPadHdim_, int kSmemLimit_>
struct Config
    : fa3::FwdConfig<Element_, kHeadDimQK_, kHeadDimV_, kBlockM_, kBlockN_, kNumWarps_,
                     kStages_, kMask_, kBias_, VLayout::kRowMajor, Mode::kBatch, /*kLse=*/true,
                     /*kDropout=*/false, kSoftcap_, kPadSeqlen_, kPadHdim_, kSmemLimit_> {
  static_assert(std::is_same_v<KvElement_, Element_>,
                "chunked prefill reads a cache of the queries' dtype or an e4m3 one");
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

  using Append = AppendConfig<Element_, KvElement_, kHeadDimQK_, kHeadDimV_, kPaged_, kPadHdim_>;
  using KernelParams = CacheKernelParams<Base, typename Base::TmaStoreO>;
};

// Chunked prefill from an e4m3 cache: the forward's kernel in fp16 (its Element), with staging
// stages for the cache's tiles and widened rings between the widening warps and the consumers.
template <typename Element_, int kHeadDimQK_, int kHeadDimV_, int kBlockM_, int kBlockN_,
          int kNumWarps_, int kStages_, MaskType kMask_, BiasType kBias_, bool kPaged_,
          bool kSoftcap_, bool kPadSeqlen_, bool kPadHdim_, int kSmemLimit_>
struct Config<Element_, __nv_fp8_e4m3, kHeadDimQK_, kHeadDimV_, kBlockM_, kBlockN_, kNumWarps_,
              kStages_, kMask_, kBias_, kPaged_, kSoftcap_, kPadSeqlen_, kPadHdim_, kSmemLimit_>
    : fa3::FwdConfig<__half, kHeadDimQK_, kHeadDimV_, kBlockM_, kBlockN_, kNumWarps_, kStages_,
                     kMask_, kBias_, VLayout::kRowMajor, Mode::kBatch, /*kLse=*/true,
                     /*kDropout=*/false, kSoftcap_, kPadSeqlen_, kPadHdim_, kSmemLimit_> {
  using Base = typename Config::FwdConfig;
  using Element = typename Base::Element;  // the products': fp16
  using QueryElement = typename fa3::CuteElement<Element_>::type;
  using OutElement = QueryElement;
  using KvElement = __nv_fp8_e4m3;
  static constexpr bool kQueryBf16 = std::is_same_v<QueryElement, cutlass::bfloat16_t>;
  static constexpr bool kPaged = kPaged_;
  static constexpr bool kWidenKv = true;
  static_assert(kHeadDimQK_ == kHeadDimV_, "the widening warps take one head dim");
  using KvLoad = fa3::CachedKvLoad<Config>;
  using SmemLayoutK = typename Base::template KvStageLayouts<true>::K;
  using SmemLayoutV = typename Base::template KvStageLayouts<true>::V;
  using SmemLayoutVt = typename Base::template KvStageLayouts<true>::Vt;
  // The staging stages, (keys, d, stage) a byte an element: only their stage bases are taken
  // as tensors (CachedKvLoad's boxes); the widening warps address them by their order.
  using StagedLayoutK = cute::Layout<
      cute::Shape<typename Base::BlockN, typename Base::DimQK, cute::Int<kStages_>>,
      cute::Stride<typename Base::DimQK, cute::_1, cute::Int<kBlockN_ * kHeadDimQK_>>>;
  using StagedLayoutV = cute::Layout<
      cute::Shape<typename Base::BlockN, typename Base::DimV, cute::Int<kStages_>>,
      cute::Stride<typename Base::DimV, cute::_1, cute::Int<kBlockN_ * kHeadDimV_>>>;

  // Warps 1 and 2 of the producer warpgroup widen. Their registers are the transposing
  // warps' (fwd_fa3_config_sm90.cuh), 56, and the consumers' 224 (three: 152): at d128 with
  // 40 and 232 the kernel spilled 28 bytes, with 24 and 240 252 bytes (ptxas).
  static constexpr int kWidenThreads = 64;
  using ConsumerKPipeline = cutlass::PipelineAsync<kStages_>;
  using ConsumerVPipeline = ConsumerKPipeline;
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = Base::kConsumerWarpgroups == 2 ? 224 : 152;
  static_assert((Base::kLaunchRegisters - kProducerRegisters) * 128 >=
                    (kConsumerRegisters - Base::kLaunchRegisters) * Base::kConsumerThreads,
                "the consumers' registers must come from the producer's");

  // Q and the K/V stages in 16 bits, the staging stages a byte an element; O over Q where its
  // own region does not fit (d128: 32 + 2 x 64 + 2 x 32 KB = 224 KB).
  static constexpr int kStagedBytes = kStages_ * kBlockN_ * (kHeadDimQK_ + kHeadDimV_);
  static constexpr int kTileBytes =
      2 * (kBlockM_ * kHeadDimQK_ + kStages_ * kBlockN_ * (kHeadDimQK_ + kHeadDimV_)) +
      kStagedBytes;
  static constexpr bool kSeparateO = kTileBytes + 2 * kBlockM_ * kHeadDimV_ + 1024 <= kSmemLimit_;
  using ORegion = std::conditional_t<
      kSeparateO,
      cute::array_aligned<OutElement, Base::kConsumerWarpgroups * Base::kORegion, 1024>,
      typename Base::NoRegion>;
  struct SharedStorage {
    cute::array_aligned<Element, Base::kConsumerWarpgroups * Base::kQRegion, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<uint8_t, cute::cosize_v<StagedLayoutK>, 1024> k_staged;
    cute::array_aligned<uint8_t, cute::cosize_v<StagedLayoutV>, 1024> v_staged;
    ORegion o;
    cutlass::arch::ClusterTransactionBarrier q_full[Base::kConsumerWarpgroups];
    typename Base::Pipeline::SharedStorage k_pipe;  // the staging rings
    typename Base::Pipeline::SharedStorage v_pipe;
    typename ConsumerKPipeline::SharedStorage widened_k_pipe;
    typename ConsumerVPipeline::SharedStorage widened_v_pipe;
    uint32_t query_amax[Base::kConsumerWarpgroups][4];  // widen_query's, a warp's largest
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemLimit_, "the tile does not fit the target's shared memory");
  // What TMA writes a staging stage with.
  static constexpr uint32_t kKBytes = kBlockN_ * kHeadDimQK_;
  static constexpr uint32_t kVBytes = kBlockN_ * kHeadDimV_;

  using TmaStoreO = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<OutElement*>(nullptr)),
                        typename Base::GmemLayout{}),
      typename Base::SmemLayoutO{}, cute::Shape<cute::_64, typename Base::DimV>{}, cute::_1{}));

  using Append =
      AppendConfig<Element_, __nv_fp8_e4m3, kHeadDimQK_, kHeadDimV_, kPaged_, kPadHdim_>;
  using KernelParams = CacheKernelParams<Base, TmaStoreO>;
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
  if constexpr (Cfg::kWidenKv) {  // the consumers' descales (fwd_fa3_sm90.cuh's Descales)
    f.k_descale = a.k_scale;
    f.v_descale = a.v_scale;
    f.k_descale_batch_stride = a.k_scale_batch_stride;
    f.k_descale_head_stride = a.k_scale_head_stride;
    f.v_descale_batch_stride = a.v_scale_batch_stride;
    f.v_descale_head_stride = a.v_scale_head_stride;
  }

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
  using CacheElement = std::conditional_t<Cfg::kWidenKv, __nv_fp8_e4m3, Element>;
  const bool maps_made =
      fa3::encode_cache_map<CacheElement>(&cache.k, k_cache, page_size, a.nhead_k, a.batch_cache,
                                          cache.box_rows) &&
      fa3::encode_cache_map<CacheElement>(&cache.v, v_cache, page_size, a.nhead_k, a.batch_cache,
                                          cache.box_rows);
  if (!maps_made) return cudaErrorInvalidValue;
  kp.cache = cache;
  return fa3::launch_fwd_kernel<Cfg>(kp, static_cast<int64_t>(a.batch) * a.nhead_q, stream);
}

}  // namespace fmha::kvcache::chunked_prefill
