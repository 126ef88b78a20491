// K and V read from a KV cache by TMA, for the fa3 forward's chunked-prefill instances
// (kvcache_fa3_sm90.cuh): a paged cache (vLLM's layout, pages reached through a block table) or
// a contiguous one, which is the same thing with one page per sequence.
//
// A key tile of kBlockN keys may span several pages, so it is loaded in boxes of box_rows keys
// by 64 columns (one 128-byte swizzle atom wide), box_rows = gcd(page_size, kBlockN): each box
// lies in one page, and at pages of 16 keys a 128-key tile of d128 is 16 boxes a tile where the
// forward's K takes 2. The boxes land where the forward's whole-tile boxes would put those
// rows: the shared-memory layout of a stage is 64-column blocks of kBlockN rows each, and a box
// of box_rows (a multiple of 8) rows starts on a 1024-byte swizzle period, so the wgmma
// descriptors read it unchanged. Keys past a sequence's pages come from a page index past the
// cache, which TMA zero-fills, and the full box still counts towards the stage's transaction
// bytes, so the pipeline's byte count never depends on the cache's lengths.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <numeric>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/cuda_host_adapter.hpp>

#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

struct CachedKv {
  // (hdim, rows, nhead_k, pages) with the head dim contiguous; boxes of 64 x box_rows.
  CUtensorMap k_map;
  CUtensorMap v_map;
  const int32_t* block_table;      // paged: device (batch, pages_per_seq)
  const int32_t* cache_batch_idx;  // contiguous, optional: the cache row of each sequence
  int64_t block_table_batch_stride;
  int page_size;      // keys a page holds; contiguous: the cache's seqlen (one page a sequence)
  int pages_per_seq;  // block_table's columns; 1 when contiguous
  int box_rows;       // keys per TMA box: gcd(page_size, kBlockN), a multiple of 8
  int absent_page;    // a page index past the cache's, for keys past a sequence's pages

  // The page and the row in it of key `key` of sequence `batch`.
  template <bool kPaged>
  __device__ __forceinline__ int2 locate(int batch, int key) const {
    const int index = key / page_size;
    int page = absent_page;
    if (index < pages_per_seq) {
      if constexpr (kPaged) {
        page = block_table[batch * block_table_batch_stride + index];
      } else {
        page = cache_batch_idx != nullptr ? cache_batch_idx[batch] : batch;
      }
    }
    return make_int2(page, key - index * page_size);
  }

  // Where box `lane` of the key tile starting at `key0` comes from (one table read per box);
  // every lane of the warp calls it, a tile ahead of `load`ing its own box.
  template <bool kPaged, int kBlockN>
  __device__ __forceinline__ int2 box_source(int batch, int key0, int lane) const {
    return lane < kBlockN / box_rows ? locate<kPaged>(batch, key0 + lane * box_rows)
                                     : make_int2(0, 0);
  }

  // Lane `lane`'s box of the key tile into one stage (`stage(row, col)`: its element's
  // address), completing on `barrier`. Each box is issued by its own lane: issued by one lane
  // in turn, the 8 boxes of a 128-key tile of 16-key pages left the producer behind the
  // consumers (d128 chunked prefill at 0.48-0.55x of the contiguous cache, H100).
  template <int kBlockN, int kHeadDim, class StageAddress>
  __device__ __forceinline__ void load(const CUtensorMap& map, uint64_t& barrier,
                                       StageAddress stage, int2 source, int head,
                                       int lane) const {
    if (lane >= kBlockN / box_rows) return;
#pragma unroll
    for (int col = 0; col < kHeadDim; col += 64) {
      cute::SM90_TMA_LOAD_4D::copy(
          &map, &barrier, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
          stage(lane * box_rows, col), col, source.y, head, source.x);
    }
  }
};

// The tensor map of one cache (k or v): `rows` keys a page, strides in elements. false where
// the driver refuses it (a stride TMA cannot take).
template <typename Element>
bool encode_cache_map(CUtensorMap* map, const void* cache, int hdim, int rows, int heads,
                      int pages, int64_t row_stride, int64_t head_stride, int64_t page_stride,
                      int box_rows) {
  static_assert(sizeof(Element) == 2, "fa3 reads 16-bit caches");
  const CUtensorMapDataType type = std::is_same_v<Element, cutlass::bfloat16_t>
                                       ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(hdim), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(pages)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(tma_stride(row_stride)) * 2,
                                 static_cast<cuuint64_t>(tma_stride(head_stride)) * 2,
                                 static_cast<cuuint64_t>(tma_stride(page_stride)) * 2};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult result = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      map, type, 4, const_cast<void*>(cache), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

// Keys per box for a cache of `page_size`-key pages (contiguous: 0) and kBlockN-key tiles; 0
// where no box height serves (a page size that is not a multiple of 8).
template <int kBlockN>
int cache_box_rows(int page_size) {
  if (page_size == 0) return kBlockN;
  const int rows = std::gcd(page_size, kBlockN);
  return rows % 8 == 0 ? rows : 0;
}

}  // namespace fmha::fa3
