// Compile-time description of one backward variant. A CTA owns one key block (TileN keys
// of one kv head) and walks the query blocks (TileM rows) of every query head of its group:
//   S^T  = K Q^T     (TileN x TileM)  SS  -> P^T = exp2(S^T * scale_log2 - LSE_log2)
//   dP^T = V dO^T    (TileN x TileM)  SS  -> dS^T = P^T (dP^T - D)
//   dV  += P^T dO    (TileN x d)      RS  (P^T straight from registers)
//   dK  += dS^T Q    (TileN x d)      RS
//   dQ   = dS K      (TileM x d)      SS  (dS goes through shared memory); dQ goes to shared
//                                         memory, and the writer warp adds it to an fp32
//                                         accumulator in global memory (bulk reduction)
// Computing the transposed products keeps P^T and dS^T in the accumulator layout that the RS
// GEMMs take as their A operand, so only dS makes a trip through shared memory.
// Head dims above 128 split head_dim instead (kSplitHeadDim): dK and dV of 64 keys x 256
// columns would need 256 fp32 registers per thread in one warpgroup. There TileN is 64, two
// consumer warpgroups compute S^T and dP^T for half of the queries each, P^T joins dS^T in
// shared memory, and each warpgroup accumulates its half of the columns of dK, dV and dQ with
// SS GEMMs (d256: 64 + 64 + 64 accumulator registers per thread).
// A TileN that is not whole 64-key warpgroups (d192: 64 x 96) computes the products with
// head_dim on the WGMMA M axis instead (kTransposedDkv), one consumer warpgroup per 64 rows of
// head_dim (three at d192):
//   S    = Q K^T     (TileM x TileN)  SS  the warpgroups split the keys (N)
//   dP   = dO V^T    (TileM x TileN)  SS
//   dV^T += dO^T P   (d x TileN)      SS  P and dS go through shared memory, keys contiguous
//   dK^T += Q^T dS   (d x TileN)      SS
//   dQ   = dS K      (TileM x d)      SS  the warpgroups split head_dim (N)
// Each warpgroup's dK^T / dV^T rows are its own 64 columns of Q and dO, so dQ can be handed
// over in them (kDqInStages), and 96 keys per CTA read each query block 1.5x less often than
// 64 (d192: 48 + 48 accumulator registers for dK^T and dV^T, 160 per thread with three
// consumer warpgroups).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>
#include "fragments.cuh"   // staged_tile_bytes
#include "gmma_shapes.cuh"
#include "mask.cuh"
#include "smem_atoms.cuh"
#include "softmax.cuh"  // LogitSoftcap
#include "tile_scheduler.cuh"
#include "varlen.cuh"

namespace fa3gen {

template <class Element_, int HeadDim, int TileM, int TileN, int Stages, bool Causal, bool Local, bool Softcap,
          bool Varlen>
struct BwdTraits {
  using Element = Element_;
  static_assert(sizeof(Element) == 2, "bf16/fp16 only");
  static constexpr int kHeadDim = HeadDim, kTileM = TileM, kTileN = TileN, kStages = Stages;
  static constexpr bool kCausal = Causal, kLocal = Local, kSoftcap = Softcap, kVarlen = Varlen;
  using Mask = AttentionMask<Causal, Local, TileM, TileN>;

  // One consumer warpgroup per 64 keys, or two over 64 keys that split head_dim, or one per
  // 64 rows of head_dim (kTransposedDkv), plus the producer warpgroup (TMA loads).
  static constexpr bool kTransposedDkv = TileN % 64 != 0;
  static_assert(!kTransposedDkv || (TileM == 64 && HeadDim % 64 == 0 && HeadDim / 64 <= 3 &&
                                    TileN % (16 * (HeadDim / 64)) == 0),
                "dK^T / dV^T: TileM 64, head_dim whole 64-row warpgroups (at most 3), TileN split over them");
  static constexpr bool kSplitHeadDim = HeadDim > 128 && !kTransposedDkv;
  static_assert(!kSplitHeadDim || TileN == 64, "head_dim above 128: TileN 64 (two warpgroups split head_dim)");
  static constexpr int kConsumerWGs = kTransposedDkv ? HeadDim / 64 : kSplitHeadDim ? 2 : TileN / 64;
  // Columns of head_dim per dK / dV accumulator; the smem atoms of Q, dO, K and V are chosen
  // on that extent so that each warpgroup's columns start on a swizzle atom (d192 split: 96
  // columns, 64-byte swizzle).
  static constexpr int kDkvCols = HeadDim / (kTransposedDkv ? kConsumerWGs : kSplitHeadDim ? 2 : 1);
  static constexpr int kConsumerThreads = kConsumerWGs * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  // setmaxnreg split as in the forward (24/240 uses the 168 x 384 launch allocation exactly,
  // 24/160 the 128 x 512 one); the producer warpgroup's 24 also hold the dQ writer warp.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : 240;
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kLaunchRegs * kThreads,
                "setmaxnreg split exceeds the CTA's register allocation (the kernel would hang)");
  static_assert((TileN % 64 == 0 || kTransposedDkv) && kConsumerWGs >= 1 && kConsumerWGs <= 3);
  static_assert(TileM % 16 == 0 && TileM <= 128, "TileM is the N of S^T and the K of dV / dK");
  static_assert(HeadDim % 32 == 0 && HeadDim <= 256);
  static_assert(Stages >= 1 && Stages <= 4);
  // dQ = dS K when TileM is whole 64-row WGMMAs: the consumer warpgroups split the (TileM x d)
  // tile, first along M. Otherwise (e.g. TileM 80) dQ^T = K^T dS^T: each warpgroup owns 64 of
  // the head_dim rows and N = TileM.
  static constexpr bool kDqTransposed = TileM % 64 != 0;
  static_assert(!kDqTransposed || HeadDim == 64 * kConsumerWGs,
                "dQ^T: head_dim must be 64 rows per consumer warpgroup");
  static constexpr int kDqWgM = kDqTransposed ? kConsumerWGs : TileM / 64;
  static_assert(kConsumerWGs % kDqWgM == 0, "dQ tile: TileM / 64 must divide the consumer warpgroups");
  static constexpr int kDqWgN = kConsumerWGs / kDqWgM;
  using AtomRows = decltype(smem_atom<Element, kDkvCols, true>());
  static_assert(kDqWgN == 1 || (HeadDim / kDqWgN) % size<1>(AtomRows{}) == 0,
                "dQ tile: each warpgroup's share of head_dim must be whole swizzle atoms");
  // N of S^T / dP^T per warpgroup (queries), or of S / dP (keys) when kTransposedDkv.
  static constexpr int kSdPN = kTransposedDkv ? TileN / kConsumerWGs : kSplitHeadDim ? TileM / 2 : TileM;
  static_assert(gmma_n_available(kSdPN) && gmma_n_available(kTransposedDkv ? TileN : kDkvCols) &&
                    gmma_n_available(kDqTransposed ? TileM : HeadDim / kDqWgN),
                "WGMMA N outside CuTe's standard shapes: define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED");

  // Q and dO: (TileM, d) per stage, d contiguous. Read K-major as the B operand of S^T / dP^T,
  // and as (d, TileM) MN-major (the same bytes, transposed view) as the B operand of dK / dV.
  using SmemLayoutQ = decltype(tile_to_shape(AtomRows{},
                                             Shape<Int<TileM>, Int<HeadDim>, Int<Stages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<HeadDim>, Int<TileM>, Int<Stages>>{},
                                 Stride<Int<TileM>, _1, Int<TileM * HeadDim>>{})));
  // K and V: (TileN, d), loaded once. K is also read as (d, TileN) MN-major by dQ = dS K.
  using SmemLayoutK = decltype(tile_to_shape(AtomRows{},
                                             Shape<Int<TileN>, Int<HeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<HeadDim>, Int<TileN>>{}, Stride<Int<TileN>, _1>{})));
  // dS: (TileM, TileN) with TileM contiguous (MN-major A operand of dQ = dS K, or B operand
  // of dQ^T = K^T dS^T; its transposed view is the K-major A operand of dK = dS^T Q when
  // kSplitHeadDim, and P^T's buffer has the same layout); two buffers so that one
  // iteration's writes never race the previous iteration's GEMMs. kTransposedDkv: TileN
  // contiguous instead (K-major A operand of dQ = dS K, and the transposed view is the MN-major
  // B operand of dK^T = Q^T dS; P likewise for dV^T).
  using SmemLayoutdS = decltype(tile_to_shape(
      cute::conditional_t<kTransposedDkv, decltype(smem_atom<Element, TileN, true>()),
                          decltype(smem_atom<Element, TileM, false>())>{},
      Shape<Int<TileM>, Int<TileN>, _2>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<TileN>, Int<TileM>, _2>{},
                                  Stride<Int<TileM>, _1, Int<TileM * TileN>>{})));

  // The consumer warpgroups over the M (keys) of S^T, dP^T, dV and dK, or (kSplitHeadDim) over
  // their N: the queries of S^T and dP^T, the head_dim columns of dV and dK. kTransposedDkv:
  // over the N (keys) of S and dP and the M (head_dim rows) of dK^T and dV^T.
  using ConsumerWgLayout =
      cute::conditional_t<kSplitHeadDim, Layout<Shape<_1, _2, _1>>, Layout<Shape<Int<kConsumerWGs>, _1, _1>>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kSdPN>, Int<HeadDim>>>(),
      cute::conditional_t<kTransposedDkv, Layout<Shape<_1, Int<kConsumerWGs>, _1>>, ConsumerWgLayout>{}));
  // dV += P^T dO and dK += dS^T Q: A from the S^T accumulators (RS), or from shared memory
  // with the warpgroups splitting head_dim (SS). kTransposedDkv: dV^T += dO^T P and
  // dK^T += Q^T dS, both operands MN-major views of shared memory.
  using TiledMmadKV = decltype(make_tiled_mma(
      cute::conditional_t<
          kTransposedDkv,
          decltype(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<TileN>, Int<TileM>>,
                                        GMMA::Major::MN, GMMA::Major::MN>()),
          cute::conditional_t<
              kSplitHeadDim,
              decltype(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kDkvCols>, Int<TileM>>,
                                            GMMA::Major::K, GMMA::Major::MN>()),
              decltype(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<HeadDim>, Int<TileM>>,
                                            GMMA::Major::K, GMMA::Major::MN>())>>{},
      ConsumerWgLayout{}));
  // dK / dV accumulator tile: (TileN, d), or (d, TileN) when kTransposedDkv.
  using DkvTileShape = cute::conditional_t<kTransposedDkv, Shape<Int<HeadDim>, Int<TileN>>,
                                           Shape<Int<TileN>, Int<HeadDim>>>;
  // Both operands of dQ (dS, K^T) and of dQ^T (K^T, dS^T as (TileM, TileN)) are MN-major views
  // (kTransposedDkv: dS is K-major).
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<_64, Int<kDqTransposed ? TileM : HeadDim / kDqWgN>, Int<TileN>>,
                           kTransposedDkv ? GMMA::Major::K : GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<Int<kDqWgM>, Int<kDqWgN>, _1>>{}));
  // The dQ accumulator tile: (TileM, d), or (d, TileM) when transposed.
  using DqTileShape = cute::conditional_t<kDqTransposed, Shape<Int<HeadDim>, Int<TileM>>,
                                          Shape<Int<TileM>, Int<HeadDim>>>;

  using GmemLayoutRows = Layout<Shape<int, Int<HeadDim>, int, int>, Stride<int64_t, _1, int64_t, int64_t>>;
  using GmemTensorRows = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayoutRows{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorRows{}, take<0, 2>(SmemLayoutQ{})));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorRows{}, SmemLayoutK{}));

  static constexpr uint32_t kBytesQ = TileM * HeadDim * sizeof(Element);
  static constexpr uint32_t kBytesK = TileN * HeadDim * sizeof(Element);
  static constexpr uint32_t kBytesRowStats = TileM * sizeof(float);
  static constexpr uint32_t kBytesdQ = TileM * HeadDim * sizeof(float);
  static constexpr int kDqChunks = TileM * HeadDim / (2 * kConsumerThreads);  // float2 per consumer thread

  using Pipeline = cutlass::PipelineTmaAsync<Stages>;
  using PipelineState = typename cutlass::PipelineState<Stages>;

  static constexpr bool kPInSmem = kSplitHeadDim || kTransposedDkv;
  // FA4's sm90 step order: dV, the dS hand-over, dQ, then dK; each consumer warpgroup waits for
  // its dQ only and hands its own contiguous half to the writer warp on barriers of its own (160
  // threads) while dK runs, and frees the stage after dK; half of P's exponentials come before
  // the dP wait (bwd_mainloop.cuh). Two consumer warpgroups, dQ = dS K in a buffer of its own.
  // d128 64x128: 1.00-1.035x (docs/BENCHMARKS.md "2026-12-04 (third)"); d64 128x128 gained at
  // most 1.5% and spilled 4 bytes with it, so it keeps the old order; with the shuffled row
  // stats (kRowsByShfl) it fits and loses 0-2.6% (FA3GEN_BWD_D64_DQ_PER_WG, 2026-12-04 fifth),
  // and ties again under a profile: the wait moves to the dQ hand-over (2026-12-04 seventh).
  // (80x128, dQ^T = K^T dS^T, FA4's own d128 non-causal tile, with each warpgroup's 64 head_dim
  // rows of dQ^T its half: 1.00-1.03x at 80x128, still below 64x128 in the old order; removed.)
  static constexpr bool kDqPerWg = !kPInSmem && !kDqTransposed && kConsumerWGs == 2 && HeadDim >= 128;
  // LSE and D read once a warp and spread by shuffles (bwd_mainloop.cuh ShuffledRowStats), as
  // FA4 does: d64 128x128 1.00-1.03x (fewer shared-memory reads beside the GEMMs); at d128
  // 64x128 (FA4's step order) 0.94-0.99x, so there the reads stay (docs/BENCHMARKS.md
  // "2026-12-04 (fourth)"). The column layout it assumes is checked by tests/gpu/bwd_row_layout.cu.
  // Values stored by the preprocess in the readers' order (LDS.128, no shuffles: 8% fewer
  // d64 instructions) tied at d64 and d128 ("2026-12-06 (twenty-ninth)").
  static constexpr bool kRowsByShfl = !kSplitHeadDim && HeadDim == 64;
  // dV and dK issued in two parts along their K (the queries), the first as soon as its P
  // and dS are converted, so that the tensor pipe runs it while the second part's
  // exponentials are taken (bwd_mainloop.cuh, scores_to_grads in parts), where the step had
  // the pipe idle from the dP wait to the dV issue. d64 128x128: 1.004-1.034x over two A/B runs (16
  // points; four parts 0.994-1.034x); at d128 64x128 (dV alone, before dQ in FA4's order) two
  // parts tie and four lose 1-3%, so it stays off there (docs/BENCHMARKS.md, "2026-12-06
  // (twenty-seventh)"). Not with softcap, whose pass order differs (scores_to_grads). On top
  // of it, dQ issued in the next step, the last part issued after dQ, and d128 in the old order
  // with parts lost or tied; the next step's S before the end-of-step wait serializes every
  // GEMM (ptxas C7514) ("2026-12-06 (twenty-eighth)"); two steps a loop iteration, the
  // second's S issued by the first, lost 1.6% ("2026-12-06 (twenty-ninth)").
  static constexpr bool kSplitDkv = kRowsByShfl && !kSoftcap && !kPInSmem && !kDqTransposed && !kDqPerWg;
  static constexpr int kSplitDkvParts = 2;
  template <bool DqTile>
  struct SharedStorageT {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>> ds;
    alignas(1024) cute::array_aligned<Element, kPInSmem ? cosize_v<SmemLayoutdS> : 8> p;  // P^T (P when kTransposedDkv)
    alignas(128) cute::array_aligned<float, DqTile ? TileM * HeadDim : 4> dq;  // one query block's dQ, dq_slot order
    alignas(16) float lse_log2[Stages][TileM];  // LSE * log2(e) of the stage's query rows
    alignas(16) float dsum[Stages][TileM];      // D = rowsum(dO * O)
    typename Pipeline::SharedStorage pipeline_q;  // Q, dO, LSE and D of one query block
    alignas(8) uint64_t barrier_kv;               // K and V landed
    // Last, in the tail padding: the other members keep their offsets where it is unused.
    alignas(8) uint64_t barrier_do[Stages];       // kSplitQdo: the stage's dO and D landed
  };
  // When the dQ tile does not fit beside the stages (d256: 290 KB with two; d192 64x96: 264
  // KB), kSplitHeadDim and kTransposedDkv hand dQ over in the Q and dO buffers of its own
  // stage (dq_slot): each holds half of the fp32 tile, warpgroup w's columns of Q are the w-th
  // part of the buffer, and the stage is free once the dQ writer has read them too. Where the
  // tile fits (d192 64x64) it is kept: the stage is then freed a bulk read earlier, and the
  // next block's load starts sooner.
  static constexpr bool kDqInStages = kPInSmem && sizeof(SharedStorageT<true>) > kSmemPerBlockLimit;
  using SharedStorage = SharedStorageT<!kDqInStages>;
  static constexpr bool own_columns_contiguous() {
    for (int w = 0; w < kConsumerWGs; ++w) {
      if (SmemLayoutQ{}(0, w * kDkvCols, 0) != w * TileM * kDkvCols ||
          SmemLayoutQ{}(TileM - 1, (w + 1) * kDkvCols - 1, 0) >= (w + 1) * TileM * kDkvCols) {
        return false;
      }
    }
    return true;
  }
  static_assert(!kDqInStages || (2 * kBytesQ == kBytesdQ && kDkvCols * kConsumerWGs == HeadDim &&
                                 own_columns_contiguous()),
                "dQ hand-off in the stage buffers: each warpgroup's columns must be one contiguous part");
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  // The epilogue stages dK and dV row-major from the start of the Q buffer over Q, dO, K and V
  // and writes 16-byte rows; the dQ^T (TileM 80) consumers spill 8 bytes with it and store
  // their fragments directly.
  static constexpr bool kStagedEpilogue = !kDqTransposed;
  // The consumers leave the loop without waiting for the dQ writer to have read the last
  // block's dQ (the writer skips that "empty" arrival), as FA4 does, so the epilogue does not
  // wait for the last bulk reduction's read of up to 32 KB; its staging lies over Q, dO, K and
  // V, not the dQ buffer. Not with kDqInStages, where dQ is handed over in the Q and dO
  // buffers the staging overwrites. (Short rows +1-2.6%, docs/BENCHMARKS.md 2026-12-04 (sixth).)
  static constexpr bool kNoLastDqWait = !kDqInStages;
  // Both consumer warpgroups past their last GEMM before the epilogue stages over Q, dO, K
  // and V: with kNoLastDqWait a warpgroup leaves the loop without the other (with kDqPerWg, a
  // subset, on its own writer barrier) while the other's last dK GEMM may still read Q. With
  // kDqInStages the last dQ-empty sync, which both warpgroups and the writer meet, orders it.
#ifdef FA3GEN_BWD_NO_EPILOGUE_SYNC  // debug builds only: shows the race (FA3GEN_BWD_DEBUG_LATE_DK)
  static constexpr bool kEpilogueSync = false;
#else
  static constexpr bool kEpilogueSync = kNoLastDqWait;
#endif
  // A stage's Q and LSE land on the pipeline's barrier and its dO and D on one of their own
  // (barrier_do), so that S is issued once Q is in, before dO (FA4's separate Q and dO
  // barriers: the first GEMM waits for about 33 KB at d64 instead of 65). Dense with P in
  // registers only (d64, d96, d128: mma()'s register path; varlen zeroes both before the GEMMs).
  static constexpr bool kSplitQdo = !kPInSmem && !kVarlen;
  static_assert(2 * staged_tile_bytes<TileN, HeadDim, Element>() <=
                    2 * sizeof(Element) * (cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutK>),
                "dK/dV staging does not fit in the Q, dO, K and V buffers");
  static_assert(kSmemBytes <= kSmemPerBlockLimit, "tile does not fit in the 227 KiB of shared memory");
};

template <class Traits>
struct BwdParams {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaK tma_k;
  typename Traits::TmaK tma_v;
  const float* lse_log2;  // (batch, heads_q, seqlen_q_rounded)
  const float* dsum;      // same layout
  float* dq_accum;        // (batch, heads_q, m_blocks) tiles of TileM x d floats (dq_slot order), zeroed
  int* dq_semaphore;      // (batch, heads_q, m_blocks), zeroed; deterministic mode only
  typename Traits::Element* dk;
  typename Traits::Element* dv;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int seqlen_q, seqlen_k, seqlen_q_rounded, heads_q, heads_kv, batch, heads_per_kv;
  int window_left, window_right;  // local variants (AttentionMask)
  LogitSoftcap softcap;           // softcap variants
  // dK and dQ are scaled by softmax_scale at the end; P = exp2(S * scale_log2 - LSE_log2),
  // where softcapping (S = tanh(S * softmax_scale / cap)) makes scale_log2 cap * log2(e).
  float softmax_scale, scale_log2;
  bool deterministic;
  bool vector_stores;     // dk and dv rows are 16-byte aligned: staged epilogue
  TileSchedule schedule;  // one CTA per (key block, kv head, batch): the dense grid's
                          // dimensions, or the varlen tile list's entries
  VarlenArgs varlen;      // varlen variants (varlen.cuh): batch is 1 in the TMA tensors, and
  int q_tiles_padded;     // the stats and dq_accum are (heads_q, q_tiles_padded * TileM) rows
};

// First query tile of (batch b, query head) in the stats (times TileM: the row) and in
// dq_accum: dense (batch, heads_q, m_blocks); varlen (heads_q, q_tiles_padded) with sequence b
// from tile (offset_q + b * TileM) / TileM (fa3gen_abi.h), so sequences never share a tile.
template <class Traits>
__device__ __forceinline__ int64_t q_tile_base(BwdParams<Traits> const& p, int b, int head, SeqSlice const& seq) {
  if constexpr (Traits::kVarlen) {
    return int64_t(head) * p.q_tiles_padded + (seq.offset_q + int64_t(b) * Traits::kTileM) / Traits::kTileM;
  } else {
    return (int64_t(b) * p.heads_q + head) * (p.seqlen_q_rounded / Traits::kTileM);
  }
}

}  // namespace fa3gen
