// FlashAttention-3 style forward pipeline for Hopper (sm90a): TMA, wgmma, warp specialization.
//
// A CTA is one producer warpgroup and kBlockM / 64 consumer warpgroups, and it is persistent:
// it walks the (query tile, head, sequence) work tiles in a static order (tile_order.cuh) until
// all are done, so one tile's loads overlap the previous tile's epilogue.
//   producer: one thread issues TMA loads: Q once per tile, then K and V tiles, key tiles last
//     to first, into kStages-deep rings guarded by mbarriers (cutlass::PipelineTmaAsync). Its
//     warpgroup gives its registers up (setmaxnreg) so the consumers can hold O and two S.
//   consumer warpgroup w owns query rows [64 w, 64 w + 64) of the tile, with its own Q and O
//     regions in shared memory, its own Q barrier and its own epilogue, so no consumer ever
//     waits for another except to take turns on the tensor cores. Per key tile:
//     S = Q K^T   wgmma, both operands from shared memory (128-byte swizzle), fp32 accumulators
//     softmax     online, on the accumulators (exp2 with the scale folded into one FFMA)
//     O += P V    wgmma, P from registers (S's accumulator layout is the A-operand register
//                 layout once rounded to 16 bits) and V from shared memory, read transposed.
// Two overlaps keep the tensor cores busy during the softmax (FlashAttention-3, section 3):
//   - within a warpgroup, S of step j+1 and O += P_j V_j are issued together and the softmax of
//     step j+1 runs while the PV product is still on the tensor cores;
//   - across warpgroups, named barriers take turns issuing those GEMMs (ping-pong), so one
//     warpgroup's softmax overlaps the other's GEMMs.
// Epilogue, per warpgroup: O / rowsum goes to shared memory (stmatrix) and out with one TMA
// store when the warpgroup's 64 rows are whole and O has a region of its own (then while the
// next tile's first QK^T runs), else with predicated 16-byte stores; the log-sum-exp goes
// straight from registers.
//
// The config (tile, register split, shared memory, TMA types, named barriers) is
// fwd_fa3_config_sm90.cuh's; the work units, their tiles and the key tiles each visits are
// fwd_fa3_scheduler_sm90.cuh's.
//
// Traits on this pipeline: fp16/bf16; head dims that are multiples of 64; no mask, causal and
// sliding windows (both alignments); MQA/GQA; batch and group mode with seqused; LSE. Every
// sequence length is served (TMA zero-fills ragged tiles; the last key tile is masked), so the
// instances are pad_seqlen=true. Bias, dropout, soft-capping, V^T and padded head dims run on
// the fa2 pipeline (instances.yaml's rules say so, and the dispatcher's explain quotes them).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

// First: it sets how CuTe is configured before any CuTe header.
#include "fmha/kernels/sm90_primitives.cuh"

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "fmha/fmha.h"
#include "fmha/kernels/cached_kv_sm90.cuh"
#include "fmha/kernels/device_facts.cuh"
#include "fmha/kernels/fwd_fa3_config_sm90.cuh"
#include "fmha/kernels/fwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/fwd_params.cuh"
#include "fmha/kernels/sm80_primitives.cuh"

namespace fmha::fa3 {

// The softmax state of the two rows a thread holds in a wgmma accumulator: value v of the
// fragment ((2, 2, N / 8), 1, 1) is row half (v / 2) % 2 (rows r and r + 8), column
// 8 * (v / 4) + 2 * (lane % 4) + v % 2.
//
// The running max that the exponents subtract moves only when a row's new max exceeds it by
// more than 2^kStaleMaxLog2 (FlashAttention-4's conditional rescaling): P then stays below 256,
// which fp16, bf16 and the fp32 sums hold with their usual relative precision, and O, whose
// rescale is the softmax's largest cost (128 FMULs per thread and key tile at d256 against 40
// exponentials), is rescaled only in the steps where some row of the warp moved its max.
struct RowStats {
  static constexpr float kStaleMaxLog2 = 8.f;
  float max[2] = {-INFINITY, -INFINITY};  // what the exponents subtract, already * softmax_mul
  float sum[2] = {0.f, 0.f};  // this thread's partial sums; the quad reduces them at the end

  // Folds a new S tile in and turns S into unnormalized P. Returns whether O must be
  // multiplied by `correction` (warp-uniform: true when any row of the warp moved its max);
  // the sums are corrected here.
  template <class TensorS>
  __device__ __forceinline__ bool update(TensorS& s, float softmax_mul, float (&correction)[2]) {
    constexpr int kValues = decltype(cute::size(s))::value;
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = -INFINITY;
#pragma unroll
      for (int v = 0; v < kValues; ++v) {
        if ((v / 2) % 2 == h) m = fmaxf(m, s(v));
      }
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
      const float m_scaled_new = m * softmax_mul;
      // A row with nothing visible yet keeps max -inf; subtracting 0 instead keeps exp2 at 0
      // rather than NaN from (-inf) - (-inf). The first visible key always moves the max.
      correction[h] = 1.f;
      if (m_scaled_new > max[h] + kStaleMaxLog2) {
        correction[h] = sm80::fast_exp2(max[h] - m_scaled_new);
        max[h] = m_scaled_new;
        sum[h] *= correction[h];
        moved = true;
      }
      const float m_scaled = max[h] == -INFINITY ? 0.f : max[h];
#pragma unroll
      for (int v = 0; v < kValues; ++v) {
        if ((v / 2) % 2 == h) {
          s(v) = sm80::fast_exp2(s(v) * softmax_mul - m_scaled);
          sum[h] += s(v);
        }
      }
    }
    return __any_sync(0xffffffff, moved);
  }
};

template <class TensorO>
__device__ __forceinline__ void scale_rows(TensorO& o, const float (&factor)[2]) {
  constexpr int kValues = decltype(cute::size(o))::value;
#pragma unroll
  for (int v = 0; v < kValues; ++v) o(v) *= factor[(v / 2) % 2];
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_kernel(const __grid_constant__ typename Cfg::KernelParams kp) {
  using namespace cute;
  using Element = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kWarpgroups = Cfg::kConsumerWarpgroups;
  constexpr bool kGroup = Cfg::kMode == Mode::kGroup;
  constexpr int kConsumerThreads = Cfg::kConsumerThreads;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const FwdParams& p = kp.p;
  // Through a shuffle the compiler knows it is warp-uniform, and so is all it addresses.
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);
  const int lane = threadIdx.x % 32;
  const TileScheduler<Cfg> scheduler(kp);
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutVt{});

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
    if constexpr (Cfg::kCachedKv) {
      cute::prefetch_tma_descriptor(&kp.cache.k.tma);
      cute::prefetch_tma_descriptor(&kp.cache.v.tma);
    } else {
      cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
    }
    cute::prefetch_tma_descriptor(kp.tma_o.get_tma_descriptor());
#pragma unroll
    for (int w = 0; w < kWarpgroups; ++w) shared.q_full[w].init(/*arrival_count=*/1);
  }
  typename Pipeline::Params k_params;
  k_params.transaction_bytes = Cfg::kKBytes;
  k_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                                 : Pipeline::ThreadCategory::Consumer;
  k_params.is_leader = threadIdx.x == 0;
  k_params.num_consumers = kConsumerThreads;
  typename Pipeline::Params v_params = k_params;
  v_params.transaction_bytes = Cfg::kVBytes;
  Pipeline k_pipe(shared.k_pipe, k_params, Shape<_1, _1, _1>{});
  Pipeline v_pipe(shared.v_pipe, v_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegisters>();
    if (threadIdx.x >= 32) return;  // one warp issues; its lane 0 the copies
    cutlass::PipelineState<Cfg::kStages> write_k = cutlass::make_producer_start_state<Pipeline>();
    cutlass::PipelineState<Cfg::kStages> write_v = cutlass::make_producer_start_state<Pipeline>();
    for (int unit = blockIdx.x; unit < scheduler.units(); unit += gridDim.x)
    for (int half = 0; half < 2; ++half) {
      TileCoord coord;
      if (!unit_tile<Cfg>(kp, unit, half, scheduler.batch_heads(), &coord)) continue;
      const WorkTile<Cfg> work(p, coord);
      // A tile that sees no key loads nothing: the consumers write its zeros themselves.
      if (!work.in_sequence() || work.n_end <= work.n_begin) continue;
      const TileCoord& tile = work.tile;
      const SequenceExtent& seq = work.seq;
      const int n_begin = work.n_begin;
      const int n_end = work.n_end;
      const int kv_head = tile.head / p.kv_group;
      const int batch_coord = kGroup ? 0 : tile.batch;

      Tensor mQ = kp.tma_q.get_tma_tensor(kp.q_shape)(_, _, tile.head, batch_coord);
      Tensor gQ = local_tile(domain_offset(make_coord(static_cast<int>(seq.q_start), _0{}), mQ),
                             Shape<_64, typename Cfg::DimQK>{},
                             make_coord(_, _0{}));  // (64, d, 64-row block)

      // The tile's loads in the order the consumers take them, whatever K and V come from.
      auto produce = [&](auto&& load_k, auto&& load_v) {
        // The first K tile does not wait for the consumers. Each warpgroup's Q rows load once
        // it has freed them: past its last QK^T of the previous tile (and, with O staged over
        // Q, past that tile's O store).
        load_k(n_end - 1);
#pragma unroll
        for (int w = 0; w < kWarpgroups; ++w) {
          barrier_sync(Barrier::kQueryEmptyFirst + w, 128 + 32);
          if (lane == 0) {
            auto q_part = tma_partition(kp.tma_q, _0{}, Layout<_1>{},
                                        group_modes<0, 2>(query_rows<Cfg>(shared, w)),
                                        group_modes<0, 2>(gQ));
            shared.q_full[w].arrive_and_expect_tx(Cfg::kQBytes);
            copy(kp.tma_q.with(reinterpret_cast<uint64_t&>(shared.q_full[w]), 0),
                 get<0>(q_part)(_, tile.m_block * kWarpgroups + w), get<1>(q_part));
          }
        }
        // The consumers take K of step j+1 before V of step j (their GEMM order).
        for (int n_block = n_end - 1; n_block > n_begin; --n_block) {
          load_k(n_block - 1);
          load_v(n_block);
        }
        load_v(n_begin);
      };

      if constexpr (Cfg::kCachedKv) {
        const CachedKv& cache = kp.cache;
        // A tile's boxes, each from its page (cached_kv_sm90.cuh). Their table entries are read
        // one K load ahead, so the read overlaps the previous tile's wait and copies, and kept
        // for the tile's V load, which comes after the next tile's K. A box's coordinates and
        // stage address are made before the stage's wait, so that only the copies follow the
        // consumers' release: made after it, d128 chunks on pages of 16 read 3-8% less (H100,
        // perf notes v24), two stages leaving the producer no slack for its arithmetic.
        auto sources_of = [&](int n_block) {
          return cache.template box_source<Cfg::kPaged>(tile.batch, n_block * kBlockN, lane);
        };
        // A lane's box starts box_rows x lane rows into its stage (CachedKv::box): a stage
        // holds 8-row groups of every column one after another, and the 128-byte swizzle acts
        // on address bits inside a group's 1 KB blocks, which a group's start leaves alone.
        static_assert(get_nonswizzle_portion(typename Cfg::SmemLayoutK{})(8, 0, 0) ==
                              8 * Cfg::kHeadDimQK &&
                      get_nonswizzle_portion(typename Cfg::SmemLayoutV{})(8, 0, 0) ==
                              8 * Cfg::kHeadDimV);
        auto issue = [&](auto& pipe, auto& state, const CacheMap& map, auto& smem,
                         auto head_dim, int2 source) {
          const int stage = state.index();
          const CacheBox box = cache.template box<decltype(head_dim)::value>(
              map, raw_pointer_cast(&smem(0, 0, stage)), source, kv_head, lane);
          uint64_t* barrier = pipe.producer_get_barrier(state);
          pipe.producer_acquire(state);
          CachedKv::copy(map, *barrier, box);
          ++state;
        };
        int2 next_k = sources_of(n_end - 1);
        int2 v_even, v_odd;  // the sources of the last two K tiles, by n_block's parity
        produce(
            [&](int n_block) {
              const int2 source = next_k;
              if (n_block > n_begin) next_k = sources_of(n_block - 1);
              (n_block % 2 == 0 ? v_even : v_odd) = source;
              issue(k_pipe, write_k, cache.k, sK, typename Cfg::DimQK{}, source);
            },
            [&](int n_block) {
              issue(v_pipe, write_v, cache.v, sV, typename Cfg::DimV{},
                    n_block % 2 == 0 ? v_even : v_odd);
            });
      } else {
        Tensor mK = kp.tma_k.get_tma_tensor(kp.k_shape)(_, _, kv_head, batch_coord);
        Tensor gK = local_tile(domain_offset(make_coord(static_cast<int>(seq.k_start), _0{}), mK),
                               Shape<typename Cfg::BlockN, typename Cfg::DimQK>{},
                               make_coord(_, _0{}));
        Tensor mV = kp.tma_v.get_tma_tensor(kp.v_shape)(_, _, kv_head, batch_coord);
        Tensor gV = local_tile(domain_offset(make_coord(static_cast<int>(seq.k_start), _0{}), mV),
                               Shape<typename Cfg::BlockN, typename Cfg::DimV>{},
                               make_coord(_, _0{}));
        auto k_part = tma_partition(kp.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(gK));  // (TMA, key tile), (TMA, stage)
        auto v_part = tma_partition(kp.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                    group_modes<0, 2>(gV));
        produce(
            [&](int n_block) {
              k_pipe.producer_acquire(write_k);
              if (lane == 0) {
                copy(kp.tma_k.with(*k_pipe.producer_get_barrier(write_k), 0),
                     get<0>(k_part)(_, n_block), get<1>(k_part)(_, write_k.index()));
              }
              ++write_k;
            },
            [&](int n_block) {
              v_pipe.producer_acquire(write_v);
              if (lane == 0) {
                copy(kp.tma_v.with(*v_pipe.producer_get_barrier(write_v), 0),
                     get<0>(v_part)(_, n_block), get<1>(v_part)(_, write_v.index()));
              }
              ++write_v;
            });
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegisters>();
  const int consumer = threadIdx.x - 128;   // 0 .. kConsumerThreads - 1
  const int consumer_wg = warpgroup - 1;    // which 64 query rows
  const int wg_thread = threadIdx.x % 128;
  const int wg_row0 = consumer_wg * 64 + wg_thread / 32 * 16 + lane / 4;  // + 8 * half
  const bool wg_leader = wg_thread == 0;
  auto warpgroup_sync = [&] { barrier_sync(Barrier::kWarpgroupFirst + consumer_wg, 128); };
  auto release_query = [&] { barrier_arrive(Barrier::kQueryEmptyFirst + consumer_wg, 128 + 32); };

  Tensor sQ = query_rows<Cfg>(shared, consumer_wg);
  Tensor sO = output_rows<Cfg>(shared, consumer_wg);
  typename Cfg::TiledMmaS mma_s;
  typename Cfg::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(wg_thread);
  auto thr_o = mma_o.get_thread_slice(wg_thread);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tOrV = thr_o.partition_fragment_B(sVt);
  auto smem_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_o);
  auto thr_copy_o = smem_copy_o.get_thread_slice(wg_thread);
  Tensor tOsO = thr_copy_o.partition_D(sO);

  // Ping-pong: warpgroup w issues its GEMMs after every other consumer warpgroup has issued
  // theirs since its last turn. Each takes its first turn in order: w arrives now for all
  // warpgroups before it.
  auto scheduler_wait = [&] {
    barrier_sync(Barrier::kSchedulerFirst + consumer_wg, kConsumerThreads);
  };
  auto scheduler_pass = [&] {
#pragma unroll
    for (int w = 0; w < kWarpgroups; ++w) {
      if (w != consumer_wg) barrier_arrive(Barrier::kSchedulerFirst + w, kConsumerThreads);
    }
  };
  for (int w = 0; w < consumer_wg; ++w) {
    barrier_arrive(Barrier::kSchedulerFirst + w, kConsumerThreads);
  }
  // A warpgroup frees its Q rows once per tile, after the tile's use of them; they start free.
  release_query();

  // A finished tile's O in 16 bits, and where it goes. With O in its own region the store
  // waits until the next tile's first QK^T is on the tensor cores and runs under it. A clock64
  // trace of d128 at S = 2k on an H200 put the store at 730-1770 of a tile's 43k cycles, all
  // of it at the tile boundary, where this warpgroup issues no GEMM; deferring it gained 1-7%
  // at S <= 4k with a causal mask (bench.ab, 3 interleaved runs), and was within noise without.
  Tensor tOrO_out = make_tensor<Element>(partition_shape_C(mma_o, Shape<_64, typename Cfg::DimV>{}));
  struct OutputRows {
    TileCoord tile;
    int64_t q_start;
    Element* rows;  // the warpgroup's first row of O in global memory
    int rows_valid;
  };
  OutputRows pending{};
  bool store_pending = false;

  // The warpgroup's 64 rows of tOrO_out to global memory. Its O region must be free: over Q,
  // its own last QK^T is done; in a region of its own, its previous TMA store has read it.
  // O staged over Q (d256) leaves with 16-byte stores only: in group mode the TMA store from
  // the Q region left whole 64-row blocks wrong (bf16 d256, H200: every row of a sequence
  // starting at packed row 64, and run-to-run differences), for reasons not found yet, while
  // the same rows stored from the same shared memory this way match the float64 reference.
  auto store_output = [&](const OutputRows& out) {
    if (Cfg::kSeparateO && wg_leader) tma_store_wait<0>();
    warpgroup_sync();
    copy(smem_copy_o, thr_copy_o.retile_S(tOrO_out), tOsO);
    cutlass::arch::fence_view_async_shared();  // the TMA store reads what stmatrix wrote
    warpgroup_sync();
    if (Cfg::kSeparateO && out.rows_valid == 64) {
      if (wg_leader) {
        Tensor mO = kp.tma_o.get_tma_tensor(kp.o_shape)(_, _, out.tile.head,
                                                        kGroup ? 0 : out.tile.batch);
        Tensor gO = local_tile(domain_offset(make_coord(static_cast<int>(out.q_start), _0{}), mO),
                               Shape<_64, typename Cfg::DimV>{},
                               make_coord(out.tile.m_block * kWarpgroups + consumer_wg, _0{}));
        auto tma_o = kp.tma_o.get_slice(_0{});
        copy(kp.tma_o, tma_o.partition_S(sO), tma_o.partition_D(gO));
        tma_store_arrive();
      }
    } else {
      // Ragged rows (and O over Q): TMA would write the rows past the sequence's end, which
      // belong to the next sequence (group mode) or lie past seqused.
      constexpr int kChunks = Cfg::kHeadDimV / 8;
      for (int idx = wg_thread; idx < out.rows_valid * kChunks; idx += 128) {
        const int row = idx / kChunks;
        const int col = (idx % kChunks) * 8;
        *reinterpret_cast<uint4*>(out.rows + row * p.o_seq_stride + col) =
            *reinterpret_cast<const uint4*>(raw_pointer_cast(&sO(row, col)));
      }
    }
  };

  cutlass::PipelineState<Cfg::kStages> read_k;
  cutlass::PipelineState<Cfg::kStages> read_v;
  int q_phase = 0;
  for (int unit = blockIdx.x; unit < scheduler.units(); unit += gridDim.x)
  for (int half = 0; half < 2; ++half) {
    TileCoord coord;
    if (!unit_tile<Cfg>(kp, unit, half, scheduler.batch_heads(), &coord)) continue;
    const WorkTile<Cfg> work(p, coord);
    if (!work.in_sequence()) continue;
    const TileCoord& tile = work.tile;
    const SequenceExtent& seq = work.seq;
    const int q_row0 = work.q_row0;
    const auto& mask = work.mask;
    const int n_begin = work.n_begin;
    const int n_end = work.n_end;
    const int rows_valid = min(kBlockM, seq.seqlen_q - q_row0);
    const int wg_rows_valid = max(0, min(64, rows_valid - 64 * consumer_wg));

    float* lse = nullptr;
    if constexpr (Cfg::kLse) {
      if (p.lse != nullptr) {
        lse = p.lse + tile.head * p.lse_head_stride +
              (kGroup ? seq.q_start : tile.batch * p.lse_batch_stride) + q_row0;
      }
    }
    auto* o_tile = static_cast<Element*>(p.o) + tile.head * p.o_head_stride +
                   (kGroup ? seq.q_start * p.o_seq_stride : tile.batch * p.o_batch_stride) +
                   static_cast<int64_t>(q_row0) * p.o_seq_stride;

    if (n_end <= n_begin) {
      // No row sees a key: O is 0 and the log-sum-exp -inf, written without shared memory
      // (the producer loads nothing for this tile, so the Q/O regions may be in use).
      constexpr int kChunks = Cfg::kHeadDimV / 8;
      for (int idx = consumer; idx < rows_valid * kChunks; idx += kConsumerThreads) {
        *reinterpret_cast<uint4*>(o_tile + (idx / kChunks) * p.o_seq_stride +
                                  (idx % kChunks) * 8) = make_uint4(0, 0, 0, 0);
      }
      if (lse != nullptr) {
        for (int row = consumer; row < rows_valid; row += kConsumerThreads) lse[row] = -INFINITY;
      }
      continue;
    }

    // The key tiles this warpgroup's own rows see end at wg_n_end, up to a tile before the
    // query tile's n_end under a causal mask or a window (at the diagonal of a causal 192-row
    // d64 tile the first warpgroup sees none of the last one or two 128-key tiles, the second
    // often none of the last), and rows past the sequence's end see none. The warpgroup takes its ping-pong
    // turns and passes those K/V stages on without issuing GEMMs, so the tensor cores serve
    // the other warpgroups alone; at least one step runs for rows that see no key at all, to
    // write their zeros.
    const int wg_first_row = q_row0 + 64 * consumer_wg;
    const int wg_last_row = wg_first_row + wg_rows_valid - 1;
    const int wg_n_end = wg_rows_valid == 0
                             ? n_begin
                             : max(n_begin + 1, min(n_end, mask.n_block_end(wg_last_row)));
    if (wg_n_end < n_end && Cfg::kSeparateO && store_pending) {
      store_output(pending);  // no GEMM of this warpgroup's to run under
      store_pending = false;
    }
    for (int n_block = n_end - 1; n_block >= wg_n_end; --n_block) {
      k_pipe.consumer_wait(read_k);
      scheduler_wait();
      scheduler_pass();
      k_pipe.consumer_release(read_k);
      ++read_k;
      v_pipe.consumer_wait(read_v);
      v_pipe.consumer_release(read_v);
      ++read_v;
    }
    if (wg_rows_valid == 0) {
      // It never reads its Q rows and has no O to write.
      shared.q_full[consumer_wg].wait(q_phase);
      q_phase ^= 1;
      release_query();
      continue;
    }

    Tensor tOrO = partition_fragment_C(mma_o, Shape<_64, typename Cfg::DimV>{});
    clear(tOrO);
    Tensor tOrP = make_tensor<Element>(
        Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>>{});
    RowStats stats;
    float correction[2];
    bool rescale_o = false;  // O is zero until the first PV product

    // Masks the key tile's invisible elements to -inf; only edge tiles have any.
    auto apply_mask = [&](auto& s, int n_block) {
      using Mask = typename WorkTile<Cfg>::Mask;
      if (!mask.is_edge_tile(wg_first_row, wg_last_row, n_block)) return;
      // Each of the thread's two rows sees the columns [lo, hi] counted from its first
      // column, so an element costs a compare against a constant (two with a left edge).
      const int col0 = n_block * kBlockN + 2 * (lane % 4);
      int lo[2], hi[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = q_row0 + wg_row0 + 8 * h;
        lo[h] = Mask::kHasLeft ? mask.first_visible_key(row) - col0 : 0;
        hi[h] = mask.last_visible_key(row) - col0;
      }
      constexpr int kValues = decltype(size(s))::value;
#pragma unroll
      for (int v = 0; v < kValues; ++v) {
        const int h = (v / 2) % 2;
        const int col = 8 * (v / 4) + v % 2;
        if (col > hi[h] || (Mask::kHasLeft && col < lo[h])) s(v) = -INFINITY;
      }
    };
    // Keys past the sequence's end get probability 0, but their V rows are whatever follows
    // in memory (the next sequence, or NaN-poisoned padding), and 0 * NaN is NaN: each
    // consumer warpgroup zeroes them before its own PV product reads them.
    const int last_tile_keys = seq.seqlen_k - (n_end - 1) * kBlockN;
    auto zero_v_tail = [&](int stage) {
      if (last_tile_keys >= kBlockN) return;
      constexpr int kChunks = Cfg::kHeadDimV / 8;
      for (int idx = wg_thread; idx < (kBlockN - last_tile_keys) * kChunks; idx += 128) {
        const int row = last_tile_keys + idx / kChunks;
        *reinterpret_cast<uint4*>(raw_pointer_cast(&sV(row, (idx % kChunks) * 8, stage))) =
            make_uint4(0, 0, 0, 0);
      }
      cutlass::arch::fence_view_async_shared();
      warpgroup_sync();
    };
    // With O in its own region, Q is free as soon as the tile's last QK^T has read it.
    auto query_read = [&](int n_block) {
      if (Cfg::kSeparateO && n_block == n_begin) release_query();
    };

    shared.q_full[consumer_wg].wait(q_phase);
    q_phase ^= 1;

    {  // The last key tile it sees (often the masked one) alone: nothing to overlap yet.
      Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, typename Cfg::BlockN>{});
      k_pipe.consumer_wait(read_k);
      scheduler_wait();
      warpgroup_gemm<true, -1>(mma_s, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
      scheduler_pass();
      if (Cfg::kSeparateO && store_pending) {
        store_output(pending);
        store_pending = false;
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      k_pipe.consumer_release(read_k);
      ++read_k;
      query_read(wg_n_end - 1);
      apply_mask(tSrS, wg_n_end - 1);
      stats.update(tSrS, p.softmax_mul, correction);  // O is still zero: nothing to rescale
      convert_p<Element>(tSrS, tOrP);
    }
    // The first V tile its PV products read is the query tile's last, ragged one unless it
    // idled past that.
    bool v_tail_pending = wg_n_end == n_end;
    for (int n_block = wg_n_end - 2; n_block >= n_begin; --n_block) {
      Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, typename Cfg::BlockN>{});
      k_pipe.consumer_wait(read_k);
      scheduler_wait();
      warpgroup_gemm<true, -1>(mma_s, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
      if (rescale_o) scale_rows(tOrO, correction);
      v_pipe.consumer_wait(read_v);
      if (v_tail_pending) {
        zero_v_tail(read_v.index());
        v_tail_pending = false;
      }
      warpgroup_gemm<false, -1>(mma_o, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
      scheduler_pass();
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      k_pipe.consumer_release(read_k);
      ++read_k;
      query_read(n_block);
      apply_mask(tSrS, n_block);
      rescale_o = stats.update(tSrS, p.softmax_mul, correction);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      v_pipe.consumer_release(read_v);
      ++read_v;
      convert_p<Element>(tSrS, tOrP);
    }
    if (rescale_o) scale_rows(tOrO, correction);
    v_pipe.consumer_wait(read_v);
    if (v_tail_pending) zero_v_tail(read_v.index());
    warpgroup_gemm<false, -1>(mma_o, tOrP, tOrV(_, _, _, read_v.index()), tOrO);

    // While the last PV product runs: the row sums, the log-sum-exp, 1 / rowsum.
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = stats.sum[h];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      // No visible key: output 0, log-sum-exp -inf, never NaN.
      inv[h] = sum > 0.f ? 1.f / sum : 0.f;
      const int row = wg_row0 + 8 * h;
      if (lse != nullptr && lane % 4 == 0 && row < rows_valid) {
        // A NaN sum (NaN or +inf among the logits) is no empty row: its LSE is NaN too.
        lse[row] = sum > 0.f    ? (stats.max[h] + log2f(sum)) *
                                   static_cast<float>(M_LN2)
                   : sum == 0.f ? -INFINITY
                                : NAN;
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    v_pipe.consumer_release(read_v);
    ++read_v;
    scale_rows(tOrO, inv);

#pragma unroll
    for (int v = 0; v < size(tOrO); ++v) tOrO_out(v) = static_cast<Element>(tOrO(v));
    pending = {tile, seq.q_start, o_tile + static_cast<int64_t>(64 * consumer_wg) * p.o_seq_stride,
               wg_rows_valid};
    if constexpr (Cfg::kSeparateO) {
      store_pending = true;
    } else {
      store_output(pending);
      release_query();
    }
  }
  if (Cfg::kSeparateO && store_pending) store_output(pending);
  // Shared memory must outlive the last store's reads of it.
  if (wg_leader) tma_store_wait<0>();
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
                                               (Cfg::kHeadDimQK + Cfg::kHeadDimV) * 2,
                                           batch_heads);
  kp.total_tiles = static_cast<int>(total_tiles);

  const int batch = kGroup ? 1 : args.batch;
  auto shape = [&](int64_t rows, int dim, int heads) {
    return typename Cfg::GmemShape(static_cast<int32_t>(rows), dim, heads, batch);
  };
  auto stride = [&](int64_t seq, int64_t head, int64_t batch_stride) {
    return typename Cfg::GmemStride(tma_stride(seq), _1{}, tma_stride(head),
                                    tma_stride(kGroup ? 0 : batch_stride));
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
  // A KV cache's maps are its launcher's (kvcache_chunked_prefill_sm90.cuh).
  if constexpr (!Cfg::kCachedKv) {
    kp.k_shape = shape(rows_k, args.hdim_q, args.nhead_k);
    kp.v_shape = shape(rows_k, args.hdim_v, args.nhead_k);
    const auto k_stride = stride(args.k_seq_stride, args.k_head_stride, args.k_batch_stride);
    const auto v_stride = stride(args.v_seq_stride, args.v_head_stride, args.v_batch_stride);
    kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem(args.k, kp.k_shape, k_stride),
                             take<0, 2>(typename Cfg::SmemLayoutK{}),
                             Shape<typename Cfg::BlockN, typename Cfg::DimQK>{}, _1{});
    kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem(args.v, kp.v_shape, v_stride),
                             take<0, 2>(typename Cfg::SmemLayoutV{}),
                             Shape<typename Cfg::BlockN, typename Cfg::DimV>{}, _1{});
  }
  kp.tma_o = make_tma_copy(
      SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<Element*>(args.o)),
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
