// The fa3 forward's V transpose for e4m3 inputs with a row-major V (Cfg::kTransposeV): the 8-bit
// wgmma reads its B operand K-major only, so the PV product needs V^T, keys contiguous, while
// models hold V with its head dim contiguous. The producer warp's TMA lands each row-major
// (keys, d) tile in the V ring as for 16-bit inputs; two more warps of the producer warpgroup
// (kTransposeThreads) rewrite it into the consumers' V^T ring, (d, keys), and free its stage.
// With no copy of V in global memory, group mode reads packed sequences as K is read.
//
// A step of one warp moves 16 keys x 32 columns of d (512 bytes) with one ldmatrix.trans and one
// stmatrix, both x4 over 8 x 16-byte rows whose addresses each lane gives freely:
//   ldmatrix.trans reads four (8 keys, 16 bytes of d) blocks as 8 x 8 b16 matrices: lane
//     (r = lane / 4, q = lane % 4) gets from block m the b16 column r of rows 2q and 2q + 1,
//     i.e. bytes d0 = 2r and d0 + 1 of two keys. Rows are chosen so that blocks 0 and 1 (2 and
//     3: the next 16 bytes of d) give lane q keys 4q .. 4q + 3 between them;
//   two PRMTs turn those two words into keys 4q .. 4q + 3 of column d0 and of d0 + 1;
//   stmatrix writes four (8 rows of d, 16 keys) blocks where lane (r, q) gives bytes 4q .. 4q + 3
//     of row r: columns d0 and d0 + 1 (blocks 0 and 1), and 16 + those (blocks 2, 3).
// Keys past the sequence's end are written as zeros: their probability is 0, but their V is
// whatever follows in memory (the next sequence, or NaN-poisoned padding), and 0 * NaN is NaN.
#pragma once

#include <cstdint>

#include "fmha/kernels/fwd_fa3_config_sm90.cuh"
#include "fmha/kernels/fwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

// The V^T ring of a transposing config (every thread makes it; warp 0 initializes its
// barriers), or nothing.
struct NoVtPipeline {};
template <class Cfg>
__device__ __forceinline__ auto make_vt_pipeline(typename Cfg::SharedStorage& shared,
                                                 int warpgroup) {
  if constexpr (Cfg::kTransposeV) {
    using VtPipeline = typename Cfg::VtPipeline;
    return VtPipeline(shared.vt_pipe, producer_warps_ring<VtPipeline>(
                                          warpgroup, Cfg::kTransposeThreads, Cfg::kConsumerThreads));
  } else {
    return NoVtPipeline{};
  }
}

// The ring the consumers read V from: V^T's where V is transposed, the widened V's where an
// e4m3 cache is widened (fwd_fa3_kv_widen_sm90.cuh), else V's own.
template <class Cfg, class VtPipe, class Widened>
__device__ __forceinline__ typename Cfg::ConsumerVPipeline& consumer_v_pipeline(
    typename Cfg::Pipeline& v_pipe, VtPipe& vt_pipe, Widened& widened) {
  if constexpr (Cfg::kTransposeV) {
    return vt_pipe;
  } else if constexpr (Cfg::kWidenKv) {
    return widened.v;
  } else {
    return v_pipe;
  }
}

template <class Cfg>
class VTranspose {
 public:
  using SharedStorage = typename Cfg::SharedStorage;
  using Pipeline = typename Cfg::Pipeline;
  using VtPipeline = typename Cfg::VtPipeline;
  static_assert(Cfg::kTransposeV);
  static constexpr int kWarps = Cfg::kTransposeThreads / 32;
  static constexpr int kColumnGroups = Cfg::kHeadDimV / 32 / kWarps;  // of 32 columns, per warp
  static constexpr int kBatch = 2;  // steps whose loads are in flight together
  static_assert(Cfg::kHeadDimV % (32 * kWarps) == 0 && Cfg::kBlockN % (16 * kBatch) == 0);

  // thread: 0 .. kTransposeThreads - 1.
  __device__ __forceinline__ VTranspose(SharedStorage& shared, Pipeline& v_pipe,
                                        VtPipeline& vt_pipe, int thread)
      : v_pipe_(v_pipe), vt_pipe_(vt_pipe), lane_(thread % 32) {
    const int warp = thread / 32;
    const int block = lane_ / 8;  // the ldmatrix / stmatrix block this lane addresses a row of
    const int row = lane_ % 8;
    // ldmatrix: block b's row `row` is key 4 (row / 2) + row % 2 + 2 ((b % 2) ^ (row >= 4)) of
    // the 16, bytes 16 (b / 2) .. + 15 of the 32 columns. stmatrix: block b's row `row` is
    // column 2 row + ((b % 2) ^ (row >= 4)) + 16 (b / 2), keys 0 .. 15. The exchanges at row 4
    // give each block's 8 rows 8 different 16-byte bank groups of the 128- and 64-byte
    // swizzles (keys 0 and 8, or columns 0 and 8, share one), so neither copy conflicts.
    const int upper = row >= 4;
    const int load_key = 4 * (row / 2) + row % 2 + 2 * ((block % 2) ^ upper);
    const int load_col = 16 * (block / 2);
    const int store_col = 2 * row + ((block % 2) ^ upper) + 16 * (block / 2);
    const uint32_t v_base = cute::cast_smem_ptr_to_uint(shared.v.data());
    const uint32_t vt_base = cute::cast_smem_ptr_to_uint(shared.vt.data());
#pragma unroll
    for (int group = 0; group < kColumnGroups; ++group) {
      const int col0 = (warp * kColumnGroups + group) * 32;
      load_[group] = v_base + VLayout{}(load_key, col0 + load_col, 0);
      store_[group] = vt_base + VtLayout{}(col0 + store_col, 0, 0);
    }
    // What this lane holds and stores: keys 4q .. 4q + 3 (q = lane % 4) of the 16, from words
    // w0 (keys 4q, 4q + 1, or for q >= 2 keys 4q + 2, 4q + 3) and w1 (the other two), at column
    // 2r and 2r + 1 (r = lane / 4), stored to blocks 0 and 1 in that order (r >= 4: swapped).
    const bool keys_swapped = lane_ % 4 >= 2;
    const uint32_t even = keys_swapped ? 0x2064 : 0x6420;  // PRMT selectors of column 2r
    const uint32_t odd = keys_swapped ? 0x3175 : 0x7531;   // and of 2r + 1
    const bool odd_first = lane_ / 4 >= 4;
    first_ = odd_first ? odd : even;
    second_ = odd_first ? even : odd;
  }

  // One work tile: its key tiles in the order the producer loads them, last to first.
  __device__ __forceinline__ void operator()(const WorkTile<Cfg>& work) {
    if (work.sees_no_key()) return;
    const int last_tile_keys = work.seq.seqlen_k - (work.n_end - 1) * Cfg::kBlockN;
    for (int n_block = work.n_end - 1; n_block >= work.n_begin; --n_block) {
      v_pipe_.consumer_wait(read_);
      vt_pipe_.producer_acquire(write_);
      if (n_block == work.n_end - 1 && last_tile_keys < Cfg::kBlockN) {
        transpose<true>(read_.index(), write_.index(), last_tile_keys);
      } else {
        transpose<false>(read_.index(), write_.index(), Cfg::kBlockN);
      }
      // stmatrix writes through the generic proxy, and wgmma reads through the async one.
      cutlass::arch::fence_view_async_shared();
      vt_pipe_.producer_commit(write_);
      v_pipe_.consumer_release(read_);
      ++read_;
      ++write_;
    }
  }

 private:
  using VLayout = typename Cfg::SmemLayoutV;    // (keys, d, stage); e4m3: offsets are bytes
  using VtLayout = typename Cfg::SmemLayoutVt;  // (d, keys, stage)
  // Addresses move by constants: a V row's swizzle repeats every 8 keys, so 16 keys further
  // down is 16 rows' bytes further on; a V^T row of keys is one swizzle row (at most 128
  // bytes), whose 16-byte chunks the swizzle permutes by XOR, so keys key0 .. key0 + 15 of a
  // column are at its keys 0 .. 15 XOR key0. Stages are whole swizzle atoms apart.
  static constexpr int kKeyPitch = VLayout{}(8, 0, 0) / 8;
  static constexpr int kVStage = VLayout{}(0, 0, 1);
  static constexpr int kVtStage = VtLayout{}(0, 0, 1);
  static_assert(Cfg::kBlockN <= 128 && kVtStage % 1024 == 0 && kVStage % 1024 == 0);

  // The row-major tile in V stage `from` to V^T stage `to`; kRagged: keys [keys, kBlockN) as
  // zeros. Each warp takes kColumnGroups groups of 32 columns and, for each, the tile's
  // groups of 16 keys, kBatch loads in flight before the first store.
  template <bool kRagged>
  __device__ __forceinline__ void transpose(int from, int to, int keys) const {
    const int word_key = 4 * (lane_ % 4);  // the first of each stored word's four keys
#pragma unroll
    for (int group = 0; group < kColumnGroups; ++group) {
      const uint32_t load = load_[group] + from * kVStage;
      const uint32_t store = store_[group] + to * kVtStage;
#pragma unroll
      for (int key0 = 0; key0 < Cfg::kBlockN; key0 += 16 * kBatch) {
        uint32_t w[kBatch][4];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(w[b][0]), "=r"(w[b][1]), "=r"(w[b][2]), "=r"(w[b][3])
                       : "r"(load + (key0 + 16 * b) * kKeyPitch));
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          uint32_t t[4];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            t[2 * half] = byte_perm(w[b][2 * half], w[b][2 * half + 1], first_);
            t[2 * half + 1] = byte_perm(w[b][2 * half], w[b][2 * half + 1], second_);
          }
          if constexpr (kRagged) {
            const int valid = keys - (key0 + 16 * b + word_key);  // of each word's four keys
            const uint32_t keep =
                valid >= 4 ? ~0u : valid <= 0 ? 0u : (1u << (8 * valid)) - 1u;
#pragma unroll
            for (int i = 0; i < 4; ++i) t[i] &= keep;
          }
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                       :: "r"(store ^ static_cast<uint32_t>(key0 + 16 * b)),
                          "r"(t[0]), "r"(t[1]), "r"(t[2]), "r"(t[3]));
        }
      }
    }
  }

  static __device__ __forceinline__ uint32_t byte_perm(uint32_t lo, uint32_t hi, uint32_t sel) {
    uint32_t out;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(lo), "r"(hi), "r"(sel));
    return out;
  }

  Pipeline& v_pipe_;
  VtPipeline& vt_pipe_;
  const int lane_;
  uint32_t load_[kColumnGroups];   // shared-memory addresses of stage 0, keys 0 .. 15
  uint32_t store_[kColumnGroups];
  uint32_t first_, second_;        // PRMT selectors of stmatrix blocks 0 and 1 (2 and 3)
  cutlass::PipelineState<Cfg::kStages> read_;
  cutlass::PipelineState<Cfg::kStages> write_ = cutlass::make_producer_start_state<VtPipeline>();
};

}  // namespace fmha::fa3
