// The backward's dQ accumulator: its layout, shared by the main kernel (consumers and the dQ
// writer) and the dQ conversion, and the writer's bulk operations.
#pragma once
#include <cstdint>
#include <cute/arch/util.hpp>

namespace fa3gen {

// gmem[0, bytes) += smem[0, bytes) as fp32, asynchronously (TMA bulk reduction, one thread).
__device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Wait until this thread's bulk operations have read their shared memory / fully completed.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_done() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// A consumer thread's dQ fragment lives in shared memory (and in the fp32 accumulator in
// global memory) as [element / 2][thread][2] floats: the accumulator's neighbouring-column
// pairs, stored 8 bytes per thread by consecutive threads (contiguous, no bank conflicts), and
// the bulk reduction is one contiguous block per query block. bwd_convert_dq_kernel maps it
// back to (row, column) with the same TiledMma.
// When dQ is handed over in the query block's own Q and dO stage buffers instead (half of the
// tile each; Traits::kDqInStages, where the warpgroups split head_dim), the order is
// [half][warpgroup][element / 2 within the half][thread of the warpgroup][2], so that each
// warpgroup's share of a half lands on the bytes of its own head_dim columns, which only its
// own (finished) dK / dV GEMMs read.
template <class Traits>
__device__ __forceinline__ int dq_slot(int tid, int chunk) {
  constexpr int kThreads = Traits::kConsumerThreads;
  if constexpr (Traits::kDqInStages) {
    constexpr int kHalf = Traits::kDqChunks / 2;
    const int half = chunk / kHalf, wg = tid / 128;
    return ((half * Traits::kConsumerWGs + wg) * kHalf + chunk % kHalf) * 128 + tid % 128;
  } else if constexpr (Traits::kDqPerWg) {  // [warpgroup][element / 2][thread][2]: a half each
    return ((tid / 128) * Traits::kDqChunks + chunk) * 128 + tid % 128;
  } else {
    return chunk * kThreads + tid;
  }
}
// The accumulator holds one TileM x d tile per (batch, query head, query block), in that order.
__device__ __forceinline__ int64_t dq_tile_index(int b, int head, int heads_q, int m_blocks, int m_block) {
  return (int64_t(b) * heads_q + head) * m_blocks + m_block;
}

__device__ __forceinline__ int load_acquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

}  // namespace fa3gen
