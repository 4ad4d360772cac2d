// Decode attention over a KV cache (fa3gen.flash_attn_with_kvcache): a few query rows per kv
// head against a long cache, contiguous (batch, capacity, heads_kv, d) or paged
// (pages, page_size, heads_kv, d) through a block table, the key range split across CTAs
// (split-KV) and merged by a combine kernel.
//   GQA packing: the heads_q / heads_kv query heads of one kv head, times seqlen_q, are the
//   Rows rows of one warp, so each K and V row is read once per kv head, not once per query
//   head.
//   One warp per (split, kv head, batch). Per key: each lane holds head_dim / 32 columns of
//   K and V (coalesced 16-bit loads), dots reduced across the warp; keys go in chunks of 32 so
//   that lane j owns the score of key j: one exp2 per key and row, a max per chunk.
// Memory-bound by design for Rows <= 8 (two FMAs per byte of K and V per row).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>
#include "fa3gen_abi.h"
#include "launch_common.cuh"
#include "simt_common.cuh"

namespace fa3gen {
namespace decode {

using namespace simt;

// The E columns [lane * E, + E) of cache row (b, key, head) as floats; pages through the
// block table when there is one.
template <class T, int E>
__device__ __forceinline__ void load_cache_row(const fa3gen_decode_params& p, const T* cache, int64_t batch_stride,
                                               int64_t row_stride, int64_t head_stride, int cache_b, int b, int key,
                                               int head, int lane, float (&out)[E]) {
  int64_t offset;
  if (p.block_table != nullptr) {
    const int page = min(max(p.block_table[int64_t(b) * p.block_table_batch_stride + key / p.page_size], 0),
                         p.cache_rows - 1);  // a bad table gives wrong numbers, not a bad read
    offset = int64_t(page) * batch_stride + int64_t(key % p.page_size) * row_stride;
  } else {
    offset = int64_t(cache_b) * batch_stride + int64_t(key) * row_stride;
  }
  const T* src = cache + offset + int64_t(head) * head_stride + lane * E;
  load_floats<T, E>(src, out);
}

// Keys [start, end) of one split for Rows rows (r = local query head * seqlen_q + query
// index) of kv head `head_kv`: partial O (normalized) and LSE, into the final output when there
// is one split, else into the fp32 workspace the combine kernel reads.
template <class T, int HeadDim, int Rows>
__global__ void __launch_bounds__(32) split_kernel(const fa3gen_decode_params p) {
  constexpr int E = HeadDim / 32;
  // K/V rows in flight per warp: one warp per CTA and at most 32 CTAs per SM, so each warp
  // must keep several reads outstanding to cover the memory latency (~16 KB per SM in flight).
  constexpr int kAhead = E <= 4 ? 8 : 4;
  const int split = blockIdx.x, head_kv = blockIdx.y, b = blockIdx.z, lane = threadIdx.x;
  const int group = p.heads_q / p.heads_kv, rows = group * p.seqlen_q;
  // Clamped (bad values give wrong numbers, never reads outside the cache).
  const int seqlen_k = p.cache_seqlens ? min(max(p.cache_seqlens[b], 0), p.seqlen_k) : p.seqlen_k;
  const int cache_b = p.cache_batch_idx ? min(max(p.cache_batch_idx[b], 0), p.cache_rows - 1) : b;
  const int per_split = ((seqlen_k + p.num_splits - 1) / p.num_splits + 31) / 32 * 32;
  const int start = split * per_split, end = min(seqlen_k, start + per_split);
  const float scale_log2 = p.softmax_scale * float(M_LOG2E);
  const T* q = static_cast<const T*>(p.q);
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);

  float qr[Rows][E], o[Rows][E], m[Rows], l[Rows];
  int last_key[Rows];  // causal: the last key row r sees (bottom-right aligned)
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    const int g = r / p.seqlen_q, qi = r % p.seqlen_q;
    const int head = head_kv * group + g;
    last_key[r] = p.causal ? seqlen_k - p.seqlen_q + qi : seqlen_k - 1;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      qr[r][i] = r < rows ? to_float(q[int64_t(b) * p.q_batch_stride + int64_t(qi) * p.q_row_stride +
                                         int64_t(head) * p.q_head_stride + lane * E + i])
                          : 0.f;
      o[r][i] = 0.f;
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }

  for (int chunk = start; chunk < end; chunk += 32) {
    // Scores: lane j keeps the score of key chunk + j for every row.
    float s[Rows];
#pragma unroll
    for (int r = 0; r < Rows; ++r) s[r] = -INFINITY;
    const int keys = min(32, end - chunk);
    for (int j0 = 0; j0 < keys; j0 += kAhead) {
      // kAhead rows loaded before any is used: one warp keeps that many reads in flight.
      float kr[kAhead][E];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        if (j0 + u < keys) {
          load_cache_row<T, E>(p, kc, p.k_batch_stride, p.k_row_stride, p.k_head_stride, cache_b, b, chunk + j0 + u,
                               head_kv, lane, kr[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        if (j0 + u >= keys) break;
#pragma unroll
        for (int r = 0; r < Rows; ++r) {
          float dot = 0.f;
#pragma unroll
          for (int i = 0; i < E; ++i) dot = fmaf(qr[r][i], kr[u][i], dot);
          dot = warp_sum(dot);
          const bool visible = chunk + j0 + u <= last_key[r];
          if (lane == j0 + u) s[r] = visible ? dot : -INFINITY;
        }
      }
    }
    // Online softmax over the chunk, then O += P V with P broadcast from the lane of its key.
    float pr[Rows];
#pragma unroll
    for (int r = 0; r < Rows; ++r) {
      const float m_new = fmaxf(m[r], warp_max(s[r]));
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;  // no visible key yet: keep 0s
      const float alpha = exp2f((m[r] - m_safe) * scale_log2);
      pr[r] = exp2f((s[r] - m_safe) * scale_log2);
      l[r] = l[r] * alpha + warp_sum(pr[r]);
      m[r] = m_new;
#pragma unroll
      for (int i = 0; i < E; ++i) o[r][i] *= alpha;
    }
    for (int j0 = 0; j0 < keys; j0 += kAhead) {
      float vr[kAhead][E];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        if (j0 + u < keys) {
          load_cache_row<T, E>(p, vc, p.v_batch_stride, p.v_row_stride, p.v_head_stride, cache_b, b, chunk + j0 + u,
                               head_kv, lane, vr[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        if (j0 + u >= keys) break;
#pragma unroll
        for (int r = 0; r < Rows; ++r) {
          const float pj = __shfl_sync(0xffffffff, pr[r], j0 + u);
#pragma unroll
          for (int i = 0; i < E; ++i) o[r][i] = fmaf(pj, vr[u][i], o[r][i]);
        }
      }
    }
  }

  // Normalized partial output and its LSE (natural log); -inf and zeros for a row without keys.
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    if (r >= rows) continue;
    const int g = r / p.seqlen_q, qi = r % p.seqlen_q, head = head_kv * group + g;
    const bool empty = !(l[r] > 0.f);
    const float inv = empty ? 0.f : 1.f / l[r];
    const float lse = empty ? -INFINITY : m[r] * p.softmax_scale + logf(l[r]);
    const int64_t row = (int64_t(b) * p.heads_q + head) * p.seqlen_q + qi;  // (b, hq, sq)
    if (p.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + int64_t(b) * p.out_batch_stride + int64_t(qi) * p.out_row_stride +
               int64_t(head) * p.out_head_stride + lane * E;
#pragma unroll
      for (int i = 0; i < E; ++i) from_float(o[r][i] * inv, out[i]);
      if (lane == 0) p.lse[row] = lse;
    } else {
      float* acc = p.o_accum + (row * p.num_splits + split) * HeadDim + lane * E;
#pragma unroll
      for (int i = 0; i < E; ++i) acc[i] = o[r][i] * inv;
      if (lane == 0) p.lse_accum[row * p.num_splits + split] = lse;
    }
  }
}

// Merge the splits of one (b, head, query) row: O = sum_s exp(lse_s - lse) O_s.
template <class T, int HeadDim>
__global__ void __launch_bounds__(32) combine_kernel(const fa3gen_decode_params p) {
  constexpr int E = HeadDim / 32;
  const int64_t row = blockIdx.x;  // (b, hq, sq) flattened
  const int lane = threadIdx.x, splits = p.num_splits;
  const float* lses = p.lse_accum + row * splits;
  float lmax = -INFINITY;
  for (int s = lane; s < splits; s += 32) lmax = fmaxf(lmax, lses[s]);
  lmax = warp_max(lmax);
  float total = 0.f;
  if (lmax != -INFINITY) {
    for (int s = lane; s < splits; s += 32) total += expf(lses[s] - lmax);
  }
  total = warp_sum(total);
  const float lse = lmax == -INFINITY ? -INFINITY : lmax + logf(total);
  float o[E] = {};
  if (lmax != -INFINITY) {
    for (int s = 0; s < splits; ++s) {
      const float w = expf(lses[s] - lse);  // 0 for an empty split
      const float* acc = p.o_accum + (row * splits + s) * HeadDim + lane * E;
#pragma unroll
      for (int i = 0; i < E; ++i) o[i] = fmaf(w, acc[i], o[i]);
    }
  }
  const int qi = int(row % p.seqlen_q), head = int((row / p.seqlen_q) % p.heads_q);
  const int b = int(row / (int64_t(p.seqlen_q) * p.heads_q));
  T* out = static_cast<T*>(p.out) + int64_t(b) * p.out_batch_stride + int64_t(qi) * p.out_row_stride +
           int64_t(head) * p.out_head_stride + lane * E;
#pragma unroll
  for (int i = 0; i < E; ++i) from_float(o[i], out[i]);
  if (lane == 0) p.lse[row] = lse;
}

template <class T, int HeadDim, int Rows>
int launch(const fa3gen_decode_params& p, cudaStream_t stream) {
  const dim3 grid(p.num_splits, p.heads_kv, p.batch);
  split_kernel<T, HeadDim, Rows><<<grid, 32, 0, stream>>>(p);
  if (p.num_splits > 1) {
    combine_kernel<T, HeadDim><<<unsigned(int64_t(p.batch) * p.heads_q * p.seqlen_q), 32, 0, stream>>>(p);
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : report("decode kernel launch", err);
}

template <class T, int HeadDim>
int launch_rows(const fa3gen_decode_params& p, cudaStream_t stream, int rows) {
  if (rows <= 1) return launch<T, HeadDim, 1>(p, stream);
  if (rows <= 2) return launch<T, HeadDim, 2>(p, stream);
  if (rows <= 4) return launch<T, HeadDim, 4>(p, stream);
  return launch<T, HeadDim, 8>(p, stream);
}

}  // namespace decode

// The C entry point's body: checks, then the instantiation for dtype, head dim and rows.
inline int launch_decode(const fa3gen_decode_params& p, cudaStream_t stream) {
  const int rows = p.heads_kv > 0 ? p.heads_q / p.heads_kv * p.seqlen_q : 0;
  if (p.batch < 1 || p.seqlen_q < 1 || p.heads_kv < 1 || p.heads_q % p.heads_kv != 0 || rows > 8 ||
      p.num_splits < 1 || p.batch > 65535 || p.heads_kv > 65535 || p.num_splits > 65535 ||
      (p.block_table != nullptr && p.page_size < 1) || (p.num_splits > 1 && p.o_accum == nullptr) ||
      p.cache_rows < 1 || (p.block_table == nullptr && p.cache_batch_idx == nullptr && p.cache_rows < p.batch)) {
    fa3gen_set_error("decode: invalid sizes (rows = heads_q / heads_kv * seqlen_q must be 1..8, "
                     "num_splits >= 1 with a workspace when > 1, page_size >= 1 when paged, "
                     "cache_rows >= 1 and >= batch without cache_batch_idx)");
    return 1;
  }
  const bool fp16 = p.fp16 != 0;
  switch (p.head_dim) {
    case 64: return fp16 ? decode::launch_rows<__half, 64>(p, stream, rows)
                         : decode::launch_rows<__nv_bfloat16, 64>(p, stream, rows);
    case 128: return fp16 ? decode::launch_rows<__half, 128>(p, stream, rows)
                          : decode::launch_rows<__nv_bfloat16, 128>(p, stream, rows);
    case 256: return fp16 ? decode::launch_rows<__half, 256>(p, stream, rows)
                          : decode::launch_rows<__nv_bfloat16, 256>(p, stream, rows);
    default:
      fa3gen_set_error("decode: head_dim must be 64, 128 or 256");
      return 1;
  }
}

}  // namespace fa3gen
