// The attention mask of one query tile, as a policy answering three questions: which key tiles
// the query tile visits at all, whether a visited tile needs per-element checks (an edge tile),
// and the per-element predicate. The main loop runs interior tiles with no checks, so masking
// costs O(1) edge tiles per query tile, and fully masked tiles are never loaded.
//
// Row i is aligned with key i + offset (0 for top-left, seqlen_k - seqlen_q for bottom-right)
// and sees keys in [i + offset - left, i + offset + right]: causal is (unbounded, 0), a window
// is what the caller gave (a negative size is unbounded), no mask is unbounded both ways.
#pragma once

#include "fmha/fmha.h"

namespace fmha {

template <MaskType kMask, bool kPadSeqlen, int kBlockM, int kBlockN>
struct TileMask {
  static constexpr bool kHasRight = kMask != MaskType::kNone;
  static constexpr bool kHasLeft = kMask == MaskType::kWindow;

  int seqlen_k;
  int offset;
  int left;   // finite: an unbounded side is set past every key
  int right;

  __device__ TileMask(int seqlen_q, int seqlen_k_, bool bottom_right, int window_left,
                      int window_right)
      : seqlen_k(seqlen_k_), offset(bottom_right ? seqlen_k_ - seqlen_q : 0) {
    // seqlen_q + seqlen_k reaches past every key from any row. A window wider than that sees
    // as much as an unbounded one, so sizes are clamped to it: the key bounds below,
    // row + offset -/+ size, then stay within 2 (seqlen_q + seqlen_k) + kBlockM in magnitude
    // (int-safe for seqlen_q + seqlen_k < 2^30), where a size near INT_MAX, e.g.
    // window_size=(2**31 - 1, 2**31 - 1), used to wrap around and hide every key.
    const int unbounded = seqlen_q + seqlen_k_;
    left = kHasLeft && window_left >= 0 ? min(window_left, unbounded) : unbounded;
    right = kMask == MaskType::kCausal ? 0
            : kHasRight && window_right >= 0 ? min(window_right, unbounded) : unbounded;
  }

  // The key tiles [begin, end) that rows first_row..last_row see; empty when end <= begin.
  __device__ int n_block_begin(int first_row) const {
    if (!kHasLeft) return 0;
    const int first_key = first_row + offset - left;
    return first_key > 0 ? first_key / kBlockN : 0;
  }
  __device__ int n_block_end(int last_row) const {
    int keys = seqlen_k;
    if (kHasRight) keys = min(keys, max(last_row + offset + right + 1, 0));
    return (keys + kBlockN - 1) / kBlockN;
  }

  // The backward's question, transposed: the query tiles [begin, end) whose rows see some key
  // of first_key..last_key; empty when end <= begin.
  __device__ int m_block_begin(int first_key) const {
    if (!kHasRight) return 0;
    const int first_row = first_key - offset - right;
    return first_row > 0 ? first_row / kBlockM : 0;
  }
  __device__ int m_block_end(int last_key, int seqlen_q) const {
    int rows = seqlen_q;
    if (kHasLeft) rows = min(rows, max(last_key - offset + left + 1, 0));
    return (rows + kBlockM - 1) / kBlockM;
  }

  // True when some element of key tile n_block is invisible to some row of first_row..last_row
  // (by default the query tile starting at first_row): it crosses either window edge, or runs
  // past the last key.
  __device__ bool is_edge_tile(int first_row, int last_row, int n_block) const {
    const int first_key = n_block * kBlockN;
    const int last_key = first_key + kBlockN - 1;
    const bool crosses_right = kHasRight && last_key > first_row + offset + right;
    const bool crosses_left = kHasLeft && first_key < last_row + offset - left;
    const bool past_keys = kPadSeqlen && last_key >= seqlen_k;
    return crosses_right || crosses_left || past_keys;
  }
  __device__ bool is_edge_tile(int first_row, int n_block) const {
    return is_edge_tile(first_row, first_row + kBlockM - 1, n_block);
  }

  // Row `row` sees the keys [first_visible_key(row), last_visible_key(row)]; the first bound
  // exists only with kHasLeft, the last only with kHasRight or kPadSeqlen.
  __device__ int first_visible_key(int row) const { return row + offset - left; }
  __device__ int last_visible_key(int row) const {
    const int last = row + offset + right;
    return kPadSeqlen && (!kHasRight || seqlen_k - 1 < last) ? seqlen_k - 1 : last;
  }

  __device__ bool is_visible(int row, int col) const {
    return (!(kPadSeqlen || kHasRight) || col <= last_visible_key(row)) &&
           (!kHasLeft || col >= first_visible_key(row));
  }
};

}  // namespace fmha
