// The fa3 forward's tile scheduler: which (query tile, head, sequence) work tiles a persistent
// CTA runs, in which order, and the key tiles each one visits. The producer warp and the
// consumer warpgroups each walk the same tiles with it (TileScheduler::for_each_tile), so they
// agree on every tile's loads without talking to each other.
#pragma once

#include <cstdint>

#include "fmha/fmha.h"
#include "fmha/kernels/fwd_params.cuh"
#include "fmha/kernels/mask.cuh"
#include "fmha/kernels/tile_order.cuh"

namespace fmha::fa3 {

// Persistent CTAs take work units round-robin: unit u goes to CTA u % gridDim.x. Without a
// causal mask a unit is one tile, and units are query tiles of one head next to each other, so
// the CTAs running at once share that head's K/V in L2. Under a causal mask tile m costs m + 1
// key tiles, and round-robin over tiles sorted by length gave CTA 0 up to 3x the key tiles of
// CTA 123 (bf16 d128, S = 16k, 16k tokens: 423 TFLOP/s against 642 without the mask). So a
// causal unit pairs query tile M-1-p with tile p of the same head: every pair costs M + 1 key
// tiles (the middle tile of an odd M is alone), and pairs run in L2 head groups
// (tile_order.cuh).
template <class Cfg>
__host__ __device__ inline int64_t work_units(int64_t m_blocks, int64_t batch_heads) {
  return Cfg::kMask == MaskType::kCausal ? (m_blocks + 1) / 2 * batch_heads
                                         : m_blocks * batch_heads;
}

// Tile `half` (0 or 1) of work unit `unit`; false when the unit has no such tile.
template <class Cfg>
__device__ __forceinline__ bool unit_tile(const typename Cfg::KernelParams& kp, int unit,
                                          int half, int batch_heads, TileCoord* tile) {
  const FwdParams& p = kp.p;
  if constexpr (Cfg::kMask == MaskType::kCausal) {
    const int pairs = (p.m_blocks + 1) / 2;
    // The pair index plays the query tile's part in the head-group order.
    const TileCoord pair = longest_first_in_head_groups(unit, pairs, p.nhead_q, batch_heads,
                                                        p.group_heads);
    const int long_m = p.m_blocks - 1 - (pairs - 1 - pair.m_block);
    const int short_m = p.m_blocks - 1 - long_m;
    if (half == 1 && short_m == long_m) return false;
    *tile = {half == 0 ? long_m : short_m, pair.head, pair.batch};
    return true;
  } else {
    if (half == 1) return false;
    if (kp.spread_heads) {
      const int m_block = unit / batch_heads;
      const int bh = unit - m_block * batch_heads;
      *tile = {m_block, bh % p.nhead_q, bh / p.nhead_q};
    } else {
      const int bh = unit / p.m_blocks;
      *tile = {unit - bh * p.m_blocks, bh % p.nhead_q, bh / p.nhead_q};
    }
    return true;
  }
}

// One work tile as the producer and the consumers both derive it, so that they agree on which
// tiles exist and which key tiles [n_begin, n_end) each one visits.
template <class Cfg>
struct WorkTile {
  using Mask = TileMask<Cfg::kMask, /*kPadSeqlen=*/true, Cfg::kBlockM, Cfg::kBlockN>;
  TileCoord tile;
  SequenceExtent seq;
  int q_row0;
  Mask mask;
  int n_begin;
  int n_end;

  __device__ WorkTile(const FwdParams& p, TileCoord coord)
      : tile(coord),
        seq(sequence_extent<Cfg::kMode>(p, coord.batch)),
        q_row0(coord.m_block * Cfg::kBlockM),
        mask(seq.seqlen_q, seq.seqlen_k, p.bottom_right, p.window_left, p.window_right),
        n_begin(mask.n_block_begin(q_row0)),
        n_end(mask.n_block_end(q_row0 + Cfg::kBlockM - 1)) {}

  // The grid covers the longest sequence; tiles past this one's end have nothing to do.
  __device__ bool in_sequence() const { return q_row0 < seq.seqlen_q; }
  // No row of the tile sees a key (a window past the sequence's keys, or no keys at all).
  __device__ __forceinline__ bool sees_no_key() const { return n_end <= n_begin; }
};

// The persistent loop: this CTA's work units, each unit's one or two tiles.
template <class Cfg>
class TileScheduler {
 public:
  __device__ __forceinline__ explicit TileScheduler(const typename Cfg::KernelParams& kp)
      : kp_(kp),
        batch_heads_(kp.total_tiles / kp.p.m_blocks),
        units_(static_cast<int>(work_units<Cfg>(kp.p.m_blocks, batch_heads_))) {}

  // visit(const WorkTile<Cfg>&) on each of the CTA's tiles that lies within its sequence, in
  // the order every role of the CTA takes them. visit is a role (Producer, Consumer) passed by
  // reference: a lambda that captured a role's state by reference kept that state in memory
  // past NVVM's early passes, which reordered the loop's code (scripts/ptx_identity.py).
  template <class Visit>
  __device__ __forceinline__ void for_each_tile(Visit&& visit) const {
    for (int unit = blockIdx.x; unit < units_; unit += gridDim.x)
    for (int half = 0; half < 2; ++half) {
      TileCoord coord;
      if (!unit_tile<Cfg>(kp_, unit, half, batch_heads_, &coord)) continue;
      const WorkTile<Cfg> work(kp_.p, coord);
      if (!work.in_sequence()) continue;
      visit(work);
    }
  }

 private:
  const typename Cfg::KernelParams& kp_;
  int batch_heads_;
  int units_;
};

}  // namespace fmha::fa3
