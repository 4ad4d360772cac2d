// FP8 quantization of q, k or v for the e4m3 forward (fa3gen.quantize_fp8): x (batch, seqlen,
// heads, head_dim) in bf16/fp16 -> e4m3 values (same shape, contiguous) and fp32 descales, one
// per (batch, head, block of block_rows rows) or one for the tensor, the largest magnitude of
// each scope mapped to 448 (fa3gen.fp8.quantize is the PyTorch reference). Optionally the rows
// are first multiplied by diag(signs) H / sqrt(d), H the Sylvester-Hadamard matrix (incoherent
// processing; fa3gen.reference.hadamard_transform).
// One CTA per (block, head, batch); a warp owns whole rows, each lane head_dim / 32
// consecutive elements (vector loads), so the Hadamard butterflies are in-thread for the lowest
// strides and warp shuffles for the rest. Memory-bound: blocks that fit the registers of 8 warps
// are read once (quantize_blocks_resident); larger blocks and per-tensor scales are read twice
// (the amax, then the values; a block's second read hits L2), and written once in 8 bits.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cstdint>
#include "fa3gen_abi.h"
#include "launch_common.cuh"
#include "simt_common.cuh"

namespace fa3gen {
namespace quantize {

using namespace simt;

constexpr int kWarps = 4;
constexpr int kTensorRows = 128;  // rows per CTA for a per-tensor scale
constexpr float kInvE4m3Max = float(1.0 / 448.0);  // as fa3gen.fp8.INV_E4M3_MAX

// Incoherent processing of one row held by a warp (E = HeadDim / 32 consecutive elements per
// lane): times diag(signs), then the Sylvester-Hadamard matrix, then 1/sqrt(d).
template <int HeadDim>
__device__ __forceinline__ void transform_row(float (&v)[HeadDim / 32], int lane, const float* signs) {
  constexpr int E = HeadDim / 32;
  #pragma unroll
  for (int i = 0; i < E; ++i) v[i] *= signs[lane * E + i];
  // Element e = lane * E + i. Strides below E pair elements inside the thread ...
  #pragma unroll
  for (int h = 1; h < E; h *= 2) {
    #pragma unroll
    for (int i = 0; i < E; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
  // ... the others pair lane with lane ^ (h / E), same i: the lower index keeps a + b.
  #pragma unroll
  for (int m = 1; m < 32; m *= 2) {
    const bool upper = lane & m;
    #pragma unroll
    for (int i = 0; i < E; ++i) {
      const float other = __shfl_xor_sync(0xffffffff, v[i], m);
      v[i] = upper ? other - v[i] : v[i] + other;
    }
  }
  // Times 1/sqrt(d) rounded to float (as reference.hadamard_transform: bit for bit).
  constexpr float kInvSqrtD = HeadDim == 64 ? 0.125f : HeadDim == 128 ? float(0.08838834764831845) : 0.0625f;
  #pragma unroll
  for (int i = 0; i < E; ++i) v[i] = __fmul_rn(v[i], kInvSqrtD);
}

// The E = HeadDim / 32 elements of a row that this lane owns, transformed when signs != null.
template <class T, int HeadDim>
__device__ __forceinline__ void load_row(const T* x, int64_t row_offset, int lane, const float* signs,
                                         float (&v)[HeadDim / 32]) {
  load_floats<T, HeadDim / 32>(x + row_offset + lane * (HeadDim / 32), v);
  if (signs != nullptr) transform_row<HeadDim>(v, lane, signs);
}

// The largest of every thread's amax in a CTA of Warps warps (all threads get it).
template <int Warps>
__device__ __forceinline__ float cta_max(float amax) {
  __shared__ float warp_amax[Warps];
  const int warp = threadIdx.x / 32;
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[warp] = amax;
  __syncthreads();
  amax = warp_amax[0];
  #pragma unroll
  for (int w = 1; w < Warps; ++w) amax = fmaxf(amax, warp_amax[w]);
  return amax;
}

// A lane's E values divided by descale (as fa3gen.fp8.quantize: x / scale, rounded to nearest
// even, saturated at 448), stored as E e4m3 bytes at dst in one access.
template <int E>
__device__ __forceinline__ void store_e4m3(uint8_t* dst, const float (&v)[E], float descale) {
  Vec<E> packed;
  uint8_t* bytes = reinterpret_cast<uint8_t*>(&packed);
  #pragma unroll
  for (int i = 0; i < E; ++i) {
    bytes[i] = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], descale), __NV_SATFINITE, __NV_E4M3);
  }
  *reinterpret_cast<Vec<E>*>(dst) = packed;
}

// Largest magnitude of the CTA's rows (after the transform).
template <class T, int HeadDim>
__device__ float block_amax(const fa3gen_quantize_params& p, int row0, int rows, int head, int b) {
  const T* x = static_cast<const T*>(p.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float amax = 0.f;
  for (int r = warp; r < rows; r += kWarps) {
    float v[HeadDim / 32];
    load_row<T, HeadDim>(x, int64_t(b) * p.x_batch_stride + int64_t(row0 + r) * p.x_row_stride + head * p.x_head_stride,
                         lane, p.signs, v);
    #pragma unroll
    for (int i = 0; i < HeadDim / 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
  }
  return cta_max<kWarps>(amax);
}

// The CTA's rows as e4m3 (store_e4m3) in the contiguous (batch, seqlen, heads, head_dim) out.
template <class T, int HeadDim>
__device__ void write_block(const fa3gen_quantize_params& p, int row0, int rows, int head, int b, float descale) {
  constexpr int E = HeadDim / 32;
  const T* x = static_cast<const T*>(p.x);
  uint8_t* out = static_cast<uint8_t*>(p.out);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows; r += kWarps) {
    float v[E];
    load_row<T, HeadDim>(x, int64_t(b) * p.x_batch_stride + int64_t(row0 + r) * p.x_row_stride + head * p.x_head_stride,
                         lane, p.signs, v);
    store_e4m3<E>(out + ((int64_t(b) * p.seqlen + row0 + r) * p.heads + head) * HeadDim + lane * E, v,
                  descale);
  }
}

__device__ __forceinline__ float descale_of(float amax) {
  return amax > 0.f ? __fmul_rn(amax, kInvE4m3Max) : 1.f;  // as fp8.quantize, bit for bit
}

// Block scales: amax, descale, then the values, in one pass over the CTA's block.
template <class T, int HeadDim>
__global__ void __launch_bounds__(kWarps * 32) quantize_blocks(const fa3gen_quantize_params p) {
  const int blk = blockIdx.x, head = blockIdx.y, b = blockIdx.z;
  const int row0 = blk * p.block_rows, rows = min(p.block_rows, p.seqlen - row0);
  const float descale = descale_of(block_amax<T, HeadDim>(p, row0, rows, head, b));
  if (threadIdx.x == 0) p.descale[(int64_t(b) * p.heads + head) * gridDim.x + blk] = descale;
  write_block<T, HeadDim>(p, row0, rows, head, b, descale);
}

// Block scales with the block held in registers: one read of the input. 8 warps (two CTAs fit
// an SM, so one loads while the other converts); a lane holds up to 64 values (R rows of E), so
// blocks of up to 8 R rows (d64: 256, d128: 128, d256: 64).
constexpr int kResidentWarps = 8;
template <int HeadDim>
struct Resident {
  static constexpr int E = HeadDim / 32, R = 64 / E, kMaxRows = kResidentWarps * R;
};

template <class T, int HeadDim>
__global__ void __launch_bounds__(kResidentWarps * 32, 2) quantize_blocks_resident(const fa3gen_quantize_params p) {
  constexpr int E = Resident<HeadDim>::E, R = Resident<HeadDim>::R;
  const int blk = blockIdx.x, head = blockIdx.y, b = blockIdx.z;
  const int row0 = blk * p.block_rows, rows = min(p.block_rows, p.seqlen - row0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* x = static_cast<const T*>(p.x) + int64_t(b) * p.x_batch_stride + int64_t(head) * p.x_head_stride +
               lane * E;
  // Every load issued before any is used (rows warp, warp + kResidentWarps, ...).
  Vec<E * int(sizeof(T))> raw[R];
  #pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = warp + i * kResidentWarps;
    if (r < rows) raw[i] = *reinterpret_cast<const Vec<E * int(sizeof(T))>*>(x + int64_t(row0 + r) * p.x_row_stride);
  }
  float v[R][E];
  float amax = 0.f;
  #pragma unroll
  for (int i = 0; i < R; ++i) {
    if (warp + i * kResidentWarps >= rows) continue;  // warp-uniform: the shuffles stay converged
    const T* elems = reinterpret_cast<const T*>(&raw[i]);
    #pragma unroll
    for (int e = 0; e < E; ++e) v[i][e] = to_float(elems[e]);
    if (p.signs != nullptr) transform_row<HeadDim>(v[i], lane, p.signs);
    #pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(v[i][e]));
  }
  const float descale = descale_of(cta_max<kResidentWarps>(amax));
  if (threadIdx.x == 0) p.descale[(int64_t(b) * p.heads + head) * gridDim.x + blk] = descale;
  uint8_t* out = static_cast<uint8_t*>(p.out) + ((int64_t(b) * p.seqlen + row0) * p.heads + head) * HeadDim + lane * E;
  #pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = warp + i * kResidentWarps;
    if (r < rows) store_e4m3<E>(out + int64_t(r) * p.heads * HeadDim, v[i], descale);
  }
}

// One scale for the tensor: every CTA's amax into *amax (non-negative floats order like their
// bits as ints, so an integer atomicMax serves), then a second launch writes the values.
template <class T, int HeadDim>
__global__ void __launch_bounds__(kWarps * 32) tensor_amax(const fa3gen_quantize_params p) {
  const int row0 = blockIdx.x * kTensorRows, rows = min(kTensorRows, p.seqlen - row0);
  const float amax = block_amax<T, HeadDim>(p, row0, rows, blockIdx.y, blockIdx.z);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(p.amax_workspace), __float_as_int(amax));
}

template <class T, int HeadDim>
__global__ void __launch_bounds__(kWarps * 32) tensor_write(const fa3gen_quantize_params p) {
  const int row0 = blockIdx.x * kTensorRows, rows = min(kTensorRows, p.seqlen - row0);
  const float descale = descale_of(*p.amax_workspace);
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) *p.descale = descale;
  write_block<T, HeadDim>(p, row0, rows, blockIdx.y, blockIdx.z, descale);
}

template <class T, int HeadDim>
int launch(const fa3gen_quantize_params& p, cudaStream_t stream) {
  const int rows = p.block_rows > 0 ? p.block_rows : kTensorRows;
  const dim3 grid((p.seqlen + rows - 1) / rows, p.heads, p.batch);
  if (p.block_rows > 0 && p.block_rows <= Resident<HeadDim>::kMaxRows) {
    quantize_blocks_resident<T, HeadDim><<<grid, kResidentWarps * 32, 0, stream>>>(p);
  } else if (p.block_rows > 0) {
    quantize_blocks<T, HeadDim><<<grid, kWarps * 32, 0, stream>>>(p);
  } else {
    cudaError_t err = cudaMemsetAsync(p.amax_workspace, 0, sizeof(float), stream);
    if (err != cudaSuccess) return report("cudaMemsetAsync", err);
    tensor_amax<T, HeadDim><<<grid, kWarps * 32, 0, stream>>>(p);
    tensor_write<T, HeadDim><<<grid, kWarps * 32, 0, stream>>>(p);
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : report("quantize kernel launch", err);
}

}  // namespace quantize

// The C entry point's body: checks, then the instantiation for the dtype and head dim.
inline int launch_quantize_fp8(const fa3gen_quantize_params& p, cudaStream_t stream) {
  if (p.batch < 1 || p.seqlen < 1 || p.heads < 1 || p.batch > 65535 || p.heads > 65535 ||
      p.block_rows < 0 || p.block_rows > 1024 ||
      (p.block_rows == 0 && p.amax_workspace == nullptr)) {
    fa3gen_set_error("quantize_fp8: invalid sizes (1 <= batch, heads <= 65535, seqlen >= 1, "
                     "0 <= block_rows <= 1024) "
                     "or no amax workspace for a per-tensor scale");
    return 1;
  }
  const bool fp16 = p.x_fp16 != 0;
  switch (p.head_dim) {
    case 64: return fp16 ? quantize::launch<__half, 64>(p, stream) : quantize::launch<__nv_bfloat16, 64>(p, stream);
    case 128: return fp16 ? quantize::launch<__half, 128>(p, stream) : quantize::launch<__nv_bfloat16, 128>(p, stream);
    case 256: return fp16 ? quantize::launch<__half, 256>(p, stream) : quantize::launch<__nv_bfloat16, 256>(p, stream);
    default:
      fa3gen_set_error("quantize_fp8: head_dim must be 64, 128 or 256");
      return 1;
  }
}

}  // namespace fa3gen
