// The fa3 forward's configuration (fwd_fa3_sm90.cuh): the tile and its warpgroups, the register
// split, the shared-memory layout and the TMA copy types, checked against what the kernel
// assumes; the load policy for K and V; the named barriers its roles meet at; a consumer
// thread's place (ConsumerWarpgroup); and the shared-memory tensors the stages address.
#pragma once

#include <cstdint>
#include <type_traits>

// First: it sets how CuTe is configured before any CuTe header.
#include "fmha/kernels/sm90_primitives.cuh"

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "fmha/fmha.h"
#include "fmha/kernels/fwd_params.cuh"

namespace fmha::fa3 {

template <class Cfg>
class TmaKvLoad;

template <typename Element_, int kHeadDimQK_, int kHeadDimV_, int kBlockM_, int kBlockN_,
          int kNumWarps_, int kStages_, MaskType kMask_, BiasType kBias_, VLayout kVLayout_,
          Mode kMode_, bool kLse_, bool kDropout_, bool kSoftcap_, bool kPadSeqlen_,
          bool kPadHdim_, int kSmemLimit_>
struct FwdConfig {
  using Element = typename CuteElement<Element_>::type;  // Q, K and V
  // e4m3 inputs: wgmma reads 8-bit operands K-major only, so the PV product reads V^T (keys
  // contiguous), P is cast to e4m3 and moved into the k32 A-operand layout before P V
  // (convert_p_e4m3), and O leaves in bf16 or fp16 (the call's, FwdParams::o_fp16: OutElement
  // is bf16, and an fp16 O its bits, since only the epilogue's rounding differs). V^T either
  // arrives so (vlayout=col: TMA copies it into the consumers' stages) or is made from a
  // row-major V (vlayout=row, what models hold): TMA lands the row-major tiles in a ring of their
  // own and two more warps of the producer warpgroup transpose each into the consumers' V^T
  // stages (fwd_fa3_v_transpose_sm90.cuh).
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static constexpr bool kVtInGlobal = kVLayout_ == VLayout::kColMajor;
  static constexpr bool kTransposeV = kFp8 && !kVtInGlobal;
  using OutElement = std::conditional_t<kFp8, cutlass::bfloat16_t, Element>;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr MaskType kMask = kMask_;
  static constexpr Mode kMode = kMode_;
  static constexpr bool kLse = kLse_;
  // Where K and V come from (fwd_fa3_producer_sm90.cuh): the call's own tensors, a whole key
  // tile a TMA box. Chunked prefill's Config (kvcache_chunked_prefill_sm90.cuh) reads them from a
  // KV cache instead (CachedKvLoad, cached_kv_sm90.cuh).
  using KvLoad = TmaKvLoad<FwdConfig>;

  static_assert(kBias_ == BiasType::kNone && !kDropout_ && !kSoftcap_,
                "fa3 has no bias, dropout or soft-cap yet: those instances are fa2");
  static_assert(kFp8 || !kVtInGlobal, "fa3 reads 16-bit V row-major (V^T is fa2)");
  static_assert(kPadSeqlen_ && !kPadHdim_,
                "fa3 serves every sequence length (pad_seqlen) and exact head dims only");
  static_assert(kHeadDimQK % 64 == 0 && kHeadDimV % 64 == 0 && kHeadDimV <= kHeadDimQK,
                "fa3 head dims are whole 128-byte swizzle atoms, and O is staged over Q");
  static_assert(kBlockM % 64 == 0, "each consumer warpgroup owns 64 query rows (wgmma M)");
  static_assert(kBlockN % (kFp8 ? 32 : 16) == 0 && kBlockN <= 256,
                "key tiles are wgmma N <= 256, and whole k-steps of P V (k16, or k32 for e4m3)");
  static_assert(kStages >= 2, "K and V need at least double buffering");

  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3,
                "the register split and the ping-pong barriers are for 2 or 3 consumers");
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static_assert(kNumWarps_ * 32 == kThreads, "warps = 4 * (block_m / 64 + 1)");
  // setmaxnreg moves registers between warpgroups within what the CTA got at launch, which
  // __launch_bounds__(kThreads, 1) caps at 65536 / kThreads (168 for 384 threads, 128 for
  // 512): what the producer gives up must cover what the consumers take, or their
  // setmaxnreg.inc waits forever. Two consumers: 168 -> 24 frees 144 x 128, and 168 -> 240
  // takes 72 x 256; three: 128 -> 32 frees 96 x 128, and 128 -> 160 takes 32 x 384. The
  // transposing warps want 56 (two key groups' loads in flight spilled 44 bytes at 40, e4m3
  // d128), so those consumers get 224 or 152 (224 read the same as 240 on the V^T instances:
  // 807-817 TFLOP/s at d128, H200).
  static constexpr int kLaunchRegisters = (65536 / kThreads) / 8 * 8;
  static constexpr int kProducerRegisters =
      kTransposeV ? 56 : (kConsumerWarpgroups == 2 ? 24 : 32);
  static constexpr int kConsumerRegisters =
      kConsumerWarpgroups == 2 ? (kTransposeV ? 224 : 240) : (kTransposeV ? 152 : 160);
  static_assert((kLaunchRegisters - kProducerRegisters) * 128 >=
                    (kConsumerRegisters - kLaunchRegisters) * kConsumerThreads,
                "the consumers' registers must come from the producer's");

  using BlockN = cute::Int<kBlockN>;
  using DimQK = cute::Int<kHeadDimQK>;
  using DimV = cute::Int<kHeadDimV>;
  // One warpgroup's GEMMs (64 query rows). Each consumer warpgroup partitions its own Q and O
  // tensors, whose addresses are warp-uniform, so the wgmma descriptors live in uniform
  // registers: as per-thread values the 16 Q descriptors of d256 took 32 of the 240 registers.
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, BlockN, DimQK>>()));
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, DimV, BlockN>,
                                 cute::GMMA::Major::K,
                                 kFp8 ? cute::GMMA::Major::K : cute::GMMA::Major::MN>()));
  static_assert(wgmma_n<TiledMmaS> == kBlockN && wgmma_n<TiledMmaO> == kHeadDimV,
                "a wgmma N outside CuTe's base shapes: the TU must define "
                "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED first (sm90_primitives.cuh)");

  // Rows of 128 bytes (64 16-bit elements, 128 e4m3 ones) in 8-row swizzle atoms: what TMA
  // writes and wgmma reads. e4m3 rows of 64 bytes (d64) take the 64-byte swizzle.
  using SwizzleAtom = KMajorSwizzleAtom<Element, kHeadDimQK>;
  // Q and O: one (64, d) region per consumer warpgroup.
  using SmemLayoutQ = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<cute::_64, DimQK>{}));
  // K and V stages, (keys, d, stage). kRowGroupsOuter false: 64-column blocks of kBlockN rows,
  // what a TMA box of a whole (kBlockN, 64) tile writes. true: each 8-row group's column blocks
  // side by side, what a box of a few rows by every column writes (a KV cache's pages,
  // cached_kv_sm90.cuh). wgmma reads either through the descriptors cute derives from them.
  template <bool kRowGroupsOuter>
  struct KvStageLayouts {
    using Order = std::conditional_t<kRowGroupsOuter, cute::Step<cute::_2, cute::_1, cute::_3>,
                                     cute::Step<cute::_1, cute::_2, cute::_3>>;
    using K = decltype(cute::tile_to_shape(
        SwizzleAtom{}, cute::Shape<BlockN, DimQK, cute::Int<kStages>>{}, Order{}));
    using V = decltype(cute::tile_to_shape(
        SwizzleAtom{}, cute::Shape<BlockN, DimV, cute::Int<kStages>>{}, Order{}));
    // V as the PV product's B operand, (d, keys): the same bytes, viewed transposed.
    using Vt = decltype(cute::composition(
        V{}, cute::make_ordered_layout(cute::Shape<DimV, BlockN, cute::Int<kStages>>{},
                                       cute::Step<cute::_2, cute::_1, cute::_3>{})));
  };
  // e4m3 V^T stages, (d, keys, stage) with the keys contiguous, as the PV product reads them
  // (K-major): what TMA copies from a column-major V, or what the transposing warps write.
  using SmemLayoutVtFp8 = decltype(cute::tile_to_shape(
      KMajorSwizzleAtom<Element, kBlockN>{}, cute::Shape<DimV, BlockN, cute::Int<kStages>>{}));
  using SmemLayoutK = typename KvStageLayouts<false>::K;
  // Where V's TMA copies land (VBox tiles), and V as the PV product reads it.
  using SmemLayoutV = std::conditional_t<kFp8 && kVtInGlobal, SmemLayoutVtFp8,
                                         typename KvStageLayouts<false>::V>;
  using SmemLayoutVt =
      std::conditional_t<kFp8, SmemLayoutVtFp8, typename KvStageLayouts<false>::Vt>;
  using SmemLayoutO = decltype(cute::tile_to_shape(KMajorSwizzleAtom<OutElement, kHeadDimV>{},
                                                   cute::Shape<cute::_64, DimV>{}));

  // K and V's TMA rings. Transposing, the V^T stages are a second ring between the transposing
  // warps and the consumers, its stages full when all kTransposeThreads have written theirs.
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr int kTransposeThreads = 64;  // warps 1 and 2 of the producer warpgroup
  using VtPipeline = cutlass::PipelineAsync<kStages>;
  using ConsumerVPipeline = std::conditional_t<kTransposeV, VtPipeline, Pipeline>;
  // Chunked prefill from an e4m3 cache (kvcache_chunked_prefill_sm90.cuh) lands the cache's
  // tiles in staging stages and widens them into K and V stages of rings of their own
  // (fwd_fa3_kv_widen_sm90.cuh): its config says so and names the consumers' K ring.
  static constexpr bool kWidenKv = false;
  using ConsumerKPipeline = Pipeline;

  // Shared memory one CTA may opt into on the target (generator/schema.py's smem_limit: 227 KB
  // on H100/H200).
  static constexpr int kSmemLimit = kSmemLimit_;
  // O gets its own region where it fits: a warpgroup's next Q then loads
  // while it finishes its last PV product and stores O. Otherwise (d256) each warpgroup stages
  // O over its own Q rows, and its next Q waits for the store.
  static constexpr int kTileBytes = static_cast<int>(
      sizeof(Element) * (kBlockM * kHeadDimQK +
                         kStages * kBlockN * (kHeadDimQK + (kTransposeV ? 2 : 1) * kHeadDimV)));
  static constexpr bool kSeparateO =
      kTileBytes + static_cast<int>(sizeof(OutElement)) * kBlockM * kHeadDimV + 1024 <= kSmemLimit;
  static_assert(kSeparateO || sizeof(OutElement) <= sizeof(Element),
                "a bf16 O from e4m3 inputs does not fit over Q: it needs its own region");
  struct NoRegion {};
  static constexpr int kQRegion = cute::cosize_v<SmemLayoutQ>;  // elements per warpgroup
  static constexpr int kORegion = cute::cosize_v<SmemLayoutO>;
  using ORegion = std::conditional_t<
      kSeparateO, cute::array_aligned<OutElement, kConsumerWarpgroups * kORegion, 1024>,
      NoRegion>;
  // Transposing, the consumers' V^T stages and their ring (v holds the row-major tiles); a base
  // of SharedStorage, so that it takes no bytes and moves no member where it is empty.
  struct TransposeStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> vt;
    typename VtPipeline::SharedStorage vt_pipe;
  };

  struct SharedStorage : std::conditional_t<kTransposeV, TransposeStorage, NoRegion> {
    cute::array_aligned<Element, kConsumerWarpgroups * kQRegion, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    ORegion o;
    cutlass::arch::ClusterTransactionBarrier q_full[kConsumerWarpgroups];
    typename Pipeline::SharedStorage k_pipe;
    typename Pipeline::SharedStorage v_pipe;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemLimit, "the tile does not fit the target's shared memory");

  static constexpr uint32_t kQBytes = 64 * kHeadDimQK * sizeof(Element);  // per warpgroup
  static constexpr uint32_t kKBytes = kBlockN * kHeadDimQK * sizeof(Element);
  static constexpr uint32_t kVBytes = kBlockN * kHeadDimV * sizeof(Element);

  // Global tensors as TMA sees them: (rows, head dim, head, batch). Group mode packs every
  // sequence along rows and has a batch extent of 1.
  using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemLayout = cute::Layout<GmemShape, GmemStride>;
  using TmaLoadQ = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      SmemLayoutQ{}, cute::Shape<cute::_64, DimQK>{}, cute::_1{}));
  using TmaLoadK = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      cute::take<0, 2>(SmemLayoutK{}), cute::Shape<BlockN, DimQK>{}, cute::_1{}));
  // V's box: a (keys, d) tile, or a (d, keys) tile of a V^T.
  using VBox =
      std::conditional_t<kVtInGlobal, cute::Shape<DimV, BlockN>, cute::Shape<BlockN, DimV>>;
  using TmaLoadV = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      cute::take<0, 2>(SmemLayoutV{}), VBox{}, cute::_1{}));
  using TmaStoreO = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<OutElement*>(nullptr)), GmemLayout{}),
      SmemLayoutO{}, cute::Shape<cute::_64, DimV>{}, cute::_1{}));

  struct KernelParams {
    FwdParams p;
    TmaLoadQ tma_q;
    TmaLoadK tma_k;
    TmaLoadV tma_v;
    TmaStoreO tma_o;
    GmemShape q_shape, k_shape, v_shape, o_shape;
    int total_tiles;  // m_blocks * nhead_q * batch
    // The L2-blind order (query tile slowest, FMHA_FA3_SPREAD_HEADS set): for measuring what
    // the head-major order gains, e.g. at S = 32k and 64k; never the default.
    bool spread_heads;
  };
};

// Named barriers. Nine are needed with three consumer warpgroups, one more than
// cutlass::arch::NamedBarrier leaves its users (it reserves 8 of the 16), and this kernel uses
// none of CUTLASS's collectives that take those, so it numbers its own from 1 (0 is
// __syncthreads).
enum Barrier : uint32_t {
  kQueryEmptyFirst = 1,  // + w: warpgroup w -> producer warp: its Q rows may take the next Q
  kSchedulerFirst = 4,   // + w: consumer warpgroup w may issue its GEMMs (ping-pong)
  kWarpgroupFirst = 7,   // + w: the 128 threads of consumer warpgroup w
};

// A consumer thread's place: its warpgroup owns query rows [64 index, 64 index + 64) of the
// tile, and the thread holds rows row0 and row0 + 8 of the warpgroup's wgmma accumulators.
struct ConsumerWarpgroup {
  int index;     // which 64 query rows
  int consumer;  // 0 .. kConsumerThreads - 1
  int thread;    // 0 .. 127 within the warpgroup
  int lane;
  int row0;      // counted from the tile's first row
  bool leader;

  __device__ __forceinline__ ConsumerWarpgroup(int warpgroup, int lane_)
      : index(warpgroup - 1),
        consumer(threadIdx.x - 128),
        thread(threadIdx.x % 128),
        lane(lane_),
        row0(index * 64 + thread / 32 * 16 + lane / 4),
        leader(thread == 0) {}

  // The warpgroup's 128 threads meet.
  __device__ void sync() const { barrier_sync(Barrier::kWarpgroupFirst + index, 128); }
  // Its Q rows may take the next tile's Q (the producer warp waits for this, once per tile).
  __device__ void release_query() const {
    barrier_arrive(Barrier::kQueryEmptyFirst + index, 128 + 32);
  }
};

// Rings between warps of the producer warpgroup and other threads. Warp 0 issues TMA; the
// next `threads` threads rewrite what it lands (VTranspose, KvWiden). A TMA ring that feeds
// them: warp 0 produces, they consume, the rest do not take part.
template <class Params>
__device__ __forceinline__ void feed_producer_warps(Params& params, int threads) {
  using Role = decltype(params.role);
  params.role = threadIdx.x < 32             ? Role::Producer
                : threadIdx.x < 32 + threads ? Role::Consumer
                                             : Role::NonParticipant;
  params.num_consumers = threads;
}
// The ring they fill for the consumer warpgroups (a cutlass::PipelineAsync's parameters).
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params producer_warps_ring(int warpgroup, int threads,
                                                                         int consumer_threads) {
  typename Pipeline::Params params;
  const bool fills = threadIdx.x >= 32 && threadIdx.x < 32 + threads;
  params.role = warpgroup != 0 ? Pipeline::ThreadCategory::Consumer
                : fills        ? Pipeline::ThreadCategory::Producer
                               : Pipeline::ThreadCategory::NonParticipant;
  params.producer_arv_count = threads;
  params.consumer_arv_count = consumer_threads;
  return params;
}

// Shared-memory tensors of a config's SharedStorage, in the config's layouts: chunked
// prefill's Config keeps the forward's storage but lays K and V out its own way.
//
// Warpgroup w's 64 query rows: Q, and O (over Q without a region of its own).
template <class Cfg>
__device__ auto query_rows(typename Cfg::SharedStorage& shared, int w) {
  return cute::make_tensor(cute::make_smem_ptr(shared.q.data() + w * Cfg::kQRegion),
                           typename Cfg::SmemLayoutQ{});
}
template <class Cfg>
__device__ auto output_rows(typename Cfg::SharedStorage& shared, int w) {
  typename Cfg::OutElement* region;
  if constexpr (Cfg::kSeparateO) {
    region = shared.o.data() + w * Cfg::kORegion;
  } else {  // the same 16-bit size (the config asserts it), if not the same type
    region = reinterpret_cast<typename Cfg::OutElement*>(shared.q.data() + w * Cfg::kQRegion);
  }
  return cute::make_tensor(cute::make_smem_ptr(region), typename Cfg::SmemLayoutO{});
}
// The K and V rings' stages, (keys, d, stage) (an e4m3 V^T's: (d, keys, stage)), and V as the
// PV product reads it, (d, keys, stage).
template <class Cfg>
__device__ __forceinline__ auto k_stages(typename Cfg::SharedStorage& shared) {
  return cute::make_tensor(cute::make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutK{});
}
template <class Cfg>
__device__ __forceinline__ auto v_stages(typename Cfg::SharedStorage& shared) {
  return cute::make_tensor(cute::make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutV{});
}
template <class Cfg>
__device__ __forceinline__ auto vt_stages(typename Cfg::SharedStorage& shared) {
  if constexpr (Cfg::kTransposeV) {
    return cute::make_tensor(cute::make_smem_ptr(shared.vt.data()), typename Cfg::SmemLayoutVt{});
  } else {
    return cute::make_tensor(cute::make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutVt{});
  }
}

}  // namespace fmha::fa3
