// The dropout pattern: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC'11), the counter-based generator cuRAND and PyTorch use, keyed so that the keep
// decision of one attention probability depends only on (seed, offset, batch, head, row, key).
// The forward kernel and fmha::dropout_mask() both call dropout_words(), so the pattern a test
// reads back is the one the kernel applied; tests/reference.py re-implements it in torch.
//
// One Philox call yields four 32-bit words, used for two rows and two keys: rows i and i + 8
// of a 16-row block and keys j and j + 1 (j even), the four probabilities one lane holds in an
// mma.sync m16n8 accumulator tile, so the fa2 kernel uses every word it draws (one call per
// four elements; half of each call went unused when the four words covered four keys of a row):
//   key     = (seed & 0xffffffff, seed >> 32)
//   counter = (key / 2, (row / 16) * 8 + row % 8, batch * nhead + head, offset)
//   word    = 2 * ((row / 8) % 2) + key % 2
// and a probability is kept when its word is >= threshold, where
// threshold = min(floor(dropout_p * 2^32), 2^32 - 1), so it survives with chance 1 - dropout_p
// (to 2^-32).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FMHA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FMHA_HOST_DEVICE inline
#endif

namespace fmha::philox {

struct Words {
  uint32_t w[4];
};

FMHA_HOST_DEVICE void mul_hi_lo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  *lo = a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
#endif
}

// Philox4x32 with 10 rounds and the standard multipliers and Weyl key increments.
FMHA_HOST_DEVICE Words philox4x32_10(uint32_t key0, uint32_t key1, uint32_t c0, uint32_t c1,
                                     uint32_t c2, uint32_t c3) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kMul0, c0, &hi0, &lo0);
    mul_hi_lo(kMul1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ key0, n1 = lo1, n2 = hi0 ^ c3 ^ key1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// The threshold a random word must reach for its probability to be kept.
FMHA_HOST_DEVICE uint32_t drop_threshold(float dropout_p) {
  const double scaled = static_cast<double>(dropout_p) * 4294967296.0;
  return scaled >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(scaled);
}

// The words of the call that covers (row, key), and those of its row + 8 and key + 1
// neighbours in the order of the comment at the top.
FMHA_HOST_DEVICE Words dropout_words(uint64_t seed, uint32_t offset, uint32_t batch_head,
                                     uint32_t row, uint32_t key) {
  return philox4x32_10(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), key / 2,
                       (row / 16) * 8 + row % 8, batch_head, offset);
}

// Which of dropout_words(..., row, key) decides (row, key).
FMHA_HOST_DEVICE int dropout_word(uint32_t row, uint32_t key) {
  return 2 * ((row / 8) % 2) + key % 2;
}

}  // namespace fmha::philox
