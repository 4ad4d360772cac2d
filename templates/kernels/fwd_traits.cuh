// Compile-time description of one forward variant: thread roles, register split,
// shared-memory layouts, tiled MMAs and the TMA copy types. Every spec knob is a parameter.
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>
#include "gmma_shapes.cuh"
#include "mask.cuh"
#include "smem_atoms.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "varlen.cuh"

namespace fa3gen {
using namespace cute;

// V^T as the PV GEMM's B operand (head_dim x keys, per stage). 16-bit: MN-major, which is V's
// own layout (head_dim contiguous), so TMA loads it directly; its swizzle atoms (head_dim wide,
// 8 keys) are stacked keys first, so a tile arrives in one TMA box per 64 (or 32) columns, not
// one per 8 keys as well (44 boxes at d128 n176): 1.02-1.24x at d96-d256 (docs/BENCHMARKS.md,
// "V^T keys first"). fp8: WGMMA takes K-major 8-bit operands only, so V^T is stored
// keys-contiguous and written by the in-kernel transpose.
template <class Element, int HeadDim, int TileN, int Stages>
constexpr auto smem_layout_vt() {
  constexpr auto shape = Shape<Int<HeadDim>, Int<TileN>, Int<Stages>>{};
  if constexpr (sizeof(Element) == 1) return tile_to_shape(smem_atom<Element, TileN, true>(), shape);
  else return tile_to_shape(smem_atom<Element, HeadDim, false>(), shape, Step<_2, _1, _3>{});
}

// fp8 only: the TMA landing slots of V as stored (keys x head_dim), which the producer
// warpgroup transposes into V^T; the kernel's shared memory holds them in front of Q.
template <class Element, int Elems, int Slots, bool Present>
struct VRawStorage {
  alignas(1024) cute::array_aligned<Element, Elems> v_raw;
  alignas(8) uint64_t barrier_v_raw[Slots];  // slot landed (TMA transaction barrier)
};
template <class Element, int Elems, int Slots>
struct VRawStorage<Element, Elems, Slots, false> {};  // empty base: 16-bit kernels unchanged

// p_in_smem only: P's tile, written by the consumers and read by the PV GEMM.
template <class Element, int Elems, bool Present>
struct PStorage {
  alignas(1024) cute::array_aligned<Element, Elems> p;
};
template <class Element, int Elems>
struct PStorage<Element, Elems, false> {};

// o_tma_store variants only: O's tile, written by the consumers, read by their TMA stores.
template <class Element, int Elems, bool Present>
struct OStorage {
  alignas(1024) cute::array_aligned<Element, Elems> o;
};
template <class Element, int Elems>
struct OStorage<Element, Elems, false> {};

// fp8 descale factors (fa3gen_abi.h): per (batch, head) as FA3's q/k/v_descale, or per
// (batch, head, tile-aligned block) for block quantization; a null pointer reads 1.
struct Descales {
  float const* q;
  float const* k;
  float const* v;
  int64_t q_batch, q_head, q_block, k_batch, k_head, k_block, v_batch, v_head, v_block;  // strides in floats
  int q_head_div;  // query head -> q descale head
  __device__ __forceinline__ static float at(float const* t, int64_t bs, int64_t hs, int64_t ks, int b, int h,
                                             int blk) {
    return t ? t[b * bs + h * hs + blk * ks] : 1.f;
  }
  __device__ __forceinline__ float q_(int b, int head_q, int m_block) const {
    return at(q, q_batch, q_head, q_block, b, head_q / q_head_div, m_block);
  }
  __device__ __forceinline__ float k_(int b, int head_kv, int n_block) const {
    return at(k, k_batch, k_head, k_block, b, head_kv, n_block);
  }
  __device__ __forceinline__ float v_(int b, int head_kv, int n_block) const {
    return at(v, v_batch, v_head, v_block, b, head_kv, n_block);
  }
  // Per key block (the mainloop applies them block by block) or one per tile (folded outside).
  __device__ __forceinline__ bool k_blocks() const { return k != nullptr && k_block != 0; }
  __device__ __forceinline__ bool v_blocks() const { return v != nullptr && v_block != 0; }
};

template <class Element_, int HeadDim, int TileM, int TileN, int Stages, bool Causal, bool Local,
          bool Softcap, bool Varlen, bool Paged, bool WarpSpecialized, bool Pingpong, bool IntraWgOverlap,
          bool PeelMasked = false, bool PInSmem = false, bool OTmaStore = false>
struct FwdTraits {
  using Element = Element_;  // of q, k, v
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static_assert(sizeof(Element) == 2 || kFp8, "bf16/fp16 or e4m3");
  static_assert(!kFp8 || WarpSpecialized, "fp8: the producer warpgroup transposes V");
  static_assert(!kFp8 || TileN % 32 == 0, "fp8: the PV GEMM takes 32 keys per instruction");
  static_assert(!kFp8 || HeadDim % 16 == 0, "fp8: V is transposed in 16-column strips");
  // Of O: the input type, or for fp8 bf16 (fp16 when the call asks: FwdParams::o_fp16).
  using ElementOut = cute::conditional_t<kFp8, cutlass::bfloat16_t, Element>;
  static constexpr int kHeadDim = HeadDim, kTileM = TileM, kTileN = TileN, kStages = Stages;
  static constexpr bool kCausal = Causal, kLocal = Local, kSoftcap = Softcap, kVarlen = Varlen;
  static constexpr bool kWarpSpecialized = WarpSpecialized, kPingpong = Pingpong, kOverlap = IntraWgOverlap;
  // The masked key blocks in their own copy of the overlapped loop (fwd_mainloop.cuh), so the
  // steady-state loop has no mask code; it lets d256 causal 128x80 build without a spill.
  // Per-key gains and losses: docs/BENCHMARKS.md, "The masked-block peel as a knob".
  static constexpr bool kPeelMasked = PeelMasked;
  static_assert(!PeelMasked || IntraWgOverlap, "the peel is realized in the overlapped loop");
  // P through shared memory: both PV GEMM operands from shared memory (16-bit only: the e4m3
  // P is permuted in registers into its operand layout).
  static constexpr bool kPInSmem = PInSmem;
  static_assert(!PInSmem || !kFp8, "p_in_smem: 16-bit only");
  // Paged: keys and values of a varlen sequence read through a block table (PagedArgs), in
  // chunks of kPageChunk rows, each its own TMA load from its page; page sizes are multiples of
  // it (fa3gen/contract.py PAGED_CHUNK_ROWS, which says why 64).
  static constexpr bool kPaged = Paged;
  static constexpr int kPageChunk = 64;
  static_assert(!Paged || (Varlen && !kFp8), "paged: a 16-bit varlen forward");
  static_assert(!Paged || TileN % kPageChunk == 0, "paged: whole chunks per key block");
  using Mask = AttentionMask<Causal, Local, TileM, TileN>;

  // CTA pairs as thread-block clusters of two, each pair on two query tiles of one (head,
  // batch) (tile_scheduler.cuh), so that they read the same K and V blocks; each CTA loads half
  // of every block and multicasts it to both (FA3 does this for 16-bit non-causal head dims >=
  // 128; FA4's sm90 forward does not). Halves the L2-to-SM traffic of K and V, the forward's
  // largest, and the producer's TMA issue. Dense non-causal warp-specialized 16-bit variants
  // only: there every tile of a head visits the same key blocks, so the two CTAs stay in step.
  // CuTe halves each load's box along the keys (a box is one swizzle row of columns by TileN
  // keys: 176 -> 88, 112 -> 56, 80 -> 40 rows, whole 8-row swizzle atoms). Head dims >= 128,
  // where it gained (16k, alone for seconds: d128 1.02-1.03x, d256 1.01-1.02x; about a tie at
  // 1k), not d64 and d96 (0.96x at 1k); softcap not measured, so not clustered (A/B on an H100
  // SXM, 2026-12-05 (seventeenth), and the H200, (fourteenth)). generator/variants.py
  // fwd_clustered mirrors this condition. FA3GEN_FWD_NO_CLUSTER2: none (an A/B's A side). The
  // varlen d128 forwards as pairs on one sequence's neighbouring tiles were measured and
  // removed (docs/BENCHMARKS.md, 2026-12-05 (eighteenth)).
#ifdef FA3GEN_FWD_NO_CLUSTER2
  static constexpr int kClusterM = 1;
#else
  static constexpr int kClusterM =
      (!kFp8 && !Causal && !Local && !Softcap && !Varlen && !Paged && WarpSpecialized && !PInSmem && HeadDim >= 128)
          ? 2 : 1;
#endif
  static_assert(kClusterM == 1 || TileN % 16 == 0, "each CTA's half of a key block: whole 8-row swizzle atoms");

  // One consumer warpgroup per 64 query rows; a producer warpgroup when warp specialized.
  static constexpr int kConsumerWGs = TileM / 64;
  static constexpr int kConsumerThreads = kConsumerWGs * 128;
  static constexpr int kThreads = kConsumerThreads + (WarpSpecialized ? 128 : 0);
  // setmaxnreg split: the producer keeps few registers so consumers can hold S, P and O.
  // fp8: the producers also transpose V; clusters: each load is this CTA's multicast half.
  // Their loop state then needs more than 24: in a cluster at 24 / 240 the producer's loop
  // spills (d128 128x128, 128x176, d256 128x80). At 40 / 232, with the epilogue's offsets
  // recomputed each tile where the tile is large (store_fwd_tile), all 22 dense non-causal
  // forwards of specs/h100.yaml build spill-free with the switch (2026-12-05 (fourteenth)).
  static constexpr bool kProducerNeeds40 = kFp8 || kClusterM > 1;  // generator/variants.py's caps mirror it
  static constexpr int kProducerRegs = kConsumerWGs == 3 ? 32 : kProducerNeeds40 ? 40 : 24;
  static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : kProducerNeeds40 ? 232 : 240;
  // setmaxnreg only moves registers inside the CTA's launch allocation (the per-thread cap
  // from __launch_bounds__, rounded down to 8, times the threads): asking for more makes the
  // consumers' increase wait forever. 24/240, 40/232 and 32/160 use exactly the whole pool.
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static_assert(!WarpSpecialized ||
                kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kLaunchRegs * kThreads,
                "setmaxnreg split exceeds the CTA's register allocation (the kernel would hang)");

  // Softmax row max and sum as 4 independent chains where a thread holds 32 or more columns
  // of a row, 16-bit (H200 A/B against one chain, 2026-12-01, docs/results/
  // ab_softmax_chains.json: d64 192x128 causal +2-3%, d128 128x128 causal +0-2%, the rest
  // within 1%). d256's 16-20 columns gained nothing (0.96-1.0): one chain. e4m3: two chains
  // at d128 (128x128 and 128x192: 0.997-1.03, median 1.01; docs/results/ab_fp8_chains.json),
  // one elsewhere (d256 0.97-1.01, d64 0.94-1.03 with two).
  static constexpr int kSoftmaxChains = kFp8 ? (HeadDim == 128 ? 2 : 1) : TileN < 128 ? 1 : 4;
  // The softmax's warp vote before its quad reductions (softmax.cuh), where it measured a gain
  // (H200 A/B, 2026-12-01, docs/results/ab_softmax_vote_4rounds.json, 4 rounds, 1k-16k): d128
  // causal 1.02-1.06x, non-causal 128x176 1.00-1.04, d192 1.01-1.04, d256 causal softcap
  // 1.04-1.08; d64 non-causal 192x128 1.02-1.04 (bf16 and fp16; 2026-12-02, docs/results/
  // ab_softmax_vote_d64_nc.json). Off where it lost: d64 causal and softcap, d96 (0.84-0.98),
  // sliding windows (0.98-0.99 then; d128 local softcap 1.00-1.03), d256 without
  // softcap (non-causal 128x80 spills with it) and the fp8 forward (0.93-0.98: its rescale
  // threshold is 0.8, so rows move often and the vote seldom skips anything). Varlen as the
  // padded batch (2026-12-02, docs/results/ab_softmax_vote_varlen.json, mean lengths 512/2k/8k:
  // d128 causal 1.02-1.07x, non-causal 1.01-1.05, d64 non-causal 1.02-1.05).
  // Sliding windows: d128 only, with the pinned wait below (1.01-1.04x; 2026-12-04 (eighth)).
  static constexpr bool kSoftmaxVote =
      !kFp8 && (!Local || HeadDim == 128) &&
      ((HeadDim >= 128 && (HeadDim < 256 || Softcap)) || (HeadDim == 64 && !Causal && !Softcap));

  // The wait for the previous block's P V GEMM, pinned halfway through the softmax (after
  // the exponentials of half of a thread's rows; fwd_mainloop.cuh, softmax_block). Where no
  // branch splits the softmax, ptxas lifts that wait (it has no inputs) above the whole
  // softmax, which then never overlaps P V: every variant without the vote (sass_loops.py
  // --events: WAIT1 WAIT0 E66). Pinned in the 16-bit sliding-window variants (1.00-1.05x;
  // d128 and d256 window 4096 +2% at 16k; docs/BENCHMARKS.md 2026-12-04 (eighth)) and d256's
  // 128x64 ones (causal short rows and varlen 1.01-1.05x; 2026-12-04 (ninth)). Not elsewhere:
  // d64 causal softcap 0.90x, d96 1.00, d64 causal 0.99, d256 128x80 1.00; the
  // vote variants keep ptxas's own placement (d128 non-causal: WAIT1 E32 WAIT0 E34; d128
  // causal 128x128 with kPBeforeRescale: WAIT1 E40 WAIT0 E26).
  static constexpr bool kPinPvWait =
      !kFp8 && (Local || (HeadDim == 256 && TileN == 64 && !kSoftmaxVote));

  // P converted to 16-bit before O's rescale branch rather than after it, so that ptxas
  // interleaves its F2FP with the exponentials, as FA4's loop has them (after the branch they
  // run as one block of 32 at the step's end, waiting on the last exponentials). d128 128x128
  // only: 1.01x median over two H100 runs (0.986-1.038, 12 of 16 points above 1); d64
  // 0.965-0.999 (the conversions take issue slots from its MUFU-bound chain), 128x176 and d256
  // mixed (docs/BENCHMARKS.md, 2026-12-05 (twentieth)). Timed: the bf16 dense 128x128
  // pingpong defaults. Not timed: fp16, varlen, paged and the ablation spec's other d128
  // 128x128 schedules (it applies only to the overlapped step); excluded: windows, softcap.
  static constexpr bool kPBeforeRescale =
      !kFp8 && !PInSmem && HeadDim == 128 && TileN == 128 && !Local && !Softcap;

  static_assert(TileM % 64 == 0 && kConsumerWGs >= 1 && kConsumerWGs <= 3);
  static_assert(TileN % 16 == 0 && TileN <= 256);
  static_assert(HeadDim % 32 == 0 && HeadDim <= 256);
  static_assert(Stages >= 1 && Stages <= 4);
  static_assert(gmma_n_available(TileN) && gmma_n_available(HeadDim),
                "WGMMA N outside CuTe's standard shapes: define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED");
  static_assert(!Pingpong || (WarpSpecialized && kConsumerWGs >= 2),
                "pingpong orders two or more consumer warpgroups of a warp-specialized kernel");

  using SmemLayoutQ = decltype(tile_to_shape(smem_atom<Element, HeadDim, true>(),
                                             Shape<Int<TileM>, Int<HeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(smem_atom<Element, HeadDim, true>(),
                                             Shape<Int<TileN>, Int<HeadDim>, Int<Stages>>{}));
  // V is read as the B operand of O = P V with N = head_dim, K = key (smem_layout_vt).
  using SmemLayoutVt = decltype(smem_layout_vt<Element, HeadDim, TileN, Stages>());
  // fp8: raw V slots; V(i + 1 .. i + slots - 1) land while V(i) is transposed. 3 measured no
  // faster than 2 (docs/BENCHMARKS.md); generator/variants.py FP8_V_RAW_SLOTS mirrors it.
  static constexpr int kVRawSlots = 2;
  using SmemLayoutVRaw = decltype(tile_to_shape(smem_atom<Element, HeadDim, true>(),
                                                Shape<Int<TileN>, Int<HeadDim>, Int<kVRawSlots>>{}));

  using AtomLayout = Layout<Shape<Int<kConsumerWGs>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<TileN>, Int<HeadDim>>>(),
      AtomLayout{}));
  // P (TileM x TileN, keys contiguous: the K-major A operand) when it goes through shared memory.
  using SmemLayoutP = decltype(tile_to_shape(smem_atom<Element, TileN, true>(), Shape<Int<TileM>, Int<TileN>>{}));
  static constexpr auto make_mma_pv() {
    if constexpr (PInSmem) {
      return make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<HeadDim>, Int<TileN>>,
                                                 GMMA::Major::K, GMMA::Major::MN>(),
                            AtomLayout{});
    } else {
      return make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<HeadDim>, Int<TileN>>,
                                                 GMMA::Major::K, kFp8 ? GMMA::Major::K : GMMA::Major::MN>(),
                            AtomLayout{});
    }
  }
  using TiledMmaPV = decltype(make_mma_pv());

  // Global tensors as TMA sees them: (seqlen, head_dim, heads, batch), head_dim contiguous.
  // The seqlen mode is its own TMA dimension, so out-of-range rows are zero-filled per head.
  using GmemLayoutRows = Layout<Shape<int, Int<HeadDim>, int, int>, Stride<int64_t, _1, int64_t, int64_t>>;
  using GmemLayoutVt = Layout<Shape<Int<HeadDim>, int, int, int>, Stride<_1, int64_t, int64_t, int64_t>>;
  using GmemTensorRows = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayoutRows{}));
  using GmemTensorVt = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayoutVt{}));
  // Q is loaded in kQParts row slices, each with its own full/free barriers. With pingpong each
  // consumer warpgroup reads only its 64 rows of Q (its GEMM slice), so a slice per warpgroup
  // lets the next tile's Q start loading as soon as that warpgroup's last S GEMM is done.
  // Only with two consumer warpgroups: with three (d64 192x128, 160 registers each) one Q
  // measured 3% faster at 1k-16k (A/B on the H200, 2026-11-30).
  static constexpr int kQParts = (Pingpong && kConsumerWGs == 2) ? 2 : 1;
  using SmemLayoutQPart = decltype(composition(
      SmemLayoutQ{}, Layout<Shape<Int<TileM / kQParts>, Int<HeadDim>>, Stride<_1, Int<TileM>>>{}));
  // Element offset of a slice's first row (swizzle atoms are stacked along the rows first).
  static constexpr int kQPartOffset =
      TileM / kQParts * decltype(size<1>(smem_atom<Element, HeadDim, true>()))::value;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorRows{}, SmemLayoutQPart{}));
  // Paged: one chunk of kPageChunk keys of a K or V^T stage (the swizzle atoms are stacked
  // keys first in both, so a chunk starts kPageChunk lines further: kChunkOffset elements).
  using SmemLayoutKChunk = decltype(composition(
      take<0, 2>(SmemLayoutK{}), Layout<Shape<Int<kPageChunk>, Int<HeadDim>>, Stride<_1, Int<TileN>>>{}));
  using SmemLayoutVtChunk = decltype(composition(
      take<0, 2>(SmemLayoutVt{}), Layout<Shape<Int<HeadDim>, Int<kPageChunk>>, Stride<_1, Int<HeadDim>>>{}));
  static constexpr int kChunkOffset = kPageChunk * decltype(size<1>(smem_atom<Element, HeadDim, true>()))::value;
  // What one TMA load of K or V lands (the host builds the descriptors with these): a whole
  // stage, a paged chunk, or for fp8 a raw V slot (V as stored, rows like K).
  using SmemLayoutKBox = cute::conditional_t<kPaged, SmemLayoutKChunk, decltype(take<0, 2>(SmemLayoutK{}))>;
  using SmemLayoutVBox = cute::conditional_t<
      kFp8, decltype(take<0, 2>(SmemLayoutVRaw{})),
      cute::conditional_t<kPaged, SmemLayoutVtChunk, decltype(take<0, 2>(SmemLayoutVt{}))>>;
  using GmemTensorV = cute::conditional_t<kFp8, GmemTensorRows, GmemTensorVt>;
  using ClusterShape = Shape<Int<kClusterM>, _1, _1>;
  using TmaLoadKV = cute::conditional_t<kClusterM == 1, SM90_TMA_LOAD, SM90_TMA_LOAD_MULTICAST>;
  using TmaK = decltype(make_tma_copy(TmaLoadKV{}, GmemTensorRows{}, SmemLayoutKBox{}, Int<kClusterM>{}));
  using TmaV = decltype(make_tma_copy(TmaLoadKV{}, GmemTensorV{}, SmemLayoutVBox{}, Int<kClusterM>{}));

  static constexpr uint32_t kBytesQ = TileM * HeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = TileN * HeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<Stages>;
  // V^T: loaded by TMA (16-bit), or written by the producer warpgroup's transpose (fp8).
  using PipelineV = cute::conditional_t<kFp8, cutlass::PipelineAsync<Stages>, Pipeline>;
  using PipelineState = typename cutlass::PipelineState<Stages>;

  // The o_tma_store knob: O leaves through a shared-memory tile of its own and one TMA store per
  // consumer warpgroup (its 64 rows), as FA3, FA4 and cuDNN do, instead of 16-byte stores from
  // registers (fwd_epilogue.cuh); 16-bit warp-specialized forwards without varlen
  // (generator/variants.py o_tma_store_scope).
  static constexpr bool kOTmaStore = OTmaStore;
  static_assert(!OTmaStore || (!kFp8 && !Varlen && WarpSpecialized),
                "o_tma_store: a 16-bit warp-specialized forward without varlen");
  using SmemLayoutOPart = decltype(composition(
      SmemLayoutQ{}, Layout<Shape<_64, Int<HeadDim>>, Stride<_1, Int<TileM>>>{}));
  static constexpr int kOPartOffset = 64 * decltype(size<1>(smem_atom<Element, HeadDim, true>()))::value;
  using GmemTensorRowsOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemLayoutRows{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorRowsOut{}, SmemLayoutOPart{}));

  struct SharedStorage : VRawStorage<Element, kFp8 ? cosize_v<SmemLayoutVRaw> : 1, kVRawSlots, kFp8>,
                         PStorage<Element, PInSmem ? cosize_v<SmemLayoutP> : 1, PInSmem>,
                         OStorage<Element, OTmaStore ? cosize_v<SmemLayoutQ> : 1, OTmaStore> {
    // 1024-byte alignment: the 128B swizzle pattern repeats every 1024 bytes and both TMA
    // and WGMMA derive it from address bits.
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutVt>> v;
    typename Pipeline::SharedStorage pipeline_k;
    typename PipelineV::SharedStorage pipeline_v;
    alignas(8) uint64_t barrier_q[kQParts];       // Q slice landed (TMA transaction barrier)
    alignas(8) uint64_t barrier_q_free[kQParts];  // its readers are done: the next tile may load it
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemPerBlockLimit, "tile does not fit in the 227 KiB of shared memory");
};

// O's TMA store, in the params of o_tma_store variants only (empty otherwise).
template <class Traits, bool = Traits::kOTmaStore>
struct FwdOTmaArgs {};
template <class Traits>
struct FwdOTmaArgs<Traits, true> {
  typename Traits::TmaO tma;
  bool enabled;  // O and its strides allow it (16-byte aligned); else the stores from registers
};

template <class Traits>
struct FwdParams {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  void* o;  // Traits::ElementOut, or half_t for an fp8 call with o_fp16
  float* lse;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int seqlen_q, seqlen_k, heads_q, heads_kv, batch, heads_per_kv;
  int window_left, window_right;  // local variants (AttentionMask)
  LogitSoftcap softcap;           // softcap variants
  // The softmax works on scores * lse_scale in the natural-log domain: softmax_scale, or the
  // cap when softcapping has made them tanh(s * softmax_scale / cap); scale_log2 = lse_scale *
  // log2(e).
  float lse_scale, scale_log2;
  bool o_vector_stores;  // O and its strides 16-byte aligned: the epilogue stores 16 bytes at a time
  TileSchedule schedule;  // the grid policy the host chose (tile_scheduler.cuh)
  VarlenArgs varlen;      // varlen variants (varlen.cuh): batch is 1 in the TMA tensors
  Descales descale;       // fp8 variants
  bool o_fp16;            // fp8 variants: O in fp16 instead of bf16
  PagedArgs paged;        // paged variants (varlen.cuh)
  FwdOTmaArgs<Traits> o_tma;  // o_tma_store variants: O's TMA store (fwd_epilogue.cuh)
};

}  // namespace fa3gen
