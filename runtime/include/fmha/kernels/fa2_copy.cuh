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
  auto copy = [&](int row, int chunk, const typename Cfg::Element* src) {
    const bool valid = (!Cfg::kPadSeqlen || row < rows_valid) &&
                       (!Cfg::kPadHdim || chunk < chunks_valid);
    sm80::cp_async_16(smem_tile + Tile::offset(row, chunk), valid ? src : gmem, valid ? 16 : 0);
  };
  if constexpr (Cfg::kThreads % Tile::kChunks == 0) {
    // Thread t copies chunk t % kChunks of rows t / kChunks + i * kRowStep: one address computed
    // here, the rest an add each (this runs once per step of the backward's query loop).
    constexpr int kRowStep = Cfg::kThreads / Tile::kChunks;
    const int first_row = threadIdx.x / Tile::kChunks;
    const int chunk = threadIdx.x % Tile::kChunks;
    const auto* first_src = gmem + first_row * row_stride + chunk * 8;
    const int64_t src_step = kRowStep * row_stride;
#pragma unroll
    for (int i = 0; i < kTotalChunks / Cfg::kThreads; ++i) {
      copy(first_row + i * kRowStep, chunk, first_src + i * src_step);
    }
  } else {  // rows of 24 chunks (head dim 192): a thread's chunk changes from row to row
#pragma unroll
    for (int i = 0; i < kTotalChunks / Cfg::kThreads; ++i) {
      const int idx = threadIdx.x + i * Cfg::kThreads;
      const int row = idx / Tile::kChunks;
      const int chunk = idx % Tile::kChunks;
      copy(row, chunk, gmem + row * row_stride + chunk * 8);
    }
  }
}

}  // namespace fmha::fa2
