// The forward epilogue: O / rowsum and the LSE of one query tile, straight from registers to
// global memory, without shared memory (the forward's shared memory is all Q, K and V); in
// o_tma_store variants, O through a shared-memory tile of its own and TMA stores.
#pragma once
#include "barriers.cuh"
#include "fragments.cuh"
#include "fwd_traits.cuh"
#include "tma_pipeline.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace fa3gen {

// In the accumulator the 4 threads of a quad hold one row: thread q has columns 8j + 2q and
// 8j + 2q + 1 of every 8-column block j (one 4-byte pair each). A 4x4 transpose across the quad
// (two butterfly stages, 4 shuffles per 4 blocks) leaves thread q with all 8 columns of block
// 4g + q, so each store writes 16 bytes and one warp store covers 64 contiguous bytes of each
// of 8 rows (the 4-byte stores of store_tile_rows cover 16). Writes rows [0, row_end) of a
// (TileRows x Cols) tile; tile and row_stride must be 16-byte aligned.
template <int TileRows, int Cols, class ThrMma, class Frag, class Element>
__device__ __forceinline__ void store_tile_rows_16b(ThrMma const& thr, Frag const& frag, Element* tile,
                                                    int64_t row_stride, int row_end) {
  static_assert(sizeof(Element) == 2 && Cols % 32 == 0, "4 blocks of 8 16-bit columns per transpose");
  Tensor tc = thr.partition_C(make_identity_tensor(Shape<Int<TileRows>, Int<Cols>>{}));
  Tensor r_rc = make_tensor(frag.data(), acc_as_rowcol(frag.layout()));
  Tensor c_rc = make_tensor(tc.data(), acc_as_rowcol(tc.layout()));
  constexpr int kPairs = decltype(size<1>(r_rc))::value / 2;  // column pairs per row and thread
  static_assert(kPairs % 4 == 0);
  const int q = threadIdx.x % 4;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < size<0>(r_rc); ++r) {
    const int row = get<0>(c_rc(r, 0));
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kPairs / 4; ++g) {
      uint32_t a[4];  // a[s]: the pair of block 4g + s
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < 4; ++s) {
        Element pair[2] = {r_rc(r, 2 * (4 * g + s)), r_rc(r, 2 * (4 * g + s) + 1)};
        a[s] = *reinterpret_cast<uint32_t const*>(pair);
      }
      // Stage m (1, then 2): swap with thread q ^ m the slots whose bit m differs from q's.
      CUTLASS_PRAGMA_UNROLL
      for (int m = 1; m <= 2; m *= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int s = 0; s < 4; ++s) {
          if (s & m) continue;
          const uint32_t send = (q & m) ? a[s] : a[s + m];
          const uint32_t recv = __shfl_xor_sync(0xffffffff, send, m);
          if (q & m) a[s] = recv; else a[s + m] = recv;
        }
      }
      // a[s] now holds columns 2s, 2s + 1 of block 4g + q.
      const int col = get<1>(c_rc(r, 8 * g)) - 2 * q + 8 * q;
      if (row < row_end) {
        *reinterpret_cast<uint4*>(tile + row * row_stride + col) = make_uint4(a[0], a[1], a[2], a[3]);
      }
    }
  }
}

// o_tma_store: thread 0 of each consumer warpgroup issues its rows' TMA store and waits for it.
__device__ __forceinline__ bool o_store_issuer(int tid) { return tid % 128 == 0; }

// O = O / rowsum in the output dtype and LSE (natural log, fp32) for the rows of the tile that
// exist; tid is the thread's index among the consumers; smem holds O's tile with o_tma_store.
// fp8: lse_scale and o_scale carry the descale factors.
template <class Traits, int Rows, int Chains, int PLog2, bool Vote, class TO>
__device__ __forceinline__ void store_fwd_tile(FwdParams<Traits> const& p, typename Traits::SharedStorage& smem,
                                               TileCoord const& tile, SeqSlice const& seq,
                                               OnlineSoftmax<Rows, Chains, PLog2, Vote>& softmax, TO& tOrO, int tid,
                                               float lse_scale, float o_scale = 1.f) {
  constexpr int kTileM = Traits::kTileM, kHeadDim = Traits::kHeadDim;
  // Clustered tiles larger than 128 x 128 (keys x head dim: d128 128x176, d192 128x112, d256
  // 128x80), whose consumers run at 232 registers: ptxas hoists this thread's row and column
  // offsets out of the tile loop and then spills them. An opaque tid makes it recompute them
  // here, a few instructions a tile. An empirical line (ptxas, 2026-12-05): at 128 x 128 and
  // below nothing spills without it, and with it d256 128x64 pingpong spilled two counters.
  if constexpr (Traits::kClusterM > 1 && Traits::kTileN * kHeadDim > 128 * 128) {
    asm volatile("" : "+r"(tid));
  }
  typename Traits::TiledMmaPV mma_pv;
  auto thr_pv = mma_pv.get_thread_slice(tid);
  float inv_sum[Rows], lse[Rows];
  softmax.finalize(lse_scale, inv_sum, lse);
  if constexpr (Traits::kFp8) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < Rows; ++r) inv_sum[r] *= o_scale;
  }
  Tensor O = make_tensor(tOrO.data(), acc_as_rowcol(tOrO.layout()));
  scale_rows(O, inv_sum);
  // Varlen: O and LSE rows of the sequence in the packed tensors (LSE is (heads_q, total_q)).
  const int seqlen_q = Traits::kVarlen ? seq.seqlen_q : p.seqlen_q;
  const int64_t first_row = int64_t(Traits::kVarlen ? seq.offset_q : 0) + int64_t(tile.block) * kTileM;
  const int row_end = seqlen_q - tile.block * kTileM;
  // LSE before O: lse[] and inv_sum[] are then dead while O is converted and stored (the other
  // order spilled 16 bytes on d256 128x80, where O alone is 128 registers per thread).
  // The quad's first thread holds the row's statistics; a null lse: the caller wants none.
  if (tid % 4 == 0 && p.lse != nullptr) {
    typename Traits::TiledMmaQK mma_qk;
    Tensor c = mma_qk.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<Traits::kTileN>>{}));
    Tensor rows = make_tensor(c.data(), acc_as_rowcol(c.layout()));
    float* lse_row = Traits::kVarlen
                         ? p.lse + int64_t(tile.head) * p.varlen.total_q + first_row
                         : p.lse + (int64_t(tile.batch) * p.heads_q + tile.head) * p.seqlen_q + tile.block * kTileM;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < Rows; ++r) {
      int row = get<0>(rows(r, 0));
      if (row < row_end) { lse_row[row] = lse[r]; }
    }
  }
  if constexpr (Traits::kOTmaStore) {
    static_assert(!Traits::kFp8 && !Traits::kVarlen && Traits::kConsumerWGs <= 3,
                  "barrier ids 4 to 3 + consumer warpgroups are free (barriers.cuh)");
    if (p.o_tma.enabled) {
      const int wg = tid / 128;
      const bool issuer = o_store_issuer(tid);
      Tensor rO = convert_fragment<typename Traits::ElementOut>(tOrO);
      // The warpgroup's rows of the previous tile have left shared memory before new ones land.
      if (issuer) tma_store_wait<0>();
      barrier_sync_at<BarrierId::kFwdOStored0>(wg, 128);
      Tensor sO = make_tensor(make_smem_ptr(smem.o.data()), typename Traits::SmemLayoutQ{});
      auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, typename Traits::ElementOut>{}, mma_pv);
      auto thr_copy = smem_copy.get_thread_slice(tid);
      copy(smem_copy, thr_copy.retile_S(rO), thr_copy.partition_D(sO));
      cutlass::arch::fence_view_async_shared();  // the writes, visible to the TMA unit
      barrier_sync_at<BarrierId::kFwdOStored0>(wg, 128);
      if (issuer) {  // rows past seqlen_q fall outside the tensor: TMA drops them
        auto [tg, ts] = tma_tiles(p.o_tma.tma, make_shape(p.seqlen_q, Int<kHeadDim>{}, p.heads_q, p.batch), tile.head,
                                  tile.batch, Shape<_64, Int<kHeadDim>>{},
                                  make_coord(tile.block * Traits::kConsumerWGs + wg, _0{}),
                                  smem.o.data() + wg * Traits::kOPartOffset, typename Traits::SmemLayoutOPart{});
        copy(p.o_tma.tma, ts, tg);
        tma_store_arrive();
      }
      return;
    }
  }
  const int64_t o_offset = Traits::kVarlen
                              ? first_row * p.o_row_stride + tile.head * p.o_head_stride
                              : tile.batch * p.o_batch_stride + tile.head * p.o_head_stride +
                                    int64_t(tile.block) * kTileM * p.o_row_stride;
  auto store = [&](auto out_type) {
    using Out = decltype(out_type);
    Tensor rO = convert_fragment<Out>(tOrO);
    Out* o_tile = static_cast<Out*>(p.o) + o_offset;
    if (p.o_vector_stores) store_tile_rows_16b<kTileM, kHeadDim>(thr_pv, rO, o_tile, p.o_row_stride, row_end);
    else store_tile_rows<kTileM, kHeadDim>(thr_pv, rO, o_tile, p.o_row_stride, row_end);
  };
  if constexpr (Traits::kFp8) {
    if (p.o_fp16) store(cutlass::half_t{});
    else store(cutlass::bfloat16_t{});
  } else {
    store(typename Traits::ElementOut{});
  }
}

// o_tma_store: O's last TMA stores have read shared memory before the CTA exits.
template <class Traits>
__device__ __forceinline__ void drain_o_stores(FwdParams<Traits> const& p, int tid) {
  if constexpr (Traits::kOTmaStore) {
    if (p.o_tma.enabled && o_store_issuer(tid)) tma_store_wait<0>();
  }
}

}  // namespace fa3gen
