// The fa3 backward's producer: the first warp of the producer warpgroup issues the TMA loads,
// K and V once per key tile, then per step (query head, query tile) Q with its LSE and dO with
// its D, into two-stage rings guarded by mbarriers (cutlass::PipelineTmaAsync, made by the
// kernel), in the order the consumers take them. Lane 0 issues.
#pragma once

#include "fmha/fmha.h"
#include "fmha/kernels/bwd_fa3_config_sm90.cuh"
#include "fmha/kernels/bwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

template <class Cfg>
class BwdProducer {
 public:
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;
  using RingPipeline = typename Cfg::RingPipeline;
  using KVPipeline = typename Cfg::KVPipeline;

  static __device__ __forceinline__ void prefetch_descriptors(const KernelParams& kp) {
    cute::prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
  }

  __device__ __forceinline__ BwdProducer(const KernelParams& kp, SharedStorage& shared,
                                         RingPipeline& q_pipe, RingPipeline& do_pipe,
                                         KVPipeline& kv_pipe, const KeyTileWalk& walk, int lane)
      : kp_(kp), shared_(shared), q_pipe_(q_pipe), do_pipe_(do_pipe), kv_pipe_(kv_pipe),
        walk_(walk), lane_(lane) {}

  // The loads of every key tile of the CTA's walk.
  __device__ __forceinline__ void run() {
    using namespace cute;
    using BlockM = typename Cfg::BlockM;
    using BlockN = typename Cfg::BlockN;
    using DimQK = typename Cfg::DimQK;
    using DimV = typename Cfg::DimV;
    const FwdParams& f = kp_.p.fwd;
    Tensor sQ = make_tensor(make_smem_ptr(shared_.q.data()), typename Cfg::SmemLayoutQ{});
    Tensor sDo = make_tensor(make_smem_ptr(shared_.dout.data()), typename Cfg::SmemLayoutDo{});
    Tensor sK = make_tensor(make_smem_ptr(shared_.k.data()), typename Cfg::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(shared_.v.data()), typename Cfg::SmemLayoutV{});
    auto write_q = cutlass::make_producer_start_state<RingPipeline>();
    auto write_do = cutlass::make_producer_start_state<RingPipeline>();
    auto write_kv = cutlass::make_producer_start_state<KVPipeline>();
    // Group mode packs the sequences along the rows of one batch: a sequence's tiles start at
    // its first row (rows past its end are the next sequence's, zeroed by the consumers).
    const int batch_coord = Cfg::kMode == Mode::kGroup ? 0 : walk_.batch;
    for (int n_block = walk_.n_block; n_block < kp_.p.n_blocks; n_block += walk_.n_stride) {
      const KeyTileWork<Cfg> work(f, walk_.batch, n_block);
      if (!work.has_steps()) continue;
      const auto k_start = make_coord(static_cast<int>(work.seq.k_start), _0{});
      const auto q_start = make_coord(static_cast<int>(work.seq.q_start), _0{});
      Tensor mK = domain_offset(k_start, kp_.tma_k.get_tma_tensor(kp_.k_shape)(_, _, walk_.kv_head,
                                                                               batch_coord));
      Tensor mV = domain_offset(k_start, kp_.tma_v.get_tma_tensor(kp_.v_shape)(_, _, walk_.kv_head,
                                                                               batch_coord));
      kv_pipe_.producer_acquire(write_kv);
      if (lane_ == 0) {
        auto* bar = kv_pipe_.producer_get_barrier(write_kv);
        auto k_part = tma_partition(kp_.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(local_tile(mK, Shape<BlockN, DimQK>{},
                                                                 make_coord(n_block, _0{}))));
        auto v_part = tma_partition(kp_.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                    group_modes<0, 2>(local_tile(mV, Shape<BlockN, DimV>{},
                                                                 make_coord(n_block, _0{}))));
        copy(kp_.tma_k.with(*bar, 0), get<0>(k_part), get<1>(k_part));
        copy(kp_.tma_v.with(*bar, 0), get<0>(v_part), get<1>(v_part));
      }
      ++write_kv;
      for (int g = 0; g < f.kv_group; ++g) {
        const int head = walk_.kv_head * f.kv_group + g;
        Tensor mQ = domain_offset(q_start,
                                  kp_.tma_q.get_tma_tensor(kp_.q_shape)(_, _, head, batch_coord));
        Tensor mDo = domain_offset(
            q_start, kp_.tma_do.get_tma_tensor(kp_.do_shape)(_, _, head, batch_coord));
        Tensor gQ = local_tile(mQ, Shape<BlockM, DimQK>{}, make_coord(_, _0{}));
        Tensor gDo = local_tile(mDo, Shape<BlockM, DimV>{}, make_coord(_, _0{}));
        // (TMA, query tile) and (TMA, stage)
        auto q_part = tma_partition(kp_.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                    group_modes<0, 2>(gQ));
        auto do_part = tma_partition(kp_.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sDo),
                                     group_modes<0, 2>(gDo));
        for (int m_block = work.m_begin; m_block < work.m_end; ++m_block) {
          q_pipe_.producer_acquire(write_q);
          if (lane_ == 0) {
            auto* bar = q_pipe_.producer_get_barrier(write_q);
            copy(kp_.tma_q.with(*bar, 0), get<0>(q_part)(_, m_block),
                 get<1>(q_part)(_, write_q.index()));
            SM90_BULK_COPY_G2S::copy(row_stats(kp_.lse_log2, head, m_block), bar,
                                     shared_.lse[write_q.index()], Cfg::kRowStatBytes);
          }
          ++write_q;
          do_pipe_.producer_acquire(write_do);
          if (lane_ == 0) {
            auto* bar = do_pipe_.producer_get_barrier(write_do);
            copy(kp_.tma_do.with(*bar, 0), get<0>(do_part)(_, m_block),
                 get<1>(do_part)(_, write_do.index()));
            SM90_BULK_COPY_G2S::copy(row_stats(kp_.dpsum, head, m_block), bar,
                                     shared_.dpsum[write_do.index()], Cfg::kRowStatBytes);
          }
          ++write_do;
        }
      }
    }
  }

 private:
  // The row statistics of (head, query tile m) in kernel 1's padded layout.
  __device__ __forceinline__ const float* row_stats(const float* base, int head,
                                                    int m_block) const {
    return base + head * kp_.padded_rows + padded_row0<Cfg>(kp_, walk_.batch) +
           m_block * Cfg::kBlockM;
  }

  const KernelParams& kp_;
  SharedStorage& shared_;
  RingPipeline& q_pipe_;
  RingPipeline& do_pipe_;
  KVPipeline& kv_pipe_;
  const KeyTileWalk walk_;
  const int lane_;
};

}  // namespace fmha::fa3
