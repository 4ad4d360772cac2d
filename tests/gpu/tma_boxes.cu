// The TMA boxes CuTe builds for the forward's K and V descriptors (the host side of launch_fwd),
// printed by a stand-in for the driver's cuTensorMapEncodeTiled: runs on a machine without a
// GPU or driver: the multicast descriptors of the clustered ones (kClusterM), each CTA's half. Not a
// test; asserts stay on (no -DNDEBUG), so a box CuTe cannot split aborts here:
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED [-DFA3GEN_FWD_NO_CLUSTER2] -Itemplates/kernels \
//     -I$CUTLASS_DIR -o /tmp/tma_boxes tests/gpu/tma_boxes.cu && /tmp/tma_boxes
// docs/BENCHMARKS.md, 2026-12-04 (eleventh).
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL
#include <cuda.h>
#include <cstdio>
#include "fwd_traits.cuh"

extern "C" CUresult cuTensorMapEncodeTiled(CUtensorMap*, CUtensorMapDataType, cuuint32_t rank, void*,
                                           const cuuint64_t* gdim, const cuuint64_t* gstride, const cuuint32_t* box,
                                           const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle sw,
                                           CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
  std::printf("    rank %u box", rank);
  for (unsigned i = 0; i < rank; ++i) std::printf(" %u", box[i]);
  std::printf("  gdim");
  for (unsigned i = 0; i < rank; ++i) std::printf(" %llu", (unsigned long long)gdim[i]);
  std::printf("  swizzle %d\n", int(sw));
  return CUDA_SUCCESS;
}

using namespace fa3gen;
template <class E, int HD, int TM, int TN, bool PP>
void show(const char* name) {
  using T = FwdTraits<E, HD, TM, TN, 2, false, false, false, false, false, true, PP, true, false, false>;
  std::printf("%s cluster %d\n", name, T::kClusterM);
  const int seqlen = 16384, heads = 8, batch = 2;
  const int64_t rs = int64_t(heads) * HD, hs = HD, bs = int64_t(seqlen) * rs;
  auto k = make_tensor(make_gmem_ptr(reinterpret_cast<E const*>(0x10000000)),
                       make_layout(make_shape(seqlen, Int<HD>{}, heads, batch), make_stride(rs, _1{}, hs, bs)));
  auto v = make_tensor(make_gmem_ptr(reinterpret_cast<E const*>(0x20000000)),
                       make_layout(make_shape(Int<HD>{}, seqlen, heads, batch), make_stride(_1{}, rs, hs, bs)));
  std::printf("  K\n");
  auto tk = make_tma_copy(typename T::TmaLoadKV{}, k, typename T::SmemLayoutKBox{}, Int<T::kClusterM>{});
  std::printf("  V^T\n");
  auto tv = make_tma_copy(typename T::TmaLoadKV{}, v, typename T::SmemLayoutVBox{}, Int<T::kClusterM>{});
  (void)tk; (void)tv;
}

int main() {
  using bf16 = cutlass::bfloat16_t;
  show<bf16, 128, 128, 176, true>("d128 128x176");
  show<bf16, 128, 128, 128, true>("d128 128x128");
  show<bf16, 256, 128, 80, false>("d256 128x80");
  show<bf16, 256, 128, 64, true>("d256 128x64");
  show<bf16, 64, 192, 128, true>("d64 192x128");
  show<bf16, 96, 128, 128, false>("d96 128x128");
  show<bf16, 192, 128, 112, false>("d192 128x112");
  return 0;
}
