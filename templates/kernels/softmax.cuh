// Online softmax on the (rows, cols) view of a WGMMA accumulator (the forward's part; the
// backward recomputes P from the saved LSE instead).
// Works in the log2 domain (exp2 is one MUFU op); the row sum is kept per thread and
// reduced across the quad only once, at the end.
#pragma once
#include <cmath>
#include <type_traits>
#include "fragments.cuh"
#include "rescale_threshold.cuh"

namespace fa3gen {

// PLog2: P comes out times 2^PLog2 (the fp8 forward's e4m3 P, fwd_mainloop.cuh), folded into
// the exponent so it costs no multiply; the row sum carries the same factor, so O / rowsum is
// unchanged and only the LSE subtracts it.
// Vote: before a block's quad reductions of the row maxima, a warp vote on whether any row can
// grow past the threshold (step_impl; FwdTraits::kSoftmaxVote says which variants).
template <int Rows, int Chains, int PLog2 = 0, bool Vote = false>
struct OnlineSoftmax {
  float row_max[Rows];
  float row_sum[Rows];
  float scale_log2;
  float threshold;  // rescale_threshold.cuh (a constant once inlined)

  __device__ explicit OnlineSoftmax(float scale_log2_, float threshold_ = FA3GEN_RESCALE_THRESHOLD)
      : scale_log2(scale_log2_), threshold(threshold_) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < Rows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
  }

  // Floors of the fp8 scales, which multiply raw e4m3 dot products of at most 448^2 * 256 <
  // 2^26 (differences below 2^27): a tile's scale (the softmax scale times the q descale, and
  // the k descale unless per block) below 2^-60 moves every exponent by at most 2^-33 times
  // the block's factor, and a key block's factor below 2^-63 by at most 2^-36 times the
  // tile's scale. So a descale of 0 (the attention of zeros on that side) gives equal weights
  // over the visible keys, and a block's multiplier, at least 2^-123 > FLT_MIN, cannot
  // underflow to 0, which would turn a masked -inf into NaN. The floors are visible only
  // when a tiny scale on one side meets a factor above about 2^23 on the other (README). A
  // NaN is kept (x < floor is false) and shows in the output. Flooring the product instead
  // puts two dependent instructions before the exponentials (0.984x per-tensor, measured
  // together with another change, H100).
  static constexpr float kTileScaleFloor = 0x1p-60f, kBlockScaleFloor = 0x1p-63f;
  __device__ __forceinline__ static float floored(float x, float floor) { return x < floor ? floor : x; }

  // A row's max and sum run as Chains independent chains (column c in chain c % Chains):
  // while one warpgroup's softmax runs, the other holds the tensor cores and no other warp on
  // the scheduler has work, so one serial chain of dependent FMNMX/FADD exposes its latency
  // (FwdTraits::kSoftmaxChains says how many each variant uses).
  static constexpr int kChains = Chains;
  template <class TS>
  __device__ __forceinline__ static float chains_max(TS const& S, int r) {
    constexpr int kCols = decltype(size<1>(S))::value;
    static_assert(kCols % kChains == 0, "columns per thread split evenly into the chains");
    float m[kChains];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kChains; ++k) m[k] = S(r, k);
    CUTLASS_PRAGMA_UNROLL
    for (int c = kChains; c < kCols; ++c) m[c % kChains] = fmaxf(m[c % kChains], S(r, c));
    float out = m[0];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 1; k < kChains; ++k) out = fmaxf(out, m[k]);
    return out;
  }
  __device__ __forceinline__ static float chains_total(float const (&sum)[kChains]) {
    float out = sum[0];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 1; k < kChains; ++k) out += sum[k];
    return out;
  }

  // Turns scores S into unnormalized probabilities in place; rescale[r] is the factor the
  // running output row r must be multiplied by (0 on the first block, where O is still 0, 1
  // where the row kept its maximum). Returns whether any of this thread's rows needs one.
  template <class TS>
  __device__ __forceinline__ bool step(TS& S, float (&rescale)[Rows]) {
    return step_impl<false>(S, rescale, 1.f, NoHook{});
  }
  // The same on the scores S * block_scale (a factor of this key block, e.g. its fp8 descale),
  // without multiplying them: the block's maximum and the exponent's multiplier take the factor
  // instead, one multiply per row instead of one per score. The factor is floored at
  // kBlockScaleFloor (a block of zeros, descale 0: its scores are 0).
  // between(): called once every row's maximum is known and before the first exponential
  // (the rows' two phases then run as two loops); without it each row runs both in turn. It
  // returns an int that is 0 at run time but not to the compiler: the exponentials take it in,
  // so they cannot be scheduled before the call.
  struct NoHook {};
  template <class TS, class Hook = NoHook>
  __device__ __forceinline__ bool step(TS& S, float (&rescale)[Rows], float block_scale, Hook&& between = {}) {
    return step_impl<true>(S, rescale, floored(block_scale, kBlockScaleFloor), between);
  }
  // Unscaled, with between() called before row HookRow's exponentials (the two phases).
  template <int HookRow, class TS, class Hook>
  __device__ __forceinline__ bool step_hooked(TS& S, float (&rescale)[Rows], Hook&& between) {
    return step_impl<false, HookRow>(S, rescale, 1.f, between);
  }
  template <bool kScaled, int HookRow = 0, class TS, class Hook>
  __device__ __forceinline__ bool step_impl(TS& S, float (&rescale)[Rows], float block_scale, Hook&& between) {
    constexpr bool kSplit = !std::is_same_v<cute::remove_cvref_t<Hook>, NoHook>;
    static_assert(decltype(size<0>(S))::value == Rows);
    const float mul = kScaled ? scale_log2 * block_scale : scale_log2;
    bool any = false;
    // Vote: a row's quad-reduced maximum only matters when it grows past the threshold, and it
    // can only do so where one of the four threads' own maxima does. So each thread tests its
    // own rows first and the warp votes once: when no row of the warp moves (the usual case
    // after the first blocks), every quad reduction (two dependent shuffles a row) is skipped.
    // Bit-identical: the skipped reductions' results were discarded.
    float own_max[Rows];
    bool reduce = true;
    if constexpr (Vote) {
      bool moves = false;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < Rows; ++r) {
        own_max[r] = chains_max(S, r);
        if constexpr (kScaled) own_max[r] *= block_scale;
        moves |= !((own_max[r] - row_max[r]) * scale_log2 <= threshold);  // NaN (-inf - -inf) moves
      }
      reduce = __any_sync(0xffffffffu, moves);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < Rows; ++r) {
      if (!reduce) {
        rescale[r] = 1.f;
      } else {
        float block_max;
        if constexpr (Vote) {
          block_max = own_max[r];
        } else {
          block_max = chains_max(S, r);
          if constexpr (kScaled) block_max *= block_scale;
        }
        float m = quad_allreduce_max<4>(fmaxf(row_max[r], block_max));
        // NaN when the row has seen no visible key (-inf - -inf): it takes the update branch.
        const float grew = (m - row_max[r]) * scale_log2;
        if (!(grew <= threshold)) {
          // A row that has seen no visible key yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
          const float m_new_scaled = (m == -INFINITY) ? 0.f : m * scale_log2;
          rescale[r] = exp2f(row_max[r] * scale_log2 - m_new_scaled);
          row_max[r] = m;
          any = true;
        } else {
          rescale[r] = 1.f;
        }
      }
      if constexpr (!kSplit) exp_row(S, r, mul, rescale[r]);
    }
    if constexpr (kSplit) {
      static_assert(HookRow >= 0 && HookRow < Rows);
      int zero = 0;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < Rows; ++r) {
        if (r == HookRow) zero = between();
        exp_row(S, r, mul, rescale[r], zero);
      }
    }
    return any;
  }
  // Row r's exponentials and its running sum, once row_max[r] is final for the block.
  template <class TS>
  __device__ __forceinline__ void exp_row(TS& S, int r, float mul, float rescale, int zero = 0) {
    const float m_scaled = (row_max[r] == -INFINITY) ? 0.f : row_max[r] * scale_log2;
    float bias;  // the exponent's constant term (PLog2 0: exactly -m_scaled)
    if constexpr (PLog2 == 0) bias = -m_scaled;
    else bias = float(PLog2) - m_scaled;
    bias = __int_as_float(__float_as_int(bias) + zero);  // between()'s 0: orders, changes nothing
    float sum[kChains] = {};
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < size<1>(S); ++c) {
      float p = exp2f(fmaf(S(r, c), mul, bias));
      S(r, c) = p;
      sum[c % kChains] += p;
    }
    row_sum[r] = row_sum[r] * rescale + chains_total(sum);
  }

  // 1/rowsum (0 for a row with no visible key) and the natural-log LSE (-inf for such rows).
  __device__ __forceinline__ void finalize(float softmax_scale, float (&inv_sum)[Rows], float (&lse)[Rows]) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < Rows; ++r) {
      float sum = quad_allreduce_sum<4>(row_sum[r]);
      bool empty = sum == 0.f;  // a NaN sum (NaN inputs or descales) stays NaN in O and the LSE
      inv_sum[r] = empty ? 0.f : 1.f / sum;
      if constexpr (PLog2 == 0) lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + logf(sum);
      else  // without the sum's 2^PLog2
        lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + (logf(sum) - float(PLog2) * 0.693147181f);
    }
  }
};

// Logit softcapping: s -> cap * tanh(s * softmax_scale / cap). The kernels keep only
// t = tanh(s * softmax_scale / cap), computed from raw scores before the mask (a masked -inf
// must stay -inf); the cap joins the softmax's scale (launch_common.cuh: masking_args): one
// multiply a score fewer (forward +0-3.5%, docs/results/ab_softcap_cap_in_scale.json), and the
// backward needs t itself for the derivative, 1 - t^2. tanh.approx is one MUFU op (relative
// error about 2^-11); an exact tanh is a dozen instructions, and the softmax is bound by
// instruction issue: moving a quarter or half of the exp2s from MUFU to a polynomial on the FMA
// pipe (8 instructions each) cost 2-21% (docs/results/ab_exp2_emu_2.json, ab_exp2_emu_4.json).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct LogitSoftcap {
  float pre;  // softmax_scale / cap
  template <class TS>
  __device__ __forceinline__ void apply(TS& S) const {
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < size(S); ++e) S(e) = tanh_approx(S(e) * pre);
  }
};

template <class TO, int Rows>
__device__ __forceinline__ void scale_rows(TO& O, float const (&factor)[Rows]) {
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < Rows; ++r) {
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < size<1>(O); ++c) { O(r, c) *= factor[r]; }
  }
}

}  // namespace fa3gen
