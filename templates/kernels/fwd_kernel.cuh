// The forward kernel, FlashAttention-3 style: TMA loads into a `Stages`-deep ring of K and V
// buffers, S = Q K^T and O += P V on WGMMA, online softmax in registers.
//   WarpSpecialized: warpgroup 0 only issues TMA (and gives registers away); the others compute.
//                    Otherwise thread 0 of the first consumer issues the loads in between its math.
//   Pingpong:        named barriers make consumer warpgroups take turns issuing GEMMs, so one
//                    warpgroup's softmax runs while another's GEMMs occupy the tensor cores.
//                    With two consumer warpgroups each loads and releases its own rows of Q, so
//                    the next tile's Q arrives for the warpgroup that finishes first.
//   IntraWgOverlap:  S(j+1) = Q K(j+1)^T and O += P(j) V(j) are in flight together; the softmax
//                    of block j+1 runs while the PV GEMM of block j finishes.
#pragma once
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include "fwd_epilogue.cuh"
#include "fwd_softmax.cuh"
#include "fwd_traits.cuh"

namespace fa3gen {

// Consumer warpgroups take turns issuing GEMMs (round robin). Barrier w is the turn of
// warpgroup w: it syncs on it, and the previous warpgroup arrives on it. Barrier ids are
// compile-time immediates (a runtime id costs a register and makes ptxas reserve all 16).
// The order runs on across the tiles of a persistent CTA: the last warpgroup seeds the first
// turn once, every turn is handed on, and warpgroup 0 absorbs the final hand-over at exit, so
// arrivals and syncs balance whatever the number of turns.
template <class Traits>
struct GemmTurns {
  static constexpr int kThreads = 256;  // the waiting warpgroup + the one handing over
  int wg;                               // consumer warpgroup index
  template <bool Arrive>
  __device__ static void barrier(int id) {
    auto op = [](auto bar_id) {
      if constexpr (Arrive) cutlass::arch::NamedBarrier::arrive(kThreads, decltype(bar_id)::value);
      else cutlass::arch::NamedBarrier::sync(kThreads, decltype(bar_id)::value);
    };
    if (id == 0) op(Int<0>{});
    else if (id == 1) op(Int<1>{});
    else op(Int<2>{});
  }
  __device__ void seed() const {
    if constexpr (Traits::kPingpong) { if (wg == Traits::kConsumerWGs - 1) barrier<true>(0); }
  }
  __device__ void wait_turn() const {
    if constexpr (Traits::kPingpong) barrier<false>(wg);
  }
  __device__ void pass_turn() const {
    if constexpr (Traits::kPingpong) barrier<true>(wg + 1 == Traits::kConsumerWGs ? 0 : wg + 1);
  }
  __device__ void drain() const {
    if constexpr (Traits::kPingpong) { if (wg == 0) barrier<false>(0); }
  }
};
// Named barrier (user id) that consumers without a producer warpgroup use to agree that the
// previous tile's Q is no longer read.
constexpr int kQFreeBarrier = 3;

// Tile schedule. Tiles are ordered head-major so that CTAs running together share one head's
// K and V in L2. Three ways to walk them:
//  - one CTA per tile (grid = tiles): tile blockIdx.x; causal heads list their longest (last)
//    query tiles first, so the hardware's in-order block dispatch ends on short ones;
//  - persistent, non-causal: CTA b takes tiles b, b + G, b + 2G, ... (all tiles are equal);
//  - persistent, causal: query tile m of a head visits about m + 1 key blocks, so a CTA takes
//    the tiles in pairs (M-1-j, j) whose lengths sum to about M + 1: pair u is tiles 2u and
//    2u + 1, and CTA b takes pairs b, b + G, ... Equal pairs keep a static round robin
//    balanced without a work queue. With M odd the middle tile forms a pair of its own.
template <class Traits>
struct TileScheduler {
  int m_blocks, heads, batch;
  bool paired;     // persistent causal: tiles are walked in pairs
  int pairs_per_head;

  __device__ TileScheduler(int m_blocks_, int heads_, int batch_)
      : m_blocks(m_blocks_), heads(heads_), batch(batch_),
        paired(Traits::kCausal && int64_t(gridDim.x) < int64_t(m_blocks_) * heads_ * batch_),
        pairs_per_head((m_blocks_ + 1) / 2) {}
  // Upper bound of the tile index t (pair indices cover 2 per pair).
  __device__ int count() const { return (paired ? 2 * pairs_per_head : m_blocks) * heads * batch; }
  __device__ int first() const { return paired ? 2 * int(blockIdx.x) : int(blockIdx.x); }
  __device__ int next(int t) const {
    if (!paired) return t + gridDim.x;
    return (t & 1) ? t - 1 + 2 * int(gridDim.x) : t + 1;
  }
  // False for the empty half of the middle pair (M odd): skip it.
  __device__ bool decode(int t, int& m_block, int& head, int& b) const {
    int hb;
    if (paired) {
      const int pair = t >> 1, j = pair % pairs_per_head;
      hb = pair / pairs_per_head;
      m_block = (t & 1) ? j : m_blocks - 1 - j;
      if ((t & 1) && j == m_blocks - 1 - j) return false;
    } else {
      const int m = t % m_blocks;
      hb = t / m_blocks;
      m_block = Traits::kCausal ? m_blocks - 1 - m : m;
    }
    head = hb % heads;
    b = hb / heads;
    return true;
  }
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
fwd_kernel(__grid_constant__ const FwdParams<Traits> p) {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kTileM = Traits::kTileM, kTileN = Traits::kTileN, kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr bool kCausal = Traits::kCausal;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const TileScheduler<Traits> sched((p.seqlen_q + kTileM - 1) / kTileM, p.heads_q, p.batch);

  if (warp_idx == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    for (int part = 0; part < Traits::kQParts; ++part) {
      Barrier::init(&smem.barrier_q[part], 1);
      Barrier::init(&smem.barrier_q_free[part], Traits::kConsumerThreads / Traits::kQParts);
    }
  }
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kBytesKV;
  pipe_params.role = Traits::kWarpSpecialized
                         ? (warp_idx < 4 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer)
                         : Pipeline::ThreadCategory::ProducerConsumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kConsumerThreads;
  Pipeline pipe_k(smem.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipe_v(smem.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier initialisation visible to every thread before first use

  // ---- TMA loads (issued by one thread). Block i of a tile's visiting order is key block
  // n_blocks - 1 - i: the diagonal (masked) blocks come first. ----
  auto load_q = [&](int m_block, int head, int b, int part) {
    constexpr int kRows = kTileM / Traits::kQParts;
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seqlen_q, Int<kHeadDim>{}, p.heads_q, p.batch));
    Tensor gQ = local_tile(mQ(_, _, head, b), Shape<Int<kRows>, Int<kHeadDim>>{},
                           make_coord(m_block * Traits::kQParts + part, _0{}));
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data() + part * Traits::kQPartOffset), typename Traits::SmemLayoutQPart{});
    auto [tQgQ, tQsQ] = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    Barrier::arrive_and_expect_tx(&smem.barrier_q[part], Traits::kBytesQ / Traits::kQParts);
    copy(p.tma_q.with(smem.barrier_q[part], 0), tQgQ, tQsQ);
  };
  auto load_k = [&](int n_block, int head_kv, int b, PipelineState& st) {
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen_k, Int<kHeadDim>{}, p.heads_kv, p.batch));
    Tensor gK = local_tile(mK(_, _, head_kv, b), Shape<Int<kTileN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    auto [tKgK, tKsK] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    pipe_k.producer_acquire(st);
    copy(p.tma_k.with(*pipe_k.producer_get_barrier(st), 0), tKgK(_, n_block), tKsK(_, st.index()));
    ++st;
  };
  auto load_v = [&](int n_block, int head_kv, int b, PipelineState& st) {
    Tensor mVt = p.tma_v.get_tma_tensor(make_shape(Int<kHeadDim>{}, p.seqlen_k, p.heads_kv, p.batch));
    Tensor gVt = local_tile(mVt(_, _, head_kv, b), Shape<Int<kHeadDim>, Int<kTileN>>{}, make_coord(_0{}, _));
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    auto [tVgV, tVsV] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sVt), group_modes<0, 2>(gVt));
    pipe_v.producer_acquire(st);
    copy(p.tma_v.with(*pipe_v.producer_get_barrier(st), 0), tVgV(_, n_block), tVsV(_, st.index()));
    ++st;
  };

  if constexpr (Traits::kWarpSpecialized) {
    if (warp_idx < 4) {  // producer warpgroup
      cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      if (threadIdx.x == 0) {
        PipelineState st_k = cutlass::make_producer_start_state<Pipeline>();
        PipelineState st_v = st_k;
        int q_iter = 0;  // tiles with work so far: the phase of the Q barriers
        for (int t = sched.first(); t < sched.count(); t = sched.next(t)) {
          int m_block, head, b;
          if (!sched.decode(t, m_block, head, b)) continue;
          const int n_blocks = key_block_count<kCausal, kTileM, kTileN>(m_block, p.seqlen_q, p.seqlen_k);
          if (n_blocks == 0) continue;
          const int head_kv = head / p.heads_per_kv;
          // FA3's order: the tile's first K before waiting for Q to be free, then each K one
          // block ahead of V (the consumers need K(i) together with V(i - 1)).
          load_k(n_blocks - 1, head_kv, b, st_k);
          for (int part = 0; part < Traits::kQParts; ++part) {
            if (q_iter > 0) Barrier::wait(&smem.barrier_q_free[part], (q_iter - 1) & 1);
            load_q(m_block, head, b, part);
          }
          for (int i = 0; i < n_blocks; ++i) {
            if (i + 1 < n_blocks) load_k(n_blocks - 2 - i, head_kv, b, st_k);
            load_v(n_blocks - 1 - i, head_kv, b, st_v);
          }
          ++q_iter;
        }
      }
      return;
    } else {
      cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    }
  }

  // ---------------- consumers ----------------
  const int tid = Traits::kWarpSpecialized ? int(threadIdx.x) - 128 : int(threadIdx.x);
  const bool inline_loader = !Traits::kWarpSpecialized && threadIdx.x == 0;
  PipelineState st_load_k = cutlass::make_producer_start_state<Pipeline>();
  PipelineState st_load_v = st_load_k;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) smem descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, Stages)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, Stages)
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kTileM>, Int<kTileN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kTileM>, Int<kHeadDim>>{});
  Tensor rP = make_tensor<Element>(tSrS.layout());
  Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
  Tensor S = make_tensor(tSrS.data(), acc_as_rowcol(tSrS.layout()));
  Tensor O = make_tensor(tOrO.data(), acc_as_rowcol(tOrO.layout()));
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  Tensor coordS = make_tensor(cS.data(), acc_as_rowcol(cS.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;
  const GemmTurns<Traits> turns{tid / 128};
  const int q_part = Traits::kQParts == 1 ? 0 : tid / 128;  // the Q rows this warpgroup reads

  PipelineState st;  // consumer read position, shared by K and V, continues across tiles
  int q_iter = 0;
  turns.seed();
  for (int t = sched.first(); t < sched.count(); t = sched.next(t)) {
    int m_block, head, b;
    if (!sched.decode(t, m_block, head, b)) continue;
    const int n_blocks = key_block_count<kCausal, kTileM, kTileN>(m_block, p.seqlen_q, p.seqlen_k);
    const int head_kv = head / p.heads_per_kv;

    if (!Traits::kWarpSpecialized && n_blocks > 0) {
      // Without a producer warpgroup, thread 0 loads Q once every consumer is done with the
      // previous tile's Q, then fills the ring; later it refills a slot as soon as it is free.
      if (q_iter > 0) cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kQFreeBarrier);
      if (inline_loader) {
        for (int part = 0; part < Traits::kQParts; ++part) load_q(m_block, head, b, part);
        for (int i = 0; i < min(kStages, n_blocks); ++i) {
          load_k(n_blocks - 1 - i, head_kv, b, st_load_k);
          load_v(n_blocks - 1 - i, head_kv, b, st_load_v);
        }
      }
      __syncwarp();
    }
    auto refill_k = [&](int i) {
      if (inline_loader && i + kStages < n_blocks) load_k(n_blocks - 1 - i - kStages, head_kv, b, st_load_k);
      __syncwarp();
    };
    auto refill_v = [&](int i) {
      if (inline_loader && i + kStages < n_blocks) load_v(n_blocks - 1 - i - kStages, head_kv, b, st_load_v);
      __syncwarp();
    };
    // After the last S GEMM of the tile, Q may be overwritten by the next tile's load.
    auto release_q_if_last = [&](int i) {
      if (Traits::kWarpSpecialized && i == n_blocks - 1) Barrier::arrive(&smem.barrier_q_free[q_part]);
    };

    OnlineSoftmax<kRows> softmax(p.scale_log2);
    float rescale[kRows];
    clear(tOrO);
    auto softmax_block = [&](int i) {
      const int n_block = n_blocks - 1 - i;
      if (block_needs_mask<kCausal, kTileM, kTileN>(m_block, n_block, p.seqlen_q, p.seqlen_k)) {
        apply_mask<kCausal>(S, coordS, m_block * kTileM, n_block * kTileN, p.seqlen_q, p.seqlen_k);
      }
      softmax.step(S, rescale);
    };
    auto to_p = [&]() {
      Tensor converted = convert_fragment<Element>(tSrS);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < size(rP); ++e) { rP(e) = converted(e); }
    };

    if (n_blocks > 0) Barrier::wait(&smem.barrier_q[q_part], q_iter & 1);

    if constexpr (!Traits::kOverlap) {
      for (int i = 0; i < n_blocks; ++i) {
        pipe_k.consumer_wait(st);
        turns.wait_turn();
        wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, st.index()), tSrS);
        turns.pass_turn();
        warpgroup_wait<0>();
        pipe_k.consumer_release(st);
        release_q_if_last(i);
        refill_k(i);
        softmax_block(i);
        scale_rows(O, rescale);
        to_p();
        pipe_v.consumer_wait(st);
        turns.wait_turn();
        wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, st.index()), tOrO);
        turns.pass_turn();
        warpgroup_wait<0>();
        pipe_v.consumer_release(st);
        refill_v(i);
        ++st;
      }
    } else if (n_blocks > 0) {
      // Prologue: S(0) and its softmax alone. As in FA3, the first S GEMM and the last PV GEMM
      // of a tile take no turn: every warpgroup starts its tile as soon as its Q and K are in.
      pipe_k.consumer_wait(st);
      wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, st.index()), tSrS);
      warpgroup_wait<0>();
      pipe_k.consumer_release(st);
      release_q_if_last(0);
      refill_k(0);
      softmax_block(0);
      to_p();
      PipelineState st_v = st;  // V slot of the block whose P is in rP
      ++st;
      for (int i = 1; i < n_blocks; ++i) {
        pipe_k.consumer_wait(st);
        turns.wait_turn();
        wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, st.index()), tSrS);
        pipe_v.consumer_wait(st_v);
        wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, st_v.index()), tOrO);
        turns.pass_turn();
        warpgroup_wait<1>();  // groups retire in order: S(i) is done, P(i-1) V(i-1) may still run
        pipe_k.consumer_release(st);
        release_q_if_last(i);
        refill_k(i);
        softmax_block(i);
        warpgroup_wait<0>();
        pipe_v.consumer_release(st_v);
        refill_v(i - 1);
        scale_rows(O, rescale);
        to_p();
        st_v = st;
        ++st;
      }
      pipe_v.consumer_wait(st_v);
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, st_v.index()), tOrO);
      warpgroup_wait<0>();
      pipe_v.consumer_release(st_v);
      refill_v(n_blocks - 1);
    }

    // ---------------- epilogue: O / rowsum and LSE, straight from registers ----------------
    float inv_sum[kRows], lse[kRows];
    softmax.finalize(p.softmax_scale, inv_sum, lse);
    scale_rows(O, inv_sum);
    Tensor rO = convert_fragment<Element>(tOrO);
    const int row_end = p.seqlen_q - m_block * kTileM;
    Element* o_tile = p.o + b * p.o_batch_stride + head * p.o_head_stride + int64_t(m_block) * kTileM * p.o_row_stride;
    if (p.o_vector_stores) store_tile_rows_16b<kTileM, kHeadDim>(thr_pv, rO, o_tile, p.o_row_stride, row_end);
    else store_tile_rows<kTileM, kHeadDim>(thr_pv, rO, o_tile, p.o_row_stride, row_end);
    if (tid % 4 == 0) {
      float* lse_row = p.lse + (int64_t(b) * p.heads_q + head) * p.seqlen_q + m_block * kTileM;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        int row = get<0>(coordS(r, 0));
        if (row < row_end) { lse_row[row] = lse[r]; }
      }
    }
    if (n_blocks > 0) ++q_iter;
  }
  turns.drain();
}

}  // namespace fa3gen
