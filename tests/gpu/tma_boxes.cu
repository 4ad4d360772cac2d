// The TMA boxes CuTe builds for the forward's K and V descriptors (the host side of launch_fwd),
// printed by a stand-in for the driver's cuTensorMapEncodeTiled: runs on a machine without a
// GPU or driver, with where each CTA's share of one load lands (global coordinate, shared-memory
// offset). With -DFA3GEN_FWD_CLUSTER2 the multicast descriptors and both CTAs' halves. Not a
// test; asserts stay on (no -DNDEBUG), so a box CuTe cannot split aborts here:
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED [-DFA3GEN_FWD_CLUSTER2] -Itemplates/kernels \
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

// tma_partition's body (a device function in CuTe), on the host: where each CTA's share of a
// load starts in global memory and in shared memory.
template <class Atom, class CtaCoord, class TShape, class TStride, class SEngine, class SLayout, class GEngine, class GLayout>
auto host_partition(Atom const& copy_atom, CtaCoord const& cta_coord, Layout<TShape,TStride> const& cta_layout,
                    Tensor<SEngine,SLayout> const& stensor, Tensor<GEngine,GLayout> const& gtensor) {
  Layout inv_smem_layout = right_inverse(get_nonswizzle_portion(layout<0>(stensor)));
  Layout layout_v = tile_to_shape(make_layout(inv_smem_layout), size<0>(stensor));
  Layout tma_layout_v = make_layout(Int<Atom::NumValSrc>{});
  auto layout_V = make_tile(logical_divide(layout_v, tma_layout_v));
  auto glayout_V = append<GLayout::rank>(layout_V, _);
  auto slayout_V = append<SLayout::rank>(layout_V, _);
  Tensor gtensor_v = coalesce(gtensor.compose(glayout_V), Shape<Shape<_1,_1>>{});
  Tensor stensor_v = coalesce(stensor.compose(slayout_V), Shape<Shape<_1,_1>>{});
  auto multicast_offset = cta_layout(cta_coord) * (size(tma_layout_v) / cosize(cta_layout));
  auto multicast_coord  = make_coord(make_coord(multicast_offset, Int<0>{}));
  auto gcoord = append<GLayout::rank>(multicast_coord, Int<0>{});
  auto scoord = append<SLayout::rank>(multicast_coord, Int<0>{});
  return cute::make_tuple(domain_offset(gcoord, gtensor_v), domain_offset(scoord, stensor_v));
}
// Each CTA's share of key block 5 into stage 1: per TMA instruction, the first element's
// global coordinate and shared-memory offset (elements). The shares of a cluster must tile the
// block: the same instructions, rows offset by TileN / 2 keys.
template <class T, class E, class Tma, class G, class SLayout>
void shares(Tma const& tma, G const& g, SLayout const&) {
  Tensor s = make_tensor(make_smem_ptr(reinterpret_cast<E*>(0)), SLayout{});
  for (int r = 0; r < T::kClusterM; ++r) {
    auto [tg, ts] = host_partition(tma, r, Layout<Int<T::kClusterM>>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
    auto gb = tg(_, 5);
    auto sb = ts(_, 1);
    constexpr int iters = decltype(size<0, 1>(gb))::value;
    std::printf("      rank %d:", r);
    for (int i = 0; i < iters; ++i) {
      std::printf(" [g ");
      print(gb(make_coord(make_coord(0, i))));
      auto first = &sb(make_coord(make_coord(0, i)));
      std::printf(" s %lld]", (long long)(reinterpret_cast<E const*>(&*first) - (E const*)0));
    }
    std::printf("\n");
  }
}

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
  shares<T, E>(tk, local_tile(tk.get_tma_tensor(shape(k))(_, _, 3, 1), Shape<Int<TN>, Int<HD>>{}, make_coord(_, _0{})),
               typename T::SmemLayoutK{});
  std::printf("  V^T\n");
  auto tv = make_tma_copy(typename T::TmaLoadKV{}, v, typename T::SmemLayoutVBox{}, Int<T::kClusterM>{});
  shares<T, E>(tv, local_tile(tv.get_tma_tensor(shape(v))(_, _, 3, 1), Shape<Int<HD>, Int<TN>>{}, make_coord(_0{}, _)),
               typename T::SmemLayoutVt{});
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
