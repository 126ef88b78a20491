// The fa3 backward's consumer warpgroups: per key tile of the CTA's walk, the steps' GEMMs into
// dK and dV in registers (bwd_fa3_sm90.cuh's comment gives the GEMMs and the work splits), each
// step's dQ handed to BwdDqOut, then dK and dV out through BwdEpilogue.
#pragma once

#include <cmath>
#include <cstdint>

#include "fmha/fmha.h"
#include "fmha/kernels/bwd_common.cuh"
#include "fmha/kernels/bwd_fa3_config_sm90.cuh"
#include "fmha/kernels/bwd_fa3_dq_writer_sm90.cuh"
#include "fmha/kernels/bwd_fa3_epilogue_sm90.cuh"
#include "fmha/kernels/bwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/sm80_primitives.cuh"
#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

// `x`, as a value the compiler knows nothing about: computations from it stay where they are
// written rather than being hoisted out of a loop.
__device__ __forceinline__ int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// Zeroes rows [first_row, rows) of a (rows, d) shared-memory tile, 16 bytes at a time (a
// swizzle permutes 16-byte chunks, so 8 neighbouring elements of a row stay together).
template <class Tensor2D>
__device__ __forceinline__ void zero_rows(Tensor2D tile, int first_row, int thread, int threads) {
  constexpr int kRows = decltype(cute::size<0>(tile))::value;
  constexpr int kChunks = decltype(cute::size<1>(tile))::value / 8;
  for (int idx = thread; idx < (kRows - first_row) * kChunks; idx += threads) {
    const int row = first_row + idx / kChunks;
    *reinterpret_cast<uint4*>(cute::raw_pointer_cast(&tile(row, (idx % kChunks) * 8))) =
        make_uint4(0, 0, 0, 0);
  }
}

template <class Cfg>
class BwdConsumer {
 public:
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;
  using RingPipeline = typename Cfg::RingPipeline;
  using KVPipeline = typename Cfg::KVPipeline;

  // `split`: whose dQ accumulator (deterministic mode); `warpgroup`: 1 or 2.
  __device__ __forceinline__ BwdConsumer(const KernelParams& kp, SharedStorage& shared,
                                         RingPipeline& q_pipe, RingPipeline& do_pipe,
                                         KVPipeline& kv_pipe, const KeyTileWalk& walk, int split,
                                         int warpgroup)
      : kp_(kp), shared_(shared), q_pipe_(q_pipe), do_pipe_(do_pipe), kv_pipe_(kv_pipe),
        walk_(walk), split_(split), warpgroup_(warpgroup) {}

  // The CTA's key tiles, each with its steps and its dK and dV.
  __device__ __forceinline__ void run() {
    using namespace cute;
    using Element = typename Cfg::MmaElement;
    using BlockM = typename Cfg::BlockM;
    using BlockN = typename Cfg::BlockN;
    using DimQK = typename Cfg::DimQK;
    using DimV = typename Cfg::DimV;
    constexpr int kBlockM = Cfg::kBlockM;
    constexpr int kBlockN = Cfg::kBlockN;
    constexpr int kConsumerThreads = Cfg::kConsumerThreads;
    const BwdParams& p = kp_.p;
    const FwdParams& f = p.fwd;
    const int kv_head = walk_.kv_head;
    const int batch = walk_.batch;
    Tensor sQ = make_tensor(make_smem_ptr(shared_.q.data()), typename Cfg::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(shared_.q.data()), typename Cfg::SmemLayoutQt{});
    Tensor sDo = make_tensor(make_smem_ptr(shared_.dout.data()), typename Cfg::SmemLayoutDo{});
    Tensor sDot = make_tensor(make_smem_ptr(shared_.dout.data()), typename Cfg::SmemLayoutDot{});
    Tensor sK = make_tensor(make_smem_ptr(shared_.k.data()), typename Cfg::SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(shared_.k.data()), typename Cfg::SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(shared_.v.data()), typename Cfg::SmemLayoutV{});
    Tensor sDsT = make_tensor(make_smem_ptr(shared_.ds.data()), typename Cfg::SmemLayoutDsT{});
    Tensor sDs = make_tensor(make_smem_ptr(shared_.ds.data()), typename Cfg::SmemLayoutDs{});

    const int consumer = threadIdx.x - 128;   // 0 .. kConsumerThreads - 1
    const int consumer_wg = warpgroup_ - 1;  // which keys or queries, and which columns
    const int wg_thread = threadIdx.x % 128;
    constexpr bool kSplitHeadDim = Cfg::kSplitHeadDim;
    using SdPQueries = typename Cfg::SdPQueries;
    using DKCols = typename Cfg::DKCols;
    using DVCols = typename Cfg::DVCols;
    // The warpgroup's first key, query of the step (S^T's and dP^T's), and column of dK and dV.
    const int wg_key_offset = kSplitHeadDim ? 0 : 64 * consumer_wg;
    const int wg_query_offset = kSplitHeadDim ? Cfg::kSdPQueries * consumer_wg : 0;
    const int wg_split = kSplitHeadDim ? consumer_wg : 0;
    typename Cfg::TiledMmaSdP mma_sdp;
    typename Cfg::TiledMmaDV mma_dv;
    typename Cfg::TiledMmaDK mma_dk;
    typename Cfg::TiledMmaDQ mma_dq;
    typename Cfg::TiledMmaDKTail mma_dk_tail;  // the products split's warpgroup 1
    typename Cfg::TiledMmaDQTail mma_dq_tail;
    auto thr_sdp = mma_sdp.get_thread_slice(wg_thread);
    auto thr_dv = mma_dv.get_thread_slice(wg_thread);
    auto thr_dk = mma_dk.get_thread_slice(wg_thread);
    auto thr_dq = mma_dq.get_thread_slice(wg_thread);
    // The warpgroup's part of dS^T (and of P^T), and its operands of Q, dO and their transposes.
    // Its keys of K and V and its dQ columns of K^T are partitioned in the step loop.
    using Buffers = Int<Cfg::kDsBuffers>;
    Tensor sDsT_wg = local_tile(sDsT, Shape<_64, SdPQueries, Buffers>{},
                                make_coord(kSplitHeadDim ? 0 : consumer_wg, wg_split, _0{}));
    Tensor tSrQ = thr_sdp.partition_fragment_B(
        local_tile(sQ, Shape<SdPQueries, DimQK, typename Cfg::Stages>{},
                   make_coord(wg_split, _0{}, _0{})));
    Tensor tDPrDo = thr_sdp.partition_fragment_B(
        local_tile(sDo, Shape<SdPQueries, DimV, typename Cfg::Stages>{},
                   make_coord(wg_split, _0{}, _0{})));
    const int wg_dkv_split = Cfg::kSplitProducts ? 0 : wg_split;  // which dK/dV columns
    Tensor tdVrDot = thr_dv.partition_fragment_B(
        local_tile(sDot, Shape<DVCols, BlockM, typename Cfg::Stages>{},
                   make_coord(wg_dkv_split, _0{}, _0{})));
    Tensor tdKrQt = thr_dk.partition_fragment_B(
        local_tile(sQt, Shape<DKCols, BlockM, typename Cfg::Stages>{},
                   make_coord(wg_dkv_split, _0{}, _0{})));
    Tensor tdQrDs = thr_dq.partition_fragment_A(sDs);
    auto smem_copy_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_copy_ds = smem_copy_ds.get_thread_slice(wg_thread);
    Tensor tDSsDsT = thr_copy_ds.partition_D(sDsT_wg);

    // Each S^T value's (key, query) within the warpgroup's keys and queries of the step.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<_64, SdPQueries>{}));
    constexpr int kSValues = decltype(size(tScS))::value;

    auto consumers_sync = [&](uint32_t barrier) { barrier_sync(barrier, kConsumerThreads); };
    const BwdDqOut<Cfg> dq_out(kp_, shared_, split_, batch, wg_thread);
    // Every key the sequence owns gets dK and dV (past seqused_k too).
    const int keys_owned = rows_owned<Cfg::kMode>(f.cu_seqlens_k, batch, f.seqlen_k);
    const BwdEpilogue<Cfg> epilogue(kp_, shared_, kv_head, batch, keys_owned, consumer_wg,
                                    wg_thread);

    cutlass::PipelineState<Cfg::kStages> read_q;
    cutlass::PipelineState<Cfg::kStages> read_do;
    cutlass::PipelineState<1> read_kv;
    int step = 0;  // of the CTA's walk: which dS^T buffer it writes

    for (int n_block = walk_.n_block; n_block < p.n_blocks; n_block += walk_.n_stride) {
      const KeyTileWork<Cfg> work(f, batch, n_block);
      const SequenceExtent& seq = work.seq;
      const int key0 = work.key0;
      if (key0 >= keys_owned) break;
      const int wg_key0 = key0 + wg_key_offset;
      Tensor tdVrdV = partition_fragment_C(mma_dv, Shape<_64, DVCols>{});
      Tensor tdKrdK = partition_fragment_C(mma_dk, Shape<_64, DKCols>{});
      clear(tdVrdV);
      clear(tdKrdK);

      if (work.has_steps()) {
        kv_pipe_.consumer_wait(read_kv);
        if (key0 + kBlockN > seq.seqlen_k) {
          // Keys past the sequence: TMA zero-filled those past the tensor, but seqused_k leaves
          // real (maybe NaN) rows, which dQ's GEMM would multiply by dS = 0.
          zero_rows(sK, seq.seqlen_k - key0, consumer, kConsumerThreads);
          zero_rows(sV, seq.seqlen_k - key0, consumer, kConsumerThreads);
          cutlass::arch::fence_view_async_shared();
          consumers_sync(BwdBarrier::kTailZeroed);
        }

        for (int g = 0; g < f.kv_group; ++g) {  // the query heads sharing the K/V head
          for (int m_block = work.m_begin; m_block < work.m_end; ++m_block) {
            const int row0 = m_block * kBlockM;
            q_pipe_.consumer_wait(read_q);
            // Stage indices through a shuffle, which tells the compiler they are warp-uniform:
            // against plain indices, 0.9-1.7% ahead at three of four points (bench.ab, bf16
            // causal d64/d128 at S 2k/8k, H100) and 0.9% behind at the fourth.
            const int q_stage = __shfl_sync(0xffffffff, read_q.index(), 0);
            const int do_stage = __shfl_sync(0xffffffff, read_do.index(), 0);
            const int ds_stage = __shfl_sync(0xffffffff, step % 2, 0);
            const bool ragged_rows = row0 + kBlockM > seq.seqlen_q;
            if (ragged_rows) {
              // As for the keys: Q and dO rows past the used rows feed dK's and dV's GEMMs.
              do_pipe_.consumer_wait(read_do);
              zero_rows(sQ(_, _, q_stage), seq.seqlen_q - row0, consumer, kConsumerThreads);
              zero_rows(sDo(_, _, do_stage), seq.seqlen_q - row0, consumer, kConsumerThreads);
              cutlass::arch::fence_view_async_shared();
              consumers_sync(BwdBarrier::kTailZeroed);
            }
            // K's, V's and K^T's operands of this warpgroup, derived anew each step from a value
            // the compiler cannot hoist: hoisted out of the loop, their 24 wgmma descriptors stay
            // live across it and spill (172 bytes at d128, 48 M local-memory requests at S = 8k,
            // which compete with the GEMMs' shared-memory reads in L1).
            const int wg = opaque(consumer_wg);
            const int wg_keys = kSplitHeadDim ? 0 : wg;
            Tensor tSrK = thr_sdp.partition_fragment_A(
                local_tile(sK, Shape<_64, DimQK>{}, make_coord(wg_keys, _0{})));
            Tensor tDPrV = thr_sdp.partition_fragment_A(
                local_tile(sV, Shape<_64, DimV>{}, make_coord(wg_keys, _0{})));
            Tensor tdQrKt = thr_dq.partition_fragment_B(
                local_tile(sKt, Shape<Int<Cfg::kDQSliceCols>, BlockN>{},
                           make_coord(Cfg::kSplitProducts ? 0 : wg, _0{})));
            Tensor tSrS = partition_fragment_C(mma_sdp, Shape<_64, SdPQueries>{});
            warpgroup_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, q_stage), tSrS);
            if (!ragged_rows) do_pipe_.consumer_wait(read_do);
            Tensor tSrDp = partition_fragment_C(mma_sdp, Shape<_64, SdPQueries>{});
            warpgroup_gemm<true, -1>(mma_sdp, tDPrV, tDPrDo(_, _, _, do_stage), tSrDp);

            // P^T = exp2(S^T * scale log2 e - LSE), masked on edge tiles.
            warpgroup_wait<1>();
            warpgroup_fence_operand(tSrS);
            const float* lse = shared_.lse[q_stage] + wg_query_offset;
            if (work.mask.is_edge_tile(row0, row0 + kBlockM - 1, n_block)) {
  #pragma unroll
              for (int v = 0; v < kSValues; ++v) {
                const int key = wg_key0 + get<0>(tScS(v));
                const int row = row0 + wg_query_offset + get<1>(tScS(v));
                if (!work.mask.is_visible(row, key)) tSrS(v) = -INFINITY;
              }
            }
  #pragma unroll
            for (int v = 0; v < kSValues; ++v) {
              tSrS(v) = sm80::fast_exp2(tSrS(v) * f.softmax_mul - lse[get<1>(tScS(v))]);
            }
            // dS^T = P^T (dP^T - D).
            warpgroup_wait<0>();
            warpgroup_fence_operand(tSrDp);
            const float* dpsum = shared_.dpsum[do_stage] + wg_query_offset;
  #pragma unroll
            for (int v = 0; v < kSValues; ++v) {
              tSrDp(v) = tSrS(v) * (tSrDp(v) - dpsum[get<1>(tScS(v))]);
            }
            using OperandA = Layout<Shape<Shape<_2, _2, _2>, _1, Int<Cfg::kSdPQueries / 16>>>;
            Tensor tdVrP = make_tensor<Element>(OperandA{});
            Tensor tdKrDs = make_tensor<Element>(OperandA{});
            convert_p<Element>(tSrS, tdVrP);
            convert_p<Element>(tSrDp, tdKrDs);

            // dS^T (and, with the head-dim split, P^T) to shared memory: the same registers
            // viewed in the accumulator's layout.
            copy(smem_copy_ds, thr_copy_ds.retile_S(make_tensor(tdKrDs.data(), tSrS.layout())),
                 tDSsDsT(_, _, _, ds_stage));
            if constexpr (kSplitHeadDim) {
              copy(smem_copy_ds, thr_copy_ds.retile_S(make_tensor(tdVrP.data(), tSrS.layout())),
                   tDSsDsT(_, _, _, 2 + ds_stage));
            }
            cutlass::arch::fence_view_async_shared();

            const int head = kv_head * f.kv_group + g;
            Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<BlockM, Int<Cfg::kDQSliceCols>>{});
            if constexpr (Cfg::kSplitProducts) {
              consumers_sync(BwdBarrier::kDsWritten);
              if (consumer_wg == 0) {
                // dV and dK's first 128 columns.
                Tensor tdVrPt = thr_dv.partition_fragment_A(sDsT);
                Tensor tdKrDsT = thr_dk.partition_fragment_A(sDsT);
                warpgroup_gemm<false, -1>(mma_dv, tdVrPt(_, _, _, 2 + ds_stage),
                                          tdVrDot(_, _, _, do_stage), tdVrdV);
                warpgroup_gemm<false, 0>(mma_dk, tdKrDsT(_, _, _, ds_stage),
                                         tdKrQt(_, _, _, q_stage), tdKrdK);
                warpgroup_fence_operand(tdVrdV);
              } else {
                // dK's last columns and dQ's two slices, the second in the registers of the dV
                // this warpgroup does not compute, so that the three GEMMs run back to back.
                auto thr_dk_tail = mma_dk_tail.get_thread_slice(wg_thread);
                auto thr_dq_tail = mma_dq_tail.get_thread_slice(wg_thread);
                constexpr int kTailTile = Cfg::kDKCols / Cfg::kDKTailCols;
                Tensor tdKrDsTTail = thr_dk_tail.partition_fragment_A(sDsT);
                Tensor tdKrQtTail = thr_dk_tail.partition_fragment_B(local_tile(
                    sQt, Shape<Int<Cfg::kDKTailCols>, BlockM, typename Cfg::Stages>{},
                    make_coord(kTailTile, _0{}, _0{})));
                Tensor tdKrdKTail = dk_tail_of<Cfg>(tdKrdK);
                constexpr int kDQTailCols = Cfg::kHeadDimQK - Cfg::kDQSliceCols;
                Tensor tdQrdQTail = make_tensor(
                    tdVrdV.data(),
                    partition_fragment_C(mma_dq_tail, Shape<BlockM, Int<kDQTailCols>>{}).layout());
                Tensor tdQrDsTail = thr_dq_tail.partition_fragment_A(sDs);
                Tensor tdQrKtTail = thr_dq_tail.partition_fragment_B(
                    local_tile(sKt, Shape<Int<kDQTailCols>, BlockN>{},
                               make_coord(Cfg::kDQSliceCols / kDQTailCols, _0{})));
                warpgroup_gemm<false, -1>(mma_dk_tail, tdKrDsTTail(_, _, _, ds_stage),
                                          tdKrQtTail(_, _, _, q_stage), tdKrdKTail);
                warpgroup_gemm<true, -1>(mma_dq, tdQrDs(_, _, _, ds_stage), tdQrKt, tdQrdQ);
                warpgroup_gemm<true, -1>(mma_dq_tail, tdQrDsTail(_, _, _, ds_stage), tdQrKtTail,
                                         tdQrdQTail);
                warpgroup_wait<1>();  // dK's and the first dQ slice's GEMMs
                warpgroup_fence_operand(tdQrdQ);
                dq_out.put(tdQrdQ, 0, head, m_block);
                warpgroup_wait<0>();
                warpgroup_fence_operand(tdQrdQTail);
                warpgroup_fence_operand(tdKrdKTail);
                dq_out.put(tdQrdQTail, 1, head, m_block);
              }
              do_pipe_.consumer_release(read_do);
              ++read_do;
            } else if constexpr (kSplitHeadDim) {
              // Every GEMM reads the other warpgroup's half of P^T or dS^T: A is all 64 keys.
              Tensor tdVrPt = thr_dv.partition_fragment_A(sDsT);
              Tensor tdKrDsT = thr_dk.partition_fragment_A(sDsT);
              consumers_sync(BwdBarrier::kDsWritten);
              warpgroup_gemm<false, -1>(mma_dv, tdVrPt(_, _, _, 2 + ds_stage),
                                        tdVrDot(_, _, _, do_stage), tdVrdV);
              warpgroup_gemm<true, -1>(mma_dq, tdQrDs(_, _, _, ds_stage), tdQrKt, tdQrdQ);
              warpgroup_gemm<false, -1>(mma_dk, tdKrDsT(_, _, _, ds_stage),
                                        tdKrQt(_, _, _, q_stage), tdKrdK);
            } else {
              warpgroup_gemm<false, -1>(mma_dv, tdVrP, tdVrDot(_, _, _, do_stage), tdVrdV);
              consumers_sync(BwdBarrier::kDsWritten);
              warpgroup_gemm<true, -1>(mma_dq, tdQrDs(_, _, _, ds_stage), tdQrKt, tdQrdQ);
              warpgroup_gemm<false, -1>(mma_dk, tdKrDs, tdKrQt(_, _, _, q_stage), tdKrdK);
            }

            // dV's and dQ's GEMMs are done: dO's stage is free, and dQ leaves while dK's runs.
            if constexpr (!Cfg::kSplitProducts) {
              warpgroup_wait<1>();
              warpgroup_fence_operand(tdQrdQ);
              do_pipe_.consumer_release(read_do);
              ++read_do;
            }
            if constexpr (!Cfg::kSplitProducts) {
              dq_out.put(tdQrdQ, consumer_wg, head, m_block);
            }
            warpgroup_wait<0>();
            warpgroup_fence_operand(tdKrdK);
            q_pipe_.consumer_release(read_q);
            ++read_q;
            ++step;
          }
        }
        kv_pipe_.consumer_release(read_kv);
        ++read_kv;
      }

      epilogue.store(seq, wg_key0, tdVrdV, tdKrdK);
    }
  }

 private:
  const KernelParams& kp_;
  SharedStorage& shared_;
  RingPipeline& q_pipe_;
  RingPipeline& do_pipe_;
  KVPipeline& kv_pipe_;
  const KeyTileWalk walk_;
  const int split_;
  const int warpgroup_;
};

}  // namespace fmha::fa3
