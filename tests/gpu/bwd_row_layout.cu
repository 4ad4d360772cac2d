// Host-only check (no GPU needed) of the column layout that bwd_mainloop.cuh's
// ShuffledRowStats (BwdTraits::kRowsByShfl) relies on: the backward's S^T accumulator column r
// of consumer thread tid is query 8 (r / 2) + 2 (tid % 4) + r % 2. Run it after changing the
// backward's TiledMma or tiles:
//   nvcc -std=c++17 --expt-relaxed-constexpr -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED \
//     -Itemplates/kernels -I$CUTLASS_DIR -gencode arch=compute_90a,code=sm_90a \
//     -o /tmp/bwd_row_layout tests/gpu/bwd_row_layout.cu && /tmp/bwd_row_layout
// Exit status 1 when a checked tile breaks it. d256 64x64 is printed as the
// counter-example: split-head-dim tiles hand each warpgroup half of the queries, and the
// trait leaves them alone. Also checked: the rows-to-k-blocks map of kSplitDkv (check_parts).
#include <cstdio>
#include "bwd_traits.cuh"
#include "fragments.cuh"
using namespace cute;

template <class Traits>
int check(const char* name) {
  typename Traits::TiledMmaSdP mma;
  int bad = 0, cols = 0;
  for (int tid = 0; tid < Traits::kConsumerThreads; ++tid) {
    auto thr = mma.get_thread_slice(tid);
    auto cS = thr.partition_C(make_identity_tensor(Shape<Int<Traits::kTileN>, Int<Traits::kTileM>>{}));
    auto coordS = make_tensor(cS.data(), fa3gen::acc_as_rowcol(cS.layout()));
    cols = size<1>(coordS);
    for (int r = 0; r < size<1>(coordS); ++r) {
      int q = get<1>(coordS(0, r));
      int want = 8 * (r / 2) + 2 * (tid % 4) + r % 2;
      if (q != want && bad++ < 3) printf("%s tid %d r %d: query %d, formula %d\n", name, tid, r, q, want);
    }
  }
  printf("%s: %d columns a thread, %d mismatches\n", name, cols, bad);
  return bad;
}

// BwdTraits::kSplitDkv issues the RS GEMMs dV += P^T dO and dK += dS^T Q in parts along
// their K (the queries): rows [4c, 4c + 4) of the thread's (query, key) view must be exactly
// the fragment values of the A operand's k-block c (acc_as_operand_a), for every c.
template <class Traits>
int check_parts(const char* name) {
  typename Traits::TiledMmaSdP mma;
  auto acc = partition_fragment_C(mma, Shape<Int<Traits::kTileN>, Int<Traits::kTileM>>{}).layout();
  auto rc = fa3gen::acc_as_rowcol(acc);
  auto qk = make_layout(layout<1>(rc), layout<0>(rc));  // (query, key) view, as bwd_mainloop.cuh
  auto a = fa3gen::acc_as_operand_a(acc);                // (MMA, MMA_M, MMA_K)
  int bad = 0;
  for (int k = 0; k < size<2>(a); ++k) {
    for (int i = 0; i < size<0>(a); ++i) {
      for (int m = 0; m < size<1>(a); ++m) {
        const int idx = a(i, m, k);
        int row = -1;
        for (int r = 0; r < size<0>(qk); ++r)
          for (int c = 0; c < size<1>(qk); ++c)
            if (qk(r, c) == idx) row = r;
        if (row / 4 != k && bad++ < 3) printf("%s k-block %d: value %d is row %d\n", name, k, idx, row);
      }
    }
  }
  printf("%s: %d k-blocks, %d rows a thread, %d values outside their rows\n", name, int(size<2>(a)),
         int(size<0>(qk)), bad);
  return bad;
}

int main() {
  int bad = 0;
  bad += check_parts<fa3gen::BwdTraits<cutlass::bfloat16_t, 64, 128, 128, 2, true, false, false, false>>("parts d64 128x128");
  bad += check_parts<fa3gen::BwdTraits<cutlass::bfloat16_t, 128, 64, 128, 2, true, false, false, false>>("parts d128 64x128");
  bad += check<fa3gen::BwdTraits<cutlass::bfloat16_t, 128, 64, 128, 2, true, false, false, false>>("d128 64x128");
  bad += check<fa3gen::BwdTraits<cutlass::bfloat16_t, 64, 128, 128, 2, true, false, false, false>>("d64 128x128");
  bad += check<fa3gen::BwdTraits<cutlass::bfloat16_t, 128, 80, 128, 2, false, false, false, false>>("d128 80x128");
  const int fitting = bad;
  check<fa3gen::BwdTraits<cutlass::bfloat16_t, 256, 64, 64, 2, true, false, false, false>>("d256 64x64 (split head dim: expected not to fit)");
  return fitting != 0;
}
