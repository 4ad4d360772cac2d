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

}  // namespace fa3gen
