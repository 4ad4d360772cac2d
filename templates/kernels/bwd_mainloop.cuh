// The backward mainloop (see bwd_traits.cuh for the GEMMs). Warpgroup 0 is the producer: its
// thread 0 loads K and V of the CTA's key block once, then Q, dO and the per-row LSE and D of
// each query block into a `Stages`-deep ring (produce); its warp 1 is the dQ writer, which adds
// each query block's dQ from shared memory to the fp32 accumulator in global memory with one
// bulk reduction (write_dq), so the consumers never wait on global memory. The consumer
// warpgroups (64 keys each, or half of head_dim each: bwd_traits.cuh, kSplitHeadDim)
// recompute P from the saved LSE and accumulate dK and dV in registers over every query block
// (mma).
// Deterministic mode orders the dQ additions: the CTA of key block n adds its part of a query
// block's dQ only after the CTA of key block n - 1 has (a semaphore per query block).
#pragma once
#include <cutlass/arch/barrier.h>
#include "barriers.cuh"
#include "bwd_dq.cuh"
#include "bwd_traits.cuh"
#include "tile_scheduler.cuh"
#include "tma_pipeline.cuh"

namespace fa3gen {

// BwdTraits::kRowsByShfl (FA4's way): a warp's rows of LSE (or D) read
// from shared memory once, 8-byte words spread over the lanes, and handed to the lanes that
// need them by shuffles: 2 reads a lane at 128 queries instead of 32, fewer shared-memory
// wavefronts beside the GEMMs' operand reads. The thread's accumulator column r (of the
// (query, key) view) is query 8 (r / 2) + 2 (lane % 4) + r % 2 (the WGMMA C layout, one MMA
// along the queries, which a warpgroup spans unless kSplitHeadDim; checked on the host for
// d128 64x128 and 80x128 and d64 128x128); lane 4 J + t holds queries 8 (J + 8 k) + 2 t +
// {0, 1} in v[k].
template <int TileM>
struct ShuffledRowStats {
  static constexpr int kWords = (TileM / 8 + 7) / 8;
  float2 v[kWords];
  __device__ __forceinline__ explicit ShuffledRowStats(const float* stats) {
    const int lane = threadIdx.x % 32;
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kWords; ++k) {
      const int query = 8 * (lane / 4 + 8 * k) + 2 * (lane % 4);
      v[k] = query < TileM ? *reinterpret_cast<const float2*>(stats + query) : make_float2(0.f, 0.f);
    }
  }
  __device__ __forceinline__ float operator()(int r) const {
    const int j = r / 2;
    const float word = r % 2 ? v[j / 8].y : v[j / 8].x;
    return __shfl_sync(0xffffffff, word, 4 * (j % 8) + threadIdx.x % 4);
  }
};

template <class Traits>
struct BwdMainloop {
  using Element = typename Traits::Element;
  using PipelineState = typename Traits::PipelineState;
  static constexpr int kTileM = Traits::kTileM, kTileN = Traits::kTileN, kHeadDim = Traits::kHeadDim;
  static constexpr int kWriterThreads = Traits::kConsumerThreads + 32;  // consumers + the dQ writer warp
  static constexpr int kWgWriterThreads = 128 + 32;  // kDqPerWg: one consumer warpgroup + the writer

  BwdParams<Traits> const& p;
  typename Traits::SharedStorage& smem;
  typename Traits::Pipeline pipe;  // Q, dO, LSE and D of one query block per stage

  // Once, by one thread of warp 0, before the pipeline is built.
  __device__ __forceinline__ static void init(BwdParams<Traits> const& p, typename Traits::SharedStorage& smem) {
    prefetch_tma_descriptors(p.tma_q, p.tma_do, p.tma_k, p.tma_v);
    TmaBarrier::init(&smem.barrier_kv, 1);
    if constexpr (Traits::kSplitQdo) {
      for (int s = 0; s < Traits::kStages; ++s) TmaBarrier::init(&smem.barrier_do[s], 1);
    }
  }
  // The bytes a stage's pipeline barrier expects: Q, dO, LSE and D, or (kSplitQdo) Q and LSE.
  static constexpr uint32_t kStageTxBytes = (Traits::kSplitQdo ? 1 : 2) * (Traits::kBytesQ + Traits::kBytesRowStats);

  __device__ __forceinline__ BwdMainloop(BwdParams<Traits> const& p_, typename Traits::SharedStorage& smem_, int warp_idx)
      : p(p_), smem(smem_),
        pipe(smem_.pipeline_q,
             // kDqInStages: the dQ writer's arrival too, once it has read dQ out of the stage
             // (one arrival among the consumers' threads: CUTLASS's PipelineTmaAsync counts a
             // one-CTA cluster's consumer arrivals per thread; a larger cluster counts one per
             // warpgroup, which would lose it)
             tma_pipeline_params<typename Traits::Pipeline>(kStageTxBytes, true, warp_idx,
                                           Traits::kConsumerThreads + (Traits::kDqInStages ? 1 : 0)),
             Shape<_1, _1, _1>{}) {}

  // kDqInStages: half `half` of a query block's dQ lives in its stage's Q (0) or dO (1) buffer.
  __device__ __forceinline__ float* dq_stage_half(int stage, int half) const {
    Element* buffer = (half == 0 ? smem.q.data() : smem.dout.data()) + stage * kTileM * kHeadDim;
    return reinterpret_cast<float*>(buffer);
  }

  // ---------------- producer: the loader thread ----------------
  // Query blocks [m_first, m_end) of each query head of the kv head.
  // TMA partitions of row tiles of Q, dO, K or V (tma_pipeline.cuh).
  template <class Tma, class TileShape, class Coord, class SmemLayout>
  __device__ __forceinline__ auto row_tiles(Tma const& tma, int seqlen, int total, int offset, int heads, int head,
                                            int b, TileShape tile, Coord coord, Element* s, SmemLayout layout) const {
    return fa3gen::row_tiles<Traits::kVarlen, kHeadDim>(tma, seqlen, p.batch, total, offset, heads, head, b, tile,
                                                        coord, s, layout);
  }

  __device__ __forceinline__ void produce(TileCoord const& tile, SeqSlice const& seq, int m_first, int m_end) {
    const int b = tile.batch;
    auto load_kv = [&](auto const& tma, Element* smem_ptr) {
      auto [tg, ts] = row_tiles(tma, p.seqlen_k, p.varlen.total_k, seq.offset_k, p.heads_kv, tile.head, b,
                                Shape<Int<kTileN>, Int<kHeadDim>>{}, make_coord(tile.block, _0{}), smem_ptr,
                                typename Traits::SmemLayoutK{});
      copy(tma.with(smem.barrier_kv, 0), tg, ts);
    };
    TmaBarrier::arrive_and_expect_tx(&smem.barrier_kv, 2 * Traits::kBytesK);
    load_kv(p.tma_k, smem.k.data());
    load_kv(p.tma_v, smem.v.data());

    auto load_rows = [&](auto const& tma, Element* smem_ptr, int head, int m_block, PipelineState const& st,
                         uint64_t* barrier) {
      auto [tg, ts] = row_tiles(tma, p.seqlen_q, p.varlen.total_q, seq.offset_q, p.heads_q, head, b,
                                Shape<Int<kTileM>, Int<kHeadDim>>{}, make_coord(_, _0{}), smem_ptr,
                                typename Traits::SmemLayoutQ{});
      copy(tma.with(*barrier, 0), tg(_, m_block), ts(_, st.index()));
    };
    PipelineState st = cutlass::make_producer_start_state<typename Traits::Pipeline>();
    for (int hq = 0; hq < p.heads_per_kv; ++hq) {
      const int head = tile.head * p.heads_per_kv + hq;
      const int64_t stats_row0 = Traits::kVarlen ? q_tile_base(p, b, head, seq) * kTileM
                                                 : (int64_t(b) * p.heads_q + head) * p.seqlen_q_rounded;
      for (int m_block = m_first; m_block < m_end; ++m_block) {
        pipe.producer_acquire(st);
        uint64_t* barrier = pipe.producer_get_barrier(st);
        // What S needs first (Q, LSE), then dO and D: on barrier_do where kSplitQdo.
        uint64_t* barrier_do = Traits::kSplitQdo ? &smem.barrier_do[st.index()] : barrier;
        if constexpr (Traits::kSplitQdo) {
          TmaBarrier::arrive_and_expect_tx(barrier_do, Traits::kBytesQ + Traits::kBytesRowStats);
        }
        const int64_t row0 = stats_row0 + int64_t(m_block) * kTileM;
        load_rows(p.tma_q, smem.q.data(), head, m_block, st, barrier);
        SM90_BULK_COPY_G2S::copy(p.lse_log2 + row0, barrier, smem.lse_log2[st.index()], Traits::kBytesRowStats);
        load_rows(p.tma_do, smem.dout.data(), head, m_block, st, barrier_do);
        SM90_BULK_COPY_G2S::copy(p.dsum + row0, barrier_do, smem.dsum[st.index()], Traits::kBytesRowStats);
        ++st;
      }
    }
  }

  // ---------------- producer: the dQ writer warp ----------------
  // Query blocks [m_first, m_end) of the m_blocks of each query head of the kv head.
  __device__ __forceinline__ void write_dq(TileCoord const& tile, SeqSlice const& seq, int m_first, int m_end,
                                           int m_blocks, typename Traits::Mask const& mask) {
    constexpr int kTileElems = kTileM * kHeadDim;
    const bool leader = threadIdx.x % 32 == 0;
    const int head0 = tile.head * p.heads_per_kv;
    PipelineState st;  // the stage of each query block, as the consumers see it (kDqInStages)
    int64_t dq_tile = Traits::kVarlen ? q_tile_base(p, tile.batch, head0, seq) + m_first
                                      : dq_tile_index(tile.batch, head0, p.heads_q, m_blocks, m_first);
    // to the next head's m_first: the heads' tiles are m_blocks apart (varlen: q_tiles_padded)
    const int head_stride = Traits::kVarlen ? p.q_tiles_padded : m_blocks;
    const int head_step = (Traits::kLocal || Traits::kVarlen) ? head_stride - (m_end - m_first) : m_first;
    for (int hq = 0; hq < p.heads_per_kv; ++hq, dq_tile += head_step) {
      for (int m_block = m_first; m_block < m_end; ++m_block, ++dq_tile) {
        // kNoLastDqWait: no "empty" arrival after the last block, which no consumer waits for.
        const bool arrive_empty = !Traits::kNoLastDqWait || hq + 1 < p.heads_per_kv || m_block + 1 < m_end;
        if constexpr (Traits::kDqPerWg) {
          write_dq_halves(dq_tile, m_block, tile, mask, leader, arrive_empty);
          continue;
        }
        barrier_sync<BarrierId::kBwdDqFull>(kWriterThreads);
        if (leader) {
          if (p.deterministic) {
            // The key blocks that see this query block add in order, from its first one.
            const int turn = tile.block - mask.key_blocks(m_block).first;
            while (load_acquire(p.dq_semaphore + dq_tile) != turn) {}
          }
          float* dq_gmem = p.dq_accum + dq_tile * kTileElems;
          if constexpr (Traits::kDqInStages) {  // halves in the stage's Q and dO buffers (dq_slot)
            bulk_reduce_add(dq_gmem, dq_stage_half(st.index(), 0), Traits::kBytesdQ / 2);
            bulk_reduce_add(dq_gmem + kTileElems / 2, dq_stage_half(st.index(), 1), Traits::kBytesdQ / 2);
          } else {
            bulk_reduce_add(dq_gmem, smem.dq.data(), Traits::kBytesdQ);
          }
          finish_dq_add(dq_tile);
          // The stage's last arrival (the consumers' come when they are done with it); on the
          // barrier itself, as consumer_release traps outside a consumer warpgroup in debug builds.
          if constexpr (Traits::kDqInStages) smem.pipeline_q.empty_barrier_[st.index()].arrive();
        }
        ++st;
        __syncwarp();
        if (arrive_empty) barrier_arrive<BarrierId::kBwdDqEmpty>(kWriterThreads);
      }
    }
    if (leader) bulk_wait_done();
  }

  // The leader's end of a query block's dQ addition: deterministic mode waits for it to be
  // complete before the next key block's turn; otherwise only for the shared memory to be read.
  __device__ __forceinline__ void finish_dq_add(int64_t dq_tile) {
    if (p.deterministic) {
      bulk_wait_done();
      asm volatile("fence.proxy.async.global;" ::: "memory");
      __threadfence();
      atomicAdd(p.dq_semaphore + dq_tile, 1);
    } else {
      bulk_wait_read();
    }
  }

  // kDqPerWg: each consumer warpgroup's half of a query block's dQ, as it arrives.
  __device__ __forceinline__ void write_dq_halves(int64_t dq_tile, int m_block, TileCoord const& tile,
                                                  typename Traits::Mask const& mask, bool leader,
                                                  bool arrive_empty) {
    constexpr int kHalfElems = kTileM * kHeadDim / 2;
    float* dq_gmem = p.dq_accum + dq_tile * (kTileM * kHeadDim);
    if (leader && p.deterministic) {
      const int turn = tile.block - mask.key_blocks(m_block).first;
      while (load_acquire(p.dq_semaphore + dq_tile) != turn) {}
    }
    barrier_sync<BarrierId::kBwdDqFull0>(kWgWriterThreads);
    if (leader) bulk_reduce_add(dq_gmem, smem.dq.data(), Traits::kBytesdQ / 2);
    barrier_sync<BarrierId::kBwdDqFull1>(kWgWriterThreads);
    if (leader) bulk_reduce_add(dq_gmem + kHalfElems, smem.dq.data() + kHalfElems, Traits::kBytesdQ / 2);
    if (leader) finish_dq_add(dq_tile);
    __syncwarp();
    if (arrive_empty) {
      barrier_arrive<BarrierId::kBwdDqEmpty0>(kWgWriterThreads);
      barrier_arrive<BarrierId::kBwdDqEmpty1>(kWgWriterThreads);
    }
  }

  // ---------------- consumers: every query block of the key block ----------------
  // The shared-memory tiles as the GEMMs read them (the t-suffixed ones are transposed views
  // of the same bytes; P's only where the kernel stores P or P^T: Traits::kPInSmem).
  __device__ __forceinline__ auto smem_tiles() const {
    auto tile = [](auto* ptr, auto layout) { return make_tensor(make_smem_ptr(ptr), layout); };
    using T = Traits;
    return cute::make_tuple(
        tile(smem.q.data(), typename T::SmemLayoutQ{}), tile(smem.dout.data(), typename T::SmemLayoutQ{}),
        tile(smem.q.data(), typename T::SmemLayoutQt{}), tile(smem.dout.data(), typename T::SmemLayoutQt{}),
        tile(smem.k.data(), typename T::SmemLayoutK{}), tile(smem.v.data(), typename T::SmemLayoutK{}),
        tile(smem.k.data(), typename T::SmemLayoutKt{}), tile(smem.ds.data(), typename T::SmemLayoutdS{}),
        tile(smem.ds.data(), typename T::SmemLayoutdSt{}), tile(smem.p.data(), typename T::SmemLayoutdS{}),
        tile(smem.p.data(), typename T::SmemLayoutdSt{}));
  }
  // varlen: TMA reads rows past a sequence's ends unbounded (the next sequence, padding), and
  // 0 * NaN is NaN in the GEMMs (fwd_mainloop.cuh, clear_v_past_end). So K and V rows past
  // seqlen_k and the last query block's Q and dO rows past seqlen_q are zeroed before the
  // GEMMs read them: S^T and dP^T are then 0 there, P^T = exp2(-LSE) = 0 (a padded row's LSE
  // is +inf, D 0: bwd_prepost.cuh) and dS^T = 0, so nothing from those rows reaches dK, dV,
  // dQ. (kBwdDsReady: every consumer passes it in the same order, once more here.)
  template <int Rows>
  __device__ __forceinline__ void zero_rows_past(Element* a, Element* b, int valid, int tid) {
    constexpr int kLineBytes = smem_swizzle_bytes<Element, Traits::kDkvCols>();  // AtomRows
    zero_tile_rows<Element, Rows, kHeadDim, kLineBytes, Traits::kConsumerThreads>(a, valid, tid);
    zero_tile_rows<Element, Rows, kHeadDim, kLineBytes, Traits::kConsumerThreads>(b, valid, tid);
    cutlass::arch::fence_view_async_shared();
    barrier_sync<BarrierId::kBwdDsReady>(Traits::kConsumerThreads);
  }
  // K and V landed (and their rows past the sequence zeroed).
  __device__ __forceinline__ void wait_kv(typename Traits::Mask const& mask, int n_block, int tid) {
    TmaBarrier::wait(&smem.barrier_kv, 0);
    if constexpr (Traits::kVarlen) {
      if (mask.seqlen_k - n_block * kTileN < kTileN) {
        zero_rows_past<kTileN>(smem.k.data(), smem.v.data(), mask.seqlen_k - n_block * kTileN, tid);
      }
    }
  }
  // The stage's Q and dO rows past the sequence zeroed (its last query block).
  __device__ __forceinline__ void zero_q_rows_past(typename Traits::Mask const& mask, int m_block,
                                                   PipelineState const& st, int tid) {
    if constexpr (Traits::kVarlen) {
      if (mask.seqlen_q - m_block * kTileM < kTileM) {
        constexpr int kStageElems = kTileM * kHeadDim;
        static_assert(cosize_v<typename Traits::SmemLayoutQ> == kStageElems * Traits::kStages);
        zero_rows_past<kTileM>(smem.q.data() + st.index() * kStageElems,
                               smem.dout.data() + st.index() * kStageElems, mask.seqlen_q - m_block * kTileM, tid);
      }
    }
  }

  // Hand a query block's dQ fragment to the writer warp (once it has read the previous
  // block's), then release the stage's Q, dO, LSE and D (kDqInStages: the stage is free once
  // the writer has also read dQ out of it).
  template <class TDq>
  __device__ __forceinline__ void hand_dq(TDq const& tdQrdQ, PipelineState const& st, int iter, int tid) {
    if (iter > 0) barrier_sync<BarrierId::kBwdDqEmpty>(kWriterThreads);
    if constexpr (Traits::kDqInStages) {
      // Into this block's Q and dO buffers, over this warpgroup's own columns (dq_slot):
      // only its own dK / dV GEMMs, now finished, read them since kBwdDsReady. (The other
      // warpgroup's S^T and dP^T GEMMs read every column: scores_to_grads waits for both
      // before kBwdDsReady, which is what orders them; a dP wait moved past that barrier,
      // as in kDqPerWg's step, would race here.)
      constexpr int kHalfSlots = kTileM * kHeadDim / 4;  // float2 per half
      static_assert(decltype(size(tdQrdQ))::value / 2 == Traits::kDqChunks);
      float2* sdQ_q = reinterpret_cast<float2*>(dq_stage_half(st.index(), 0));
      float2* sdQ_do = reinterpret_cast<float2*>(dq_stage_half(st.index(), 1));
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size(tdQrdQ) / 2; ++j) {  // the first half's chunks first (dq_slot)
        const float2 v = make_float2(tdQrdQ(2 * j), tdQrdQ(2 * j + 1));
        if (j < Traits::kDqChunks / 2) sdQ_q[dq_slot<Traits>(tid, j)] = v;
        else sdQ_do[dq_slot<Traits>(tid, j) - kHalfSlots] = v;
      }
    } else {
      float2* sdQ = reinterpret_cast<float2*>(smem.dq.data());
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size(tdQrdQ) / 2; ++j) {
        sdQ[dq_slot<Traits>(tid, j)] = make_float2(tdQrdQ(2 * j), tdQrdQ(2 * j + 1));
      }
    }
    cutlass::arch::fence_view_async_shared();
    barrier_arrive<BarrierId::kBwdDqFull>(kWriterThreads);
    pipe.consumer_release(st);
  }

  // Row r's LSE and D read from the stage's shared-memory copies; query(r) is its query in the tile.
  template <class QueryOf>
  __device__ __forceinline__ auto smem_row_stats(int stage, QueryOf const& query) const {
    const float* lse_log2 = smem.lse_log2[stage];
    const float* dsum = smem.dsum[stage];
    return cute::make_tuple([=](int r) { return lse_log2[query(r)]; }, [=](int r) { return dsum[query(r)]; });
  }

  // S(r, c) = P = exp2(S * scale_log2 - LSE) for rows [First, Last) of the thread's fragment.
  template <int First, int Last, class TScores, class LseOf>
  __device__ __forceinline__ void exp_rows(TScores& S, LseOf const& lse_of) const {
    CUTLASS_PRAGMA_UNROLL
    for (int r = First; r < Last; ++r) {
      const float lse = lse_of(r);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(S); ++c) S(r, c) = exp2f(fmaf(S(r, c), p.scale_log2, -lse));
    }
  }

  // dP(r, c) = dS = P (dP - D) for rows [First, Last) of the (query, key) views.
  template <int First, int Last, class TScores, class DOf>
  __device__ __forceinline__ static void grad_rows(TScores const& S, TScores& dP, DOf const& d_of) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = First; r < Last; ++r) {
      const float d = d_of(r);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(S); ++c) dP(r, c) = S(r, c) * (dP(r, c) - d);
    }
  }

  // Rows [First, Last) of a (query, key) view converted to 16 bits, two rows at a time: rows
  // 2i and 2i + 1 are a column pair of the accumulator, one packed conversion (kSplitDkv).
  template <int First, int Last, class TSrc, class TDst>
  __device__ __forceinline__ static void convert_rows(TSrc const& src, TDst& dst) {
    static_assert(First % 2 == 0 && Last % 2 == 0);
    cutlass::NumericArrayConverter<Element, float, 2> convert;
    CUTLASS_PRAGMA_UNROLL
    for (int r = First; r < Last; r += 2) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(src); ++c) {
        const cutlass::Array<Element, 2> v = convert(cutlass::Array<float, 2>{src(r, c), src(r + 1, c)});
        dst(r, c) = v[0];
        dst(r + 1, c) = v[1];
      }
    }
  }

  // scores_to_grads' default on_part: nothing between the parts.
  struct NoPartWork {
    template <class First, class Last>
    __device__ __forceinline__ void operator()(First, Last) const {}
  };

  // An accumulator fragment as its (query, key) view: the rows-by-columns view (keys on the
  // rows, acc_as_rowcol) transposed, so that a row's LSE and D are read once.
  template <class TAcc>
  __device__ __forceinline__ static auto qk_view(TAcc& t) {
    auto rc = make_tensor(t.data(), acc_as_rowcol(t.layout()));
    return make_tensor(rc.data(), make_layout(layout<1>(rc), layout<0>(rc)));
  }

  // Ends ptxas's basic block here: a loop on the clock, which it can neither drop nor predicate
  // (taken at most once in 2^32 cycles, to sleep). A volatile read of a parameter instead was
  // hoisted above its guard as a generic load of the parameter's offset: an illegal address.
  __device__ __forceinline__ static void end_basic_block() {
    uint32_t clock;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(clock));
    while (clock == 0u) asm volatile("nanosleep.u32 32;\n\tmov.u32 %0, %%clock;" : "=r"(clock));
  }

  // P and dS from the S and dP accumulators (both GEMMs issued, S's committed first), in
  // place: S becomes P = exp2(S * scale_log2 - LSE) and dP becomes dS = P (dP - D). S and dP
  // are (query, key) views, so that a row's LSE and D are read once; lse_of(r) and d_of(r) are
  // row r's. mask_s() masks S in place (-inf outside the mask). Without softcap, the
  // exponentials of the first EarlyQuarters / 4 of the rows come before the dP wait, and the
  // rest run in Parts parts along the queries, on_part(Int<first>, Int<last>) called once
  // rows [first, last) are P and dS (kSplitDkv converts them there and issues the RS GEMMs'
  // k-blocks that take them: rows r are queries 8 (r / 2) + ..., so rows [first, last) are
  // k-blocks [first / 4, last / 4) of 16 queries).
  template <int EarlyQuarters, int Parts = 1, class TScores, class LseOf, class DOf, class MaskS,
            class OnPart = NoPartWork>
  __device__ __forceinline__ void scores_to_grads(TScores& S, TScores& dP, LseOf const& lse_of, DOf const& d_of,
                                                  MaskS const& mask_s, OnPart const& on_part = {}) {
    warpgroup_wait<1>();  // S is done, dP may still run
    if constexpr (Traits::kSoftcap) {
      // S becomes t = tanh(S * scale / cap); once dP is done, dP becomes (dP - D)(1 - t^2),
      // then the mask, then P = exp2(t * scale_log2 - LSE) (scale_log2 holds cap * log2(e))
      // and dS = P * dP. Only t is kept: 1 - t^2 in a fragment of its own spilled 36 bytes
      // (d128 64x128), one fused pass 16-44 bytes (the compiler batched every exp2, keeping
      // t and P both live), and masking before the (1 - t^2) pass 4-12 bytes.
      p.softcap.apply(S);
      warpgroup_wait<0>();  // dP
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < size<0>(S); ++r) {
        const float d = d_of(r);
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(S); ++c) dP(r, c) = (dP(r, c) - d) * fmaf(-S(r, c), S(r, c), 1.f);
      }
      mask_s();  // only now: 1 - t^2 above took finite t; exp2(-inf) = 0 below
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < size<0>(S); ++r) {
        const float lse = lse_of(r);
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          S(r, c) = exp2f(fmaf(S(r, c), p.scale_log2, -lse));
          dP(r, c) *= S(r, c);
        }
      }
    } else {
      mask_s();
      // Without a block boundary ptxas lifts the dP wait (it has no inputs) to after the first
      // few exponentials, or above all of them.
      constexpr int kRows = decltype(size<0>(S))::value;
      constexpr int kEarlyRows = kRows * EarlyQuarters / 4;
      static_assert(Parts == 1 || kRows % (4 * Parts) == 0, "parts of whole k-blocks");
      exp_rows<0, kEarlyRows>(S, lse_of);
      if constexpr (kEarlyRows < kRows) end_basic_block();
      warpgroup_wait<0>();  // dP
      cute::for_each(make_int_sequence<Parts>{}, [&](auto part) {
        constexpr int first = kRows * decltype(part)::value / Parts, last = first + kRows / Parts;
        exp_rows<(first > kEarlyRows ? first : kEarlyRows), (last > kEarlyRows ? last : kEarlyRows)>(S, lse_of);
        grad_rows<first, last>(S, dP, d_of);
        on_part(Int<first>{}, Int<last>{});
      });
    }
  }

  // Accumulates dK (unscaled) and dV into tdKrdK and tdVrdV; tid is the thread's index among
  // the consumers.
  template <class TAcc>
  __device__ __forceinline__ void mma(TileCoord const& tile, int m_first, int m_end, typename Traits::Mask const& mask, TAcc& tdKrdK,
                      TAcc& tdVrdV, int tid) {
    const int n_block = tile.block;
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);  // accumulators: per thread
    auto wg_sdp = warpgroup_slice(mma_sdp, tid);    // shared-memory operands: per warpgroup
    auto wg_dkv = warpgroup_slice(mma_dkv, tid);
    auto wg_dq = warpgroup_slice(mma_dq, tid);
    auto [sQ, sdO, sQt, sdOt, sK, sV, sKt, sdS, sdSt, sP, sPt] = smem_tiles();  // sP, sPt: kSplitHeadDim

    Tensor tSrK = wg_sdp.partition_fragment_A(sK);  // (MMA, MMA_N, MMA_K)
    Tensor tSrV = wg_sdp.partition_fragment_A(sV);
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);  // (MMA, MMA_M, MMA_K, Stages)
    Tensor tSrdO = wg_sdp.partition_fragment_B(sdO);
    Tensor tdVrdOt = wg_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_D, MMA_K, Stages)
    Tensor tdKrQt = wg_dkv.partition_fragment_B(sQt);
    // dQ = dS K (dS is A, K^T is B) or dQ^T = K^T dS^T (K^T is A, dS is B).
    // (The operands are arguments, not captures: a lambda may not capture a structured
    // binding before C++20.)
    Tensor tdQrdS = [](auto const& wg, auto const& tile) {
      if constexpr (Traits::kDqTransposed) return wg.partition_fragment_B(tile);
      else return wg.partition_fragment_A(tile);
    }(wg_dq, sdS);  // (MMA, MMA_M or MMA_N, MMA_K, 2)
    Tensor tdQrKt = [](auto const& wg, auto const& tile) {
      if constexpr (Traits::kDqTransposed) return wg.partition_fragment_A(tile);
      else return wg.partition_fragment_B(tile);
    }(wg_dq, sKt);
    // dQ = dS K, or dQ^T = K^T dS^T, from dS^T buffer buf.
    auto issue_dq = [&](int buf, auto& tdQrdQ) {
      if constexpr (Traits::kDqTransposed) {
        wgmma_issue<true>(mma_dq, tdQrKt, tdQrdS(_, _, _, buf), tdQrdQ);
      } else {
        wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, buf), tdQrKt, tdQrdQ);
      }
    };
    // dS^T goes to shared memory with stmatrix (8x8 tiles whose 16-byte rows are contiguous
    // queries): a few STSM per thread instead of one 2-byte store per element, which took
    // d128 64x128 from 497 to ~557 TFLOP/s at seqlen 16k, and d128 80x128 (dQ^T) by 5-9%.
    auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_r2s_ds = r2s_ds.get_thread_slice(tid);
    Tensor tdSsdS = thr_r2s_ds.partition_D(sdSt);  // (CPY, CPY_N, CPY_M, 2)
    // kSplitHeadDim: the A operands of dV and dK, from shared memory.
    auto split_operand_a = [](auto const& wg, auto const& tile) {
      if constexpr (Traits::kSplitHeadDim) return wg.partition_fragment_A(tile);  // (MMA, MMA_N, MMA_K, 2)
      else return 0;
    };
    auto tdVsPt = split_operand_a(wg_dkv, sPt);
    auto tdKsdSt = split_operand_a(wg_dkv, sdSt);
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kTileN>, Int<kTileM>>{}));
    Tensor coordS = make_tensor(cS.data(), acc_as_rowcol(cS.layout()));  // (key, query) in the tile

    wait_kv(mask, n_block, tid);
    PipelineState st;
    int iter = 0;
    for (int hq = 0; hq < p.heads_per_kv; ++hq) {
      for (int m_block = m_first; m_block < m_end; ++m_block, ++iter) {
        pipe.consumer_wait(st);
        zero_q_rows_past(mask, m_block, st, tid);
        Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kTileN>, Int<kTileM>>{});
        Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kTileN>, Int<kTileM>>{});
        wgmma_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, st.index()), tSrS);
        if constexpr (Traits::kSplitQdo) TmaBarrier::wait(&smem.barrier_do[st.index()], st.phase());
        wgmma_issue<true>(mma_sdp, tSrV, tSrdO(_, _, _, st.index()), tSrdP);
        Tensor S = make_tensor(tSrS.data(), acc_as_rowcol(tSrS.layout()));
        // Keys on the rows here: the (query, key) views are transposes.
        Tensor S_qk = qk_view(tSrS);
        Tensor dP_qk = qk_view(tSrdP);
        auto mask_s = [&] {
          if (mask.needs_mask(m_block, n_block)) mask.apply_transposed(S, coordS, n_block * kTileN, m_block * kTileM);
        };
        // kDqPerWg (FA4's sm90 step): half of the exponentials before the dP wait, so that the
        // warps are not left waiting on dP with the softmax still to do. With the shuffled rows
        // ptxas put the wait above every exponential in the old order (d64): a quarter there,
        // about where it places it with the shared-memory reads (13 of 64).
        constexpr int kEarlyQuarters = Traits::kDqPerWg ? 2 : Traits::kRowsByShfl ? 1 : 4;
        // P and dS in 16 bits (rP, rdS). kSplitDkv: dV and dK issued in parts as each part's P
        // and dS are converted (the branch below then issues neither).
        auto [rP, rdS] = [&] {
          auto with_stats = [&](auto const& lse_of, auto const& d_of) {
            if constexpr (Traits::kSplitDkv) {
              Tensor rP = make_tensor<Element>(tSrS.layout());
              Tensor rdS = make_tensor<Element>(tSrdP.layout());
              Tensor rP_qk = qk_view(rP);
              Tensor rdS_qk = qk_view(rdS);
              Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
              Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));
              scores_to_grads<kEarlyQuarters, Traits::kSplitDkvParts>(
                  S_qk, dP_qk, lse_of, d_of, mask_s, [&](auto first, auto last) {
                    constexpr int r0 = decltype(first)::value, r1 = decltype(last)::value;
                    convert_rows<r0, r1>(S_qk, rP_qk);
                    convert_rows<r0, r1>(dP_qk, rdS_qk);
                    wgmma_issue_k<false, r0 / 4, r1 / 4>(mma_dkv, tdVrP, tdVrdOt(_, _, _, st.index()), tdVrdV);
                    wgmma_issue_k<false, r0 / 4, r1 / 4>(mma_dkv, tdKrdS, tdKrQt(_, _, _, st.index()), tdKrdK);
                  });
              return cute::make_tuple(rP, rdS);
            } else {
              scores_to_grads<kEarlyQuarters>(S_qk, dP_qk, lse_of, d_of, mask_s);
              return cute::make_tuple(convert_fragment<Element>(tSrS), convert_fragment<Element>(tSrdP));
            }
          };
          if constexpr (Traits::kRowsByShfl) {
            const ShuffledRowStats<kTileM> lse(smem.lse_log2[st.index()]), dsum(smem.dsum[st.index()]);
            return with_stats(lse, dsum);
          } else {
            auto [lse_of, d_of] = smem_row_stats(st.index(), [&](int r) { return get<1>(coordS(0, r)); });
            return with_stats(lse_of, d_of);
          }
        }();
        const int buf = iter & 1;
        if constexpr (Traits::kSplitHeadDim) {
          // Each warpgroup holds half of the queries of P^T: the dV GEMMs need all of them.
          copy(r2s_ds, thr_r2s_ds.retile_S(rP), thr_r2s_ds.partition_D(sPt)(_, _, _, buf));
        } else if constexpr (Traits::kDqPerWg) {
          Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
          Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));
          wgmma_issue<false>(mma_dkv, tdVrP, tdVrdOt(_, _, _, st.index()), tdVrdV);
          copy(r2s_ds, thr_r2s_ds.retile_S(rdS), tdSsdS(_, _, _, buf));
          cutlass::arch::fence_view_async_shared();
          barrier_sync<BarrierId::kBwdDsReady>(Traits::kConsumerThreads);
          Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Traits::DqTileShape{});
          issue_dq(buf, tdQrdQ);
          warpgroup_wait<1>();  // dV
#ifdef FA3GEN_BWD_DEBUG_LATE_DK
          // Debug build: on the last block, warpgroup 1 issues its dK GEMM only after handing
          // over dQ and a pause of about 50 us, so that it still reads Q when warpgroup 0
          // reaches the epilogue, which stages over Q (kEpilogueSync must hold it back; with
          // FA3GEN_BWD_NO_EPILOGUE_SYNC too, dK comes out wrong).
          const bool late_dk = tid / 128 == 1 && hq + 1 == p.heads_per_kv && m_block + 1 == m_end;
#else
          constexpr bool late_dk = false;
#endif
          if (!late_dk) {
            wgmma_issue<false>(mma_dkv, tdKrdS, tdKrQt(_, _, _, st.index()), tdKrdK);
            warpgroup_wait<1>();  // dQ; dK runs on
          } else {
            warpgroup_wait<0>();  // dQ
          }
          const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
          if (iter > 0) barrier_sync_at<BarrierId::kBwdDqEmpty0>(wg, kWgWriterThreads);
          float2* sdQ = reinterpret_cast<float2*>(smem.dq.data());
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(tdQrdQ) / 2; ++j) {
            sdQ[dq_slot<Traits>(tid, j)] = make_float2(tdQrdQ(2 * j), tdQrdQ(2 * j + 1));
          }
          cutlass::arch::fence_view_async_shared();
          barrier_arrive_at<BarrierId::kBwdDqFull0>(wg, kWgWriterThreads);
          if (late_dk) {
            for (const long long start = clock64(); clock64() - start < 100000;) {}
            wgmma_issue<false>(mma_dkv, tdKrdS, tdKrQt(_, _, _, st.index()), tdKrdK);
          }
          warpgroup_wait<0>();  // dK: done with the stage's Q
          pipe.consumer_release(st);
          ++st;
          continue;
        } else {
          // dV and dK run while dS^T goes to shared memory (buffer iter % 2) and the
          // warpgroups meet. (Issuing dQ before dK, so that handing dQ to the writer overlaps
          // the dK GEMM, as FA3 and FA4 do: 0.965-1.005x at d128 64x128, where it no longer
          // spills; the wait it shortens is for the tensor pipe, which dK keeps busy anyway.)
          if constexpr (!Traits::kSplitDkv) {
            Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
            Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));
            wgmma_issue<false>(mma_dkv, tdVrP, tdVrdOt(_, _, _, st.index()), tdVrdV);
            wgmma_issue<false>(mma_dkv, tdKrdS, tdKrQt(_, _, _, st.index()), tdKrdK);
          }
        }
        copy(r2s_ds, thr_r2s_ds.retile_S(rdS), tdSsdS(_, _, _, buf));
        cutlass::arch::fence_view_async_shared();
        barrier_sync<BarrierId::kBwdDsReady>(Traits::kConsumerThreads);
        if constexpr (Traits::kSplitHeadDim) {
          wgmma_issue<false>(mma_dkv, tdVsPt(_, _, _, buf), tdVrdOt(_, _, _, st.index()), tdVrdV);
          wgmma_issue<false>(mma_dkv, tdKsdSt(_, _, _, buf), tdKrQt(_, _, _, st.index()), tdKrdK);
        }
        Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Traits::DqTileShape{});
        issue_dq(buf, tdQrdQ);
        warpgroup_wait<0>();

        hand_dq(tdQrdQ, st, iter, tid);
        ++st;
      }
    }
    // kDqInStages: the writer signals "empty" after every block; take the last one so that no
    // arrival is left over. (Elsewhere, kNoLastDqWait, it skips that one and the epilogue syncs
    // the consumers alone, kEpilogueSync; kDqPerWg is always among those.)
    static_assert(!Traits::kDqPerWg || Traits::kNoLastDqWait);
    if constexpr (!Traits::kNoLastDqWait) {
      if (iter > 0) barrier_sync<BarrierId::kBwdDqEmpty>(kWriterThreads);
    }
  }

  // kTransposedDkv (bwd_traits.cuh): S and dP with the queries on M and the keys split over
  // the warpgroups; accumulates dK^T (unscaled) and dV^T, this warpgroup's 64 head_dim rows.
  template <class TAcc>
  __device__ __forceinline__ void mma_transposed(TileCoord const& tile, int m_first, int m_end,
                                                 typename Traits::Mask const& mask, TAcc& tdKrdKt, TAcc& tdVrdVt,
                                                 int tid) {
    static_assert(Traits::kTransposedDkv && Traits::kDqInStages && !Traits::kDqTransposed);
    const int n_block = tile.block;
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    auto wg_sdp = warpgroup_slice(mma_sdp, tid);
    auto wg_dkv = warpgroup_slice(mma_dkv, tid);
    auto wg_dq = warpgroup_slice(mma_dq, tid);
    auto [sQ, sdO, sQt, sdOt, sK, sV, sKt, sdS, sdSt, sP, sPt] = smem_tiles();

    Tensor tSrQ = wg_sdp.partition_fragment_A(sQ);        // (MMA, MMA_M, MMA_K, Stages)
    Tensor tSrdO = wg_sdp.partition_fragment_A(sdO);
    Tensor tSrK = wg_sdp.partition_fragment_B(sK);        // (MMA, MMA_N, MMA_K)
    Tensor tSrV = wg_sdp.partition_fragment_B(sV);
    Tensor tdVrdOt = wg_dkv.partition_fragment_A(sdOt);   // (MMA, MMA_D, MMA_K, Stages)
    Tensor tdKrQt = wg_dkv.partition_fragment_A(sQt);
    Tensor tdVrPt = wg_dkv.partition_fragment_B(sPt);     // (MMA, MMA_N, MMA_K, 2)
    Tensor tdKrdSt = wg_dkv.partition_fragment_B(sdSt);
    Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);      // (MMA, MMA_M, MMA_K, 2)
    Tensor tdQrKt = wg_dq.partition_fragment_B(sKt);
    // P and dS go to shared memory with stmatrix (8x8 tiles whose 16-byte rows are contiguous keys).
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_r2s = r2s.get_thread_slice(tid);
    Tensor tPsP = thr_r2s.partition_D(sP);                // (CPY, CPY_M, CPY_N, 2)
    Tensor tdSsdS = thr_r2s.partition_D(sdS);
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
    Tensor coordS = make_tensor(cS.data(), acc_as_rowcol(cS.layout()));  // (query, key) in the tile

    wait_kv(mask, n_block, tid);
    PipelineState st;
    int iter = 0;
    for (int hq = 0; hq < p.heads_per_kv; ++hq) {
      for (int m_block = m_first; m_block < m_end; ++m_block, ++iter) {
        pipe.consumer_wait(st);
        zero_q_rows_past(mask, m_block, st, tid);
        Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kTileM>, Int<kTileN>>{});
        Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kTileM>, Int<kTileN>>{});
        wgmma_issue<true>(mma_sdp, tSrQ(_, _, _, st.index()), tSrK, tSrS);
        wgmma_issue<true>(mma_sdp, tSrdO(_, _, _, st.index()), tSrV, tSrdP);
        Tensor S = make_tensor(tSrS.data(), acc_as_rowcol(tSrS.layout()));
        Tensor dP = make_tensor(tSrdP.data(), acc_as_rowcol(tSrdP.layout()));
        auto [lse_of, d_of] = smem_row_stats(st.index(), [&](int r) { return get<0>(coordS(r, 0)); });
        scores_to_grads<4>(S, dP, lse_of, d_of, [&] {
          if (mask.needs_mask(m_block, n_block)) mask.apply(S, coordS, m_block * kTileM, n_block * kTileN);
        });
        const int buf = iter & 1;
        Tensor rP = convert_fragment<Element>(tSrS);
        Tensor rdS = convert_fragment<Element>(tSrdP);
        copy(r2s, thr_r2s.retile_S(rP), tPsP(_, _, _, buf));
        copy(r2s, thr_r2s.retile_S(rdS), tdSsdS(_, _, _, buf));
        cutlass::arch::fence_view_async_shared();
        barrier_sync<BarrierId::kBwdDsReady>(Traits::kConsumerThreads);
        wgmma_issue<false>(mma_dkv, tdVrdOt(_, _, _, st.index()), tdVrPt(_, _, _, buf), tdVrdVt);
        wgmma_issue<false>(mma_dkv, tdKrQt(_, _, _, st.index()), tdKrdSt(_, _, _, buf), tdKrdKt);
        Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Traits::DqTileShape{});
        wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, buf), tdQrKt, tdQrdQ);
        warpgroup_wait<0>();
        hand_dq(tdQrdQ, st, iter, tid);
        ++st;
      }
    }
    if (iter > 0) barrier_sync<BarrierId::kBwdDqEmpty>(kWriterThreads);  // as in mma()
  }
};

}  // namespace fa3gen
