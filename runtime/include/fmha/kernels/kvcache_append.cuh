// The step every KV-cache pipeline runs first (kvcache_decode_split_kv.cuh's decode and
// kvcache_chunked_prefill_sm90.cuh's chunked prefill): k_new and v_new appended to the cache at
// cache_seqlens[b], k rotated when rotary tables are given, and q rotated into the workspace.
// A kernel of its own on the call's stream, before the attention; mma.sync-free, so one kernel
// serves sm80 and sm90a. Also the parameters it and the decode kernel read (KvcacheParams),
// derived once per call.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "fmha/fmha.h"
#include "fmha/kernels/dependent_launch.cuh"
#include "fmha/kernels/e4m3_cache.cuh"
#include "fmha/kernels/fast_divisor.cuh"
#include "fmha/kernels/sm80_primitives.cuh"

namespace fmha::kvcache {

// What the append kernel and the decode kernel read, derived once per call on the host.
struct KvcacheParams {
  const void* q;  // args.q, or the rotated copy in the workspace
  void* k_cache;
  void* v_cache;
  const void* k_new;
  const void* v_new;
  void* o;
  float* lse;
  float* o_partial;    // (num_splits, batch, nhead_q, seqlen_q, hdim_v), when num_splits > 1
  float* lse_partial;  // (num_splits, batch, nhead_q, seqlen_q)

  int batch, seqlen_q, seqlen_new, seqlen_cache, nhead_q, nhead_k, group;
  int hdim_qk, hdim_v;  // the call's: Cfg's, or up to them when Cfg::kPadHdim
  int rows;      // packed query rows per (sequence, K/V head): seqlen_q * group
  int m_blocks;  // CTAs of kBlockM packed rows per (sequence, K/V head)
  int num_splits;

  int64_t q_batch_stride, q_seq_stride, q_head_stride;
  int64_t kc_batch_stride, kc_seq_stride, kc_head_stride;
  int64_t vc_batch_stride, vc_seq_stride, vc_head_stride;
  int64_t kn_batch_stride, kn_seq_stride, kn_head_stride;
  int64_t vn_batch_stride, vn_seq_stride, vn_head_stride;
  int64_t o_batch_stride, o_seq_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;

  const int32_t* cache_seqlens;
  const int32_t* cache_batch_idx;
  const int32_t* cache_leftpad;
  const int32_t* block_table;
  int64_t block_table_batch_stride;
  FastDivisor page_size;  // keys a page holds (paged only): key / page_size by multiply-high

  const void* rotary_cos;
  const void* rotary_sin;
  int rotary_dim;
  int seqlen_rotary;
  bool rotary_interleaved;
  bool rotate_q_per_token;  // masked calls rotate query token i at cache_seqlens + i
  void* q_rotated;          // (batch, seqlen_q, nhead_q, hdim_q), contiguous

  // An e4m3 cache's dequantization factors (KvcacheArgs::k_scale), null for a 16-bit cache.
  const float* k_scale;
  const float* v_scale;
  int64_t k_scale_batch_stride, k_scale_head_stride;
  int64_t v_scale_batch_stride, v_scale_head_stride;

  float scale, softcap, softcap_scale, softmax_mul;
  int window_left, window_right;
  const float* alibi_slopes;
  int64_t alibi_batch_stride;
};

// Where key `key` of sequence `batch`, head `head` lives in a cache (k or v): through the block
// table when paged, else in the sequence's own cache row.
template <bool kPaged, typename Element>
__device__ __forceinline__ Element* cache_row(Element* cache, const KvcacheParams& p,
                                              int64_t batch_stride, int64_t seq_stride,
                                              int64_t head_stride, int batch, int head, int key) {
  int64_t base;
  if constexpr (kPaged) {
    const int index = p.page_size.quotient(key);
    const int page = p.block_table[batch * p.block_table_batch_stride + index];
    const int row_in_page = key - index * p.page_size.divisor;
    base = page * batch_stride + static_cast<int64_t>(row_in_page) * seq_stride;
  } else {
    const int row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[batch] : batch;
    base = row * batch_stride + static_cast<int64_t>(key) * seq_stride;
  }
  return cache + base + head * head_stride;
}

// ---- a row's 16-byte pieces ----------------------------------------------------------------

// Rows move in 16-byte pieces of 8 elements (here and in the decode kernel), every row starting
// 16-byte aligned (the API's stride checks). A call whose head dim is below its instance's
// (Cfg::kPadHdim) has a partial last piece where the head dim is no multiple of 8, and none past
// it: nothing beyond a row's head dim is read or written, and the tile's columns past it are
// zeros.

// The elements of piece `chunk` that a row of `dim` elements holds: 8, 1-7, or 0 past the row.
__device__ __forceinline__ int piece_elements(int chunk, int dim) {
  return min(max(dim - chunk * 8, 0), 8);
}

// Piece `chunk` of a row: one 16-byte access when whole, element by element when partial.
template <typename Element>
__device__ __forceinline__ void load_piece(Element (&v)[8], const Element* row, int chunk,
                                           int count) {
  if (count == 8) {
    *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(row + chunk * 8);
  } else {
    for (int e = 0; e < count; ++e) v[e] = row[chunk * 8 + e];
  }
}

template <typename Element>
__device__ __forceinline__ void store_piece(Element* row, int chunk, const Element (&v)[8],
                                            int count) {
  if (count == 8) {
    *reinterpret_cast<uint4*>(row + chunk * 8) = *reinterpret_cast<const uint4*>(v);
  } else {
    for (int e = 0; e < count; ++e) row[chunk * 8 + e] = v[e];
  }
}

// ---- append: k_new/v_new into the cache, with rotary on k and q -----------------------------

// One thread per 8 elements (16 bytes) of a row, the first `count` of them the row's. Rotary
// pairs element e with e ± rotary_dim / 2 (or its neighbour, interleaved), which may sit in
// another thread's chunk, so the partner is read from the source row directly.
template <typename Element>
__device__ void rotate_chunk(Element (&out)[8], const Element* row, int chunk,
                             const KvcacheParams& p, int position, int count) {
  position = min(position, p.seqlen_rotary - 1);  // a query past the cache (fmha.h)
  const auto* cos_row = static_cast<const Element*>(p.rotary_cos) +
                        static_cast<int64_t>(position) * (p.rotary_dim / 2);
  const auto* sin_row = static_cast<const Element*>(p.rotary_sin) +
                        static_cast<int64_t>(position) * (p.rotary_dim / 2);
  const int half = p.rotary_dim / 2;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (e >= count) break;
    const int d = chunk * 8 + e;
    const float x = sm80::to_float(row[d]);
    if (d >= p.rotary_dim) {
      out[e] = row[d];
      continue;
    }
    // (x_first, x_second) rotated by the angle of pair `pair`: first' = first cos - second
    // sin, second' = second cos + first sin.
    const bool first = p.rotary_interleaved ? d % 2 == 0 : d < half;
    const int pair = p.rotary_interleaved ? d / 2 : d % half;
    const int partner = p.rotary_interleaved ? (first ? d + 1 : d - 1)
                                             : (first ? d + half : d - half);
    const float y = sm80::to_float(row[partner]);
    const float c = sm80::to_float(cos_row[pair]);
    const float s = sm80::to_float(sin_row[pair]);
    const float r = first ? x * c - y * s : x * c + y * s;
    out[e] = static_cast<Element>(r);
  }
}

// Grid: (ceil(rows * chunks / 128), batch), rows = seqlen_new * nhead_k for k and v, then
// seqlen_q * nhead_q for q when it is rotated.
template <class Cfg>
__global__ void __launch_bounds__(128) kvcache_append_kernel(const __grid_constant__ KvcacheParams p) {
  using Element = typename Cfg::Element;
  using KvElement = typename Cfg::KvElement;
  constexpr int kChunksQK = Cfg::kHeadDimQK / 8;
  constexpr int kChunksV = Cfg::kHeadDimV / 8;
  let_dependents_launch();
  wait_for_previous_grids();
  const int batch = blockIdx.y;
  const int cached = p.cache_seqlens[batch];
  const int kv_items = p.seqlen_new * p.nhead_k * (kChunksQK + kChunksV);
  const int q_items = p.q_rotated != nullptr ? p.seqlen_q * p.nhead_q * kChunksQK : 0;
  const int item = blockIdx.x * 128 + threadIdx.x;
  if (item < kv_items) {
    const bool is_k = item < p.seqlen_new * p.nhead_k * kChunksQK;
    const int local = is_k ? item : item - p.seqlen_new * p.nhead_k * kChunksQK;
    const int chunks = is_k ? kChunksQK : kChunksV;
    const int chunk = local % chunks;
    const int head = local / chunks % p.nhead_k;
    const int token = local / chunks / p.nhead_k;
    const int key = cached + token;
    if (key >= p.seqlen_cache) return;  // past the cache: the attention stops before it
    const int count = Cfg::kPadHdim ? piece_elements(chunk, is_k ? p.hdim_qk : p.hdim_v) : 8;
    if (count == 0) return;
    const auto* src =
        static_cast<const Element*>(is_k ? p.k_new : p.v_new) +
        batch * (is_k ? p.kn_batch_stride : p.vn_batch_stride) +
        token * (is_k ? p.kn_seq_stride : p.vn_seq_stride) +
        head * (is_k ? p.kn_head_stride : p.vn_head_stride);
    KvElement* dst = is_k ? cache_row<Cfg::kPaged>(static_cast<KvElement*>(p.k_cache), p,
                                                   p.kc_batch_stride, p.kc_seq_stride,
                                                   p.kc_head_stride, batch, head, key)
                          : cache_row<Cfg::kPaged>(static_cast<KvElement*>(p.v_cache), p,
                                                   p.vc_batch_stride, p.vc_seq_stride,
                                                   p.vc_head_stride, batch, head, key);
    alignas(16) Element vals[8];
    if (is_k && p.rotary_dim > 0 && chunk * 8 < p.rotary_dim) {
      rotate_chunk(vals, src, chunk, p, key, count);
    } else {
      load_piece(vals, src, chunk, count);
    }
    if constexpr (std::is_same_v<KvElement, Element>) {
      store_piece(dst, chunk, vals, count);
    } else {
      // An e4m3 cache (exact head dims: whole pieces): the 8 elements divided by the
      // sequence's and head's scale, rounded, 8 bytes.
      const float scale = is_k ? p.k_scale[batch * p.k_scale_batch_stride +
                                           head * p.k_scale_head_stride]
                               : p.v_scale[batch * p.v_scale_batch_stride +
                                           head * p.v_scale_head_stride];
      float x[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = sm80::to_float(vals[e]);
      *reinterpret_cast<uint2*>(dst + chunk * 8) = e4m3::quantize8(x, scale);
    }
  } else if (item < kv_items + q_items) {
    const int local = item - kv_items;
    const int chunk = local % kChunksQK;
    const int head = local / kChunksQK % p.nhead_q;
    const int token = local / kChunksQK / p.nhead_q;
    const int count = Cfg::kPadHdim ? piece_elements(chunk, p.hdim_qk) : 8;
    if (count == 0) return;
    const auto* src = static_cast<const Element*>(p.q) + batch * p.q_batch_stride +
                      token * p.q_seq_stride + head * p.q_head_stride;
    alignas(16) Element vals[8];
    if (chunk * 8 < p.rotary_dim) {
      rotate_chunk(vals, src, chunk, p, cached + (p.rotate_q_per_token ? token : 0), count);
    } else {
      load_piece(vals, src, chunk, count);
    }
    auto* dst = static_cast<Element*>(p.q_rotated) +
                ((static_cast<int64_t>(batch) * p.seqlen_q + token) * p.nhead_q + head) *
                    Cfg::kHeadDimQK;
    store_piece(dst, chunk, vals, count);
  }
}

inline size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The workspace's rotated copy of q, when the call rotates it (every kvcache pipeline's).
inline size_t rotated_q_bytes(const KvcacheArgs& a, int hdim_q) {
  if (a.rotary_dim == 0) return 0;
  return round_up_256(static_cast<size_t>(a.batch) * a.nhead_q * a.seqlen_q * hdim_q * 2);
}

// The fields of KvcacheParams that the append step and the decode kernel read as the call
// gives them.
inline KvcacheParams kvcache_params(const KvcacheArgs& a) {
  KvcacheParams p{};
  p.q = a.q;
  p.k_cache = a.k_cache;
  p.v_cache = a.v_cache;
  p.k_new = a.k_new;
  p.v_new = a.v_new;
  p.o = a.o;
  p.lse = a.lse;
  p.batch = a.batch;
  p.seqlen_q = a.seqlen_q;
  p.seqlen_new = a.k_new != nullptr ? a.seqlen_new : 0;
  p.seqlen_cache = a.seqlen_cache;
  p.nhead_q = a.nhead_q;
  p.nhead_k = a.nhead_k;
  p.hdim_qk = a.hdim_q;
  p.hdim_v = a.hdim_v;
  p.group = a.nhead_q / a.nhead_k;
  p.rows = a.seqlen_q * p.group;
  p.q_batch_stride = a.q_batch_stride;
  p.q_seq_stride = a.q_seq_stride;
  p.q_head_stride = a.q_head_stride;
  p.kc_batch_stride = a.k_cache_batch_stride;
  p.kc_seq_stride = a.k_cache_seq_stride;
  p.kc_head_stride = a.k_cache_head_stride;
  p.vc_batch_stride = a.v_cache_batch_stride;
  p.vc_seq_stride = a.v_cache_seq_stride;
  p.vc_head_stride = a.v_cache_head_stride;
  p.kn_batch_stride = a.k_new_batch_stride;
  p.kn_seq_stride = a.k_new_seq_stride;
  p.kn_head_stride = a.k_new_head_stride;
  p.vn_batch_stride = a.v_new_batch_stride;
  p.vn_seq_stride = a.v_new_seq_stride;
  p.vn_head_stride = a.v_new_head_stride;
  p.o_batch_stride = a.o_batch_stride;
  p.o_seq_stride = a.o_seq_stride;
  p.o_head_stride = a.o_head_stride;
  p.lse_batch_stride = a.lse_batch_stride;
  p.lse_head_stride = a.lse_head_stride;
  p.cache_seqlens = a.cache_seqlens;
  p.cache_batch_idx = a.cache_batch_idx;
  p.cache_leftpad = a.cache_leftpad;
  p.block_table = a.block_table;
  p.block_table_batch_stride = a.block_table_batch_stride;
  if (a.page_size > 0) p.page_size = FastDivisor(a.page_size);
  p.rotary_cos = a.rotary_cos;
  p.rotary_sin = a.rotary_sin;
  p.rotary_dim = a.rotary_dim;
  p.seqlen_rotary = a.seqlen_rotary;
  p.rotary_interleaved = a.rotary_interleaved;
  p.rotate_q_per_token = a.mask != MaskType::kNone;
  p.k_scale = a.k_scale;
  p.v_scale = a.v_scale;
  p.k_scale_batch_stride = a.k_scale_batch_stride;
  p.k_scale_head_stride = a.k_scale_head_stride;
  p.v_scale_batch_stride = a.v_scale_batch_stride;
  p.v_scale_head_stride = a.v_scale_head_stride;
  p.scale = a.softmax_scale;
  p.softcap = a.softcap;
  p.softcap_scale = a.softcap > 0.f ? a.softmax_scale / a.softcap : 0.f;
  p.window_left = a.window_left;
  p.window_right = a.window_right;
  p.alibi_slopes = a.alibi_slopes;
  p.alibi_batch_stride = a.alibi_batch_stride;
  return p;
}

// The append step, when the call appends k_new/v_new or rotates q: the new keys and values go
// into the cache, and a rotated q into p.q_rotated, which p.q then points to. Cfg gives the
// element type, the head dims and kPaged; either pipeline's attention runs after it.
template <class Cfg>
cudaError_t launch_append(KvcacheParams& p, cudaStream_t stream) {
  if (p.seqlen_new == 0 && p.q_rotated == nullptr) return cudaSuccess;
  const int64_t items =
      static_cast<int64_t>(p.seqlen_new) * p.nhead_k * (Cfg::kHeadDimQK + Cfg::kHeadDimV) / 8 +
      (p.q_rotated != nullptr ? static_cast<int64_t>(p.seqlen_q) * p.nhead_q * Cfg::kHeadDimQK / 8
                              : 0);
  const dim3 grid(static_cast<unsigned>((items + 127) / 128), p.batch);
  const cudaError_t err = launch_dependent<kvcache_append_kernel<Cfg>>(grid, 128, 0, stream, p);
  if (err != cudaSuccess) return err;
  if (p.q_rotated != nullptr) {
    p.q = p.q_rotated;
    p.q_batch_stride = static_cast<int64_t>(p.seqlen_q) * p.nhead_q * Cfg::kHeadDimQK;
    p.q_seq_stride = static_cast<int64_t>(p.nhead_q) * Cfg::kHeadDimQK;
    p.q_head_stride = Cfg::kHeadDimQK;
  }
  return cudaSuccess;
}

}  // namespace fmha::kvcache
