// What the sm90a (fa3) kernels share: CuTe's element types, named barriers, one wgmma batch,
// the accumulator-to-A-operand conversion and TMA's stride rule. The forward
// (fwd_fa3_sm90.cuh) and the backward (bwd_fa3_sm90.cuh) compose these. Include it before any
// CuTe header: it sets how CuTe is configured.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// TMA needs every global stride to be a positive multiple of 16 bytes. The API passes 0 for
// the stride of a size-1 dimension (it is never stepped over), so any valid one stands in.
inline int64_t tma_stride(int64_t stride) { return stride > 0 ? stride : 8; }

}  // namespace fmha::fa3
