// Swizzled shared-memory atoms for WGMMA operands, shared by the forward and backward traits
// (its own header so that editing one direction's traits does not recompile the other's).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>

namespace fa3gen {
using namespace cute;

// sm_90's largest dynamic shared memory per block, 227 KiB (generator/variants.py SMEM_LIMIT).
constexpr int kSmemPerBlockLimit = 232448;

// Widest swizzle whose atom divides the contiguous extent: 128-byte rows need 64 16-bit or
// 128 8-bit elements. The atom's row in bytes (128, 64 or 32):
template <class Element, int ContiguousExtent>
constexpr int smem_swizzle_bytes() {
  constexpr int kBytes = ContiguousExtent * int(sizeof(Element));
  return kBytes % 128 == 0 ? 128 : kBytes % 64 == 0 ? 64 : 32;
}
template <class Element, int ContiguousExtent, bool KMajor>
constexpr auto smem_atom() {
  constexpr int kRow = smem_swizzle_bytes<Element, ContiguousExtent>();
  if constexpr (KMajor) {
    if constexpr (kRow == 128) return GMMA::Layout_K_SW128_Atom<Element>{};
    else if constexpr (kRow == 64) return GMMA::Layout_K_SW64_Atom<Element>{};
    else return GMMA::Layout_K_SW32_Atom<Element>{};
  } else {
    if constexpr (kRow == 128) return GMMA::Layout_MN_SW128_Atom<Element>{};
    else if constexpr (kRow == 64) return GMMA::Layout_MN_SW64_Atom<Element>{};
    else return GMMA::Layout_MN_SW32_Atom<Element>{};
  }
}

// Zeroes rows [first, Rows) of one (Rows x Cols) tile built by tile_to_shape from atoms of
// LineBytes rows (smem_swizzle_bytes) with the rows mode first (the default order for K-major
// tiles; fwd_traits.cuh's V^T keys first), `Threads` threads taking part. Such a tile is Cols *
// sizeof(Element) / LineBytes blocks of Rows lines (a row's values within one atom): line
// (block, row) lies at (block * Rows + row) * LineBytes, and the swizzle permutes 16-byte
// chunks only within a line, so whole lines are zeroed without swizzled addresses. The caller
// orders the stores before the GEMMs that read them (fence_view_async_shared, a barrier).
// first >= 0: the callers pass the block that holds a sequence's last rows.
template <class Element, int Rows, int Cols, int LineBytes, int Threads>
__device__ __forceinline__ void zero_tile_rows(Element* tile, int first, int thread) {
  constexpr int kLineBytes = LineBytes, kLineChunks = kLineBytes / 16;
  constexpr int kBlocks = Cols * int(sizeof(Element)) / kLineBytes;
  static_assert(Threads % kLineChunks == 0);
  // 32-bit shared addresses: a generic pointer's extra register spilled d256 128x80.
  const uint32_t chunk = cute::cast_smem_ptr_to_uint(tile) + thread % kLineChunks * 16;
#pragma unroll 1
  for (int row = first + thread / kLineChunks; row < Rows; row += Threads / kLineChunks) {
    CUTLASS_PRAGMA_UNROLL
    for (int block = 0; block < kBlocks; ++block) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(chunk + (block * Rows + row) * kLineBytes), "r"(0)
                   : "memory");
    }
  }
}

}  // namespace fa3gen
