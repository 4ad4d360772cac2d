// Host-side helpers shared by the forward and backward launchers.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>
#include "fa3gen_abi.h"

namespace fa3gen {

// Records a CUDA error for fa3gen_last_error() and returns a nonzero code.
inline int report(const char* what, cudaError_t err) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
  fa3gen_set_error(buf);
  return int(err) == 0 ? 1 : int(err);
}

// True when `ptr` and the three strides (in elements of E) allow `elems`-element vector
// accesses: the pointer aligned to the vector, every stride a multiple of it.
template <class E>
inline bool vec_aligned(const void* ptr, int64_t batch_stride, int64_t row_stride, int64_t head_stride, int elems) {
  return reinterpret_cast<uintptr_t>(ptr) % (elems * sizeof(E)) == 0 && batch_stride % elems == 0 &&
         row_stride % elems == 0 && head_stride % elems == 0;
}

// Returns nonzero (with a message) unless the problem sizes fit the variant.
inline int check_sizes(int built_head_dim, int head_dim, int batch, int seqlen_q, int seqlen_k,
                       int heads_q, int heads_kv) {
  char buf[160];
  if (head_dim != built_head_dim) {
    std::snprintf(buf, sizeof(buf), "variant built for head_dim %d called with head_dim %d", built_head_dim, head_dim);
    fa3gen_set_error(buf);
    return 1;
  }
  if (batch < 1 || seqlen_q < 1 || seqlen_k < 1 || heads_kv < 1 || heads_q % heads_kv != 0) {
    fa3gen_set_error("invalid sizes: need batch, seqlens, heads >= 1 and heads_q % heads_kv == 0");
    return 1;
  }
  return 0;
}

}  // namespace fa3gen
