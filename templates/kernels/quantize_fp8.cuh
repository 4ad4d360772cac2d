// FP8 quantization of q, k or v for the e4m3 forward (fa3gen.quantize_fp8): x (batch, seqlen,
// heads, head_dim) in bf16/fp16 -> e4m3 values (same shape, contiguous) and fp32 descales, one
// per (batch, head, block of block_rows rows) or one for the tensor, the largest magnitude of
// each scope mapped to 448 (fa3gen.fp8.quantize is the PyTorch reference). Optionally the rows
// are first multiplied by diag(signs) H / sqrt(d), H the Sylvester-Hadamard matrix (incoherent
// processing; fa3gen.reference.hadamard_transform), after an optional rotary embedding.
// Memory-bound. Blocks of up to 32768 values (32768 / head_dim rows) are read once, through
// the shared-memory ring of quantize_blocks_staged (below); larger blocks and per-tensor scales
// are read twice by CTAs per (block, head, batch) whose warps own whole rows, each lane
// head_dim / 32 consecutive elements (the amax, then the values; a block's second read hits
// L2). Every value is written once, in 8 bits.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include "fa3gen_abi.h"
#include "launch_common.cuh"
#include "simt_common.cuh"

namespace fa3gen {
namespace quantize {

using namespace simt;

constexpr int kWarps = 4;
constexpr int kTensorRows = 128;  // rows per CTA for a per-tensor scale
constexpr float kInvE4m3Max = float(1.0 / 448.0);  // as fa3gen.fp8.INV_E4M3_MAX

// 1/sqrt(d) rounded to float (as reference.hadamard_transform: bit for bit).
template <int HeadDim>
constexpr float kInvSqrtD = HeadDim == 64 ? 0.125f : HeadDim == 128 ? float(0.08838834764831845) : 0.0625f;

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
  #pragma unroll
  for (int i = 0; i < E; ++i) v[i] = __fmul_rn(v[i], kInvSqrtD<HeadDim>);
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

// Block scales, one read of the input: a persistent CTA streams its blocks through a ring of
// Stages shared-memory stages (cp.async, so the next blocks load while this one converts) and
// holds a block in registers between its amax and its store. A row's 32 x T elements belong to
// T = HeadDim / 32 consecutive lanes, 32 each: lane t of a row owns its 16-byte chunks
// t, t + T, t + 2T, t + 3T (element e = 8 (t + T k) + i is value j = 8 k + i), so the Hadamard
// butterflies cross lanes for log2 T strides only (the rest are in-thread: T log2 T shuffle
// instructions a row, 8 at d128 against 20 with a lane per 4 elements), and rotary pairs are
// in-thread.
// 512 threads (one CTA an SM), or 256 for the rings of small and middle blocks: two CTAs an
// SM, so one CTA's barriers overlap the other's work (a 16 KB block fills one pass of 256).
// Stages: 3 of up to 64 KB (192 KB), 6 for blocks of at most 16 KB and 4 for blocks of 16-24 KB
// (d64 129-192 rows, d128 65-96; two passes where the rows exceed one), so that smaller blocks
// keep as many bytes in flight (96 KB a CTA). On 3 stages at 512 threads, d64's 160-row blocks
// kept 320 of the threads at work and 60 KB in flight an SM: 63% of copy, 69% on the 4-stage
// ring (docs/BENCHMARKS.md); a 5-stage ring for blocks of 16-20 KB measured 67% (2026-12-01).
constexpr int kStages = 3, kSmallStages = 6, kSmallStageBytes = 16384;
constexpr int kMidStages = 4, kMidStageBytes = 24576;
constexpr int staged_threads(int stages) {
  return stages == kSmallStages || stages == kMidStages ? 256 : 512;
}
template <int HeadDim, int Threads = 512>
struct Staged {
  static constexpr int T = HeadDim / 32;            // lanes per row
  static constexpr int kRowsPerPass = Threads / T;  // rows per 32 registers a thread
  static constexpr int kChunks = HeadDim / 8;       // 16-byte chunks of a 16-bit row
  static constexpr int kRowBytes = HeadDim * 2;
  // Bank swizzle of a row's chunks: the 8 lanes of one shared-memory phase (8 / T rows) read
  // 8 distinct 16-byte bank groups.
  __device__ static int swizzle(int row) { return (row % (8 / T)) * T; }
  // The tensor-core instances' layout instead (hadamard_mma_tile): a phase of ldmatrix reads
  // every other chunk of 128 bytes (the first or second halves of 8 segments), which a row's
  // swizzle leaves on 4 bank groups (2-way conflicts: 0.55M excess wavefronts at d128 on
  // 2048 blocks); flipping the chunk's low bit in every other 128 bytes of the stage spreads
  // them over 8.
  __device__ static int mma_swizzle(int row, int chunk) { return ((row * kChunks + chunk) >> 3) & 1; }
};

// The largest block the staged kernel takes: two passes of its rows (64 values a thread), the
// same number of values at every head dim (fa3gen/fp8.py's KERNEL_BLOCK_VALUES: a CPU test reads
// kStagedBlockValues here).
template <int HeadDim>
constexpr int staged_max_rows() { return 2 * Staged<HeadDim>::kRowsPerPass; }
constexpr int kStagedBlockValues = 32768;
// The most rows a stage of a ring holds.
template <int HeadDim, int Stages>
constexpr int staged_stage_rows() {
  return Stages == kSmallStages ? kSmallStageBytes / Staged<HeadDim>::kRowBytes
         : Stages == kMidStages ? kMidStageBytes / Staged<HeadDim>::kRowBytes
                                : staged_max_rows<HeadDim>();
}
static_assert(staged_max_rows<64>() * 64 == kStagedBlockValues && staged_max_rows<128>() * 128 == kStagedBlockValues &&
                  staged_max_rows<256>() * 256 == kStagedBlockValues,
              "the staged kernel's largest block");

// x * (1 / d) corrected to x / d rounded to nearest (Markstein: rcp = 1 / d correctly rounded,
// the residual exact in one FMA): as fa3gen.fp8.quantize's division, in 3 instructions instead
// of a division's 8 and a slow-path check. Callers keep d normal and >= 2^-100 (no over- or
// underflow in rcp; tiny quotients become e4m3 zeros either way).
__device__ __forceinline__ float div_by(float x, float d, float rcp) {
#ifdef FA3GEN_QUANTIZE_RCP_MUL  // measurement switch: x * (1 / d) alone, 1 instruction instead of
  return __fmul_rn(x, rcp);     // 3 (not bit-identical to fa3gen.fp8.quantize's division)
#else
  const float q = __fmul_rn(x, rcp);
  return __fmaf_rn(__fmaf_rn(-q, d, x), rcp, q);
#endif
}

// Rotary embedding of a thread's 32 values of row `pos` in fp32, as reference.apply_rotary
// (separately rounded products, no FMA). Halves (KShift = half / 8T in {1, 2}: the partner of
// chunk k is chunk k + KShift, same lane) or adjacent pairs (interleaved; any even rotary_dim).
template <int HeadDim, int KShift>
__device__ __forceinline__ void rotate_halves(float (&v)[32], const float* cos, const float* sin, int half,
                                              int64_t pos, int t) {
  constexpr int T = HeadDim / 32;
  #pragma unroll
  for (int k = 0; k < KShift; ++k) {
    float c[8], s[8];
    const int64_t at = pos * half + 8 * (t + T * k);
    *reinterpret_cast<float4*>(c) = *reinterpret_cast<const float4*>(cos + at);
    *reinterpret_cast<float4*>(c + 4) = *reinterpret_cast<const float4*>(cos + at + 4);
    *reinterpret_cast<float4*>(s) = *reinterpret_cast<const float4*>(sin + at);
    *reinterpret_cast<float4*>(s + 4) = *reinterpret_cast<const float4*>(sin + at + 4);
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x1 = v[8 * k + i], x2 = v[8 * (k + KShift) + i];
      v[8 * k + i] = __fsub_rn(__fmul_rn(x1, c[i]), __fmul_rn(x2, s[i]));
      v[8 * (k + KShift) + i] = __fadd_rn(__fmul_rn(x1, s[i]), __fmul_rn(x2, c[i]));
    }
  }
}
template <int HeadDim>
__device__ __forceinline__ void rotate_pairs(float (&v)[32], const float* cos, const float* sin, int half,
                                             int64_t pos, int t) {
  constexpr int T = HeadDim / 32;
  #pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int j0 = 4 * (t + T * k);  // the chunk's first pair
    if (j0 >= half) continue;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (j0 + i >= half) break;
      const float c = cos[pos * half + j0 + i], s = sin[pos * half + j0 + i];
      const float x1 = v[8 * k + 2 * i], x2 = v[8 * k + 2 * i + 1];
      v[8 * k + 2 * i] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
      v[8 * k + 2 * i + 1] = __fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c));
    }
  }
}

// Incoherent processing of the 32 values a thread owns (see Staged): sign flips (bit j of neg),
// then the butterflies in stride order 1, 2, 4 (in a chunk), 8 .. 4T (across the row's lanes),
// 8T, 16T (across chunks), the lower index keeping a + b, then 1/sqrt(d): the operations of
// reference.hadamard_transform in its order, so the same bits (the rotary instances; the
// others take hadamard_mma_tile). Scale false: the caller folds 1/sqrt(d) into the descale.
template <int HeadDim, bool Scale = true>
__device__ __forceinline__ void transform_owned(float (&v)[32], uint32_t neg, int lane) {
  constexpr int T = HeadDim / 32;
  #pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = __int_as_float(__float_as_int(v[j]) ^ (((neg >> j) & 1u) << 31));
  #pragma unroll
  for (int h = 1; h < 32; h *= 2) {
    if (h == 8) {  // the lane strides come between the in-chunk and the cross-chunk ones
      #pragma unroll
      for (int m = 1; m < T; m *= 2) {
        const float sign = (lane & m) ? -1.f : 1.f;  // the upper lane keeps other - v
        #pragma unroll
        for (int j = 0; j < 32; ++j) {
          const float other = __shfl_xor_sync(0xffffffff, v[j], m);
          v[j] = __fmaf_rn(v[j], sign, other);  // the product is exact: one rounding, as the sum
        }
      }
    }
    #pragma unroll
    for (int j = 0; j < 32; ++j) {
      if (j & h) continue;
      const float a = v[j], b = v[j + h];
      v[j] = a + b;
      v[j + h] = a - b;
    }
  }
  #pragma unroll
  for (int j = 0; j < 32 && Scale; ++j) v[j] = __fmul_rn(v[j], kInvSqrtD<HeadDim>);
}

// The lean unpack, in the two-pass instances (where it measured a gain; H200 A/B, 2026-12-01,
// docs/results/ab_quantize_lean.json, Hadamard blocks as % of copy: d64 160 rows 43 -> 48, 192
// 46 -> 52, d128 160 43-45 -> 47, 192 49 -> 53, d256 128 55 -> 58; one pass lost, d128 128 rows
// 60 -> 58, d64 128 59 -> 58; those Hadamard instances take hadamard_mma_tile since). Fewer
// instructions a value:
// - 16-bit -> fp32 by bit operations (bf16: a shift and a mask a pair, where the default
//   conversion's upper half took a PRMT and a shift);
// - d64 and d256: 1/sqrt(d) is a power of two, so multiplying by it is exact and commutes with
//   every rounding (short of fp32's subnormals, which the flush-to-zero arithmetic departs from
//   either way): the kernel keeps the unscaled values, scales the block's amax once and divides
//   by descale * sqrt(d), the same bits as reference.hadamard_transform then fp8.quantize.
template <int Passes>
constexpr bool kQuantizeLean = Passes > 1;
template <int HeadDim, int Passes>
constexpr bool kFoldInvSqrtD = kQuantizeLean<Passes> && (HeadDim == 64 || HeadDim == 256);

// One 16-byte chunk of 16-bit values as 8 floats.
template <class T>
__device__ __forceinline__ void unpack_chunk(const uint4& raw, float* out) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  #pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t x = w[q];
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      out[2 * q] = __uint_as_float(x << 16);
      out[2 * q + 1] = __uint_as_float(x & 0xffff0000u);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&x));
      out[2 * q] = f.x;
      out[2 * q + 1] = f.y;
    }
  }
}

// The Hadamard transform on the tensor cores: the staged kernel's kHadamard instances (the
// rotary ones keep transform_owned, whose butterflies cost about 9 instructions a value; here
// 24 mma.sync a warp per 32 values a lane, and a split into two bf16 halves). H200,
// 2026-12-02, against the butterflies: d64 and d256 Hadamard blocks 4-6 points of the copy's
// bandwidth faster, d128 the same (55-66% at the e4m3 defaults' blocks, plain blocks 75-98%;
// docs/BENCHMARKS.md).
//   H_d = H_S (x) H_16 with S = d / 16 (Sylvester order: element 16a + b of a row is value b of
// its segment a), so a row's y = H_d (signs x) is H_16 on each segment, then H_S across its
// segments for each b. A block's rows are segment slots (slot = row * S + segment) in tiles of
// 16 (16 / S whole rows); a CTA's warps take the tiles in turn (tile k of warp w is k Warps + w),
// so the block's tiles spread evenly (at most 4 Passes a warp):
//  1. each 8 slots, C = H_16 X^T (m16n8k16: A = H_16, B = the 8 segments, read from the stage
//     by ldmatrix with the signs xored in): C[b][slot];
//  2. each tile (two of step 1), Y = blockdiag(H_S, ...) C^T over its slots
//     (m16n8k16: its B fragment is step 1's two accumulators as they lie), for b 0-7 and 8-15.
//     The accumulators enter as bf16 hi + lo (two mma each), so Y keeps about 16 bits of
//     precision before e4m3 keeps 3: not the bits of reference.hadamard_transform's fp32
//     butterflies (tests/gpu/test_fp8.py states the tolerance), and bf16 whatever x's dtype
//     (f16 would overflow past 4096).
// Step 1's A is H_16 with its rows permuted (hadamard_out_index), so that the four values of
// a slot that a lane ends with are four adjacent output bytes: lane (g, t) ends with
// y[4h + e] of a tile: Y[slot g + 8 (e / 2)][b = 4t + 2h + e % 2], and stores 4 bytes a slot
// (whole 32-byte sectors a warp) where 2-byte stores left each sector half written twice.
template <int HeadDim>
struct HadamardMma {
  static constexpr int S = HeadDim / 16;         // segments a row
  static constexpr int kTileRows = 16 / S;       // rows a tile
  __device__ static int tiles(int rows) { return (rows + kTileRows - 1) / kTileRows; }
};

// The output value b of step 1's accumulator row r: rows 2t, 2t + 1 (a lane's c0, c1) give
// 4t, 4t + 1 and rows 8 + 2t, 9 + 2t (its c2, c3) give 4t + 2, 4t + 3.
__host__ __device__ constexpr int hadamard_out_index(int r) { return 4 * (r % 8 / 2) + 2 * (r / 8) + r % 2; }
constexpr bool hadamard_out_index_fits_store_mma() {
  int seen = 0;
  for (int t = 0; t < 4; ++t) {
    for (int e = 0; e < 2; ++e) {
      if (hadamard_out_index(2 * t + e) != 4 * t + e || hadamard_out_index(8 + 2 * t + e) != 4 * t + 2 + e) return false;
      seen |= 1 << hadamard_out_index(2 * t + e) | 1 << hadamard_out_index(8 + 2 * t + e);
    }
  }
  return seen == 0xFFFF;
}
static_assert(hadamard_out_index_fits_store_mma(), "a permutation of H_16's rows giving each lane 4 adjacent bytes");

// Entry (r, c) of a Sylvester-Hadamard matrix: (-1)^popcount(r & c).
__device__ __forceinline__ float hadamard_entry(int r, int c) { return (__popc(r & c) & 1) ? -1.f : 1.f; }

// The m16n8k16 A fragment of H_16 (T) and of blockdiag(H_S, ...) (bf16), and the sign bits of
// step 1's B fragment (per tile parity at d256, whose tiles alternate between segments 0-7 and
// 8-15; every tile holds the same segments of its rows below).
template <class T, int HeadDim>
struct HadamardFragments {
  static constexpr int kParities = HeadDim > 128 ? 2 : 1;
  uint32_t h16[4], hs[4], flips[kParities][2];
  HadamardFragments() = default;
  __device__ HadamardFragments(const float* signs, int lane) {
    constexpr int S = HadamardMma<HeadDim>::S;
    const int g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {  // a0: (g, 2t), a1: (g + 8, 2t), a2: (g, 2t + 8), a3: (g + 8, 2t + 8)
      const int r = g + 8 * (j & 1), c = 2 * t + 8 * (j >> 1);
      h16[j] = pack2<T>(hadamard_entry(hadamard_out_index(r), c), hadamard_entry(hadamard_out_index(r), c + 1));
      auto block = [&](int cc) { return r / S == cc / S ? hadamard_entry(r % S, cc % S) : 0.f; };
      hs[j] = pack2<__nv_bfloat16>(block(c), block(c + 1));
    }
    #pragma unroll
    for (int q = 0; q < kParities; ++q) {
      const int seg = (8 * q + g) % S;
      #pragma unroll
      for (int j = 0; j < 2; ++j) {  // b0: k = 2t, 2t + 1; b1: k = 2t + 8, 2t + 9
        const int e = 16 * seg + 2 * t + 8 * j;
        flips[q][j] = (signs[e] < 0.f ? 0x8000u : 0u) | (signs[e + 1] < 0.f ? 0x80000000u : 0u);
      }
    }
  }
  // Through shared memory (kSmemWords 16-byte words a lane, word-major; kFragmentsInSmem).
  static constexpr int kSmemWords = 3;
  __device__ void save(uint4* smem, int lane) const {
    smem[lane] = make_uint4(h16[0], h16[1], h16[2], h16[3]);
    smem[32 + lane] = make_uint4(hs[0], hs[1], hs[2], hs[3]);
    smem[64 + lane] = make_uint4(flips[0][0], flips[0][1], flips[kParities - 1][0], flips[kParities - 1][1]);
  }
  __device__ static HadamardFragments load(const uint4* smem, int lane) {
    HadamardFragments f;
    const uint4 a = smem[lane], b = smem[32 + lane], c = smem[64 + lane];
    f.h16[0] = a.x, f.h16[1] = a.y, f.h16[2] = a.z, f.h16[3] = a.w;
    f.hs[0] = b.x, f.hs[1] = b.y, f.hs[2] = b.z, f.hs[3] = b.w;
    f.flips[0][0] = c.x, f.flips[0][1] = c.y, f.flips[kParities - 1][0] = c.z, f.flips[kParities - 1][1] = c.w;
    return f;
  }
};

// Tile `tile` of the stage (rows at or past `rows` read as zeros; Full: none are) into y,
// unscaled (the caller applies 1/sqrt(d) with the descale).
template <class T, int HeadDim, bool Full>
__device__ __forceinline__ void hadamard_mma_tile(float* y, const uint8_t* stage, int tile, int rows, int lane,
                                                  const HadamardFragments<T, HeadDim>& f) {
  using S_ = Staged<HeadDim>;  // the stage's row bytes and swizzle (any thread count)
  constexpr int S = HadamardMma<HeadDim>::S;
  const int g = lane / 4;
  // ldmatrix: lane L addresses row L % 8 of matrix L / 8 = (slots 8 (L / 16) .., values 8 (L / 8 % 2) ..);
  // it returns lane (g, t) row g of each: slot 8 (j / 2) + g, values 2t, 2t + 1 (+ 8 (j % 2)).
  const int slot = 16 * tile + 8 * (lane / 16) + lane % 8;
  const int row = slot / S, safe = Full || row < rows ? row : 0;  // inside the stage either way
  const int chunk = 2 * (slot % S) + (lane / 8) % 2;
  uint32_t b[4];
  ldmatrix_x4(b, smem_addr(stage + safe * S_::kRowBytes + ((chunk ^ S_::mma_swizzle(safe, chunk)) << 4)));
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    const bool live = Full || (16 * tile + 8 * (j / 2) + g) / S < rows;  // zeros, not 0 x NaN, past the block
    b[j] = live ? b[j] ^ f.flips[j / 2 % f.kParities][j % 2] : 0u;
  }
  float c[2][4] = {};
  mma_16816<T>(c[0], f.h16, b[0], b[1]);
  mma_16816<T>(c[1], f.h16, b[2], b[3]);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {  // c[.][2h], c[.][2h + 1]: step 1's row 8h + g, slots 2t, 2t + 1 of each half
    const uint32_t hi0 = pack2<__nv_bfloat16>(c[0][2 * h], c[0][2 * h + 1]);
    const uint32_t hi1 = pack2<__nv_bfloat16>(c[1][2 * h], c[1][2 * h + 1]);
    const float2 r0 = bf16x2_to_float2(hi0), r1 = bf16x2_to_float2(hi1);
    const uint32_t lo0 = pack2<__nv_bfloat16>(c[0][2 * h] - r0.x, c[0][2 * h + 1] - r0.y);
    const uint32_t lo1 = pack2<__nv_bfloat16>(c[1][2 * h] - r1.x, c[1][2 * h + 1] - r1.y);
    float acc[4] = {};
    mma_16816<__nv_bfloat16>(acc, f.hs, hi0, hi1);
    mma_16816<__nv_bfloat16>(acc, f.hs, lo0, lo1);
    #pragma unroll
    for (int e = 0; e < 4; ++e) y[4 * h + e] = acc[e];
  }
}

// The warp's tiles' values (tile k in v[k / 4][8 (k % 4) ..]) times `factor` (1/sqrt(d) /
// descale; or divided, Divide) as e4m3, four adjacent bytes a store. Slot 8 half + g of a tile
// lies in its row (8 half + g) / S at byte 16 ((8 half + g) % S): the lane's part (g) is
// fixed, the half's a constant.
template <int HeadDim, int Threads, int Passes, bool Divide>
__device__ __forceinline__ void store_mma(uint8_t* out, int heads, int rows, int warp, int lane,
                                          const float (&v)[Passes][32], float factor, float descale) {
  using M = HadamardMma<HeadDim>;
  constexpr int S = M::S;
  const int g = lane / 4, t = lane % 4;
  const int lane_row = g / S, lane_col = 16 * (g % S) + 4 * t;
  const int64_t row_bytes = int64_t(heads) * HeadDim;
  auto e4m3x2 = [&](float a, float b) -> uint32_t {
    const float2 q = Divide ? make_float2(__fdiv_rn(a * kInvSqrtD<HeadDim>, descale),
                                          __fdiv_rn(b * kInvSqrtD<HeadDim>, descale))
                            : make_float2(a * factor, b * factor);
    return __nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, __NV_E4M3);
  };
  // Rows of the block from the warp's tile 0 on, and from the lane's row of it: one compare a
  // store (with a bound a tile the two-pass instances spilled about 30 bytes more).
  constexpr int kStepRows = Threads / 32 * M::kTileRows;  // from a warp's tile k to k + 1
  const int warp_rows = rows - warp * M::kTileRows, lane_rows = warp_rows - lane_row;
  uint8_t* base = out + int64_t(warp * M::kTileRows + lane_row) * row_bytes + lane_col;
  #pragma unroll
  for (int k = 0; k < 4 * Passes; ++k, base += kStepRows * row_bytes) {
    if (k * kStepRows >= warp_rows) break;  // tile k * Warps + warp is past the block
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int step_row = 8 * half / S, step_col = 16 * (8 * half % S);
      if (k * kStepRows + step_row >= lane_rows) continue;
      const float* y = &v[k / 4][8 * (k % 4) + 2 * half];  // bytes 4t, 4t + 1 (y[0], y[1]); 4t + 2, 4t + 3 (y[4], y[5])
      *reinterpret_cast<uint32_t*>(base + step_row * row_bytes + step_col) =
          e4m3x2(y[0], y[1]) | e4m3x2(y[4], y[5]) << 16;
    }
  }
}

// A block's values / descale as e4m3 (8 bytes a chunk) into out (the block's first row).
template <int HeadDim, int Threads, int Passes, bool Divide>
__device__ __forceinline__ void store_owned(uint8_t* out, int heads, int rows, int tid, const float (&v)[Passes][32],
                                            float descale) {
  using S = Staged<HeadDim, Threads>;
  const int t = tid % S::T;
  const float rcp = __frcp_rn(descale);
  #pragma unroll
  for (int ps = 0; ps < Passes; ++ps) {
    const int r = ps * S::kRowsPerPass + tid / S::T;
    if (r >= rows) continue;
    uint2 packed[4];
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint16_t* pairs = reinterpret_cast<uint16_t*>(&packed[k]);
      #pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const float a = v[ps][8 * k + i], b = v[ps][8 * k + i + 1];
        const float2 q = Divide ? make_float2(__fdiv_rn(a, descale), __fdiv_rn(b, descale))
                                : make_float2(div_by(a, descale, rcp), div_by(b, descale, rcp));
        pairs[i / 2] = __nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, __NV_E4M3);
      }
    }
    uint8_t* row_out = out + int64_t(r) * heads * HeadDim;
    // d64: the row's two lanes swap chunks so that each store writes whole 32-byte sectors
    // (16 bytes a lane) instead of halves: 64% -> 73% of copy at 128-row blocks, 60% -> 64% at
    // 160 (docs/results/ab_quantize_pair_stores.json). d128 and d256 store whole sectors anyway.
    if constexpr (S::T == 2) {
      const unsigned pair = 3u << (tid % 32 & ~1);  // the row's two lanes (both here or both not)
      #pragma unroll
      for (int k = 0; k < 4; k += 2) {  // chunks 2k .. 2k + 3: lane 0 keeps 2k, lane 1 2k + 3
        const uint2 give = t == 0 ? packed[k + 1] : packed[k];
        const uint2 got = make_uint2(__shfl_xor_sync(pair, give.x, 1), __shfl_xor_sync(pair, give.y, 1));
        const uint4 mine = t == 0 ? make_uint4(packed[k].x, packed[k].y, got.x, got.y)
                                  : make_uint4(got.x, got.y, packed[k + 1].x, packed[k + 1].y);
        *reinterpret_cast<uint4*>(row_out + 8 * (2 * k + 2 * t)) = mine;
      }
    } else {
      #pragma unroll
      for (int k = 0; k < 4; ++k) *reinterpret_cast<uint2*>(row_out + 8 * (t + S::T * k)) = packed[k];
    }
  }
}

// Whether the staged kernel applies the Hadamard transform: as p.signs says (the rotary kernels,
// one instance for both) or compiled in or out (the others). With the transform's code in it the
// plain two-pass instance spilled 28 bytes at d64/d128; apart, d128 blocks of 160 and 192 rows went
// from 67-70% to 79-93% of the copy's bandwidth (docs/results/ab_quantize_hadamard_instances.json).
constexpr int kHadamardAtRunTime = 0, kNoHadamard = 1, kHadamard = 2;
template <int Hadamard>
__device__ __forceinline__ bool transforms(const fa3gen_quantize_params& p) {
  return Hadamard == kHadamardAtRunTime ? p.signs != nullptr : Hadamard == kHadamard;
}

// The staged kernel's copy loop unrolled (one pointer a thread, a constant stride) except in
// the plain instances of the 3-stage ring, which loop over the chunks. H200, 2026-12-02, each
// form against the chunk loop with integer divisions before it (docs/results/
// ab_quantize_unrolled_copy_skip.json, ab_quantize_chunk_copy.json, ab_quantize_hybrid.json),
// % of copy: unrolled, the Hadamard blocks gained 3-14 points (d128 192 rows 53 -> 62 and
// 54 -> 67; the chunk loop gained them nothing) and the plain blocks of the smaller rings 1-5
// (d64 160 rows 70 -> 75), but the 3-stage ring's plain d128 192-row blocks lost 96 -> 83 at
// (8, 8192, 16, 128) (alone under ncu both took 100-102 us: only back to back) and d256's 96
// rows 83 -> 78, where the chunk loop kept 98 and 84. Each instance's SASS is that of a measured
// side.
template <int Hadamard, int Stages>
constexpr bool kUnrolledCopy = Hadamard != kNoHadamard || Stages != kStages;

template <class T, int HeadDim, int Passes, bool Rotary, int Stages, int Hadamard = kHadamardAtRunTime>
__global__ void __launch_bounds__(staged_threads(Stages), 512 / staged_threads(Stages))
    quantize_blocks_staged(const fa3gen_quantize_params p) {
  constexpr int Threads = staged_threads(Stages);
  using S = Staged<HeadDim, Threads>;
  extern __shared__ __align__(16) uint8_t ring[];
  __shared__ float warp_amax[2][Threads / 32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, t = tid % S::T;
  const int nblk = (p.seqlen + p.block_rows - 1) / p.block_rows;
  const int items = nblk * p.heads * p.batch;  // block fastest, then head, batch (< 2^31: launch)
  const int stage_bytes = p.block_rows * S::kRowBytes;
  const T* x = static_cast<const T*>(p.x);

  // Item -> (its block, first row, rows, head, batch), the divisions by multiplies.
  const FastDiv by_blocks(nblk), by_heads(p.heads);
  auto where = [&](int item, int& blk, int& row0, int& rows, int& head, int& b) {
    const int hb = by_blocks.div(item);
    blk = item - hb * nblk;
    b = by_heads.div(hb);
    head = hb - b * p.heads;
    row0 = blk * p.block_rows;
    rows = min(p.block_rows, p.seqlen - row0);
  };
  constexpr bool kMma = Hadamard == kHadamard && !Rotary;  // the transform on the tensor cores
  // Where chunk `chunk` of a stage's row `row` lies (16-byte units from the row's start).
  auto placed = [](int row, int chunk) {
    return chunk ^ (kMma ? S::mma_swizzle(row, chunk) : S::swizzle(row));
  };
  // An item's copies into a stage (one group). Where kUnrolledCopy, thread tid copies chunk
  // tid % kChunks of rows tid / kChunks + k kCopyRows, one source pointer a thread stepping by a
  // constant stride, the steps unrolled (the bank swizzle of those rows is the same: kCopyRows
  // is a multiple of 8 / T, and even); elsewhere a loop over the block's chunks.
  constexpr int kCopyRows = Threads / S::kChunks;
  static_assert(kCopyRows % (8 / S::T) == 0 && kCopyRows % 2 == 0 &&
                    staged_stage_rows<HeadDim, Stages>() % kCopyRows == 0,
                "a thread's copied rows share their swizzle and fill a stage");
  const int copy_row = tid / S::kChunks, copy_chunk = tid % S::kChunks;
  const uint32_t copy_dst = smem_addr(ring) + copy_row * S::kRowBytes + (placed(copy_row, copy_chunk) << 4);
  auto load = [&](int item, int stage) {
    if (item < items) {
      int blk, row0, rows, head, b;
      where(item, blk, row0, rows, head, b);
      const T* base = x + int64_t(b) * p.x_batch_stride + int64_t(head) * p.x_head_stride;
      if constexpr (kUnrolledCopy<Hadamard, Stages>) {
        const T* src = base + int64_t(row0 + copy_row) * p.x_row_stride + copy_chunk * 8;
        const int64_t src_step = int64_t(kCopyRows) * p.x_row_stride;
        const uint32_t dst = copy_dst + stage * stage_bytes;
        #pragma unroll
        for (int k = 0; k < staged_stage_rows<HeadDim, Stages>() / kCopyRows; ++k, src += src_step) {
          if (copy_row + k * kCopyRows < rows) cp_async_16(dst + k * kCopyRows * S::kRowBytes, src, true);
        }
      } else {
        const uint32_t dst = smem_addr(ring + stage * stage_bytes);
        for (int c = tid; c < rows * S::kChunks; c += Threads) {
          const int r = c / S::kChunks, ch = c % S::kChunks;
          cp_async_16(dst + r * S::kRowBytes + (placed(r, ch) << 4),
                      base + int64_t(row0 + r) * p.x_row_stride + ch * 8, true);
        }
      }
    }
    cp_async_commit();  // empty groups keep the count uniform
  };

  uint32_t neg = 0;  // the signs of this thread's elements (bit j: value j negated)
  if (!kMma && transforms<Hadamard>(p)) {
    #pragma unroll
    for (int j = 0; j < 32; ++j) neg |= uint32_t(p.signs[8 * (t + S::T * (j / 8)) + j % 8] < 0.f) << j;
  }
  const int kshift = p.rotary_half * 4 / HeadDim;  // halves: rotary_half / 8T (1 or 2)
  // The tensor-core transform's constant fragments: in registers in the one-pass instances; the
  // two-pass ones keep them in shared memory (HadamardFragments::save; the first item's barrier
  // publishes them) and load them where a block is transformed. H200, 2026-12-02: in registers
  // the two-pass instances spilled 4-40 bytes; in shared memory the one-pass d128 blocks lost
  // 4-5 points of the copy's bandwidth.
  constexpr bool kFragmentsInSmem = kMma && Passes == 2;
  __shared__ uint4 fragment_words[kFragmentsInSmem ? HadamardFragments<T, HeadDim>::kSmemWords * 32 : 1];
  using KeptFragments = std::conditional_t<kMma && !kFragmentsInSmem, HadamardFragments<T, HeadDim>, int>;
  const KeptFragments kept_fragments = [&] {
    if constexpr (kMma && !kFragmentsInSmem) return HadamardFragments<T, HeadDim>(p.signs, lane);
    else return 0;
  }();
  if constexpr (kFragmentsInSmem) {
    if (warp == 0) HadamardFragments<T, HeadDim>(p.signs, lane).save(fragment_words, lane);
  }

  #pragma unroll 1
  for (int s = 0; s < Stages; ++s) load(blockIdx.x + s * gridDim.x, s);
  int n = 0;
  for (int item = blockIdx.x; item < items; item += gridDim.x, ++n) {
    const int stage = n % Stages;
    int blk, row0, rows, head, b;
    where(item, blk, row0, rows, head, b);
    cp_async_wait<Stages - 1>();  // this item's group has landed (this thread's copies) ...
    __syncthreads();               // ... and everyone's

    float v[Passes][32];
    float amax = 0.f;
    #pragma unroll
    for (int ps = 0; ps < Passes; ++ps) {
      if constexpr (kMma) {  // the pass's tiles of this warp (tile k * Warps + warp of the block)
        const uint8_t* stage_data = ring + stage * stage_bytes;
        const int tiles = HadamardMma<HeadDim>::tiles(rows);
        const HadamardFragments<T, HeadDim> fragments = [&] {
          if constexpr (kFragmentsInSmem) return HadamardFragments<T, HeadDim>::load(fragment_words, lane);
          else return kept_fragments;
        }();
        // A second copy of the tiles without the row checks, for blocks of whole tiles (d64's
        // two-pass instances spilled 24 bytes with it; the 4-stage one spills 4 without).
        constexpr bool kWholeTilesCopy = Passes == 1 || HeadDim != 64;
        const bool whole_tiles = kWholeTilesCopy && rows % HadamardMma<HeadDim>::kTileRows == 0;
        float part[4] = {};  // four independent chains
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          // A branch a pair of tiles: a pair whose first tile is in the block computes both,
          // the second as zeros where it lies past the block (the measured form; a branch a
          // tile was not timed).
          const int tile = (4 * ps + i) * (Threads / 32) + warp, pair = (4 * ps + i / 2 * 2) * (Threads / 32) + warp;
          float* y = &v[ps][8 * i];
          if (pair >= tiles) {
            #pragma unroll
            for (int j = 0; j < 8; ++j) y[j] = 0.f;
          } else if (whole_tiles && tile < tiles) {
            hadamard_mma_tile<T, HeadDim, true>(y, stage_data, tile, rows, lane, fragments);
          } else {
            hadamard_mma_tile<T, HeadDim, false>(y, stage_data, tile, rows, lane, fragments);
          }
          #pragma unroll
          for (int j = 0; j < 8; ++j) part[j % 4] = fmaxf(part[j % 4], fabsf(y[j]));
        }
        amax = fmaxf(amax, fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3])));
        continue;
      }
      const int r = ps * S::kRowsPerPass + tid / S::T;
      if (r < rows) {
        const uint8_t* row = ring + stage * stage_bytes + r * S::kRowBytes;
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint4 raw = *reinterpret_cast<const uint4*>(row + (((t + S::T * k) ^ S::swizzle(r)) << 4));
          if constexpr (kQuantizeLean<Passes>) {
            unpack_chunk<T>(raw, &v[ps][8 * k]);
          } else {
            const T* e = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int i = 0; i < 8; ++i) v[ps][8 * k + i] = to_float(e[i]);
          }
        }
        if (Rotary) {  // a template flag: the registers of a call without it stay free
          const int64_t pos = row0 + r;
          if (p.rotary_interleaved) rotate_pairs<HeadDim>(v[ps], p.rotary_cos, p.rotary_sin, p.rotary_half, pos, t);
          else if (kshift == 1) rotate_halves<HeadDim, 1>(v[ps], p.rotary_cos, p.rotary_sin, p.rotary_half, pos, t);
          else rotate_halves<HeadDim, 2>(v[ps], p.rotary_cos, p.rotary_sin, p.rotary_half, pos, t);
        }
      } else {
        #pragma unroll
        for (int j = 0; j < 32; ++j) v[ps][j] = 0.f;  // rows past the end: zeros, never stored
      }
      // Every lane of the warp shuffles (whole rows are live or not, but a warp may hold both).
      if (transforms<Hadamard>(p)) transform_owned<HeadDim, !kFoldInvSqrtD<HeadDim, Passes>>(v[ps], neg, lane);
      #pragma unroll
      for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(v[ps][j]));
    }
    amax = warp_max(amax);
    if (lane == 0) warp_amax[n & 1][warp] = amax;
    __syncthreads();  // the stage is read: refill it with the item Stages ahead
    load(item + Stages * gridDim.x, stage);
    amax = warp_amax[n & 1][0];
    #pragma unroll
    for (int w = 1; w < Threads / 32; ++w) amax = fmaxf(amax, warp_amax[n & 1][w]);
    // Values left unscaled (kFoldInvSqrtD, kMma): the scaled amax (exact for d64 and d256), and
    // a divisor as exact.
    const bool unscaled = (kMma || kFoldInvSqrtD<HeadDim, Passes>) && transforms<Hadamard>(p);
    const float descale = descale_of(unscaled ? amax * kInvSqrtD<HeadDim> : amax);
    const float divisor = unscaled ? descale * (1.f / kInvSqrtD<HeadDim>) : descale;
    if (tid == 0) p.descale[(int64_t(b) * p.heads + head) * nblk + blk] = descale;

    uint8_t* out = static_cast<uint8_t*>(p.out) + ((int64_t(b) * p.seqlen + row0) * p.heads + head) * HeadDim;
    // div_by needs a normal 1 / divisor; blocks of tiny or infinite magnitudes divide.
    const bool normal = divisor >= 0x1p-100f && !isinf(divisor);
    if constexpr (kMma) {
      const float factor = kInvSqrtD<HeadDim> * __frcp_rn(descale);
      if (normal) store_mma<HeadDim, Threads, Passes, false>(out, p.heads, rows, warp, lane, v, factor, descale);
      else store_mma<HeadDim, Threads, Passes, true>(out, p.heads, rows, warp, lane, v, factor, descale);
    } else if (normal) {
      store_owned<HeadDim, Threads, Passes, false>(out, p.heads, rows, tid, v, divisor);
    } else {
      store_owned<HeadDim, Threads, Passes, true>(out, p.heads, rows, tid, v, divisor);
    }
  }
  cp_async_wait<0>();  // no copy outlives the CTA (the refills past the last item are empty)
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

template <class T, int HeadDim, int Passes, bool Rotary, int Stages, int Hadamard>
struct StagedTag {};

// One persistent CTA per slot the ring's shared memory leaves on each SM.
template <class T, int HeadDim, int Passes, bool Rotary, int Stages, int Hadamard>
int launch_staged(const fa3gen_quantize_params& p, cudaStream_t stream) {
  const auto kernel = quantize_blocks_staged<T, HeadDim, Passes, Rotary, Stages, Hadamard>;
  const int smem = Stages * p.block_rows * Staged<HeadDim>::kRowBytes;
  // The quantizer's kernels share one signature: a tag per instance keeps their flags apart.
  const int most = staged_stage_rows<HeadDim, Stages>() * Staged<HeadDim>::kRowBytes;
  cudaError_t err = set_smem_limit_once<StagedTag<T, HeadDim, Passes, Rotary, Stages, Hadamard>>(kernel, Stages * most);
  int device = 0, sms = 0, per_sm = 0;
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, staged_threads(Stages), smem);
  if (err != cudaSuccess) return report("quantize_fp8 launch setup", err);
  const int64_t items = int64_t((p.seqlen + p.block_rows - 1) / p.block_rows) * p.heads * p.batch;
  if (items + int64_t(Stages + 1) * sms * std::max(per_sm, 1) >= (int64_t(1) << 31)) {
    fa3gen_set_error("quantize_fp8: more than 2^31 blocks (batch x heads x blocks of rows)");
    return 1;
  }
  const int grid = int(std::min<int64_t>(items, int64_t(sms) * std::max(per_sm, 1)));
  kernel<<<grid, staged_threads(Stages), smem, stream>>>(p);
  err = cudaGetLastError();
  return err == cudaSuccess ? 0 : report("quantize kernel launch", err);
}

// Blocks of at most 16 KB (always one pass) take the deepest ring, blocks of at most 24 KB the
// middle one.
template <class T, int HeadDim, bool Rotary, int Hadamard>
int launch_staged(const fa3gen_quantize_params& p, cudaStream_t stream) {
  if (p.block_rows * Staged<HeadDim>::kRowBytes <= kSmallStageBytes) {
    static_assert(kSmallStageBytes / Staged<HeadDim>::kRowBytes <= Staged<HeadDim, staged_threads(kSmallStages)>::kRowsPerPass);
    return launch_staged<T, HeadDim, 1, Rotary, kSmallStages, Hadamard>(p, stream);
  }
  if (p.block_rows * Staged<HeadDim>::kRowBytes <= kMidStageBytes) {
    using Mid = Staged<HeadDim, staged_threads(kMidStages)>;
    static_assert(kMidStageBytes / Staged<HeadDim>::kRowBytes <= 2 * Mid::kRowsPerPass);
    return p.block_rows <= Mid::kRowsPerPass ? launch_staged<T, HeadDim, 1, Rotary, kMidStages, Hadamard>(p, stream)
                                             : launch_staged<T, HeadDim, 2, Rotary, kMidStages, Hadamard>(p, stream);
  }
  return p.block_rows <= Staged<HeadDim>::kRowsPerPass ? launch_staged<T, HeadDim, 1, Rotary, kStages, Hadamard>(p, stream)
                                                       : launch_staged<T, HeadDim, 2, Rotary, kStages, Hadamard>(p, stream);
}
template <class T, int HeadDim, bool Rotary>
int launch_staged(const fa3gen_quantize_params& p, cudaStream_t stream) {
  if constexpr (Rotary) {
    return launch_staged<T, HeadDim, Rotary, kHadamardAtRunTime>(p, stream);
  } else {
    return p.signs != nullptr ? launch_staged<T, HeadDim, Rotary, kHadamard>(p, stream)
                              : launch_staged<T, HeadDim, Rotary, kNoHadamard>(p, stream);
  }
}

template <class T, int HeadDim>
int launch(const fa3gen_quantize_params& p, cudaStream_t stream) {
  const int rows = p.block_rows > 0 ? p.block_rows : kTensorRows;
  const dim3 grid((p.seqlen + rows - 1) / rows, p.heads, p.batch);
  if (p.block_rows > 0 && p.block_rows <= staged_max_rows<HeadDim>()) {
    return p.rotary_half > 0 ? launch_staged<T, HeadDim, true>(p, stream) : launch_staged<T, HeadDim, false>(p, stream);
  } else if (p.rotary_half > 0) {
    fa3gen_set_error("quantize_fp8: rotary needs block scales of at most 32768 / head_dim rows");
    return 1;
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
