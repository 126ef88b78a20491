// What the sm90a (fa3) kernels share: CuTe's element types, named barriers, one wgmma batch,
// the accumulator-to-A-operand conversion and TMA's stride rule. The forward
// (fwd_fa3_sm90.cuh) and the backward (bwd_fa3_sm90.cuh) compose these. Include it before any
// CuTe header: it sets how CuTe is configured.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

// wgmma has every N that is a multiple of 8 up to 256, CuTe's op selectors only N = 8, 16, 32,
// 64, 96, 128, 192 and 256 unless CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED is defined before the
// first CuTe header; for any other N (the forward's 80- and 112-key tiles of d256 and d192)
// they fall back to a narrow atom (5-7x the instructions). The extended set is 150k lines of
// atom definitions, which cost a TU 60 s of nvcc's front ends (a fa3 forward TU: 113 s with
// it, 52 s without, one core), so only the TUs whose tiles need it define it: the generator
// decides per instance (generator/operations.py, Kernel.wgmma_n), and the configs'
// static_asserts on wgmma_n below catch a TU that lacks it.
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace fmha::fa3 {

template <typename T>
struct CuteElement;
template <>
struct CuteElement<__half> {
  using type = cutlass::half_t;
};
template <>
struct CuteElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CuteElement<__nv_fp8_e4m3> {
  using type = cutlass::float_e4m3_t;
};

// The 8-row swizzle atom of K-major rows of kCols elements as TMA writes them and wgmma reads
// them: the widest swizzle (128, 64 or 32 bytes) that the row's bytes are a multiple of.
template <class Element, int kCols>
using KMajorSwizzleAtom = std::conditional_t<
    kCols * sizeof(Element) % 128 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
    std::conditional_t<kCols * sizeof(Element) % 64 == 0, cute::GMMA::Layout_K_SW64_Atom<Element>,
                       cute::GMMA::Layout_K_SW32_Atom<Element>>>;

// The N of the wgmma atom CuTe selected for a tiled MMA: a config static_asserts that it is
// the whole of the GEMM's N it asked for.
template <class TiledMma>
inline constexpr int wgmma_n = decltype(cute::size<1>(typename TiledMma::AtomShape_MNK{}))::value;

// Named barriers: `threads` threads (a multiple of 32) of the CTA meet at barrier `id` (1-15;
// 0 is __syncthreads). arrive signals without waiting.
__device__ __forceinline__ void barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" : : "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" : : "r"(id), "r"(threads) : "memory");
}

// One wgmma batch over the k-blocks of its operands, committed as one group; kWait >= 0 waits
// until at most kWait groups are in flight. The operand fences keep the compiler from moving
// register reads and writes of the accumulators (and of A, when it is in registers) across the
// asynchronous GEMM.
template <bool kZeroInit, int kWait, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  using namespace cute;
  constexpr bool kARegisters =
      !cute::is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
}

// A wgmma accumulator ((2, 2, N / 8), 1, 1) rounded to 16 bits as the A operand of the next
// GEMM, whose K is the accumulator's N (the forward's O += P V, the backward's dV += P^T dO and
// dK += dS^T Q): ((2, 2, 2), 1, N / 16) holds the values in the accumulator's own order (value
// 4k..4k+3 of n8 block 2t and 2t+1 make k16 step t), so it is a plain copy.
template <class Element, class TensorS, class TensorP>
__device__ __forceinline__ void convert_p(const TensorS& s, TensorP& p) {
  constexpr int kValues = decltype(cute::size(s))::value;
  auto p32 = cute::recast<uint32_t>(p);
#pragma unroll
  for (int v = 0; v < kValues / 2; ++v) {
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(s(2 * v), s(2 * v + 1));
      p32(v) = reinterpret_cast<const uint32_t&>(pair);
    } else {
      const __half2 pair = __floats2half2_rn(s(2 * v), s(2 * v + 1));
      p32(v) = reinterpret_cast<const uint32_t&>(pair);
    }
  }
}

// An accumulator ((2, 2, N / 8), 1, 1) as the e4m3 A operand of a k32 wgmma,
// ((4, 2, 2), 1, N / 32), P times its static scale already. The layouts differ, unlike the
// 16-bit case: in each 32-key slice, quad thread t holds the pairs of keys 8b + 2t, 8b + 2t + 1
// (n8 block b = 0..3) of its rows r and r + 8, where the operand wants keys 4t..4t+3 and
// 16 + 4t..16 + 4t + 3 of both rows in its four registers (CuTe's ALayout_64x32): keys 4t..4t+3
// are the block-t/2 pairs of quad threads 2 (t % 2) and 2 (t % 2) + 1. Each thread packs
// word b = (its row-r pair, its row-(r+8) pair) of block b, and two quad shuffles per block
// pair (0, 1) and (2, 3) bring every thread the words it needs: in the first it reads from quad
// thread 2 (t % 2) + t / 2, which offers word s % 2 (s its own quad index), in the second from
// 2 (t % 2) + 1 - t / 2, which offers word 1 - s % 2. Per 32 keys: 8 conversions, 4 shuffles
// and 8 byte permutes for 16 values, against 16 exponentials.
template <class TensorS, class TensorP>
__device__ __forceinline__ void convert_p_e4m3(const TensorS& s, TensorP& p) {
  constexpr int kSlices = decltype(cute::size(s))::value / 16;
  auto p32 = cute::recast<uint32_t>(p);
  const int quad = threadIdx.x % 4;
  const int first_source = 2 * (quad % 2) + quad / 2;
  const int second_source = 2 * (quad % 2) + 1 - quad / 2;
  const bool offers_odd_first = quad % 2 == 1;
  // Bytes of (from quad thread 2 (t % 2), from 2 (t % 2) + 1): the first shuffle brought the
  // former when t / 2 == 0.
  const uint32_t row_r = quad / 2 == 0 ? 0x5410u : 0x1054u;
  const uint32_t row_r8 = quad / 2 == 0 ? 0x7632u : 0x3276u;
#pragma unroll
  for (int slice = 0; slice < kSlices; ++slice) {
    uint32_t word[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int v = 16 * slice + 4 * b;  // value (row half h, pair element e) is v + 2h + e
      asm("{\n\t.reg .b16 r, r8;\n\t"
          "cvt.rn.satfinite.e4m3x2.f32 r, %2, %1;\n\t"
          "cvt.rn.satfinite.e4m3x2.f32 r8, %4, %3;\n\t"
          "mov.b32 %0, {r, r8};\n\t}"
          : "=r"(word[b])
          : "f"(s(v)), "f"(s(v + 1)), "f"(s(v + 2)), "f"(s(v + 3)));
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t even = word[2 * half], odd = word[2 * half + 1];
      const uint32_t first =
          __shfl_sync(0xffffffff, offers_odd_first ? odd : even, first_source, 4);
      const uint32_t second =
          __shfl_sync(0xffffffff, offers_odd_first ? even : odd, second_source, 4);
      p32(4 * slice + 2 * half) = __byte_perm(first, second, row_r);
      p32(4 * slice + 2 * half + 1) = __byte_perm(first, second, row_r8);
    }
  }
}

// TMA needs every global stride to be a positive multiple of 16 bytes. The API passes 0 for
// the stride of a size-1 dimension (it is never stepped over), so any valid one stands in.
template <class Element = cutlass::half_t>
inline int64_t tma_stride(int64_t stride) {
  return stride > 0 ? stride : static_cast<int64_t>(16 / sizeof(Element));
}

}  // namespace fmha::fa3
