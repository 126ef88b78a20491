// The fa3 backward's dQ path: each step's dQ of a query tile is added into the fp32 accumulator
// of kernel 1's padded layout (dq_tile), in the consumers' wgmma register order
// (dq_tile_offset), which kernel 3 converts. Two sides, by the config's work split:
//   BwdDqWriter  the second warp of the producer warpgroup (FlashAttention-3's dQ writer): per
//                step, one bulk reduce-add per dQ slice (cp.reduce.async.bulk .add.f32) out of
//                shared memory, where the consumers staged it (BwdDqOut), so the consumers never
//                wait on global memory; the key split and the products split;
//   BwdDqOut     a consumer warpgroup's side: stages its slice for the writer warp, or, with the
//                even head-dim split (no room for a shared dQ tile), adds its registers into the
//                accumulator with float4 atomics.
#pragma once

#include <cstdint>

#include "fmha/kernels/bwd_fa3_config_sm90.cuh"
#include "fmha/kernels/bwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

// Adds `bytes` (a multiple of 16) of fp32 from shared memory into global memory, both 16-byte
// aligned, as one asynchronous bulk operation of the issuing thread's current bulk group
// (commit it with cute::tma_store_arrive; cute::tma_store_wait waits until it has been read).
__device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem, uint32_t bytes) {
  const auto smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :
               : "l"(gmem), "r"(smem_addr), "r"(bytes)
               : "memory");
}

// Waits until every committed bulk group of this thread has completed, its writes to global
// memory included (tma_store_wait waits only until shared memory has been read).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" : : : "memory");
}

// The writer warp: per step of each key tile, waits for every consumer warpgroup's dQ slice in
// shared memory, adds it into the step's query tile of the accumulator, and frees the slice
// once the bulk reduce has read it. Lane 0 issues.
template <class Cfg>
class BwdDqWriter {
 public:
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;
  static_assert(Cfg::kDqWriterWarp, "the even head-dim split's consumers add dQ themselves");

  // Every slice starts free. `split`: whose dQ accumulator (deterministic mode).
  __device__ __forceinline__ BwdDqWriter(const KernelParams& kp, SharedStorage& shared,
                                         const KeyTileWalk& walk, int split, int lane)
      : kp_(kp), shared_(shared), walk_(walk), split_(split), lane_(lane) {
    for (int w = 0; w < Cfg::kConsumerWarpgroups; ++w) {
      barrier_arrive(BwdBarrier::kDqEmptyFirst + w, kDqBarrierThreads);
    }
  }

  // The steps of every key tile of the CTA's walk.
  __device__ __forceinline__ void run() {
    using namespace cute;
    const FwdParams& f = kp_.p.fwd;
    for (int n_block = walk_.n_block; n_block < kp_.p.n_blocks; n_block += walk_.n_stride) {
      const KeyTileWork<Cfg> work(f, walk_.batch, n_block);
      if (!work.has_steps()) continue;
      for (int g = 0; g < f.kv_group; ++g) {
        const int head = walk_.kv_head * f.kv_group + g;
        for (int m_block = work.m_begin; m_block < work.m_end; ++m_block) {
          float* tile = dq_tile<Cfg>(kp_, split_, head, walk_.batch, m_block);
#pragma unroll
          for (int w = 0; w < Cfg::kConsumerWarpgroups; ++w) {
            barrier_sync(BwdBarrier::kDqFullFirst + w, kDqBarrierThreads);
            if (lane_ == 0) {
              bulk_reduce_add(tile + w * Cfg::kDQSliceFloats, shared_.dq.slice[w],
                              Cfg::dq_slice_floats(w) * sizeof(float));
              tma_store_arrive();
            }
          }
          // The slices are free once read; warpgroup 0's was issued first.
#pragma unroll
          for (int w = 0; w < Cfg::kConsumerWarpgroups; ++w) {
            if (lane_ == 0) {
              if (w == 0) {
                tma_store_wait<Cfg::kConsumerWarpgroups - 1>();
              } else {
                tma_store_wait<0>();
              }
            }
            __syncwarp();
            barrier_arrive(BwdBarrier::kDqEmptyFirst + w, kDqBarrierThreads);
          }
        }
      }
      // Deterministic: a query tile's chunk gets one add per key tile; the next key tile's
      // adds start after this one's have landed, so each chunk sums in key-tile order.
      if (kp_.p.deterministic && lane_ == 0) bulk_wait_all();
    }
    if (lane_ == 0) tma_store_wait<0>();  // shared memory outlives the last reads of it
  }

 private:
  const KernelParams& kp_;
  SharedStorage& shared_;
  const KeyTileWalk walk_;
  const int split_;
  const int lane_;
};

// A consumer warpgroup's dQ of a step, slice by slice (dq_tile_offset's slices).
template <class Cfg>
class BwdDqOut {
 public:
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;

  __device__ __forceinline__ BwdDqOut(const KernelParams& kp, SharedStorage& shared, int split,
                                      int batch, int wg_thread)
      : kp_(kp), shared_(shared), split_(split), batch_(batch), wg_thread_(wg_thread) {}

  // dQ slice `slice` of query tile m_block of query head `head`, the accumulator `acc` of a
  // warpgroup's dQ GEMM.
  template <class Acc>
  __device__ __forceinline__ void put(const Acc& acc, int slice, int head, int m_block) const {
    if constexpr (Cfg::kDqWriterWarp) {
      stage(acc, slice);
    } else {
      add(acc, slice, head, m_block);
    }
  }

 private:
  // dQ slice `slice` of the step's query tile straight into the accumulator, float4s in its
  // register order (the even head-dim split; the other splits' writer warp does this with one
  // bulk reduce a slice). Deterministic mode: each float4 of a split's accumulator has one
  // writer thread, whose adds land in program order.
  template <class Acc>
  __device__ __forceinline__ void add(const Acc& acc, int slice, int head, int m_block) const {
    float4* dq_slice = reinterpret_cast<float4*>(
        dq_tile<Cfg>(kp_, split_, head, batch_, m_block) + slice * Cfg::kDQSliceFloats);
#pragma unroll
    for (int j = 0; j < decltype(cute::size(acc))::value / 4; ++j) {
      atomicAdd(dq_slice + 128 * j + wg_thread_,
                make_float4(acc(4 * j), acc(4 * j + 1), acc(4 * j + 2), acc(4 * j + 3)));
    }
  }

  // dQ slice `slice` to the writer warp through shared memory, in the same order.
  template <class Acc>
  __device__ __forceinline__ void stage(const Acc& acc, int slice) const {
    barrier_sync(BwdBarrier::kDqEmptyFirst + slice, kDqBarrierThreads);
    float4* dq_slice = reinterpret_cast<float4*>(shared_.dq.slice[slice]);
#pragma unroll
    for (int j = 0; j < decltype(cute::size(acc))::value / 4; ++j) {
      dq_slice[128 * j + wg_thread_] =
          make_float4(acc(4 * j), acc(4 * j + 1), acc(4 * j + 2), acc(4 * j + 3));
    }
    cutlass::arch::fence_view_async_shared();  // the bulk reduce reads it
    barrier_arrive(BwdBarrier::kDqFullFirst + slice, kDqBarrierThreads);
  }

  const KernelParams& kp_;
  SharedStorage& shared_;
  const int split_;
  const int batch_;
  const int wg_thread_;
};

}  // namespace fmha::fa3
