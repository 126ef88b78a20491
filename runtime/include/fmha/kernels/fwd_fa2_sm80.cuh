// FlashAttention-2 forward pipeline for sm80-class GPUs (runs on sm90 too).
//
// One CTA computes one (query tile, head, sequence): kBlockM query rows against every visible
// key, kBlockN keys per step. Each warp owns 16 or 32 query rows end to end, so the softmax
// statistics of a row never leave the 4 lanes that hold it. Per step:
//   K tile -> S = Q K^T (mma.sync; Q fragments in registers at 16 rows per warp up to d128,
//             re-read from shared memory otherwise, where registers go to the larger O and S)
//          -> logits: soft-cap, bias or ALiBi (only in instances that have them), mask (only
//             on edge tiles)
//          -> online softmax in fp32 (exp2, the scale folded into one FFMA per score), then
//             dropout on the probabilities (Philox, in instances that have it)
//   V tile -> O += P V (P re-packed from the S accumulators, never touching shared memory)
// K and V stream through a two-stage shared-memory ring with cp.async: the loads of step j+1
// are issued right after the barrier of step j, so they have a whole step to land.
//
// Every trait is a template parameter: an instance compiles only the code its traits need.
// Shared memory per CTA: Q tile + 2 K tiles + 2 V tiles, e.g. 96 KB at hdim 128, 128x64 tiles;
// the Q region is reused to stage O for 16-byte coalesced stores.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fmha/fmha.h"
#include "fmha/kernels/device_facts.cuh"
#include "fmha/kernels/fa2_copy.cuh"
#include "fmha/kernels/fwd_params.cuh"
#include "fmha/kernels/mask.cuh"
#include "fmha/kernels/philox.cuh"
#include "fmha/kernels/sm80_primitives.cuh"
#include "fmha/kernels/smem_tile.cuh"
#include "fmha/kernels/tile_order.cuh"

namespace fmha::fa2 {

template <typename Element_, int kHeadDimQK_, int kHeadDimV_, int kBlockM_, int kBlockN_,
          int kNumWarps_, int kStages_, MaskType kMask_, BiasType kBias_, VLayout kVLayout_,
          Mode kMode_, bool kLse_, bool kDropout_, bool kSoftcap_, bool kPadSeqlen_,
          bool kPadHdim_, int kSmemLimit>
struct FwdConfig {
  using Element = Element_;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNumWarps = kNumWarps_;
  static constexpr int kStages = kStages_;
  static constexpr MaskType kMask = kMask_;
  static constexpr BiasType kBias = kBias_;
  static constexpr VLayout kVLayout = kVLayout_;
  static constexpr Mode kMode = kMode_;
  static constexpr bool kLse = kLse_;
  static constexpr bool kDropout = kDropout_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kPadSeqlen = kPadSeqlen_;
  static constexpr bool kPadHdim = kPadHdim_;

  static constexpr int kThreads = kNumWarps * 32;
  static constexpr bool kVColMajor = kVLayout == VLayout::kColMajor;
  // Soft-cap and bias act on scaled logits, so such instances scale the scores in place and
  // run the softmax on logits; the others fold the scale into the softmax's exp2 argument.
  static constexpr bool kLogitsInScores = kSoftcap || kBias != BiasType::kNone;

  // Every warp reads the whole K and V tile from shared memory each step, so rows per warp set
  // the shared-memory traffic per FLOP: at 16 rows, d128, 8 warps read 256 KB a 64-key step,
  // more than the ~1.5k cycles of mma.sync it feeds can hide (128 B/cycle/SM); 32 rows halve it.
  static constexpr int kRowsPerWarp = kBlockM / kNumWarps;
  static constexpr int kMFrags = kRowsPerWarp / 16;  // m16 fragments per warp
  // At 32 rows the O and S accumulators alone take 192 registers (d128, 64 keys), and past
  // d128 Q's fragments alone would take 64+, so Q is re-read per step instead of held.
  static constexpr bool kQInRegisters = kMFrags == 1 && kHeadDimQK <= 128;

  static_assert(sizeof(Element) == 2, "fa2 takes 16-bit inputs");
  static_assert(kBlockM % kNumWarps == 0 && (kRowsPerWarp == 16 || kRowsPerWarp == 32),
                "fa2: each warp owns 16 or 32 query rows");
  static_assert(kBlockN % 16 == 0, "fa2: key tiles come in mma k-steps of 16");
  static_assert(kStages == 2, "fa2 double-buffers K and V");
  static_assert(kMode != Mode::kGroup || kPadSeqlen,
                "group mode lengths are known only on the device: every tile may be ragged");

  using QTile = SmemTile<kBlockM, kHeadDimQK>;
  using KTile = SmemTile<kBlockN, kHeadDimQK>;
  // Row-major V is stored as loaded (keys x d) and read with ldmatrix.trans; column-major V
  // (d x keys) is already the mma's B layout and is read like K.
  using VTile = std::conditional_t<kVColMajor, SmemTile<kHeadDimV, kBlockN>,
                                   SmemTile<kBlockN, kHeadDimV>>;
  using OTile = SmemTile<kBlockM, kHeadDimV>;

  // The Q region also stages the O tile in the epilogue, so it fits the larger of the two.
  static constexpr int kQRegionBytes = QTile::kBytes > OTile::kBytes ? QTile::kBytes
                                                                     : OTile::kBytes;
  static constexpr int kSmemBytes = kQRegionBytes + kStages * (KTile::kBytes + VTile::kBytes);
  // kSmemLimit: what one CTA may opt into on the target (generator/schema.py's smem_limit).
  static_assert(kSmemBytes <= kSmemLimit, "the tile does not fit the target's shared memory");
};

// Column-major V: the tile is hdim_v rows of kBlockN keys, keys contiguous in global memory.
// A chunk holds 8 keys, so at the end of a padded sequence a chunk is partly valid: cp.async
// reads only its valid bytes and zero-fills the rest. In group mode a sequence may start at
// any token, leaving its keys without 16-byte alignment; such tiles are copied element-wise.
template <class Cfg>
__device__ __forceinline__ void load_v_col_major(uint32_t smem_tile,
                                                 const typename Cfg::Element* gmem,
                                                 int64_t dim_stride, int keys_valid,
                                                 int dims_valid, bool aligned) {
  using Tile = typename Cfg::VTile;
  constexpr int kTotalChunks = Cfg::kHeadDimV * Tile::kChunks;
  static_assert(kTotalChunks % Cfg::kThreads == 0, "tile must split evenly over the CTA");
#pragma unroll
  for (int i = 0; i < kTotalChunks / Cfg::kThreads; ++i) {
    const int idx = threadIdx.x + i * Cfg::kThreads;
    const int dim = idx / Tile::kChunks;
    const int chunk = idx % Tile::kChunks;
    const int keys = Cfg::kPadSeqlen ? min(max(keys_valid - chunk * 8, 0), 8) : 8;
    const int valid_keys = !Cfg::kPadHdim || dim < dims_valid ? keys : 0;
    const auto* src = gmem + dim * dim_stride + chunk * 8;
    const uint32_t dst = smem_tile + Tile::offset(dim, chunk);
    if (Cfg::kMode != Mode::kGroup || aligned) {
      sm80::cp_async_16(dst, valid_keys > 0 ? src : gmem, valid_keys * 2);
    } else {
      uint16_t vals[8];
      const auto* src16 = reinterpret_cast<const uint16_t*>(src);
#pragma unroll
      for (int e = 0; e < 8; ++e) vals[e] = e < valid_keys ? src16[e] : 0;
      asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst),
                   "r"(vals[0] | (uint32_t(vals[1]) << 16)), "r"(vals[2] | (uint32_t(vals[3]) << 16)),
                   "r"(vals[4] | (uint32_t(vals[5]) << 16)), "r"(vals[6] | (uint32_t(vals[7]) << 16)));
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) fwd_kernel(const __grid_constant__ FwdParams p) {
  using Element = typename Cfg::Element;
  using Mask = TileMask<Cfg::kMask, Cfg::kPadSeqlen, Cfg::kBlockM, Cfg::kBlockN>;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  using VTile = typename Cfg::VTile;
  using OTile = typename Cfg::OTile;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kDimQK = Cfg::kHeadDimQK;
  constexpr int kDimV = Cfg::kHeadDimV;
  constexpr int kNTiles = kBlockN / 8;  // n8 accumulator tiles of S per warp
  constexpr int kDTiles = kDimV / 8;    // n8 accumulator tiles of O per warp
  constexpr int kMFrags = Cfg::kMFrags;

  extern __shared__ __align__(128) unsigned char smem[];

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const TileCoord tile =
      Cfg::kMask == MaskType::kCausal
          ? longest_first_in_head_groups(blockIdx.x, p.m_blocks, p.nhead_q, gridDim.x / p.m_blocks,
                                         p.group_heads)
          : TileCoord{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                      static_cast<int>(blockIdx.z)};
  const int m_block = tile.m_block;
  const int head = tile.head;
  const int batch = tile.batch;
  const SequenceExtent seq = sequence_extent<Cfg::kMode>(p, batch);
  const int q_row0 = m_block * kBlockM;
  // The grid covers the longest sequence; tiles past this one's end have nothing to do.
  if (q_row0 >= seq.seqlen_q) return;
  const int kv_head = head / p.kv_group;
  constexpr bool kGroup = Cfg::kMode == Mode::kGroup;

  const auto* q = static_cast<const Element*>(p.q) + head * p.q_head_stride +
                  (kGroup ? seq.q_start * p.q_seq_stride : batch * p.q_batch_stride) +
                  static_cast<int64_t>(q_row0) * p.q_seq_stride;
  const auto* k = static_cast<const Element*>(p.k) + kv_head * p.k_head_stride +
                  (kGroup ? seq.k_start * p.k_seq_stride : batch * p.k_batch_stride);
  const auto* v = static_cast<const Element*>(p.v) + kv_head * p.v_head_stride +
                  (kGroup ? seq.k_start * p.v_seq_stride : batch * p.v_batch_stride);
  auto* o = static_cast<Element*>(p.o) + head * p.o_head_stride +
            (kGroup ? seq.q_start * p.o_seq_stride : batch * p.o_batch_stride) +
            static_cast<int64_t>(q_row0) * p.o_seq_stride;
  // Column-major V rows start 16-byte aligned unless a group-mode sequence starts mid-chunk.
  const bool v_aligned = !Cfg::kVColMajor || !kGroup || seq.k_start % 8 == 0;

  const uint32_t s_q = sm80::smem_addr(smem);
  const uint32_t s_k = s_q + Cfg::kQRegionBytes;                // kStages K tiles
  const uint32_t s_v = s_k + Cfg::kStages * KTile::kBytes;      // kStages V tiles

  const Mask mask(seq.seqlen_q, seq.seqlen_k, p.bottom_right, p.window_left, p.window_right);
  const int last_row = min(q_row0 + kBlockM, seq.seqlen_q) - 1;
  const int n_begin = mask.n_block_begin(q_row0);
  const int n_end = mask.n_block_end(last_row);
  const int n_steps = max(n_end - n_begin, 0);

  auto load_kv = [&](int n_block, int stage) {
    const int64_t key0 = static_cast<int64_t>(n_block) * kBlockN;
    const int keys_valid = seq.seqlen_k - n_block * kBlockN;
    load_rows<Cfg, KTile, kBlockN>(s_k + stage * KTile::kBytes, k + key0 * p.k_seq_stride,
                                   p.k_seq_stride, keys_valid, p.hdim_q / 8);
    sm80::cp_async_commit();
    if constexpr (Cfg::kVColMajor) {
      load_v_col_major<Cfg>(s_v + stage * VTile::kBytes, v + key0 * p.v_seq_stride,
                            p.v_dim_stride, keys_valid, p.hdim_v, v_aligned);
    } else {
      load_rows<Cfg, VTile, kBlockN>(s_v + stage * VTile::kBytes, v + key0 * p.v_seq_stride,
                                     p.v_seq_stride, keys_valid, p.hdim_v / 8);
    }
    sm80::cp_async_commit();
  };

  // Prologue: Q with the first K tile as one group, the first V tile as the next. Key tiles run
  // from the last to the first, so the causal edge tiles come first.
  load_rows<Cfg, QTile, kBlockM>(s_q, q, p.q_seq_stride, seq.seqlen_q - q_row0, p.hdim_q / 8);
  if (n_steps > 0) {
    load_kv(n_end - 1, 0);
  } else {
    sm80::cp_async_commit();
    sm80::cp_async_commit();
  }
  sm80::cp_async_wait<1>();
  __syncthreads();

  const int warp_row0 = warp * Cfg::kRowsPerWarp;  // first row of this warp within the tile
  // Per-lane ldmatrix bases (see SmemTile::step). Q and row-major V: lanes 0-15 address rows
  // 0-15 at the low chunk, 16-31 the same rows at the high chunk. K and column-major V: lanes
  // 8i..8i+7 address matrix i = (rows +0/+8) x (chunk lo/hi).
  const uint32_t q_lane = QTile::offset(warp_row0 + lane % 16, lane / 16);
  const uint32_t k_lane = KTile::offset((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const uint32_t v_lane = Cfg::kVColMajor
                              ? VTile::offset((lane / 16) * 8 + lane % 8, (lane / 8) % 2)
                              : VTile::offset(lane % 16, lane / 16);
  auto load_q = [&](uint32_t (&a)[4], int mf, int kt) {
    sm80::ldmatrix_x4(a, s_q + QTile::step(q_lane, mf, kt));
  };
  uint32_t q_frag[Cfg::kQInRegisters ? kDimQK / 16 : 1][4];
  if constexpr (Cfg::kQInRegisters) {
#pragma unroll
    for (int kt = 0; kt < kDimQK / 16; ++kt) load_q(q_frag[kt], 0, kt);
  }

  float o_acc[kMFrags][kDTiles][4];
#pragma unroll
  for (int mf = 0; mf < kMFrags; ++mf) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mf][dt][e] = 0.f;
    }
  }
  // Each lane holds two rows per m16 fragment: lane/4 (accumulator elements 0,1) and
  // lane/4 + 8 (elements 2,3); these are their rows within the sequence.
  auto row_of = [&](int mf, int half) { return q_row0 + warp_row0 + mf * 16 + lane / 4 + half * 8; };
  float row_max[kMFrags][2];  // of the stored scores, before softmax_mul
  float row_sum[kMFrags][2];  // this lane's partial sums; reduced across the quad at the end
#pragma unroll
  for (int mf = 0; mf < kMFrags; ++mf) {
    row_max[mf][0] = row_max[mf][1] = -INFINITY;
    row_sum[mf][0] = row_sum[mf][1] = 0.f;
  }

  const Element* bias = nullptr;
  if constexpr (Cfg::kBias == BiasType::kElementwise) {
    bias = static_cast<const Element*>(p.bias) + batch * p.bias_batch_stride +
           head * p.bias_head_stride;
  }
  float alibi_slope = 0.f;
  if constexpr (Cfg::kBias == BiasType::kAlibi) {
    alibi_slope = p.alibi_slopes[batch * p.alibi_batch_stride + head];
  }

  for (int it = 0; it < n_steps; ++it) {
    const int n_block = n_end - 1 - it;
    const int stage = it % 2;
    sm80::cp_async_wait<1>();  // this step's K tile has landed (its V tile may still fly)
    __syncthreads();           // ...for every thread, and all warps are done with the other stage
    if (it + 1 < n_steps) {
      load_kv(n_block - 1, stage ^ 1);
    } else {
      sm80::cp_async_commit();  // empty groups keep the wait counts uniform
      sm80::cp_async_commit();
    }

    // S = Q K^T for this warp's rows: kMFrags x (16, kBlockN) in n8 accumulator tiles. Each
    // K fragment read from shared memory feeds kMFrags mma.
    float s[kMFrags][kNTiles][4];
#pragma unroll
    for (int mf = 0; mf < kMFrags; ++mf) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mf][nt][e] = 0.f;
      }
    }
    const uint32_t s_k_stage = s_k + stage * KTile::kBytes;
#pragma unroll
    for (int kt = 0; kt < kDimQK / 16; ++kt) {
      uint32_t a[kMFrags][4];
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf) {
        if constexpr (Cfg::kQInRegisters) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[mf][r] = q_frag[kt][r];
        } else {
          load_q(a[mf], mf, kt);
        }
      }
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t b[4];  // keys np*16 + 0..15, d in k-step kt
        sm80::ldmatrix_x4(b, s_k_stage + KTile::step(k_lane, np, kt));
#pragma unroll
        for (int mf = 0; mf < kMFrags; ++mf) {
          sm80::mma_16816<Element>(s[mf][2 * np], a[mf], b[0], b[1]);
          sm80::mma_16816<Element>(s[mf][2 * np + 1], a[mf], b[2], b[3]);
        }
      }
    }

    // Element (mf, nt, e) of S is row row_of(mf, e / 2), key col0 + nt * 8 + e % 2.
    const int col0 = n_block * kBlockN + (lane % 4) * 2;
    if constexpr (Cfg::kLogitsInScores) {
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = row_of(mf, e / 2);
            const int col = col0 + nt * 8 + e % 2;
            float x = s[mf][nt][e];
            x = Cfg::kSoftcap ? p.softcap * sm80::tanh_fast(x * p.softcap_scale) : x * p.scale;
            if constexpr (Cfg::kBias == BiasType::kElementwise) {
              if (!Cfg::kPadSeqlen || (row < seq.seqlen_q && col < seq.seqlen_k)) {
                x += sm80::to_float(bias[row * p.bias_seq_stride + col]);
              }
            }
            if constexpr (Cfg::kBias == BiasType::kAlibi) {
              x -= alibi_slope * fabsf(static_cast<float>(row + mask.offset - col));
            }
            s[mf][nt][e] = x;
          }
        }
      }
    }

    if (mask.is_edge_tile(q_row0, n_block)) {
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (!mask.is_visible(row_of(mf, e / 2), col0 + nt * 8 + e % 2)) {
              s[mf][nt][e] = -INFINITY;
            }
          }
        }
      }
    }

    // Online softmax: new running max, rescale what was accumulated, exponentiate.
#pragma unroll
    for (int mf = 0; mf < kMFrags; ++mf) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m = row_max[mf][h];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          m = fmaxf(m, fmaxf(s[mf][nt][2 * h], s[mf][nt][2 * h + 1]));
        }
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
        // A row with nothing visible yet keeps max -inf; subtracting 0 instead keeps exp2 at 0
        // rather than NaN from (-inf) - (-inf).
        const float m_scaled = m == -INFINITY ? 0.f : m * p.softmax_mul;
        const float correction = sm80::fast_exp2(row_max[mf][h] * p.softmax_mul - m_scaled);
        row_max[mf][h] = m;
        row_sum[mf][h] *= correction;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o_acc[mf][dt][2 * h] *= correction;
          o_acc[mf][dt][2 * h + 1] *= correction;
        }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            s[mf][nt][e] = sm80::fast_exp2(s[mf][nt][e] * p.softmax_mul - m_scaled);
            row_sum[mf][h] += s[mf][nt][e];
          }
        }
      }
    }

    // Dropout zeroes probabilities after they entered the row sums: the softmax is of all
    // logits, and 1 / (1 - p) is applied once in the epilogue. One Philox call decides a lane's
    // four elements of an n8 tile: rows r and r + 8, keys c and c + 1 (philox.cuh).
    if constexpr (Cfg::kDropout) {
      // In uint32: batch * nhead_q reaches 65535^2 > INT_MAX (philox.cuh keys on it mod 2^32).
      const uint32_t batch_head = static_cast<uint32_t>(batch) * static_cast<uint32_t>(p.nhead_q) +
                                  static_cast<uint32_t>(head);
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          const philox::Words r = philox::dropout_words(p.dropout_seed, p.dropout_offset,
                                                        batch_head, row_of(mf, 0), col0 + nt * 8);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (r.w[e] < p.drop_threshold) s[mf][nt][e] = 0.f;
          }
        }
      }
    }

    // P as A fragments: the accumulators of n-tiles 2t and 2t+1 are exactly the A fragment of
    // k-step t, so P goes from S to the next mma without a trip through shared memory.
    uint32_t p_frag[kMFrags][kBlockN / 16][4];
#pragma unroll
    for (int mf = 0; mf < kMFrags; ++mf) {
#pragma unroll
      for (int t = 0; t < kBlockN / 16; ++t) {
        p_frag[mf][t][0] = sm80::pack2<Element>(s[mf][2 * t][0], s[mf][2 * t][1]);
        p_frag[mf][t][1] = sm80::pack2<Element>(s[mf][2 * t][2], s[mf][2 * t][3]);
        p_frag[mf][t][2] = sm80::pack2<Element>(s[mf][2 * t + 1][0], s[mf][2 * t + 1][1]);
        p_frag[mf][t][3] = sm80::pack2<Element>(s[mf][2 * t + 1][2], s[mf][2 * t + 1][3]);
      }
    }

    sm80::cp_async_wait<2>();  // this step's V tile has landed (the next step's K, V may fly)
    __syncthreads();
    const uint32_t s_v_stage = s_v + stage * VTile::kBytes;
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t) {
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        // B fragments of V for keys t*16 + 0..15 and d tiles 2dp, 2dp+1: transposed out of
        // row-major V, or straight out of column-major V (rows d, columns keys).
        uint32_t b[4];
        if constexpr (Cfg::kVColMajor) {
          sm80::ldmatrix_x4(b, s_v_stage + VTile::step(v_lane, dp, t));
        } else {
          sm80::ldmatrix_x4_trans(b, s_v_stage + VTile::step(v_lane, t, dp));
        }
#pragma unroll
        for (int mf = 0; mf < kMFrags; ++mf) {
          sm80::mma_16816<Element>(o_acc[mf][2 * dp], p_frag[mf][t], b[0], b[1]);
          sm80::mma_16816<Element>(o_acc[mf][2 * dp + 1], p_frag[mf][t], b[2], b[3]);
        }
      }
    }
  }

  // Epilogue: O / rowsum (and / (1 - p) under dropout), rounded to Element, staged through the
  // Q region, then written with 16-byte stores. With equal head dims a warp's O rows sit where
  // its own Q rows were, which only it read; otherwise (192 x 128) the layouts differ and all
  // warps must be done with Q first. The log-sum-exp goes out from the first lane of a quad.
  if constexpr (!std::is_same_v<QTile, OTile>) __syncthreads();
  const uint32_t s_o = s_q;
  float* lse = nullptr;
  if constexpr (Cfg::kLse) {
    if (p.lse != nullptr) {
      lse = p.lse + head * p.lse_head_stride +
            (kGroup ? seq.q_start : batch * p.lse_batch_stride);
    }
  }
#pragma unroll
  for (int mf = 0; mf < kMFrags; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mf][h];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      // No visible key: output 0, log-sum-exp -inf, never NaN.
      const float inv = sum > 0.f ? (Cfg::kDropout ? p.keep_scale : 1.f) / sum : 0.f;
      if constexpr (Cfg::kLse) {
        const int row = row_of(mf, h);
        if (lse != nullptr && lane % 4 == 0 && row < seq.seqlen_q) {
          // A NaN sum (NaN or +inf among the logits) is no empty row: its LSE is NaN too.
          lse[row] = sum > 0.f    ? (row_max[mf][h] * p.softmax_mul + log2f(sum)) *
                                     static_cast<float>(M_LN2)
                     : sum == 0.f ? -INFINITY
                                  : NAN;
        }
      }
      const int tile_row = warp_row0 + mf * 16 + lane / 4 + h * 8;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const uint32_t packed =
            sm80::pack2<Element>(o_acc[mf][dt][2 * h] * inv, o_acc[mf][dt][2 * h + 1] * inv);
        asm volatile("st.shared.b32 [%0], %1;\n"
                     ::"r"(s_o + OTile::offset(tile_row, dt) + (lane % 4) * 4), "r"(packed));
      }
    }
  }
  __syncwarp();
  constexpr int kOutChunks = Cfg::kRowsPerWarp * OTile::kChunks;  // this warp's rows, 16 B each
  static_assert(kOutChunks % 32 == 0, "the output rows must split evenly over a warp");
#pragma unroll
  for (int i = 0; i < kOutChunks / 32; ++i) {
    const int idx = lane + i * 32;
    const int row = warp_row0 + idx / OTile::kChunks;
    const int chunk = idx % OTile::kChunks;
    if ((!Cfg::kPadSeqlen || row < seq.seqlen_q - q_row0) &&
        (!Cfg::kPadHdim || chunk < p.hdim_v / 8)) {
      uint4 val;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(s_o + OTile::offset(row, chunk)));
      *reinterpret_cast<uint4*>(o + row * p.o_seq_stride + chunk * 8) = val;
    }
  }
}

template <class Cfg>
cudaError_t launch_fwd(const FwdArgs& args, cudaStream_t stream) {
  FwdParams p = make_fwd_params(args, Cfg::kLogitsInScores);
  // In group mode seqlen_q is the longest sequence: shorter ones exit their extra tiles.
  // Sizes in int64: seqlen_q + kBlockM - 1 and batch * nhead_q (up to 65535^2) overflow int.
  const int64_t m_blocks = (static_cast<int64_t>(args.seqlen_q) + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t batch_heads = static_cast<int64_t>(args.batch) * args.nhead_q;
  // The causal grid is 1-D, and the kernel decodes blockIdx.x as an int: it must stay below
  // 2^31 CTAs (gridDim.x's limit too); past that the launch fails instead of wrapping around.
  if (Cfg::kMask == MaskType::kCausal && m_blocks * batch_heads > INT32_MAX) {
    return cudaErrorInvalidConfiguration;
  }
  p.m_blocks = static_cast<int>(m_blocks);
  const int64_t kv_bytes_per_head =
      static_cast<int64_t>(args.seqlen_k) * (Cfg::kHeadDimQK + Cfg::kHeadDimV) * 2;
  p.group_heads = heads_per_group(kv_bytes_per_head, batch_heads);
  const dim3 grid = Cfg::kMask == MaskType::kCausal
                        ? dim3(static_cast<unsigned>(m_blocks * batch_heads))
                        : dim3(static_cast<unsigned>(m_blocks), args.nhead_q, args.batch);
  auto* kernel = fwd_kernel<Cfg>;
  if (Cfg::kSmemBytes > 48 * 1024) {  // past 48 KB a kernel must opt in to dynamic smem
    static std::atomic<uint64_t> smem_raised{0};
    const cudaError_t err =
        allow_dynamic_smem(reinterpret_cast<const void*>(kernel), Cfg::kSmemBytes, smem_raised);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fmha::fa2
