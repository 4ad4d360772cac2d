// The forward kernel, FlashAttention-3 style, composed of its parts: the tile scheduler
// (tile_scheduler.cuh), the mainloop with its TMA loads and GEMMs (fwd_mainloop.cuh), the
// mask (mask.cuh), the online softmax (softmax.cuh) and the epilogue (fwd_epilogue.cuh).
#pragma once
#include <cutlass/arch/reg_reconfig.h>
#include "fwd_epilogue.cuh"
#include "fwd_mainloop.cuh"
#include "mask.cuh"

namespace fa3gen {

template <class Scheduler, bool Varlen, class Params>
__device__ __forceinline__ Scheduler make_scheduler(Params const& p) {
  if constexpr (Varlen) return {p.schedule, p.varlen.tiles};
  else return {p.schedule};
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
fwd_kernel(__grid_constant__ const FwdParams<Traits> p) {
  using Mainloop = FwdMainloop<Traits>;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  using Scheduler = cute::conditional_t<Traits::kVarlen, VarlenTileScheduler, TileScheduler<Traits::kCausal>>;
  const Scheduler sched = make_scheduler<Scheduler, Traits::kVarlen>(p);

  if (warp_idx == 0 && cute::elect_one_sync()) Mainloop::init(p, smem);
  Mainloop mainloop(p, smem, warp_idx);
  // Barrier initialisation visible to every thread before first use; in a cluster, to the
  // other CTAs too (their TMA multicasts and consumers signal this CTA's pipeline barriers).
  if constexpr (Traits::kClusterM > 1) cute::cluster_sync();
  else __syncthreads();

  if constexpr (Traits::kWarpSpecialized) {
    if (warp_idx < 4) {  // producer warpgroup
      cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      // One thread issues the loads; with fp8 the whole warpgroup also transposes V.
      if (Traits::kFp8 || threadIdx.x == 0) mainloop.produce(sched);
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
    const SeqSlice seq = mainloop.seq_of(tile);
    const KeyBlocks blocks = mainloop.mask(seq).key_blocks(tile.block);
    if constexpr (Traits::kFp8) {
      // The descales scale the scores (softmax and LSE) and the output, never the data.
      // Factors per key block (block quantization) are applied by the mainloop, block by block.
      const int head_kv = tile.head / p.heads_per_kv;
      const float qk = p.descale.q_(tile.batch, tile.head, tile.block) *
                       (p.descale.k_blocks() ? 1.f : p.descale.k_(tile.batch, head_kv, 0));
      const float v_tile = p.descale.v_blocks() ? 1.f : p.descale.v_(tile.batch, head_kv, 0);
      using Softmax = typename Mainloop::Softmax;
      Softmax softmax(Softmax::floored(p.scale_log2 * qk, Softmax::kTileScaleFloor), kRescaleThresholdFp8P);
      mainloop.mma(tile, seq, blocks, turns, softmax, tOrO, tid);
      store_fwd_tile(p, smem, tile, seq, softmax, tOrO, tid, p.lse_scale * qk,
                     v_tile * mainloop.o_units);
    } else {
      typename Mainloop::Softmax softmax(p.scale_log2);
      mainloop.mma(tile, seq, blocks, turns, softmax, tOrO, tid);
      store_fwd_tile(p, smem, tile, seq, softmax, tOrO, tid, p.lse_scale);
    }
  }
  turns.drain();
  drain_o_stores(p, tid);
}

}  // namespace fa3gen
