// fmha::dropout_mask(): the keep pattern of fwd()'s dropout, written out for tests and for
// reproducing a run. It calls the same Philox helpers as the kernels (fmha/kernels/philox.cuh),
// so the pattern read back is the one a forward call with the same (seed, offset, p) applied.
//
// Compiled for every target of the build (CMakeLists.txt), unlike an instance TU, which is
// compiled for its own.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "fmha/fmha.h"
#include "fmha/kernels/philox.cuh"

namespace fmha {
namespace {

// As fwd(): batches and heads ride gridDim.z and .y there, which also keeps batch * nhead + head
// within the 32-bit Philox counter word it occupies.
constexpr int kMaxBatchOrHeads = 65535;
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // a grid-stride loop covers the rest

// One thread per (batch, head, row, pair of keys): the Philox call that covers a key pair also
// covers the same keys 8 rows down, which another thread draws again; this is a test and
// reproduction utility, so the simple index map wins over saving those calls.
__global__ void dropout_mask_kernel(uint64_t seed, uint32_t offset, uint32_t threshold,
                                    int seqlen_q, int seqlen_k, int64_t pairs_per_row,
                                    int64_t total_pairs, uint8_t* keep) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < total_pairs;
       g += stride) {
    const int64_t row_index = g / pairs_per_row;  // over (batch, head, row)
    const auto key0 = static_cast<uint32_t>(g % pairs_per_row) * 2;
    const auto row = static_cast<uint32_t>(row_index % seqlen_q);
    const auto batch_head = static_cast<uint32_t>(row_index / seqlen_q);  // batch * nhead + head
    const philox::Words words = philox::dropout_words(seed, offset, batch_head, row, key0);
    uint8_t* out = keep + row_index * seqlen_k;
#pragma unroll
    for (uint32_t key = key0; key < key0 + 2; ++key) {
      if (key < static_cast<uint32_t>(seqlen_k)) {
        out[key] = words.w[philox::dropout_word(row, key)] >= threshold ? 1 : 0;
      }
    }
  }
}

Status invalid(const std::string& message) {
  return {Status::Code::kInvalidArgument, "fmha::dropout_mask: " + message};
}

}  // namespace

Status dropout_mask(uint64_t seed, uint32_t offset, float dropout_p, int batch, int nhead,
                    int seqlen_q, int seqlen_k, uint8_t* keep, Stream stream) {
  if (!(std::isfinite(dropout_p) && dropout_p >= 0.f && dropout_p < 1.f)) {
    return invalid("dropout_p must be in [0, 1)");
  }
  if (batch < 0 || nhead < 0 || seqlen_q < 0 || seqlen_k < 0) {
    return invalid("batch, nhead, seqlen_q and seqlen_k must be non-negative");
  }
  if (batch > kMaxBatchOrHeads || nhead > kMaxBatchOrHeads) {
    return invalid("batch and nhead must be at most 65535, as in fmha::fwd");
  }
  const int64_t pairs_per_row = (static_cast<int64_t>(seqlen_k) + 1) / 2;
  const int64_t total_pairs = static_cast<int64_t>(batch) * nhead * seqlen_q * pairs_per_row;
  if (total_pairs == 0) return Status::Ok();  // nothing to write, nothing launched
  if (keep == nullptr) return invalid("keep is a null pointer");

  const int64_t blocks = std::min((total_pairs + kThreads - 1) / kThreads, kMaxBlocks);
  dropout_mask_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      seed, offset, philox::drop_threshold(dropout_p), seqlen_q, seqlen_k, pairs_per_row,
      total_pairs, keep);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return {Status::Code::kCudaError, std::string("fmha::dropout_mask: launch failed: ") +
                                          cudaGetErrorName(err) + ": " + cudaGetErrorString(err)};
  }
  return Status::Ok();
}

}  // namespace fmha
