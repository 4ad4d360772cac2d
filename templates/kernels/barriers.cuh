// Named barriers of both kernels in one place. CUTLASS reserves hardware barriers 0-7
// (0 is __syncthreads); these ids are its user ids 0-7 (hardware 8-15). Ids are compile-time
// immediates: a run-time id costs a register and makes ptxas reserve all 16.
#pragma once
#include <cutlass/arch/barrier.h>

namespace fa3gen {

enum class BarrierId : uint32_t {
  // Forward. Pingpong: consumer warpgroup w waits on kFwdTurn0 + w for its turn to issue GEMMs.
  kFwdTurn0 = 0,
  kFwdTurn1 = 1,
  kFwdTurn2 = 2,
  kFwdQFree = 3,     // no producer warpgroup: every consumer is done with the previous tile's Q
  // fp8: the producer warpgroup has transposed a raw V slot (ids are per kernel, so the
  // forward may reuse a backward id).
  kFwdVTransposed = 4,
  // varlen: the consumers have zeroed the V rows past the sequence (fwd_mainloop.cuh).
  kFwdVTail = 5,
  // Two consumer warpgroups without pingpong or the overlap: once a block, half a
  // block apart (fwd_mainloop.cuh, kStagger).
  kFwdStagger = 6,
  // o_tma_store (16-bit forwards without varlen, where 4 and 5 are otherwise unused, and 6
  // too with three consumer warpgroups, which never stagger): consumer warpgroup w's threads
  // have written its O rows to shared memory (fwd_epilogue.cuh).
  kFwdOStored0 = 4,
  // Backward. kDqPerWg (bwd_traits.cuh): consumer warpgroup w hands its own slice of dQ to
  // the writer warp on kBwdDqFull0 + w and waits for it to be read on kBwdDqEmpty0 + w.
  kBwdDqFull0 = 0,
  kBwdDqFull1 = 1,
  kBwdDqEmpty0 = 2,
  kBwdDqEmpty1 = 3,
  kBwdDsReady = 4,   // consumers: every warpgroup's part of dS is in shared memory
  kBwdDqFull = 5,    // consumers -> dQ writer: the query block's dQ is in shared memory
  kBwdDqEmpty = 6,   // dQ writer -> consumers: the dQ buffer has been read
  kBwdStaged = 7,    // consumers: dK and dV are staged in shared memory
};
static_assert(uint32_t(BarrierId::kBwdStaged) + uint32_t(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier) < 16,
              "the hardware has 16 named barriers");

template <BarrierId Id>
__device__ __forceinline__ void barrier_sync(int threads) {
  cutlass::arch::NamedBarrier::sync(threads, static_cast<uint32_t>(Id));
}
template <BarrierId Id>
__device__ __forceinline__ void barrier_arrive(int threads) {
  cutlass::arch::NamedBarrier::arrive(threads, static_cast<uint32_t>(Id));
}
// A run-time id from First + offset (offset warp-uniform), for the forward's GEMM turns: one
// BAR with a register id instead of branches to one of three immediates (d128 128x176's
// steady-state loop: 838 -> 816 instructions, 7 WARPSYNC and 4 BAR fewer; ptxas then reserves
// all 16 barriers, which costs nothing at one CTA per SM).
template <BarrierId First>
__device__ __forceinline__ void barrier_sync_at(int offset, int threads) {
  cutlass::arch::NamedBarrier::sync(threads, static_cast<uint32_t>(First) + offset);
}
template <BarrierId First>
__device__ __forceinline__ void barrier_arrive_at(int offset, int threads) {
  cutlass::arch::NamedBarrier::arrive(threads, static_cast<uint32_t>(First) + offset);
}

// bar.red.popc on a named barrier: waits like barrier_sync and returns how many of the
// threads gave pred = true, a value the compiler cannot know (the fp8 stagger orders
// arithmetic against the barrier through it).
template <BarrierId Id>
__device__ __forceinline__ int barrier_sync_popc(int threads, bool pred) {
  constexpr uint32_t kId = static_cast<uint32_t>(Id) + uint32_t(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier);
  int count;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n bar.red.popc.u32 %0, %1, %3, p;\n}"
               : "=r"(count) : "n"(kId), "r"(int(pred)), "r"(threads) : "memory");
  return count;
}

}  // namespace fa3gen
