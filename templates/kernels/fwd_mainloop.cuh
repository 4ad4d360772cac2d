// The forward mainloop: TMA loads of Q, K and V (producer) and, per query tile, the GEMMs
// S = Q K^T and O += P V with the online softmax between them (consumers).
//   WarpSpecialized: warpgroup 0 only issues TMA (produce); the others compute (mma).
//                    Otherwise thread 0 of the first consumer issues the loads in between its
//                    math (the inline loader).
//   Pingpong:        named barriers make consumer warpgroups take turns issuing GEMMs, so one
//                    warpgroup's softmax runs while another's GEMMs occupy the tensor cores.
//                    With two consumer warpgroups each loads and releases its own rows of Q, so
//                    the next tile's Q arrives for the warpgroup that finishes first.
//   IntraWgOverlap:  S(j+1) = Q K(j+1)^T and O += P(j) V(j) are in flight together; the softmax
//                    of block j+1 runs while the PV GEMM of block j finishes.
//   Neither, two consumer warpgroups: they take turns around their exponentials instead
//                    (kStagger), each one's GEMMs running while the other's exponentials do.
// Block i of a tile's visiting order is key block blocks.at(i), from the last visible one down:
// the diagonal (masked) blocks come first.
// fp8 (e4m3 q, k, v): WGMMA reads 8-bit operands K-major only, so V^T cannot come straight
// from memory: TMA lands V (keys x head_dim) in a raw slot and the producer warpgroup
// transposes it into V^T (transpose_v), overlapped with the consumers' GEMMs. P goes from the
// fp32 accumulator into the e4m3 A operand inside each thread (p_to_fp8); the key order that
// leaves in P's registers is matched by the order the transpose writes V^T's columns in.
#pragma once
#include <cutlass/arch/barrier.h>
#include "barriers.cuh"
#include "fwd_traits.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "tma_pipeline.cuh"

namespace fa3gen {

// Consumer warpgroups take turns issuing GEMMs (round robin). Barrier kFwdTurn0 + w is the turn
// of warpgroup w: it syncs on it, and the previous warpgroup arrives on it. The order runs on
// across the tiles of a persistent CTA: the last warpgroup seeds the first turn once, every
// turn is handed on, and warpgroup 0 absorbs the final hand-over at exit, so arrivals and syncs
// balance whatever the number of turns.
template <class Traits>
struct GemmTurns {
  static constexpr int kThreads = 256;  // the waiting warpgroup + the one handing over
  int wg;                               // consumer warpgroup index
  template <bool Arrive>
  __device__ __forceinline__ static void barrier(int wg_turn) {
    if constexpr (Arrive) barrier_arrive_at<BarrierId::kFwdTurn0>(wg_turn, kThreads);
    else barrier_sync_at<BarrierId::kFwdTurn0>(wg_turn, kThreads);
  }
  __device__ __forceinline__ void seed() const {
    if constexpr (Traits::kPingpong) { if (wg == Traits::kConsumerWGs - 1) barrier<true>(0); }
  }
  __device__ __forceinline__ void wait_turn() const {
    if constexpr (Traits::kPingpong) barrier<false>(wg);
  }
  __device__ __forceinline__ void pass_turn() const {
    if constexpr (Traits::kPingpong) barrier<true>(wg + 1 == Traits::kConsumerWGs ? 0 : wg + 1);
  }
  __device__ __forceinline__ void drain() const {
    if constexpr (Traits::kPingpong) { if (wg == 0) barrier<false>(0); }
  }
};

template <class Traits>
struct FwdMainloop {
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineV = typename Traits::PipelineV;
  using PipelineState = typename Traits::PipelineState;
  static constexpr int kTileM = Traits::kTileM, kTileN = Traits::kTileN, kHeadDim = Traits::kHeadDim;
  static constexpr int kStages = Traits::kStages;
  // kClusterM > 1: every K and V load is multicast to all CTAs of the cluster.
  static constexpr uint16_t kClusterMask = Traits::kClusterM > 1 ? uint16_t((1u << Traits::kClusterM) - 1) : 0;
  __device__ __forceinline__ static int cluster_rank() {
    if constexpr (Traits::kClusterM > 1) return int(cute::block_rank_in_cluster());
    else return 0;
  }
  // A consumer warpgroup done with a K or V stage. In a cluster every CTA's producer writes
  // into every CTA's stage, so each warpgroup arrives once on each CTA's empty barrier (the
  // count PipelineTmaAsync initialises them with for a cluster): lane 0 of warp r for CTA r.
  // The pipeline's own release keeps that assignment in registers across the whole loop,
  // which made d128 128x176 spill inside its steady loop; recomputed here it costs none.
  template <class Pipe, class Storage>
  __device__ __forceinline__ static void release(Pipe& pipe, Storage& storage, PipelineState const& s) {
    if constexpr (Traits::kClusterM == 1) {
      pipe.consumer_release(s);
    } else {
      const int warp = (int(threadIdx.x) / 32) % 4;
      storage.empty_barrier_[s.index()].arrive(uint32_t(warp), threadIdx.x % 32 == 0 && warp < Traits::kClusterM);
    }
  }
  // Without pingpong or the intra-warpgroup overlap: the two consumer warpgroups are held half a
  // block apart by one barrier a block, which warpgroup 0 meets between its row maxima and its
  // exponentials and warpgroup 1 after its exponentials (softmax_block). So their exp2 phases,
  // each as long as its S and P V GEMMs, take turns on the MUFU units, the other's GEMMs
  // running meanwhile: cuDNN's schedule (its fp8 kernel's SASS; the template of its 16-bit
  // persistent forward). Measured against the same tile without it: fp8 128x256 +7-11%, 16-bit
  // d64 causal 128x128 +3-8% (docs/BENCHMARKS.md).
  static constexpr bool kStagger = Traits::kConsumerWGs == 2 && !Traits::kPingpong && !Traits::kOverlap;
  // Rows of the S and O accumulators per consumer thread (OnlineSoftmax's size).
  using AccS = decltype(partition_fragment_C(typename Traits::TiledMmaQK{}, Shape<Int<kTileM>, Int<kTileN>>{}));
  static constexpr int kRows = decltype(size<0>(acc_as_rowcol(typename AccS::layout_type{})))::value;
  // fp8: P in [0, 1] is stored times 256 in e4m3 (whose normal range starts at 2^-6), so small
  // probabilities keep their precision; the softmax's exponent carries the factor (its row sum
  // too, so the output needs no correction).
  static constexpr int kPLog2Fp8 = 8;
  static constexpr float kPScaleFp8 = float(1 << kPLog2Fp8);
  using Softmax = OnlineSoftmax<kRows, Traits::kSoftmaxChains, Traits::kFp8 ? kPLog2Fp8 : 0, Traits::kSoftmaxVote>;
  // P reaches 2^kRescaleThresholdFp8P before a rescale (rescale_threshold.cuh).
  static_assert(kPScaleFp8 * exp2_constexpr(kRescaleThresholdFp8P) <= kE4m3Max,
                "e4m3 P would overflow before its rescale");

  FwdParams<Traits> const& p;
  typename Traits::SharedStorage& smem;
  Pipeline pipe_k;
  PipelineV pipe_v;
  // Consumer side: the read position (shared by K and V, continues across tiles), the inline
  // loader's write positions, and how many tiles with work came before (the Q barriers' phase).
  PipelineState st;
  PipelineState st_load_k = cutlass::make_producer_start_state<Pipeline>(), st_load_v = st_load_k;
  int q_iter = 0;
  // fp8 with V block descales: O is accumulated in units of the last block's descale (negative
  // after a block whose descale is 0: softmax_block), which the epilogue multiplies back (1
  // otherwise).
  float o_units = 1.f;

  // The mask of a tile's sequence. Built where it is used: dense bounds then stay in the
  // kernel's parameter space instead of occupying registers across the loop (and `seq`, which
  // only varlen reads, compiles away).
  __device__ __forceinline__ typename Traits::Mask mask(SeqSlice const& seq) const {
    if constexpr (Traits::kVarlen) return {seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
    else return {p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
  }
  // The sequence of a tile (varlen); dense kernels never read it.
  __device__ __forceinline__ SeqSlice seq_of(TileCoord const& tile) const {
    if constexpr (Traits::kVarlen) return seq_slice(p.varlen, tile.batch);
    else return SeqSlice{};
  }

  // TMA partitions of row tiles of Q or K (tma_pipeline.cuh); Multicast > 1: this CTA's share.
  template <int Multicast = 1, class Tma, class TileShape, class Coord, class SmemLayout>
  __device__ __forceinline__ auto row_tiles(Tma const& tma, int seqlen, int total, int offset, int heads, int head,
                                            int b, TileShape tile, Coord coord, Element* s, SmemLayout layout) const {
    return fa3gen::row_tiles<Traits::kVarlen, kHeadDim, Multicast>(tma, seqlen, p.batch, total, offset, heads, head,
                                                                   b, tile, coord, s, layout,
                                                                   Multicast > 1 ? cluster_rank() : 0);
  }

  // Once, by one thread of warp 0, before the pipelines are built.
  __device__ __forceinline__ static void init(FwdParams<Traits> const& p, typename Traits::SharedStorage& smem) {
    prefetch_tma_descriptors(p.tma_q, p.tma_k, p.tma_v);
    if constexpr (Traits::kOTmaStore) { if (p.o_tma.enabled) prefetch_tma_descriptors(p.o_tma.tma); }
    for (int part = 0; part < Traits::kQParts; ++part) {
      TmaBarrier::init(&smem.barrier_q[part], 1);
      TmaBarrier::init(&smem.barrier_q_free[part], Traits::kConsumerThreads / Traits::kQParts);
    }
    if constexpr (Traits::kFp8) {
      for (int slot = 0; slot < Traits::kVRawSlots; ++slot) TmaBarrier::init(&smem.barrier_v_raw[slot], 1);
    }
  }

  __device__ __forceinline__ FwdMainloop(FwdParams<Traits> const& p_, typename Traits::SharedStorage& smem_, int warp_idx)
      : p(p_), smem(smem_),
        pipe_k(smem_.pipeline_k, params(warp_idx), typename Traits::ClusterShape{}),
        pipe_v(make_pipe_v(smem_, warp_idx)) {}

  __device__ __forceinline__ static PipelineV make_pipe_v(typename Traits::SharedStorage& smem, int warp_idx) {
    if constexpr (Traits::kFp8) {  // the producer warpgroup's 128 threads write V^T
      typename PipelineV::Params vp;
      vp.role = warp_idx < 4 ? PipelineV::ThreadCategory::Producer : PipelineV::ThreadCategory::Consumer;
      vp.producer_arv_count = 128;
      vp.consumer_arv_count = Traits::kConsumerThreads;
      return PipelineV(smem.pipeline_v, vp);
    } else {
      return PipelineV(smem.pipeline_v, params(warp_idx), typename Traits::ClusterShape{});
    }
  }

  __device__ __forceinline__ static typename Pipeline::Params params(int warp_idx) {
    return tma_pipeline_params<Pipeline>(Traits::kBytesKV, Traits::kWarpSpecialized, warp_idx,
                                         Traits::kConsumerThreads);
  }

  // ---------------- TMA loads (issued by one thread) ----------------
  __device__ __forceinline__ void load_q(TileCoord const& tile, SeqSlice const& seq, int part) {
    constexpr int kRowsPerPart = kTileM / Traits::kQParts;
    // kClusterM > 1: a head's extra tile (past the last query block, tile_scheduler.cuh) loads
    // the last block's rows; it stores nothing. (A box wholly out of bounds would do too: TMA
    // zero-fills it and credits its bytes, as for a K/V half past the last key.)
    const int block = Traits::kClusterM > 1 ? min(tile.block, (p.seqlen_q - 1) / kTileM) : tile.block;
    auto [tg, ts] = row_tiles(p.tma_q, p.seqlen_q, p.varlen.total_q, seq.offset_q, p.heads_q, tile.head, tile.batch,
                              Shape<Int<kRowsPerPart>, Int<kHeadDim>>{},
                              make_coord(block * Traits::kQParts + part, _0{}),
                              smem.q.data() + part * Traits::kQPartOffset, typename Traits::SmemLayoutQPart{});
    TmaBarrier::arrive_and_expect_tx(&smem.barrier_q[part], Traits::kBytesQ / Traits::kQParts);
    copy(p.tma_q.with(smem.barrier_q[part], 0), tg, ts);
  }
  // Paged: key block n_block of sequence b in chunks of kPageChunk keys, each from its page,
  // into the chunk's rows of `stage` (kTileN * kHeadDim elements from `base`). One division and
  // one table read per page the block touches. Chunks of the block past the sequence read
  // whatever their (clamped) pages hold, as varlen reads the next sequence: K's are masked,
  // V's zeroed before the PV GEMM (clear_v_past_end).
  template <bool IsV, class Tma>
  __device__ __forceinline__ void load_paged(Tma const& tma, uint64_t* barrier, Element* base, int stage,
                                             int n_block, int head_kv, int b) {
    constexpr int kChunk = Traits::kPageChunk;
    using ChunkLayout = cute::conditional_t<IsV, typename Traits::SmemLayoutVtChunk, typename Traits::SmemLayoutKChunk>;
    const PagedArgs& pa = p.paged;
    int col = n_block * kTileN / pa.page_size;
    int row = n_block * kTileN - col * pa.page_size;
    int page = pa.page(b, col);
    CUTE_UNROLL
    for (int c = 0; c < kTileN / kChunk; ++c) {
      Element* dst = base + stage * (kTileN * kHeadDim) + c * Traits::kChunkOffset;
      if constexpr (IsV) {
        auto [tg, ts] = tma_tiles(tma, make_shape(Int<kHeadDim>{}, pa.page_size, p.heads_kv, pa.num_pages), head_kv,
                                  page, Shape<Int<kHeadDim>, Int<kChunk>>{}, make_coord(_0{}, row / kChunk), dst,
                                  ChunkLayout{});
        copy(tma.with(*barrier, 0), tg, ts);
      } else {
        auto [tg, ts] = tma_tiles(tma, make_shape(pa.page_size, Int<kHeadDim>{}, p.heads_kv, pa.num_pages), head_kv,
                                  page, Shape<Int<kChunk>, Int<kHeadDim>>{}, make_coord(row / kChunk, _0{}), dst,
                                  ChunkLayout{});
        copy(tma.with(*barrier, 0), tg, ts);
      }
      row += kChunk;
      if (row == pa.page_size && c + 1 < kTileN / kChunk) {
        row = 0;
        page = pa.page(b, ++col);
      }
    }
  }
  __device__ __forceinline__ void load_k(int n_block, int head_kv, int b, SeqSlice const& seq, PipelineState& s) {
    if constexpr (Traits::kPaged) {
      pipe_k.producer_acquire(s);
      load_paged<false>(p.tma_k, pipe_k.producer_get_barrier(s), smem.k.data(), s.index(), n_block, head_kv, b);
    } else {  // kClusterM > 1: this CTA's share, multicast to the cluster
      auto [tg, ts] = row_tiles<Traits::kClusterM>(p.tma_k, p.seqlen_k, p.varlen.total_k, seq.offset_k, p.heads_kv,
                                                   head_kv, b, Shape<Int<kTileN>, Int<kHeadDim>>{},
                                                   make_coord(_, _0{}), smem.k.data(), typename Traits::SmemLayoutK{});
      pipe_k.producer_acquire(s);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(s), uint16_t(kClusterMask)), tg(_, n_block), ts(_, s.index()));
    }
    ++s;
  }
  // 16-bit only: fp8 is warp specialized (FwdTraits) and lands V through load_v_raw; the body is
  // not instantiated for it, V's TMA box not being V^T's layout there.
  __device__ __forceinline__ void load_v(int n_block, int head_kv, int b, SeqSlice const& seq, PipelineState& s) {
    if constexpr (Traits::kPaged) {
      pipe_v.producer_acquire(s);
      load_paged<true>(p.tma_v, pipe_v.producer_get_barrier(s), smem.v.data(), s.index(), n_block, head_kv, b);
      ++s;
    } else if constexpr (!Traits::kFp8) {
      auto tiles = [&]() {
        constexpr auto kTile = Shape<Int<kHeadDim>, Int<kTileN>>{};
        if constexpr (Traits::kVarlen) {
          return tma_tiles_at(p.tma_v, make_shape(Int<kHeadDim>{}, p.varlen.total_k, p.heads_kv, 1), head_kv,
                              make_coord(_0{}, seq.offset_k), kTile, make_coord(_0{}, _), smem.v.data(),
                              typename Traits::SmemLayoutVt{});
        } else {
          return tma_tiles<Traits::kClusterM>(p.tma_v, make_shape(Int<kHeadDim>{}, p.seqlen_k, p.heads_kv, p.batch),
                                              head_kv, b, kTile, make_coord(_0{}, _), smem.v.data(),
                                              typename Traits::SmemLayoutVt{}, cluster_rank());
        }
      };
      auto [tg, ts] = tiles();
      pipe_v.producer_acquire(s);
      copy(p.tma_v.with(*pipe_v.producer_get_barrier(s), uint16_t(kClusterMask)), tg(_, n_block), ts(_, s.index()));
      ++s;
    }
  }

  // The producer warpgroup's loader thread: every tile of this CTA. FA3's order: the tile's
  // first K before waiting for Q to be free, then each K one block ahead of V (the consumers
  // need K(i) together with V(i - 1)).
  template <class Scheduler>
  __device__ __forceinline__ void produce(Scheduler const& sched) {
    if constexpr (Traits::kFp8) {
      produce_fp8(sched);
      return;
    }
    PipelineState st_k = cutlass::make_producer_start_state<Pipeline>();
    PipelineState st_v = st_k;
    for_each_tile_loading_q(sched, true, st_k, [&](TileCoord const& tile, SeqSlice const& seq,
                                                   KeyBlocks const& blocks, int head_kv) {
      for (int i = 0; i < blocks.count; ++i) {
        if (i + 1 < blocks.count) load_k(blocks.at(i + 1), head_kv, tile.batch, seq, st_k);
        load_v(blocks.at(i), head_kv, tile.batch, seq, st_v);
      }
    });
    if constexpr (Traits::kClusterM > 1) {
      // The other CTA's consumers release this CTA's stages (its empty barriers): stay until
      // they all have, so that no arrival reaches an exited CTA.
      pipe_k.producer_tail(st_k);
      pipe_v.producer_tail(st_v);
    }
  }

  // The producer's walk over this CTA's tiles with work: the leader loads each tile's first K,
  // then its Q once the previous tile's readers are done with Q; body(tile, seq, blocks,
  // head_kv) loads the rest of the tile.
  template <class Scheduler, class Body>
  __device__ __forceinline__ void for_each_tile_loading_q(Scheduler const& sched, bool leader, PipelineState& st_k,
                                                         Body&& body) {
    int tiles_loaded = 0;  // tiles with work so far: the phase of the Q barriers
    for (int t = sched.first(); t < sched.count(); t = sched.next(t)) {
      TileCoord tile;
      if (!sched.decode(t, tile)) continue;
      const SeqSlice seq = seq_of(tile);
      const KeyBlocks blocks = mask(seq).key_blocks(tile.block);
      if (blocks.count == 0) continue;
      const int head_kv = tile.head / p.heads_per_kv;
      if (leader) {
        load_k(blocks.at(0), head_kv, tile.batch, seq, st_k);
        for (int part = 0; part < Traits::kQParts; ++part) {
          if (tiles_loaded > 0) TmaBarrier::wait(&smem.barrier_q_free[part], (tiles_loaded - 1) & 1);
          load_q(tile, seq, part);
        }
      }
      body(tile, seq, blocks, head_kv);
      ++tiles_loaded;
    }
  }

  // ---------------- fp8: V through the producer warpgroup ----------------
  __device__ __forceinline__ void load_v_raw(int n_block, int head_kv, int b, SeqSlice const& seq, int slot) {
    auto [tg, ts] = row_tiles(p.tma_v, p.seqlen_k, p.varlen.total_k, seq.offset_k, p.heads_kv, head_kv, b,
                              Shape<Int<kTileN>, Int<kHeadDim>>{}, make_coord(_, _0{}), smem.v_raw.data(),
                              typename Traits::SmemLayoutVRaw{});
    TmaBarrier::arrive_and_expect_tx(&smem.barrier_v_raw[slot], Traits::kBytesKV);
    copy(p.tma_v.with(smem.barrier_v_raw[slot], 0), tg(_, n_block), ts(_, slot));
  }

  // V (keys x head_dim, raw slot) -> V^T (head_dim x keys, K-major, pipeline stage), by the 128
  // producer threads. Warp w owns the 16-column strips w, w + 4, ... of head_dim and walks each
  // in steps of 32 keys: ldmatrix.x4.trans reads the step as four 8-key matrices (lane l gets
  // keys 2c, 2c + 1 of each at columns 2r, 2r + 1, r = l / 4, c = l % 4), four byte permutes
  // regroup them per column, and stmatrix.x4 writes V^T rows D + 2r and D + 2r + 1, 16 key
  // positions at a time. The key order that leaves in V^T: within each 32-key step, column
  // 16g + 4t + b holds key 16g + 8(b / 2) + 2t + b % 2, the key that p_to_fp8 puts in byte b of
  // thread t's register for half g.
  // Along a strip each step's addresses follow from the first step's, so a strip costs two
  // address registers whatever tile_n is (the producers run on 32-40 registers): 32 keys further
  // is 32 raw rows further (whole swizzle atoms: an add), and 32 bytes further along V^T's rows:
  // inside a swizzle row the chunk bits, zero in the first step's address, where the swizzle
  // (an XOR of address bits) passes them through, so an XOR; past the row, the next column of
  // atoms (an add).
  __device__ __forceinline__ void transpose_v(int slot, int stage) const {
    const uint32_t raw_base = cute::cast_smem_ptr_to_uint(smem.v_raw.data());
    const uint32_t vt_base = cute::cast_smem_ptr_to_uint(smem.v.data());
    constexpr auto raw = typename Traits::SmemLayoutVRaw{};  // byte offsets (1-byte elements)
    constexpr auto vt = typename Traits::SmemLayoutVt{};
    constexpr int kVtRow = smem_swizzle_bytes<Element, kTileN>();  // V^T's swizzle row, bytes
    constexpr int kRawStep = raw(32, 0, 0);                         // 32 keys of raw V
    constexpr int kVtAtomColumn = kHeadDim * kVtRow;                // the next kVtRow keys of V^T
    static_assert(kRawStep == 32 * smem_swizzle_bytes<Element, kHeadDim>());
    static_assert(kTileN <= kVtRow || vt(0, kVtRow, 0) == kVtAtomColumn);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int matrix = lane / 8, row = lane % 8;  // the matrix row whose address this lane gives
    constexpr int kStrips = kHeadDim / 16, kSteps = kTileN / 32;
#ifdef FA3GEN_FP8_SKIP_TRANSPOSE  // measurements only: V^T left as it was (wrong results)
    if (kSteps > 0) return;
#endif
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < (kStrips + 3) / 4; ++j) {
      const int d0 = 16 * (warp + 4 * j);
      if (kStrips % 4 != 0 && d0 >= kHeadDim) break;
      const uint32_t src = raw_base + uint32_t(raw(8 * matrix + row, d0, slot));
      const uint32_t dst = vt_base + uint32_t(vt(d0 + 2 * row + (matrix >> 1), 16 * (matrix & 1), stage));
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kSteps; ++s) {
        uint32_t r0, r1, r2, r3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(src + s * kRawStep));
        const uint32_t w0 = __byte_perm(r0, r1, 0x6420), w2 = __byte_perm(r0, r1, 0x7531);
        const uint32_t w1 = __byte_perm(r2, r3, 0x6420), w3 = __byte_perm(r2, r3, 0x7531);
        const uint32_t dst_s = (dst ^ uint32_t(32 * s % kVtRow)) + 32 * s / kVtRow * kVtAtomColumn;
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                     ::"r"(dst_s), "r"(w0), "r"(w1), "r"(w2), "r"(w3) : "memory");
      }
    }
  }

  // The producer warpgroup with fp8: thread 0 issues the loads as in produce(), one V ahead;
  // every thread transposes each V once it lands, then hands V^T to the consumers.
  template <class Scheduler>
  __device__ __forceinline__ void produce_fp8(Scheduler const& sched) {
    constexpr int kSlots = Traits::kVRawSlots;
    const bool leader = threadIdx.x == 0;
    PipelineState st_k = cutlass::make_producer_start_state<Pipeline>();
    PipelineState st_vt = cutlass::make_producer_start_state<PipelineV>();
    int v_issued = 0, v_done = 0;  // raw V loads issued / transposed: ring slot and phase
    for_each_tile_loading_q(sched, leader, st_k, [&](TileCoord const& tile, SeqSlice const& seq,
                                                     KeyBlocks const& blocks, int head_kv) {
      const int n_blocks = blocks.count;
      if (leader) {
        for (int j = 0; j < kSlots - 1 && j < n_blocks; ++j) {
          load_v_raw(blocks.at(j), head_kv, tile.batch, seq, v_issued++ % kSlots);
        }
      }
      for (int i = 0; i < n_blocks; ++i) {
        // V runs kSlots - 1 blocks ahead: the slot V(i + kSlots - 1) lands in held V(i - 1),
        // transposed before the last barrier below.
        if (leader) {
          if (i + 1 < n_blocks) load_k(blocks.at(i + 1), head_kv, tile.batch, seq, st_k);
          if (i + kSlots - 1 < n_blocks) {
            load_v_raw(blocks.at(i + kSlots - 1), head_kv, tile.batch, seq, v_issued++ % kSlots);
          }
        }
        TmaBarrier::wait(&smem.barrier_v_raw[v_done % kSlots], (v_done / kSlots) & 1);
        pipe_v.producer_acquire(st_vt);
        transpose_v(v_done % kSlots, st_vt.index());
        cutlass::arch::fence_view_async_shared();  // generic-proxy stores, read by WGMMA
        pipe_v.producer_commit(st_vt);
        ++st_vt;
        ++v_done;
        barrier_sync<BarrierId::kFwdVTransposed>(128);  // the raw slot may be reloaded
      }
    });
  }

  // ---------------- consumers: one query tile ----------------
  // fp8: P (fp32, accumulator layout: thread t of a quad holds columns 8j + 2t and 8j + 2t + 1
  // of rows r and r + 8; already times kPScaleFp8) into the e4m3 A operand of each 32-key step, whose
  // byte b of the register for (row half h, column half g) is operand column 16g + 4t + b.
  // Filled from accumulator column 8(4 step + 2g + b / 2) + 2t + b % 2 instead: the same
  // thread's values, no shuffle; transpose_v orders V^T's keys to match.
  template <class TS, class TP>
  __device__ __forceinline__ static void p_to_fp8(TS const& tSrS, TP& rP) {
    CUTLASS_PRAGMA_UNROLL
    for (int step = 0; step < kTileN / 32; ++step) {
      cutlass::Array<float, 16> f;
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < 2; ++g) {
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {
          CUTLASS_PRAGMA_UNROLL
          for (int b = 0; b < 4; ++b) {
            f[b + 4 * h + 8 * g] = tSrS(make_coord(b & 1, h, 4 * step + 2 * g + (b >> 1)), 0, 0);
          }
        }
      }
      cutlass::NumericArrayConverter<Element, float, 16, cutlass::FloatRoundStyle::round_to_nearest> convert;
      *reinterpret_cast<cutlass::Array<Element, 16>*>(&rP(0, 0, step)) = convert(f);
    }
  }

  // Leaves O (unnormalized) in tOrO and the row statistics in softmax; tid is the thread's
  // index among the consumers.
  template <class TO>
  __device__ __forceinline__ void mma(TileCoord const& tile, SeqSlice const& seq, KeyBlocks const& blocks,
                                      GemmTurns<Traits> const& turns,
                      Softmax& softmax, TO& tOrO, int tid) {
    const int n_blocks = blocks.count;
    const bool inline_loader = !Traits::kWarpSpecialized && threadIdx.x == 0;
    const int head_kv = tile.head / p.heads_per_kv;
    const int q_part = Traits::kQParts == 1 ? 0 : tid / 128;  // the Q rows this warpgroup reads

    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(tid);
    auto thr_pv = mma_pv.get_thread_slice(tid);
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    // Sliced per thread, not per warpgroup (warpgroup_slice): per warpgroup, Q's descriptors
    // cost the pingpong variants 1-2% and the others 0-7% (d192 and d96 most), though the
    // non-pingpong loops then run 6-17 instructions a step fewer (docs/BENCHMARKS.md,
    // 2026-12-04 (ninth)).
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) smem descriptors
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, Stages)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, Stages)
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kTileM>, Int<kTileN>>{});
    // P as the PV GEMM's A operand: 16-bit P shares the accumulator's layout (acc_as_operand_a
    // views it); fp8 P is a plain (16 bytes, 1, k-step) fragment filled by p_to_fp8.
    auto p_layout = [&]() {
      if constexpr (Traits::kFp8) return Layout<Shape<Shape<_4, _2, _2>, _1, Int<kTileN / 32>>>{};
      else return tSrS.layout();
    };
    Tensor rP = make_tensor<Element>(p_layout());
    // p_in_smem: P's tile in shared memory, the PV GEMM's A operand through descriptors, and
    // the stmatrix copy that writes a thread's accumulator-layout values into it.
    auto sP = [&]() {
      if constexpr (Traits::kPInSmem) return make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutP{});
      else return 0;
    }();
    auto p_operand = [&]() {
      if constexpr (Traits::kPInSmem) return thr_pv.partition_fragment_A(sP);
      else if constexpr (Traits::kFp8) return make_tensor(rP.data(), rP.layout());
      else return make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
    };
    auto tOrP = p_operand();
    auto r2s_p = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_qk);
    auto thr_r2s_p = r2s_p.get_thread_slice(tid);
    auto tPsP = [&]() {
      if constexpr (Traits::kPInSmem) return thr_r2s_p.partition_D(sP);
      else return 0;
    }();
    Tensor S = make_tensor(tSrS.data(), acc_as_rowcol(tSrS.layout()));
    Tensor O = make_tensor(tOrO.data(), acc_as_rowcol(tOrO.layout()));
    Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
    Tensor coordS = make_tensor(cS.data(), acc_as_rowcol(cS.layout()));

    if (!Traits::kWarpSpecialized && n_blocks > 0) {
      // Without a producer warpgroup, thread 0 loads Q once every consumer is done with the
      // previous tile's Q, then fills the ring; later it refills a slot as soon as it is free.
      if (q_iter > 0) barrier_sync<BarrierId::kFwdQFree>(Traits::kConsumerThreads);
      if (inline_loader) {
        for (int part = 0; part < Traits::kQParts; ++part) load_q(tile, seq, part);
        for (int i = 0; i < min(kStages, n_blocks); ++i) {
          load_k(blocks.at(i), head_kv, tile.batch, seq, st_load_k);
          load_v(blocks.at(i), head_kv, tile.batch, seq, st_load_v);
        }
      }
      __syncwarp();
    }
    auto refill_k = [&](int i) {
      if (inline_loader && i + kStages < n_blocks) load_k(blocks.at(i + kStages), head_kv, tile.batch, seq, st_load_k);
      __syncwarp();
    };
    auto refill_v = [&](int i) {
      if (inline_loader && i + kStages < n_blocks) load_v(blocks.at(i + kStages), head_kv, tile.batch, seq, st_load_v);
      __syncwarp();
    };
    // After the last S GEMM of the tile, Q may be overwritten by the next tile's load.
    auto release_q_if_last = [&](int i) {
      if (Traits::kWarpSpecialized && i == n_blocks - 1) TmaBarrier::arrive(&smem.barrier_q_free[q_part]);
    };
    // The two GEMMs, written once for both schedules: wait for the slot's data, then (where
    // the schedule says so) for this warpgroup's turn, then issue.
    auto issue_s = [&](PipelineState const& s, bool take_turn) {
      pipe_k.consumer_wait(s);
      if (take_turn) turns.wait_turn();
      wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, s.index()), tSrS);
    };
    auto issue_pv = [&](PipelineState const& s, bool take_turn) {
      pipe_v.consumer_wait(s);
      if (take_turn) turns.wait_turn();
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, s.index()), tOrO);
    };
    // varlen: TMA reads a key block past its sequence's end unbounded (the next sequence, padding
    // rows, a cache's rows past seqused_k), and those rows' P is 0, but 0 * NaN (or Inf) is NaN
    // in the P V GEMM: garbage there reached the output (FA3 and FA4 have this bug; FA2 fills
    // them with zeros). So the consumers zero that block's V rows in shared memory before the
    // GEMM reads them. Only the first block visited (KeyBlocks::at(0)) can cross the end, and
    // every consumer warpgroup gets here with no GEMM turn pending, so one barrier over all of
    // them cannot deadlock (a per-warpgroup barrier id held a register: d256 128x80 spilled).
    // Dense kernels need none of this: TMA fills rows past seqlen_k with zeros.
    auto clear_v_past_end = [&](PipelineState const& s, int n_block) {
      if constexpr (Traits::kVarlen && !Traits::kFp8) {
        const int valid = seq.seqlen_k - n_block * kTileN;  // this block's keys in the sequence
        if (valid < kTileN) {
          // One stage of sVt: (kTileN keys x kHeadDim), atoms stacked keys first.
          static_assert(cosize_v<typename Traits::SmemLayoutVt> == kHeadDim * kTileN * kStages);
          pipe_v.consumer_wait(s);
          zero_tile_rows<Element, kTileN, kHeadDim, smem_swizzle_bytes<Element, kHeadDim>(), Traits::kConsumerThreads>(
              smem.v.data() + s.index() * (kHeadDim * kTileN), valid, tid);
          cutlass::arch::fence_view_async_shared();  // generic-proxy stores, read by WGMMA
          barrier_sync<BarrierId::kFwdVTail>(Traits::kConsumerThreads);
        }
      }
    };
    float rescale[kRows];
    bool rescale_o = true;  // this thread's O rows need their factors (softmax.cuh: threshold)
    o_units = 1.f;
    // Warpgroup 0 starts its exponentials when warpgroup 1 has finished its own (kStagger).
    // bar.red.popc both times: ptxas moves arithmetic across a plain bar.sync (it put
    // exponentials on both sides), so warpgroup 0's exponentials take in the first one's
    // count less 256 (0), and warpgroup 1's barrier waits on its row sums (a predicate that
    // is always true).
    auto stagger_head = [&]() {
      return tid < 128 ? barrier_sync_popc<BarrierId::kFwdStagger>(256, true) - 256 : 0;
    };
    auto stagger_tail = [&]() {
      if (tid >= 128) {
        float sums = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) sums += softmax.row_sum[r];
        barrier_sync_popc<BarrierId::kFwdStagger>(256, sums != -1.f);
      }
    };
    // masked (std::true_type / false_type): whether block i may need the mask (then checked
    // per block); the peeled loop's unmasked run has no mask code.
    // pinned (std::true_type in the steady state's step; Traits::kPinPvWait): the wait for
    // P(i-1) V(i-1) inside the softmax, before the exponentials of the second half of the
    // thread's rows, in a warp-uniform branch on the rows' maxima that is always taken, so
    // that ptxas can neither lift it above them nor drop it; step()'s own wait then finds
    // nothing left to wait for.
    auto softmax_block = [&](int i, auto masked, auto pinned) {
      const int n_block = blocks.at(i);
      if constexpr (Traits::kSoftcap) p.softcap.apply(S);  // before the mask: -inf stays -inf
      if constexpr (decltype(masked)::value) {
        if (mask(seq).needs_mask(tile.block, n_block)) mask(seq).apply(S, coordS, tile.block * kTileM, n_block * kTileN);
      }
      if constexpr (Traits::kFp8) {
        // Block quantization of K: this block's factor on its scores, taken by the softmax
        // (per row, not per score).
        const float k_descale = p.descale.k_blocks() ? p.descale.k_(tile.batch, head_kv, n_block) : 1.f;
        if constexpr (kStagger) {
          rescale_o = softmax.step(S, rescale, k_descale, stagger_head);
          stagger_tail();
        } else {
          rescale_o = softmax.step(S, rescale, k_descale);
        }
      } else {
        if constexpr (kStagger) {
          rescale_o = softmax.template step_hooked<0>(S, rescale, stagger_head);
          stagger_tail();
        } else if constexpr (Traits::kPinPvWait && decltype(pinned)::value) {
          rescale_o = softmax.template step_hooked<kRows / 2>(S, rescale, [&]() {
            if (__any_sync(0xffffffffu, softmax.row_max[0] == softmax.row_max[0])) warpgroup_wait<0>();
            return 0;
          });
        } else {
          rescale_o = softmax.step(S, rescale);
        }
      }
      if constexpr (Traits::kFp8) {
        // Block quantization of V: O so far is in units of the previous block's factor; P V(j)
        // adds in units of this one, so O is rescaled by their ratio along with the softmax's
        // factor (O is still 0 at the first block). A factor of 0 (the attention of zeros,
        // whatever finite values the block holds) takes units -2^-64 times the previous
        // block's: what P V adds is then 2^-64 of the same products in those units, and O grows
        // by 2^64 at most. Negative units (descales are never negative) mark a run of such
        // blocks, which keeps them, so that O grows once; the sign cancels when the epilogue
        // multiplies O by its units. Limits: after a factor below 2^-62 the units flush to -0
        // (NaN); O overflows once the visible keys times the spread of the row's factors reach
        // about 2^46; a 0 first block adds 2^-64 of its values at units 1. What would lift them
        // cost on per-tensor calls (H100): a register for the last nonzero factor 0.5-1.4%,
        // units starting at FLT_MIN with -max(2^-40 x previous, FLT_MIN) about 2%.
        if (p.descale.v_blocks()) {
          const float v_descale = p.descale.v_(tile.batch, head_kv, n_block);
          const float units = v_descale != 0.f ? v_descale : o_units < 0.f ? o_units : o_units * -0x1p-64f;
          const float ratio = o_units / units;
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) rescale[r] *= ratio;
          o_units = units;
          rescale_o = true;
        }
      }
    };
    // Skipped when no row of the warp moved its maximum (warp-uniform: a predicated multiply
    // would still cost its issue slot).
    auto rescale_o_if_needed = [&]() {
      if (__any_sync(0xffffffffu, rescale_o)) scale_rows(O, rescale);
    };
    auto to_p = [&]() {
      if constexpr (Traits::kFp8) {
        p_to_fp8(tSrS, rP);
      } else if constexpr (Traits::kPInSmem) {
        // Called after the wait for the previous P V GEMM, which read this buffer. A warp writes
        // the rows of its own accumulator slice and then issues the GEMM, which no warp of the
        // warpgroup starts alone: a warp sync suffices, as in FA3 and FA4 (a warpgroup barrier
        // measured 0-2% slower, docs/results/ab_p_smem_warp_sync.json).
        Tensor converted = convert_fragment<Element>(tSrS);
        copy(r2s_p, thr_r2s_p.retile_S(converted), tPsP);
        cutlass::arch::fence_view_async_shared();  // generic-proxy stores, read by WGMMA
        __syncwarp();
      } else {
        Tensor converted = convert_fragment<Element>(tSrS);
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < size(rP); ++e) { rP(e) = converted(e); }
      }
    };

    clear(tOrO);
    if (n_blocks > 0) TmaBarrier::wait(&smem.barrier_q[q_part], q_iter & 1);

    if constexpr (!Traits::kOverlap) {
      for (int i = 0; i < n_blocks; ++i) {
        issue_s(st, true);
        turns.pass_turn();
        warpgroup_wait<0>();
        release(pipe_k, smem.pipeline_k, st);
        release_q_if_last(i);
        refill_k(i);
        softmax_block(i, std::true_type{}, std::false_type{});
        rescale_o_if_needed();
        to_p();
        if (i == 0) clear_v_past_end(st, blocks.at(0));
        issue_pv(st, true);
        turns.pass_turn();
        warpgroup_wait<0>();
        release(pipe_v, smem.pipeline_v, st);
        refill_v(i);
        ++st;
      }
    } else if (n_blocks > 0) {
      // Prologue: S(0) and its softmax alone. As in FA3, the first S GEMM and the last PV GEMM
      // of a tile take no turn: every warpgroup starts its tile as soon as its Q and K are in.
      issue_s(st, false);
      warpgroup_wait<0>();
      release(pipe_k, smem.pipeline_k, st);
      release_q_if_last(0);
      refill_k(0);
      softmax_block(0, std::true_type{}, std::false_type{});
      to_p();
      clear_v_past_end(st, blocks.at(0));
      PipelineState st_v = st;  // V slot of the block whose P is in rP
      ++st;
      // One step of the steady state: S(i) and P(i-1) V(i-1) in flight together. `masked`
      // says whether block i may need the mask (then checked per block). Forced inline: as a
      // plain lambda the unpeeled loop compiled differently (a 4-byte spill on d128 varlen
      // 128x176).
      auto step = [&](int i, auto masked) __attribute__((always_inline)) {
        issue_s(st, true);
        issue_pv(st_v, false);
        turns.pass_turn();
        // Groups retire in order: S(i) is done, P(i-1) V(i-1) may still run. In the 16-bit
        // variants ptxas moves the wait<0> below up to here (it has no inputs), so the softmax
        // does not overlap P(i-1) V(i-1); forcing it back measured slower (docs/BENCHMARKS.md,
        // "Where the consumer warps wait"; tests/gpu/sass_loops.py --events shows the order),
        // except in the window and d256 128x64 variants, which pin it halfway (Traits::kPinPvWait).
        warpgroup_wait<1>();
        release(pipe_k, smem.pipeline_k, st);
        release_q_if_last(i);
        refill_k(i);
        softmax_block(i, masked, std::true_type{});
        warpgroup_wait<0>();
        release(pipe_v, smem.pipeline_v, st_v);
        refill_v(i - 1);
        if constexpr (Traits::kPBeforeRescale) {
          to_p();  // independent of O: its conversions then join the exponentials (fwd_traits.cuh)
          rescale_o_if_needed();
        } else {
          rescale_o_if_needed();
          to_p();
        }
        st_v = st;
        ++st;
      };
      if constexpr (!Traits::kPeelMasked) {
        for (int i = 1; i < n_blocks; ++i) step(i, std::true_type{});
      } else if constexpr (Traits::Mask::kMasksFirstBlockOnly) {  // block 0 was the masked one
        for (int i = 1; i < n_blocks; ++i) step(i, std::false_type{});
      } else {
        // The masked and unmasked runs of the visiting order (mask.cuh, masked_runs). Their
        // bounds are broadcast from lane 0 so that ptxas sees them warp-uniform: otherwise it
        // put WARPSYNCs before the turn barriers and moved the Q descriptors with twice the
        // R2UR in every step.
        const auto runs = mask(seq).masked_runs(tile.block, blocks);
        const int front_end = __shfl_sync(0xffffffff, max(1, runs.front), 0);
        const int back_begin = __shfl_sync(0xffffffff, max(front_end, n_blocks - runs.back), 0);
        for (int i = 1; i < front_end; ++i) step(i, std::true_type{});
        for (int i = front_end; i < back_begin; ++i) step(i, std::false_type{});
        if constexpr (Traits::kLocal) {
          for (int i = back_begin; i < n_blocks; ++i) step(i, std::true_type{});
        }
      }
      issue_pv(st_v, false);
      warpgroup_wait<0>();
      release(pipe_v, smem.pipeline_v, st_v);
      refill_v(n_blocks - 1);
    }
    if (n_blocks > 0) ++q_iter;
  }
};

}  // namespace fa3gen
