// Decode attention over a KV cache (fa3gen.flash_attn_with_kvcache): a few query rows per kv
// head against a long cache, contiguous (batch, capacity, heads_kv, d) or paged
// (pages, page_size, heads_kv, d) through a block table, the key range split across CTAs
// (split-KV) and merged by a combine kernel.
//   GQA packing: the heads_q / heads_kv query heads of one kv head, times seqlen_q, are the up
//   to 16 rows of one M=16 tile, so each K and V row is read once per kv head, not once per
//   query head.
//   One CTA of 4 warps per (split, kv head, batch). Each warp takes every fourth 16-key slice
//   of the split and streams it through its own cp.async ring (no CTA barrier in the loop),
//   with tensor cores (mma.sync m16n8k16, fp32 accumulators) for S = Q K^T and O += P V and an
//   online softmax in registers, as the prefill kernels; the four warps' partial results merge
//   in shared memory at the end. Memory-bound: the rings keep 2-3 slices per warp in flight.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include "fa3gen_abi.h"
#include "launch_common.cuh"
#include "rescale_threshold.cuh"
#include "simt_common.cuh"

namespace fa3gen {
namespace decode {

using namespace simt;

constexpr int kWarps = 4;
constexpr int kRows = 16;   // query rows per kv head: M of the mma
constexpr int kSlice = 16;  // keys per warp and stage: K of the P V mma

// Debugging builds only (fa3gen build --define FA3GEN_DECODE_TRACE): each split-kernel CTA
// stamps %globaltimer (ns) at its phases into kTracePoints slots, with the SM it ran on in the
// last slot, and each combine CTA (slots kTraceCtas on) its start, release, LSEs loaded (in
// kTraceQStaged), partials summed (kTraceFirstSlice), warps merged and stores; read back
// through fa3gen_decode_trace (tests/gpu/trace_decode.py). The last call's stamps stay, for up
// to kTraceCtas CTAs of each kernel. Compiled out otherwise (the kernels' code is unchanged).
enum TracePoint { kTraceStart, kTraceReleased, kTraceQStaged, kTraceFirstSlice, kTraceWarpDone,
                  kTraceMerged = kTraceWarpDone + kWarps, kTraceStored, kTraceSm, kTracePoints };
constexpr int kTraceCtas = 1 << 16;
#ifdef FA3GEN_DECODE_TRACE
__device__ unsigned long long g_trace[2 * kTraceCtas * kTracePoints];
// first_cta: 0 for the split kernel, kTraceCtas for the combine.
__device__ __forceinline__ void trace(int point, unsigned first_cta = 0) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  if (cta >= kTraceCtas) return;
  unsigned long long* slots = g_trace + (first_cta + cta) * kTracePoints;
  slots[point] = now;
  if (point == kTraceStart) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    slots[kTraceSm] = sm;
  }
}
#define FA3GEN_DECODE_STAMP(when, point, ...) \
  do {                                        \
    if (when) trace(point, ##__VA_ARGS__);    \
  } while (0)
#else
#define FA3GEN_DECODE_STAMP(when, point, ...) \
  do {                                        \
  } while (0)
#endif

// KvFp8: the cache holds e4m3 (one byte per element). Its slices land in the ring as they are
// and the mma fragments are read from the bytes and converted in registers (qk_fp8, pv_fp8);
// the ring gets twice the stages for the same bytes in flight and the same shared memory
// (66 / 100 / 200 KB: kvcache.CTAS_PER_SM holds for both caches).
template <int HeadDim, bool KvFp8 = false>
struct Config {
  static constexpr int kChunks = HeadDim / 8;  // 16-byte chunks per 16-bit row (Q, out)
  static constexpr int kElemBytes = KvFp8 ? 1 : 2;  // of the cache
  static constexpr int kCacheChunks = HeadDim * kElemBytes / 16;  // 16-byte chunks per cache row
#ifdef FA3GEN_DECODE_STAGES  // measurement builds: another ring depth (and so CTAs per SM)
  static constexpr int kStages = FA3GEN_DECODE_STAGES * (KvFp8 ? 2 : 1);
#else
  static constexpr int kStages = (HeadDim <= 64 ? 4 : 3) * (KvFp8 ? 2 : 1);  // per warp ring
#endif
  static constexpr int kCacheSliceBytes = kSlice * HeadDim * kElemBytes;  // one K or V slice as stored
  static constexpr int kQBytes = kRows * HeadDim * 2;
  static constexpr int kRingBytes = kStages * 2 * kCacheSliceBytes;  // per warp
  static constexpr int kSmemBytes = kQBytes + kWarps * kRingBytes;
  // The final merge: each warp's ring takes its (row, column) fp32 partial output, rows padded
  // by 4 floats: the 8 rows of a fragment store then start on different banks (unpadded, a
  // row of 64-256 floats put all 8 on the same ones).
  static constexpr int kMergeStride = HeadDim + 4;
  static_assert(kRows * kMergeStride * 4 <= kRingBytes, "merge buffer");
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of RowBytes-wide rows, swizzled
// so that the eight row addresses of an ldmatrix (eight consecutive rows, one chunk) hit
// distinct banks: chunk ^ row % 8 for rows of 128 bytes or more, chunk ^ (row / 2) % 4 for
// 64-byte rows (two to a 128-byte line).
template <int RowBytes>
__device__ __forceinline__ int swizzled_row(int row, int chunk) {
  static_assert(RowBytes >= 64 && RowBytes % 64 == 0, "rows of 64 bytes or whole 128-byte lines");
  const int x = RowBytes >= 128 ? (row & 7) : ((row >> 1) & 3);
  return row * RowBytes + ((chunk ^ x) << 4);
}
// 16-bit rows of HeadDim values (Q, a 16-bit cache's slices).
template <int HeadDim>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return swizzled_row<HeadDim * 2>(row, chunk);
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(r) : "r"(x), "r"(selector));
  return r;
}

// Two e4m3 values (the first in the low byte of `two`) as one register of two f16, the first
// in the low half. Exact: every e4m3 value is an f16 value.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// e4m3 slices are read into the f16 mma fragments straight from the ring (rows of HeadDim
// bytes, swizzled_row<HeadDim>), through ldmatrix on byte pairs:
//  - K (S = Q K^T): a plain ldmatrix of 8 keys x 16 bytes gives lane (g, t) bytes 4t..4t+3 of
//    key g. Converted, the first pair is the B fragment's k = 2t, 2t+1 and the second its
//    k = 2t + 8, 2t + 9: within each 16 columns the mma's k order is d = 0 1 4 5 8 9 12 13,
//    2 3 6 7 10 11 14 15, and Q is staged in that order (the KvFp8 Q staging), so the sum is the same.
//  - V (O += P V): a transposing ldmatrix gives lane (g, t) the byte pairs (2g, 2g + 1) of keys
//    2t and 2t + 1; one byte permute makes (key 2t, key 2t + 1) pairs for column 2g (low half)
//    and 2g + 1 (high half): the B fragments of two n8 blocks, even and odd columns. So o[2c]
//    holds columns 16c + 4t, 16c + 4t + 2 and o[2c + 1] columns 16c + 4t + 1, 16c + 4t + 3.
// Per 16 keys x 16 columns a lane does half an ldmatrix.x4, 4 conversions and (V) 2 permutes,
// with no 16-bit copy of the slice in shared memory.
template <int HeadDim>
__device__ __forceinline__ uint32_t fp8_fragment_addr(const uint8_t* tile, int lane, int chunk) {
  // The x4's matrices: (keys 0-7, chunk), (keys 8-15, chunk), (keys 0-7, chunk + 1), (8-15, chunk + 1).
  const int mi = lane / 8;
  return smem_addr(tile + swizzled_row<HeadDim>((mi & 1) * 8 + lane % 8, chunk + (mi >> 1)));
}

template <int HeadDim>
__device__ __forceinline__ void qk_fp8(float (&s)[2][4], const uint8_t* q_smem, const uint8_t* k_tile, int lane) {
#pragma unroll
  for (int ks = 0; ks < HeadDim / 16; ks += 2) {  // two 16-column k steps per x4
    uint32_t kb[4];
    ldmatrix_x4(kb, fp8_fragment_addr<HeadDim>(k_tile, lane, ks));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t a[4];
      const int mi = lane / 8;
      ldmatrix_x4(a, smem_addr(q_smem + swizzled<HeadDim>((mi & 1) * 8 + lane % 8, 2 * (ks + h) + (mi >> 1))));
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        const uint32_t b = kb[2 * h + nb];
        mma_16816<__half>(s[nb], a, e4m3x2_to_f16x2(b), e4m3x2_to_f16x2(b >> 16));
      }
    }
  }
}

template <int HeadDim>
__device__ __forceinline__ void pv_fp8(float (&o)[HeadDim / 8][4], const uint32_t (&pa)[4], const uint8_t* v_tile,
                                       int lane) {
#pragma unroll
  for (int c = 0; c < HeadDim / 16; c += 2) {
    uint32_t vb[4];
    ldmatrix_x4_trans(vb, fp8_fragment_addr<HeadDim>(v_tile, lane, c));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t lo_keys = byte_perm(vb[2 * h], 0x3120), hi_keys = byte_perm(vb[2 * h + 1], 0x3120);
      mma_16816<__half>(o[2 * (c + h)], pa, e4m3x2_to_f16x2(lo_keys), e4m3x2_to_f16x2(hi_keys));
      mma_16816<__half>(o[2 * (c + h) + 1], pa, e4m3x2_to_f16x2(lo_keys >> 16), e4m3x2_to_f16x2(hi_keys >> 16));
    }
  }
}

// The dequantization factor of an e4m3 cache for (batch b, kv head): per (batch, head) or per
// head through the pointer, or one value.
__device__ __forceinline__ float kv_scale(const float* t, float value, const fa3gen_decode_params& p, int b,
                                          int head_kv) {
  return t ? t[int64_t(b) * p.kv_scale_batch_stride + int64_t(head_kv) * p.kv_scale_head_stride] : value;
}

// The page that holds key `key` of sequence b, clamped into the cache.
__device__ __forceinline__ int page_of(const fa3gen_decode_params& p, int b, int key) {
  return min(max(p.block_table[int64_t(b) * p.block_table_batch_stride + key / p.page_size], 0), p.cache_rows - 1);
}

// Where key row `key` of sequence b lives (in elements from the cache base, before the head
// offset): through the block table when there is one. Indices are clamped: a bad table or
// cache_batch_idx gives wrong numbers, never a read outside the cache.
__device__ __forceinline__ int64_t cache_row_offset(const fa3gen_decode_params& p, int64_t batch_stride,
                                                    int64_t row_stride, int cache_b, int b, int key) {
  if (p.block_table != nullptr) {
    return int64_t(page_of(p, b, key)) * batch_stride + int64_t(key % p.page_size) * row_stride;
  }
  return int64_t(cache_b) * batch_stride + int64_t(key) * row_stride;
}

// Keys [start, end) of one split for the rows r = local query head * seqlen_q + query index of
// kv head `head_kv`: the normalized partial O and its LSE, into the output when there is one
// split, else into the fp32 workspace the combine kernel reads.
template <class T, int HeadDim, bool KvFp8>
__global__ void __launch_bounds__(kWarps * 32) split_kernel(const fa3gen_decode_params p) {
  using C = Config<HeadDim, KvFp8>;
  using CacheT = std::conditional_t<KvFp8, uint8_t, T>;
  // An e4m3 cache converts to f16 in one instruction per pair (to bf16 it takes three), so its
  // mma runs in f16 whatever q's dtype (bf16 q: see the Q staging).
  constexpr int kSteps = HeadDim / 16;  // k steps of Q K^T
  constexpr int kLoads = kSlice * C::kCacheChunks / 32;  // 16-byte chunks per lane per K (or V) slice
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float warp_m[kWarps][kRows], warp_l[kWarps][kRows];

  const int split = blockIdx.x, head_kv = blockIdx.y, b = blockIdx.z;
  // A programmatic dependent of the kernel before it (the previous decode step's combine or
  // split kernel): placed while that one drains, it waits here until its writes are visible.
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceStart);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceReleased);
  asm volatile("griddepcontrol.launch_dependents;");  // the combine kernel may be placed now
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int group = p.heads_q / p.heads_kv, rows = group * p.seqlen_q;
  const int seqlen_k = p.cache_seqlens ? min(max(p.cache_seqlens[b], 0), p.seqlen_k) : p.seqlen_k;
  const int cache_b = p.cache_batch_idx ? min(max(p.cache_batch_idx[b], 0), p.cache_rows - 1) : b;
  // Query i of the sequence sits at position seqlen_k - seqlen_q + i (bottom-right aligned) and
  // sees keys [position - left, position + right]; -1: unbounded. The splits share the keys
  // that some row sees (from the first query's window start, down to a slice boundary), so
  // the work grows with the window, not with the cache.
  const int left = p.window_left, right = p.causal ? 0 : p.window_right;
  const int lo = left >= 0 ? max(0, seqlen_k - p.seqlen_q - left) / kSlice * kSlice : 0;
  constexpr int kSplitAlign = kWarps * kSlice;
  const int span = seqlen_k - lo;
  const int per_split = ((span + p.num_splits - 1) / p.num_splits + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  const int start = lo + split * per_split, end = min(seqlen_k, start + per_split);
  const int slices = end > start ? (end - start + kSlice - 1) / kSlice : 0;
  const int my_slices = slices > warp ? (slices - 1 - warp) / kWarps + 1 : 0;  // slices warp, warp + 4, ...
  // Softcap: scores become softcap * tanh(scale * s / softcap), already scaled for the softmax.
  // An e4m3 cache: K's factor joins the softmax scale, V's the output's normalization.
  const float k_factor = KvFp8 ? kv_scale(p.k_scale, p.k_scale_value, p, b, head_kv) : 1.f;
  const float v_factor = KvFp8 ? kv_scale(p.v_scale, p.v_scale_value, p, b, head_kv) : 1.f;
  const CacheT* kc = static_cast<const CacheT*>(p.k_cache);
  const CacheT* vc = static_cast<const CacheT*>(p.v_cache);

  // This lane's two rows (g and g + 8): the first and last key each sees.
  int first_key[2], last_key[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = g + 8 * j, position = seqlen_k - p.seqlen_q + r % p.seqlen_q;
    first_key[j] = (left >= 0 && r < rows) ? position - left : 0;
    last_key[j] = (right >= 0 && r < rows) ? position + right : seqlen_k - 1;
  }

  uint8_t* q_smem = smem;
  uint8_t* ring = smem + C::kQBytes + warp * C::kRingBytes;  // stage s: K at 2s, V at 2s + 1
  // Pages of a multiple of 16 rows hold whole slices (slices start at multiples of 16): one
  // block-table read per slice, issued an iteration before its copies need it. Other page
  // sizes read the table per row.
  const bool paged = p.block_table != nullptr, slice_in_page = paged && p.page_size % kSlice == 0;
  auto slice_page = [&](int n) {  // the page of the warp's n-th slice (0 when not needed)
    const int key0 = start + (warp + n * kWarps) * kSlice;
    if (!slice_in_page || n >= my_slices) return 0;
    return page_of(p, b, key0);
  };
  auto load_slice = [&](int n, int page) {  // the warp's n-th slice into stage n % kStages
    const int key0 = start + (warp + n * kWarps) * kSlice;
    uint8_t* k_dst = ring + (n % C::kStages) * 2 * C::kCacheSliceBytes;
    uint8_t* v_dst = k_dst + C::kCacheSliceBytes;
    // The slice's first row: in its page, or in the sequence's row of a contiguous cache.
    const int64_t first_row = slice_in_page ? key0 % p.page_size : key0;
    const int64_t k_base = (slice_in_page ? int64_t(page) : int64_t(cache_b)) * p.k_batch_stride +
                           int64_t(head_kv) * p.k_head_stride;
    const int64_t v_base = (slice_in_page ? int64_t(page) : int64_t(cache_b)) * p.v_batch_stride +
                           int64_t(head_kv) * p.v_head_stride;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int idx = lane + 32 * i, row = idx / C::kCacheChunks, chunk = idx % C::kCacheChunks;
      const bool valid = key0 + row < end;
      const int safe_row = valid ? row : 0;  // keeps the (unread) address inside the cache
      int64_t k_off, v_off;
      if (paged && !slice_in_page) {
        k_off = cache_row_offset(p, p.k_batch_stride, p.k_row_stride, cache_b, b, key0 + safe_row) +
                int64_t(head_kv) * p.k_head_stride;
        v_off = cache_row_offset(p, p.v_batch_stride, p.v_row_stride, cache_b, b, key0 + safe_row) +
                int64_t(head_kv) * p.v_head_stride;
      } else {
        k_off = k_base + (first_row + safe_row) * p.k_row_stride;
        v_off = v_base + (first_row + safe_row) * p.v_row_stride;
      }
      const int dst = swizzled_row<HeadDim * C::kElemBytes>(row, chunk);
      constexpr int kPerChunk = 16 / sizeof(CacheT);
      cp_async_16(smem_addr(k_dst + dst), kc + k_off + chunk * kPerChunk, valid);
      cp_async_16(smem_addr(v_dst + dst), vc + v_off + chunk * kPerChunk, valid);
    }
  };
  // Q: the rows of this kv head, zero-padded to 16. Each thread reads its pairs of 16-byte
  // chunks (c, c + 1 of row r) into registers before the first K/V copies are issued: read
  // after them, Q waited behind the whole GPU's queued copies (the loop started 4.4-5.4 us
  // after launch at 67 MB, H200).
  auto q_chunk = [&](int r, int chunk) {  // 8 values of row r (zeros past the rows)
    if (r >= rows) return make_uint4(0, 0, 0, 0);
    const int head = head_kv * group + r / p.seqlen_q, qi = r % p.seqlen_q;
    return *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + int64_t(b) * p.q_batch_stride +
                                           int64_t(qi) * p.q_row_stride + int64_t(head) * p.q_head_stride +
                                           chunk * 8);
  };
  constexpr int kPairs = kRows * C::kChunks / 2, kPairsPerThread = (kPairs + kWarps * 32 - 1) / (kWarps * 32);
  uint4 q_pairs[kPairsPerThread][2];
#pragma unroll
  for (int k = 0; k < kPairsPerThread; ++k) {
    const int i = threadIdx.x + k * kWarps * 32, r = i / (C::kChunks / 2), c = 2 * (i % (C::kChunks / 2));
    q_pairs[k][0] = i < kPairs ? q_chunk(r, c) : make_uint4(0, 0, 0, 0);
    q_pairs[k][1] = i < kPairs ? q_chunk(r, c + 1) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int n = 0; n < C::kStages - 1; ++n) {
    if (n < my_slices) load_slice(n, slice_page(n));
    cp_async_commit();  // empty groups keep the count uniform
  }
  // Q into shared memory (swizzled).
  float q_pow = 1.f;  // q entered the mma as q / q_pow
  if constexpr (KvFp8) {
    // The f16 mma. bf16 q is scaled by 2^-e, e the least that keeps this CTA's largest |q|
    // below 2^15 (f16 tops at 65504); exact (a power of two), and f16 keeps bf16's 8 bits.
    if constexpr (!std::is_same_v<T, __half>) {
      __shared__ int q_amax_bits;  // a non-negative float's bits order as ints
      if (threadIdx.x == 0) q_amax_bits = 0;
      __syncthreads();
      float amax = 0.f;
#pragma unroll
      for (int k = 0; k < kPairsPerThread; ++k) {
        for (const uint4& v : q_pairs[k]) {
          for (const uint32_t w : {v.x, v.y, v.z, v.w}) {
            const float2 f = bf16x2_to_float2(w);
            amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
          }
        }
      }
      amax = warp_max(amax);
      if (lane == 0) atomicMax(&q_amax_bits, __float_as_int(amax));
      __syncthreads();
      const int e = max(0, ((q_amax_bits >> 23) & 0xff) - 127 - 14);
      q_pow = exp2f(float(e));
      const float q_mul = exp2f(float(-e));
#pragma unroll
      for (int k = 0; k < kPairsPerThread; ++k) {
        for (uint4& v : q_pairs[k]) {
          for (uint32_t* w : {&v.x, &v.y, &v.z, &v.w}) {
            const float2 f = bf16x2_to_float2(*w);
            *w = pack2<__half>(f.x * q_mul, f.y * q_mul);
          }
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kPairsPerThread; ++k) {
    const int i = threadIdx.x + k * kWarps * 32, r = i / (C::kChunks / 2), c = 2 * (i % (C::kChunks / 2));
    const uint4 v0 = q_pairs[k][0], v1 = q_pairs[k][1];
    if (i < kPairs) {
      if constexpr (KvFp8) {  // each 16 columns in the order qk_fp8's K fragments take: value
                              // pairs 0 2 4 6, then 1 3 5 7
        *reinterpret_cast<uint4*>(q_smem + swizzled<HeadDim>(r, c)) = make_uint4(v0.x, v0.z, v1.x, v1.z);
        *reinterpret_cast<uint4*>(q_smem + swizzled<HeadDim>(r, c + 1)) = make_uint4(v0.y, v0.w, v1.y, v1.w);
      } else {
        *reinterpret_cast<uint4*>(q_smem + swizzled<HeadDim>(r, c)) = v0;
        *reinterpret_cast<uint4*>(q_smem + swizzled<HeadDim>(r, c + 1)) = v1;
      }
    }
  }
  const float qk_scale = p.softmax_scale * k_factor * q_pow;
  const bool capped = p.softcap > 0.f;
  const float cap_in = capped ? qk_scale / p.softcap : 0.f;
  const float score_scale = capped ? 1.f : qk_scale;  // of the scores the softmax sees
  const float scale_log2 = score_scale * float(M_LOG2E);

  int next_page = slice_page(C::kStages - 1);
  __syncthreads();  // Q is in shared memory
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceQStaged);

  float o[HeadDim / 8][4];
#pragma unroll
  for (int n = 0; n < HeadDim / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this lane's part of the row sum

  for (int n = 0; n < my_slices; ++n) {
    if (n + C::kStages - 1 < my_slices) load_slice(n + C::kStages - 1, next_page);
    next_page = slice_page(n + C::kStages);  // read now, used by the next iteration
    cp_async_commit();
    cp_async_wait<C::kStages - 1>();  // slice n has landed (this lane's copies) ...
    __syncwarp();                     // ... and every lane's
    FA3GEN_DECODE_STAMP(n == 0 && threadIdx.x == 0, kTraceFirstSlice);
    const uint8_t* k_tile = ring + (n % C::kStages) * 2 * C::kCacheSliceBytes;
    const uint8_t* v_tile = k_tile + C::kCacheSliceBytes;
    const int key0 = start + (warp + n * kWarps) * kSlice;

    // S (16 rows x 16 keys) = Q K^T: s[nb] holds keys 8 nb + 2t, +1 of rows g (0, 1), g + 8 (2, 3).
    float s[2][4] = {};
    if constexpr (KvFp8) {
      qk_fp8<HeadDim>(s, q_smem, k_tile, lane);
    } else {
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {
        uint32_t a[4], kb[4];
        const int mi = lane / 8;
        ldmatrix_x4(a, smem_addr(q_smem + swizzled<HeadDim>((mi & 1) * 8 + lane % 8, 2 * ks + (mi >> 1))));
        ldmatrix_x4(kb, smem_addr(k_tile + swizzled<HeadDim>((mi >> 1) * 8 + lane % 8, 2 * ks + (mi & 1))));
        mma_16816<T>(s[0], a, kb[0], kb[1]);
        mma_16816<T>(s[1], a, kb[2], kb[3]);
      }
    }
    // Mask (past the split's end, causal), online softmax; P as the A fragment of P V.
    float alpha[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + nb * 8 + 2 * t + e;
          float& x = s[nb][2 * j + e];
          if (capped) x = p.softcap * tanhf(x * cap_in);
          x = (key < end && key >= first_key[j] && key <= last_key[j]) ? x : -INFINITY;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      // rescale_threshold.cuh: the running maximum stays while a slice raises it by at most
      // the threshold (P below 256), and O is then left as it is.
      const float m_new = fmaxf(m[j], mx);
      if (!((m_new - m[j]) * scale_log2 <= FA3GEN_RESCALE_THRESHOLD)) {  // NaN (no key yet): update
        alpha[j] = exp2f(m[j] * scale_log2 - (m_new == -INFINITY ? 0.f : m_new * scale_log2));
        m[j] = m_new;
      } else {
        alpha[j] = 1.f;
      }
      const float m_scaled = m[j] == -INFINITY ? 0.f : m[j] * scale_log2;  // no key yet: keep 0s
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[nb][2 * j + e];
          x = exp2f(fmaf(x, scale_log2, -m_scaled));
          sum += x;
        }
      }
      l[j] = l[j] * alpha[j] + sum;
    }
    using M = std::conditional_t<KvFp8, __half, T>;  // the mma's 16-bit type
    const uint32_t pa[4] = {pack2<M>(s[0][0], s[0][1]), pack2<M>(s[0][2], s[0][3]),
                            pack2<M>(s[1][0], s[1][1]), pack2<M>(s[1][2], s[1][3])};
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // warp-uniform
#pragma unroll
      for (int n = 0; n < HeadDim / 8; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
    }
    if constexpr (KvFp8) {
      pv_fp8<HeadDim>(o, pa, v_tile, lane);
    } else {
#pragma unroll
      for (int nd = 0; nd < HeadDim / 8; nd += 2) {
        uint32_t vb[4];
        const int mi = lane / 8;
        ldmatrix_x4_trans(vb, smem_addr(v_tile + swizzled<HeadDim>((mi & 1) * 8 + lane % 8, nd + (mi >> 1))));
#pragma unroll
        for (int h = 0; h < 2; ++h) mma_16816<T>(o[nd + h], pa, vb[2 * h], vb[2 * h + 1]);
      }
    }
    __syncwarp();  // every lane is done with this stage before a later load_slice refills it
  }
  cp_async_wait<0>();
  FA3GEN_DECODE_STAMP(lane == 0, kTraceWarpDone + warp);

  // Merge the four warps behind one barrier: each writes its rows' maximum and sum and its
  // unscaled partial output into its own ring (its copies have all landed: no barrier needed
  // first); then each thread rescales and sums one row chunk of the four.
  float* own = reinterpret_cast<float*>(ring);  // (row, column)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    l[j] += __shfl_xor_sync(0xffffffff, l[j], 1);
    l[j] += __shfl_xor_sync(0xffffffff, l[j], 2);
    const int r = g + 8 * j;
    if (t == 0) {
      warp_m[warp][r] = m[j];
      warp_l[warp][r] = l[j];
    }
    if (r >= rows) continue;  // padding rows of the M tile: never read
    float* row_out = own + r * C::kMergeStride;
    if constexpr (KvFp8) {  // o[2c], o[2c + 1]: columns 16c + 4t + (0, 2), (1, 3) (pv_fp8)
#pragma unroll
      for (int c = 0; c < HeadDim / 16; ++c) {
        *reinterpret_cast<float4*>(row_out + 16 * c + 4 * t) =
            make_float4(o[2 * c][2 * j], o[2 * c + 1][2 * j], o[2 * c][2 * j + 1], o[2 * c + 1][2 * j + 1]);
      }
    } else {
#pragma unroll
      for (int n = 0; n < HeadDim / 8; ++n) {
        *reinterpret_cast<float2*>(row_out + n * 8 + 2 * t) = make_float2(o[n][2 * j], o[n][2 * j + 1]);
      }
    }
  }
  __syncthreads();
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceMerged);
  // Row r's maximum over the warps, each warp's factor to it and the row's sum.
  auto row_merge = [&](int r, float (&f)[kWarps], float& mx, float& sum) {
    mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, warp_m[w][r]);
    sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      f[w] = mx == -INFINITY ? 0.f : exp2f((warp_m[w][r] - mx) * scale_log2);
      sum = fmaf(warp_l[w][r], f[w], sum);
    }
  };
  for (int i = threadIdx.x; i < rows * C::kChunks; i += kWarps * 32) {
    const int r = i / C::kChunks, col = (i % C::kChunks) * 8;
    float f[kWarps], mx, sum;
    row_merge(r, f, mx, sum);
    const float inv = sum > 0.f ? v_factor / sum : 0.f;
    float v[8] = {};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float* part = reinterpret_cast<const float*>(smem + C::kQBytes + w * C::kRingBytes);
      const float4* src = reinterpret_cast<const float4*>(part + r * C::kMergeStride + col);
      const float4 x0 = src[0], x1 = src[1];
      v[0] = fmaf(f[w], x0.x, v[0]); v[1] = fmaf(f[w], x0.y, v[1]);
      v[2] = fmaf(f[w], x0.z, v[2]); v[3] = fmaf(f[w], x0.w, v[3]);
      v[4] = fmaf(f[w], x1.x, v[4]); v[5] = fmaf(f[w], x1.y, v[5]);
      v[6] = fmaf(f[w], x1.z, v[6]); v[7] = fmaf(f[w], x1.w, v[7]);
    }
    const int head = head_kv * group + r / p.seqlen_q, qi = r % p.seqlen_q;
    const int64_t row = (int64_t(b) * p.heads_q + head) * p.seqlen_q + qi;  // (b, hq, sq)
    if (p.num_splits == 1) {
      uint4 packed;
      uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
      for (int e = 0; e < 4; ++e) words[e] = pack2<T>(v[2 * e] * inv, v[2 * e + 1] * inv);
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + int64_t(b) * p.out_batch_stride +
                                int64_t(qi) * p.out_row_stride + int64_t(head) * p.out_head_stride + col) = packed;
    } else {
      float4* acc = reinterpret_cast<float4*>(p.o_accum + (row * p.num_splits + split) * HeadDim + col);
      acc[0] = make_float4(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv);
      acc[1] = make_float4(v[4] * inv, v[5] * inv, v[6] * inv, v[7] * inv);
    }
  }
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceStored);  // its own stores issued
  if (threadIdx.x < rows) {  // LSE in natural log; -inf for a row without keys
    const int r = threadIdx.x;
    const int head = head_kv * group + r / p.seqlen_q, qi = r % p.seqlen_q;
    const int64_t row = (int64_t(b) * p.heads_q + head) * p.seqlen_q + qi;
    float f[kWarps], mx, sum;
    row_merge(r, f, mx, sum);
    const float lse = sum > 0.f ? mx * score_scale + logf(sum) : -INFINITY;
    if (p.num_splits == 1) {
      p.lse[row] = lse;
    } else {
      p.lse_accum[row * p.num_splits + split] = lse;
    }
  }
}

// Merge the splits of one (b, head, query) row: O = sum_s exp(lse_s - lse) O_s. Launched as a
// programmatic dependent of the split kernel: its blocks are placed while the split kernel
// drains and wait here until its partials are complete and visible. Its time is a tail after
// the split kernel, so it is built for latency: warp w takes splits w, w + 4, ..., and issues
// the loads of up to kBatch of them together with the LSE loads, so that up to 32 splits cost
// one round trip to L2 (the earlier one-warp version took one for the LSEs and one per 8 splits:
// 3.1 us after the split kernel at 29 splits, H200).
constexpr int kCombineWarps = 4;

template <class T, int HeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const fa3gen_decode_params p) {
  constexpr int E = HeadDim / 32;  // columns per lane
  constexpr int kBatch = 8;        // splits per warp whose partials are in flight at once
  struct alignas(E * 4 <= 16 ? E * 4 : 16) Part { float v[E]; };
  __shared__ float warp_o[kCombineWarps][HeadDim];
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceStart, kTraceCtas);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceReleased, kTraceCtas);
  asm volatile("griddepcontrol.launch_dependents;");  // the next call's split kernel may be placed
  const int64_t row = blockIdx.x;  // (b, hq, sq) flattened
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, splits = p.num_splits;
  const float* lses = p.lse_accum + row * splits;
  const float* parts = p.o_accum + row * splits * HeadDim + lane * E;
  auto load_batch = [&](int s0, Part (&part)[kBatch], float (&w)[kBatch]) {  // splits s0 + warp + 4j
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = s0 + warp + kCombineWarps * j;
      const int safe = min(s, splits - 1);  // past the last split: a valid address, weight 0
      part[j] = *reinterpret_cast<const Part*>(parts + int64_t(safe) * HeadDim);
      w[j] = s < splits ? lses[safe] : -INFINITY;
    }
  };
  Part part[kBatch];
  float w[kBatch];
  load_batch(0, part, w);
  float lmax = -INFINITY;
  for (int s = lane; s < splits; s += 32) lmax = fmaxf(lmax, lses[s]);
  lmax = warp_max(lmax);
  float total = 0.f;
  if (lmax != -INFINITY) {
    for (int s = lane; s < splits; s += 32) total += expf(lses[s] - lmax);
  }
  total = warp_sum(total);
  const float lse = lmax == -INFINITY ? -INFINITY : lmax + logf(total);
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceQStaged, kTraceCtas);
  float o[E] = {};
  if (lmax != -INFINITY) {
    for (int s0 = 0;;) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float wj = expf(w[j] - lse);  // 0 for an empty split and past the last one
#pragma unroll
        for (int i = 0; i < E; ++i) o[i] = fmaf(wj, part[j].v[i], o[i]);
      }
      s0 += kCombineWarps * kBatch;
      if (s0 >= splits) break;
      load_batch(s0, part, w);
    }
  }
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceFirstSlice, kTraceCtas);
#pragma unroll
  for (int i = 0; i < E; ++i) warp_o[warp][lane * E + i] = o[i];
  __syncthreads();
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceMerged, kTraceCtas);
  const int qi = int(row % p.seqlen_q), head = int((row / p.seqlen_q) % p.heads_q);
  const int b = int(row / (int64_t(p.seqlen_q) * p.heads_q));
  T* out = static_cast<T*>(p.out) + int64_t(b) * p.out_batch_stride + int64_t(qi) * p.out_row_stride +
           int64_t(head) * p.out_head_stride;
  for (int c = threadIdx.x; c < HeadDim; c += kCombineWarps * 32) {
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kCombineWarps; ++k) sum += warp_o[k][c];
    from_float(sum, out[c]);
  }
  if (threadIdx.x == 0) p.lse[row] = lse;
  FA3GEN_DECODE_STAMP(threadIdx.x == 0, kTraceStored, kTraceCtas);
}

template <class T, int HeadDim, bool KvFp8>
struct SplitKernelTag {};

template <class T, int HeadDim, bool KvFp8>
int launch(const fa3gen_decode_params& p, cudaStream_t stream) {
  constexpr int smem = Config<HeadDim, KvFp8>::kSmemBytes;
  // Every split_kernel instance has the same function type: the tag keeps their flags apart.
  cudaError_t err =
      set_smem_limit_once<SplitKernelTag<T, HeadDim, KvFp8>>(split_kernel<T, HeadDim, KvFp8>, smem);
  if (err != cudaSuccess) return report("cudaFuncSetAttribute (decode shared memory)", err);
  // Both kernels are programmatic dependents of the kernel before them (griddepcontrol.wait
  // at their start): each grid is set up while the one before drains, instead of after it
  // retires (the split kernel started 0.9 us after the previous step's combine, H200 graph).
  err = launch_programmatic(split_kernel<T, HeadDim, KvFp8>, dim3(p.num_splits, p.heads_kv, p.batch),
                            dim3(kWarps * 32), smem, stream, p);
  if (err != cudaSuccess) return report("decode split launch", err);
  if (p.num_splits > 1) {
    err = launch_programmatic(combine_kernel<T, HeadDim>, dim3(unsigned(int64_t(p.batch) * p.heads_q * p.seqlen_q)),
                              dim3(kCombineWarps * 32), 0, stream, p);
    if (err != cudaSuccess) return report("decode combine launch", err);
  }
  err = cudaGetLastError();
  return err == cudaSuccess ? 0 : report("decode kernel launch", err);
}

}  // namespace decode

// The checks of fa3gen_decode_fwd before it picks an instantiation (templates/decode.cu.j2
// instantiates the (dtype, head dim) pairs its spec's `decode:` lists).
inline int check_decode(const fa3gen_decode_params& p) {
  const int rows = p.heads_kv > 0 ? p.heads_q / p.heads_kv * p.seqlen_q : 0;
  if (p.batch < 1 || p.seqlen_q < 1 || p.heads_kv < 1 || p.heads_q % p.heads_kv != 0 || rows > decode::kRows ||
      p.num_splits < 1 || p.batch > 65535 || p.heads_kv > 65535 || p.num_splits > 65535 ||
      (p.block_table != nullptr && p.page_size < 1) || (p.num_splits > 1 && p.o_accum == nullptr) ||
      p.cache_rows < 1 || (p.block_table == nullptr && p.cache_batch_idx == nullptr && p.cache_rows < p.batch)) {
    fa3gen_set_error("decode: invalid sizes (rows = heads_q / heads_kv * seqlen_q must be 1..16, "
                     "num_splits >= 1 with a workspace when > 1, batch, heads_kv and num_splits at most 65535, "
                     "page_size >= 1 when paged, "
                     "cache_rows >= 1 and >= batch without cache_batch_idx)");
    return 1;
  }
  return 0;
}

}  // namespace fa3gen
