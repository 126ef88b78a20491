// FlashAttention-3 style backward pipeline for Hopper (sm90a): TMA, wgmma and warp
// specialization. dQ, dK, dV of the forward, recomputing P from Q, K and the forward's
// log-sum-exp (FlashAttention-2's algorithm, FlashAttention-3's kernel design:
// docs/design/fa3-backward.md).
//
// One instance is three kernels, launched in order on one stream by launch_bwd:
//   1. bwd_preprocess_kernel: D = rowsum(dO * O) and the log-sum-exp in log2 units, per
//      (head, sequence) padded to whole query tiles (rows past a sequence's used length get
//      D = 0 and LSE = +inf, so their P is 0), which lets the main kernel fetch a tile's 64
//      values with one bulk copy; and zeroes the fp32 dQ accumulator;
//   2. bwd_kernel: one CTA per (key tile, K/V head, sequence), 384 threads:
//        producer warpgroup (setmaxnreg down to 24 registers): its first warp issues the TMA
//          loads, K and V once per key tile, then per step (query head, query tile) Q with its
//          LSE and dO with its D, into two-stage rings guarded by mbarriers
//          (cutlass::PipelineTmaAsync); its second warp adds each step's dQ tile into the fp32
//          accumulator with one bulk reduce-add per consumer warpgroup
//          (cp.reduce.async.bulk .add.f32, FlashAttention-3's dQ writer), so the consumers never
//          wait on global memory;
//        two consumer warpgroups (240 registers), each owning 64 of the tile's keys (the key
//          split, head dims up to 128): their dK and dV accumulate in registers over the steps.
//          Per step, with the keys as wgmma's M (FlashAttention-3's SdP_swapAB), so P^T and
//          dS^T come out of the first two GEMMs already as the register A operands of the next
//          two:
//            S^T  = K Q^T        (shared/shared)      P^T  = exp2(S^T * scale log2 e - LSE)
//            dP^T = V dO^T       (shared/shared)      dS^T = P^T (dP^T - D)
//            dV  += P^T dO       (A from registers, dO read transposed in shared memory)
//            dS^T -> shared memory (stmatrix), both warpgroups meet at a named barrier
//            dQ   = dS K         (dS and K read transposed; each warpgroup half the head dim)
//            dK  += dS^T Q       (A from registers, Q read transposed)
//          and dQ goes to the writer warp through shared memory, in the accumulator's own
//          register order (float4s, conflict-free), which is also the global accumulator's.
//          Head dim 256 (the head-dim split): dK and dV of 64 keys over every column would take
//          256 registers a thread, so both warpgroups work on one tile of 64 keys, each with
//          dK, dV and dQ of half the columns and S^T, dP^T of half the step's queries; P^T
//          joins dS^T in shared memory, dV's and dK's GEMMs read both from there, and dQ leaves
//          as float4 atomics in the same order (no room for a shared dQ tile). Head dims
//          (192, 128) split the products instead (96 columns would start mid-atom in Q^T and
//          K^T): warpgroup 0 computes dV and dK's first 128 columns, warpgroup 1 dK's last 64
//          and dQ, whose two slices go to the writer warp;
//   3. bwd_convert_dq_kernel: dQ = softmax_scale * the accumulator, out of that order, rounded.
// MQA/GQA: a CTA walks every query head sharing its K/V head, so dK and dV are summed in
// registers. Deterministic mode: `splits` CTAs per (K/V head, sequence) walk fixed key tiles in
// order, each adding into a dQ accumulator of its own (a query tile's chunk gets one reduce per
// key tile, and the writer lets each key tile's reduces complete before the next key tile's);
// kernel 3 sums the accumulators in order, as fa2's backward does.
// The config (the work split, WorkSplit: the key split, the head-dim split or the products
// split; the GEMMs, shared memory and TMA types) is bwd_fa3_config_sm90.cuh's; the key tiles a
// CTA walks and each one's steps are bwd_fa3_scheduler_sm90.cuh's; the loads
// bwd_fa3_producer_sm90.cuh's; the dQ writer warp and the consumers' side of it
// bwd_fa3_dq_writer_sm90.cuh's; the consumers' GEMMs bwd_fa3_consumer_sm90.cuh's, and dK's and
// dV's stores bwd_fa3_epilogue_sm90.cuh's.
//
// Traits on this pipeline: fp16/bf16; head dims 64, 128, (192, 128) and 256; no mask, causal
// and sliding windows (both alignments); MQA/GQA; batch and group (varlen) mode with seqused;
// the deterministic mode. Every sequence length is served (pad_seqlen): TMA zero-fills rows past
// the tensors' ends, and rows past a sequence's used length (the next sequence's, in group mode)
// are zeroed in shared memory before a GEMM reads them. The rest runs on fa2 (instances.yaml's
// rules say so).
#pragma once

// First: it sets how CuTe is configured before any CuTe header.
#include "fmha/kernels/sm90_primitives.cuh"

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "fmha/fmha.h"
#include "fmha/kernels/bwd_common.cuh"
#include "fmha/kernels/bwd_fa3_config_sm90.cuh"
#include "fmha/kernels/bwd_fa3_consumer_sm90.cuh"
#include "fmha/kernels/bwd_fa3_dq_writer_sm90.cuh"
#include "fmha/kernels/bwd_fa3_epilogue_sm90.cuh"
#include "fmha/kernels/bwd_fa3_producer_sm90.cuh"
#include "fmha/kernels/bwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/device_facts.cuh"
#include "fmha/kernels/fwd_params.cuh"
#include "fmha/kernels/mask.cuh"
#include "fmha/kernels/sm80_primitives.cuh"
#include "fmha/kernels/tile_order.cuh"

namespace fmha::fa3 {

// Kernel 1: per (head, sequence, row) of the padded layout, D = rowsum(dO * O) and the
// log-sum-exp in log2 units (+inf for rows that see no key, whose forward LSE is -inf, so that
// their P is 0 rather than NaN); rows past the sequence's used length, up to its last query
// tile's end, get D = 0 and +inf. Then zeroes the dQ accumulators.
template <class Cfg>
__global__ void __launch_bounds__(256)
    bwd_preprocess_kernel(const __grid_constant__ typename Cfg::KernelParams kp) {
  using Element = typename Cfg::Element;
  using Shape = RowDotShape<Cfg::kHeadDimV>;
  const BwdParams& p = kp.p;
  const FwdParams& f = p.fwd;
  const int lane = threadIdx.x % 32;
  const int col = lane % Shape::kLanesPerRow * 8;
  const int64_t warp = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t rows = static_cast<int64_t>(f.nhead_q) * p.batch * kp.seqlen_q_rounded;
  for (int64_t w0 = warp * Shape::kRowsPerWarp; w0 < rows; w0 += warps * Shape::kRowsPerWarp) {
    // Row w of the padded layout: position i of sequence `batch`, query head `head`.
    int64_t at[Shape::kPasses];  // where its statistics go; -1 past the sequence's last tile
    uint4 o8[Shape::kPasses], do8[Shape::kPasses];
    float lse2[Shape::kPasses];
#pragma unroll
    for (int pass = 0; pass < Shape::kPasses; ++pass) {
      const int64_t w = w0 + pass * Shape::kRowsPerPass + lane / Shape::kLanesPerRow;
      const int i = static_cast<int>(w % kp.seqlen_q_rounded);
      const int64_t head_batch = w / kp.seqlen_q_rounded;
      const int batch = static_cast<int>(head_batch % p.batch);
      const int head = static_cast<int>(head_batch / p.batch);
      at[pass] = -1;
      o8[pass] = do8[pass] = make_uint4(0, 0, 0, 0);
      lse2[pass] = INFINITY;
      if (w >= rows) continue;
      const int owned = rows_owned<Cfg::kMode>(f.cu_seqlens_q, batch, f.seqlen_q);
      if (i >= (owned + Cfg::kBlockM - 1) / Cfg::kBlockM * Cfg::kBlockM) continue;
      at[pass] = head * kp.padded_rows + padded_row0<Cfg>(kp, batch) + i;
      const SequenceExtent seq = sequence_extent<Cfg::kMode>(f, batch);
      if (i >= seq.seqlen_q) continue;
      const bool group = Cfg::kMode == Mode::kGroup;
      const int64_t row = (group ? seq.q_start : static_cast<int64_t>(batch) * f.seqlen_q) + i;
      if (col < f.hdim_v) load_o_do<Element, Cfg::kMode>(p, row, head, col, o8[pass], do8[pass]);
      const float lse =
          f.lse[head * f.lse_head_stride + (group ? seq.q_start : batch * f.lse_batch_stride) + i];
      lse2[pass] = lse == -INFINITY ? INFINITY : lse * static_cast<float>(M_LOG2E);
    }
#pragma unroll
    for (int pass = 0; pass < Shape::kPasses; ++pass) {
      const float dot = row_dot_do_o<Element, Shape::kLanesPerRow>(o8[pass], do8[pass]);
      if (at[pass] >= 0 && lane % Shape::kLanesPerRow == 0) {
        kp.dpsum[at[pass]] = dot;
        kp.lse_log2[at[pass]] = lse2[pass];
      }
    }
  }
  zero_dq_accumulators(p);
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_kernel(const __grid_constant__ typename Cfg::KernelParams kp) {
  using namespace cute;
  using RingPipeline = typename Cfg::RingPipeline;
  using KVPipeline = typename Cfg::KVPipeline;
  constexpr int kConsumerThreads = Cfg::kConsumerThreads;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const BwdParams& p = kp.p;
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);
  const int lane = threadIdx.x % 32;
  const KeyTileWalk walk = cta_key_tiles<Cfg>(kp);
  const int split = p.deterministic ? static_cast<int>(blockIdx.x) : 0;  // whose dQ accumulator

  if (threadIdx.x == 0) BwdProducer<Cfg>::prefetch_descriptors(kp);
  const auto role = warpgroup == 0 ? RingPipeline::ThreadCategory::Producer
                                   : RingPipeline::ThreadCategory::Consumer;
  typename RingPipeline::Params q_params;
  q_params.transaction_bytes = Cfg::kQStepBytes;
  q_params.role = role;
  q_params.is_leader = threadIdx.x == 0;
  q_params.num_consumers = kConsumerThreads;
  typename RingPipeline::Params do_params = q_params;
  do_params.transaction_bytes = Cfg::kDoStepBytes;
  typename KVPipeline::Params kv_params;
  kv_params.transaction_bytes = Cfg::kKVBytes;
  kv_params.role = warpgroup == 0 ? KVPipeline::ThreadCategory::Producer
                                  : KVPipeline::ThreadCategory::Consumer;
  kv_params.is_leader = threadIdx.x == 0;
  kv_params.num_consumers = kConsumerThreads;
  RingPipeline q_pipe(shared.q_pipe, q_params, Shape<_1, _1, _1>{});
  RingPipeline do_pipe(shared.do_pipe, do_params, Shape<_1, _1, _1>{});
  KVPipeline kv_pipe(shared.kv_pipe, kv_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegisters>();
    if (threadIdx.x >= 64) return;
    if (threadIdx.x >= 32) {
      // ------------------------------------------------------------ dQ writer
      // (the head-dim split has none: its consumers add dQ with atomics)
      if constexpr (Cfg::kDqWriterWarp) {
        BwdDqWriter<Cfg>(kp, shared, walk, split, lane).run();
      }
      return;
    }
    // ------------------------------------------------------------ loads (lane 0 issues)
    BwdProducer<Cfg>(kp, shared, q_pipe, do_pipe, kv_pipe, walk, lane).run();
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegisters>();
  BwdConsumer<Cfg>(kp, shared, q_pipe, do_pipe, kv_pipe, walk, split, warpgroup).run();
}

// Kernel 3: dQ = softmax_scale * the sum of the accumulators over the splits (in split order),
// one thread per 8 columns of two rows r and r + 8 (which share float4s of the tile layout).
// Every row of dQ is written: those past a sequence's used length are 0, and so (group mode) are
// the packed rows past the last sequence.
template <class Cfg>
__global__ void __launch_bounds__(256)
    bwd_convert_dq_kernel(const __grid_constant__ typename Cfg::KernelParams kp) {
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kDim = Cfg::kHeadDimQK;
  constexpr int kGroups = kDim / 8;
  const BwdParams& p = kp.p;
  const FwdParams& f = p.fwd;
  // Row pairs (r, r + 8) of a query tile: r in [16 i, 16 i + 8).
  const int64_t pairs = static_cast<int64_t>(p.batch) * f.nhead_q * (kp.seqlen_q_rounded / 2);
  const int64_t total = pairs * kGroups;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += threads) {
    const int group = static_cast<int>(t % kGroups);
    const int64_t pair = t / kGroups;
    const int pair_in_seq = static_cast<int>(pair % (kp.seqlen_q_rounded / 2));
    const int64_t batch_head = pair / (kp.seqlen_q_rounded / 2);
    const int head = static_cast<int>(batch_head % f.nhead_q);
    const int batch = static_cast<int>(batch_head / f.nhead_q);
    const int row = 16 * (pair_in_seq / 8) + pair_in_seq % 8;  // and row + 8
    const int owned = rows_owned<Cfg::kMode>(f.cu_seqlens_q, batch, f.seqlen_q);
    if (row >= owned) continue;
    const int m_block = row / kBlockM;
    const float* tile = dq_tile<Cfg>(kp, 0, head, batch, m_block);
    // Columns 8 g + 2 q, + 1 of rows r and r + 8 are float4 q of 4 neighbouring ones.
    const int first =
        dq_tile_offset<kBlockM, kDim, Cfg::kDQSliceCols>(row % kBlockM, 8 * group);
    float sum[2][8] = {};
    for (int s = 0; s < p.splits; ++s) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 x =
            *reinterpret_cast<const float4*>(tile + s * p.split_stride + first + 4 * q);
        sum[0][2 * q] += x.x, sum[0][2 * q + 1] += x.y;
        sum[1][2 * q] += x.z, sum[1][2 * q + 1] += x.w;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row + 8 * h;
      if (r >= owned) continue;
      uint32_t out[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        out[q] = sm80::pack2<Element>(sum[h][2 * q] * f.scale, sum[h][2 * q + 1] * f.scale);
      }
      const int64_t first_row =
          Cfg::kMode == Mode::kGroup ? f.cu_seqlens_q[batch] * p.dq_seq_stride
                                     : batch * p.dq_batch_stride;
      *reinterpret_cast<uint4*>(static_cast<Element*>(p.dq) + first_row + r * p.dq_seq_stride +
                                head * p.dq_head_stride + 8 * group) =
          make_uint4(out[0], out[1], out[2], out[3]);
    }
  }
  if constexpr (Cfg::kMode == Mode::kGroup) {
    const int64_t last = f.cu_seqlens_q[p.batch];
    const int64_t chunks = (p.rows - last) * f.nhead_q * kGroups;  // p.rows: total_q
    for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < chunks;
         t += threads) {
      const int64_t row = last + t / (f.nhead_q * kGroups);
      const int head = static_cast<int>(t / kGroups % f.nhead_q);
      *reinterpret_cast<uint4*>(static_cast<Element*>(p.dq) + row * p.dq_seq_stride +
                                head * p.dq_head_stride + 8 * (t % kGroups)) =
          make_uint4(0, 0, 0, 0);
    }
  }
}

// seqlen_q (group mode: the longest sequence's) up to whole query tiles.
template <class Cfg>
inline int bwd_seqlen_q_rounded(const BwdArgs& a) {
  return (a.fwd.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM * Cfg::kBlockM;
}

// The rows per head of kernel 1's statistics and of the dQ accumulator (padded_row0's layout):
// padded_row0 of a batch one past the last.
template <class Cfg>
inline int64_t bwd_padded_rows(const BwdArgs& a) {
  if constexpr (Cfg::kMode == Mode::kGroup) {
    return (a.fwd.total_q + static_cast<int64_t>(a.fwd.batch) * Cfg::kBlockM) / Cfg::kBlockM *
           Cfg::kBlockM;
  } else {
    return static_cast<int64_t>(a.fwd.batch) * bwd_seqlen_q_rounded<Cfg>(a);
  }
}

// The workspace: kernel 1's row statistics (LSE and D, padded to whole query tiles), then the
// fp32 dQ accumulators. No O(S^2) term.
template <class Cfg>
size_t bwd_workspace_bytes(const BwdArgs& a) {
  const size_t rows = static_cast<size_t>(a.fwd.nhead_q) * bwd_padded_rows<Cfg>(a);
  const size_t splits = static_cast<size_t>(bwd_splits(a, Cfg::kBlockN));
  return 2 * align_workspace(rows * sizeof(float)) +
         align_workspace(splits * rows * Cfg::kHeadDimQK * sizeof(float));
}

template <class Cfg>
cudaError_t launch_bwd(const BwdArgs& args, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Cfg::MmaElement;
  typename Cfg::KernelParams kp{};
  BwdParams& p = kp.p;
  p = make_bwd_params(args, /*logits_in_scores=*/false);
  p.n_blocks = static_cast<int>((static_cast<int64_t>(args.fwd.seqlen_k) + Cfg::kBlockN - 1) /
                                Cfg::kBlockN);
  p.splits = bwd_splits(args, Cfg::kBlockN);
  kp.seqlen_q_rounded = bwd_seqlen_q_rounded<Cfg>(args);
  kp.padded_rows = bwd_padded_rows<Cfg>(args);
  // A K/V head's CTAs stream the Q and dO of its query heads.
  kp.group_heads = heads_per_group(static_cast<int64_t>(args.fwd.seqlen_q) *
                                       (Cfg::kHeadDimQK + Cfg::kHeadDimV) * 2 * p.fwd.kv_group,
                                   static_cast<int64_t>(args.fwd.nhead_k) * args.fwd.batch);
  const size_t rows = static_cast<size_t>(args.fwd.nhead_q) * kp.padded_rows;
  p.split_stride = static_cast<int64_t>(rows) * Cfg::kHeadDimQK;
  const size_t stats_bytes = align_workspace(rows * sizeof(float));
  auto* workspace = static_cast<unsigned char*>(args.workspace);
  kp.lse_log2 = reinterpret_cast<float*>(workspace);
  kp.dpsum = reinterpret_cast<float*>(workspace + stats_bytes);
  p.dq_accum = reinterpret_cast<float*>(workspace + 2 * stats_bytes);

  // Global tensors as TMA sees them; group mode packs every sequence along the rows of one
  // batch. TMA coordinates are int32.
  constexpr bool kGroup = Cfg::kMode == Mode::kGroup;
  const FwdArgs& f = args.fwd;
  const int64_t rows_q = kGroup ? f.total_q : f.seqlen_q;
  const int64_t rows_k = kGroup ? f.total_k : f.seqlen_k;
  if (rows_q > INT32_MAX - Cfg::kBlockM || rows_k > INT32_MAX - Cfg::kBlockN) {
    return cudaErrorInvalidConfiguration;
  }
  auto shape = [&](int64_t rows, int dim, int heads) {
    return typename Cfg::GmemShape(static_cast<int32_t>(rows), dim, heads, kGroup ? 1 : f.batch);
  };
  auto gmem = [&](const void* ptr, auto shape, int64_t seq, int64_t head, int64_t batch_stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_layout(shape, typename Cfg::GmemStride(
                                              tma_stride(seq), _1{}, tma_stride(head),
                                              tma_stride(kGroup ? 0 : batch_stride))));
  };
  kp.q_shape = shape(rows_q, f.hdim_q, f.nhead_q);
  kp.do_shape = shape(rows_q, f.hdim_v, f.nhead_q);
  kp.k_shape = shape(rows_k, f.hdim_q, f.nhead_k);
  kp.v_shape = shape(rows_k, f.hdim_v, f.nhead_k);
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{},
                           gmem(f.q, kp.q_shape, f.q_seq_stride, f.q_head_stride, f.q_batch_stride),
                           take<0, 2>(typename Cfg::SmemLayoutQ{}),
                           Shape<typename Cfg::BlockM, typename Cfg::DimQK>{}, _1{});
  kp.tma_do = make_tma_copy(SM90_TMA_LOAD{},
                            gmem(args.dout, kp.do_shape, args.dout_seq_stride,
                                 args.dout_head_stride, args.dout_batch_stride),
                            take<0, 2>(typename Cfg::SmemLayoutDo{}),
                            Shape<typename Cfg::BlockM, typename Cfg::DimV>{}, _1{});
  kp.tma_k = make_tma_copy(SM90_TMA_LOAD{},
                           gmem(f.k, kp.k_shape, f.k_seq_stride, f.k_head_stride, f.k_batch_stride),
                           typename Cfg::SmemLayoutK{},
                           Shape<typename Cfg::BlockN, typename Cfg::DimQK>{}, _1{});
  kp.tma_v = make_tma_copy(SM90_TMA_LOAD{},
                           gmem(f.v, kp.v_shape, f.v_seq_stride, f.v_head_stride, f.v_batch_stride),
                           typename Cfg::SmemLayoutV{},
                           Shape<typename Cfg::BlockN, typename Cfg::DimV>{}, _1{});

  // Kernels 1 and 3 are memory-bound grid-stride loops: a few waves of 256 threads per SM.
  const int sms = multiprocessor_count();
  const int stream_blocks = sms > 0 ? 4 * sms : 512;
  bwd_preprocess_kernel<Cfg><<<stream_blocks, 256, 0, stream>>>(kp);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;

  if (p.n_blocks > 0) {
    auto* kernel = bwd_kernel<Cfg>;
    static std::atomic<uint64_t> smem_raised{0};
    const cudaError_t err =
        allow_dynamic_smem(reinterpret_cast<const void*>(kernel), Cfg::kSmemBytes, smem_raised);
    if (err != cudaSuccess) return err;
    const int64_t kv_heads = static_cast<int64_t>(f.nhead_k) * f.batch;
    const bool causal_order = Cfg::kMask == MaskType::kCausal && !p.deterministic;
    if (causal_order && p.n_blocks * kv_heads > INT32_MAX) return cudaErrorInvalidConfiguration;
    const dim3 grid = causal_order
                          ? dim3(static_cast<unsigned>(p.n_blocks * kv_heads))
                          : dim3(static_cast<unsigned>(p.deterministic ? p.splits : p.n_blocks),
                                 static_cast<unsigned>(f.nhead_k), static_cast<unsigned>(f.batch));
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(kp);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }

  bwd_convert_dq_kernel<Cfg><<<stream_blocks, 256, 0, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace fmha::fa3
