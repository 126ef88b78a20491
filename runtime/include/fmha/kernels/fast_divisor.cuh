// Division by a divisor fixed for a whole launch, as a multiply-high, an add and a shift
// (Granlund and Montgomery, "Division by invariant integers using multiplication", 1994). A
// paged decode kernel maps every key it copies to its page and row (key / page_size, any page
// size >= 1); an integer division there is a ~20-instruction subroutine per copied row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fmha {

struct FastDivisor {
  int divisor = 1;
  uint32_t multiplier = 1;  // 2^32 * (2^shift - divisor) / divisor + 1, so that 1 gives n
  int shift = 0;            // ceil(log2(divisor))

  FastDivisor() = default;
  explicit FastDivisor(int d) : divisor(d) {
    while ((int64_t{1} << shift) < d) ++shift;
    const uint64_t excess = (uint64_t{1} << shift) - static_cast<uint64_t>(d);
    multiplier = static_cast<uint32_t>((excess << 32) / static_cast<uint64_t>(d) + 1);
  }

  // n / divisor for 0 <= n < 2^31 (the sum below stays under 2^32).
  __device__ __forceinline__ int quotient(int n) const {
    const uint32_t high = __umulhi(static_cast<uint32_t>(n), multiplier);
    return static_cast<int>((high + static_cast<uint32_t>(n)) >> shift);
  }
};

}  // namespace fmha
