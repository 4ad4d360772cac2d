// The backward epilogue: dK (times the softmax scale) and dV of the CTA's key block to global
// memory.
#pragma once
#include "barriers.cuh"
#include "bwd_traits.cuh"
#include "fragments.cuh"
#include "tile_scheduler.cuh"

namespace fa3gen {

// tid is the thread's index among the consumers.
template <class Traits, class TAcc>
__device__ __forceinline__ void store_bwd_tile(BwdParams<Traits> const& p, typename Traits::SharedStorage& smem,
                                               TileCoord const& tile, SeqSlice const& seq, TAcc& tdKrdK,
                                               TAcc& tdVrdV, int tid) {
  using Element = typename Traits::Element;
  constexpr int kTileN = Traits::kTileN, kHeadDim = Traits::kHeadDim;
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  CUTLASS_PRAGMA_UNROLL
  for (int e = 0; e < size(tdKrdK); ++e) tdKrdK(e) *= p.softmax_scale;
  auto rows_of = [&](Element* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
    if constexpr (Traits::kVarlen) {  // the sequence's rows of the packed tensor
      return base + tile.head * head_stride + (int64_t(seq.offset_k) + int64_t(tile.block) * kTileN) * row_stride;
    } else {
      return base + tile.batch * batch_stride + tile.head * head_stride + int64_t(tile.block) * kTileN * row_stride;
    }
  };
  const int row_end = (Traits::kVarlen ? seq.seqlen_k : p.seqlen_k) - tile.block * kTileN;
  // Staged row-major in the Q/dO/K/V buffers, which no GEMM reads any more (kEpilogueSync:
  // once both warpgroups are past their last one), then written as
  // whole rows with 16-byte stores. Storing the fragments straight from registers (4 bytes
  // each) took 9% of the stall samples at seqlen 2k: store backpressure, drain at exit.
  // kTransposedDkv always stages (dK^T / dV^T stored element by element from registers spilled
  // at 160 registers), and copies 2 bytes at a time when the rows are not 16-byte aligned.
  if constexpr (Traits::kStagedEpilogue) {
    if (Traits::kTransposedDkv || p.vector_stores) {
      if constexpr (Traits::kEpilogueSync) barrier_sync<BarrierId::kBwdStaged>(Traits::kConsumerThreads);
      Element* stage_k = smem.q.data();
      Element* stage_v = stage_k + staged_tile_bytes<kTileN, kHeadDim, Element>() / sizeof(Element);
      if constexpr (Traits::kTransposedDkv) {  // dK^T and dV^T
        stage_fragment_rows_transposed<kTileN, kHeadDim>(thr_dkv, tdKrdK, stage_k);
        stage_fragment_rows_transposed<kTileN, kHeadDim>(thr_dkv, tdVrdV, stage_v);
      } else {
        stage_fragment_rows<kTileN, kHeadDim>(thr_dkv, convert_fragment<Element>(tdKrdK), stage_k);
        stage_fragment_rows<kTileN, kHeadDim>(thr_dkv, convert_fragment<Element>(tdVrdV), stage_v);
      }
      barrier_sync<BarrierId::kBwdStaged>(Traits::kConsumerThreads);
      Element* dk = rows_of(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
      Element* dv = rows_of(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
      if (p.vector_stores) {
        store_staged_rows<kTileN, kHeadDim, Traits::kConsumerThreads>(stage_k, dk, p.dk_row_stride, row_end, tid);
        store_staged_rows<kTileN, kHeadDim, Traits::kConsumerThreads>(stage_v, dv, p.dv_row_stride, row_end, tid);
      } else {
        store_staged_elems<kTileN, kHeadDim, Traits::kConsumerThreads>(stage_k, dk, p.dk_row_stride, row_end, tid);
        store_staged_elems<kTileN, kHeadDim, Traits::kConsumerThreads>(stage_v, dv, p.dv_row_stride, row_end, tid);
      }
      return;
    }
  }
  if constexpr (!Traits::kTransposedDkv) {  // which always returned above
    auto store_rows = [&](auto const& acc, Element* base, int64_t batch_stride, int64_t row_stride,
                          int64_t head_stride) {
      Tensor r16 = convert_fragment<Element>(acc);
      store_tile_rows<kTileN, kHeadDim>(thr_dkv, r16, rows_of(base, batch_stride, row_stride, head_stride),
                                        row_stride, row_end);
    };
    store_rows(tdKrdK, p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
    store_rows(tdVrdV, p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  }
}

}  // namespace fa3gen
