// The forward kernel, FlashAttention-3 style, composed of its parts: the tile scheduler
// (tile_scheduler.cuh), the mainloop with its TMA loads and GEMMs (fwd_mainloop.cuh), the
// mask (mask.cuh), the online softmax (softmax.cuh) and the epilogue (fwd_epilogue.cuh).
#pragma once
#include <cutlass/arch/reg_reconfig.h>
#include "fwd_epilogue.cuh"
#include "fwd_mainloop.cuh"
#include "mask.cuh"

namespace fa3gen {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
fwd_kernel(__grid_constant__ const FwdParams<Traits> p) {
  using Mainloop = FwdMainloop<Traits>;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const TileScheduler<Traits::kCausal> sched{p.schedule};

  if (warp_idx == 0 && cute::elect_one_sync()) Mainloop::init(p, smem);
  Mainloop mainloop(p, smem, warp_idx);
  __syncthreads();  // barrier initialisation visible to every thread before first use

  if constexpr (Traits::kWarpSpecialized) {
    if (warp_idx < 4) {  // producer warpgroup
      cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      if (threadIdx.x == 0) mainloop.produce(sched);
      return;
    }
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  }

  // ---------------- consumers ----------------
  const int tid = Traits::kWarpSpecialized ? int(threadIdx.x) - 128 : int(threadIdx.x);
  typename Traits::TiledMmaPV mma_pv;
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<Traits::kTileM>, Int<Traits::kHeadDim>>{});
  const GemmTurns<Traits> turns{tid / 128};
  turns.seed();
  for (int t = sched.first(); t < sched.count(); t = sched.next(t)) {
    TileCoord tile;
    if (!sched.decode(t, tile)) continue;
    const KeyBlocks blocks = mainloop.mask().key_blocks(tile.block);
    OnlineSoftmax<Mainloop::kRows> softmax(p.scale_log2);
    mainloop.mma(tile, blocks, turns, softmax, tOrO, tid);
    store_fwd_tile(p, tile, softmax, tOrO, tid);
  }
  turns.drain();
}

}  // namespace fa3gen
