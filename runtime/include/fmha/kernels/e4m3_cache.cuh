// float8 e4m3 KV-cache elements as the decode kernel's fp16 mma operands, and the appends'
// rounding into them (KvCacheDtype::kE4M3, fmha.h).
//
// Widening. Every e4m3 value is an fp16 value (3 of fp16's 10 mantissa bits, 4 of its 5
// exponent bits, subnormals included), so a decode step against an e4m3 cache runs its
// products in fp16 whatever the queries' dtype, and the cache's elements convert exactly:
// on sm89 and newer one cvt.rn.f16x2.e4m3x2 a pair. A bf16 widening would cost three
// instructions a pair (PRMT, shift, mask: the bits moved into place), and the decode kernel's
// step is bound by instruction issue once its bytes halve: on an H200 (bf16 queries, d128, GQA
// 8:1) that widening read 1.34-1.63x the 16-bit cache's steps per second at batch 8-64 x
// 8k-128k keys, against the 2x the bytes allow. sm80 has no e4m3 conversion: there the bits are
// moved into place (an fp16 of 2^-8 times the value) and one HMUL2 by 256 restores it, which
// reads the e4m3 NaN code (S.1111.111) as 480, not NaN.
//
// Which two bytes of a 32-bit word form a pair is the caller's: K's pairs are bytes 0, 1 and
// 2, 3 of a word; V's are bytes 0, 2 and 1, 3 (a transposed ldmatrix interleaves two keys),
// which one PRMT turns into 0, 1 and 2, 3 for both of the word's pairs.
//
// bf16 queries become fp16 once per CTA, times 2^-shift where their largest magnitude would
// pass fp16's range (query_shift below); the logits' scale takes 2^shift back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace fmha::e4m3 {

// Bytes 0 and 2 of a word, then 1 and 3: V's two pairs as K's are laid out.
__device__ __forceinline__ uint32_t pair_interleaved_bytes(uint32_t word) {
  return __byte_perm(word, 0, 0x3120);
}

// The two e4m3 values in bytes 0, 1 (kHigh: 2, 3) of `word` as an fp16 pair, exactly.
template <bool kHigh>
__device__ __forceinline__ uint32_t widen_pair(uint32_t word) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t pair;
  const uint16_t bytes = static_cast<uint16_t>(kHigh ? word >> 16 : word);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(pair) : "h"(bytes));
  return pair;
#else
  // Each byte sign-extended to 16 bits (a PRMT selector nibble's bit 3), shifted so that
  // exponent and mantissa land in fp16's bits 7-13, the sign kept in bit 15: 2^-8 x the value.
  constexpr uint32_t kSelector = kHigh ? 0xB3A2 : 0x9180;
  uint32_t extended;
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(extended) : "r"(word), "n"(kSelector));
  const uint32_t scaled = (extended << 7) & 0xbf80bf80;
  const __half2 x = *reinterpret_cast<const __half2*>(&scaled);
  const __half2 y = __hmul2(x, __half2(__ushort_as_half(0x5c00), __ushort_as_half(0x5c00)));
  return *reinterpret_cast<const uint32_t*>(&y);  // 256 x: exact
#endif
}

// The power of two that brings queries of largest magnitude `amax` below 2^15, inside fp16's
// range: 0 for any query fp16 holds, so that most calls convert without rounding (bf16's 8
// significant bits fit fp16's 11 down to 2^-14; smaller elements round to fp16's subnormals,
// 2^-24 apart, far below what a logit resolves).
__device__ __forceinline__ int query_shift(float amax) {
  const int exponent = amax > 0.f && amax < INFINITY ? ilogbf(amax) : 0;
  return min(max(exponent - 14, 0), 100);
}

// Eight values divided by `scale` and rounded to nearest even, saturated to +-448 (what torch's
// (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn) stores): one 8-byte word.
__device__ __forceinline__ uint2 quantize8(const float (&x)[8], float scale) {
  uint32_t half[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const float2 pair = make_float2(__fdiv_rn(x[4 * w + e], scale),
                                      __fdiv_rn(x[4 * w + e + 1], scale));
      const __nv_fp8x2_storage_t bytes = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
      word |= static_cast<uint32_t>(bytes) << (8 * e);
    }
    half[w] = word;
  }
  return make_uint2(half[0], half[1]);
}

}  // namespace fmha::e4m3
