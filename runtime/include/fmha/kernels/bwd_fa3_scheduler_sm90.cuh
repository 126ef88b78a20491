// The fa3 backward's tile scheduler: which key tiles a CTA owns, in which order, and the steps
// (query head, query tile) each key tile takes. The load warp, the dQ writer warp and the
// consumer warpgroups each walk the same key tiles with it, so they agree on every step without
// talking to each other.
#pragma once

#include "fmha/fmha.h"
#include "fmha/kernels/bwd_common.cuh"
#include "fmha/kernels/fwd_params.cuh"
#include "fmha/kernels/mask.cuh"
#include "fmha/kernels/tile_order.cuh"

namespace fmha::fa3 {

// The CTA's first key tile, K/V head and sequence; it walks key tiles n_block, n_block +
// n_stride, ... (one, but in deterministic mode, where CTA `split` walks every splits-th). Without
// a causal mask the grid is (key tile, K/V head, sequence): a head's key tiles run at once and
// share its Q and dO in L2. Under a causal mask key tile n sees the query tiles from about n on,
// so tile 0 costs the most: the grid is 1-D, heads in groups whose Q and dO fit L2, each group's
// longest key tiles first (tile_order.cuh), so the last wave holds only short tiles.
struct KeyTileWalk {
  int n_block;
  int n_stride;
  int kv_head;
  int batch;
};

template <class Cfg>
__device__ __forceinline__ KeyTileWalk cta_key_tiles(const typename Cfg::KernelParams& kp) {
  const BwdParams& p = kp.p;
  if (Cfg::kMask == MaskType::kCausal && !p.deterministic) {
    const TileCoord t = longest_first_in_head_groups(blockIdx.x, p.n_blocks, p.nhead_k,
                                                     p.nhead_k * p.batch, kp.group_heads);
    return {p.n_blocks - 1 - t.m_block, p.n_blocks, t.head, t.batch};
  }
  return {static_cast<int>(blockIdx.x), p.deterministic ? static_cast<int>(gridDim.x) : p.n_blocks,
          static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
}

// One key tile's work as the producer and the consumers both derive it: the query tiles
// [m_begin, m_end) of each query head that see some of its keys.
template <class Cfg>
struct KeyTileWork {
  using Mask = TileMask<Cfg::kMask, /*kPadSeqlen=*/true, Cfg::kBlockM, Cfg::kBlockN>;
  SequenceExtent seq;
  Mask mask;
  int key0;
  int m_begin;
  int m_end;

  __device__ KeyTileWork(const FwdParams& f, int batch, int n_block)
      : seq(sequence_extent<Cfg::kMode>(f, batch)),
        mask(seq.seqlen_q, seq.seqlen_k, f.bottom_right, f.window_left, f.window_right),
        key0(n_block * Cfg::kBlockN) {
    const bool has_keys = key0 < seq.seqlen_k;
    const int last_key = min(key0 + Cfg::kBlockN, seq.seqlen_k) - 1;
    const int m_tiles = (seq.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
    m_begin = has_keys ? mask.m_block_begin(key0) : 0;
    m_end = has_keys ? min(mask.m_block_end(last_key, seq.seqlen_q), m_tiles) : 0;
  }

  __device__ bool has_steps() const { return m_end > m_begin; }
};

}  // namespace fmha::fa3
