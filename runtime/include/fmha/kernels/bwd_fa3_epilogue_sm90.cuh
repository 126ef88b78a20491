// The fa3 backward's epilogue, per consumer warpgroup and key tile: dK (times softmax_scale: the
// GEMMs used unscaled dS) and dV of the keys this sequence owns, zero for those that no row
// sees. Each warpgroup stages its 64 rows (of its columns, with the head-dim split) in 16 bits
// in the dS^T buffers' bytes (stmatrix), so they leave in whole 16-byte row chunks rather than
// as 4-byte pieces of 8 rows per warp.
#pragma once

#include <cstdint>

#include "fmha/fmha.h"
#include "fmha/kernels/bwd_common.cuh"
#include "fmha/kernels/bwd_fa3_config_sm90.cuh"
#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

template <class Cfg>
class BwdEpilogue {
 public:
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;
  using Element = typename Cfg::MmaElement;

  // `keys_owned`: the sequence's keys, which all get dK and dV; `wg`: the consumer warpgroup,
  // `wg_thread` its thread.
  __device__ __forceinline__ BwdEpilogue(const KernelParams& kp, SharedStorage& shared,
                                         int kv_head, int batch, int keys_owned, int wg,
                                         int wg_thread)
      : kp_(kp), shared_(shared), kv_head_(kv_head), batch_(batch), keys_owned_(keys_owned),
        wg_(wg), wg_thread_(wg_thread) {}

  // dK and dV of the warpgroup's keys from wg_key0 on, tdVrdV and tdKrdK in its GEMMs' layouts.
  template <class AccDV, class AccDK>
  __device__ __forceinline__ void store(const SequenceExtent& seq, int wg_key0,
                                        const AccDV& tdVrdV, AccDK& tdKrdK) const {
    using namespace cute;
    constexpr bool kGroup = Cfg::kMode == Mode::kGroup;
    const BwdParams& p = kp_.p;
    const int wg_split = Cfg::kSplitHeadDim ? wg_ : 0;
    // The other warpgroup's last GEMMs must have read the dS^T buffers' bytes first.
    barrier_sync(BwdBarrier::kDsWritten, Cfg::kConsumerThreads);
    Element* const dv_out = static_cast<Element*>(p.dv) + kv_head_ * p.dv_head_stride +
                            (kGroup ? seq.k_start * p.dv_seq_stride : batch_ * p.dv_batch_stride);
    Element* const dk_out = static_cast<Element*>(p.dk) + kv_head_ * p.dk_head_stride +
                            (kGroup ? seq.k_start * p.dk_seq_stride : batch_ * p.dk_batch_stride);
    if constexpr (Cfg::kSplitProducts) {
      if (wg_ == 0) {
        store_keys(tdVrdV, typename Cfg::TiledMmaDV{}, typename Cfg::DVCols{}, 1.f, wg_key0,
                   dv_out, p.dv_seq_stride);
        store_keys(tdKrdK, typename Cfg::TiledMmaDK{}, typename Cfg::DKCols{}, p.fwd.scale,
                   wg_key0, dk_out, p.dk_seq_stride);
      } else {
        store_keys(dk_tail_of<Cfg>(tdKrdK), typename Cfg::TiledMmaDKTail{},
                   Int<Cfg::kDKTailCols>{}, p.fwd.scale, wg_key0, dk_out + Cfg::kDKCols,
                   p.dk_seq_stride);
      }
    } else {
      store_keys(tdVrdV, typename Cfg::TiledMmaDV{}, typename Cfg::DVCols{}, 1.f, wg_key0,
                 dv_out + wg_split * Cfg::kDVCols, p.dv_seq_stride);
      store_keys(tdKrdK, typename Cfg::TiledMmaDK{}, typename Cfg::DKCols{}, p.fwd.scale,
                 wg_key0, dk_out + wg_split * Cfg::kDKCols, p.dk_seq_stride);
    }
  }

 private:
  // `acc` times `scale`, the warpgroup's 64 rows of `cols` columns of `mma`'s accumulator, to
  // rows wg_key0 on of `out`.
  template <class Acc, class TiledMma, class Cols>
  __device__ __forceinline__ void store_keys(const Acc& acc, const TiledMma& mma, Cols,
                                             float scale, int wg_key0, Element* out,
                                             int64_t seq_stride) const {
    using namespace cute;
    constexpr int kStagedCols = cute::max(Cfg::kDKCols, Cfg::kDVCols);  // per warpgroup
    static_assert(Cols::value <= kStagedCols &&
                  2 * 64 * kStagedCols <= cosize_v<typename Cfg::SmemLayoutDsT>);
    Tensor staged_wg = make_tensor(
        make_smem_ptr(shared_.ds.data() + wg_ * 64 * kStagedCols),
        tile_to_shape(typename Cfg::SwizzleAtom{}, Shape<_64, Cols>{}));
    auto copy_op = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma);
    auto thr_copy = copy_op.get_thread_slice(wg_thread_);
    Tensor rows = make_tensor_like<Element>(acc);
#pragma unroll
    for (int v = 0; v < size(acc); ++v) rows(v) = static_cast<Element>(acc(v) * scale);
    copy(copy_op, thr_copy.retile_S(rows), thr_copy.partition_D(staged_wg));
    barrier_sync(BwdBarrier::kWarpgroupFirst + wg_, 128);
    constexpr int kChunks = Cols::value / 8;
    for (int idx = wg_thread_; idx < 64 * kChunks; idx += 128) {
      const int row = idx / kChunks;
      const int col = (idx % kChunks) * 8;
      if (wg_key0 + row >= keys_owned_) continue;
      *reinterpret_cast<uint4*>(out + (wg_key0 + row) * seq_stride + col) =
          *reinterpret_cast<const uint4*>(raw_pointer_cast(&staged_wg(row, col)));
    }
    barrier_sync(BwdBarrier::kWarpgroupFirst + wg_, 128);  // read before rewritten
  }

  const KernelParams& kp_;
  SharedStorage& shared_;
  const int kv_head_;
  const int batch_;
  const int keys_owned_;
  const int wg_;
  const int wg_thread_;
};

}  // namespace fmha::fa3
