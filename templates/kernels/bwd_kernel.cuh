// The backward main kernel, FlashAttention-3 style, composed of its parts: the tile scheduler
// (one CTA per key block, tile_scheduler.cuh), the mainloop with its producer, dQ writer and
// consumer GEMMs (bwd_mainloop.cuh), the mask (mask.cuh) and the epilogue (bwd_epilogue.cuh).
// The preprocess and dQ conversion kernels around it are in bwd_prepost.cuh.
#pragma once
#include <cutlass/arch/reg_reconfig.h>
#include "bwd_epilogue.cuh"
#include "bwd_mainloop.cuh"
#include "bwd_prepost.cuh"

namespace fa3gen {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
bwd_kernel(__grid_constant__ const BwdParams<Traits> p) {
  using Mainloop = BwdMainloop<Traits>;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  TileCoord tile;  // key block, kv head, batch
  SeqSlice seq{};  // varlen: the tile's sequence
  allow_dependent_grid();  // the dQ conversion may be placed as this grid's CTAs retire
  if constexpr (Traits::kVarlen) {
    prerequisite_grid_wait();  // the tile list (the kernel before this one) is complete
    if (!VarlenTileScheduler{p.schedule, p.varlen.tiles}.decode(int(blockIdx.x), tile)) return;  // past the list
    seq = seq_slice(p.varlen, tile.batch);
  } else {
    // A (key block, kv head, batch) grid read from blockIdx, as FA4 does, rather than a 1D
    // index decoded by two integer divisions (about 60 instructions before the barrier set-up).
    tile = {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  }
  const typename Traits::Mask mask{Traits::kVarlen ? seq.seqlen_q : p.seqlen_q,
                                   Traits::kVarlen ? seq.seqlen_k : p.seqlen_k, p.window_left, p.window_right};
  const int m_blocks = Traits::kVarlen ? (seq.seqlen_q + Traits::kTileM - 1) / Traits::kTileM
                                       : p.seqlen_q_rounded / Traits::kTileM;
  const int m_first = mask.first_query_block(tile.block);
  const int m_end = mask.query_block_end(tile.block, m_blocks);
  // Some query block sees the key block (varlen: and the block holds used keys; with
  // seqused_k the tile list also has blocks past them).
  const bool has_work = m_first < m_end && (!Traits::kVarlen || tile.block * Traits::kTileN < seq.seqlen_k);

  if (warp_idx == 0 && cute::elect_one_sync()) Mainloop::init(p, smem);
  Mainloop mainloop(p, smem, warp_idx);
  __syncthreads();

  if (warp_idx < 4) {  // producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    // The preprocess's LSE, D and zeroed dQ accumulator (and semaphores): read and written
    // only by these warps (the consumers read shared memory they fill).
    if constexpr (!Traits::kVarlen) prerequisite_grid_wait();
    // Writer first: values it needs are then not live across the TMA loop (24 registers).
    if (warp_idx == 1 && has_work) mainloop.write_dq(tile, seq, m_first, m_end, m_blocks, mask);
    else if (threadIdx.x == 0 && has_work) mainloop.produce(tile, seq, m_first, m_end);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();

  // ---------------- consumers ----------------
  const int tid = int(threadIdx.x) - 128;
  typename Traits::TiledMmadKV mma_dkv;
  Tensor tdVrdV = partition_fragment_C(mma_dkv, typename Traits::DkvTileShape{});  // dV^T when kTransposedDkv
  Tensor tdKrdK = partition_fragment_C(mma_dkv, typename Traits::DkvTileShape{});
  clear(tdVrdV);
  clear(tdKrdK);
  if (has_work) {
    if constexpr (Traits::kTransposedDkv) mainloop.mma_transposed(tile, m_first, m_end, mask, tdKrdK, tdVrdV, tid);
    else mainloop.mma(tile, m_first, m_end, mask, tdKrdK, tdVrdV, tid);
  }
  store_bwd_tile(p, smem, tile, seq, tdKrdK, tdVrdV, tid);
}

}  // namespace fa3gen
