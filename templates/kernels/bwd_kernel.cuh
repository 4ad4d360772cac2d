// The backward main kernel, FlashAttention-3 style (see bwd_traits.cuh for the GEMMs).
// Warpgroup 0 is the producer: it loads K and V of the CTA's key block once, then Q, dO and
// the per-row LSE and D of each query block into a `Stages`-deep ring. The consumer
// warpgroups (64 keys each) recompute P from the saved LSE, keep dK and dV in registers for
// the whole CTA, and leave each query block's dQ in shared memory; warp 1 of the producer
// warpgroup (the dQ writer) adds it to the fp32 accumulator in global memory with one bulk
// reduction (cp.reduce.async.bulk .add.f32), so the consumers never wait on global memory.
// Deterministic mode orders those additions: the CTA of key block n adds its part of a query
// block's dQ only after the CTA of key block n - 1 has (a semaphore per query block).
#pragma once
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include "bwd_traits.cuh"
#include "fwd_softmax.cuh"  // key/query block bounds, quad reductions

namespace fa3gen {

// Named barriers (id 0 is __syncthreads).
constexpr int kDsReadyBarrier = 1;  // consumers: every warpgroup's part of dS is in shared memory
constexpr int kDqFullBarrier = 2;   // consumers -> writer: the query block's dQ is in shared memory
constexpr int kDqEmptyBarrier = 3;  // writer -> consumers: the dQ buffer has been read
constexpr int kStagedBarrier = 4;   // consumers: dK and dV are staged in shared memory

// Query blocks that see key block n_block: [first, last). Causal attention is bottom-right
// aligned (query i sees key j iff j <= i + seqlen_k - seqlen_q), so later key blocks start later.
template <bool Causal, int TileM, int TileN>
__device__ __forceinline__ int first_query_block(int n_block, int seqlen_q, int seqlen_k) {
  if constexpr (!Causal) return 0;
  int first_row = n_block * TileN - (seqlen_k - seqlen_q);  // first query that sees the block
  return first_row <= 0 ? 0 : first_row / TileM;
}

// Masking of S^T (rows = keys, cols = queries): keys past the end, and the causal triangle.
template <bool Causal, int TileM, int TileN>
__device__ __forceinline__ bool bwd_block_needs_mask(int m_block, int n_block, int seqlen_q, int seqlen_k) {
  int last_key = (n_block + 1) * TileN - 1;
  bool tail = last_key >= seqlen_k;
  if constexpr (Causal) return tail || last_key > m_block * TileM + seqlen_k - seqlen_q;
  else return tail;
}

template <bool Causal, class TS, class TC>
__device__ __forceinline__ void apply_mask_transposed(TS& St, TC const& coords, int key0, int row0,
                                                      int seqlen_q, int seqlen_k) {
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

// gmem[0, bytes) += smem[0, bytes) as fp32, asynchronously (TMA bulk reduction, one thread).
__device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Wait until this thread's bulk operations have read their shared memory / fully completed.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_done() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// A consumer thread's dQ fragment lives in shared memory (and in the fp32 accumulator in
// global memory) as [element / 2][thread][2] floats: the accumulator's neighbouring-column
// pairs, stored 8 bytes per thread by consecutive threads (contiguous, no bank conflicts), and
// the bulk reduction is one contiguous block per query block. bwd_convert_dq_kernel maps it
// back to (row, column) with the same TiledMma.
template <int Threads>
__device__ __forceinline__ int dq_slot(int tid, int chunk) { return chunk * Threads + tid; }
// The accumulator holds one TileM x d tile per (batch, query head, query block), in that order.
__device__ __forceinline__ int64_t dq_tile_index(int b, int head, int heads_q, int m_blocks, int m_block) {
  return (int64_t(b) * heads_q + head) * m_blocks + m_block;
}

__device__ __forceinline__ int load_acquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
bwd_kernel(__grid_constant__ const BwdParams<Traits> p) {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kTileM = Traits::kTileM, kTileN = Traits::kTileN, kHeadDim = Traits::kHeadDim;
  constexpr bool kCausal = Traits::kCausal;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const int n_block = blockIdx.x, head_kv = blockIdx.y, b = blockIdx.z;
  const int m_blocks = p.seqlen_q_rounded / kTileM;
  const int m_first = first_query_block<kCausal, kTileM, kTileN>(n_block, p.seqlen_q, p.seqlen_k);
  const int m_count = max(0, m_blocks - m_first);  // query blocks per query head

  if (warp_idx == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    Barrier::init(&smem.barrier_kv, 1);
  }
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = 2 * Traits::kBytesQ + 2 * Traits::kBytesRowStats;
  pipe_params.role = warp_idx < 4 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kConsumerThreads;
  Pipeline pipe(smem.pipeline_q, pipe_params, Shape<_1, _1, _1>{});
  __syncthreads();

  if (warp_idx < 4) {  // ---------------- producer warpgroup ----------------
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    // Writer first: values it needs are then not live across the TMA loop (24 registers).
    if (warp_idx == 1 && m_count > 0) {  // the dQ writer
      constexpr int kTileElems = kTileM * kHeadDim;
      const bool leader = threadIdx.x % 32 == 0;
      // Query-block tiles of this kv head's query heads, m_first .. m_blocks - 1 of each.
      int64_t tile = dq_tile_index(b, head_kv * p.heads_per_kv, p.heads_q, m_blocks, m_first);
      for (int hq = 0; hq < p.heads_per_kv; ++hq, tile += m_first) {
        for (int m_block = m_first; m_block < m_blocks; ++m_block, ++tile) {
          cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads + 32, kDqFullBarrier);
          if (leader) {
            if (p.deterministic) {
              while (load_acquire(p.dq_semaphore + tile) != n_block) {}
            }
            bulk_reduce_add(p.dq_accum + tile * kTileElems, smem.dq.data(), Traits::kBytesdQ);
            if (p.deterministic) {
              bulk_wait_done();  // the additions are complete before the next key block's turn
              asm volatile("fence.proxy.async.global;" ::: "memory");
              __threadfence();
              atomicAdd(p.dq_semaphore + tile, 1);
            } else {
              bulk_wait_read();
            }
          }
          __syncwarp();
          cutlass::arch::NamedBarrier::arrive(Traits::kConsumerThreads + 32, kDqEmptyBarrier);
        }
      }
      if (leader) bulk_wait_done();
    } else if (threadIdx.x == 0 && m_count > 0) {
      auto load_kv = [&](auto const& tma, Element* smem_ptr) {
        Tensor mK = tma.get_tma_tensor(make_shape(p.seqlen_k, Int<kHeadDim>{}, p.heads_kv, p.batch));
        Tensor gK = local_tile(mK(_, _, head_kv, b), Shape<Int<kTileN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
        Tensor sK = make_tensor(make_smem_ptr(smem_ptr), typename Traits::SmemLayoutK{});
        auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        copy(tma.with(smem.barrier_kv, 0), tg, ts);
      };
      Barrier::arrive_and_expect_tx(&smem.barrier_kv, 2 * Traits::kBytesK);
      load_kv(p.tma_k, smem.k.data());
      load_kv(p.tma_v, smem.v.data());

      auto load_rows = [&](auto const& tma, Element* smem_ptr, int head, int m_block, PipelineState const& st) {
        Tensor mQ = tma.get_tma_tensor(make_shape(p.seqlen_q, Int<kHeadDim>{}, p.heads_q, p.batch));
        Tensor gQ = local_tile(mQ(_, _, head, b), Shape<Int<kTileM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
        Tensor sQ = make_tensor(make_smem_ptr(smem_ptr), typename Traits::SmemLayoutQ{});
        auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        copy(tma.with(*pipe.producer_get_barrier(st), 0), tg(_, m_block), ts(_, st.index()));
      };
      PipelineState st = cutlass::make_producer_start_state<Pipeline>();
      for (int hq = 0; hq < p.heads_per_kv; ++hq) {
        const int head = head_kv * p.heads_per_kv + hq;
        const int64_t stats_row0 = (int64_t(b) * p.heads_q + head) * p.seqlen_q_rounded;
        for (int m_block = m_first; m_block < m_blocks; ++m_block) {
          pipe.producer_acquire(st);
          load_rows(p.tma_q, smem.q.data(), head, m_block, st);
          load_rows(p.tma_do, smem.dout.data(), head, m_block, st);
          const int64_t row0 = stats_row0 + int64_t(m_block) * kTileM;
          SM90_BULK_COPY_G2S::copy(p.lse_log2 + row0, pipe.producer_get_barrier(st),
                                   smem.lse_log2[st.index()], Traits::kBytesRowStats);
          SM90_BULK_COPY_G2S::copy(p.dsum + row0, pipe.producer_get_barrier(st),
                                   smem.dsum[st.index()], Traits::kBytesRowStats);
          ++st;
        }
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();

  // ---------------- consumers ----------------
  const int tid = int(threadIdx.x) - 128;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutdSt{});

  Tensor tSrK = thr_sdp.partition_fragment_A(sK);      // (MMA, MMA_N, MMA_K)
  Tensor tSrV = thr_sdp.partition_fragment_A(sV);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);      // (MMA, MMA_M, MMA_K, Stages)
  Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_D, MMA_K, Stages)
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
  // dQ = dS K (dS is A, K^T is B) or dQ^T = K^T dS^T (K^T is A, dS is B).
  Tensor tdQrdS = [&] {
    if constexpr (Traits::kDqTransposed) return thr_dq.partition_fragment_B(sdS);
    else return thr_dq.partition_fragment_A(sdS);
  }();  // (MMA, MMA_M or MMA_N, MMA_K, 2)
  Tensor tdQrKt = [&] {
    if constexpr (Traits::kDqTransposed) return thr_dq.partition_fragment_A(sKt);
    else return thr_dq.partition_fragment_B(sKt);
  }();
  // dS^T goes to shared memory with stmatrix (8x8 tiles whose 16-byte rows are contiguous
  // queries): a few STSM per thread instead of one 2-byte store per element, which took
  // d128 64x128 from 497 to ~557 TFLOP/s at seqlen 16k. The dQ^T variants (TileM 80) spilled
  // 8 bytes with it and keep the element-wise store.
  auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  auto thr_r2s_ds = r2s_ds.get_thread_slice(tid);
  Tensor tdSsdS = [&] {
    if constexpr (Traits::kDqTransposed) return thr_sdp.partition_C(sdSt);  // accumulator layout
    else return thr_r2s_ds.partition_D(sdSt);                               // (CPY, CPY_N, CPY_M, 2)
  }();

  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kTileN>, Int<kHeadDim>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kTileN>, Int<kHeadDim>>{});
  clear(tdVrdV);
  clear(tdKrdK);
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kTileN>, Int<kTileM>>{}));
  Tensor coordS = make_tensor(cS.data(), acc_as_rowcol(cS.layout()));  // (key, query) in the tile

  if (m_count > 0) Barrier::wait(&smem.barrier_kv, 0);
  PipelineState st;
  int iter = 0;
  for (int hq = 0; hq < p.heads_per_kv && m_count > 0; ++hq) {
    for (int m_block = m_first; m_block < m_blocks; ++m_block, ++iter) {
      pipe.consumer_wait(st);
      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kTileN>, Int<kTileM>>{});
      Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kTileN>, Int<kTileM>>{});
      wgmma_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, st.index()), tSrS);
      wgmma_issue<true>(mma_sdp, tSrV, tSrdO(_, _, _, st.index()), tSrdP);
      Tensor S = make_tensor(tSrS.data(), acc_as_rowcol(tSrS.layout()));
      Tensor dP = make_tensor(tSrdP.data(), acc_as_rowcol(tSrdP.layout()));
      const float* lse_log2 = smem.lse_log2[st.index()];
      const float* dsum = smem.dsum[st.index()];

      warpgroup_wait<1>();  // S^T is done, dP^T may still run
      if (bwd_block_needs_mask<kCausal, kTileM, kTileN>(m_block, n_block, p.seqlen_q, p.seqlen_k)) {
        apply_mask_transposed<kCausal>(S, coordS, n_block * kTileN, m_block * kTileM, p.seqlen_q, p.seqlen_k);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(S); ++c) {
        const float lse = lse_log2[get<1>(coordS(0, c))];
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < size<0>(S); ++r) S(r, c) = exp2f(fmaf(S(r, c), p.scale_log2, -lse));
      }
      warpgroup_wait<0>();  // dP^T
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(S); ++c) {
        const float d = dsum[get<1>(coordS(0, c))];
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < size<0>(S); ++r) dP(r, c) = S(r, c) * (dP(r, c) - d);
      }
      Tensor rP = convert_fragment<Element>(tSrS);
      Tensor rdS = convert_fragment<Element>(tSrdP);
      Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
      Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));
      // dV and dK run while dS^T goes to shared memory (buffer iter % 2) and the warpgroups
      // meet. (Issuing dQ before dK, so that handing dQ to the writer overlaps the dK GEMM,
      // spilled 20-48 bytes at 240 registers in d64 and both d128 tiles.)
      wgmma_issue<false>(mma_dkv, tdVrP, tdVrdOt(_, _, _, st.index()), tdVrdV);
      wgmma_issue<false>(mma_dkv, tdKrdS, tdKrQt(_, _, _, st.index()), tdKrdK);
      const int buf = iter & 1;
      if constexpr (Traits::kDqTransposed) {
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < size(rdS); ++e) tdSsdS(_, _, _, buf)(e) = rdS(e);
      } else {
        copy(r2s_ds, thr_r2s_ds.retile_S(rdS), tdSsdS(_, _, _, buf));
      }
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kDsReadyBarrier);
      Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Traits::DqTileShape{});
      if constexpr (Traits::kDqTransposed) {
        wgmma_issue<true>(mma_dq, tdQrKt, tdQrdS(_, _, _, buf), tdQrdQ);
      } else {
        wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, buf), tdQrKt, tdQrdQ);
      }
      warpgroup_wait<0>();

      // Hand dQ to the writer warp (once it has read the previous query block's).
      if (iter > 0) cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads + 32, kDqEmptyBarrier);
      float2* sdQ = reinterpret_cast<float2*>(smem.dq.data());
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size(tdQrdQ) / 2; ++j) {
        sdQ[dq_slot<Traits::kConsumerThreads>(tid, j)] = make_float2(tdQrdQ(2 * j), tdQrdQ(2 * j + 1));
      }
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::arrive(Traits::kConsumerThreads + 32, kDqFullBarrier);
      pipe.consumer_release(st);  // Q, dO, LSE, D of this block are no longer read
      ++st;
    }
  }
  // The writer signals "empty" after every block; take the last one so no arrival is left over.
  if (iter > 0) cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads + 32, kDqEmptyBarrier);

  // ---------------- epilogue: dK (times the softmax scale) and dV ----------------
  CUTLASS_PRAGMA_UNROLL
  for (int e = 0; e < size(tdKrdK); ++e) tdKrdK(e) *= p.softmax_scale;
  auto rows_of = [&](Element* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
    return base + b * batch_stride + head_kv * head_stride + int64_t(n_block) * kTileN * row_stride;
  };
  if constexpr (Traits::kStagedEpilogue) {
    if (p.vector_stores) {
      // Staged row-major in the Q/dO/K/V buffers, which no GEMM reads any more, then written as
      // whole rows with 16-byte stores. Storing the fragments straight from registers (4 bytes
      // each) took 9% of the stall samples at seqlen 2k: store backpressure, drain at exit.
      Element* stage_k = smem.q.data();
      Element* stage_v = stage_k + staged_tile_bytes<kTileN, kHeadDim, Element>() / sizeof(Element);
      stage_fragment_rows<kTileN, kHeadDim>(thr_dkv, convert_fragment<Element>(tdKrdK), stage_k);
      stage_fragment_rows<kTileN, kHeadDim>(thr_dkv, convert_fragment<Element>(tdVrdV), stage_v);
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kStagedBarrier);
      const int row_end = p.seqlen_k - n_block * kTileN;
      store_staged_rows<kTileN, kHeadDim, Traits::kConsumerThreads>(
          stage_k, rows_of(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride), p.dk_row_stride, row_end, tid);
      store_staged_rows<kTileN, kHeadDim, Traits::kConsumerThreads>(
          stage_v, rows_of(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride), p.dv_row_stride, row_end, tid);
      return;
    }
  }
  auto store_rows = [&](auto const& acc, Element* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
    Tensor r16 = convert_fragment<Element>(acc);
    store_tile_rows<kTileN, kHeadDim>(thr_dkv, r16, rows_of(base, batch_stride, row_stride, head_stride),
                                      row_stride, p.seqlen_k - n_block * kTileN);
  };
  store_rows(tdKrdK, p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  store_rows(tdVrdV, p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
}

// ---------------- preprocess and postprocess (plain CUDA, memory-bound) ----------------

struct BwdRowParams {
  const void* o;
  const void* dout;
  const float* lse;    // (batch, heads_q, seqlen_q) from the forward
  float* lse_log2;     // (batch, heads_q, seqlen_q_rounded)
  float* dsum;
  float* dq_accum;     // zeroed here: head_dim floats per padded row cover the whole accumulator
  int* dq_semaphore;   // zeroed here (one per query block) unless null
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int batch, heads_q, seqlen_q, seqlen_q_rounded, tile_m;
  bool vector_loads;   // O and dO rows are aligned for the row_vec_elems-wide loads
};

// Threads per query row in the preprocess, and elements per vector load (16 bytes where
// head_dim allows, else 8: head_dim 96 is 24 loads of 4 elements over 8 threads).
constexpr int kRowLanes = 8;
constexpr int kRowThreads = 256;
template <int HeadDim>
constexpr int row_vec_elems() { return HeadDim % (kRowLanes * 8) == 0 ? 8 : 4; }

// D = rowsum(dO * O) in fp32 and LSE in the log2 domain, one query row per 8 threads, and the
// row's share of the fp32 dQ accumulator (and the semaphores) zeroed in the same pass, so the
// caller need not clear the workspace (cuDNN's preprocess does the same). Padding rows and
// rows that saw no key get LSE +inf, which makes their recomputed P exactly 0.
template <class Element, int HeadDim>
__global__ void __launch_bounds__(kRowThreads) bwd_preprocess_kernel(const BwdRowParams p) {
  constexpr int kVec = row_vec_elems<HeadDim>();
  static_assert(HeadDim % (kRowLanes * kVec) == 0 && HeadDim % (kRowLanes * 4) == 0);
  using Vec = cute::conditional_t<kVec == 8, uint4, uint2>;
  const int64_t row = (int64_t(blockIdx.x) * kRowThreads + threadIdx.x) / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  const bool valid = row < int64_t(p.batch) * p.heads_q * p.seqlen_q_rounded;
  const int m = int(row % p.seqlen_q_rounded);
  const int head = int((row / p.seqlen_q_rounded) % p.heads_q);
  const int b = int(row / (int64_t(p.seqlen_q_rounded) * p.heads_q));
  float dot = 0.f, lse_log2 = INFINITY;
  if (valid && m < p.seqlen_q) {
    const Element* o = static_cast<const Element*>(p.o) + b * p.o_batch_stride + m * p.o_row_stride + head * p.o_head_stride;
    const Element* dout = static_cast<const Element*>(p.dout) + b * p.do_batch_stride + m * p.do_row_stride + head * p.do_head_stride;
    if (p.vector_loads) {
      // Lane l reads vectors l, l + 8, ...: the 8 lanes of a row read contiguous bytes.
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < HeadDim / (kRowLanes * kVec); ++i) {
        const int col = (lane + i * kRowLanes) * kVec;
        Vec ov = *reinterpret_cast<const Vec*>(o + col), dv = *reinterpret_cast<const Vec*>(dout + col);
        const Element* oe = reinterpret_cast<const Element*>(&ov);
        const Element* de = reinterpret_cast<const Element*>(&dv);
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kVec; ++e) dot += float(oe[e]) * float(de[e]);
      }
    } else {
      for (int col = lane; col < HeadDim; col += kRowLanes) dot += float(o[col]) * float(dout[col]);
    }
    const float lse = p.lse[(int64_t(b) * p.heads_q + head) * p.seqlen_q + m];
    if (lse != -INFINITY) lse_log2 = lse * 1.4426950408889634f;
  }
  dot = quad_allreduce_sum<kRowLanes>(dot);  // every lane of the warp takes part
  if (!valid) return;
  float4* accum = reinterpret_cast<float4*>(p.dq_accum + row * HeadDim);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < HeadDim / (kRowLanes * 4); ++i) accum[lane + i * kRowLanes] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (lane == 0) {
    p.dsum[row] = dot;
    p.lse_log2[row] = lse_log2;
    if (p.dq_semaphore != nullptr && m % p.tile_m == 0) p.dq_semaphore[row / p.tile_m] = 0;
  }
}

struct BwdDqParams {
  const float* dq_accum;  // (batch, heads_q, m_blocks) tiles of TileM x d floats, dq_slot order
  void* dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int heads_q, seqlen_q, m_blocks;
  float softmax_scale;
  bool vector_stores;     // dq rows are 16-byte aligned
};

// dQ = softmax_scale * dq_accum, converted to the input dtype in the caller's layout. One CTA
// per (query block, head, batch), one thread per consumer thread of the main kernel: it reads
// that thread's fragment (coalesced 8-byte loads), places it with the dQ TiledMma in a
// row-major shared-memory tile, and the CTA then writes whole rows with 16-byte stores
// (placing it straight into global memory took 3x cuDNN's conversion time).
template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads)
bwd_convert_dq_kernel(const BwdDqParams p) {
  using Element = typename Traits::Element;
  constexpr int kTileM = Traits::kTileM, kHeadDim = Traits::kHeadDim, kThreads = Traits::kConsumerThreads;
  // Row stride of the staging tile, as store_staged_rows reads it.
  constexpr int kStride = staged_row_stride<kHeadDim>();
  static_assert(staged_tile_bytes<kTileM, kHeadDim, Element>() <= 48 * 1024, "dQ staging tile exceeds static shared memory");
  __shared__ alignas(16) Element staged[kTileM * kStride];
  const int m_block = blockIdx.x, head = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;

  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor acc = partition_fragment_C(mma_dq, typename Traits::DqTileShape{});  // the main kernel's dQ fragment
  const float2* tile = reinterpret_cast<const float2*>(
      p.dq_accum + dq_tile_index(b, head, p.heads_q, p.m_blocks, m_block) * (kTileM * kHeadDim));
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < size(acc) / 2; ++j) {
    const float2 v = tile[dq_slot<kThreads>(tid, j)];
    acc(2 * j) = v.x * p.softmax_scale;
    acc(2 * j + 1) = v.y * p.softmax_scale;
  }
  Tensor frag = convert_fragment<Element>(acc);
  if constexpr (Traits::kDqTransposed) {  // (d, query): neighbouring elements are two query rows
    Tensor coords = thr_dq.partition_C(make_identity_tensor(typename Traits::DqTileShape{}));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(frag); ++i) { staged[get<1>(coords(i)) * kStride + get<0>(coords(i))] = frag(i); }
  } else {
    stage_fragment_rows<kTileM, kHeadDim>(thr_dq, frag, staged);
  }
  __syncthreads();

  const int rows = min(kTileM, p.seqlen_q - m_block * kTileM);
  Element* dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + head * p.dq_head_stride +
                int64_t(m_block) * kTileM * p.dq_row_stride;
  if (p.vector_stores) {
    store_staged_rows<kTileM, kHeadDim, kThreads>(staged, dq, p.dq_row_stride, rows, tid);
  } else {
    for (int i = tid; i < rows * kHeadDim; i += kThreads) {
      dq[(i / kHeadDim) * p.dq_row_stride + i % kHeadDim] = staged[(i / kHeadDim) * kStride + i % kHeadDim];
    }
  }
}

}  // namespace fa3gen
