// The fa3 forward's mainloop, per consumer warpgroup and work tile: over the key tiles its rows
// see, last to first,
//   S = Q K^T   wgmma, both operands from shared memory (128-byte swizzle), fp32 accumulators
//   softmax     online, on the accumulators (exp2 with the scale folded into one FFMA)
//   O += P V    wgmma, P from registers (S's accumulator layout is the A-operand register
//               layout once rounded to 16 bits; e4m3 P is moved into it, convert_p_e4m3) and
//               V from shared memory, read transposed (e4m3: stored transposed).
// Two overlaps keep the tensor cores busy during the softmax (FlashAttention-3, section 3):
//   - within a warpgroup, S of step j+1 and O += P_j V_j are issued together and the softmax of
//     step j+1 runs while the PV product is still on the tensor cores;
//   - across warpgroups, named barriers take turns issuing those GEMMs (ping-pong, GemmTurns),
//     so one warpgroup's softmax overlaps the other's GEMMs.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include "fmha/kernels/fwd_fa3_config_sm90.cuh"
#include "fmha/kernels/fwd_fa3_kv_widen_sm90.cuh"
#include "fmha/kernels/fwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/sm80_primitives.cuh"
#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

// The softmax state of the two rows a thread holds in a wgmma accumulator: value v of the
// fragment ((2, 2, N / 8), 1, 1) is row half (v / 2) % 2 (rows r and r + 8), column
// 8 * (v / 4) + 2 * (lane % 4) + v % 2.
//
// 16-bit P: the running max that the exponents subtract moves only when a row's new max
// exceeds it by more than 2^kStaleMaxLog2 (FlashAttention-4's conditional rescaling): P then
// stays below 256, which fp16, bf16 and the fp32 sums hold with their usual relative precision,
// and O, whose rescale is the softmax's largest cost (128 FMULs per thread and key tile at d256
// against 40 exponentials), is rescaled only in the steps where some row of the warp moved its
// max.
// e4m3 P: the max is exact and P is scaled by 2^kPScaleLog2 = 256 before the cast, so that P
// spans (0, 256] of e4m3's range (448 at most, normal from 2^-6, subnormal to 2^-9): a
// probability keeps e4m3's 3 mantissa bits down to 2^-14 of its row's largest and reaches 0
// only below 2^-18 (FlashAttention-3's choice). The sums are of the scaled P, so O / sum
// cancels the scale; the log-sum-exp takes it out.
template <bool kFp8>
struct RowStats {
  static constexpr float kStaleMaxLog2 = kFp8 ? 0.f : 8.f;
  static constexpr float kPScaleLog2 = kFp8 ? 8.f : 0.f;
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
      const float m_scaled = (max[h] == -INFINITY ? 0.f : max[h]) - kPScaleLog2;
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

// Ping-pong: warpgroup w issues its GEMMs after every other consumer warpgroup has issued
// theirs since its last turn.
template <int kWarpgroups>
struct GemmTurns {
  static constexpr int kThreads = 128 * kWarpgroups;
  int wg;

  // Each takes its first turn in order: w arrives now for all warpgroups before it.
  __device__ __forceinline__ void enter() const {
    for (int w = 0; w < wg; ++w) {
      barrier_arrive(Barrier::kSchedulerFirst + w, kThreads);
    }
  }
  __device__ void wait() const { barrier_sync(Barrier::kSchedulerFirst + wg, kThreads); }
  __device__ void pass() const {
#pragma unroll
    for (int w = 0; w < kWarpgroups; ++w) {
      if (w != wg) barrier_arrive(Barrier::kSchedulerFirst + w, kThreads);
    }
  }
};

// One consumer warpgroup's GEMMs and softmax: its Q rows, the K and V rings' stages as wgmma
// operands, and its read positions in the rings.
template <class Cfg>
class Mainloop {
 public:
  using Element = typename Cfg::Element;
  using SharedStorage = typename Cfg::SharedStorage;
  using KPipeline = typename Cfg::ConsumerKPipeline;  // the widened K's ring of an e4m3 cache
  using VPipeline = typename Cfg::ConsumerVPipeline;  // V^T's ring where V is transposed
  using TiledMmaS = typename Cfg::TiledMmaS;
  using TiledMmaO = typename Cfg::TiledMmaO;

 private:
  // The operands' types: the smem tensors and their wgmma descriptor fragments.
  using SmemQ = decltype(query_rows<Cfg>(std::declval<SharedStorage&>(), 0));
  using SmemK = decltype(k_stages<Cfg>(std::declval<SharedStorage&>()));
  using SmemV = decltype(v_stages<Cfg>(std::declval<SharedStorage&>()));
  using SmemVt = decltype(vt_stages<Cfg>(std::declval<SharedStorage&>()));
  using ThrMmaS = decltype(std::declval<TiledMmaS&>().get_thread_slice(0));
  using ThrMmaO = decltype(std::declval<TiledMmaO&>().get_thread_slice(0));
  using FragQ = decltype(std::declval<ThrMmaS&>().partition_fragment_A(std::declval<SmemQ&>()));
  using FragK = decltype(std::declval<ThrMmaS&>().partition_fragment_B(std::declval<SmemK&>()));
  using FragV = decltype(std::declval<ThrMmaO&>().partition_fragment_B(std::declval<SmemVt&>()));
  // P as the PV product's A operand: k16 steps of 16-bit pairs, or k32 steps of e4m3 quads.
  using PLayout = std::conditional_t<
      Cfg::kFp8,
      cute::Layout<cute::Shape<cute::Shape<cute::_4, cute::_2, cute::_2>, cute::_1,
                               cute::Int<Cfg::kBlockN / 32>>>,
      cute::Layout<cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1,
                               cute::Int<Cfg::kBlockN / 16>>>>;

  template <class TensorS, class TensorP>
  static __device__ __forceinline__ void to_operand(const TensorS& s, TensorP& p) {
    if constexpr (Cfg::kFp8) {
      convert_p_e4m3(s, p);
    } else {
      convert_p<Element>(s, p);
    }
  }

 public:
  __device__ __forceinline__ Mainloop(SharedStorage& shared, KPipeline& k_pipe, VPipeline& v_pipe,
                                      const ConsumerWarpgroup& wg)
      : shared_(shared),
        k_pipe_(k_pipe),
        v_pipe_(v_pipe),
        wg_(wg),
        sV_(v_stages<Cfg>(shared)),
        thr_s_(mma_s_.get_thread_slice(wg.thread)),
        thr_o_(mma_o_.get_thread_slice(wg.thread)),
        tSrQ_(thr_s_.partition_fragment_A(query_rows<Cfg>(shared, wg.index))),
        tSrK_(thr_s_.partition_fragment_B(k_stages<Cfg>(shared))),
        tOrV_(thr_o_.partition_fragment_B(vt_stages<Cfg>(shared))),
        turns_{wg.index} {}

  // Before the first tile: the warpgroup's first ping-pong turn.
  __device__ __forceinline__ void enter_turns() const { turns_.enter(); }

  // The key tiles this warpgroup's own rows see end at wg_n_end, up to a tile before the
  // query tile's n_end under a causal mask or a window (at the diagonal of a causal 192-row
  // d64 tile the first warpgroup sees none of the last one or two 128-key tiles, the second
  // often none of the last), and rows past the sequence's end see none. The warpgroup takes
  // its ping-pong turns and passes those K/V stages on without issuing GEMMs (pass_unseen), so
  // the tensor cores serve the other warpgroups alone; at least one step runs for rows that see
  // no key at all, to write their zeros.
  __device__ __forceinline__ int key_tiles_end(const WorkTile<Cfg>& work,
                                               int wg_rows_valid) const {
    const int wg_last_row = work.q_row0 + 64 * wg_.index + wg_rows_valid - 1;
    return wg_rows_valid == 0
               ? work.n_begin
               : max(work.n_begin + 1, min(work.n_end, work.mask.n_block_end(wg_last_row)));
  }
  __device__ __forceinline__ void pass_unseen(int n_end, int wg_n_end) {
    for (int n_block = n_end - 1; n_block >= wg_n_end; --n_block) {
      k_pipe_.consumer_wait(read_k_);
      turns_.wait();
      turns_.pass();
      k_pipe_.consumer_release(read_k_);
      ++read_k_;
      v_pipe_.consumer_wait(read_v_);
      v_pipe_.consumer_release(read_v_);
      ++read_v_;
    }
  }

  // A warpgroup without rows in the tile never reads its Q rows (and has no O to write).
  __device__ __forceinline__ void skip_query() {
    shared_.q_full[wg_.index].wait(q_phase_);
    q_phase_ ^= 1;
    wg_.release_query();
  }

  // O (unnormalized) and the row statistics of key tiles [n_begin, wg_n_end), returning with
  // the last PV product still on the tensor cores (finish waits for it). The epilogue's
  // deferred store of the previous tile runs under the first QK^T. `softmax_mul` turns a raw
  // score into log2 units (e4m3: the descales of Q and K in it).
  template <class TensorO, class Stats, class Epilogue>
  __device__ __forceinline__ void run(const WorkTile<Cfg>& work, int wg_rows_valid,
                                      int wg_n_end, float softmax_mul, TensorO& tOrO,
                                      Stats& stats, Epilogue& epilogue) {
    using namespace cute;
    constexpr int kBlockN = Cfg::kBlockN;
    const int q_row0 = work.q_row0;
    const auto& mask = work.mask;
    const int n_begin = work.n_begin;
    const int n_end = work.n_end;
    const int wg_first_row = q_row0 + 64 * wg_.index;
    const int wg_last_row = wg_first_row + wg_rows_valid - 1;

    clear(tOrO);
    Tensor tOrP = make_tensor<Element>(PLayout{});
    float correction[2];
    bool rescale_o = false;  // O is zero until the first PV product

    // Masks the key tile's invisible elements to -inf; only edge tiles have any.
    auto apply_mask = [&](auto& s, int n_block) {
      using Mask = typename WorkTile<Cfg>::Mask;
      if (!mask.is_edge_tile(wg_first_row, wg_last_row, n_block)) return;
      // Each of the thread's two rows sees the columns [lo, hi] counted from its first
      // column, so an element costs a compare against a constant (two with a left edge).
      const int col0 = n_block * kBlockN + 2 * (wg_.lane % 4);
      int lo[2], hi[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = q_row0 + wg_.row0 + 8 * h;
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
    // (A transposed V's are zeros already: VTranspose writes them so.)
    const int last_tile_keys = work.seq.seqlen_k - (n_end - 1) * kBlockN;
    auto zero_v_tail = [&](int stage) {
      if (last_tile_keys >= kBlockN) return;
      if constexpr (Cfg::kVtInGlobal) {
        // V^T: the tail is the last columns of every row, one e4m3 byte each, addressed
        // through the swizzled layout (the last tile only).
        const int tail = kBlockN - last_tile_keys;
        for (int idx = wg_.thread; idx < tail * Cfg::kHeadDimV; idx += 128) {
          *reinterpret_cast<uint8_t*>(raw_pointer_cast(
              &sV_(idx / tail, last_tile_keys + idx % tail, stage))) = 0;
        }
      } else {
        constexpr int kChunks = Cfg::kHeadDimV / 8;
        for (int idx = wg_.thread; idx < (kBlockN - last_tile_keys) * kChunks; idx += 128) {
          const int row = last_tile_keys + idx / kChunks;
          *reinterpret_cast<uint4*>(raw_pointer_cast(&sV_(row, (idx % kChunks) * 8, stage))) =
              make_uint4(0, 0, 0, 0);
        }
      }
      cutlass::arch::fence_view_async_shared();
      wg_.sync();
    };
    // With O in its own region, Q is free as soon as the tile's last QK^T has read it.
    auto query_read = [&](int n_block) {
      if (Cfg::kSeparateO && n_block == n_begin) wg_.release_query();
    };

    shared_.q_full[wg_.index].wait(q_phase_);
    q_phase_ ^= 1;
    if constexpr (Cfg::kWidenKv) softmax_mul *= widen_query<Cfg>(shared_, wg_);

    {  // The last key tile it sees (often the masked one) alone: nothing to overlap yet.
      Tensor tSrS = partition_fragment_C(mma_s_, Shape<_64, typename Cfg::BlockN>{});
      k_pipe_.consumer_wait(read_k_);
      turns_.wait();
      warpgroup_gemm<true, -1>(mma_s_, tSrQ_, tSrK_(_, _, _, read_k_.index()), tSrS);
      turns_.pass();
      epilogue.store_deferred();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      k_pipe_.consumer_release(read_k_);
      ++read_k_;
      query_read(wg_n_end - 1);
      apply_mask(tSrS, wg_n_end - 1);
      stats.update(tSrS, softmax_mul, correction);  // O is still zero: nothing to rescale
      to_operand(tSrS, tOrP);
    }
    // The first V tile its PV products read is the query tile's last, ragged one unless it
    // idled past that.
    bool v_tail_pending = !Cfg::kTransposeV && wg_n_end == n_end;
    for (int n_block = wg_n_end - 2; n_block >= n_begin; --n_block) {
      Tensor tSrS = partition_fragment_C(mma_s_, Shape<_64, typename Cfg::BlockN>{});
      k_pipe_.consumer_wait(read_k_);
      turns_.wait();
      warpgroup_gemm<true, -1>(mma_s_, tSrQ_, tSrK_(_, _, _, read_k_.index()), tSrS);
      if (rescale_o) scale_rows(tOrO, correction);
      v_pipe_.consumer_wait(read_v_);
      if (v_tail_pending) {
        zero_v_tail(read_v_.index());
        v_tail_pending = false;
      }
      warpgroup_gemm<false, -1>(mma_o_, tOrP, tOrV_(_, _, _, read_v_.index()), tOrO);
      turns_.pass();
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      k_pipe_.consumer_release(read_k_);
      ++read_k_;
      query_read(n_block);
      apply_mask(tSrS, n_block);
      rescale_o = stats.update(tSrS, softmax_mul, correction);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      v_pipe_.consumer_release(read_v_);
      ++read_v_;
      to_operand(tSrS, tOrP);
    }
    if (rescale_o) scale_rows(tOrO, correction);
    v_pipe_.consumer_wait(read_v_);
    if (v_tail_pending) zero_v_tail(read_v_.index());
    warpgroup_gemm<false, -1>(mma_o_, tOrP, tOrV_(_, _, _, read_v_.index()), tOrO);
  }

  // The last PV product done: O is whole, and its V stage free.
  template <class TensorO>
  __device__ __forceinline__ void finish(TensorO& tOrO) {
    cute::warpgroup_wait<0>();
    cute::warpgroup_fence_operand(tOrO);
    v_pipe_.consumer_release(read_v_);
    ++read_v_;
  }

 private:
  SharedStorage& shared_;
  KPipeline& k_pipe_;
  VPipeline& v_pipe_;
  const ConsumerWarpgroup wg_;
  SmemV sV_;
  TiledMmaS mma_s_;
  TiledMmaO mma_o_;
  ThrMmaS thr_s_;
  ThrMmaO thr_o_;
  FragQ tSrQ_;
  FragK tSrK_;
  FragV tOrV_;
  GemmTurns<Cfg::kConsumerWarpgroups> turns_;
  cutlass::PipelineState<Cfg::kStages> read_v_;
  cutlass::PipelineState<Cfg::kStages> read_k_;
  int q_phase_ = 0;
};

}  // namespace fmha::fa3
