// K and V read from a KV cache by TMA, for the fa3 forward's kernel as chunked prefill runs it
// (kvcache_chunked_prefill_sm90.cuh): a paged cache (vLLM's layout, pages reached through a block
// table) or a contiguous one, which is the same thing with one page per sequence. CachedKvLoad
// is the forward producer's load policy for it (fwd_fa3_producer_sm90.cuh says what one is).
//
// A key tile of kBlockN keys may span several pages, so it is loaded in boxes of box_rows keys by
// every column, box_rows = gcd(page_size, kBlockN): each box lies in one page. A stage keeps each
// 8-row group's 64-column blocks side by side ([8-row group][column block][8 rows][64 columns],
// 128-byte swizzle: chunked_prefill::Config's layouts), which is the order a box writes when its
// map's first dimensions are 64 columns, 8 rows, column blocks and row groups. So one box carries
// every column of its rows: at pages of 16 keys a d128 tile of 128 keys is 8 boxes, where boxes of
// 64 columns took 16 and left chunked prefill at 0.69-0.89x of the contiguous cache (H100, perf
// notes v15). A box starts on an 8-row group, a 1024-byte swizzle period, so the wgmma descriptors
// read it unchanged.
//
// Keys past a sequence's pages come from a page index past the cache, which TMA zero-fills,
// and the full box still counts towards the stage's transaction bytes, so the pipeline's byte
// count never depends on the cache's lengths.
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <numeric>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/cuda_host_adapter.hpp>

#include "fmha/kernels/fwd_fa3_config_sm90.cuh"
#include "fmha/kernels/fwd_fa3_scheduler_sm90.cuh"
#include "fmha/kernels/sm90_primitives.cuh"

namespace fmha::fa3 {

// A map has five dimensions: 64 columns and 8 rows first, then column blocks and row groups
// (what a stage's order needs), and the heads and pages fold into those or the last one, as
// the cache's strides allow.
enum class CacheFold : int32_t {
  // (64, 8, heads x column blocks, rows / 8, pages): a row's heads adjacent (head stride = head
  // dim), as vLLM's and FlashAttention's (pages, rows, heads, d).
  kHeadsInColumns,
  // (64, 8, column blocks, rows / 8, pages x heads): a page's heads one after another (page
  // stride = heads x head stride), as a (pages, heads, rows, d) cache.
  kHeadsInPages,
  // (64, rows, column blocks, heads, pages) in boxes of 8 rows: any other strides, and
  // contiguous caches whose length is not a multiple of 8.
  kEightRowBoxes,
};

struct CacheMap {
  CUtensorMap tma;
  CacheFold fold;
};

// One cache tensor (k or v) as its map sees it, strides in elements; a contiguous cache's
// pages are its rows.
struct CacheTensor {
  const void* data;
  int hdim;
  int64_t row_stride;
  int64_t head_stride;
  int64_t page_stride;
};

// One TMA box of a key tile: its destination in a stage and its map coordinates (the first,
// the 64 columns, is always 0).
struct CacheBox {
  void* smem;  // null: the lane has no box in this tile
  int rows, columns, groups, outer;
};

struct CachedKv {
  CacheMap k;
  CacheMap v;
  const int32_t* block_table;      // paged: device (batch, pages_per_seq)
  const int32_t* cache_batch_idx;  // contiguous, optional: the cache row of each sequence
  int64_t block_table_batch_stride;
  int page_size;      // keys a page holds; contiguous: the cache's seqlen (one page a sequence)
  int page_shift;     // log2(page_size) for pages of a power of 2 keys, else -1
  int pages_per_seq;  // block_table's columns; 1 when contiguous
  int heads;          // K/V heads
  int box_rows;       // keys per TMA box, a multiple of 8 (cache_box_rows)
  int boxes_per_tile;  // kBlockN / box_rows, the lanes that issue a tile's boxes
  int absent_page;    // a page index past the cache's, for keys past a sequence's pages

  // The page and the row in it of key `key` of sequence `batch`. The producer warp runs this
  // for every box, beside two consumer warps on its SM sub-partition: an integer division is
  // a ~20-instruction subroutine, so pages of a power of 2 keys shift, and a contiguous cache
  // (one page a sequence) compares.
  template <bool kPaged>
  __device__ __forceinline__ int2 locate(int batch, int key) const {
    int index;
    if constexpr (kPaged) {
      index = page_shift >= 0 ? key >> page_shift : key / page_size;
    } else {
      index = key < page_size ? 0 : 1;
    }
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
  // every lane of the warp calls it, a tile ahead of its box's copy.
  template <bool kPaged>
  __device__ __forceinline__ int2 box_source(int batch, int key0, int lane) const {
    return lane < boxes_per_tile ? locate<kPaged>(batch, key0 + lane * box_rows)
                                 : make_int2(0, 0);
  }

  // Lane `lane`'s box of a key tile from `source`, into the stage at `stage` (its rows in
  // 8-row groups of every column, one group after another), made before the stage is free
  // (CachedKvLoad). Each box is issued by its own lane: issued by one lane in
  // turn, the 8 boxes of a 128-key tile of 16-key pages left the producer behind the consumers
  // (d128 chunked prefill at 0.48-0.55x of the contiguous cache, H100).
  template <int kHeadDim, typename Element>
  __device__ __forceinline__ CacheBox box(const CacheMap& map, Element* stage, int2 source,
                                          int head, int lane) const {
    CacheBox b;
    b.smem = lane < boxes_per_tile ? stage + lane * box_rows * kHeadDim : nullptr;
    const int page = source.x;
    const int row = source.y;  // >= 0
    b.rows = 0;             // the 8-row dimension, or the page's rows
    b.columns = 0;          // the column blocks (with the heads)
    b.groups = row >> 3;    // the row groups, or the heads
    b.outer = page;         // the pages (with the heads)
    switch (map.fold) {
      case CacheFold::kHeadsInColumns:
        b.columns = head * (kHeadDim / 64);
        break;
      case CacheFold::kHeadsInPages:
        b.outer = page * heads + head;
        break;
      case CacheFold::kEightRowBoxes:
        b.rows = row;
        b.groups = head;
        break;
    }
    return b;
  }

  // The box's copy, completing on `barrier` (a lane without a box copies nothing).
  __device__ __forceinline__ static void copy(const CacheMap& map, uint64_t& barrier,
                                              const CacheBox& b) {
    if (b.smem == nullptr) return;
    cute::SM90_TMA_LOAD_5D::copy(
        &map.tma, &barrier, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
        b.smem, 0, b.rows, b.columns, b.groups, b.outer);
  }
};

// Where a key tile's boxes land: the consumers' K and V stages, or an e4m3 cache's staging
// stages, which the widening warps turn into those (fwd_fa3_kv_widen_sm90.cuh).
template <class Cfg>
__device__ __forceinline__ auto k_landing_stages(typename Cfg::SharedStorage& shared) {
  if constexpr (Cfg::kWidenKv) {
    return cute::make_tensor(cute::make_smem_ptr(shared.k_staged.data()),
                             typename Cfg::StagedLayoutK{});
  } else {
    return k_stages<Cfg>(shared);
  }
}
template <class Cfg>
__device__ __forceinline__ auto v_landing_stages(typename Cfg::SharedStorage& shared) {
  if constexpr (Cfg::kWidenKv) {
    return cute::make_tensor(cute::make_smem_ptr(shared.v_staged.data()),
                             typename Cfg::StagedLayoutV{});
  } else {
    return v_stages<Cfg>(shared);
  }
}

// The forward producer's load policy for a KV cache (fwd_fa3_producer_sm90.cuh): the config's
// KernelParams carry the CachedKv as `cache`, and its K/V stages are laid out as the boxes
// write them (KvStageLayouts<true>, kvcache_chunked_prefill_sm90.cuh).
template <class Cfg>
class CachedKvLoad {
 public:
  using KernelParams = typename Cfg::KernelParams;
  using SharedStorage = typename Cfg::SharedStorage;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = cutlass::PipelineState<Cfg::kStages>;

  static __device__ __forceinline__ void prefetch_descriptors(const KernelParams& kp) {
    cute::prefetch_tma_descriptor(&kp.cache.k.tma);
    cute::prefetch_tma_descriptor(&kp.cache.v.tma);
  }

  __device__ __forceinline__ CachedKvLoad(const KernelParams& kp, SharedStorage& shared, int lane)
      : kp_(kp), shared_(shared), lane_(lane) {}

  // A tile's boxes, each from its page. Their table entries are read one K load ahead, so the
  // read overlaps the previous tile's wait and copies, and kept for the tile's V load, which
  // comes after the next tile's K. A box's coordinates and stage address are made before the
  // stage's wait, so that only the copies follow the consumers' release: made after it, d128
  // chunks on pages of 16 read 3-8% less (H100, perf notes v24), two stages leaving the
  // producer no slack for its arithmetic.
  class Tile {
   public:
    __device__ __forceinline__ Tile(CachedKvLoad& load, const WorkTile<Cfg>& work, int kv_head)
        : load_(load),
          batch_(work.tile.batch),
          kv_head_(kv_head),
          n_begin_(work.n_begin),
          next_k_(sources_of(work.n_end - 1)) {}

    __device__ void load_k(Pipeline& pipe, PipelineState& state, int n_block) {
      const int2 source = next_k_;
      if (n_block > n_begin_) next_k_ = sources_of(n_block - 1);
      (n_block % 2 == 0 ? load_.v_even_ : load_.v_odd_) = source;
      issue<Cfg::kHeadDimQK>(pipe, state, load_.kp_.cache.k, k_landing_stages<Cfg>(load_.shared_),
                             source);
    }
    __device__ void load_v(Pipeline& pipe, PipelineState& state, int n_block) {
      issue<Cfg::kHeadDimV>(pipe, state, load_.kp_.cache.v, v_landing_stages<Cfg>(load_.shared_),
                            n_block % 2 == 0 ? load_.v_even_ : load_.v_odd_);
    }

   private:
    __device__ int2 sources_of(int n_block) const {
      return load_.kp_.cache.template box_source<Cfg::kPaged>(batch_, n_block * Cfg::kBlockN,
                                                           load_.lane_);
    }

    // A lane's box starts box_rows x lane rows into its stage (CachedKv::box): a stage
    // holds 8-row groups of every column one after another, and the 128-byte swizzle acts
    // on address bits inside a group's 1 KB blocks, which a group's start leaves alone.
    static_assert(cute::get_nonswizzle_portion(typename Cfg::SmemLayoutK{})(8, 0, 0) ==
                          8 * Cfg::kHeadDimQK &&
                  cute::get_nonswizzle_portion(typename Cfg::SmemLayoutV{})(8, 0, 0) ==
                          8 * Cfg::kHeadDimV);
    template <int kHeadDim, class Stages>
    __device__ void issue(Pipeline& pipe, PipelineState& state, const CacheMap& map,
                          Stages smem, int2 source) {
      const int stage = state.index();
      const CacheBox box = load_.kp_.cache.template box<kHeadDim>(
          map, cute::raw_pointer_cast(&smem(0, 0, stage)), source, kv_head_, load_.lane_);
      uint64_t* barrier = pipe.producer_get_barrier(state);
      pipe.producer_acquire(state);
      CachedKv::copy(map, *barrier, box);
      ++state;
    }

    CachedKvLoad& load_;
    int batch_;
    int kv_head_;
    int n_begin_;
    int2 next_k_;
  };

  __device__ __forceinline__ Tile tile(const WorkTile<Cfg>& work, int kv_head) {
    return Tile(*this, work, kv_head);
  }

  // Host: the cache's maps are its launcher's (kvcache_chunked_prefill_sm90.cuh).
  template <class MakeShape, class MakeStride, class MakeGmem>
  static void make_params(const FwdArgs&, int64_t, KernelParams&, MakeShape, MakeStride,
                          MakeGmem) {}

 private:
  const KernelParams& kp_;
  SharedStorage& shared_;
  int lane_;
  // The sources of the last two K tiles, by n_block's parity: the V load of a key tile reads
  // what its K load, a step earlier, looked up.
  int2 v_odd_, v_even_;
};

// The fold a cache's strides allow: `rows` keys a page.
inline CacheFold cache_fold(const CacheTensor& t, int rows, int heads, int pages) {
  if (rows % 8 == 0) {
    if (heads == 1 || t.head_stride == t.hdim) return CacheFold::kHeadsInColumns;
    if (pages == 1 || t.page_stride == heads * t.head_stride) return CacheFold::kHeadsInPages;
  }
  return CacheFold::kEightRowBoxes;
}

// Keys per box for pages of `page_size` keys (contiguous: 0) and kBlockN-key tiles; 0 where no
// box height serves (a page size that is not a multiple of 8).
template <int kBlockN>
int cache_box_rows(int page_size, CacheFold k_fold, CacheFold v_fold) {
  if (k_fold == CacheFold::kEightRowBoxes || v_fold == CacheFold::kEightRowBoxes) {
    return page_size % 8 == 0 ? 8 : 0;
  }
  if (page_size == 0) return kBlockN;
  const int rows = std::gcd(page_size, kBlockN);
  return rows % 8 == 0 ? rows : 0;
}

// The tensor map of one cache in `map->fold`: `rows` keys a page, boxes of box_rows keys by
// every column. false where the driver refuses it (a stride TMA cannot take). A 16-bit cache's
// boxes are the consumers' stages (128-byte swizzle); an e4m3 cache's land unswizzled in the
// staging stages (rows of 64 bytes: fwd_fa3_kv_widen_sm90.cuh).
template <typename Element>
bool encode_cache_map(CacheMap* map, const CacheTensor& t, int rows, int heads, int pages,
                      int box_rows) {
  constexpr bool kE4m3 = std::is_same_v<Element, __nv_fp8_e4m3>;
  static_assert(sizeof(Element) == 2 || kE4m3, "fa3 reads 16-bit and e4m3 caches");
  const CUtensorMapDataType type = kE4m3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : std::is_same_v<Element, cutlass::bfloat16_t>
                                       ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  auto bytes = [](int64_t stride) {
    return static_cast<cuuint64_t>(tma_stride<Element>(stride)) * sizeof(Element);
  };
  const cuuint64_t column_blocks = t.hdim / 64;
  const cuuint64_t row_bytes = bytes(t.row_stride);
  cuuint64_t dims[5] = {64, 8, column_blocks, static_cast<cuuint64_t>(rows / 8),
                        static_cast<cuuint64_t>(pages)};
  cuuint64_t strides[4] = {row_bytes, 64 * sizeof(Element), 8 * row_bytes, bytes(t.page_stride)};
  cuuint32_t box[5] = {64, 8, static_cast<cuuint32_t>(column_blocks),
                       static_cast<cuuint32_t>(box_rows / 8), 1};
  switch (map->fold) {
    case CacheFold::kHeadsInColumns:
      dims[2] *= heads;
      break;
    case CacheFold::kHeadsInPages:
      dims[4] *= heads;
      strides[3] = bytes(t.head_stride);
      break;
    case CacheFold::kEightRowBoxes:
      dims[1] = rows;
      dims[3] = heads;
      strides[2] = bytes(t.head_stride);
      box[3] = 1;
      break;
  }
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult result = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      &map->tma, type, 5, const_cast<void*>(t.data), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE,
      kE4m3 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

}  // namespace fmha::fa3
