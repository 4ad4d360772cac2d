// Measurement switch FA3GEN_BWD_DESC_ADD64 (backward translation units only: bwd_mainloop.cuh
// includes this): advance a WGMMA shared-memory descriptor with one 64-bit add instead of
// CuTe's 32-bit add of its low word and a copy of its high word. ptxas turns CuTe's form into
// a UIADD3 plus a UMOV of the constant high word for every descriptor of every WGMMA, and the
// 64-bit form into one UIADD3.64, as FA4's backward shows: static steady loop d64 764 -> 708
// instructions (FA4: 651), d128 498 -> 445. The forward's loops grow with it (d128 128x176
// 824 -> 842, d256 128x80 586 -> 636), so it stays out of them. The value is the same: the low
// word (start address and leading byte offset) never carries into the high one.
#pragma once
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#ifdef FA3GEN_BWD_DESC_ADD64
namespace cute::SM90::GMMA {
template <>  // of the member template of a plain struct: one template<> only
CUTE_HOST_DEVICE constexpr DescriptorIterator DescriptorIterator::operator+<int>(int const& offset) const {
  return {GmmaDescriptor{desc_.desc_ + uint64_t(int64_t(offset))}};
}
}  // namespace cute::SM90::GMMA
#endif
