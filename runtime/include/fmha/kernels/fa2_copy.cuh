// Global -> shared copies of the fa2 pipelines (forward and backward): rows of 16-bit
// elements, 16 bytes per cp.async, into the swizzled tiles of smem_tile.cuh.
#pragma once

#include <cstdint>

#include "fmha/kernels/sm80_primitives.cuh"

namespace fmha::fa2 {

// All threads of the CTA copy kRows rows of a Tile (rows of tokens, columns of head dim), 16
// bytes at a time. Rows at or past `rows_valid` (padded sequences) and chunks at or past
// `chunks_valid` (padded head dims) are zero-filled: zero Q/K columns add nothing to QK^T,
// zero K rows are masked anyway, and zero V rows keep 0 * garbage from turning into NaN.
template <class Cfg, class Tile, int kRows>
__device__ __forceinline__ void load_rows(uint32_t smem_tile, const typename Cfg::Element* gmem,
                                          int64_t row_stride, int rows_valid, int chunks_valid) {
  constexpr int kTotalChunks = kRows * Tile::kChunks;
  static_assert(kTotalChunks % Cfg::kThreads == 0, "tile must split evenly over the CTA");
#pragma unroll
  for (int i = 0; i < kTotalChunks / Cfg::kThreads; ++i) {
    const int idx = threadIdx.x + i * Cfg::kThreads;
    const int row = idx / Tile::kChunks;
    const int chunk = idx % Tile::kChunks;
    const bool valid = (!Cfg::kPadSeqlen || row < rows_valid) &&
                       (!Cfg::kPadHdim || chunk < chunks_valid);
    const auto* src = valid ? gmem + row * row_stride + chunk * 8 : gmem;
    sm80::cp_async_16(smem_tile + Tile::offset(row, chunk), src, valid ? 16 : 0);
  }
}

}  // namespace fmha::fa2
