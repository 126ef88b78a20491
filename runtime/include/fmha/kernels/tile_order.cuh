// The order in which CTAs take their (query tile, head, sequence).
//
// Without a causal mask every query tile costs the same, and the natural grid order (query
// tiles of one head, then the next head) keeps the CTAs running at once on the same K/V, which
// stays in L2. Under a causal mask tile m costs m + 1 key steps, so that order leaves the
// longest tiles of the last heads running alone at the end. Causal grids therefore run heads in
// groups whose K/V fit comfortably in L2 and, inside a group, the longest query tiles of every
// head first: the last wave holds only short tiles, and a group's K/V is still read from L2.
#pragma once

#include <cstdint>

namespace fmha {

struct TileCoord {
  int m_block;
  int head;
  int batch;
};

// K/V bytes that a group of heads may keep in L2: 16 MB, well under A100's 40 MB and
// H100's 50 MB, leaving room for the Q and O streams and for the other SM partition's share.
constexpr int64_t kHeadGroupL2Bytes = 16ll << 20;

// (batch, head) pairs per group for K/V of `kv_bytes_per_head` each; at least one, at most
// batch_heads and INT32_MAX (batch * nhead_q reaches 65535^2, past int).
inline int heads_per_group(int64_t kv_bytes_per_head, int64_t batch_heads) {
  const int64_t fit = kv_bytes_per_head > 0 ? kHeadGroupL2Bytes / kv_bytes_per_head : batch_heads;
  const int64_t heads = fit < 1 ? 1 : fit < batch_heads ? fit : batch_heads;
  return static_cast<int>(heads < INT32_MAX ? heads : INT32_MAX);
}

// Decodes a 1-D grid of m_blocks * nhead * batch CTAs in the causal order described above.
__device__ __forceinline__ TileCoord longest_first_in_head_groups(int linear, int m_blocks,
                                                                  int nhead, int batch_heads,
                                                                  int group_heads) {
  const int group_size = group_heads * m_blocks;
  const int group = linear / group_size;
  const int within = linear - group * group_size;
  const int first_bh = group * group_heads;
  const int heads_here = min(group_heads, batch_heads - first_bh);  // the last group may be short
  const int bh = first_bh + within % heads_here;
  return {m_blocks - 1 - within / heads_here, bh % nhead, bh / nhead};
}

}  // namespace fmha
