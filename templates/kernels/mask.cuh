// The attention mask, one type for the forward (S: rows are queries) and the backward (S^T:
// rows are keys). Causal attention is aligned to the bottom-right corner: query i sees key j
// iff j <= i + seqlen_k - seqlen_q. A local (sliding-window) mask bounds both sides:
//   i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right,
// so causal is the window (unbounded, 0). Keys past seqlen_k are never seen. The block
// bounds below let the kernels skip whole blocks outside the visible band, so local work is
// proportional to the window, not to seqlen_k.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

namespace fa3gen {
using namespace cute;

// The key blocks a query block visits: first, first + 1, ..., first + count - 1. The kernels
// walk them from the last down (the diagonal, masked blocks first).
struct KeyBlocks {
  int first, count;
  __device__ __forceinline__ int at(int i) const { return first + count - 1 - i; }
};

template <bool Causal, bool Local, int TileM, int TileN>
struct AttentionMask {
  static_assert(!(Causal && Local), "a local window includes the causal case (window_right = 0)");
  static constexpr bool kRightBound = Causal || Local;
  // Without a causal or window bound only the block holding the end of the keys can need the
  // mask, and it is the first one visited (KeyBlocks::at(0)).
  static constexpr bool kMasksFirstBlockOnly = !kRightBound;
  int seqlen_q, seqlen_k;
  // Local only, >= 0: the host replaces -1 (unbounded) by seqlen_q + seqlen_k, which no row reaches.
  int window_left, window_right;

  // Row `row` sees keys [key_begin(row), key_end(row)) (before clipping to [0, seqlen_k)).
  __device__ __forceinline__ int key_end(int row) const {
    return row + 1 + seqlen_k - seqlen_q + (Local ? window_right : 0);
  }
  __device__ __forceinline__ int key_begin(int row) const { return row + seqlen_k - seqlen_q - window_left; }

  __device__ __forceinline__ KeyBlocks key_blocks(int m_block) const {
    int end = (seqlen_k + TileN - 1) / TileN;
    if constexpr (kRightBound) {
      const int last = key_end((m_block + 1) * TileM - 1);  // exclusive column bound of the tile
      if (last <= 0) return {0, 0};
      end = min(end, (last + TileN - 1) / TileN);
    }
    if constexpr (!Local) {
      return {0, end};
    } else {
      const int first = max(0, key_begin(m_block * TileM)) / TileN;
      return {first, max(0, end - first)};
    }
  }

  // The query blocks that see key block n_block: [first_query_block, query_block_end).
  // (Exactly the m_block whose key_blocks include n_block: the deterministic backward counts
  // on it.)
  __device__ __forceinline__ int first_query_block(int n_block) const {
    if constexpr (!kRightBound) return 0;
    // first query that sees the block's first key
    const int first_row = n_block * TileN - (seqlen_k - seqlen_q) - (Local ? window_right : 0);
    return first_row <= 0 ? 0 : first_row / TileM;
  }
  __device__ __forceinline__ int query_block_end(int n_block, int m_blocks) const {
    if constexpr (!Local) return m_blocks;
    // last query that sees the block's last key
    const int last_row = (n_block + 1) * TileN - 1 - (seqlen_k - seqlen_q) + window_left;
    return last_row < 0 ? 0 : min(m_blocks, last_row / TileM + 1);
  }

  // Only blocks crossing the end of the keys or an edge of the visible band need masking.
  // (Here and in apply_transposed the right edge is spelled as before the window existed, not
  // through key_end: that kept the non-local backward kernels' SASS unchanged.)
  __device__ __forceinline__ bool needs_mask(int m_block, int n_block) const {
    const int last_key = (n_block + 1) * TileN - 1;
    bool crosses = last_key >= seqlen_k;
    if constexpr (kRightBound) {
      crosses = crosses || last_key > m_block * TileM + seqlen_k - seqlen_q + (Local ? window_right : 0);
    }
    if constexpr (Local) crosses = crosses || n_block * TileN < key_begin((m_block + 1) * TileM - 1);
    return crosses;
  }

  // A query block's visiting order (KeyBlocks::at) starts with the blocks that need the mask
  // (the end of the keys, the diagonal) and, with a window, ends with those at its left edge;
  // the run between needs none. front + back <= blocks.count.
  struct MaskedRuns { int front, back; };
  __device__ __forceinline__ MaskedRuns masked_runs(int m_block, KeyBlocks const& blocks) const {
    MaskedRuns runs{0, 0};
    while (runs.front < blocks.count && needs_mask(m_block, blocks.at(runs.front))) ++runs.front;
    if constexpr (Local) {
      while (runs.back < blocks.count - runs.front && needs_mask(m_block, blocks.at(blocks.count - 1 - runs.back))) {
        ++runs.back;
      }
    }
    return runs;
  }

  // S and coords are (query, key) views of an accumulator; coords are tile-local.
  template <class TS, class TC>
  __device__ __forceinline__ void apply(TS& S, TC const& coords, int row0, int col0) const {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(S); ++r) {
      const int row = row0 + get<0>(coords(r, 0));
      int col_end = seqlen_k;
      if constexpr (kRightBound) col_end = min(seqlen_k, key_end(row));
      if constexpr (Local) {
        // One unsigned compare per element for both edges (two compares spilled 20 bytes on
        // d256 128x64): col is visible iff 0 <= col - begin < end - begin.
        const int begin = key_begin(row);
        const unsigned width = unsigned(max(0, col_end - begin));
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          if (unsigned(col0 + get<1>(coords(r, c)) - begin) >= width) { S(r, c) = -INFINITY; }
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          if (col0 + get<1>(coords(r, c)) >= col_end) { S(r, c) = -INFINITY; }
        }
      }
    }
  }

  // The same mask on S^T: St and coords are (key, query) views.
  template <class TS, class TC>
  __device__ __forceinline__ void apply_transposed(TS& St, TC const& coords, int key0, int row0) const {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(St); ++r) {
      const int key = key0 + get<0>(coords(r, 0));
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(St); ++c) {
        const int row = row0 + get<1>(coords(r, c));
        bool hidden = key >= seqlen_k;
        if constexpr (kRightBound) hidden = hidden || key > row + seqlen_k - seqlen_q + (Local ? window_right : 0);
        if constexpr (Local) hidden = hidden || key < key_begin(row);
        if (hidden) St(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace fa3gen
