// The attention mask, one type for the forward (S: rows are queries) and the backward (S^T:
// rows are keys). Causal attention is aligned to the bottom-right corner: query i sees key j
// iff j <= i + seqlen_k - seqlen_q; keys past seqlen_k are never seen. The block bounds below
// are where a local window or per-sequence (varlen) lengths would narrow the visible range.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

namespace fa3gen {
using namespace cute;

template <bool Causal, int TileM, int TileN>
struct AttentionMask {
  int seqlen_q, seqlen_k;

  // Key blocks query block m_block must visit: [0, count).
  __device__ __forceinline__ int key_block_count(int m_block) const {
    int n_blocks = (seqlen_k + TileN - 1) / TileN;
    if constexpr (Causal) {
      int last_visible_plus_one = (m_block + 1) * TileM + seqlen_k - seqlen_q;  // exclusive column bound
      if (last_visible_plus_one <= 0) return 0;
      n_blocks = min(n_blocks, (last_visible_plus_one + TileN - 1) / TileN);
    }
    return n_blocks;
  }

  // First query block that sees key block n_block (the backward walks [first, m_blocks)).
  __device__ __forceinline__ int first_query_block(int n_block) const {
    if constexpr (!Causal) return 0;
    int first_row = n_block * TileN - (seqlen_k - seqlen_q);  // first query that sees the block
    return first_row <= 0 ? 0 : first_row / TileM;
  }

  // Only blocks crossing the end of the keys or the causal diagonal need masking.
  __device__ __forceinline__ bool needs_mask(int m_block, int n_block) const {
    int last_key = (n_block + 1) * TileN - 1;
    bool tail = last_key >= seqlen_k;
    if constexpr (Causal) return tail || last_key > m_block * TileM + seqlen_k - seqlen_q;
    else return tail;
  }

  // S and coords are (query, key) views of an accumulator; coords are tile-local.
  template <class TS, class TC>
  __device__ __forceinline__ void apply(TS& S, TC const& coords, int row0, int col0) const {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(S); ++r) {
      int row = row0 + get<0>(coords(r, 0));
      int col_end = seqlen_k;
      if constexpr (Causal) { col_end = min(seqlen_k, row + 1 + seqlen_k - seqlen_q); }
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(S); ++c) {
        if (col0 + get<1>(coords(r, c)) >= col_end) { S(r, c) = -INFINITY; }
      }
    }
  }

  // The same mask on S^T: St and coords are (key, query) views.
  template <class TS, class TC>
  __device__ __forceinline__ void apply_transposed(TS& St, TC const& coords, int key0, int row0) const {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(St); ++r) {
      int key = key0 + get<0>(coords(r, 0));
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(St); ++c) {
        int row = row0 + get<1>(coords(r, c));
        bool hidden = key >= seqlen_k;
        if constexpr (Causal) hidden = hidden || key > row + seqlen_k - seqlen_q;
        if (hidden) St(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace fa3gen
