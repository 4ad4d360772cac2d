// Variable-length batches (the varlen axis): sequences packed along the rows of q (total_q,
// heads, d) and k, v (total_k, heads_kv, d), sequence b being rows [cu_seqlens[b],
// cu_seqlens[b + 1]). Three pieces, shared by both directions:
//  - SeqSlice: where a tile's sequence lies (row offsets and lengths). Dense kernels use the
//    launch's sizes and never read one, so their code does not change.
//  - varlen_tiles_kernel: before the main kernel, one CTA lists the tiles that exist (no
//    padding tiles), the sequence with the most work first (its cost: the other side's
//    length), so that the hardware's in-order block dispatch runs the longest tiles first and
//    ends on short ones. Within a sequence a head's tiles are consecutive (K and V stay in L2).
//  - VarlenTileScheduler: the main kernel's CTA t runs entry t of that list (one CTA per tile),
//    or a persistent CTA walks entries b, b + G, ... (in pairs 2u, 2u + 1 for the causal
//    forward, whose list then alternates each head's longest and shortest query tiles).
// Offsets and lengths are clamped to [0, total]: cu_seqlens that are not what they should be
// (decreasing, past the end) give wrong numbers, never an access outside the tensors.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <cub/block/block_scan.cuh>
#include "fa3gen_abi.h"  // FA3GEN_VARLEN_TILES: the bound of the list (sum of ceil(len_b / tile))
#include "tile_scheduler.cuh"

namespace fa3gen {

struct SeqSlice {
  int offset_q, offset_k;  // first row of the sequence in the packed tensors
  int seqlen_q, seqlen_k;
};

struct VarlenArgs {
  const int* cu_seqlens_q;  // batch + 1 entries each
  const int* cu_seqlens_k;
  int total_q, total_k;     // rows of the packed tensors
  const int2* tiles;        // varlen_tiles_kernel's list: {batch, head << 16 | block}, batch -1: none
  const int* seqused_k = nullptr;  // optional: the keys of each sequence actually used
};

// Paged variants (fa3gen_abi.h): a varlen sequence's keys in pages of a paged cache.
struct PagedArgs {
  const int* block_table;  // (batch, cols) with row stride batch_stride
  int64_t batch_stride;
  int page_size, num_pages, cols;

  // The page of table column col of sequence b, both clamped into range (a column past the
  // table: the chunks of a sequence's last key block past its pages, whose rows are not used).
  __device__ __forceinline__ int page(int b, int col) const {
    return min(max(block_table[b * batch_stride + min(col, cols - 1)], 0), num_pages - 1);
  }
};

__device__ __forceinline__ void clamped_range(const int* cu, int b, int total, int& offset, int& len) {
  const int begin = min(max(cu[b], 0), total), end = min(max(cu[b + 1], 0), total);
  offset = begin;
  len = max(end - begin, 0);
}

__device__ __forceinline__ SeqSlice seq_slice(VarlenArgs const& v, int b) {
  SeqSlice s;
  clamped_range(v.cu_seqlens_q, b, v.total_q, s.offset_q, s.seqlen_q);
  clamped_range(v.cu_seqlens_k, b, v.total_k, s.offset_k, s.seqlen_k);
  if (v.seqused_k != nullptr) s.seqlen_k = min(s.seqlen_k, max(v.seqused_k[b], 0));
  return s;
}

// Rows outside every sequence (before cu_seqlens[0], from cu_seqlens[batch] on) of a packed
// output, which no tile writes, are zeroed, and the forward's LSE there set to -inf (a row
// that sees no key), so that torch.empty's leftovers (NaN included) do not reach the next
// layer's gradients through padded outputs, nor the inputs' gradients through dq, dk, dv
// (flash-attn leaves them unwritten). The list kernel's extra CTAs do it, before the main
// kernel in stream order (a later write of a row by a tile, possible only with cu_seqlens out
// of order, wins). Within noise of leaving them (A/B at mean lengths 512 and 2048, H200,
// 2026-12-05 (fourteenth)).
struct PaddedRows {
  void* ptr = nullptr;      // 16-bit (rows, heads, cols) with element strides; null: none
  const int* cu = nullptr;  // the batch + 1 offsets that cut its rows
  int64_t row_stride = 0, head_stride = 0;
  int rows = 0, heads = 0, cols = 0;
};
struct PaddingArgs {
  PaddedRows rows[3];
  float* lse = nullptr;     // (heads, rows) of rows[0]'s tensor, fp32: -inf in its padding
  int batch = 0;
};

// The sequences of a tensor of `rows` rows cover [lo, hi) (offsets clamped as clamped_range
// clamps them); its padding rows are [0, lo) and [hi, rows), `count` in all, the i-th of them
// padding_row(i).
struct PaddingSpan {
  int lo, hi, count;
  __host__ __device__ int row(int i) const { return i < lo ? i : hi + (i - lo); }
};
__host__ __device__ inline PaddingSpan padding_span(int first, int last, int rows) {
  const int lo = first < 0 ? 0 : first > rows ? rows : first;
  int hi = last < 0 ? 0 : last > rows ? rows : last;
  hi = hi < lo ? lo : hi;
  return {lo, hi, lo + (rows - hi)};
}

// Element e of t's padding (its padding rows, then heads, then columns; consecutive e are
// consecutive columns), as an offset in elements; and entry e of its (heads, rows) LSE's.
__host__ __device__ inline int64_t padding_offset(PaddedRows const& t, PaddingSpan s, int64_t e) {
  const int64_t per_row = int64_t(t.heads) * t.cols, within = e % per_row;
  return s.row(int(e / per_row)) * t.row_stride + (within / t.cols) * t.head_stride + within % t.cols;
}
__host__ __device__ inline int64_t padding_lse_offset(PaddedRows const& t, PaddingSpan s, int64_t e) {
  return (e / s.count) * t.rows + s.row(int(e % s.count));
}

// CTA `cta` of `ctas` zeroing the padding rows (16-bit zero: bf16 and fp16 alike).
__device__ inline void zero_padding(PaddingArgs const& z, int cta, int ctas) {
  const int64_t first = int64_t(cta) * blockDim.x + threadIdx.x, step = int64_t(ctas) * blockDim.x;
  for (int i = 0; i < 3; ++i) {
    PaddedRows const& t = z.rows[i];
    if (t.ptr == nullptr) continue;
    const PaddingSpan s = padding_span(t.cu[0], t.cu[z.batch], t.rows);
    const int64_t n = int64_t(s.count) * t.heads * t.cols;
    for (int64_t e = first; e < n; e += step) static_cast<uint16_t*>(t.ptr)[padding_offset(t, s, e)] = 0;
    if (i == 0 && z.lse != nullptr) {
      for (int64_t e = first; e < int64_t(s.count) * t.heads; e += step) z.lse[padding_lse_offset(t, s, e)] = -INFINITY;
    }
  }
}

constexpr int kVarlenListThreads = 1024;
constexpr int kPaddingCtasMax = 128;

// The list kernel's extra CTAs for `z`: enough for every row to be padding at 8 elements a
// thread, at most kPaddingCtasMax. With no padding each reads two offsets and exits.
inline int padding_ctas(PaddingArgs const& z) {
  int64_t most = 0;
  for (PaddedRows const& t : z.rows) most += t.ptr != nullptr ? int64_t(t.rows) * t.heads * t.cols : 0;
  const int64_t per_cta = int64_t(kVarlenListThreads) * 8;
  return int(most < int64_t(kPaddingCtasMax) * per_cta ? (most + per_cta - 1) / per_cta : kPaddingCtasMax);
}
constexpr int kVarlenSortedBatch = 1024;  // larger batches keep their order (the sort is O(batch^2 / threads))

// Entry `within` of one sequence's heads x n tiles: head-major, each head's blocks in order,
// last to first (descending), or, `paired`, as n - 1, 0, n - 2, 1, .... With section > 1
// (heads in sections of that many, as tile_scheduler.cuh's l2_head_section), a section lists
// its heads' blocks longest first across them: block n - 1 of each head, then n - 2, ...
__host__ __device__ inline void list_entry_tile(int within, int n, int heads, int section, bool descending,
                                                bool paired, int& head, int& block) {
  int j;
  if (section > 1) {
    section_order(within, n, heads, section, head, j);
  } else {
    head = within / n;
    j = within % n;
  }
  block = !descending ? j : paired ? paired_block(j / 2, j & 1, n) : n - 1 - j;
}

// The forward list kernel's KvBytesPerKey: a key's K and V bytes in one head for the causal
// forward, whose list then takes each sequence's heads in L2 sections (1.01-1.04x at d256,
// docs/BENCHMARKS.md 2026-12-05 (twentieth)); 0 (head-major) with a window or without causal.
template <class Element, int HeadDim, bool Causal, bool Local>
constexpr int fwd_list_kv_bytes() {
  return Causal && !Local ? kv_bytes_per_key<Element, HeadDim>() : 0;
}

// The section list_entry_tile gets for a sequence of `keys` keys: its heads in L2 sections of
// their K and V (kv_bytes_per_key: a key's K and V bytes in one head; 0: no sections), except
// where the list is walked in pairs (their order is the pairing's).
__host__ __device__ inline int list_head_section(int keys, int kv_bytes_per_key, int heads, bool paired) {
  return kv_bytes_per_key > 0 && !paired ? l2_head_section(int64_t(keys) * kv_bytes_per_key, heads) : 1;
}

// One CTA. `rows`: the side the tiles cut (q for the forward, k for the backward); `cost`:
// the other side, whose length each tile of the sequence walks. Writes `capacity` entries:
// the tiles (heads x blocks per sequence), then {-1, 0}. A head's blocks run last to first
// (BlocksDescending: the causal forward's longest query tiles first), or, `paired`, as
// n - 1, 0, n - 2, 1, ...: consecutive entries then cost about n + 1 key blocks together, as
// the dense kernels' pairs (tile_scheduler.cuh).
// CTAs past the first zero the padding rows of `padding` (padding_ctas).
// KvBytesPerKey > 0 (the causal forward, not paired): a sequence's heads in L2 sections of its
// K and V (list_entry_tile), so that the last head's longest tiles do not start at the
// sequence's end (d256 +2-4% at mean 2k-8k, docs/BENCHMARKS.md 2026-12-05 (twentieth)).
template <int Tile, bool BlocksDescending, int KvBytesPerKey = 0>
__global__ void __launch_bounds__(kVarlenListThreads)
varlen_tiles_kernel(const int* cu_rows, int total_rows, const int* cu_cost, int total_cost, int batch, int heads,
                    int2* tiles, int capacity, bool paired, const PaddingArgs padding) {
  if (blockIdx.x > 0) {
    zero_padding(padding, int(blockIdx.x) - 1, int(gridDim.x) - 1);
    return;
  }
  extern __shared__ int smem[];
  const bool sorted = batch <= kVarlenSortedBatch;
  int* blocks_of = smem;               // [batch]: tiles per head of sequence b
  int* cost_of = smem + batch;         // [batch] (sorted only)
  int* seq_at = cost_of + (sorted ? batch : 0);  // [batch]: the sequence in position i
  int* start_at = seq_at + batch;      // [batch + 1]: first list entry (in blocks) of position i
  for (int b = threadIdx.x; b < batch; b += blockDim.x) {
    int offset, len;
    clamped_range(cu_rows, b, total_rows, offset, len);
    blocks_of[b] = (len + Tile - 1) / Tile;
    if (sorted) {
      clamped_range(cu_cost, b, total_cost, offset, len);
      cost_of[b] = len;
    }
  }
  __shared__ int total_blocks;
  if (threadIdx.x == 0) total_blocks = 0;
  __syncthreads();
  if (sorted) {
    // Position of b: sequences with more cost first, ties in batch order; its start is the sum
    // of the blocks of every sequence before it.
    for (int b = threadIdx.x; b < batch; b += blockDim.x) {
      const int cost = cost_of[b];
      int pos = 0, start = 0;
      for (int j = 0; j < batch; ++j) {
        const bool before = cost_of[j] > cost || (cost_of[j] == cost && j < b);
        pos += before;
        start += before ? blocks_of[j] : 0;
      }
      seq_at[pos] = b;
      start_at[pos] = start;
      atomicMax(&total_blocks, start + blocks_of[b]);  // the last position's end
    }
  } else {
    // Batch order: a block-wide exclusive scan of the tile counts, blockDim.x at a time.
    using Scan = cub::BlockScan<int, kVarlenListThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    int carry = 0;
    for (int base = 0; base < batch; base += kVarlenListThreads) {
      const int b = base + int(threadIdx.x);
      int start, chunk;
      Scan(scan_storage).ExclusiveSum(b < batch ? blocks_of[b] : 0, start, chunk);
      if (b < batch) {
        seq_at[b] = b;
        start_at[b] = carry + start;
      }
      carry += chunk;
      __syncthreads();  // scan_storage is reused by the next chunk
    }
    if (threadIdx.x == 0) total_blocks = carry;
  }
  __syncthreads();
  if (threadIdx.x == 0) start_at[batch] = total_blocks;
  __syncthreads();
  const int used = start_at[batch] * heads;
  for (int e = threadIdx.x; e < capacity; e += blockDim.x) {
    if (e >= used) {
      tiles[e] = make_int2(-1, 0);
      continue;
    }
    // The position whose entries hold e: the last i with start_at[i] * heads <= e.
    int lo = 0, hi = batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (start_at[mid] * heads <= e) lo = mid; else hi = mid - 1;
    }
    const int b = seq_at[lo], n = blocks_of[b];
    const int within = e - start_at[lo] * heads;
    int section = 1;
    if constexpr (KvBytesPerKey > 0) {
      int offset, keys;
      clamped_range(cu_cost, b, total_cost, offset, keys);
      section = list_head_section(keys, KvBytesPerKey, heads, paired);
    }
    int head, block;
    list_entry_tile(within, n, heads, section, BlocksDescending, paired, head, block);
    tiles[e] = make_int2(b, (head << 16) | block);
  }
}

// Shared memory of varlen_tiles_kernel for `batch` sequences.
inline size_t varlen_tiles_smem(int batch) {
  return sizeof(int) * (size_t(batch) * (batch <= kVarlenSortedBatch ? 4 : 3) + 1);
}

// Launches the list kernel; returns the CUDA error (the list is `capacity` int2 entries).
template <int Tile, bool BlocksDescending, int KvBytesPerKey = 0>
inline cudaError_t launch_varlen_tiles(const int* cu_rows, int total_rows, const int* cu_cost, int total_cost,
                                       int batch, int heads, int2* tiles, int capacity, cudaStream_t stream,
                                       bool paired = false, PaddingArgs const& padding = {}) {
  const size_t smem = varlen_tiles_smem(batch);
  auto kernel = varlen_tiles_kernel<Tile, BlocksDescending, KvBytesPerKey>;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<1 + padding_ctas(padding), kVarlenListThreads, smem, stream>>>(
      cu_rows, total_rows, cu_cost, total_cost, batch, heads, tiles, capacity, paired, padding);
  return cudaGetLastError();
}

// The varlen backward's workspace (fa3gen_abi.h): sequence b's query tiles start at padded
// tile (offset_q + b * tile) / tile, strictly increasing in b, so tiles never mix sequences.
__device__ __forceinline__ int padded_tile_start(const int* cu_q, int total_q, int b, int tile) {
  return (min(max(cu_q[b], 0), total_q) + b * tile) / tile;
}
// The sequence whose padded tiles hold tile `pt` (or, for a gap between two, the one before).
__device__ __forceinline__ int seq_of_padded_tile(const int* cu_q, int total_q, int batch, int tile, int pt) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (padded_tile_start(cu_q, total_q, mid, tile) <= pt) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The main kernel's side: CTA b runs entries b, b + G, ... (G = the grid: one CTA per entry, or
// persistent), or with s.paired the pairs b, b + G, ... (entries 2u and 2u + 1 of pair u).
struct VarlenTileScheduler {
  TileSchedule const& s;
  const int2* tiles;
  __device__ __forceinline__ int first() const { return walk_first(s.paired); }
  __device__ __forceinline__ int count() const { return s.blocks; }  // entries
  __device__ __forceinline__ int next(int t) const { return walk_next(t, s.paired); }
  __host__ __device__ __forceinline__ bool decode(int t, TileCoord& tile) const {
    const int2 e = tiles[t];
    tile.batch = e.x;
    tile.head = e.y >> 16;
    tile.block = e.y & 0xffff;
    return e.x >= 0;
  }
};

}  // namespace fa3gen
