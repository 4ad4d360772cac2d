// New keys and values into a KV cache (fa3gen_kvcache_append): what flash_attn_with_kvcache's
// k, v did as about twenty PyTorch operations (index arithmetic, gathers, index_put) in one
// launch before the decode kernel. A byte copy: one thread per 16-byte chunk of a new row, k
// and v in one grid; an e4m3 cache gets rows already quantized. Positions at or past the
// capacity are not written, as the PyTorch path, so nothing outside the cache is touched.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include "fa3gen_abi.h"
#include "launch_common.cuh"

namespace fa3gen {
namespace append {

constexpr int kChunkBytes = 16;
constexpr int kThreads = 256;

// A sequence's first new position (cache_seqlens[b] or seqlen; negative values read as 0).
__host__ __device__ inline int64_t start_position(const fa3gen_append_params& p, int b) {
  const int64_t seqlen = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen;
  return seqlen > 0 ? seqlen : 0;
}

// The element offset in k_cache (v: v_cache) of new row i of sequence b, kv head h, or -1 when
// its position is at or past the capacity. Host and device: tests/test_compile.py checks it on
// the CPU against the PyTorch path's positions.
__host__ __device__ inline int64_t cache_offset(const fa3gen_append_params& p, int b, int i, int h,
                                                bool v) {
  const int64_t pos = start_position(p, b) + i;
  if (pos >= p.capacity) return -1;
  const int64_t batch_stride = v ? p.v_batch_stride : p.k_batch_stride;
  const int64_t row_stride = v ? p.v_row_stride : p.k_row_stride;
  const int64_t head = int64_t(h) * (v ? p.v_head_stride : p.k_head_stride);
  int64_t row;  // the cache batch row (contiguous) or page (paged), clamped into range
  int64_t in_row = pos;
  if (p.block_table != nullptr) {
    row = p.block_table[int64_t(b) * p.block_table_batch_stride + pos / p.page_size];
    in_row = pos % p.page_size;
  } else {
    row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
  }
  row = row < 0 ? 0 : (row >= p.cache_rows ? p.cache_rows - 1 : row);
  return row * batch_stride + in_row * row_stride + head;
}

// 16-byte chunks per row, and per tensor (k_new or v_new).
__host__ __device__ inline int row_chunks(const fa3gen_append_params& p) {
  return p.head_dim * p.element_bytes / kChunkBytes;
}
__host__ __device__ inline int64_t tensor_chunks(const fa3gen_append_params& p) {
  return int64_t(p.batch) * p.seqlen_new * p.heads_kv * row_chunks(p);
}

// Where chunk t of k_new (t < tensor_chunks) or of v_new (the rest) lies: the new row's element
// offset (src), its cache row's (dst, -1 when past the capacity), the chunk in the row, and the
// row's sequence and index there.
struct ChunkPlace {
  bool v;
  int b, i, chunk;
  int64_t src, dst;
};

__host__ __device__ inline ChunkPlace place_chunk(const fa3gen_append_params& p, int64_t t) {
  ChunkPlace c;
  const int chunks = row_chunks(p);
  const int64_t per_tensor = tensor_chunks(p);
  c.v = t >= per_tensor;
  int64_t r = c.v ? t - per_tensor : t;
  c.chunk = int(r % chunks);
  r /= chunks;
  const int h = int(r % p.heads_kv);
  r /= p.heads_kv;
  c.i = int(r % p.seqlen_new);
  c.b = int(r / p.seqlen_new);
  c.dst = cache_offset(p, c.b, c.i, h, c.v);
  c.src = int64_t(c.b) * (c.v ? p.v_new_batch_stride : p.k_new_batch_stride) +
          int64_t(c.i) * (c.v ? p.v_new_row_stride : p.k_new_row_stride) +
          int64_t(h) * (c.v ? p.v_new_head_stride : p.k_new_head_stride);
  return c;
}

// A placed chunk copied to its cache row, if the row is within the capacity.
__host__ __device__ inline void copy_placed(const fa3gen_append_params& p, const ChunkPlace& c) {
  if (c.dst < 0) return;
  const char* from = static_cast<const char*>(c.v ? p.v_new : p.k_new) + c.src * p.element_bytes;
  char* to = static_cast<char*>(c.v ? p.v_cache : p.k_cache) + c.dst * p.element_bytes;
  reinterpret_cast<uint4*>(to)[c.chunk] = reinterpret_cast<const uint4*>(from)[c.chunk];
}

// Chunk t of k_new or v_new copied. Host and device (the CPU test runs every t on host memory).
__host__ __device__ inline void copy_chunk(const fa3gen_append_params& p, int64_t t) {
  copy_placed(p, place_chunk(p, t));
}

// --- The rotary embedding (fa3gen_rotary_params) -------------------------------------------
// fp32 arithmetic rounded at every step, as PyTorch's separate elementwise operations round it:
// no fused multiply-add, and subnormals kept (inline PTX without .ftz: the library is built
// with --use_fast_math, under which __fmul_rn and friends flush them). The host build of the
// CPU test has neither.
#ifdef __CUDA_ARCH__
#define FA3GEN_RN_OP(name, op, expr)                                                  \
  __host__ __device__ inline float name(float a, float b) {                          \
    float r;                                                                         \
    asm(op " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                             \
    return r;                                                                        \
  }
#else
#define FA3GEN_RN_OP(name, op, expr) \
  __host__ __device__ inline float name(float a, float b) { return expr; }
#endif
FA3GEN_RN_OP(mul_rn, "mul.rn.f32", a * b)
FA3GEN_RN_OP(add_rn, "add.rn.f32", a + b)
FA3GEN_RN_OP(sub_rn, "sub.rn.f32", a - b)
#undef FA3GEN_RN_OP

// A 16-bit value's float, and a float rounded to nearest even into 16-bit bits (PyTorch's
// .to(dtype)): CUDA's conversions, host and device; on the device plain cvt, so subnormals are
// kept under --use_fast_math too.
__host__ __device__ inline float half_bits_to_float(uint16_t h, bool fp16) {
  if (fp16) {
    __half_raw raw;
    raw.x = h;
    return __half2float(__half(raw));
  }
  __nv_bfloat16_raw raw;
  raw.x = h;
  return __bfloat162float(__nv_bfloat16(raw));
}
__host__ __device__ inline uint16_t float_to_half_bits(float f, bool fp16) {
  return fp16 ? __half_raw(__float2half_rn(f)).x : __nv_bfloat16_raw(__float2bfloat16_rn(f)).x;
}

__host__ __device__ inline float table_at(const void* table, int64_t row_stride, int64_t col_stride,
                                          int64_t row, int col, int type) {
  const int64_t at = row * row_stride + int64_t(col) * col_stride;
  if (type == 0) return static_cast<const float*>(table)[at];
  return half_bits_to_float(static_cast<const uint16_t*>(table)[at], type == 2);
}

// Chunk `chunk` (8 values) of a 16-bit row rotated at `position` (clamped to the table's rows).
__host__ __device__ inline uint4 rotate_chunk(const fa3gen_rotary_params& r, const uint16_t* row,
                                              int chunk, int64_t position) {
  const bool fp16 = r.fp16 != 0;
  const int64_t at = position < 0 ? 0 : (position >= r.rows ? r.rows - 1 : position);
  const int half = r.rotary_half;
  uint16_t out[8];
  for (int j = 0; j < 8; ++j) {
    const int e = chunk * 8 + j;
    if (e >= 2 * half) {
      out[j] = row[e];
      continue;
    }
    // x1 is the pair's first value, x2 its second; e is one of them.
    const bool first = r.interleaved ? (e % 2 == 0) : e < half;
    const int pair = r.interleaved ? e / 2 : (first ? e : e - half);
    const int partner = r.interleaved ? (e ^ 1) : (first ? e + half : e - half);
    const float x1 = half_bits_to_float(row[first ? e : partner], fp16);
    const float x2 = half_bits_to_float(row[first ? partner : e], fp16);
    const float c = table_at(r.cos, r.cos_row_stride, r.cos_col_stride, at, pair, r.cos_type);
    const float s = table_at(r.sin, r.sin_row_stride, r.sin_col_stride, at, pair, r.cos_type);
    const float o = first ? sub_rn(mul_rn(x1, c), mul_rn(x2, s)) : add_rn(mul_rn(x1, s), mul_rn(x2, c));
    out[j] = float_to_half_bits(o, fp16);
  }
  uint4 packed;
  memcpy(&packed, out, 16);
  return packed;
}

__host__ __device__ inline int64_t q_chunks(const fa3gen_append_params& p, const fa3gen_rotary_params& r) {
  return int64_t(p.batch) * r.seqlen_q * r.heads_q * row_chunks(p);
}

// Work item t of the rotary append: the q chunks first (rotated into q_out), then k_new's
// (rotated into the cache), then v_new's (copied). Host and device, as copy_chunk.
__host__ __device__ inline void rotary_chunk(const fa3gen_append_params& p, const fa3gen_rotary_params& r,
                                             int64_t t) {
  const int chunks = row_chunks(p);
  const int64_t in_q = q_chunks(p, r);
  if (t >= in_q) {
    const ChunkPlace c = place_chunk(p, t - in_q);
    if (c.v || c.dst < 0) return copy_placed(p, c);
    const uint16_t* from = static_cast<const uint16_t*>(p.k_new) + c.src;
    uint16_t* to = static_cast<uint16_t*>(p.k_cache) + c.dst;
    reinterpret_cast<uint4*>(to)[c.chunk] = rotate_chunk(r, from, c.chunk, start_position(p, c.b) + c.i);
    return;
  }
  const int chunk = int(t % chunks);
  const int64_t row = t / chunks;  // (b, i, h) of q, in order: q_out's contiguous row
  const int h = int(row % r.heads_q);
  const int i = int(row / r.heads_q % r.seqlen_q);
  const int b = int(row / r.heads_q / r.seqlen_q);
  const uint16_t* from = static_cast<const uint16_t*>(r.q) + int64_t(b) * r.q_batch_stride +
                         int64_t(i) * r.q_row_stride + int64_t(h) * r.q_head_stride;
  uint16_t* to = static_cast<uint16_t*>(r.q_out) + row * p.head_dim;
  reinterpret_cast<uint4*>(to)[chunk] =
      rotate_chunk(r, from, chunk, start_position(p, b) + (r.q_per_row ? i : 0));
}

// The launch's work items: the chunks of k_new and v_new, and with the rotary embedding q's
// first (rotary_chunk).
__host__ __device__ inline int64_t work_items(const fa3gen_append_params& p, const fa3gen_rotary_params* r) {
  return 2 * tensor_chunks(p) + (r != nullptr ? q_chunks(p, *r) : 0);
}

__global__ void __launch_bounds__(kThreads) append_kernel(const fa3gen_append_params p) {
  const int64_t total = work_items(p, nullptr);
  for (int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x; t < total; t += int64_t(gridDim.x) * kThreads) {
    copy_chunk(p, t);
  }
}

__global__ void __launch_bounds__(kThreads) append_rotary_kernel(const fa3gen_append_params p,
                                                                 const fa3gen_rotary_params r) {
  const int64_t total = work_items(p, &r);
  for (int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x; t < total; t += int64_t(gridDim.x) * kThreads) {
    rotary_chunk(p, r, t);
  }
}

}  // namespace append

inline int check_append(const fa3gen_append_params& p) {
  const bool sizes = p.batch >= 1 && p.seqlen_new >= 1 && p.heads_kv >= 1 && p.cache_rows >= 1 &&
                     (p.element_bytes == 1 || p.element_bytes == 2) && p.head_dim >= 1 &&
                     (p.head_dim * p.element_bytes) % append::kChunkBytes == 0 &&
                     (p.block_table == nullptr || p.page_size >= 1);
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % append::kChunkBytes == 0; };
  const int64_t strides[] = {p.k_new_batch_stride, p.k_new_row_stride, p.k_new_head_stride,
                             p.v_new_batch_stride, p.v_new_row_stride, p.v_new_head_stride,
                             p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                             p.v_batch_stride, p.v_row_stride, p.v_head_stride};
  bool strided = aligned(p.k_new) && aligned(p.v_new) && aligned(p.k_cache) && aligned(p.v_cache);
  for (int64_t s : strides) strided = strided && (s * p.element_bytes) % append::kChunkBytes == 0;
  if (!sizes || !strided) {
    fa3gen_set_error("kvcache append: invalid sizes or layout (batch, seqlen_new, heads_kv, "
                     "cache_rows >= 1; rows of 16-byte multiples; pointers and strides 16-byte "
                     "aligned; page_size >= 1 when paged)");
    return 1;
  }
  return 0;
}

// The rotary params beside append ones: 16-bit rows, a table of positions and pairs.
inline int check_rotary(const fa3gen_append_params& p, const fa3gen_rotary_params& r) {
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % append::kChunkBytes == 0; };
  const bool ok = p.element_bytes == 2 && r.seqlen_q >= 0 && r.heads_q >= 0 && r.rows >= 1 &&
                  r.rotary_half >= 1 && 2 * r.rotary_half <= p.head_dim && r.cos_type >= 0 &&
                  r.cos_type <= 2 && r.q != nullptr && r.cos != nullptr && r.sin != nullptr &&
                  aligned(r.q_out);
  if (!ok) {
    fa3gen_set_error("kvcache append with rotary: invalid params (16-bit rows, seqlen_q and heads_q "
                     ">= 0, rows >= 1, 1 <= rotary_half <= head_dim / 2, cos_type 0-2, q_out "
                     "16-byte aligned)");
    return 1;
  }
  return 0;
}

// One launch on `stream`: a grid-stride loop over every 16-byte chunk of k_new and v_new (and of
// q, with the rotary embedding: rotary non-null).
inline int launch_append(const fa3gen_append_params& p, cudaStream_t stream,
                         const fa3gen_rotary_params* rotary = nullptr) {
  if (int rc = check_append(p)) return rc;
  if (rotary != nullptr) {
    if (int rc = check_rotary(p, *rotary)) return rc;
  }
  const int64_t chunks = append::work_items(p, rotary);
  const int blocks = int(std::min<int64_t>((chunks + append::kThreads - 1) / append::kThreads, 4096));
  if (rotary != nullptr) {
    append::append_rotary_kernel<<<blocks, append::kThreads, 0, stream>>>(p, *rotary);
  } else {
    append::append_kernel<<<blocks, append::kThreads, 0, stream>>>(p);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : report("kvcache append launch", err);
}

}  // namespace fa3gen
