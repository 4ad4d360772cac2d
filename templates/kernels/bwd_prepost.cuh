// The backward's memory-bound kernels around the main kernel: the preprocess (D, LSE in log2,
// workspace zeroing) before it and the dQ conversion after it. Plain CUDA.
#pragma once
#include <cmath>
#include "bwd_dq.cuh"
#include "bwd_traits.cuh"
#include "fragments.cuh"

namespace fa3gen {

struct BwdRowParams {
  const void* o;
  const void* dout;
  const float* lse;    // (batch, heads_q, seqlen_q) from the forward
  float* lse_log2;     // (batch, heads_q, seqlen_q_rounded)
  float* dsum;
  float* dq_accum;     // zeroed here: head_dim floats per padded row cover the whole accumulator
  int* dq_semaphore;   // zeroed here (one per query block) unless null
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int batch, heads_q, seqlen_q, seqlen_q_rounded, tile_m;
  bool vector_loads;   // O and dO rows are aligned for the row_vec_elems-wide loads
  // Varlen: rows are (heads_q, q_tiles_padded * tile_m) of the padded workspace, lse is
  // (heads_q, total_q), O and dO are packed (total_q rows).
  const int* cu_seqlens_q;
  int total_q, q_tiles_padded;
};

// Threads per query row in the preprocess, and elements per vector load (16 bytes where
// head_dim allows, else 8: head_dim 96 is 24 loads of 4 elements over 8 threads).
constexpr int kRowLanes = 8;
constexpr int kRowThreads = 256;
template <int HeadDim>
constexpr int row_vec_elems() { return HeadDim % (kRowLanes * 8) == 0 ? 8 : 4; }

// Measurement switch FA3GEN_BWD_PDL: the main and dQ kernels launch as programmatic dependents
// of the kernel before them (launch_programmatic), so each grid is placed and sets up while the
// one before drains. Each reads what the kernel before it wrote only after
// prerequisite_grid_wait; each lets its dependent be placed from its start. Both are no-ops in
// a kernel launched the usual way. H200 A/B (docs/BENCHMARKS.md): median 0.998x, so off.
__device__ __forceinline__ void prerequisite_grid_wait() {
#ifdef FA3GEN_BWD_PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_grid() {
#ifdef FA3GEN_BWD_PDL
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// D = rowsum(dO * O) in fp32 and LSE in the log2 domain, one query row per 8 threads, and the
// row's share of the fp32 dQ accumulator (and the semaphores) zeroed in the same pass, so the
// caller need not clear the workspace (cuDNN's preprocess does the same). Padding rows and
// rows that saw no key get LSE +inf, which makes their recomputed P exactly 0.
template <class Element, int HeadDim, bool Varlen>
__global__ void __launch_bounds__(kRowThreads) bwd_preprocess_kernel(const BwdRowParams p) {
  allow_dependent_grid();
  constexpr int kVec = row_vec_elems<HeadDim>();
  static_assert(HeadDim % (kRowLanes * kVec) == 0 && HeadDim % (kRowLanes * 4) == 0);
  using Vec = cute::conditional_t<kVec == 8, uint4, uint2>;
  const int64_t row = (int64_t(blockIdx.x) * kRowThreads + threadIdx.x) / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  int64_t in_row, lse_index;  // the row in O and dO (batch 0 when packed) and in lse
  int b, m, head, seqlen_q;
  bool valid;
  if constexpr (Varlen) {
    const int64_t per_head = int64_t(p.q_tiles_padded) * p.tile_m;
    valid = row < per_head * p.heads_q;
    head = int(row / per_head);
    const int pr = int(row % per_head);
    b = seq_of_padded_tile(p.cu_seqlens_q, p.total_q, p.batch, p.tile_m, pr / p.tile_m);
    int offset;
    clamped_range(p.cu_seqlens_q, b, p.total_q, offset, seqlen_q);
    m = pr - padded_tile_start(p.cu_seqlens_q, p.total_q, b, p.tile_m) * p.tile_m;
    in_row = offset + m;
    lse_index = int64_t(head) * p.total_q + in_row;
    b = 0;
  } else {
    valid = row < int64_t(p.batch) * p.heads_q * p.seqlen_q_rounded;
    m = int(row % p.seqlen_q_rounded);
    head = int((row / p.seqlen_q_rounded) % p.heads_q);
    b = int(row / (int64_t(p.seqlen_q_rounded) * p.heads_q));
    seqlen_q = p.seqlen_q;
    in_row = m;
    lse_index = (int64_t(b) * p.heads_q + head) * p.seqlen_q + m;
  }
  float dot = 0.f, lse_log2 = INFINITY;
  if (valid && m < seqlen_q) {
    const Element* o = static_cast<const Element*>(p.o) + b * p.o_batch_stride + in_row * p.o_row_stride + head * p.o_head_stride;
    const Element* dout = static_cast<const Element*>(p.dout) + b * p.do_batch_stride + in_row * p.do_row_stride + head * p.do_head_stride;
    if (p.vector_loads) {
      // Lane l reads vectors l, l + 8, ...: the 8 lanes of a row read contiguous bytes.
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < HeadDim / (kRowLanes * kVec); ++i) {
        const int col = (lane + i * kRowLanes) * kVec;
        Vec ov = *reinterpret_cast<const Vec*>(o + col), dv = *reinterpret_cast<const Vec*>(dout + col);
        const Element* oe = reinterpret_cast<const Element*>(&ov);
        const Element* de = reinterpret_cast<const Element*>(&dv);
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kVec; ++e) dot += float(oe[e]) * float(de[e]);
      }
    } else {
      for (int col = lane; col < HeadDim; col += kRowLanes) dot += float(o[col]) * float(dout[col]);
    }
    const float lse = p.lse[lse_index];
    if (lse != -INFINITY) lse_log2 = lse * 1.4426950408889634f;
  }
  dot = quad_allreduce_sum<kRowLanes>(dot);  // every lane of the warp takes part
  if (!valid) return;
  float4* accum = reinterpret_cast<float4*>(p.dq_accum + row * HeadDim);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < HeadDim / (kRowLanes * 4); ++i) accum[lane + i * kRowLanes] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (lane == 0) {
    p.dsum[row] = dot;
    p.lse_log2[row] = lse_log2;
    if (p.dq_semaphore != nullptr && m % p.tile_m == 0) p.dq_semaphore[row / p.tile_m] = 0;
  }
}

struct BwdDqParams {
  const float* dq_accum;  // (batch, heads_q, m_blocks) tiles of TileM x d floats, dq_slot order
  void* dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int heads_q, seqlen_q, m_blocks;
  float softmax_scale;
  bool vector_stores;     // dq rows are 16-byte aligned
  // Varlen: (heads_q, q_tiles_padded) tiles, one CTA per padded tile; dq packed.
  const int* cu_seqlens_q;
  int batch, total_q, q_tiles_padded;
};

// dQ = softmax_scale * dq_accum, converted to the input dtype in the caller's layout. One CTA
// per (query block, head, batch), one thread per consumer thread of the main kernel: it reads
// that thread's fragment (coalesced 8-byte loads), places it with the dQ TiledMma in a
// row-major shared-memory tile, and the CTA then writes whole rows with 16-byte stores
// (placing it straight into global memory took 3x cuDNN's conversion time).
template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads)
bwd_convert_dq_kernel(const BwdDqParams p) {
  prerequisite_grid_wait();  // dq_accum complete
  using Element = typename Traits::Element;
  constexpr int kTileM = Traits::kTileM, kHeadDim = Traits::kHeadDim, kThreads = Traits::kConsumerThreads;
  // Row stride of the staging tile, as store_staged_rows reads it.
  constexpr int kStride = staged_row_stride<kHeadDim>();
  static_assert(staged_tile_bytes<kTileM, kHeadDim, Element>() <= 48 * 1024, "dQ staging tile exceeds static shared memory");
  __shared__ alignas(16) Element staged[kTileM * kStride];
  const int head = blockIdx.y, tid = threadIdx.x;
  int m_block = blockIdx.x, b = blockIdx.z, seqlen_q = p.seqlen_q;
  int64_t tile_index = dq_tile_index(b, head, p.heads_q, p.m_blocks, m_block), first_row = int64_t(m_block) * kTileM;
  if constexpr (Traits::kVarlen) {  // blockIdx.x is a padded tile of the workspace
    b = seq_of_padded_tile(p.cu_seqlens_q, p.total_q, p.batch, kTileM, int(blockIdx.x));
    int offset;
    clamped_range(p.cu_seqlens_q, b, p.total_q, offset, seqlen_q);
    m_block = int(blockIdx.x) - padded_tile_start(p.cu_seqlens_q, p.total_q, b, kTileM);
    if (m_block * kTileM >= seqlen_q) return;  // a gap between two sequences' tiles
    tile_index = int64_t(head) * p.q_tiles_padded + blockIdx.x;
    first_row = offset + int64_t(m_block) * kTileM;
    b = 0;
  }

  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor acc = partition_fragment_C(mma_dq, typename Traits::DqTileShape{});  // the main kernel's dQ fragment
  const float2* tile = reinterpret_cast<const float2*>(
      p.dq_accum + tile_index * (kTileM * kHeadDim));
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < size(acc) / 2; ++j) {
    const float2 v = tile[dq_slot<Traits>(tid, j)];
    acc(2 * j) = v.x * p.softmax_scale;
    acc(2 * j + 1) = v.y * p.softmax_scale;
  }
  Tensor frag = convert_fragment<Element>(acc);
  if constexpr (Traits::kDqTransposed) {  // (d, query): neighbouring elements are two query rows
    Tensor coords = thr_dq.partition_C(make_identity_tensor(typename Traits::DqTileShape{}));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(frag); ++i) { staged[get<1>(coords(i)) * kStride + get<0>(coords(i))] = frag(i); }
  } else {
    stage_fragment_rows<kTileM, kHeadDim>(thr_dq, frag, staged);
  }
  __syncthreads();

  const int rows = min(kTileM, seqlen_q - m_block * kTileM);
  Element* dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + head * p.dq_head_stride +
                first_row * p.dq_row_stride;
  if (p.vector_stores) {
    store_staged_rows<kTileM, kHeadDim, kThreads>(staged, dq, p.dq_row_stride, rows, tid);
  } else {
    for (int i = tid; i < rows * kHeadDim; i += kThreads) {
      dq[(i / kHeadDim) * p.dq_row_stride + i % kHeadDim] = staged[(i / kHeadDim) * kStride + i % kHeadDim];
    }
  }
}

}  // namespace fa3gen
