// FlashAttention-2 forward pipeline for sm80-class GPUs (runs on sm90 too).
//
// One CTA computes one (query tile, head, batch): kBlockM query rows against every visible key,
// kBlockN keys per step. Each warp owns 16 or 32 query rows end to end, so the softmax
// statistics of a row never leave the 4 lanes that hold it. Per step:
//   K tile -> S = Q K^T (mma.sync; Q fragments in registers at 16 rows per warp, re-read
//             from shared memory at 32, where registers go to the larger O and S)
//          -> online softmax in fp32 (exp2, scale folded into one FFMA per score)
//   V tile -> O += P V (P re-packed from the S accumulators, never touching shared memory)
// K and V stream through a two-stage shared-memory ring with cp.async: the loads of step j+1
// are issued right after the barrier of step j, so they have a whole step to land.
//
// Shared memory per CTA (2 stages): Q tile + 2 K tiles + 2 V tiles, e.g. 96 KB at
// hdim 128, 128x64 tiles; the Q region is reused to stage O for 16-byte coalesced stores.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "fmha/fmha.h"
#include "fmha/kernels/mask.cuh"
#include "fmha/kernels/sm80_primitives.cuh"

namespace fmha::fa2 {

template <typename Element_, int kHeadDimQK_, int kHeadDimV_, int kBlockM_, int kBlockN_,
          int kNumWarps_, int kStages_, MaskType kMask_, bool kPadSeqlen_>
struct FwdConfig {
  using Element = Element_;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNumWarps = kNumWarps_;
  static constexpr int kStages = kStages_;
  static constexpr MaskType kMask = kMask_;
  static constexpr bool kPadSeqlen = kPadSeqlen_;

  static constexpr int kThreads = kNumWarps * 32;
  static constexpr int kElementBytes = 2;

  // Every warp reads the whole K and V tile from shared memory each step, so rows per warp set
  // the shared-memory traffic per FLOP: at 16 rows, d128, 8 warps read 256 KB a 64-key step,
  // more than the ~1.5k cycles of mma.sync it feeds can hide (128 B/cycle/SM); 32 rows halve it.
  static constexpr int kRowsPerWarp = kBlockM / kNumWarps;
  static constexpr int kMFrags = kRowsPerWarp / 16;  // m16 fragments per warp
  // At 32 rows the O and S accumulators alone take 192 registers (d128, 64 keys), so Q is
  // re-read per step (8 KB per warp) instead of held.
  static constexpr bool kQInRegisters = kMFrags == 1;

  static_assert(sizeof(Element) == kElementBytes, "fa2 takes 16-bit inputs");
  static_assert(kBlockM % kNumWarps == 0 && (kRowsPerWarp == 16 || kRowsPerWarp == 32),
                "fa2: each warp owns 16 or 32 query rows");
  static_assert(kBlockN % 16 == 0, "fa2: key tiles come in mma k-steps of 16");
  static_assert(kStages == 2, "fa2 double-buffers K and V");

  // The Q region also stages the O tile in the epilogue, so it fits the wider of the two.
  static constexpr int kQRegionBytes =
      kBlockM * (kHeadDimQK > kHeadDimV ? kHeadDimQK : kHeadDimV) * kElementBytes;
  static constexpr int kKTileBytes = kBlockN * kHeadDimQK * kElementBytes;
  static constexpr int kVTileBytes = kBlockN * kHeadDimV * kElementBytes;
  static constexpr int kSmemBytes = kQRegionBytes + kStages * (kKTileBytes + kVTileBytes);
};

// What the kernel reads, by value in constant memory. Strides are in elements.
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int64_t q_batch_stride, q_seq_stride, q_head_stride;
  int64_t k_batch_stride, k_seq_stride, k_head_stride;
  int64_t v_batch_stride, v_seq_stride, v_head_stride;
  int64_t o_batch_stride, o_seq_stride, o_head_stride;
  int seqlen_q;
  int seqlen_k;
  int kv_group;      // nhead_q / nhead_k: query heads that share one K/V head
  float scale_log2;  // softmax_scale * log2(e): softmax runs on exp2
};

// A row-major tile of 16-bit elements in shared memory, kCols wide, its 16-byte chunks XOR-
// swizzled by row so that the 8 row addresses of an ldmatrix, and the 8 chunks a warp's cp.async
// writes per row, fall in 8 different bank groups (no conflicts).
template <int kCols>
struct SwizzledTile {
  static constexpr int kChunks = kCols / 8;
  static constexpr int kRowBytes = kCols * 2;
  static_assert(kChunks % 8 == 0 && (kChunks & (kChunks - 1)) == 0,
                "the 8-way XOR swizzle needs head dims of 64 * 2^k");

  __device__ static uint32_t offset(int row, int chunk) {
    return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
  }

  // offset(row + 16 * i, chunk + 2 * j) from offset(row, chunk): the chunk bits of an offset
  // sit below the row bits (kChunks is a power of two), so stepping whole chunk pairs is an XOR
  // with a constant and stepping 16 rows an add. In the unrolled loops every ldmatrix address
  // is then one per-lane base plus compile-time terms, instead of a register per (i, j).
  __device__ static uint32_t step(uint32_t base, int i, int j) {
    return (base ^ (j << 5)) + i * 16 * kRowBytes;
  }
};

// All threads of the CTA copy a kRows x kCols tile, each 16 bytes at a time. Rows at or past
// `rows_valid` are zero-filled (only compiled in for padded instances): zero K rows are masked
// anyway, and zero V rows keep 0 * garbage from turning into NaN.
template <class Cfg, int kRows, int kCols>
__device__ __forceinline__ void load_tile(uint32_t smem_tile, const typename Cfg::Element* gmem,
                                          int64_t row_stride, int rows_valid) {
  using Tile = SwizzledTile<kCols>;
  constexpr int kTotalChunks = kRows * Tile::kChunks;
  static_assert(kTotalChunks % Cfg::kThreads == 0, "tile must split evenly over the CTA");
#pragma unroll
  for (int i = 0; i < kTotalChunks / Cfg::kThreads; ++i) {
    const int idx = threadIdx.x + i * Cfg::kThreads;
    const int row = idx / Tile::kChunks;
    const int chunk = idx % Tile::kChunks;
    const bool valid = !Cfg::kPadSeqlen || row < rows_valid;
    const auto* src = valid ? gmem + row * row_stride + chunk * 8 : gmem;
    sm80::cp_async_16(smem_tile + Tile::offset(row, chunk), src, valid);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) fwd_kernel(const __grid_constant__ FwdParams p) {
  using Element = typename Cfg::Element;
  using Mask = MaskPolicy<Cfg::kMask, Cfg::kPadSeqlen, Cfg::kBlockM, Cfg::kBlockN>;
  using QTile = SwizzledTile<Cfg::kHeadDimQK>;
  using VTile = SwizzledTile<Cfg::kHeadDimV>;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kDimQK = Cfg::kHeadDimQK;
  constexpr int kDimV = Cfg::kHeadDimV;
  constexpr int kNTiles = kBlockN / 8;  // n8 accumulator tiles of S per warp
  constexpr int kDTiles = kDimV / 8;    // n8 accumulator tiles of O per warp

  extern __shared__ __align__(128) unsigned char smem[];

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  // Causal: the last query tiles see the most keys; start them first so they are not left
  // running alone in the final wave.
  const int m_block = Mask::kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / p.kv_group;

  const int64_t q_row0 = static_cast<int64_t>(m_block) * kBlockM;
  const auto* q = static_cast<const Element*>(p.q) + batch * p.q_batch_stride +
                  head * p.q_head_stride + q_row0 * p.q_seq_stride;
  const auto* k = static_cast<const Element*>(p.k) + batch * p.k_batch_stride +
                  kv_head * p.k_head_stride;
  const auto* v = static_cast<const Element*>(p.v) + batch * p.v_batch_stride +
                  kv_head * p.v_head_stride;
  auto* o = static_cast<Element*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
            q_row0 * p.o_seq_stride;

  const uint32_t s_q = sm80::smem_addr(smem);
  const uint32_t s_k = s_q + Cfg::kQRegionBytes;  // kStages K tiles
  const uint32_t s_v = s_k + Cfg::kStages * Cfg::kKTileBytes;  // kStages V tiles

  const int n_end = Mask::n_block_end(m_block, p.seqlen_k);
  auto load_kv = [&](int n_block, int stage) {
    const int64_t key0 = static_cast<int64_t>(n_block) * kBlockN;
    const int keys_valid = p.seqlen_k - n_block * kBlockN;
    load_tile<Cfg, kBlockN, kDimQK>(s_k + stage * Cfg::kKTileBytes, k + key0 * p.k_seq_stride,
                                    p.k_seq_stride, keys_valid);
    sm80::cp_async_commit();
    load_tile<Cfg, kBlockN, kDimV>(s_v + stage * Cfg::kVTileBytes, v + key0 * p.v_seq_stride,
                                   p.v_seq_stride, keys_valid);
    sm80::cp_async_commit();
  };

  // Prologue: Q with the first K tile as one group, the first V tile as the next. Key tiles run
  // from the last to the first, so the causal edge tiles come first.
  load_tile<Cfg, kBlockM, kDimQK>(s_q, q, p.q_seq_stride, p.seqlen_q - m_block * kBlockM);
  if (n_end > 0) {
    load_kv(n_end - 1, 0);
  } else {
    sm80::cp_async_commit();
    sm80::cp_async_commit();
  }
  sm80::cp_async_wait<1>();
  __syncthreads();

  constexpr int kMFrags = Cfg::kMFrags;
  const int warp_row0 = warp * Cfg::kRowsPerWarp;  // first row of this warp within the tile
  // A fragment of Q for m16 fragment `mf`, k-step `kt`, straight from shared memory.
  // Per-lane ldmatrix bases (see SwizzledTile::step). Q and V: lanes 0-15 address rows 0-15
  // at the low chunk, 16-31 the same rows at the high chunk. K: lanes 8i..8i+7 address matrix
  // i = (keys +0/+8) x (d chunk lo/hi).
  const uint32_t q_lane = QTile::offset(warp_row0 + lane % 16, lane / 16);
  const uint32_t k_lane = QTile::offset((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const uint32_t v_lane = VTile::offset(lane % 16, lane / 16);
  auto load_q = [&](uint32_t (&a)[4], int mf, int kt) {
    sm80::ldmatrix_x4(a, s_q + QTile::step(q_lane, mf, kt));
  };
  uint32_t q_frag[Cfg::kQInRegisters ? kDimQK / 16 : 1][4];  // held only at 16 rows per warp
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
  // lane/4 + 8 (elements 2,3).
  float row_max[kMFrags][2];  // of raw scores, before scaling
  float row_sum[kMFrags][2];  // this lane's partial sums; reduced across the quad at the end
#pragma unroll
  for (int mf = 0; mf < kMFrags; ++mf) {
    row_max[mf][0] = row_max[mf][1] = -INFINITY;
    row_sum[mf][0] = row_sum[mf][1] = 0.f;
  }

  for (int it = 0; it < n_end; ++it) {
    const int n_block = n_end - 1 - it;
    const int stage = it % 2;
    sm80::cp_async_wait<1>();  // this step's K tile has landed (its V tile may still fly)
    __syncthreads();           // ...for every thread, and all warps are done with the other stage
    if (it + 1 < n_end) {
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
    const uint32_t s_k_stage = s_k + stage * Cfg::kKTileBytes;
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
        sm80::ldmatrix_x4(b, s_k_stage + QTile::step(k_lane, np, kt));
#pragma unroll
        for (int mf = 0; mf < kMFrags; ++mf) {
          sm80::mma_16816<Element>(s[mf][2 * np], a[mf], b[0], b[1]);
          sm80::mma_16816<Element>(s[mf][2 * np + 1], a[mf], b[2], b[3]);
        }
      }
    }

    if (Mask::is_edge_tile(m_block, n_block, p.seqlen_k)) {
      const int col0 = n_block * kBlockN + (lane % 4) * 2;
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf) {
        const int row0 = m_block * kBlockM + warp_row0 + mf * 16 + lane / 4;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (!Mask::is_visible(row0 + (e / 2) * 8, col0 + nt * 8 + e % 2, p.seqlen_k)) {
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
        const float m_scaled = m == -INFINITY ? 0.f : m * p.scale_log2;
        const float correction = sm80::fast_exp2(row_max[mf][h] * p.scale_log2 - m_scaled);
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
            s[mf][nt][e] = sm80::fast_exp2(s[mf][nt][e] * p.scale_log2 - m_scaled);
            row_sum[mf][h] += s[mf][nt][e];
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
    const uint32_t s_v_stage = s_v + stage * Cfg::kVTileBytes;
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t) {
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t b[4];  // V (keys x d) transposed: keys t*16 + 0..15, d tiles 2dp and 2dp+1
        sm80::ldmatrix_x4_trans(b, s_v_stage + VTile::step(v_lane, t, dp));
#pragma unroll
        for (int mf = 0; mf < kMFrags; ++mf) {
          sm80::mma_16816<Element>(o_acc[mf][2 * dp], p_frag[mf][t], b[0], b[1]);
          sm80::mma_16816<Element>(o_acc[mf][2 * dp + 1], p_frag[mf][t], b[2], b[3]);
        }
      }
    }
  }

  // Epilogue: O / rowsum, rounded to Element, staged through this warp's own rows of the Q
  // region (only this warp read them), then written with 16-byte stores, one row per 8 lanes
  // at d64 (16 at d128).
  const uint32_t s_o = s_q;
#pragma unroll
  for (int mf = 0; mf < kMFrags; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mf][h];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // no visible key: output 0, not NaN
      const int row = warp_row0 + mf * 16 + lane / 4 + h * 8;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const uint32_t packed =
            sm80::pack2<Element>(o_acc[mf][dt][2 * h] * inv, o_acc[mf][dt][2 * h + 1] * inv);
        asm volatile("st.shared.b32 [%0], %1;\n"
                     ::"r"(s_o + VTile::offset(row, dt) + (lane % 4) * 4), "r"(packed));
      }
    }
  }
  __syncwarp();
  constexpr int kOutChunks = Cfg::kRowsPerWarp * VTile::kChunks;  // this warp's rows, 16 B each
  static_assert(kOutChunks % 32 == 0, "the output rows must split evenly over a warp");
#pragma unroll
  for (int i = 0; i < kOutChunks / 32; ++i) {
    const int idx = lane + i * 32;
    const int row = warp_row0 + idx / VTile::kChunks;
    const int chunk = idx % VTile::kChunks;
    if (!Cfg::kPadSeqlen || row < p.seqlen_q - m_block * kBlockM) {
      uint4 val;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(s_o + VTile::offset(row, chunk)));
      *reinterpret_cast<uint4*>(o + row * p.o_seq_stride + chunk * 8) = val;
    }
  }
}

template <class Cfg>
cudaError_t launch_fwd(const FwdArgs& args, cudaStream_t stream) {
  FwdParams p;
  p.q = args.q;
  p.k = args.k;
  p.v = args.v;
  p.o = args.o;
  p.q_batch_stride = args.q_batch_stride;
  p.q_seq_stride = args.q_seq_stride;
  p.q_head_stride = args.q_head_stride;
  p.k_batch_stride = args.k_batch_stride;
  p.k_seq_stride = args.k_seq_stride;
  p.k_head_stride = args.k_head_stride;
  p.v_batch_stride = args.v_batch_stride;
  p.v_seq_stride = args.v_seq_stride;
  p.v_head_stride = args.v_head_stride;
  p.o_batch_stride = args.o_batch_stride;
  p.o_seq_stride = args.o_seq_stride;
  p.o_head_stride = args.o_head_stride;
  p.seqlen_q = args.seqlen_q;
  p.seqlen_k = args.seqlen_k;
  p.kv_group = args.nhead_q / args.nhead_k;
  p.scale_log2 = args.softmax_scale * static_cast<float>(M_LOG2E);

  const dim3 grid((args.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, args.nhead_q, args.batch);
  auto* kernel = fwd_kernel<Cfg>;
  if (Cfg::kSmemBytes > 48 * 1024) {  // past 48 KB a kernel must opt in to dynamic smem
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fmha::fa2
