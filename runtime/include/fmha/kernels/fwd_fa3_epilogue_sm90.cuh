// The fa3 forward's epilogue, per consumer warpgroup and work tile: O / rowsum goes to shared
// memory (stmatrix) and out with one TMA store when the warpgroup's 64 rows are whole and O has
// a region of its own (then while the next tile's first QK^T runs), else with predicated
// 16-byte stores; the log-sum-exp goes straight from registers. A tile whose rows see no key
// gets O = 0 and log-sum-exp -inf.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include "fmha/fmha.h"
#include "fmha/kernels/fwd_fa3_config_sm90.cuh"
#include "fmha/kernels/fwd_fa3_mainloop_sm90.cuh"
#include "fmha/kernels/fwd_fa3_scheduler_sm90.cuh"

namespace fmha::fa3 {

// A finished tile's O in 16 bits, in registers until it is stored. With O in its own region the
// store waits until the next tile's first QK^T is on the tensor cores and runs under it. A
// clock64 trace of d128 at S = 2k on an H200 put the store at 730-1770 of a tile's 43k cycles,
// all of it at the tile boundary, where this warpgroup issues no GEMM; deferring it gained 1-7%
// at S <= 4k with a causal mask (bench.ab, 3 interleaved runs), and was within noise without.
//
// The kernel holds it, not the Epilogue: stmatrix reads it through a view that takes its
// address, which as a member would keep the whole Epilogue (the deferred store's rows among
// it) in memory until late in NVVM's pipeline, and the ragged-row store loop then compiled
// differently (scripts/ptx_identity.py).
template <class Cfg>
using StagedO = decltype(cute::make_tensor<typename Cfg::OutElement>(cute::partition_shape_C(
    typename Cfg::TiledMmaO{}, cute::Shape<cute::_64, typename Cfg::DimV>{})));

template <class Cfg>
class Epilogue {
 public:
  // O's: for e4m3 inputs the bits of O's 16-bit type, bf16 or fp16 (FwdParams::o_fp16), held
  // as bf16 in registers, shared memory and the TMA store's tensor map, which copy bits.
  using Element = typename Cfg::OutElement;
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;

  // Thread 0, before the CTA's first barrier.
  static __device__ __forceinline__ void prefetch_descriptor(const KernelParams& kp) {
    cute::prefetch_tma_descriptor(kp.tma_o.get_tma_descriptor());
  }

  __device__ __forceinline__ Epilogue(const KernelParams& kp, SharedStorage& shared,
                                      const ConsumerWarpgroup& wg, StagedO<Cfg>& staged_o)
      : tOrO_out_(staged_o),
        kp_(kp),
        wg_(wg),
        sO_(output_rows<Cfg>(shared, wg.index)),
        thr_copy_o_(smem_copy_o_.get_thread_slice(wg.thread)),
        tOsO_(thr_copy_o_.partition_D(sO_)) {}

  // Where a work tile's rows go, from its first row: the log-sum-exp (null without) and O.
  // Pointers, not a struct of them: NVVM's first passes see a struct's fields as memory, and
  // the LSE's null test then compiled differently (scripts/ptx_identity.py).
  __device__ __forceinline__ float* lse_rows(const WorkTile<Cfg>& work) const {
    constexpr bool kGroup = Cfg::kMode == Mode::kGroup;
    const FwdParams& p = kp_.p;
    float* lse = nullptr;
    if constexpr (Cfg::kLse) {
      if (p.lse != nullptr) {
        lse = p.lse + work.tile.head * p.lse_head_stride +
              (kGroup ? work.seq.q_start : work.tile.batch * p.lse_batch_stride) + work.q_row0;
      }
    }
    return lse;
  }
  __device__ __forceinline__ Element* o_rows(const WorkTile<Cfg>& work) const {
    constexpr bool kGroup = Cfg::kMode == Mode::kGroup;
    const FwdParams& p = kp_.p;
    return static_cast<Element*>(p.o) + work.tile.head * p.o_head_stride +
           (kGroup ? work.seq.q_start * p.o_seq_stride : work.tile.batch * p.o_batch_stride) +
           static_cast<int64_t>(work.q_row0) * p.o_seq_stride;
  }

  // No row sees a key: O is 0 and the log-sum-exp -inf, written by every consumer thread
  // without shared memory (the producer loads nothing for this tile, so the Q/O regions may be
  // in use).
  __device__ __forceinline__ void write_unseen(float* lse, Element* o, int rows_valid) const {
    constexpr int kChunks = Cfg::kHeadDimV / 8;
    for (int idx = wg_.consumer; idx < rows_valid * kChunks; idx += Cfg::kConsumerThreads) {
      *reinterpret_cast<uint4*>(o + (idx / kChunks) * kp_.p.o_seq_stride + (idx % kChunks) * 8) =
          make_uint4(0, 0, 0, 0);
    }
    if (lse != nullptr) {
      for (int row = wg_.consumer; row < rows_valid; row += Cfg::kConsumerThreads) {
        lse[row] = -INFINITY;
      }
    }
  }

  // The previous tile's O, deferred (store_tile), leaves now: under this tile's first QK^T, or
  // at once when the warpgroup has no GEMM of this tile to run it under.
  __device__ __forceinline__ void store_deferred() {
    if (Cfg::kSeparateO && store_pending_) {
      store(pending_);
      store_pending_ = false;
    }
  }

  // While the last PV product runs: the row sums, the log-sum-exp, and what O's rows are
  // multiplied by, out_scale / rowsum (out_scale: e4m3's v_descale, else 1).
  template <class Stats>
  __device__ __forceinline__ void finish_rows(const Stats& stats, float out_scale, float* lse,
                                              int rows_valid, float (&inv)[2]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = stats.sum[h];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      // No visible key: output 0, log-sum-exp -inf, never NaN.
      inv[h] = sum > 0.f ? out_scale / sum : 0.f;
      const int row = wg_.row0 + 8 * h;
      if (lse != nullptr && wg_.lane % 4 == 0 && row < rows_valid) {
        // A NaN sum (NaN or +inf among the logits) is no empty row: its LSE is NaN too.
        lse[row] = sum > 0.f    ? (stats.max[h] - Stats::kPScaleLog2 + log2f(sum)) *
                                         static_cast<float>(M_LN2)
                   : sum == 0.f ? -INFINITY
                                : NAN;
      }
    }
  }

  // The tile's O / rowsum in 16 bits, and out: over Q at once (the next Q waits for it), in a
  // region of its own deferred to the next tile's first QK^T (store_deferred).
  template <class TensorO>
  __device__ __forceinline__ void store_tile(TensorO& tOrO, const float (&inv)[2],
                                             const WorkTile<Cfg>& work, Element* o,
                                             int wg_rows_valid) {
    scale_rows(tOrO, inv);
    // e4m3 inputs: the call's choice, one for the whole grid (a uniform branch). One instance
    // serves both 16-bit outputs, and only this rounding differs.
    if (Cfg::kFp8 && kp_.p.o_fp16) {
#pragma unroll
      for (int v = 0; v < cute::size(tOrO); ++v) {
        tOrO_out_(v) = Element::bitcast(cutlass::half_t(tOrO(v)).raw());
      }
    } else {
#pragma unroll
      for (int v = 0; v < cute::size(tOrO); ++v) tOrO_out_(v) = static_cast<Element>(tOrO(v));
    }
    pending_ = {work.tile, work.seq.q_start,
                o + static_cast<int64_t>(64 * wg_.index) * kp_.p.o_seq_stride,
                wg_rows_valid};
    if constexpr (Cfg::kSeparateO) {
      store_pending_ = true;
    } else {
      store(pending_);
      wg_.release_query();
    }
  }

  // After the last tile: its deferred store, and shared memory kept until the stores have
  // read it.
  __device__ __forceinline__ void finish() {
    if (Cfg::kSeparateO && store_pending_) store(pending_);
    if (wg_.leader) cute::tma_store_wait<0>();
  }

 private:
  struct OutputRows {
    TileCoord tile;
    int64_t q_start;
    Element* rows;  // the warpgroup's first row of O in global memory
    int rows_valid;
  };

  // The warpgroup's 64 rows of tOrO_out to global memory. Its O region must be free: over Q,
  // its own last QK^T is done; in a region of its own, its previous TMA store has read it.
  // O staged over Q (d256) leaves with 16-byte stores only: in group mode the TMA store from
  // the Q region left whole 64-row blocks wrong (bf16 d256, H200: every row of a sequence
  // starting at packed row 64, and run-to-run differences), for reasons not found yet, while
  // the same rows stored from the same shared memory this way match the float64 reference.
  __device__ void store(const OutputRows& out) {
    using namespace cute;
    constexpr bool kGroup = Cfg::kMode == Mode::kGroup;
    if (Cfg::kSeparateO && wg_.leader) tma_store_wait<0>();
    wg_.sync();
    copy(smem_copy_o_, thr_copy_o_.retile_S(tOrO_out_), tOsO_);
    cutlass::arch::fence_view_async_shared();  // the TMA store reads what stmatrix wrote
    wg_.sync();
    if (Cfg::kSeparateO && out.rows_valid == 64) {
      if (wg_.leader) {
        Tensor mO = kp_.tma_o.get_tma_tensor(kp_.o_shape)(_, _, out.tile.head,
                                                          kGroup ? 0 : out.tile.batch);
        Tensor gO = local_tile(domain_offset(make_coord(static_cast<int>(out.q_start), _0{}), mO),
                               Shape<_64, typename Cfg::DimV>{},
                               make_coord(out.tile.m_block * Cfg::kConsumerWarpgroups + wg_.index,
                                          _0{}));
        auto tma_o = kp_.tma_o.get_slice(_0{});
        copy(kp_.tma_o, tma_o.partition_S(sO_), tma_o.partition_D(gO));
        tma_store_arrive();
      }
    } else {
      // Ragged rows (and O over Q): TMA would write the rows past the sequence's end, which
      // belong to the next sequence (group mode) or lie past seqused.
      constexpr int kChunks = Cfg::kHeadDimV / 8;
      for (int idx = wg_.thread; idx < out.rows_valid * kChunks; idx += 128) {
        const int row = idx / kChunks;
        const int col = (idx % kChunks) * 8;
        *reinterpret_cast<uint4*>(out.rows + row * kp_.p.o_seq_stride + col) =
            *reinterpret_cast<const uint4*>(raw_pointer_cast(&sO_(row, col)));
      }
    }
  }

  using SmemO = decltype(output_rows<Cfg>(std::declval<SharedStorage&>(), 0));
  using SmemCopyO = decltype(cute::make_tiled_copy_C(
      cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>{}, typename Cfg::TiledMmaO{}));
  using ThrCopyO = decltype(std::declval<SmemCopyO&>().get_thread_slice(0));
  using PartO = decltype(std::declval<ThrCopyO&>().partition_D(std::declval<SmemO&>()));
  StagedO<Cfg>& tOrO_out_;
  const KernelParams& kp_;
  const ConsumerWarpgroup wg_;
  SmemO sO_;
  SmemCopyO smem_copy_o_;
  ThrCopyO thr_copy_o_;
  PartO tOsO_;
  OutputRows pending_{};  // where the staged O goes
  bool store_pending_ = false;
};

}  // namespace fmha::fa3
