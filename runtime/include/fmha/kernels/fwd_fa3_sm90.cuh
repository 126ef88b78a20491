// FlashAttention-3 style forward pipeline for Hopper (sm90a): TMA, wgmma, warp specialization.
//
// A CTA is one producer warpgroup and kBlockM / 64 consumer warpgroups, and it is persistent:
// it walks the (query tile, head, sequence) work tiles in a static order (tile_order.cuh) until
// all are done, so one tile's loads overlap the previous tile's epilogue. The kernel below is
// the composition of its stages, each a type of its own:
//   TileScheduler  the CTA's work tiles and the key tiles each visits (fwd_fa3_scheduler_sm90.cuh)
//   Producer       one thread issues TMA loads: Q once per tile, then K and V tiles, key tiles
//                  last to first, into kStages-deep rings guarded by mbarriers; where
//                  K and V come from is the config's load policy (fwd_fa3_producer_sm90.cuh).
//                  Its warpgroup gives its registers up (setmaxnreg) so the consumers can hold O
//                  and two S.
//   VTranspose     e4m3 with a row-major V: two more warps of its warpgroup turn each V tile
//                  into V^T for the 8-bit PV product (fwd_fa3_v_transpose_sm90.cuh)
//   KvWiden        chunked prefill from an e4m3 cache: two more warps widen each staged K and V
//                  tile to fp16 (fwd_fa3_kv_widen_sm90.cuh)
//   Mainloop       consumer warpgroup w owns query rows [64 w, 64 w + 64) of the tile, with its
//                  own Q and O regions in shared memory, its own Q barrier and its own epilogue,
//                  so no consumer ever waits for another except to take turns on the tensor
//                  cores: QK^T, the online softmax and PV, overlapped within and across
//                  warpgroups (fwd_fa3_mainloop_sm90.cuh)
//   Epilogue       O / rowsum and the log-sum-exp out (fwd_fa3_epilogue_sm90.cuh)
// The config (tile, register split, shared memory, TMA types) is fwd_fa3_config_sm90.cuh's.
//
// Traits on this pipeline: fp16/bf16, and e4m3 with V row-major or V^T (bf16 or fp16 out,
// descales per tensor or per sequence and K/V head); head dims that are multiples of 64; no mask,
// causal and sliding windows (both alignments); MQA/GQA; batch and group mode with seqused; LSE.
// Every sequence length is served (TMA zero-fills ragged tiles; the last key tile is masked), so
// the instances are pad_seqlen=true. Bias, dropout, soft-capping, 16-bit V^T and padded head dims run on the
// fa2 pipeline (instances.yaml's rules say so, and the dispatcher's explain quotes them).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>

// First: it sets how CuTe is configured before any CuTe header.
#include "fmha/kernels/sm90_primitives.cuh"

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "fmha/fmha.h"
#include "fmha/kernels/device_facts.cuh"
#include "fmha/kernels/fwd_fa3_config_sm90.cuh"
#include "fmha/kernels/fwd_fa3_epilogue_sm90.cuh"
#include "fmha/kernels/fwd_fa3_kv_widen_sm90.cuh"
#include "fmha/kernels/fwd_fa3_mainloop_sm90.cuh"
#include "fmha/kernels/fwd_fa3_producer_sm90.cuh"
#include "fmha/kernels/fwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/fwd_fa3_v_transpose_sm90.cuh"
#include "fmha/kernels/fwd_params.cuh"
#include "fmha/kernels/tile_order.cuh"

namespace fmha::fa3 {

// A consumer warpgroup's work: per tile, the mainloop and the epilogue in their order.
template <class Cfg>
class Consumer {
 public:
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;
  using Pipeline = typename Cfg::Pipeline;

  __device__ __forceinline__ Consumer(const KernelParams& kp, SharedStorage& shared,
                                      typename Cfg::ConsumerKPipeline& k_pipe,
                                      typename Cfg::ConsumerVPipeline& v_pipe,
                                      int warpgroup, int lane,
                                      StagedO<Cfg>& staged_o)
      : wg_(warpgroup, lane),
        epilogue_(kp, shared, wg_, staged_o),
        mainloop_(shared, k_pipe, v_pipe, wg_),
        p_(kp.p) {
    mainloop_.enter_turns();
    // A warpgroup frees its Q rows once per tile, after the tile's use of them; they start free.
    wg_.release_query();
  }

  // One work tile: the scheduler's visit.
  __device__ __forceinline__ void operator()(const WorkTile<Cfg>& work) {
    const int rows_valid = min(Cfg::kBlockM, work.seq.seqlen_q - work.q_row0);
    const int wg_rows_valid = max(0, min(64, rows_valid - 64 * wg_.index));
    float* lse = epilogue_.lse_rows(work);
    auto* o = epilogue_.o_rows(work);
    if (work.sees_no_key()) {
      epilogue_.write_unseen(lse, o, rows_valid);
      return;
    }
    const int wg_n_end = mainloop_.key_tiles_end(work, wg_rows_valid);
    if (wg_n_end < work.n_end) epilogue_.store_deferred();  // no GEMM of its own to run under
    mainloop_.pass_unseen(work.n_end, wg_n_end);
    if (wg_rows_valid == 0) {
      mainloop_.skip_query();
      return;
    }

    auto tOrO = cute::partition_fragment_C(typename Cfg::TiledMmaO{},
                                           cute::Shape<cute::_64, typename Cfg::DimV>{});
    RowStats<Cfg::kFp8> stats;
    float softmax_mul = p_.softmax_mul;
    float out_scale = 1.f;
    if constexpr (Cfg::kFp8 || Cfg::kWidenKv) {
      const Descales descales(p_, work.tile.batch, work.tile.head / p_.kv_group);
      softmax_mul *= descales.q * descales.k;
      out_scale = descales.v;
    }
    mainloop_.run(work, wg_rows_valid, wg_n_end, softmax_mul, tOrO, stats, epilogue_);
    float inv[2];
    epilogue_.finish_rows(stats, out_scale, lse, rows_valid, inv);  // under the last PV product
    mainloop_.finish(tOrO);
    epilogue_.store_tile(tOrO, inv, work, o, wg_rows_valid);
  }

  // After the last tile.
  __device__ __forceinline__ void finish() { epilogue_.finish(); }

 private:
  // e4m3: the factors that dequantize a work tile's Q, K and V (FwdArgs::q_descale says how
  // they are indexed), one scalar each per (sequence, K/V head); an e4m3 cache's k_scale and
  // v_scale are K's and V's.
  struct Descales {
    float q, k, v;
    __device__ __forceinline__ Descales(const FwdParams& p, int batch, int kv_head)
        : q(load(p.q_descale, batch * p.q_descale_batch_stride + kv_head * p.q_descale_head_stride)),
          k(load(p.k_descale, batch * p.k_descale_batch_stride + kv_head * p.k_descale_head_stride)),
          v(load(p.v_descale,
                 batch * p.v_descale_batch_stride + kv_head * p.v_descale_head_stride)) {}
    static __device__ __forceinline__ float load(const float* ptr, int64_t offset) {
      return ptr == nullptr ? 1.f : __ldg(ptr + offset);
    }
  };

  const ConsumerWarpgroup wg_;
  Epilogue<Cfg> epilogue_;
  Mainloop<Cfg> mainloop_;
  const FwdParams& p_;
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_kernel(const __grid_constant__ typename Cfg::KernelParams kp) {
  using namespace cute;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  // Through a shuffle the compiler knows it is warp-uniform, and so is all it addresses.
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);
  const int lane = threadIdx.x % 32;
  const TileScheduler<Cfg> scheduler(kp);

  if (threadIdx.x == 0) {
    Producer<Cfg>::prefetch_descriptors(kp);
    Epilogue<Cfg>::prefetch_descriptor(kp);
    Producer<Cfg>::init_query_barriers(shared);
  }
  // The K and V rings: the producer fills their stages and every consumer thread frees them.
  using Pipeline = typename Cfg::Pipeline;
  typename Pipeline::Params k_params;
  k_params.transaction_bytes = Cfg::kKBytes;
  k_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                                 : Pipeline::ThreadCategory::Consumer;
  k_params.is_leader = threadIdx.x == 0;
  k_params.num_consumers = Cfg::kConsumerThreads;
  typename Pipeline::Params v_params = k_params;
  v_params.transaction_bytes = Cfg::kVBytes;
  if constexpr (Cfg::kTransposeV) {  // the V ring feeds the transposing warps
    feed_producer_warps(v_params, Cfg::kTransposeThreads);
  }
  if constexpr (Cfg::kWidenKv) {  // the K and V rings are staging, for the widening warps
    feed_producer_warps(k_params, Cfg::kWidenThreads);
    feed_producer_warps(v_params, Cfg::kWidenThreads);
  }
  Pipeline k_pipe(shared.k_pipe, k_params, Shape<_1, _1, _1>{});
  Pipeline v_pipe(shared.v_pipe, v_params, Shape<_1, _1, _1>{});
  auto vt_pipe = make_vt_pipeline<Cfg>(shared, warpgroup);
  auto widened = make_widened_pipelines<Cfg>(shared, warpgroup);
  auto& consumer_k_pipe = consumer_k_pipeline<Cfg>(k_pipe, widened);
  auto& consumer_v_pipe = consumer_v_pipeline<Cfg>(v_pipe, vt_pipe, widened);
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegisters>();
    if (threadIdx.x >= 32) {  // one warp issues; the next two transpose V or widen K and V
      if constexpr (Cfg::kTransposeV) {
        if (threadIdx.x < 32 + Cfg::kTransposeThreads) {
          VTranspose<Cfg> transpose(shared, v_pipe, vt_pipe, threadIdx.x - 32);
          scheduler.for_each_tile(transpose);
        }
      }
      if constexpr (Cfg::kWidenKv) {
        if (threadIdx.x < 32 + Cfg::kWidenThreads) {
          KvWiden<Cfg> widen(shared, k_pipe, v_pipe, widened.k, widened.v, threadIdx.x - 32);
          scheduler.for_each_tile(widen);
        }
      }
      return;
    }
    Producer<Cfg> producer(kp, shared, k_pipe, v_pipe, lane);
    scheduler.for_each_tile(producer);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegisters>();
  StagedO<Cfg> staged_o;  // the epilogue's, held here (fwd_fa3_epilogue_sm90.cuh says why)
  Consumer<Cfg> consumer(kp, shared, consumer_k_pipe, consumer_v_pipe, warpgroup, lane, staged_o);
  scheduler.for_each_tile(consumer);
  consumer.finish();
}

// The kernel's parameters for `args`: sizes, the tile order's facts and the four TMA
// descriptors; host work only, apart from the launch so that it can be timed alone
// (scripts/host_costs_fa3.cu). cudaErrorInvalidConfiguration where a size is past what the
// kernel addresses.
template <class Cfg>
cudaError_t make_kernel_params(const FwdArgs& args, typename Cfg::KernelParams& kp) {
  using namespace cute;
  using Element = typename Cfg::Element;
  constexpr bool kGroup = Cfg::kMode == Mode::kGroup;

  kp = {};
  kp.p = make_fwd_params(args, /*logits_in_scores=*/false);
  const int64_t m_blocks = (static_cast<int64_t>(args.seqlen_q) + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t batch_heads = static_cast<int64_t>(args.batch) * args.nhead_q;
  const int64_t total_tiles = m_blocks * batch_heads;
  // Tile indices are ints, and TMA coordinates are int32: rows past 2^31 cannot be addressed.
  const int64_t rows_q = kGroup ? args.total_q : args.seqlen_q;
  const int64_t rows_k = kGroup ? args.total_k : args.seqlen_k;
  if (total_tiles > INT32_MAX || rows_q > INT32_MAX || rows_k > INT32_MAX) {
    return cudaErrorInvalidConfiguration;
  }
  kp.p.m_blocks = static_cast<int>(m_blocks);
  static const bool spread_heads = std::getenv("FMHA_FA3_SPREAD_HEADS") != nullptr;
  kp.spread_heads = spread_heads;
  // Causal: one head group of every head is longest-first with no regard for L2.
  kp.p.group_heads = kp.spread_heads
                         ? static_cast<int>(batch_heads)
                         : heads_per_group(static_cast<int64_t>(args.seqlen_k) *
                                               (Cfg::kHeadDimQK + Cfg::kHeadDimV) *
                                               static_cast<int64_t>(sizeof(Element)),
                                           batch_heads);
  kp.total_tiles = static_cast<int>(total_tiles);

  const int batch = kGroup ? 1 : args.batch;
  auto shape = [&](int64_t rows, int dim, int heads) {
    return typename Cfg::GmemShape(static_cast<int32_t>(rows), dim, heads, batch);
  };
  auto stride = [&](int64_t seq, int64_t head, int64_t batch_stride) {
    return typename Cfg::GmemStride(tma_stride<Element>(seq), _1{}, tma_stride<Element>(head),
                                    tma_stride<Element>(kGroup ? 0 : batch_stride));
  };
  kp.q_shape = shape(rows_q, args.hdim_q, args.nhead_q);
  kp.o_shape = shape(rows_q, args.hdim_v, args.nhead_q);
  auto gmem = [](const void* ptr, auto shape, auto stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), make_layout(shape, stride));
  };
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{},
                           gmem(args.q, kp.q_shape,
                                stride(args.q_seq_stride, args.q_head_stride, args.q_batch_stride)),
                           typename Cfg::SmemLayoutQ{}, Shape<_64, typename Cfg::DimQK>{}, _1{});
  Cfg::KvLoad::make_params(args, rows_k, kp, shape, stride, gmem);
  kp.tma_o = make_tma_copy(
      SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<typename Cfg::OutElement*>(args.o)),
                  make_layout(kp.o_shape, stride(args.o_seq_stride, args.o_head_stride,
                                                 args.o_batch_stride))),
      typename Cfg::SmemLayoutO{}, Shape<_64, typename Cfg::DimV>{}, _1{});
  return cudaSuccess;
}

// One persistent CTA per SM (each takes ~all of its shared memory), looping over the tiles.
template <class Cfg>
cudaError_t launch_fwd_kernel(const typename Cfg::KernelParams& kp, int64_t batch_heads,
                              cudaStream_t stream) {
  const int sms = multiprocessor_count();
  if (sms <= 0) return cudaErrorInvalidDevice;
  const int64_t units = work_units<Cfg>(kp.p.m_blocks, batch_heads);
  const int grid = static_cast<int>(units < sms ? units : sms);
  auto* kernel = fwd_kernel<Cfg>;
  static std::atomic<uint64_t> smem_raised{0};
  const cudaError_t err =
      allow_dynamic_smem(reinterpret_cast<const void*>(kernel), Cfg::kSmemBytes, smem_raised);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(kp);
  return cudaGetLastError();
}

template <class Cfg>
cudaError_t launch_fwd(const FwdArgs& args, cudaStream_t stream) {
  typename Cfg::KernelParams kp;
  if (const cudaError_t err = make_kernel_params<Cfg>(args, kp); err != cudaSuccess) return err;
  return launch_fwd_kernel<Cfg>(kp, static_cast<int64_t>(args.batch) * args.nhead_q, stream);
}

}  // namespace fmha::fa3
