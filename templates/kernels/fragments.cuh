// Register-fragment helpers shared by the forward and backward parts: WGMMA issue, fragment
// layout views, dtype conversion, tile stores, quad reductions. Building blocks only; the
// schedules live in the mainloops (fwd_mainloop.cuh, bwd_mainloop.cuh).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace fa3gen {
using namespace cute;

// Issue k-blocks [KFirst, KLast) of one warpgroup GEMM asynchronously and commit them as one
// batch (ZeroInit: the first k-block overwrites tCrC; otherwise they accumulate into it). A
// GEMM may be issued in parts along K as its A operand (registers) becomes ready.
// The caller decides when to wait (warpgroup_wait<N>), which is what makes overlap possible.
// A is either smem descriptors (SS) or a register fragment of 16-bit values (RS); only
// register operands need fencing against reordering around the asynchronous WGMMA.
template <bool ZeroInit, int KFirst, int KLast, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_issue_k(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  static_assert(!ZeroInit || KFirst == 0, "only a GEMM's first part may zero the accumulator");
  constexpr bool kARegs = !is_same_v<typename TA::iterator, GMMA::DescriptorIterator>;
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  tiled_mma.accumulate_ = ZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int k = KFirst; k < KLast; ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tCrC);
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
}

// The whole GEMM (every k-block) as one batch.
template <bool ZeroInit, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_issue(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  wgmma_issue_k<ZeroInit, 0, decltype(size<2>(tCrA))::value>(tiled_mma, tCrA, tCrB, tCrC);
}

// The slice of a warpgroup-level TiledMma for its shared-memory operands (descriptors). A
// descriptor depends only on the warpgroup, so slicing at the warpgroup's first thread, with
// the index broadcast from lane 0, lets ptxas see the values as warp-uniform and keep them in
// uniform registers (sliced with the thread index, every GEMM moved them over with R2UR).
template <class TiledMma>
__device__ __forceinline__ auto warpgroup_slice(TiledMma const& tiled_mma, int tid) {
  const int warpgroup = __shfl_sync(0xffffffff, tid / 128, 0);
  return tiled_mma.get_thread_slice(warpgroup * 128);
}

// A WGMMA accumulator fragment has layout ((2, 2, N/8), MMA_M, MMA_N): (column pair,
// row half, 8-column block). View it as (rows, cols) so that softmax can reduce along rows.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_rowcol(Layout const& acc) {  // host too: tests/gpu/bwd_row_layout.cu
  static_assert(rank(Layout{}) == 3);
  auto v = get<0>(acc);
  return make_layout(make_layout(get<1>(v), get<1>(acc)),
                     make_layout(get<0>(v), get<2>(v), get<2>(acc)));
}

// Reinterpret a 16-bit accumulator-shaped fragment as the A operand of an RS WGMMA
// (K-major, k16 per instruction): the A fragment's third mode is "column + 8", i.e.
// pairs of consecutive 8-column blocks of the accumulator. No data moves.
template <class Layout>
__device__ __forceinline__ constexpr auto acc_as_operand_a(Layout const& acc) {
  auto v = get<0>(acc);                                             // (2, 2, N/8)
  auto split = logical_divide(v, make_tile(Underscore{}, Underscore{}, _2{}));  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)),
                     get<1>(acc),
                     coalesce(make_layout(get<2, 1>(split), get<2>(acc))));
}

// Convert a register fragment elementwise (packed conversions where the types allow).
template <class To, class Engine, class Layout>
__device__ __forceinline__ auto convert_fragment(Tensor<Engine, Layout> const& src) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(src))::value;
  Tensor dst = make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(src.data()));
  return dst;
}

// Store a 16-bit fragment in accumulator layout as rows [0, row_end) of a (TileRows x Cols)
// tile at `tile` (row stride in elements, columns contiguous), straight from registers.
// Columns 2c and 2c+1 are adjacent in the accumulator and in memory: one 32-bit store.
template <int TileRows, int Cols, class ThrMma, class Frag, class Element>
__device__ __forceinline__ void store_tile_rows(ThrMma const& thr, Frag const& frag, Element* tile,
                                                int64_t row_stride, int row_end) {
  Tensor g = make_tensor(make_gmem_ptr(tile), make_shape(Int<TileRows>{}, Int<Cols>{}),
                         make_stride(row_stride, _1{}));
  Tensor tg = thr.partition_C(g);
  Tensor tc = thr.partition_C(make_identity_tensor(Shape<Int<TileRows>, Int<Cols>>{}));
  Tensor r_rc = make_tensor(frag.data(), acc_as_rowcol(frag.layout()));
  Tensor g_rc = make_tensor(tg.data(), acc_as_rowcol(tg.layout()));
  Tensor c_rc = make_tensor(tc.data(), acc_as_rowcol(tc.layout()));
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < size<0>(r_rc); ++r) {
    if (get<0>(c_rc(r, 0)) < row_end) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(r_rc); c += 2) {
        Element pair[2] = {r_rc(r, c), r_rc(r, c + 1)};
        *reinterpret_cast<uint32_t*>(&g_rc(r, c)) = *reinterpret_cast<uint32_t const*>(pair);
      }
    }
  }
}

// Row-major staging tile in shared memory for coalesced stores: Cols + 8 elements per row, so
// the 8 rows of one 4-byte fragment store instruction fall on different banks, and every row
// starts 16-byte aligned (Cols is a multiple of 32).
template <int Cols>
constexpr int staged_row_stride() { return Cols + 8; }  // elements
template <int Rows, int Cols, class Element>
constexpr int staged_tile_bytes() { return Rows * staged_row_stride<Cols>() * int(sizeof(Element)); }

// Write a 16-bit accumulator-layout fragment into a row-major staging tile (see above).
template <int Rows, int Cols, class ThrMma, class Frag, class Element>
__device__ __forceinline__ void stage_fragment_rows(ThrMma const& thr, Frag const& frag, Element* stage) {
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<Rows>, Int<Cols>>{}));
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(frag); i += 2) {  // elements i and i + 1 are neighbouring columns
    Element pair[2] = {frag(i), frag(i + 1)};
    *reinterpret_cast<uint32_t*>(&stage[get<0>(coords(i)) * staged_row_stride<Cols>() + get<1>(coords(i))]) =
        *reinterpret_cast<uint32_t const*>(pair);
  }
}

// The same for an fp32 fragment of the transposed tile (a Cols x Rows accumulator), converted
// element by element: its neighbouring elements are neighbouring rows of the staging tile (a
// converted copy of the whole fragment spilled 116 bytes at 160 registers, d192 64x96).
template <int Rows, int Cols, class ThrMma, class Frag, class Element>
__device__ __forceinline__ void stage_fragment_rows_transposed(ThrMma const& thr, Frag const& frag, Element* stage) {
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<Cols>, Int<Rows>>{}));
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(frag); ++i) {
    stage[get<1>(coords(i)) * staged_row_stride<Cols>() + get<0>(coords(i))] = Element(frag(i));
  }
}

// Rows [0, row_end) of a staging tile to global memory (row stride in elements), 16 bytes per
// store, by Threads threads; tile and row_stride must be 16-byte aligned.
template <int Rows, int Cols, int Threads, class Element>
__device__ __forceinline__ void store_staged_rows(const Element* stage, Element* tile, int64_t row_stride,
                                                  int row_end, int tid) {
  constexpr int kVecs = Cols / 8, kTotal = Rows * kVecs;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < (kTotal + Threads - 1) / Threads; ++k) {
    const int i = tid + k * Threads, r = i / kVecs, c = (i % kVecs) * 8;
    if (i < kTotal && r < row_end) {
      *reinterpret_cast<uint4*>(tile + r * row_stride + c) = *reinterpret_cast<const uint4*>(&stage[r * staged_row_stride<Cols>() + c]);
    }
  }
}

// The same, 2 bytes per copy (rows not 16-byte aligned); a rolled loop, as it is rare.
template <int Rows, int Cols, int Threads, class Element>
__device__ __forceinline__ void store_staged_elems(const Element* stage, Element* tile, int64_t row_stride,
                                                   int row_end, int tid) {
#pragma unroll 1
  for (int i = tid; i < Rows * Cols; i += Threads) {
    const int r = i / Cols, c = i % Cols;
    if (r < row_end) tile[r * row_stride + c] = stage[r * staged_row_stride<Cols>() + c];
  }
}

template <int N>
__device__ __forceinline__ float quad_allreduce_max(float x) {
  CUTLASS_PRAGMA_UNROLL
  for (int offset = N / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  return x;
}

template <int N>
__device__ __forceinline__ float quad_allreduce_sum(float x) {
  CUTLASS_PRAGMA_UNROLL
  for (int offset = N / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
  return x;
}

}  // namespace fa3gen
