// The attention mask as a policy answering three questions for a (query tile, key tile) pair:
// which key tiles a query tile visits at all, whether a visited tile needs per-element checks
// (an edge tile), and the per-element predicate. The main loop runs interior tiles with no
// checks, so the cost of masking is paid on O(1) tiles per query tile, not on all of them.
#pragma once

#include "fmha/fmha.h"

namespace fmha {

template <MaskType kMask, bool kPadSeqlen, int kBlockM, int kBlockN>
struct MaskPolicy {
  static constexpr bool kCausal = kMask == MaskType::kCausalTopLeft;

  // One past the last key tile that query tile `m_block` sees. Top-left causal: query row i
  // sees keys 0..i, so the tile's last row bounds the keys.
  __device__ static int n_block_end(int m_block, int seqlen_k) {
    const int keys = kCausal ? min(seqlen_k, (m_block + 1) * kBlockM) : seqlen_k;
    return (keys + kBlockN - 1) / kBlockN;
  }

  // True when some element of the tile is invisible: the tile crosses the causal diagonal, or
  // it runs past the end of the keys.
  __device__ static bool is_edge_tile(int m_block, int n_block, int seqlen_k) {
    const int last_key = (n_block + 1) * kBlockN - 1;
    const bool crosses_diagonal = kCausal && last_key > m_block * kBlockM;
    const bool past_keys = kPadSeqlen && last_key >= seqlen_k;
    return crosses_diagonal || past_keys;
  }

  __device__ static bool is_visible(int row, int col, int seqlen_k) {
    return (!kPadSeqlen || col < seqlen_k) && (!kCausal || col <= row);
  }
};

}  // namespace fmha
