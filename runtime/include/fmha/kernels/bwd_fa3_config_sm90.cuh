// The fa3 backward's configuration (bwd_fa3_sm90.cuh): how the two consumer warpgroups split a
// CTA's work (WorkSplit), the tile and its register split, the GEMMs of each warpgroup, the
// shared-memory layout and the TMA copy types, checked against what the kernel assumes; the
// named barriers its roles meet at; and where a query tile's dQ sits in the fp32 accumulator.
#pragma once

#include <cstdint>
#include <type_traits>

// First: it sets how CuTe is configured before any CuTe header.
#include "fmha/kernels/sm90_primitives.cuh"

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "fmha/fmha.h"
#include "fmha/kernels/bwd_common.cuh"
#include "fmha/kernels/fwd_params.cuh"

namespace fmha::fa3 {

// How the two consumer warpgroups share a CTA's work; the tile picks it (work_split), as
// instances.yaml's bwd tiles say.
enum class WorkSplit {
  // The key split (block_n 128, head dims up to 128): each owns 64 of the keys (wgmma's M)
  // with their dK and dV of the whole head dim.
  kKeys,
  // The head-dim split (block_n 64, head dims of 256, FlashAttention-3's dKV_swapAB in effect):
  // dK and dV of 64 keys over 256 columns are 256 fp32 registers a thread, so both warpgroups
  // take the same 64 keys, each with dK, dV and dQ of half the head dim (128 registers of dK
  // and dV), and each computes S^T and dP^T for half of the step's queries; P^T joins dS^T in
  // shared memory, where both warpgroups read the whole of each.
  kHeadDim,
  // The head-dim split by products (block_n 64, head dims (192, 128)): both warpgroups take the
  // same 64 keys as with kHeadDim, but split the products rather than each one's columns (a
  // warpgroup's 96 columns of dK or dQ would start half-way through a swizzle atom of Q^T or
  // K^T): warpgroup 0 computes dV and dK's first 128 columns, warpgroup 1 dK's last 64 and dQ,
  // 256 columns of products each.
  kProducts,
};

// 128 keys are two warpgroups' wgmma M; 64 keys are one, which both warpgroups share.
constexpr WorkSplit work_split(int block_n, int hdim_qk, int hdim_v) {
  return block_n == 128      ? WorkSplit::kKeys
         : hdim_qk == hdim_v ? WorkSplit::kHeadDim
                             : WorkSplit::kProducts;
}

template <typename Element_, int kHeadDimQK_, int kHeadDimV_, int kBlockM_, int kBlockN_,
          int kNumWarps_, int kStages_, MaskType kMask_, BiasType kBias_, Mode kMode_,
          bool kDbias_, bool kDropout_, bool kSoftcap_, bool kPadSeqlen_, bool kPadHdim_,
          int kSmemLimit_>
struct BwdConfig {
  using Element = Element_;  // __half or __nv_bfloat16, as bwd_common.cuh's kernels take it
  using MmaElement = typename CuteElement<Element_>::type;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kStages = kStages_;  // of the Q and dO rings
  static constexpr MaskType kMask = kMask_;
  static constexpr Mode kMode = kMode_;
  static constexpr bool kPadHdim = kPadHdim_;

  static_assert(kBias_ == BiasType::kNone && !kDbias_ && !kDropout_ && !kSoftcap_,
                "the fa3 backward has no bias, dropout or soft-cap yet: those instances are fa2");
  static_assert(kPadSeqlen_ && !kPadHdim,
                "fa3 serves every sequence length (pad_seqlen) and exact head dims only");
  static constexpr WorkSplit kWorkSplit = work_split(kBlockN, kHeadDimQK, kHeadDimV);
  // Both warpgroups on the same 64 keys: the head-dim split, even or by products.
  static constexpr bool kSplitHeadDim = kWorkSplit != WorkSplit::kKeys;
  static constexpr bool kSplitProducts = kWorkSplit == WorkSplit::kProducts;
  static_assert(kSplitProducts ? kHeadDimQK == 192 && kHeadDimV == 128
                : kSplitHeadDim ? kHeadDimQK == kHeadDimV && kHeadDimQK % 128 == 0 &&
                                      kHeadDimQK <= 256
                                : kHeadDimQK % 64 == 0 && kHeadDimV % 64 == 0 &&
                                      kHeadDimQK <= 128 && kHeadDimV <= 128,
                "head dims are whole 128-byte swizzle atoms (per warpgroup's part with the "
                "head-dim split), and a consumer's dK and dV fit its registers");
  static_assert(kBlockN == 64 || kBlockN == 128,
                "two consumer warpgroups of 64 keys (wgmma's M), or both on 64 keys");
  static_assert(kSplitHeadDim ? kBlockM == 64
                              : (kBlockM == 64 || kBlockM == 128) &&
                                    kBlockM * (kHeadDimQK + kHeadDimV) <= 16384,
                "64 or 128 query rows per step (whole 128-byte swizzle atoms across dS^T's rows, "
                "m64 blocks of dQ): S^T and dP^T of 64 x kBlockM per warpgroup beside dK and dV "
                "in registers, so 128 rows only where dK and dV are 64 columns; 64 with the "
                "head-dim split, whose K, V, Q and dO tiles fill shared memory");
  static_assert(kStages == 2, "Q and dO are double-buffered");

  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static_assert(kNumWarps_ * 32 == kThreads, "12 warps: a producer and two consumer warpgroups");
  // As the forward's two-consumer split (fwd_fa3_sm90.cuh): 168 at launch, the producer gives
  // 144 x 128 registers up and the consumers take 72 x 256.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;

  using BlockM = cute::Int<kBlockM>;
  using BlockN = cute::Int<kBlockN>;
  using DimQK = cute::Int<kHeadDimQK>;
  using DimV = cute::Int<kHeadDimV>;
  using Stages = cute::Int<kStages>;
  // One consumer warpgroup's GEMMs. Key split: warpgroup w owns keys [64 w, 64 w + 64), all
  // of the step's queries and dK's and dV's head dims. Head-dim split: all 64 keys, queries
  // [w m / 2, (w + 1) m / 2) of S^T and dP^T, and dK's and dV's columns [w d / 2, (w + 1) d / 2).
  // Both: dQ's head-dim columns [w d / 2, (w + 1) d / 2); each warpgroup partitions its own
  // slices of the operands.
  // With the products split: warpgroup 0's dK columns and its dV (all of them), and dQ in two
  // slices of 128 and 64 columns, both warpgroup 1's; kDKTailCols of dK are warpgroup 1's.
  static constexpr int kDQSliceCols = kSplitProducts ? 128 : kHeadDimQK / kConsumerWarpgroups;
  static constexpr int kSdPQueries = kSplitHeadDim ? kBlockM / kConsumerWarpgroups : kBlockM;
  static constexpr int kDKCols = kSplitProducts  ? 128
                                 : kSplitHeadDim ? kHeadDimQK / kConsumerWarpgroups
                                                 : kHeadDimQK;
  static constexpr int kDVCols = kSplitHeadDim && !kSplitProducts
                                     ? kHeadDimV / kConsumerWarpgroups
                                     : kHeadDimV;
  static constexpr int kDKTailCols = kHeadDimQK - kDKCols;
  using SdPQueries = cute::Int<kSdPQueries>;
  using DKCols = cute::Int<kDKCols>;
  using DVCols = cute::Int<kDVCols>;
  // S^T = K Q^T and dP^T = V dO^T: (keys, queries), both operands K-major in shared memory
  // (the two differ only in K, which the partitions take from the operands).
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<MmaElement, MmaElement, float,
                                 cute::Shape<cute::_64, SdPQueries, DimQK>>()));
  // dV += P^T dO and dK += dS^T Q: (keys, head dim), B (dO, Q) read transposed: its head dim is
  // contiguous (MN-major). A (P^T, dS^T) from registers with the key split, where a warpgroup
  // computed them for all the step's queries; from shared memory with the head-dim split.
  template <int kCols>
  using DKVMmaOp = std::conditional_t<
      kSplitHeadDim,
      decltype(cute::GMMA::ss_op_selector<MmaElement, MmaElement, float,
                                          cute::Shape<cute::_64, cute::Int<kCols>, BlockM>,
                                          cute::GMMA::Major::K, cute::GMMA::Major::MN>()),
      decltype(cute::GMMA::rs_op_selector<MmaElement, MmaElement, float,
                                          cute::Shape<cute::_64, cute::Int<kCols>, BlockM>,
                                          cute::GMMA::Major::K, cute::GMMA::Major::MN>())>;
  using TiledMmaDV = decltype(cute::make_tiled_mma(DKVMmaOp<kDVCols>{}));
  using TiledMmaDK = decltype(cute::make_tiled_mma(DKVMmaOp<kDKCols>{}));
  // The products split's warpgroup 1: dK's last columns (an unused 64 x 64 stand-in elsewhere).
  using TiledMmaDKTail =
      decltype(cute::make_tiled_mma(DKVMmaOp<kSplitProducts ? kDKTailCols : 64>{}));
  // dQ = dS K: (queries, the warpgroup's head-dim columns) in m64 blocks, dS read transposed
  // out of dS^T (queries contiguous) and K read transposed (head dim contiguous), both MN-major.
  template <int kCols>
  using DQMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<MmaElement, MmaElement, float,
                                 cute::Shape<cute::_64, cute::Int<kCols>, BlockN>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>()));
  using TiledMmaDQ = DQMma<kDQSliceCols>;
  // The products split's second dQ slice (an unused 64-column stand-in elsewhere).
  using TiledMmaDQTail = DQMma<kSplitProducts ? kHeadDimQK - kDQSliceCols : 64>;
  static_assert(wgmma_n<TiledMmaSdP> == kSdPQueries && wgmma_n<TiledMmaDV> == kDVCols &&
                    wgmma_n<TiledMmaDK> == kDKCols && wgmma_n<TiledMmaDQ> == kDQSliceCols &&
                    (!kSplitProducts || (wgmma_n<TiledMmaDKTail> == kDKTailCols &&
                                         wgmma_n<TiledMmaDQTail> == kHeadDimQK - kDQSliceCols)),
                "a wgmma N outside CuTe's base shapes: the TU must define "
                "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED first (sm90_primitives.cuh)");

  // Rows of 64 elements (128 bytes) in 8-row swizzle atoms: what TMA writes and wgmma reads.
  using SwizzleAtom = cute::GMMA::Layout_K_SW128_Atom<MmaElement>;
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockM, DimQK, Stages>{}));
  using SmemLayoutDo =
      decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockM, DimV, Stages>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockN, DimQK>{}));
  using SmemLayoutV = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockN, DimV>{}));
  // dS^T, (keys, queries), two buffers: a warpgroup writes step i + 1's while the other may
  // still read step i's in its GEMMs. With the head-dim split, P^T's two follow (2 + i % 2).
  static constexpr int kDsBuffers = kSplitHeadDim ? 4 : 2;
  using SmemLayoutDsT = decltype(cute::tile_to_shape(
      SwizzleAtom{}, cute::Shape<BlockN, BlockM, cute::Int<kDsBuffers>>{}));
  // The same bytes viewed transposed, as the MN-major operands.
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_ordered_layout(cute::Shape<DimQK, BlockM, Stages>{},
                                               cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutDot = decltype(cute::composition(
      SmemLayoutDo{}, cute::make_ordered_layout(cute::Shape<DimV, BlockM, Stages>{},
                                                cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{},
      cute::make_ordered_layout(cute::Shape<DimQK, BlockN>{}, cute::Step<cute::_2, cute::_1>{})));
  using SmemLayoutDs = decltype(cute::composition(
      SmemLayoutDsT{},
      cute::make_ordered_layout(cute::Shape<BlockM, BlockN, cute::Int<kDsBuffers>>{},
                                cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // dQ's tile (kBlockM x kHeadDimQK) is kConsumerWarpgroups slices of head-dim columns. The
  // key split and the products split hand it to the writer warp through shared memory; the
  // even head-dim split has no room for its 64 KB beside two stages of Q and dO, so each
  // consumer adds its registers into the accumulator with float4 atomics (as FlashAttention-3
  // does at head dim 256).
  static constexpr int kDQSliceFloats = kBlockM * kDQSliceCols;
  static constexpr bool kDqWriterWarp = kWorkSplit != WorkSplit::kHeadDim;
  // The floats of slice w: the products split's last slice is narrower.
  static constexpr int dq_slice_floats(int w) {
    return w == kConsumerWarpgroups - 1 ? kBlockM * (kHeadDimQK - w * kDQSliceCols)
                                        : kDQSliceFloats;
  }
  // dQ of one step for the writer warp, its slices in the accumulator's register order (one
  // per consumer warpgroup with the key split; both warpgroup 1's with the products split).
  struct DqSlices {
    alignas(128) float slice[kConsumerWarpgroups][kDQSliceFloats];
  };
  struct NoDqSlices {};
  using DqStaging = std::conditional_t<kDqWriterWarp, DqSlices, NoDqSlices>;

  using RingPipeline = cutlass::PipelineTmaAsync<kStages>;  // Q (+ LSE), dO (+ D)
  using KVPipeline = cutlass::PipelineTmaAsync<1>;          // K and V of the CTA's key tile

  struct SharedStorage {
    cute::array_aligned<MmaElement, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<MmaElement, cute::cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<MmaElement, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<MmaElement, cute::cosize_v<SmemLayoutDo>, 1024> dout;
    cute::array_aligned<MmaElement, cute::cosize_v<SmemLayoutDsT>, 1024> ds;
    DqStaging dq;
    alignas(16) float lse[kStages][kBlockM];  // log2 units
    alignas(16) float dpsum[kStages][kBlockM];
    typename RingPipeline::SharedStorage q_pipe;
    typename RingPipeline::SharedStorage do_pipe;
    typename KVPipeline::SharedStorage kv_pipe;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemLimit_, "the tile does not fit the target's shared memory");

  static constexpr uint32_t kRowStatBytes = kBlockM * sizeof(float);
  static constexpr uint32_t kQStepBytes = kBlockM * kHeadDimQK * sizeof(MmaElement) + kRowStatBytes;
  static constexpr uint32_t kDoStepBytes = kBlockM * kHeadDimV * sizeof(MmaElement) + kRowStatBytes;
  static constexpr uint32_t kKVBytes = kBlockN * (kHeadDimQK + kHeadDimV) * sizeof(MmaElement);

  // Global tensors as TMA sees them: (rows, head dim, head, batch).
  using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemLayout = cute::Layout<GmemShape, GmemStride>;
  template <class SmemTile, class Box>
  using TmaLoad = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<MmaElement const*>(nullptr)), GmemLayout{}),
      SmemTile{}, Box{}, cute::_1{}));
  using TmaLoadQ = TmaLoad<decltype(cute::take<0, 2>(SmemLayoutQ{})), cute::Shape<BlockM, DimQK>>;
  using TmaLoadDo = TmaLoad<decltype(cute::take<0, 2>(SmemLayoutDo{})), cute::Shape<BlockM, DimV>>;
  using TmaLoadK = TmaLoad<SmemLayoutK, cute::Shape<BlockN, DimQK>>;
  using TmaLoadV = TmaLoad<SmemLayoutV, cute::Shape<BlockN, DimV>>;

  struct KernelParams {
    BwdParams p;
    TmaLoadQ tma_q;
    TmaLoadDo tma_do;
    TmaLoadK tma_k;
    TmaLoadV tma_v;
    GmemShape q_shape, do_shape, k_shape, v_shape;
    // Kernel 1's row statistics, (nhead_q, padded_rows) in the padded layout (padded_row0);
    // p.dq_accum holds per split (nhead_q, padded_rows / kBlockM) tiles of kBlockM x kHeadDimQK
    // floats, each as the kernel's shared dQ tile holds it (dq_tile_offset).
    float* lse_log2;
    float* dpsum;
    int64_t padded_rows;
    int seqlen_q_rounded;  // the longest sequence's seqlen_q, up to whole query tiles
    int group_heads;       // causal order: (K/V head, sequence) pairs per L2 group
  };
};

// Named barriers of the consumer warpgroups (0 is __syncthreads).
enum BwdBarrier : uint32_t {
  kDsWritten = 1,       // both warpgroups' dS^T rows are in shared memory: dQ may read them
  kTailZeroed = 2,      // rows past the sequence are zeroed in shared memory: GEMMs may read them
  kDqEmptyFirst = 3,    // + w: the writer has read warpgroup w's dQ slice; w may write the next
  kDqFullFirst = 5,     // + w: warpgroup w's dQ slice is in shared memory; the writer may add it
  kWarpgroupFirst = 7,  // + w: the 128 threads of consumer warpgroup w
};

// Threads meeting at kDqEmpty/kDqFull: a consumer warpgroup and the writer warp.
constexpr uint32_t kDqBarrierThreads = 128 + 32;

// Where dQ(row, col) of a query tile sits in the tile's accumulator (and in the shared dQ
// tile): slice w holds columns [w S, w S + N) (N = S but for the products split's last, 64 of
// 128) as one warpgroup's wgmma accumulator of 64 x N per m64 block, float4 j of thread t at
// float 4 (128 j + t). Float4 j = n + (N / 8) m holds n8 block n of m64 block m: (row r, col c),
// (r, c + 1), (r + 8, c), (r + 8, c + 1) for thread t's r = 64 m + 16 (t / 32) + (t % 32) / 4
// and c = 8 n + 2 (t % 4) (PTX's m64nNk16 accumulator layout, CuTe's value order).
template <int kBlockM, int kHeadDim, int kSliceCols>
__host__ __device__ constexpr int dq_tile_offset(int row, int col) {
  const int w = col / kSliceCols;
  const int c = col % kSliceCols;
  const int width = kHeadDim - w * kSliceCols < kSliceCols ? kHeadDim - w * kSliceCols
                                                           : kSliceCols;
  const int r = row % 64;
  const int t = 32 * (r / 16) + 4 * (r % 8) + (c % 8) / 2;
  const int j = c / 8 + width / 8 * (row / 64);
  return w * kBlockM * kSliceCols + 4 * (128 * j + t) + 2 * ((r % 16) / 8) + c % 2;
}

// The first row of sequence `batch` in the padded layout of kernel 1's statistics and of the dQ
// accumulator (per head): each sequence starts at a multiple of kBlockM, so a query tile's rows
// are one aligned chunk for the bulk copies. Batch mode: batch * seqlen_q_rounded; group mode
// (FlashAttention-3's): cu_seqlens_q[batch] + batch * kBlockM, rounded down to kBlockM, which
// leaves every sequence its rows rounded up to whole tiles.
template <class Cfg>
__host__ __device__ __forceinline__ int64_t padded_row0(const typename Cfg::KernelParams& kp,
                                                        int batch) {
  if constexpr (Cfg::kMode == Mode::kGroup) {
    const int64_t row = kp.p.fwd.cu_seqlens_q[batch] + static_cast<int64_t>(batch) * Cfg::kBlockM;
    return row / Cfg::kBlockM * Cfg::kBlockM;
  } else {
    return static_cast<int64_t>(batch) * kp.seqlen_q_rounded;
  }
}

// The products split's warpgroup 1 holds dK's last columns in the first registers of dK's
// accumulator: the same registers in the narrower GEMM's layout. (It computes no dV; its dV
// registers hold each step's second dQ slice.)
template <class Cfg, class Acc>
__device__ __forceinline__ auto dk_tail_of(Acc& acc) {
  return cute::make_tensor(
      acc.data(), cute::partition_fragment_C(typename Cfg::TiledMmaDKTail{},
                                             cute::Shape<cute::_64, cute::Int<Cfg::kDKTailCols>>{})
                      .layout());
}

// Query tile m_block's chunk of kBlockM x kHeadDimQK floats, for query head `head` of sequence
// `batch`, in the dQ accumulator of deterministic split `split` (0 otherwise).
template <class Cfg>
__device__ __forceinline__ float* dq_tile(const typename Cfg::KernelParams& kp, int split,
                                          int head, int batch, int m_block) {
  const int64_t row = head * kp.padded_rows + padded_row0<Cfg>(kp, batch) + m_block * Cfg::kBlockM;
  return kp.p.dq_accum + split * kp.p.split_stride + row * Cfg::kHeadDimQK;
}

}  // namespace fmha::fa3
