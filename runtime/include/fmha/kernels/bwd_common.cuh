// What the backward pipelines share (fa2's bwd_fa2_sm80.cuh, fa3's bwd_fa3_sm90.cuh): the
// problem as their kernels read it, the fp32 dQ accumulator's layout and its reduction, and
// the kernel that turns the accumulator into dQ.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fmha/fmha.h"
#include "fmha/kernels/device_facts.cuh"
#include "fmha/kernels/fwd_params.cuh"
#include "fmha/kernels/sm80_primitives.cuh"

namespace fmha {

// The backward problem as the kernels read it: the forward's parameters (the same logits,
// mask, dropout pattern) plus the gradients and the workspace.
struct BwdParams {
  FwdParams fwd;
  const void* dout;
  int64_t do_batch_stride, do_seq_stride, do_head_stride;
  void* dq;
  void* dk;
  void* dv;
  int64_t dq_batch_stride, dq_seq_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_seq_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_seq_stride, dv_head_stride;
  void* dbias;
  int64_t dbias_batch_stride, dbias_head_stride, dbias_seq_stride;

  int nhead_k;
  int batch;
  int64_t rows;         // query rows of the problem: batch * seqlen_q, or total_q
  float* row_dot;       // D, (nhead_q, rows)
  float* dq_accum;      // (splits, rows, nhead_q, kHeadDimQK) fp32, columns at dq_accum_position
  int64_t split_stride; // elements between two splits' accumulators
  int n_blocks;         // key tiles of the longest sequence
  int splits;           // deterministic: CTAs along the keys (each walks n_blocks / splits)
  bool deterministic;
};

// Deterministic mode gives each of `splits` CTAs per (K/V head, sequence) a dQ accumulator of
// its own: enough of them to fill the GPU twice over when batch * nhead_k alone does not.
inline int bwd_splits(const BwdArgs& a, int block_n) {
  const int n_blocks = static_cast<int>((static_cast<int64_t>(a.fwd.seqlen_k) + block_n - 1) /
                                        block_n);
  if (!a.deterministic || n_blocks <= 1) return 1;
  const int64_t ctas = static_cast<int64_t>(a.fwd.batch) * a.fwd.nhead_k;
  const int64_t wanted = (2 * static_cast<int64_t>(multiprocessor_count()) + ctas - 1) / ctas;
  return static_cast<int>(wanted < 1 ? 1 : wanted > n_blocks ? n_blocks : wanted);
}

inline int64_t bwd_rows(const BwdArgs& a) {
  return a.fwd.mode == Mode::kGroup ? a.fwd.total_q
                                    : static_cast<int64_t>(a.fwd.batch) * a.fwd.seqlen_q;
}

// BwdParams of `args` but for what depends on the instance's tile (n_blocks, splits,
// split_stride) and on its workspace layout (row_dot, dq_accum).
inline BwdParams make_bwd_params(const BwdArgs& args, bool logits_in_scores) {
  BwdParams p{};
  p.fwd = make_fwd_params(args.fwd, logits_in_scores);
  p.dout = args.dout;
  p.do_batch_stride = args.dout_batch_stride;
  p.do_seq_stride = args.dout_seq_stride;
  p.do_head_stride = args.dout_head_stride;
  p.dq = args.dq;
  p.dk = args.dk;
  p.dv = args.dv;
  p.dq_batch_stride = args.dq_batch_stride;
  p.dq_seq_stride = args.dq_seq_stride;
  p.dq_head_stride = args.dq_head_stride;
  p.dk_batch_stride = args.dk_batch_stride;
  p.dk_seq_stride = args.dk_seq_stride;
  p.dk_head_stride = args.dk_head_stride;
  p.dv_batch_stride = args.dv_batch_stride;
  p.dv_seq_stride = args.dv_seq_stride;
  p.dv_head_stride = args.dv_head_stride;
  p.dbias = args.dbias;
  p.dbias_batch_stride = args.dbias_batch_stride;
  p.dbias_head_stride = args.dbias_head_stride;
  p.dbias_seq_stride = args.dbias_seq_stride;
  p.nhead_k = args.fwd.nhead_k;
  p.batch = args.fwd.batch;
  p.rows = bwd_rows(args);
  p.deterministic = args.deterministic;
  return p;
}

constexpr size_t kWorkspaceAlign = 256;

inline size_t align_workspace(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
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

// D = sum_d dO * O of one query row and head, every lane of the warp getting it; `row` counts
// the packed rows of bwd_rows(). Lane l reads columns 8l..8l+7 (16 bytes of each), so a warp
// covers head dims up to 256.
template <class Element, Mode kMode>
__device__ __forceinline__ float warp_dot_do_o(const BwdParams& p, int64_t row, int head) {
  const int lane = threadIdx.x % 32;
  int64_t o_off, do_off;
  if constexpr (kMode == Mode::kGroup) {
    o_off = row * p.fwd.o_seq_stride;
    do_off = row * p.do_seq_stride;
  } else {
    const int64_t b = row / p.fwd.seqlen_q, i = row % p.fwd.seqlen_q;
    o_off = b * p.fwd.o_batch_stride + i * p.fwd.o_seq_stride;
    do_off = b * p.do_batch_stride + i * p.do_seq_stride;
  }
  o_off += head * p.fwd.o_head_stride + lane * 8;
  do_off += head * p.do_head_stride + lane * 8;
  float dot = 0.f;
  if (lane * 8 < p.fwd.hdim_v) {
    const uint4 o8 = *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.fwd.o) + o_off);
    const uint4 do8 = *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.dout) + do_off);
    const auto* o_e = reinterpret_cast<const Element*>(&o8);
    const auto* do_e = reinterpret_cast<const Element*>(&do8);
#pragma unroll
    for (int e = 0; e < 8; ++e) dot += sm80::to_float(o_e[e]) * sm80::to_float(do_e[e]);
  }
#pragma unroll
  for (int s = 16; s > 0; s /= 2) dot += __shfl_xor_sync(0xffffffff, dot, s);
  return dot;
}

// The last kernel of a backward instance: dQ = softmax_scale * the sum of its accumulators over
// the splits (in split order), one thread per 16-column group of the accumulator.
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

}  // namespace fmha
