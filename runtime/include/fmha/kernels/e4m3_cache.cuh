// float8 e4m3 KV-cache elements as the decode kernel's 16-bit mma operands, and the appends'
// rounding into them (KvCacheDtype::kE4M3, fmha.h).
//
// Widening. An e4m3 byte (sign, 4 exponent bits of bias 7, 3 mantissa bits) becomes a bf16 or
// fp16 of the same bits moved into place: sign to bit 15, exponent and mantissa to the low
// exponent bits and the high mantissa bits. That is the exact value times a power of two that
// the kernel folds into scales it applies anyway (bf16: 2^-120, the bias difference 127 - 7;
// fp16: 2^-8, 15 - 7), subnormals included (e4m3's land on the wider type's subnormals, at the
// same factor). Three instructions a pair of elements: a PRMT that picks the two bytes and
// sign-extends each to 16 bits, a shift, a mask; cvt.rn.f16x2.e4m3x2 would take one for fp16
// but bf16 then needs four more (through fp32), and the product with 2^k needs a fifth. The
// e4m3fn NaN (S.1111.111) widens to a finite 480 * 2^-120 (bf16): a NaN in a cache is not a
// value the quantizing append writes from finite inputs.
//
// Which two bytes of a 32-bit word form a pair is the caller's choice of PRMT selector: a
// selector nibble picks a byte (0-3 from the word), and its bit 3 fills the result byte with
// that byte's sign, so (b, sign(b)) is b sign-extended.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace fmha::e4m3 {

// Selectors of byte pairs (lo, hi) of a word: bytes 0 and 1, 2 and 3, 0 and 2, 1 and 3.
constexpr uint32_t kBytes01 = 0x9180;
constexpr uint32_t kBytes23 = 0xB3A2;
constexpr uint32_t kBytes02 = 0xA280;
constexpr uint32_t kBytes13 = 0xB391;

template <typename Element>
struct Widen;

// kLog2Factor: the widened value is the e4m3 value times 2^kLog2Factor. The other operand of
// each product is scaled by a power of two as well where the products would otherwise leave
// fp32's normal range: bf16 keys of 2^-120 times their value meet queries times 2^64 (a query
// up to 2^64 in magnitude stays finite), and bf16 values meet probabilities times 2^64, which
// the exp2 of the softmax applies for free (its argument gains 64). fp16 needs neither.
template <>
struct Widen<__nv_bfloat16> {
  static constexpr int kLog2Factor = -120;
  static constexpr int kShift = 4;               // e4m3 bits 0-6 to bf16 bits 4-10
  static constexpr uint32_t kMask = 0x87f087f0;  // bits 4-10 and the sign, of each half
  static constexpr int kQueryLog2Scale = 64;
  static constexpr int kProbabilityLog2Scale = 64;
};

template <>
struct Widen<__half> {
  static constexpr int kLog2Factor = -8;
  static constexpr int kShift = 7;               // e4m3 bits 0-6 to fp16 bits 7-13
  static constexpr uint32_t kMask = 0xbf80bf80;  // bits 7-13 and the sign, of each half
  static constexpr int kQueryLog2Scale = 0;
  static constexpr int kProbabilityLog2Scale = 0;
};

// The two e4m3 elements of `word` that `selector` picks, as a 16-bit pair of Element (the first
// in the low half), each 2^Widen<Element>::kLog2Factor times its value.
template <typename Element, uint32_t kSelector>
__device__ __forceinline__ uint32_t widen_pair(uint32_t word) {
  uint32_t extended;
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(extended) : "r"(word), "n"(kSelector));
  return (extended << Widen<Element>::kShift) & Widen<Element>::kMask;
}

// A pair of query elements times 2^Widen<Element>::kQueryLog2Scale (exact: a power of two).
template <typename Element>
__device__ __forceinline__ uint32_t scale_query_pair(uint32_t pair) {
  if constexpr (Widen<Element>::kQueryLog2Scale == 0) {
    return pair;
  } else {
    static_assert(std::is_same_v<Element, __nv_bfloat16> && Widen<Element>::kQueryLog2Scale == 64);
    const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(&pair);
    const __nv_bfloat162 y = __hmul2(x, __nv_bfloat162(__ushort_as_bfloat16(0x5f80),
                                                       __ushort_as_bfloat16(0x5f80)));  // 2^64
    return *reinterpret_cast<const uint32_t*>(&y);
  }
}

// 2^n as a float, for |n| <= 126.
__host__ __device__ constexpr float exp2i(int n) {
  float x = 1.f;
  for (int i = 0; i < (n < 0 ? -n : n); ++i) x = n < 0 ? x * 0.5f : x * 2.f;
  return x;
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
