// The forward problem as a kernel reads it: FwdArgs with what the host can precompute folded in
// (the softmax multiplier, the soft-cap factor, the dropout threshold), passed by value in
// constant memory; and the per-CTA view of one sequence (where its tokens start and how many
// it uses), which is where batch and group mode differ.
#pragma once

#include <cmath>
#include <cstdint>

#include "fmha/fmha.h"
#include "fmha/kernels/philox.cuh"

namespace fmha {

// Strides are in elements.
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int64_t q_batch_stride, q_seq_stride, q_head_stride;
  int64_t k_batch_stride, k_seq_stride, k_head_stride;
  int64_t v_batch_stride, v_seq_stride, v_head_stride, v_dim_stride;
  int64_t o_batch_stride, o_seq_stride, o_head_stride;
  int seqlen_q;  // batch mode: every sequence's length; group mode: cu_seqlens decide
  int seqlen_k;
  int hdim_q;  // at most the instance's head dims; smaller only in head-dim-padded instances
  int hdim_v;
  int nhead_q;
  int kv_group;  // nhead_q / nhead_k: query heads that share one K/V head

  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_q;
  const int32_t* seqused_k;
  // Keys a call appends past seqused_k[b] (fwd_kvcache's k_new, written into the cache before
  // the attention kernel runs); 0 for fmha::fwd.
  int keys_appended;

  bool bottom_right;
  // e4m3 inputs: O in fp16 rather than bf16 (FwdArgs::o_dtype); the fa3 epilogue reads it. In
  // bottom_right's padding, so that no field moves and the 16-bit kernels' code is unchanged.
  bool o_fp16;
  int window_left;
  int window_right;

  float scale;          // softmax_scale, for instances that transform logits before softmax
  float softcap;        // cap, and scale / cap: logits = cap * tanh(qk * scale / cap)
  float softcap_scale;
  // What the softmax multiplies a stored score by to get log2 units: scale * log2(e) for raw
  // scores, log2(e) when the scores are already logits (soft-capped or biased).
  float softmax_mul;

  const void* bias;
  int64_t bias_batch_stride, bias_head_stride, bias_seq_stride;
  const float* alibi_slopes;
  int64_t alibi_batch_stride;

  uint64_t dropout_seed;
  uint32_t dropout_offset;
  uint32_t drop_threshold;
  float keep_scale;  // 1 / (1 - dropout_p)

  float* lse;
  int64_t lse_batch_stride, lse_head_stride;

  const float* q_descale;  // e4m3 inputs (FwdArgs says how they are indexed); nullptr: 1
  const float* k_descale;
  const float* v_descale;
  int64_t q_descale_batch_stride, q_descale_head_stride;
  int64_t k_descale_batch_stride, k_descale_head_stride;
  int64_t v_descale_batch_stride, v_descale_head_stride;

  int m_blocks;     // query tiles per head (of the longest sequence)
  int group_heads;  // causal tile order: (batch, head) pairs per L2 group (tile_order.cuh)
};

// `logits_in_scores`: the instance turns raw scores into logits in place (soft-cap or bias)
// before its softmax.
inline FwdParams make_fwd_params(const FwdArgs& a, bool logits_in_scores) {
  FwdParams p{};
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.o = a.o;
  p.q_batch_stride = a.q_batch_stride;
  p.q_seq_stride = a.q_seq_stride;
  p.q_head_stride = a.q_head_stride;
  p.k_batch_stride = a.k_batch_stride;
  p.k_seq_stride = a.k_seq_stride;
  p.k_head_stride = a.k_head_stride;
  p.v_batch_stride = a.v_batch_stride;
  p.v_seq_stride = a.v_seq_stride;
  p.v_head_stride = a.v_head_stride;
  p.v_dim_stride = a.v_dim_stride;
  p.o_batch_stride = a.o_batch_stride;
  p.o_seq_stride = a.o_seq_stride;
  p.o_head_stride = a.o_head_stride;
  p.seqlen_q = a.seqlen_q;
  p.seqlen_k = a.seqlen_k;
  p.hdim_q = a.hdim_q;
  p.hdim_v = a.hdim_v;
  p.nhead_q = a.nhead_q;
  p.kv_group = a.nhead_q / a.nhead_k;
  p.cu_seqlens_q = a.cu_seqlens_q;
  p.cu_seqlens_k = a.cu_seqlens_k;
  p.seqused_q = a.seqused_q;
  p.seqused_k = a.seqused_k;
  p.bottom_right = a.mask_align == MaskAlign::kBottomRight;
  p.o_fp16 = a.dtype == DataType::kE4M3 && a.o_dtype == DataType::kFP16;
  p.window_left = a.window_left;
  p.window_right = a.window_right;
  p.scale = a.softmax_scale;
  p.softcap = a.softcap;
  p.softcap_scale = a.softcap > 0.f ? a.softmax_scale / a.softcap : 0.f;
  p.softmax_mul = logits_in_scores ? static_cast<float>(M_LOG2E)
                                   : a.softmax_scale * static_cast<float>(M_LOG2E);
  p.bias = a.bias_ptr;
  p.bias_batch_stride = a.bias_batch_stride;
  p.bias_head_stride = a.bias_head_stride;
  p.bias_seq_stride = a.bias_seq_stride;
  p.alibi_slopes = a.alibi_slopes;
  p.alibi_batch_stride = a.alibi_batch_stride;
  p.dropout_seed = a.dropout_seed;
  p.dropout_offset = a.dropout_offset;
  p.drop_threshold = philox::drop_threshold(a.dropout_p);
  p.keep_scale = a.dropout_p > 0.f ? 1.f / (1.f - a.dropout_p) : 1.f;
  p.lse = a.lse;
  p.lse_batch_stride = a.lse_batch_stride;
  p.lse_head_stride = a.lse_head_stride;
  p.q_descale = a.q_descale;
  p.k_descale = a.k_descale;
  p.v_descale = a.v_descale;
  p.q_descale_batch_stride = a.q_descale_batch_stride;
  p.q_descale_head_stride = a.q_descale_head_stride;
  p.k_descale_batch_stride = a.k_descale_batch_stride;
  p.k_descale_head_stride = a.k_descale_head_stride;
  p.v_descale_batch_stride = a.v_descale_batch_stride;
  p.v_descale_head_stride = a.v_descale_head_stride;
  return p;
}

// One sequence of the batch as a CTA sees it.
struct SequenceExtent {
  int64_t q_start;  // its first row in the packed Q/O (group mode); 0 in batch mode
  int64_t k_start;
  int seqlen_q;     // the rows and keys it uses
  int seqlen_k;
};

template <Mode kMode>
__device__ __forceinline__ SequenceExtent sequence_extent(const FwdParams& p, int batch) {
  SequenceExtent s{0, 0, p.seqlen_q, p.seqlen_k};
  if constexpr (kMode == Mode::kGroup) {
    s.q_start = p.cu_seqlens_q[batch];
    s.k_start = p.cu_seqlens_k[batch];
    s.seqlen_q = p.cu_seqlens_q[batch + 1] - static_cast<int>(s.q_start);
    s.seqlen_k = p.cu_seqlens_k[batch + 1] - static_cast<int>(s.k_start);
  }
  if (p.seqused_q != nullptr) s.seqlen_q = p.seqused_q[batch];
  if (p.seqused_k != nullptr) {
    s.seqlen_k = p.seqused_k[batch] + p.keys_appended;
    // Never past the K/V rows (a KV cache's end: past it nothing was written).
    if constexpr (kMode == Mode::kBatch) s.seqlen_k = min(s.seqlen_k, p.seqlen_k);
  }
  return s;
}

}  // namespace fmha
