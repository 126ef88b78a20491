// The fa3 forward's producer: one warp of the producer warpgroup loads each work tile's Q (once
// per consumer warpgroup, into its own rows) and its K and V tiles, key tiles last to first,
// into kStages-deep rings guarded by mbarriers (cutlass::PipelineTmaAsync, made by the kernel),
// in the order the consumers take them.
//
// Where K and V come from is the config's load policy, Cfg::KvLoad:
//   TmaKvLoad (below)   the call's own K and V, a whole key tile a TMA box;
//   CachedKvLoad        a KV cache's pages (cached_kv_sm90.cuh), for chunked prefill.
// A policy is made once by the producer warp, KvLoad(kp, shared, lane), and has
//   static void prefetch_descriptors(const KernelParams&)  its tensor maps, by thread 0;
//   static void make_params(args, rows_k, kp, ...)         its part of the kernel's parameters
//                                                          (host, make_kernel_params);
//   Tile tile(work, kv_head)                               a work tile's loader, made after the
//                                                          tile's Q coordinates;
// and a Tile's load_k(pipe, state, n_block) and load_v(...) each wait for the stage `state`
// names, fill it with key tile n_block and advance `state`. The producer calls load_k for the
// tile's key tiles last to first, each K tile before the V tile of the step after it, the order
// a policy may read ahead in.
#pragma once

#include <cstdint>

#include "fmha/fmha.h"
#include "fmha/kernels/fwd_fa3_config_sm90.cuh"
#include "fmha/kernels/fwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

// K and V from the call's own tensors: a key tile is one TMA box of each, issued by lane 0.
template <class Cfg>
class TmaKvLoad {
 public:
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = cutlass::PipelineState<Cfg::kStages>;

  static __device__ __forceinline__ void prefetch_descriptors(const KernelParams& kp) {
    cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
  }

  __device__ __forceinline__ TmaKvLoad(const KernelParams& kp, SharedStorage& shared, int lane)
      : kp_(kp), shared_(shared), lane_(lane) {}

  // One work tile's K and V: the key tiles of its K/V head's rows, and their copies into the
  // rings' stages.
  template <class PartK, class PartV>
  struct Tile {
    const KernelParams& kp;
    int lane;
    PartK k_part;  // (TMA, key tile), (TMA, stage)
    PartV v_part;

    __device__ void load_k(Pipeline& pipe, PipelineState& state, int n_block) {
      using namespace cute;
      pipe.producer_acquire(state);
      if (lane == 0) {
        copy(kp.tma_k.with(*pipe.producer_get_barrier(state), 0), get<0>(k_part)(_, n_block),
             get<1>(k_part)(_, state.index()));
      }
      ++state;
    }
    __device__ void load_v(Pipeline& pipe, PipelineState& state, int n_block) {
      using namespace cute;
      pipe.producer_acquire(state);
      if (lane == 0) {
        copy(kp.tma_v.with(*pipe.producer_get_barrier(state), 0), get<0>(v_part)(_, n_block),
             get<1>(v_part)(_, state.index()));
      }
      ++state;
    }
  };

  __device__ __forceinline__ auto tile(const WorkTile<Cfg>& work, int kv_head) {
    using namespace cute;
    const int batch_coord = Cfg::kMode == Mode::kGroup ? 0 : work.tile.batch;
    const int k_start = static_cast<int>(work.seq.k_start);
    Tensor mK = kp_.tma_k.get_tma_tensor(kp_.k_shape)(_, _, kv_head, batch_coord);
    Tensor gK = local_tile(domain_offset(make_coord(k_start, _0{}), mK),
                           Shape<typename Cfg::BlockN, typename Cfg::DimQK>{},
                           make_coord(_, _0{}));
    Tensor mV = kp_.tma_v.get_tma_tensor(kp_.v_shape)(_, _, kv_head, batch_coord);
    auto gV = [&] {
      if constexpr (Cfg::kVtInGlobal) {  // V^T: (d, keys), key tiles along the columns
        return local_tile(domain_offset(make_coord(_0{}, k_start), mV), typename Cfg::VBox{},
                          make_coord(_0{}, _));
      } else {
        return local_tile(domain_offset(make_coord(k_start, _0{}), mV), typename Cfg::VBox{},
                          make_coord(_, _0{}));
      }
    }();
    auto k_part = tma_partition(kp_.tma_k, _0{}, Layout<_1>{},
                                group_modes<0, 2>(k_stages<Cfg>(shared_)), group_modes<0, 2>(gK));
    auto v_part = tma_partition(kp_.tma_v, _0{}, Layout<_1>{},
                                group_modes<0, 2>(v_stages<Cfg>(shared_)), group_modes<0, 2>(gV));
    return Tile<decltype(k_part), decltype(v_part)>{kp_, lane_, k_part, v_part};
  }

  // Host: the K and V tensor maps, (rows, head dim, head, batch) as make_kernel_params shapes
  // and strides them; an e4m3 V^T is (head dim, keys, head, batch), the keys contiguous.
  template <class MakeShape, class MakeStride, class MakeGmem>
  static void make_params(const FwdArgs& args, int64_t rows_k, KernelParams& kp,
                          MakeShape shape, MakeStride stride, MakeGmem gmem) {
    using namespace cute;
    kp.k_shape = shape(rows_k, args.hdim_q, args.nhead_k);
    kp.v_shape = Cfg::kVtInGlobal ? shape(args.hdim_v, static_cast<int>(rows_k), args.nhead_k)
                           : shape(rows_k, args.hdim_v, args.nhead_k);
    const auto k_stride = stride(args.k_seq_stride, args.k_head_stride, args.k_batch_stride);
    const auto v_stride =
        stride(Cfg::kVtInGlobal ? args.v_dim_stride : args.v_seq_stride, args.v_head_stride,
               args.v_batch_stride);
    kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem(args.k, kp.k_shape, k_stride),
                             take<0, 2>(typename Cfg::SmemLayoutK{}),
                             Shape<typename Cfg::BlockN, typename Cfg::DimQK>{}, _1{});
    kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem(args.v, kp.v_shape, v_stride),
                             take<0, 2>(typename Cfg::SmemLayoutV{}), typename Cfg::VBox{}, _1{});
  }

 private:
  const KernelParams& kp_;
  SharedStorage& shared_;
  int lane_;
};

// The producer warp's work: per tile, Q into each consumer warpgroup's rows once they are free,
// K and V through the load policy. Lane 0 issues Q's copies; which lanes issue K's and V's is
// the policy's.
template <class Cfg>
class Producer {
 public:
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;
  using Pipeline = typename Cfg::Pipeline;
  using KvLoad = typename Cfg::KvLoad;

  // Thread 0, before the CTA's first barrier.
  static __device__ __forceinline__ void prefetch_descriptors(const KernelParams& kp) {
    cute::prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
    KvLoad::prefetch_descriptors(kp);
  }
  static __device__ __forceinline__ void init_query_barriers(SharedStorage& shared) {
#pragma unroll
    for (int w = 0; w < Cfg::kConsumerWarpgroups; ++w) {
      shared.q_full[w].init(/*arrival_count=*/1);
    }
  }

  __device__ __forceinline__ Producer(const KernelParams& kp, SharedStorage& shared,
                                      Pipeline& k_pipe, Pipeline& v_pipe, int lane)
      : kp_(kp),
        shared_(shared),
        k_pipe_(k_pipe),
        v_pipe_(v_pipe),
        lane_(lane),
        write_k_(cutlass::make_producer_start_state<Pipeline>()),
        write_v_(cutlass::make_producer_start_state<Pipeline>()),
        kv_(kp, shared, lane) {}

  // One work tile's loads: the scheduler's visit.
  __device__ __forceinline__ void operator()(const WorkTile<Cfg>& work) {
    using namespace cute;
    // A tile that sees no key loads nothing: the consumers write its zeros themselves.
    if (work.sees_no_key()) return;
    const TileCoord& tile = work.tile;
    const int kv_head = tile.head / kp_.p.kv_group;
    const int batch_coord = Cfg::kMode == Mode::kGroup ? 0 : tile.batch;
    Tensor mQ = kp_.tma_q.get_tma_tensor(kp_.q_shape)(_, _, tile.head, batch_coord);
    const int q_start = static_cast<int>(work.seq.q_start);
    Tensor gQ = local_tile(domain_offset(make_coord(q_start, _0{}), mQ),
                           Shape<_64, typename Cfg::DimQK>{},
                           make_coord(_, _0{}));  // (64, d, 64-row block)
    auto kv = kv_.tile(work, kv_head);
    load_in_consumer_order(work, gQ, kv);
  }

 private:
  // The tile's loads in the order the consumers take them, whatever K and V come from.
  template <class TensorQ, class KvTile>
  __device__ void load_in_consumer_order(const WorkTile<Cfg>& work, const TensorQ& gQ,
                                         KvTile& kv) {
    using namespace cute;
    const int n_begin = work.n_begin;
    const int n_end = work.n_end;
    // The first K tile does not wait for the consumers. Each warpgroup's Q rows load once
    // it has freed them: past its last QK^T of the previous tile (and, with O staged over
    // Q, past that tile's O store).
    kv.load_k(k_pipe_, write_k_, n_end - 1);
#pragma unroll
    for (int w = 0; w < Cfg::kConsumerWarpgroups; ++w) {
      barrier_sync(Barrier::kQueryEmptyFirst + w, 128 + 32);
      if (lane_ == 0) {
        auto q_part = tma_partition(kp_.tma_q, _0{}, Layout<_1>{},
                                    group_modes<0, 2>(query_rows<Cfg>(shared_, w)),
                                    group_modes<0, 2>(gQ));
        shared_.q_full[w].arrive_and_expect_tx(Cfg::kQBytes);
        copy(kp_.tma_q.with(reinterpret_cast<uint64_t&>(shared_.q_full[w]), 0),
             get<0>(q_part)(_, work.tile.m_block * Cfg::kConsumerWarpgroups + w),
             get<1>(q_part));
      }
    }
    // The consumers take K of step j+1 before V of step j (their GEMM order).
    for (int n_block = n_end - 1; n_block > n_begin; --n_block) {
      kv.load_k(k_pipe_, write_k_, n_block - 1);
      kv.load_v(v_pipe_, write_v_, n_block);
    }
    kv.load_v(v_pipe_, write_v_, n_begin);
  }

  const KernelParams& kp_;
  SharedStorage& shared_;
  Pipeline& k_pipe_;
  Pipeline& v_pipe_;
  const int lane_;
  cutlass::PipelineState<Cfg::kStages> write_k_;
  cutlass::PipelineState<Cfg::kStages> write_v_;
  KvLoad kv_;
};

}  // namespace fmha::fa3
