// Kernel prologue and TMA load pieces shared by the forward and backward mainloops.
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace fa3gen {
using namespace cute;

// The mbarrier a TMA load completes (an expected transaction byte count per phase).
using TmaBarrier = cutlass::arch::ClusterTransactionBarrier;

template <class... Tma>
__device__ __forceinline__ void prefetch_tma_descriptors(Tma const&... tma) {
  (cute::prefetch_tma_descriptor(tma.get_tma_descriptor()), ...);
}

// A TMA pipeline's parameters. Warp specialized: warpgroup 0 produces, the others consume;
// otherwise every thread does both. Thread 0 is the leader (it issues the expect-tx arrivals).
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params tma_pipeline_params(uint32_t transaction_bytes,
                                                                        bool warp_specialized, int warp_idx,
                                                                        int consumer_threads) {
  using Role = typename Pipeline::ThreadCategory;
  typename Pipeline::Params params;
  params.transaction_bytes = transaction_bytes;
  params.role = warp_specialized ? (warp_idx < 4 ? Role::Producer : Role::Consumer) : Role::ProducerConsumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumer_threads;
  return params;
}

// Source and destination partitions of a TMA load of tiles of one (head, batch) slice of a
// global tensor (mode 2 = heads, mode 3 = batch) into shared memory. `coord` picks the tile;
// an underscore in it leaves that tile mode to index at the copy (tg(_, block)). Multicast > 1
// (a descriptor made for that many CTAs): the share of CTA `rank` of the cluster, which the
// copy writes to every CTA of its mask.
template <int Multicast = 1, class Tma, class GShape, class TileShape, class Coord, class Element, class SmemLayout>
__device__ __forceinline__ auto tma_tiles(Tma const& tma, GShape const& shape, int head, int b, TileShape tile,
                                          Coord coord, Element* smem, SmemLayout layout, int rank = 0) {
  Tensor m = tma.get_tma_tensor(shape);
  Tensor g = local_tile(m(_, _, head, b), tile, coord);
  Tensor s = make_tensor(make_smem_ptr(smem), layout);
  if constexpr (Multicast == 1) {
    return tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
  } else {
    return tma_partition(tma, rank, Layout<Int<Multicast>>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
  }
}

// The same for a packed (varlen) tensor: its one batch, the slice's coordinates shifted by
// `offset` (the sequence's first row, in the seqlen mode's position), so tiles count from the
// sequence's start. Rows past the sequence read the next one's (the mask hides them).
template <class Tma, class GShape, class TileShape, class Coord, class Element, class SmemLayout, class Offset>
__device__ __forceinline__ auto tma_tiles_at(Tma const& tma, GShape const& shape, int head, Offset const& offset,
                                             TileShape tile, Coord coord, Element* smem, SmemLayout layout) {
  Tensor m = tma.get_tma_tensor(shape);
  Tensor g = local_tile(domain_offset(offset, m(_, _, head, 0)), tile, coord);
  Tensor s = make_tensor(make_smem_ptr(smem), layout);
  return tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
}

// Row tiles (rows, head_dim) of a (seqlen, head_dim, heads, batch) tensor as both mainloops
// load Q, K (and the backward dO, V): one (head, b) slice of a dense tensor (seqlen rows,
// `batch` batches), or the sequence starting at row `offset` of a packed one (`total` rows).
// Multicast, rank: as tma_tiles (dense tensors only).
template <bool Varlen, int HeadDim, int Multicast = 1, class Tma, class TileShape, class Coord, class Element,
          class SmemLayout>
__device__ __forceinline__ auto row_tiles(Tma const& tma, int seqlen, int batch, int total, int offset, int heads,
                                          int head, int b, TileShape tile, Coord coord, Element* smem,
                                          SmemLayout layout, int rank = 0) {
  static_assert(!Varlen || Multicast == 1, "multicast loads of dense tensors only");
  if constexpr (Varlen) {
    return tma_tiles_at(tma, make_shape(total, Int<HeadDim>{}, heads, 1), head, make_coord(offset, _0{}), tile,
                        coord, smem, layout);
  } else {
    return tma_tiles<Multicast>(tma, make_shape(seqlen, Int<HeadDim>{}, heads, batch), head, b, tile, coord, smem,
                                layout, rank);
  }
}

}  // namespace fa3gen
