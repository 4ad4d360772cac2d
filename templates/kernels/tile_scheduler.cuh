// Tile scheduling: which CTA computes which output tile. The policy is decided on the host
// (how many CTAs, whether causal tiles go in pairs) and handed to the kernel as a
// TileSchedule; the forward walks it. The dense backward launches its TileSchedule's
// dimensions as a (key block, kv head, batch) grid and reads the tile from blockIdx
// (bwd_kernel.cuh); varlen kernels walk a tile list (varlen.cuh).
//
// Tiles are ordered block-fastest, then head, then batch, so CTAs running together share one
// head's K and V in L2. Three ways to walk them:
//  - one CTA per tile (grid = tiles): tile blockIdx.x. Causal forward: longest tiles first,
//    across a section of heads whose K and V fit in L2 (l2_head_section), so the hardware's
//    in-order block dispatch ends on short ones;
//  - persistent, equal tiles: CTA b takes tiles b, b + G, b + 2G, ...;
//  - persistent, paired (causal forward): query tile m of a head visits about m + 1 key
//    blocks, so a CTA takes the tiles in pairs (M-1-j, j) whose lengths sum to about M + 1:
//    pair u is tiles 2u and 2u + 1, and CTA b takes pairs b, b + G, ... Equal pairs keep a
//    static round robin balanced without a work queue. With M odd the middle tile forms a
//    pair of its own.
#pragma once
#include <algorithm>
#include <cstdint>
#include "fa3gen_abi.h"

namespace fa3gen {

struct TileSchedule {
  int blocks;          // tiles per (head, batch): query blocks (forward) or key blocks (backward)
  int heads, batch;
  int pairs_per_head;  // (blocks + 1) / 2
  bool paired;         // walk tiles in (longest, shortest) pairs
  int64_t ctas;        // the one-dimensional grid of the forward and varlen launches
  int head_section = 1;  // causal, one CTA per tile: (head, batch) pairs whose tiles are listed together
};

struct TileCoord {
  int block, head, batch;
};

// The forward's grid policy. FA3GEN_GRID_AUTO is persistent (one CTA per multiprocessor, or
// fewer tiles), causal tiles paired, except for long tiles (`long_tiles`: fwd_long_tiles, which the
// launcher asks): there one CTA per tile. Measured on the H200 (2026-11-30, d128 causal): pairs
// +10-15% over one CTA per tile at 1k-4k keys, +1-8% at 8k, 2-3% behind at 16k, where per-tile
// costs are small and the hardware's dynamic dispatch balances better than equal static
// shares. A local window of 4096 keys at seqlen 16k: one CTA per tile +6% (d128) and +4%
// (d256), d64 a tie; a window of 1024: 1-4% behind; of 2048 (H100, 2026-12-05): d64 2-4%
// behind at 8k and 16k keys but 11% ahead at 4k (the first tiles, inside the first window,
// cost less), d128 and d256 within noise. So windows below 2048 keys walk persistently, and
// d64 ones below 4096 over sequences more than three windows long.
// cluster > 1 (FwdTraits::kClusterM): a head's query tiles counted up to a multiple of the
// cluster, so that CTAs c * cluster + r (one cluster) take tiles of one head side by side in
// every step of the walk (the grid is a multiple of the cluster too); the tiles past m_blocks
// load and compute with their cluster (on the last block's Q rows) and store nothing.
// cluster_fit (> 0): the clusters the device holds at once; a persistent grid stays within
// them, since a cluster placed after the others would start its share when they had finished.
// A persistent grid over `tiles` (a multiple of the cluster): one CTA per multiprocessor, whole
// clusters, within the clusters that fit; at least one cluster (num_sms 1 with clusters of two
// would make an empty grid).
inline int64_t persistent_ctas(int64_t tiles, int num_sms, int cluster, int cluster_fit) {
  int64_t slots = num_sms > 0 ? num_sms : 132;
  if (cluster_fit > 0) slots = std::min<int64_t>(slots, int64_t(cluster_fit) * cluster);
  return std::min<int64_t>(tiles, std::max<int64_t>(cluster, slots / cluster * cluster));
}

// Whether a dense forward's query tiles are long and unequal enough for one CTA each under
// AUTO (`long_tiles` above): causal over more than 8192 keys, or a window that shows a query
// at least 2048 keys (window_keys, launch_common.cuh), except at head dim 64 (key blocks of
// half the cost) a window of fewer than 4096 keys over a sequence more than three windows
// long, where most tiles see the whole window and so cost alike.
inline bool fwd_long_tiles(bool causal, bool local, int head_dim, int seqlen_k, int64_t window_keys) {
  if (causal) return seqlen_k > 8192;
  if (!local) return false;
  const bool d64_alike = head_dim <= 64 && window_keys < 4096 && seqlen_k > 3 * window_keys;
  return window_keys >= 2048 && !d64_alike;
}

// Causal tiles, one CTA per tile: the hardware starts CTAs in grid order, so the grid lists the
// longest tiles first. Head by head (each head's tiles longest first), the last head's longest
// tiles start near the end and run past everything else: a list-scheduling model of 132 SMs
// puts that tail at 3.5% of the d64 causal 16k call (192-row tiles, 32 heads). So, as FA4's
// sm90 scheduler does, the (head, batch) pairs go in sections of as many heads as keep their K
// and V in L2 (a power of two, 50 MB: every sm90 part but H20's 60), and a section lists its
// tiles longest first across its heads: block M-1 of each head, then M-2, ... kv_head_bytes:
// one kv head's K and V; 0 or more than L2: one head a section (the order before).
__host__ __device__ inline int l2_head_section(int64_t kv_head_bytes, int64_t head_groups) {
  constexpr int64_t kL2Bytes = int64_t(50) << 20;
  int section = 1;
  while (kv_head_bytes > 0 && 2 * section * kv_head_bytes <= kL2Bytes && 2 * section <= head_groups) section *= 2;
  return section;
}

// A key's K and V bytes in one head: what a head's keys hold in L2 (kv_head_bytes above is
// seqlen_k of them; the varlen list's KvBytesPerKey, varlen.cuh fwd_list_kv_bytes).
template <class Element, int HeadDim>
constexpr int kv_bytes_per_key() { return HeadDim * 2 * int(sizeof(Element)); }

// Tile t of `groups` groups of `blocks` tiles each, listed in sections of `section` groups (the
// last one narrower), each section rank-major: rank 0 of each of its groups, then rank 1, ....
// The dense causal grid's order (TileScheduler) and the varlen list's (list_entry_tile).
__host__ __device__ __forceinline__ void section_order(int t, int blocks, int groups, int section, int& group,
                                                       int& rank) {
  const int per_section = section * blocks;
  const int index = t / per_section, r = t - index * per_section;
  const int first = index * section;
  const int width = groups - first < section ? groups - first : section;
  group = first + r % width;
  rank = r / width;
}

inline TileSchedule fwd_tile_schedule(int m_blocks, int heads, int batch, bool causal, bool long_tiles,
                                      int grid_mode, int num_sms, int cluster = 1, int cluster_fit = 0,
                                      int64_t kv_head_bytes = 0) {
  const int blocks = (m_blocks + cluster - 1) / cluster * cluster;
  const int64_t tiles = int64_t(blocks) * heads * batch;
  const bool one_per_tile = grid_mode == FA3GEN_GRID_TILES || (grid_mode == FA3GEN_GRID_AUTO && long_tiles);
  const int64_t ctas = one_per_tile ? tiles : persistent_ctas(tiles, num_sms, cluster, cluster_fit);
  TileSchedule s{blocks, heads, batch, (blocks + 1) / 2, causal && ctas < tiles, ctas};
  // Clusters take neighbouring blocks of one head: they keep the head-by-head order.
  if (causal && ctas == tiles && cluster == 1) s.head_section = l2_head_section(kv_head_bytes, int64_t(heads) * batch);
  return s;
}

// One CTA per tile, tiles in order (the backward: one CTA per key block, or per varlen list entry).
inline TileSchedule one_cta_per_tile(int blocks, int heads, int batch) {
  return {blocks, heads, batch, (blocks + 1) / 2, false, int64_t(blocks) * heads * batch};
}

// The varlen forward's: `entries` list entries (varlen.cuh), one CTA per tile or `persistent`;
// causal heads' tiles in pairs when persistent leaves CTAs several.
inline TileSchedule varlen_fwd_schedule(int64_t entries, bool causal, bool persistent, int num_sms) {
  TileSchedule s = one_cta_per_tile(int(entries), 1, 1);
  if (persistent) {
    s.ctas = persistent_ctas(entries, num_sms, 1, 0);
    s.paired = causal && s.ctas < entries;
  }
  return s;
}

// A persistent CTA's walk over tile indices t: b, b + G, ... (G = the grid), or with pairs the
// pairs b, b + G, ... (indices 2u and 2u + 1 of pair u). Shared by the dense and varlen
// schedulers.
// Grid: where the CTA index and the grid size come from (the host tests pass their own,
// tests/test_compile.py).
struct DeviceGrid {
  __device__ __forceinline__ int cta() const { return int(blockIdx.x); }
  __device__ __forceinline__ int size() const { return int(gridDim.x); }
};
template <class Grid = DeviceGrid>
__host__ __device__ __forceinline__ int walk_first(bool pairs, Grid g = {}) { return pairs ? 2 * g.cta() : g.cta(); }
template <class Grid = DeviceGrid>
__host__ __device__ __forceinline__ int walk_next(int t, bool pairs, Grid g = {}) {
  if (!pairs) return t + g.size();
  return (t & 1) ? t - 1 + 2 * g.size() : t + 1;
}
// The query block of pair member `second` of pair j among n blocks: longest (n - 1 - j) first,
// then shortest (j), so that a pair costs about n + 1 key blocks.
__host__ __device__ __forceinline__ int paired_block(int j, bool second, int n) { return second ? j : n - 1 - j; }

// LongestFirst (causal forward): a head's query tiles differ in length; the longest comes
// first, and pairs are walked when the host asked for them. Without it (non-causal forward,
// backward) the pairing compiles away.
template <bool LongestFirst>
struct TileScheduler {
  TileSchedule const& s;

  __host__ __device__ __forceinline__ bool paired() const { return LongestFirst && s.paired; }

  // Upper bound of the tile index t (pair indices cover 2 per pair).
  __host__ __device__ __forceinline__ int count() const {
    return (paired() ? 2 * s.pairs_per_head : s.blocks) * s.heads * s.batch;
  }
  __device__ __forceinline__ int first() const { return walk_first(paired()); }
  __device__ __forceinline__ int next(int t) const { return walk_next(t, paired()); }
  // False for the empty half of the middle pair (M odd): skip it.
  __host__ __device__ __forceinline__ bool decode(int t, TileCoord& tile) const {
    int hb;
    if (paired()) {
      const int pair = t >> 1, j = pair % s.pairs_per_head;
      hb = pair / s.pairs_per_head;
      tile.block = paired_block(j, t & 1, s.blocks);
      if ((t & 1) && j == s.blocks - 1 - j) return false;
    } else {
      int m;
      if (LongestFirst && s.head_section > 1) {
        section_order(t, s.blocks, s.heads * s.batch, s.head_section, hb, m);
      } else {
        m = t % s.blocks;
        hb = t / s.blocks;
      }
      tile.block = LongestFirst ? s.blocks - 1 - m : m;
    }
    tile.head = hb % s.heads;
    tile.batch = hb / s.heads;
    return true;
  }
};

}  // namespace fa3gen
