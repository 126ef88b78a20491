// FlashAttention-2 backward pipeline for sm80-class GPUs (runs on sm90 too): dQ, dK, dV (and
// the bias gradient) of the forward in fwd_fa2_sm80.cuh, recomputing P from Q, K and the
// forward's log-sum-exp instead of storing it.
//
// One instance is three kernels, launched in order on one stream by launch_bwd:
//   1. bwd_dot_do_o_kernel: D = rowsum(dO * O) per (row, head), and zeroes the fp32 dQ
//      accumulator, both in the workspace;
//   2. bwd_kernel: one CTA per (key tile, K/V head, sequence). K_j and V_j stay in shared
//      memory and dK_j, dV_j in registers while the query tiles i that see key tile j stream
//      through a two-stage cp.async ring (Q_i, dO_i, LSE_i, D_i), for every query head sharing
//      the K/V head (MQA/GQA sum there, without a second pass), each CTA starting its walk at
//      a tile of its own. Per query tile:
//        S^T = K_j Q_i^T          -> logits (soft-cap, bias, ALiBi), mask on edge tiles
//        P^T = exp2(S^T - LSE)    -> dropout with the forward's Philox pattern
//        dP^T = V_j dO_i^T        -> dS^T = P^T * (dP^T - D)   (times tanh' under soft-cap)
//        dQ_i += dS K_j (fp32 reductions in global memory, issued during the next two GEMMs),
//        dV_j += P^T dO_i,  dK_j += dS^T Q_i
//      Warps own keys (S^T and dP^T come out of mma.sync with keys as rows), 32 of them up to
//      head dim 128 and 16 past it. Two warps share their keys (kSplitD = 2), each taking half
//      of the queries for S^T and dP^T and half of the head dims for dK and dV, with P^T and
//      dS^T passed through shared memory; with one warp per 16 keys (kSplitD = 1) P^T and dS^T
//      are already the A operands of dV and dK in its registers. dS^T goes through shared
//      memory for dQ, whose tile the warps split by rows and head dim;
//   3. bwd_convert_dq_kernel: dQ = softmax_scale * (sum of the fp32 accumulators), rounded.
// Deterministic mode: each CTA walks a fixed set of key tiles in order and adds into a dQ
// accumulator of its own (plain read-add-write, no atomics); kernel 3 sums the accumulators in
// a fixed order, so every run adds the same numbers in the same order.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "fmha/fmha.h"
#include "fmha/kernels/bwd_common.cuh"
#include "fmha/kernels/device_facts.cuh"
#include "fmha/kernels/fa2_copy.cuh"
#include "fmha/kernels/fwd_params.cuh"
#include "fmha/kernels/mask.cuh"
#include "fmha/kernels/philox.cuh"
#include "fmha/kernels/sm80_primitives.cuh"
#include "fmha/kernels/smem_tile.cuh"

namespace fmha::fa2 {

// Whether dQ's tile (block_m x hdim_q) splits over the warps into row groups of `rows` and
// column groups of a multiple of 16 head-dim columns.
constexpr bool bwd_dq_rows_fit(int block_m, int warps, int hdim_q, int rows) {
  return block_m % rows == 0 && warps % (block_m / rows) == 0 &&
         hdim_q % (warps / (block_m / rows)) == 0 &&
         (hdim_q / (warps / (block_m / rows))) % 16 == 0;
}

template <typename Element_, int kHeadDimQK_, int kHeadDimV_, int kBlockM_, int kBlockN_,
          int kNumWarps_, int kStages_, MaskType kMask_, BiasType kBias_, Mode kMode_,
          bool kDbias_, bool kDropout_, bool kSoftcap_, bool kPadSeqlen_, bool kPadHdim_,
          int kSmemLimit>
struct BwdConfig {
  using Element = Element_;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kNumWarps = kNumWarps_;
  static constexpr int kStages = kStages_;
  static constexpr MaskType kMask = kMask_;
  static constexpr BiasType kBias = kBias_;
  static constexpr Mode kMode = kMode_;
  static constexpr bool kDbias = kDbias_;
  static constexpr bool kDropout = kDropout_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kPadSeqlen = kPadSeqlen_;
  static constexpr bool kPadHdim = kPadHdim_;

  static constexpr int kThreads = kNumWarps * 32;
  static constexpr bool kLogitsInScores = kSoftcap || kBias != BiasType::kNone;

  // Keys per warp. Each warp reads the step's whole Q and dO tiles from shared memory as B
  // operands of S^T, dP^T, dK and dV, and shared-memory bandwidth bounds the kernel (ncu, H100,
  // d128: L1 at 74% of its peak), so the more keys (m16 fragments) a B fragment feeds, the
  // better: 32 keys where dK and dV of 32 keys over half the head dims fit the registers
  // (hdim_q + hdim_v <= 256, with two warps sharing the keys), else 16.
  static constexpr int kWarpKeys = kHeadDimQK + kHeadDimV <= 256 ? 32 : 16;
  static constexpr int kKeyFrags = kWarpKeys / 16;
  // Warps along the keys, and how many warps share a warp's keys.
  static constexpr int kKeySlices = kBlockN / kWarpKeys;
  static constexpr int kSplitD = kNumWarps / kKeySlices;
  static constexpr int kQueriesPerWarp = kBlockM / kSplitD;  // columns of a warp's S^T
  static constexpr int kDKCols = kHeadDimQK / kSplitD;       // a warp's share of dK's head dim
  static constexpr int kDVCols = kHeadDimV / kSplitD;
  // dQ's tile (kBlockM x kHeadDimQK) over the warps: row groups of kDQRows, then the head
  // dim. A warp's dS A fragments (one per 16 rows) and K^T B fragments (one per 16 columns)
  // are read from shared memory for every 16 keys, so 32 x 32 warp tiles read 4 ldmatrix per
  // 8 mma where 16 x 64 read 5 (FlashAttention-2's dQ tiling); 16 rows where 32 would leave
  // a warp fewer than 16 columns (d32).
  static constexpr int kDQRows = bwd_dq_rows_fit(kBlockM, kNumWarps, kHeadDimQK, 32) ? 32 : 16;
  static constexpr int kDQRowFrags = kDQRows / 16;
  static constexpr int kDQRowGroups = kBlockM / kDQRows;
  static constexpr int kDQColGroups = kNumWarps / kDQRowGroups;
  static constexpr int kDQCols = kHeadDimQK / kDQColGroups;

  static_assert(sizeof(Element) == 2, "fa2 takes 16-bit inputs");
  static_assert(kBlockN % kWarpKeys == 0 && kNumWarps % kKeySlices == 0 &&
                    (kSplitD == 1 || kSplitD == 2),
                "fa2 bwd: 16 or 32 keys per warp, shared by one or two warps");
  static_assert(kKeyFrags == 1 || kSplitD == 2,
                "fa2 bwd: 32 keys per warp need two warps to share them (registers)");
  static_assert(kBlockM % (16 * kSplitD) == 0, "fa2 bwd: a warp's queries come in m16 tiles");
  static_assert(bwd_dq_rows_fit(kBlockM, kNumWarps, kHeadDimQK, kDQRows),
                "fa2 bwd: dQ's tile must split into 16- or 32-row, 16-column warp tiles");
  static_assert(kDKCols % 16 == 0 && kDVCols % 16 == 0,
                "fa2 bwd: dK/dV columns come in pairs of n8 tiles");
  static_assert(kStages == 2, "fa2 bwd double-buffers Q and dO");
  static_assert(kMode != Mode::kGroup || kPadSeqlen,
                "group mode lengths are known only on the device: every tile may be ragged");

  using KTile = SmemTile<kBlockN, kHeadDimQK>;
  using VTile = SmemTile<kBlockN, kHeadDimV>;
  using QTile = SmemTile<kBlockM, kHeadDimQK>;
  using DoTile = SmemTile<kBlockM, kHeadDimV>;
  using KeyQueryTile = SmemTile<kBlockN, kBlockM>;  // dS^T, and P^T where kSplitD == 2

  // Per stage: Q, dO, and the LSE (log2 units) and D of each row.
  static constexpr int kRowStatBytes = kBlockM * 4;
  static constexpr int kStageBytes = QTile::kBytes + DoTile::kBytes + 2 * kRowStatBytes;
  static constexpr int kSmemBytes = KTile::kBytes + VTile::kBytes + kStages * kStageBytes +
                                    KeyQueryTile::kBytes * (kSplitD > 1 ? 2 : 1);
  static_assert(kSmemBytes <= kSmemLimit, "the tile does not fit the target's shared memory");
};

// The workspace: D (fp32 per row and head), then the fp32 dQ accumulators. No O(S^2) term.
template <class Cfg>
size_t bwd_workspace_bytes(const BwdArgs& a) {
  const size_t row_heads = static_cast<size_t>(bwd_rows(a)) * a.fwd.nhead_q;
  const size_t splits = static_cast<size_t>(bwd_splits(a, Cfg::kBlockN));
  return align_workspace(row_heads * sizeof(float)) +
         align_workspace(splits * row_heads * Cfg::kHeadDimQK * sizeof(float));
}

// The dQ accumulator keeps a row's columns in 16-column groups whose order matches an mma
// fragment: a lane's columns 2q, 2q + 1 of two neighbouring n8 tiles (2q + 8, 2q + 9) are
// positions 4q..4q + 3, so each lane adds 16 contiguous bytes at once (one red.v4 on sm90,
// half the reductions of column pairs). Together with dQ's GEMM ahead of dV's and dK's, bf16
// on an H100, S 2k-16k, against column pairs added during the next step's S^T: d64
// 242/262/274/279 -> 260/280/292/296 TFLOP/s, d128 266/284/293/295 -> 279/292/307/312, causal
// +4-9% (python -m bench.ab, 3 rounds). Column c of a group sits at position:
__host__ __device__ constexpr int dq_accum_position(int c) {
  return (c % 8) / 2 * 4 + (c / 8) * 2 + c % 2;
}

// Kernel 1: D[head][row] = sum_d dO * O (RowDotShape's rows a warp, 16 bytes a lane), then
// zeroes the dQ accumulators.
template <class Cfg>
__global__ void __launch_bounds__(256) bwd_dot_do_o_kernel(const __grid_constant__ BwdParams p) {
  using Element = typename Cfg::Element;
  using Shape = RowDotShape<Cfg::kHeadDimV>;
  const int lane = threadIdx.x % 32;
  const int col = lane % Shape::kLanesPerRow * 8;
  const int64_t warp = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t row_heads = p.rows * p.fwd.nhead_q;
  for (int64_t w0 = warp * Shape::kRowsPerWarp; w0 < row_heads; w0 += warps * Shape::kRowsPerWarp) {
    uint4 o8[Shape::kPasses], do8[Shape::kPasses];
#pragma unroll
    for (int pass = 0; pass < Shape::kPasses; ++pass) {
      const int64_t w = w0 + pass * Shape::kRowsPerPass + lane / Shape::kLanesPerRow;
      o8[pass] = do8[pass] = make_uint4(0, 0, 0, 0);
      if (w < row_heads && col < p.fwd.hdim_v) {
        load_o_do<Element, Cfg::kMode>(p, w / p.fwd.nhead_q, static_cast<int>(w % p.fwd.nhead_q),
                                       col, o8[pass], do8[pass]);
      }
    }
#pragma unroll
    for (int pass = 0; pass < Shape::kPasses; ++pass) {
      const int64_t w = w0 + pass * Shape::kRowsPerPass + lane / Shape::kLanesPerRow;
      const float dot = row_dot_do_o<Element, Shape::kLanesPerRow>(o8[pass], do8[pass]);
      if (w < row_heads && lane % Shape::kLanesPerRow == 0) {
        p.row_dot[(w % p.fwd.nhead_q) * p.rows + w / p.fwd.nhead_q] = dot;
      }
    }
  }
  zero_dq_accumulators(p);
}

// Kernel 3: dQ = softmax_scale * sum over splits (in split order), one thread per 16-column
// group of the accumulator.
template <class Cfg>
__global__ void __launch_bounds__(256) bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
  using Element = typename Cfg::Element;
  constexpr int kGroups = Cfg::kHeadDimQK / 16;
  const int64_t total = p.rows * p.fwd.nhead_q * kGroups;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += threads) {
    const int group = static_cast<int>(t % kGroups);
    const int64_t row_head = t / kGroups;
    if (Cfg::kPadHdim && group * 16 >= p.fwd.hdim_q) continue;
    const int64_t row = row_head / p.fwd.nhead_q;
    const int head = static_cast<int>(row_head % p.fwd.nhead_q);
    float sum[16] = {};
    const float* acc = p.dq_accum + row_head * Cfg::kHeadDimQK + group * 16;
    for (int s = 0; s < p.splits; ++s) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float4 x = *reinterpret_cast<const float4*>(acc + s * p.split_stride + 4 * v);
        sum[4 * v] += x.x, sum[4 * v + 1] += x.y, sum[4 * v + 2] += x.z, sum[4 * v + 3] += x.w;
      }
    }
    int64_t off;
    if constexpr (Cfg::kMode == Mode::kGroup) {
      off = row * p.dq_seq_stride;
    } else {
      off = (row / p.fwd.seqlen_q) * p.dq_batch_stride + (row % p.fwd.seqlen_q) * p.dq_seq_stride;
    }
    off += head * p.dq_head_stride + group * 16;
    // Two 8-column halves; a head-dim-padded instance writes only those within hdim_q.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (Cfg::kPadHdim && group * 16 + half * 8 >= p.fwd.hdim_q) continue;
      uint32_t out[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = half * 8 + 2 * e;
        out[e] = sm80::pack2<Element>(sum[dq_accum_position(c)] * p.fwd.scale,
                                      sum[dq_accum_position(c + 1)] * p.fwd.scale);
      }
      *reinterpret_cast<uint4*>(static_cast<Element*>(p.dq) + off + half * 8) =
          make_uint4(out[0], out[1], out[2], out[3]);
    }
  }
}

// Adds four of a warp's dQ fragment (row r; columns c, c + 1 of two neighbouring n8 tiles, at
// dq_accum_position) into the fp32 accumulator that CTAs of other key tiles add into too.
__device__ __forceinline__ void red_dq_quad(float* dst, float4 x) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), x);
#else
  atomicAdd(dst, x.x);
  atomicAdd(dst + 1, x.y);
  atomicAdd(dst + 2, x.z);
  atomicAdd(dst + 3, x.w);
#endif
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) bwd_kernel(const __grid_constant__ BwdParams p) {
  using Element = typename Cfg::Element;
  using Mask = TileMask<Cfg::kMask, Cfg::kPadSeqlen, Cfg::kBlockM, Cfg::kBlockN>;
  using KTile = typename Cfg::KTile;
  using VTile = typename Cfg::VTile;
  using QTile = typename Cfg::QTile;
  using DoTile = typename Cfg::DoTile;
  using KQTile = typename Cfg::KeyQueryTile;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kDimQK = Cfg::kHeadDimQK;
  constexpr int kDimV = Cfg::kHeadDimV;
  constexpr int kQTiles = Cfg::kQueriesPerWarp / 8;  // n8 tiles of a warp's S^T and dP^T
  static_assert((kQTiles & (kQTiles - 1)) == 0, "fa2 bwd: a warp's queries, a power of two");
  constexpr bool kGroup = Cfg::kMode == Mode::kGroup;
  constexpr bool kSplit = Cfg::kSplitD > 1;
  const FwdParams& f = p.fwd;

  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int key_slice = warp % Cfg::kKeySlices;  // this warp's kWarpKeys keys
  const int d_half = warp / Cfg::kKeySlices;     // its half of the queries and of dK/dV's dims
  const int dq_rows = warp % Cfg::kDQRowGroups;  // its kDQRows x kDQCols tile of dQ
  const int dq_cols = warp / Cfg::kDQRowGroups;

  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceExtent seq = sequence_extent<Cfg::kMode>(f, batch);
  // Keys this sequence owns in dK/dV (seqused_k may use fewer): each is written, zero if unused.
  const int keys_owned = rows_owned<Cfg::kMode>(f.cu_seqlens_k, batch, f.seqlen_k);

  const uint32_t s_k = sm80::smem_addr(smem);
  const uint32_t s_v = s_k + KTile::kBytes;
  const uint32_t s_stages = s_v + VTile::kBytes;  // kStages x (Q, dO, LSE, D)
  const uint32_t s_ds = s_stages + Cfg::kStages * Cfg::kStageBytes;
  const uint32_t s_p = s_ds + KQTile::kBytes;  // kSplitD == 2 only
  auto s_q = [&](int stage) { return s_stages + stage * Cfg::kStageBytes; };
  auto s_do = [&](int stage) { return s_q(stage) + QTile::kBytes; };
  auto row_stats = [&](int stage) {  // LSE (log2 units) of kBlockM rows, then their D
    return reinterpret_cast<float*>(smem + (s_q(stage) + QTile::kBytes + DoTile::kBytes - s_k));
  };

  // Per-lane ldmatrix bases (SmemTile::step adds the compile-time parts). Row-major A operands
  // (K, V, P^T): lanes 0-15 rows 0-15 at the low chunk, 16-31 the high chunk. B operands read
  // as stored (Q, dO rows for S^T, dP^T): lanes 8i..8i+7 matrix i = (rows +0/+8) x (chunk lo/hi).
  // B operands read transposed (dO, Q for dV, dK; K for dQ): lanes 0-15 rows, 16-31 chunk hi.
  constexpr int kKeyFrags = Cfg::kKeyFrags;  // m16 fragments of the warp's keys
  const int warp_key0 = key_slice * Cfg::kWarpKeys;
  const int warp_query0 = d_half * Cfg::kQueriesPerWarp;
  const uint32_t k_a = KTile::offset(warp_key0 + lane % 16, lane / 16);
  const uint32_t v_a = VTile::offset(warp_key0 + lane % 16, lane / 16);
  const uint32_t p_a = KQTile::offset(warp_key0 + lane % 16, lane / 16);
  // stmatrix rows of dS^T and P^T: matrix i = (keys +0/+8) x (this warp's queries, n8 tile
  // lo/hi). KQTile::step adds the (m16, n16) offsets: the warp's first query chunk is a
  // multiple of kQTiles, a power of two, so those steps only set chunk bits it leaves clear.
  const uint32_t kq_st =
      KQTile::offset(warp_key0 + ((lane / 8) % 2) * 8 + lane % 8, warp_query0 / 8 + lane / 16);
  const uint32_t q_b = QTile::offset(warp_query0 + (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const uint32_t do_b = DoTile::offset(warp_query0 + (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const uint32_t q_bt = QTile::offset(lane % 16, lane / 16);
  const uint32_t do_bt = DoTile::offset(lane % 16, lane / 16);
  const uint32_t k_bt = KTile::offset(lane % 16, lane / 16);
  // dS as dQ's A operand, read transposed out of dS^T: matrix i = (keys +0/+8) x (rows lo/hi),
  // one base per 16 of the warp's dQ rows.
  constexpr int kDQRowFrags = Cfg::kDQRowFrags;
  uint32_t ds_at[kDQRowFrags];
#pragma unroll
  for (int rf = 0; rf < kDQRowFrags; ++rf) {
    ds_at[rf] = KQTile::offset((lane / 16) * 8 + lane % 8,
                               (dq_rows * kDQRowFrags + rf) * 2 + (lane / 8) % 2);
  }

  const Element* bias_base = nullptr;
  Element* dbias_base = nullptr;
  if constexpr (Cfg::kBias == BiasType::kElementwise) {
    bias_base = static_cast<const Element*>(f.bias) + batch * f.bias_batch_stride;
    if constexpr (Cfg::kDbias) {
      dbias_base = static_cast<Element*>(p.dbias) + batch * p.dbias_batch_stride;
    }
  }
  const Mask mask(seq.seqlen_q, seq.seqlen_k, f.bottom_right, f.window_left, f.window_right);
  const int m_blocks_total = (seq.seqlen_q + kBlockM - 1) / kBlockM;

  // Deterministic: this CTA adds into an accumulator of its own.
  float* const dq_accum = p.dq_accum + (p.deterministic ? blockIdx.x * p.split_stride : 0);
  const int64_t row_base = kGroup ? seq.q_start : static_cast<int64_t>(batch) * f.seqlen_q;

  for (int n_block = blockIdx.x; n_block < p.n_blocks; n_block += gridDim.x) {
    const int key0 = n_block * kBlockN;
    if (key0 >= keys_owned) break;
    const int last_key = min(key0 + kBlockN, seq.seqlen_k) - 1;
    const int m_begin = key0 < seq.seqlen_k ? mask.m_block_begin(key0) : 0;
    const int m_end = key0 < seq.seqlen_k ? min(mask.m_block_end(last_key, seq.seqlen_q),
                                                m_blocks_total)
                                          : 0;
    const int m_count = max(m_end - m_begin, 0);
    const int steps = m_count * f.kv_group;  // (query head, query tile) pairs, head-major
    // Each head's query tiles are walked from tile m_first on, wrapping around: CTAs of
    // neighbouring key tiles, which run at the same time, then add their dQ into different rows
    // rather than all into the same ones at once (d128 bf16 on an H100, S 8k/16k: 289/292 ->
    // 294/297 TFLOP/s; other points within 1%).
    const int m_first = m_count > 0 ? n_block % m_count : 0;
    auto query_tile = [&](int m_step) {  // the m_step-th tile of a head's walk
      const int m = m_first + m_step;
      return m_begin + (m >= m_count ? m - m_count : m);
    };

    const Element* k = static_cast<const Element*>(f.k) + kv_head * f.k_head_stride +
                       (kGroup ? seq.k_start * f.k_seq_stride : batch * f.k_batch_stride) +
                       static_cast<int64_t>(key0) * f.k_seq_stride;
    const Element* v = static_cast<const Element*>(f.v) + kv_head * f.v_head_stride +
                       (kGroup ? seq.k_start * f.v_seq_stride : batch * f.v_batch_stride) +
                       static_cast<int64_t>(key0) * f.v_seq_stride;

    // The Q, dO, LSE and D of a step into stage `stage`: Q and dO by cp.async, LSE and D
    // through registers (they may sit anywhere in memory, so they go 4 bytes per thread). A
    // step is (query head, query tile): `m_step` counts the steps of a head (query_tile).
    struct RowStats {
      float lse2, dot;
    };
    const Element* q_seq = static_cast<const Element*>(f.q) +
                           (kGroup ? seq.q_start * f.q_seq_stride : batch * f.q_batch_stride);
    const Element* do_seq = static_cast<const Element*>(p.dout) +
                            (kGroup ? seq.q_start * p.do_seq_stride : batch * p.do_batch_stride);
    const float* lse_seq = f.lse + (kGroup ? seq.q_start : batch * f.lse_batch_stride);
    const float* dot_seq = p.row_dot + row_base;
    auto load_q_do = [&](int head, int m_step, int stage) {
      const int row0 = query_tile(m_step) * kBlockM;
      load_rows<Cfg, QTile, kBlockM>(
          s_q(stage), q_seq + head * f.q_head_stride + static_cast<int64_t>(row0) * f.q_seq_stride,
          f.q_seq_stride, seq.seqlen_q - row0, f.hdim_q / 8);
      load_rows<Cfg, DoTile, kBlockM>(
          s_do(stage),
          do_seq + head * p.do_head_stride + static_cast<int64_t>(row0) * p.do_seq_stride,
          p.do_seq_stride, seq.seqlen_q - row0, f.hdim_v / 8);
      sm80::cp_async_commit();
    };
    // Rows past the sequence, and rows that see no key (LSE -inf), get LSE +inf: their P is 0.
    auto fetch_stats = [&](int head, int m_step) {
      RowStats r{INFINITY, 0.f};
      const int row = query_tile(m_step) * kBlockM + threadIdx.x;
      if (threadIdx.x < kBlockM && row < seq.seqlen_q) {
        const float lse = lse_seq[head * f.lse_head_stride + row];
        r.lse2 = lse == -INFINITY ? INFINITY : lse * static_cast<float>(M_LOG2E);
        r.dot = dot_seq[head * p.rows + row];
      }
      return r;
    };
    auto store_stats = [&](const RowStats& r, int stage) {
      if (threadIdx.x < kBlockM) {
        row_stats(stage)[threadIdx.x] = r.lse2;
        row_stats(stage)[kBlockM + threadIdx.x] = r.dot;
      }
    };

    // Prologue: K and V with the first step's Q and dO. A key tile that no query sees only
    // writes its zeros.
    if (steps > 0) {
      const int keys_valid = seq.seqlen_k - key0;
      load_rows<Cfg, KTile, kBlockN>(s_k, k, f.k_seq_stride, keys_valid, f.hdim_q / 8);
      load_rows<Cfg, VTile, kBlockN>(s_v, v, f.v_seq_stride, keys_valid, f.hdim_v / 8);
      load_q_do(kv_head * f.kv_group, 0, 0);
      store_stats(fetch_stats(kv_head * f.kv_group, 0), 0);
    }

    float dk_acc[kKeyFrags][Cfg::kDKCols / 8][4] = {};
    float dv_acc[kKeyFrags][Cfg::kDVCols / 8][4] = {};

    // A warp's dQ fragment of a step goes into the accumulator in items of four: item
    // (rf * 2 + h) * (kDQCols / 16) + g is row lane / 4 + 16 rf + 8 h of the warp's tile and
    // the lane's columns of n8 tiles 2g and 2g + 1. Padded tiles keep the same column in the
    // sequence's last row.
    const int64_t dq_row8 = 8 * static_cast<int64_t>(f.nhead_q) * kDimQK;
    constexpr int kDQItems = kDQRowFrags * 2 * (Cfg::kDQCols / 16);
    auto dq_item = [&](int item, int* rf, int* h, int* g) {
      const int rh = item / (Cfg::kDQCols / 16);
      *rf = rh / 2, *h = rh % 2, *g = item % (Cfg::kDQCols / 16);
    };

    int head = kv_head * f.kv_group, m_step = 0;  // this step's
    for (int it = 0; it < steps; ++it) {
      const int stage = it % 2;
      const int row0 = query_tile(m_step) * kBlockM;
      const bool last_of_head = m_step + 1 == m_count;
      const int next_head = last_of_head ? head + 1 : head;
      const int next_m_step = last_of_head ? 0 : m_step + 1;
      sm80::cp_async_wait<0>();
      __syncthreads();  // this step's tiles are in for every thread; the other stage is free

      // S^T = K Q^T: this warp's keys x kQueriesPerWarp queries; each Q fragment read from
      // shared memory feeds kKeyFrags mma.
      float s[kKeyFrags][kQTiles][4] = {};
#pragma unroll
      for (int kt = 0; kt < kDimQK / 16; ++kt) {
        uint32_t a[kKeyFrags][4];
#pragma unroll
        for (int mf = 0; mf < kKeyFrags; ++mf) {
          sm80::ldmatrix_x4(a[mf], s_k + KTile::step(k_a, mf, kt));
        }
#pragma unroll
        for (int np = 0; np < kQTiles / 2; ++np) {
          uint32_t b[4];
          sm80::ldmatrix_x4(b, s_q(stage) + QTile::step(q_b, np, kt));
#pragma unroll
          for (int mf = 0; mf < kKeyFrags; ++mf) {
            sm80::mma_16816<Element>(s[mf][2 * np], a[mf], b[0], b[1]);
            sm80::mma_16816<Element>(s[mf][2 * np + 1], a[mf], b[2], b[3]);
          }
        }
      }
      // The next step's tiles into the other stage, issued behind the S^T GEMM rather than
      // ahead of it, where every warp computed their addresses right after the barrier while the
      // tensor cores waited (with load_rows' one address per thread: 210 -> 105 instructions a
      // step; d64 +1-3%, d128 within 2%).
      RowStats next_stats{};
      if (it + 1 < steps) {
        load_q_do(next_head, next_m_step, stage ^ 1);
        next_stats = fetch_stats(next_head, next_m_step);
      }
      // dP^T = V dO^T, the same shape.
      float dp[kKeyFrags][kQTiles][4] = {};
#pragma unroll
      for (int kt = 0; kt < kDimV / 16; ++kt) {
        uint32_t a[kKeyFrags][4];
#pragma unroll
        for (int mf = 0; mf < kKeyFrags; ++mf) {
          sm80::ldmatrix_x4(a[mf], s_v + VTile::step(v_a, mf, kt));
        }
#pragma unroll
        for (int np = 0; np < kQTiles / 2; ++np) {
          uint32_t b[4];
          sm80::ldmatrix_x4(b, s_do(stage) + DoTile::step(do_b, np, kt));
#pragma unroll
          for (int mf = 0; mf < kKeyFrags; ++mf) {
            sm80::mma_16816<Element>(dp[mf][2 * np], a[mf], b[0], b[1]);
            sm80::mma_16816<Element>(dp[mf][2 * np + 1], a[mf], b[2], b[3]);
          }
        }
      }

      // Element (mf, nt, e) of S^T is key key_of(mf, e), query query_of(nt, e) (within the
      // sequence).
      auto key_of = [&](int mf, int e) {
        return key0 + warp_key0 + mf * 16 + lane / 4 + (e / 2) * 8;
      };
      auto query_of = [&](int nt, int e) {
        return row0 + warp_query0 + nt * 8 + (lane % 4) * 2 + e % 2;
      };
      const float* lse2 = row_stats(stage);
      const float* dot = lse2 + kBlockM;
      const bool edge = mask.is_edge_tile(row0, n_block);
      float alibi_slope = 0.f;
      if constexpr (Cfg::kBias == BiasType::kAlibi) {
        alibi_slope = f.alibi_slopes[batch * f.alibi_batch_stride + head];
      }
      const Element* bias = bias_base;
      Element* dbias = dbias_base;
      if constexpr (Cfg::kBias == BiasType::kElementwise) {
        bias += head * f.bias_head_stride;
        if constexpr (Cfg::kDbias) dbias += head * p.dbias_head_stride;
      }
      // In uint32 as in the forward: batch * nhead_q reaches past INT_MAX.
      const uint32_t batch_head =
          static_cast<uint32_t>(batch) * static_cast<uint32_t>(f.nhead_q) +
          static_cast<uint32_t>(head);

#pragma unroll
      for (int mf = 0; mf < kKeyFrags; ++mf) {
#pragma unroll
        for (int nt = 0; nt < kQTiles; ++nt) {
          // The LSE and D of this lane's two queries (e % 2) of the n8 tile.
          const int first_query = warp_query0 + nt * 8 + (lane % 4) * 2;
          const float2 lse_pair = *reinterpret_cast<const float2*>(lse2 + first_query);
          const float2 dot_pair = *reinterpret_cast<const float2*>(dot + first_query);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key_of(mf, e);
            const int query = query_of(nt, e);
            const float row_lse = e % 2 ? lse_pair.y : lse_pair.x;
            const float row_dot = e % 2 ? dot_pair.y : dot_pair.x;
            float x = s[mf][nt][e];
            float tanh_slope = 1.f;  // d logit / d (scale * qk) under soft-cap: 1 - tanh^2
            if constexpr (Cfg::kLogitsInScores) {
              if constexpr (Cfg::kSoftcap) {
                const float t = sm80::tanh_fast(x * f.softcap_scale);
                tanh_slope = 1.f - t * t;
                x = f.softcap * t;
              } else {
                x *= f.scale;
              }
              if constexpr (Cfg::kBias == BiasType::kElementwise) {
                if (!Cfg::kPadSeqlen || (query < seq.seqlen_q && key < seq.seqlen_k)) {
                  x += sm80::to_float(bias[query * f.bias_seq_stride + key]);
                }
              }
              if constexpr (Cfg::kBias == BiasType::kAlibi) {
                x -= alibi_slope * fabsf(static_cast<float>(query + mask.offset - key));
              }
            }
            float prob = sm80::fast_exp2(x * f.softmax_mul - row_lse);
            if (edge && !mask.is_visible(query, key)) prob = 0.f;
            float dprob = dp[mf][nt][e];
            if constexpr (Cfg::kDropout) {
              const philox::Words r = philox::dropout_words(f.dropout_seed, f.dropout_offset,
                                                            batch_head, query, key);
              const bool keep = r.w[philox::dropout_word(query, key)] >= f.drop_threshold;
              dprob = keep ? dprob * f.keep_scale : 0.f;
              // dS uses P itself; dV the probability that reached O (dropped and rescaled).
              const float ds = prob * (dprob - row_dot);
              dp[mf][nt][e] = ds;
              s[mf][nt][e] = keep ? prob * f.keep_scale : 0.f;
            } else {
              dp[mf][nt][e] = prob * (dprob - row_dot);
              s[mf][nt][e] = prob;
            }
            if constexpr (Cfg::kDbias) {
              if (query < seq.seqlen_q && key < seq.seqlen_k) {
                dbias[query * p.dbias_seq_stride + key] = static_cast<Element>(dp[mf][nt][e]);
              }
            }
            if constexpr (Cfg::kSoftcap) dp[mf][nt][e] *= tanh_slope;
          }
        }
      }

      // dS^T (and P^T when two warps share the keys) to shared memory: on sm90 one stmatrix
      // per two n8 tiles (4 matrices: keys +0/+8 of each), elsewhere Element pairs.
#if __CUDA_ARCH__ >= 900
#pragma unroll
      for (int mf = 0; mf < kKeyFrags; ++mf) {
#pragma unroll
        for (int np = 0; np < kQTiles / 2; ++np) {
          const auto& d0 = dp[mf][2 * np];
          const auto& d1 = dp[mf][2 * np + 1];
          sm80::stmatrix_x4(s_ds + KQTile::step(kq_st, mf, np),
                            sm80::pack2<Element>(d0[0], d0[1]), sm80::pack2<Element>(d0[2], d0[3]),
                            sm80::pack2<Element>(d1[0], d1[1]), sm80::pack2<Element>(d1[2], d1[3]));
          if constexpr (kSplit) {
            const auto& p0 = s[mf][2 * np];
            const auto& p1 = s[mf][2 * np + 1];
            sm80::stmatrix_x4(
                s_p + KQTile::step(kq_st, mf, np), sm80::pack2<Element>(p0[0], p0[1]),
                sm80::pack2<Element>(p0[2], p0[3]), sm80::pack2<Element>(p1[0], p1[1]),
                sm80::pack2<Element>(p1[2], p1[3]));
          }
        }
      }
#else
#pragma unroll
      for (int mf = 0; mf < kKeyFrags; ++mf) {
#pragma unroll
        for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int key_row = warp_key0 + mf * 16 + lane / 4 + h * 8;
            const uint32_t at =
                KQTile::offset(key_row, (warp_query0 + nt * 8) / 8) + (lane % 4) * 4;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_ds + at),
                         "r"(sm80::pack2<Element>(dp[mf][nt][2 * h], dp[mf][nt][2 * h + 1])));
            if constexpr (kSplit) {
              asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_p + at),
                           "r"(sm80::pack2<Element>(s[mf][nt][2 * h], s[mf][nt][2 * h + 1])));
            }
          }
        }
      }
#endif
      __syncthreads();  // dS^T (and P^T) of every warp's keys and queries are in

      // dQ (kBlockM x kDimQK) = dS K: this warp's kDQRows rows x kDQCols columns, computed
      // before dV and dK so that its additions into the fp32 accumulator of (row, head) are
      // issued during their GEMMs and its registers are free again before the next step's S^T
      // and dP^T, where dK, dV, S^T and dP^T fill the register file.
      float dq[kDQRowFrags][Cfg::kDQCols / 8][4] = {};
#pragma unroll
      for (int kt = 0; kt < kBlockN / 16; ++kt) {
        uint32_t a[kDQRowFrags][4];
#pragma unroll
        for (int rf = 0; rf < kDQRowFrags; ++rf) {
          sm80::ldmatrix_x4_trans(a[rf], s_ds + KQTile::step(ds_at[rf], kt, 0));
        }
#pragma unroll
        for (int dpair = 0; dpair < Cfg::kDQCols / 16; ++dpair) {
          uint32_t b[4];
          sm80::ldmatrix_x4_trans(
              b, s_k + KTile::step(k_bt, kt, dq_cols * (Cfg::kDQCols / 16) + dpair));
#pragma unroll
          for (int rf = 0; rf < kDQRowFrags; ++rf) {
            sm80::mma_16816<Element>(dq[rf][2 * dpair], a[rf], b[0], b[1]);
            sm80::mma_16816<Element>(dq[rf][2 * dpair + 1], a[rf], b[2], b[3]);
          }
        }
      }
      const int dq_row = row0 + dq_rows * Cfg::kDQRows + lane / 4;  // item 0's row
      const int64_t dq_col = dq_cols * Cfg::kDQCols + (lane % 4) * 4;  // in the group order
      float* const dq_dst =
          dq_accum + ((row_base + dq_row) * f.nhead_q + head) * kDimQK + dq_col;
      auto dq_quad = [&](int rf, int h, int g) {
        return make_float4(dq[rf][2 * g][2 * h], dq[rf][2 * g][2 * h + 1],
                           dq[rf][2 * g + 1][2 * h], dq[rf][2 * g + 1][2 * h + 1]);
      };
      // Unconditional: a row past the sequence adds zeros into its last row instead, so that no
      // branch splits the GEMM these are issued in.
      auto red_dq = [&](int item) {
        int rf, h, g;
        dq_item(item, &rf, &h, &g);
        float4 x = dq_quad(rf, h, g);
        float* dst = dq_dst + (2 * rf + h) * dq_row8;
        if constexpr (Cfg::kPadSeqlen) {
          const bool in_seq = dq_row + rf * 16 + h * 8 < seq.seqlen_q;
          float* const last_row =
              dq_accum + ((row_base + seq.seqlen_q - 1) * f.nhead_q + head) * kDimQK + dq_col;
          x = in_seq ? x : make_float4(0.f, 0.f, 0.f, 0.f);
          dst = in_seq ? dst : last_row;
        }
        red_dq_quad(dst + g * 16, x);
      };

      // dV += P^T dO and dK += dS^T Q over the step's queries, 16 at a time, with dQ's
      // reductions issued among its k-steps (ptxas gathers them near the GEMM's start). A operands come from this warp's registers (the
      // accumulators of n8 tiles 2t and 2t+1 are the A fragment of k-step t), or from shared
      // memory when the queries are split over two warps.
      auto dv_dk_gemm = [&](auto with_dq_reductions) {
#pragma unroll
        for (int t = 0; t < kBlockM / 16; ++t) {
          uint32_t pa[kKeyFrags][4], dsa[kKeyFrags][4];
#pragma unroll
          for (int mf = 0; mf < kKeyFrags; ++mf) {
            if constexpr (kSplit) {
              sm80::ldmatrix_x4(pa[mf], s_p + KQTile::step(p_a, mf, t));
              sm80::ldmatrix_x4(dsa[mf], s_ds + KQTile::step(p_a, mf, t));
            } else {
              const auto& lo = s[mf][2 * t];
              const auto& hi = s[mf][2 * t + 1];
              pa[mf][0] = sm80::pack2<Element>(lo[0], lo[1]);
              pa[mf][1] = sm80::pack2<Element>(lo[2], lo[3]);
              pa[mf][2] = sm80::pack2<Element>(hi[0], hi[1]);
              pa[mf][3] = sm80::pack2<Element>(hi[2], hi[3]);
              const auto& dlo = dp[mf][2 * t];
              const auto& dhi = dp[mf][2 * t + 1];
              dsa[mf][0] = sm80::pack2<Element>(dlo[0], dlo[1]);
              dsa[mf][1] = sm80::pack2<Element>(dlo[2], dlo[3]);
              dsa[mf][2] = sm80::pack2<Element>(dhi[0], dhi[1]);
              dsa[mf][3] = sm80::pack2<Element>(dhi[2], dhi[3]);
            }
          }
          if constexpr (decltype(with_dq_reductions)::value) {
#pragma unroll
            for (int item = 0; item < kDQItems; ++item) {
              if (item % (kBlockM / 16) == t) red_dq(item);
            }
          }
#pragma unroll
          for (int dpair = 0; dpair < Cfg::kDVCols / 16; ++dpair) {
            uint32_t b[4];
            sm80::ldmatrix_x4_trans(
                b, s_do(stage) + DoTile::step(do_bt, t, d_half * (Cfg::kDVCols / 16) + dpair));
#pragma unroll
            for (int mf = 0; mf < kKeyFrags; ++mf) {
              sm80::mma_16816<Element>(dv_acc[mf][2 * dpair], pa[mf], b[0], b[1]);
              sm80::mma_16816<Element>(dv_acc[mf][2 * dpair + 1], pa[mf], b[2], b[3]);
            }
          }
#pragma unroll
          for (int dpair = 0; dpair < Cfg::kDKCols / 16; ++dpair) {
            uint32_t b[4];
            sm80::ldmatrix_x4_trans(
                b, s_q(stage) + QTile::step(q_bt, t, d_half * (Cfg::kDKCols / 16) + dpair));
#pragma unroll
            for (int mf = 0; mf < kKeyFrags; ++mf) {
              sm80::mma_16816<Element>(dk_acc[mf][2 * dpair], dsa[mf], b[0], b[1]);
              sm80::mma_16816<Element>(dk_acc[mf][2 * dpair + 1], dsa[mf], b[2], b[3]);
            }
          }
        }
      };
      if (p.deterministic) {
        // This CTA's own accumulator: read-add-write at once, so that dQ's registers are free
        // for the GEMMs (held across them, d256 spilled and ran at 43 TFLOP/s against 105).
#pragma unroll
        for (int item = 0; item < kDQItems; ++item) {
          int rf, h, g;
          dq_item(item, &rf, &h, &g);
          if (Cfg::kPadSeqlen && dq_row + rf * 16 + h * 8 >= seq.seqlen_q) continue;
          auto* dst = reinterpret_cast<float4*>(dq_dst + (2 * rf + h) * dq_row8 + g * 16);
          const float4 add = dq_quad(rf, h, g);
          float4 sum = *dst;
          sum.x += add.x, sum.y += add.y, sum.z += add.z, sum.w += add.w;
          *dst = sum;
        }
        dv_dk_gemm(std::false_type{});
      } else {
        dv_dk_gemm(std::true_type{});
      }
      if (it + 1 < steps) store_stats(next_stats, stage ^ 1);
      head = next_head;
      m_step = next_m_step;
    }

    // Epilogue: dK = softmax_scale * sum dS^T Q (the scale of the logits, left out of dS), dV;
    // 4-byte stores of element pairs, every key the sequence owns (zeros where no query sees
    // it or past seqused_k).
    const int64_t dk_base = kv_head * p.dk_head_stride +
                            (kGroup ? seq.k_start * p.dk_seq_stride : batch * p.dk_batch_stride);
    const int64_t dv_base = kv_head * p.dv_head_stride +
                            (kGroup ? seq.k_start * p.dv_seq_stride : batch * p.dv_batch_stride);
#pragma unroll
    for (int mf = 0; mf < kKeyFrags; ++mf) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = key0 + warp_key0 + mf * 16 + lane / 4 + h * 8;
        if (Cfg::kPadSeqlen && key >= keys_owned) continue;
#pragma unroll
        for (int dt = 0; dt < Cfg::kDKCols / 8; ++dt) {
          const int col = d_half * Cfg::kDKCols + dt * 8 + (lane % 4) * 2;
          if (Cfg::kPadHdim && col >= f.hdim_q) continue;
          *reinterpret_cast<uint32_t*>(static_cast<Element*>(p.dk) + dk_base +
                                       key * p.dk_seq_stride + col) =
              sm80::pack2<Element>(dk_acc[mf][dt][2 * h] * f.scale,
                                   dk_acc[mf][dt][2 * h + 1] * f.scale);
        }
#pragma unroll
        for (int dt = 0; dt < Cfg::kDVCols / 8; ++dt) {
          const int col = d_half * Cfg::kDVCols + dt * 8 + (lane % 4) * 2;
          if (Cfg::kPadHdim && col >= f.hdim_v) continue;
          *reinterpret_cast<uint32_t*>(static_cast<Element*>(p.dv) + dv_base +
                                       key * p.dv_seq_stride + col) =
              sm80::pack2<Element>(dv_acc[mf][dt][2 * h], dv_acc[mf][dt][2 * h + 1]);
        }
      }
    }
    __syncthreads();  // the next key tile's prologue overwrites K, V and stage 0
  }
}

template <class Cfg>
cudaError_t launch_bwd(const BwdArgs& args, cudaStream_t stream) {
  BwdParams p = make_bwd_params(args, Cfg::kLogitsInScores);
  p.n_blocks = static_cast<int>((static_cast<int64_t>(args.fwd.seqlen_k) + Cfg::kBlockN - 1) /
                                Cfg::kBlockN);
  p.splits = bwd_splits(args, Cfg::kBlockN);
  const size_t row_heads = static_cast<size_t>(p.rows) * args.fwd.nhead_q;
  p.split_stride = static_cast<int64_t>(row_heads) * Cfg::kHeadDimQK;
  auto* workspace = static_cast<unsigned char*>(args.workspace);
  p.row_dot = reinterpret_cast<float*>(workspace);
  p.dq_accum = reinterpret_cast<float*>(workspace + align_workspace(row_heads * sizeof(float)));

  // Kernels 1 and 3 are memory-bound grid-stride loops: a few waves of 256 threads per SM.
  const int sms = multiprocessor_count();
  const int stream_blocks = sms > 0 ? 4 * sms : 512;
  bwd_dot_do_o_kernel<Cfg><<<stream_blocks, 256, 0, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;

  auto* kernel = bwd_kernel<Cfg>;
  if (Cfg::kSmemBytes > 48 * 1024) {  // past 48 KB a kernel must opt in to dynamic smem
    static std::atomic<uint64_t> smem_raised{0};
    const cudaError_t err =
        allow_dynamic_smem(reinterpret_cast<const void*>(kernel), Cfg::kSmemBytes, smem_raised);
    if (err != cudaSuccess) return err;
  }
  // Without keys there is no CTA to run: dQ is the zero the accumulators were set to.
  const dim3 grid(static_cast<unsigned>(p.deterministic ? p.splits : p.n_blocks),
                  static_cast<unsigned>(args.fwd.nhead_k), static_cast<unsigned>(args.fwd.batch));
  if (p.n_blocks > 0) {
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }

  bwd_convert_dq_kernel<Cfg><<<stream_blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fmha::fa2
