// Shared-memory tiles of 16-bit elements, laid out for conflict-free cp.async writes and
// ldmatrix reads.
//
// A tile is stored as column blocks (swizzle atoms), each holding its columns of every row,
// row after row. A row of 64 * 2^k columns is a single block; other widths are split into
// blocks of 64 columns, or of 32 where the width is not a multiple of 64 (d96: 3 x 32,
// d192: 3 x 64). Within a block row the 16-byte chunks are XOR-swizzled by the row:
//   rows of 128 bytes or more: chunk ^ (row % 8), so the 8 rows an ldmatrix reads at one
//     logical chunk land in 8 different 16-byte bank groups;
//   64-byte rows (32 columns): chunk ^ ((row / 2) % 4): two rows share a 128-byte line, so
//     rows 2r and 2r + 1 take its two halves and the XOR spreads 4 such pairs over the line.
// Whole-row atoms for d64/d128/d256 keep every address one base plus constants (blocks would
// cost d128 56 more bytes of register spills).
#pragma once

#include <cstdint>

namespace fmha {

template <int kRows, int kCols>
struct SmemTile {
  static_assert(kCols % 32 == 0, "tiles are made of swizzle atoms of 32 or 64 * 2^k columns");
  static constexpr bool kPowerOfTwoRow = kCols % 64 == 0 && ((kCols / 64) & (kCols / 64 - 1)) == 0;
  static constexpr int kAtomCols = kPowerOfTwoRow ? kCols : kCols % 64 == 0 ? 64 : 32;
  static constexpr int kAtomChunks = kAtomCols / 8;  // 16-byte chunks per row of a block
  static constexpr int kAtomRowBytes = kAtomCols * 2;
  static constexpr int kBlockBytes = kRows * kAtomRowBytes;
  static constexpr int kChunks = kCols / 8;
  static constexpr int kBytes = kRows * kCols * 2;

  __device__ static int swizzle(int row) {
    return kAtomChunks >= 8 ? (row & 7) : ((row >> 1) & 3);
  }

  __device__ static uint32_t offset(int row, int chunk) {
    return (chunk / kAtomChunks) * kBlockBytes + row * kAtomRowBytes +
           (((chunk % kAtomChunks) ^ swizzle(row)) << 4);
  }

  // offset(row + 16 * i, chunk + 2 * j) from base = offset(row, chunk), for chunk 0 or 1 (the
  // two halves of an ldmatrix x4 k-step): 16 rows keep the swizzle, an even chunk step inside
  // a block is an XOR of the chunk bits (they sit below the row bits) and whole blocks are an
  // add. In the unrolled loops
  // every ldmatrix address is one per-lane base plus compile-time terms.
  __device__ static uint32_t step(uint32_t base, int i, int j) {
    return (base ^ (((2 * j) % kAtomChunks) << 4)) + ((2 * j) / kAtomChunks) * kBlockBytes +
           i * 16 * kAtomRowBytes;
  }
};

}  // namespace fmha
