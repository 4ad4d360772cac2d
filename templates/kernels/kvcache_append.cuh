// New keys and values into a KV cache (fa3gen_kvcache_append): what flash_attn_with_kvcache's
// k, v did as about twenty PyTorch operations (index arithmetic, gathers, index_put) in one
// launch before the decode kernel. A byte copy: one thread per 16-byte chunk of a new row, k
// and v in one grid; an e4m3 cache gets rows already quantized. Positions at or past the
// capacity are not written, as the PyTorch path, so nothing outside the cache is touched.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include "fa3gen_abi.h"
#include "launch_common.cuh"

namespace fa3gen {
namespace append {

constexpr int kChunkBytes = 16;
constexpr int kThreads = 256;

// The element offset in k_cache (v: v_cache) of new row i of sequence b, kv head h, or -1 when
// its position is at or past the capacity. Host and device: tests/test_compile.py checks it on
// the CPU against the PyTorch path's positions.
__host__ __device__ inline int64_t cache_offset(const fa3gen_append_params& p, int b, int i, int h,
                                                bool v) {
  const int64_t seqlen = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen;
  const int64_t pos = (seqlen > 0 ? seqlen : 0) + i;
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

// Chunk t of k_new (t < tensor_chunks) or of v_new (the rest) copied to its cache row, if the
// row is within the capacity. Host and device (the CPU test runs every t on host memory).
__host__ __device__ inline void copy_chunk(const fa3gen_append_params& p, int64_t t) {
  const int chunks = row_chunks(p);
  const int64_t per_tensor = tensor_chunks(p);
  const bool v = t >= per_tensor;
  int64_t r = v ? t - per_tensor : t;
  const int chunk = int(r % chunks);
  r /= chunks;
  const int h = int(r % p.heads_kv);
  r /= p.heads_kv;
  const int i = int(r % p.seqlen_new);
  const int b = int(r / p.seqlen_new);
  const int64_t dst = cache_offset(p, b, i, h, v);
  if (dst < 0) return;
  const int64_t src = int64_t(b) * (v ? p.v_new_batch_stride : p.k_new_batch_stride) +
                      int64_t(i) * (v ? p.v_new_row_stride : p.k_new_row_stride) +
                      int64_t(h) * (v ? p.v_new_head_stride : p.k_new_head_stride);
  const char* from = static_cast<const char*>(v ? p.v_new : p.k_new) + src * p.element_bytes;
  char* to = static_cast<char*>(v ? p.v_cache : p.k_cache) + dst * p.element_bytes;
  reinterpret_cast<uint4*>(to)[chunk] = reinterpret_cast<const uint4*>(from)[chunk];
}

__global__ void __launch_bounds__(kThreads) append_kernel(const fa3gen_append_params p) {
  const int64_t total = 2 * tensor_chunks(p);
  for (int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x; t < total; t += int64_t(gridDim.x) * kThreads) {
    copy_chunk(p, t);
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

// One launch on `stream`: a grid-stride loop over every 16-byte chunk of k_new and v_new.
inline int launch_append(const fa3gen_append_params& p, cudaStream_t stream) {
  if (int rc = check_append(p)) return rc;
  const int64_t chunks = 2 * append::tensor_chunks(p);
  const int blocks = int(std::min<int64_t>((chunks + append::kThreads - 1) / append::kThreads, 4096));
  append::append_kernel<<<blocks, append::kThreads, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : report("kvcache append launch", err);
}

}  // namespace fa3gen
