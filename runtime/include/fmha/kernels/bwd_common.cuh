// What the backward pipelines share (fa2's bwd_fa2_sm80.cuh, fa3's bwd_fa3_sm90.cuh): the
// problem as their kernels read it, the rows a sequence owns, the dot(dO, O) row sums and the
// zeroing of the fp32 dQ accumulators. Each pipeline lays its accumulator out its own way.
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

// How the D = rowsum(dO * O) kernels spread rows over a warp: kLanesPerRow lanes share a row,
// each reading 8 columns (16 bytes) of O and of dO, so a warp takes kRowsPerPass rows a pass; it
// issues the loads of kPasses passes before it sums any. A warp per row and one row at a time
// (the first version) kept 8 of 32 lanes busy at head dim 64: 256 bytes in flight a warp, 8 KB
// an SM at 32 warps, where an H100 needs about 20 KB (3.35 TB/s x ~0.8 us of latency / 132
// SMs); this shape keeps 4 KB a warp in flight at every head dim.
template <int kHeadDimV>
struct RowDotShape {
  static_assert(kHeadDimV <= 256, "a row is at most one warp of 16-byte loads");
  static constexpr int kLanesPerRow = kHeadDimV <= 32    ? 4
                                      : kHeadDimV <= 64  ? 8
                                      : kHeadDimV <= 128 ? 16
                                                         : 32;
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static constexpr int kPasses = 4;
  static constexpr int kRowsPerWarp = kRowsPerPass * kPasses;
};

// Columns col..col + 7 of O and of dO at packed row `row` (bwd_rows()'s) of query head `head`.
template <class Element, Mode kMode>
__device__ __forceinline__ void load_o_do(const BwdParams& p, int64_t row, int head, int col,
                                          uint4& o8, uint4& do8) {
  int64_t o_off, do_off;
  if constexpr (kMode == Mode::kGroup) {
    o_off = row * p.fwd.o_seq_stride;
    do_off = row * p.do_seq_stride;
  } else {
    const int64_t b = row / p.fwd.seqlen_q, i = row % p.fwd.seqlen_q;
    o_off = b * p.fwd.o_batch_stride + i * p.fwd.o_seq_stride;
    do_off = b * p.do_batch_stride + i * p.do_seq_stride;
  }
  o_off += head * p.fwd.o_head_stride + col;
  do_off += head * p.do_head_stride + col;
  o8 = *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.fwd.o) + o_off);
  do8 = *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.dout) + do_off);
}

// This lane's share of D: the dot product of its 8 columns of O and dO, then summed over the
// kLanesPerRow lanes of its row (aligned groups of lanes), every one of them getting the sum.
template <class Element, int kLanesPerRow>
__device__ __forceinline__ float row_dot_do_o(const uint4& o8, const uint4& do8) {
  const auto* o_e = reinterpret_cast<const Element*>(&o8);
  const auto* do_e = reinterpret_cast<const Element*>(&do8);
  float dot = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) dot += sm80::to_float(o_e[e]) * sm80::to_float(do_e[e]);
#pragma unroll
  for (int s = kLanesPerRow / 2; s > 0; s /= 2) dot += __shfl_xor_sync(0xffffffff, dot, s);
  return dot;
}

// The rows a sequence owns in Q, dO and dQ (seqused_q may use fewer), or in K, V, dK and dV:
// every one of them is written.
template <Mode kMode>
__device__ __forceinline__ int rows_owned(const int32_t* cu_seqlens, int batch, int seqlen) {
  return kMode == Mode::kGroup ? cu_seqlens[batch + 1] - cu_seqlens[batch] : seqlen;
}

// Zeroes the fp32 dQ accumulators of every split (a grid-stride loop, 16 bytes a thread).
__device__ __forceinline__ void zero_dq_accumulators(const BwdParams& p) {
  const int64_t quads = p.splits * p.split_stride / 4;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < quads;
       i += threads) {
    reinterpret_cast<float4*>(p.dq_accum)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

}  // namespace fmha
