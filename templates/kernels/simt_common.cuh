// Small device helpers of the CuTe-free kernels (decode, fp8 quantizer): conversions, warp
// reductions, cp.async, one vector load of a lane's consecutive elements, and the mma.sync
// pieces (ldmatrix, m16n8k16, 16-bit pairs). No CuTe, so the translation units that include it
// compile in seconds.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

namespace fa3gen {
namespace simt {

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ void from_float(float x, __nv_bfloat16& y) { y = __float2bfloat16(x); }
__device__ __forceinline__ void from_float(float x, __half& y) { y = __float2half(x); }

// The unsigned type of Bytes bytes (2 to 16), for one vector access.
template <int Bytes> struct VecOf { using type = uint4; };
template <> struct VecOf<2> { using type = uint16_t; };
template <> struct VecOf<4> { using type = uint32_t; };
template <> struct VecOf<8> { using type = uint2; };
template <int Bytes>
using Vec = typename VecOf<Bytes>::type;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffff, x, m);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, m));
  return x;
}

// x / d for 0 <= x < 2^31 and a divisor 1 <= d < 2^31 fixed for the kernel, as a multiply and
// a shift (a division is about 20 instructions): m = ceil(2^(31 + s) / d), s = ceil(log2 d), so
// x m / 2^(31 + s) exceeds x / d by less than x / 2^(31 + s) < 2^-s <= 1 / d, too little to
// reach the next integer; m < 2^32.
// (Host code too, for tests/test_compile.py's check of every bound.)
struct FastDiv {
  uint32_t m;
  int shift;
  __host__ __device__ explicit FastDiv(int d) {
#ifdef __CUDA_ARCH__
    shift = 31 + (32 - __clz(d - 1));
#else
    shift = 31 + (d > 1 ? 32 - __builtin_clz(uint32_t(d - 1)) : 0);
#endif
    m = uint32_t(((uint64_t(1) << shift) + uint32_t(d) - 1) / uint32_t(d));
  }
  __host__ __device__ int div(int x) const { return int((uint64_t(uint32_t(x)) * m) >> shift); }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; zeros when !valid (src is then not read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// E consecutive 16-bit elements at src as floats, in one vector load (callers check that src
// is aligned to E * sizeof(T) bytes: the runtimes require 16-byte strides and bases).
template <class T, int E>
__device__ __forceinline__ void load_floats(const T* src, float (&out)[E]) {
  const Vec<E * int(sizeof(T))> raw = *reinterpret_cast<const Vec<E * int(sizeof(T))>*>(src);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < E; ++i) out[i] = to_float(elems[i]);
}

// The tensor-core pieces of the decode kernels and the quantizer's Hadamard transform.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// c += a b, one m16n8k16 tile: a 16x16 (row-major fragment), b 16x8 (column-major), fp32 c.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as one register of two 16-bit values, the first in the low half.
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// Two bf16 values (the first in the low half of `two`) as floats: a bf16 is a float's high half.
__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t two) {
  return make_float2(__uint_as_float(two << 16), __uint_as_float(two & 0xffff0000u));
}

}  // namespace simt
}  // namespace fa3gen
