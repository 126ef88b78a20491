// Thin wrappers over the sm80 instructions the FlashAttention-2 pipeline is built from:
// cp.async (global -> shared without registers), ldmatrix (shared -> mma fragments) and
// mma.sync m16n8k16 with fp32 accumulators. They run unchanged on sm90.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fmha::sm80 {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte asynchronous copy of which only the first `src_bytes` (0..16) are read from global
// memory; the rest of the 16 bytes is zero-filled. This is how rows and columns past the end
// of a sequence or head dim become zeros. `src` must be 16-byte aligned even when partial.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

// A 4-byte asynchronous copy (the .ca form: .cg takes 16-byte copies only).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `kPending` of the most recently committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// As ldmatrix_x4, each matrix transposed: turns row-major V (keys x d) into B fragments.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The inverse of ldmatrix_x4 (sm90 and newer): lanes 8i..8i+7 give the row addresses of
// matrix i, and r[i] holds this lane's pair of it (row lane / 4, columns 2 * (lane % 4)), the
// layout of an mma accumulator's rows rounded to 16 bits.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3));
}
#endif

// D = A * B + D for a 16x8x16 tile: A row-major 16x16, B column-major 16x8, fp32 accumulators.
template <typename Element>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 values rounded to one 32-bit register of two 16-bit values (low half first).
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename Element>
__device__ __forceinline__ float to_float(Element x);

template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}

template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// 2^x on the special-function unit; exp2(-inf) = 0, which the masked softmax relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) = 1 - 2 / (e^(2x) + 1) on ex2.approx and a fast reciprocal: an absolute error near
// 1e-7 (the final subtraction's rounding), which soft-capped logits (cap * tanh) need, in 6
// instructions where tanhf takes ~20 and tanh.approx.f32 is off by up to 5e-4 relative, 0.015
// in a logit at cap 30. |x| > 15 is clamped: tanh(15) rounds to 1 and e^30 stays finite. The
// comparisons pass NaN through (fminf/fmaxf would turn it into a bound, and a NaN input into a
// finite logit).
__device__ __forceinline__ float tanh_fast(float x) {
  const float clamped = x > 15.f ? 15.f : (x < -15.f ? -15.f : x);
  return 1.f - __fdividef(2.f, fast_exp2(clamped * 2.8853900817779268f) + 1.f);  // 2 * log2(e)
}

}  // namespace fmha::sm80
