// The fa3 forward's K and V widened from an e4m3 KV cache, for chunked prefill (Cfg::kWidenKv,
// kvcache_chunked_prefill_sm90.cuh): the queries stay 16-bit (the FP8 cache halves what is
// stored and read, not the products' precision), so the products run in fp16, into which every
// e4m3 value converts exactly (e4m3_cache.cuh), as the decode kernel's do.
//
// The producer warp's TMA lands each key tile of the cache in a staging stage, a byte an element
// in the order its boxes write (rows of 64 bytes: [8-row group][64-column block][8 rows][64
// bytes], no swizzle; cached_kv_sm90.cuh); two more warps of the producer warpgroup
// (kWidenThreads) rewrite it into the consumers' 16-bit K or V stage, the forward's layout for a
// cache ([8-row group][64-column block][8 rows][128 bytes], 128-byte swizzle), and free the
// staging stage. A thread's step moves one 16-byte piece, 16 keys' elements of one row: one
// 16-byte load, eight cvt.rn.f16x2.e4m3x2, two 16-byte stores. Thread t takes pieces t, t + 64,
// ...: 64 pieces are two 8-row blocks, so each further piece is 1024 staged bytes and 2048
// widened bytes on, with the row, and so the swizzle, unchanged: the addresses are a base plus
// constants. A warp's stores of a phase fall in two rows whose swizzled 16-byte chunks are the
// even and the odd ones, so they do not conflict; its loads are 512 consecutive bytes.
//
// Queries: the forward's Q tile is TMA's copy of the call's q. bf16 queries become fp16 in place,
// times 2^-shift where the warpgroup's largest would pass fp16's range (query_shift), once per
// work tile and consumer warpgroup; the logits' scale takes 2^shift back.
#pragma once

#include <cstdint>

#include "fmha/kernels/e4m3_cache.cuh"
#include "fmha/kernels/fwd_fa3_config_sm90.cuh"
#include "fmha/kernels/fwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

// The widened K and V rings of a widening config (every thread makes them; warp 0 initializes
// their barriers), or nothing.
struct NoWidenedPipelines {};
template <class Cfg>
struct WidenedPipelines {
  typename Cfg::ConsumerKPipeline k;
  typename Cfg::ConsumerKPipeline v;
};
template <class Cfg>
__device__ __forceinline__ auto make_widened_pipelines(typename Cfg::SharedStorage& shared,
                                                       int warpgroup) {
  if constexpr (Cfg::kWidenKv) {
    using WidenedPipeline = typename Cfg::ConsumerKPipeline;
    const auto params = producer_warps_ring<WidenedPipeline>(warpgroup, Cfg::kWidenThreads,
                                                             Cfg::kConsumerThreads);
    return WidenedPipelines<Cfg>{WidenedPipeline(shared.widened_k_pipe, params),
                                 WidenedPipeline(shared.widened_v_pipe, params)};
  } else {
    return NoWidenedPipelines{};
  }
}

// The ring the consumers read K from: the widened K's, or K's own.
template <class Cfg, class Widened>
__device__ __forceinline__ typename Cfg::ConsumerKPipeline& consumer_k_pipeline(
    typename Cfg::Pipeline& k_pipe, Widened& widened) {
  if constexpr (Cfg::kWidenKv) {
    return widened.k;
  } else {
    return k_pipe;
  }
}

template <class Cfg>
class KvWiden {
 public:
  using SharedStorage = typename Cfg::SharedStorage;
  using StagingPipeline = typename Cfg::Pipeline;
  using WidenedPipeline = typename Cfg::ConsumerKPipeline;
  static_assert(Cfg::kWidenKv && Cfg::kHeadDimQK == Cfg::kHeadDimV);
  static constexpr int kThreads = Cfg::kWidenThreads;
  static constexpr int kPieceBytes = 16;  // staged: 16 e4m3; widened: 2 x 8 fp16
  static constexpr int kPieces = Cfg::kBlockN * Cfg::kHeadDimQK / 16;  // a stage's
  static constexpr int kPiecesPerThread = kPieces / kThreads;
  // Pieces whose loads are in flight together before the first conversion: one piece at a
  // time waited out each load's latency, 32 times a key tile.
  static constexpr int kBatch = 4;
  static_assert(kThreads == 64 && kPiecesPerThread % kBatch == 0);
  // A thread's next piece: 64 pieces on, two 8-row blocks of 64 columns (1 KB staged).
  static constexpr int kStagedStep = kThreads * kPieceBytes;
  static constexpr int kWidenedStep = 2 * kStagedStep;

  // thread: 0 .. kWidenThreads - 1.
  __device__ __forceinline__ KvWiden(SharedStorage& shared, StagingPipeline& k_staging,
                                     StagingPipeline& v_staging, WidenedPipeline& k_widened,
                                     WidenedPipeline& v_widened, int thread)
      : k_staging_(k_staging),
        v_staging_(v_staging),
        k_widened_(k_widened),
        v_widened_(v_widened) {
    // Piece `thread` of a stage: 16-byte column x16 of row r of 8-row block b (the block's
    // 64-column block c of row group g).
    constexpr int kColumnBlocks = Cfg::kHeadDimQK / 64;
    const int x16 = thread % 4;
    const int r = thread / 4 % 8;
    const int block = thread / 32;
    const int row = 8 * (block / kColumnBlocks) + r;
    const int col = 64 * (block % kColumnBlocks) + 16 * x16;
    k_staged_ = cute::cast_smem_ptr_to_uint(shared.k_staged.data()) + kPieceBytes * thread;
    v_staged_ = cute::cast_smem_ptr_to_uint(shared.v_staged.data()) + kPieceBytes * thread;
    // Through the stages' tensors: their swizzle acts on byte addresses.
    auto k = k_stages<Cfg>(shared);
    auto v = v_stages<Cfg>(shared);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      k_widened_at_[half] =
          cute::cast_smem_ptr_to_uint(cute::raw_pointer_cast(&k(row, col + 8 * half, 0)));
      v_widened_at_[half] =
          cute::cast_smem_ptr_to_uint(cute::raw_pointer_cast(&v(row, col + 8 * half, 0)));
    }
  }

  // One work tile: its key tiles in the order the producer loads them (K of step j + 1 before
  // V of step j, key tiles last to first).
  __device__ __forceinline__ void operator()(const WorkTile<Cfg>& work) {
    if (work.sees_no_key()) return;
    widen(k_staging_, k_widened_, read_k_, write_k_, k_staged_, k_widened_at_);
    for (int n_block = work.n_end - 1; n_block > work.n_begin; --n_block) {
      widen(k_staging_, k_widened_, read_k_, write_k_, k_staged_, k_widened_at_);
      widen(v_staging_, v_widened_, read_v_, write_v_, v_staged_, v_widened_at_);
    }
    widen(v_staging_, v_widened_, read_v_, write_v_, v_staged_, v_widened_at_);
  }

 private:
  // Bytes between stages, and two 8-row blocks further on in a widened stage: whole 1 KB
  // swizzle atoms, so the swizzle (of address bits inside an atom) sees the same row.
  using Unswizzled = decltype(cute::get_nonswizzle_portion(typename Cfg::SmemLayoutK{}));
  static constexpr int kStagedStage = Cfg::kBlockN * Cfg::kHeadDimQK;
  static constexpr int kWidenedStage = 2 * Unswizzled{}(0, 0, 1);
  static_assert(2 * Unswizzled{}(kThreads * 16 / Cfg::kHeadDimQK, 0, 0) == kWidenedStep &&
                kWidenedStep % 1024 == 0 && kWidenedStage % 1024 == 0);

  template <class PipelineState>
  __device__ __forceinline__ void widen(StagingPipeline& staging, WidenedPipeline& widened,
                                        PipelineState& read, PipelineState& write,
                                        uint32_t staged_at, const uint32_t (&widened_at)[2]) {
    staging.consumer_wait(read);
    widened.producer_acquire(write);
    const uint32_t from = staged_at + read.index() * kStagedStage;
    const uint32_t to = write.index() * kWidenedStage;
#pragma unroll
    for (int i0 = 0; i0 < kPiecesPerThread; i0 += kBatch) {
      uint32_t e4m3[kBatch][4];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(e4m3[b][0]), "=r"(e4m3[b][1]), "=r"(e4m3[b][2]), "=r"(e4m3[b][3])
                     : "r"(from + (i0 + b) * kStagedStep));
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        uint32_t fp16[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          fp16[2 * w] = e4m3::widen_pair<false>(e4m3[b][w]);
          fp16[2 * w + 1] = e4m3::widen_pair<true>(e4m3[b][w]);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                       :: "r"(widened_at[half] + to + (i0 + b) * kWidenedStep),
                          "r"(fp16[4 * half]), "r"(fp16[4 * half + 1]), "r"(fp16[4 * half + 2]),
                          "r"(fp16[4 * half + 3]));
        }
      }
    }
    // The stores go through the generic proxy, and wgmma reads through the async one.
    cutlass::arch::fence_view_async_shared();
    widened.producer_commit(write);
    staging.consumer_release(read);
    ++read;
    ++write;
  }

  StagingPipeline& k_staging_;
  StagingPipeline& v_staging_;
  WidenedPipeline& k_widened_;
  WidenedPipeline& v_widened_;
  uint32_t k_staged_, v_staged_;  // this thread's first piece in staging stage 0
  uint32_t k_widened_at_[2], v_widened_at_[2];  // and its two halves in widened stage 0
  cutlass::PipelineState<Cfg::kStages> read_k_, read_v_;
  cutlass::PipelineState<Cfg::kStages> write_k_ =
      cutlass::make_producer_start_state<WidenedPipeline>();
  cutlass::PipelineState<Cfg::kStages> write_v_ =
      cutlass::make_producer_start_state<WidenedPipeline>();
};

// bf16 queries as fp16, in place in consumer warpgroup wg's Q rows once they have landed:
// returns the 2^shift that the logits' scale takes back (1 for fp16 queries). The rows are
// read twice, for their largest magnitude and to convert them (held in registers in between,
// they spilled the consumers'), and the warpgroup's threads meet twice: for that magnitude, and
// after the stores, which the first QK^T then reads through the async proxy.
template <class Cfg>
__device__ __forceinline__ float widen_query(typename Cfg::SharedStorage& shared,
                                             const ConsumerWarpgroup& wg) {
  if constexpr (!Cfg::kQueryBf16) {
    return 1.f;
  } else {
    constexpr int kPieces =  // 16-byte pieces a thread
        Cfg::kQRegion * static_cast<int>(sizeof(typename Cfg::Element)) / 16 / 128;
    uint4* const rows = reinterpret_cast<uint4*>(shared.q.data() + wg.index * Cfg::kQRegion);
    uint32_t amax = 0;  // the largest of each half; bf16 magnitudes order as their bits do
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const uint4 piece = rows[wg.thread + 128 * i];
      amax = __vmaxu2(amax, piece.x & 0x7fff7fffu);
      amax = __vmaxu2(amax, piece.y & 0x7fff7fffu);
      amax = __vmaxu2(amax, piece.z & 0x7fff7fffu);
      amax = __vmaxu2(amax, piece.w & 0x7fff7fffu);
    }
    amax = __reduce_max_sync(0xffffffff, max(amax & 0xffffu, amax >> 16));
    if (wg.lane == 0) shared.query_amax[wg.index][wg.thread / 32] = amax;
    wg.sync();
    const uint32_t* warps = shared.query_amax[wg.index];
    amax = max(max(warps[0], warps[1]), max(warps[2], warps[3]));
    const int shift = e4m3::query_shift(__uint_as_float(amax << 16));
    const float down = __uint_as_float(static_cast<uint32_t>(127 - shift) << 23);
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const uint4 piece = rows[wg.thread + 128 * i];
      uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const __half2 h = __floats2half2_rn(__uint_as_float(words[w] << 16) * down,
                                            __uint_as_float(words[w] & 0xffff0000u) * down);
        words[w] = *reinterpret_cast<const uint32_t*>(&h);
      }
      rows[wg.thread + 128 * i] = make_uint4(words[0], words[1], words[2], words[3]);
    }
    cutlass::arch::fence_view_async_shared();
    wg.sync();
    return __uint_as_float(static_cast<uint32_t>(127 + shift) << 23);
  }
}

}  // namespace fmha::fa3
