// Host-side helpers shared by the forward and backward launchers.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>
#include <utility>
#include "fa3gen_abi.h"

namespace fa3gen {

// Records a CUDA error for fa3gen_last_error() and returns a nonzero code.
inline int report(const char* what, cudaError_t err) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
  fa3gen_set_error(buf);
  return int(err) == 0 ? 1 : int(err);
}

// Raises a kernel's dynamic shared memory limit to `bytes` once per device: the attribute
// belongs to the function on that device, so every later call skips the driver call (host time
// per call, and nothing but the launch when a CUDA graph captures the call). The flags belong
// to the template instance: Kernel is a distinct function type per variant (its params type);
// kernels that share a signature (the decode kernels) name themselves with a distinct Tag.
template <class Tag = void, class Kernel>
inline cudaError_t set_smem_limit_once(Kernel kernel, int bytes) {
  static std::atomic<uint64_t> done{0};  // bit d: done on device d (d < 64; others every call)
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bit && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

// A launch with one attribute (`attribute` must outlive the launch).
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, int smem_bytes, cudaStream_t stream,
                                        cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// Thread-block clusters of `cluster` CTAs along x.
inline cudaLaunchAttribute cluster_attribute(int cluster) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = unsigned(cluster);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return attribute;
}

// Launches `kernel` as a programmatic dependent of the kernel before it on `stream`: its CTAs
// may be placed once every CTA of that kernel has run griddepcontrol.launch_dependents (or
// exited), and must run griddepcontrol.wait (prerequisite_grid_wait) before they read what
// that kernel writes. Everything launched before that kernel has completed by then.
template <class... Params, class... Args>
inline cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, int smem_bytes,
                                       cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  const cudaLaunchConfig_t config = launch_config(grid, block, smem_bytes, stream, &attribute);
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// How many clusters of `cluster` CTAs of `kernel` (its dynamic shared memory limit already set)
// the device holds at once, asked once per device (0 when the query fails: no cap).
template <class Kernel>
inline int max_active_clusters_once(Kernel kernel, int threads, int smem_bytes, int cluster) {
  static std::atomic<int> fit[64];  // per device: 0 unknown, else the count + 1
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const int known = device < 64 ? fit[device].load(std::memory_order_acquire) : 0;
  if (known > 0) return known - 1;
  cudaLaunchAttribute attribute = cluster_attribute(cluster);
  const cudaLaunchConfig_t config = launch_config(dim3(unsigned(cluster)), dim3(unsigned(threads)), smem_bytes,
                                                  nullptr, &attribute);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: leave no error for the launch to report
    return 0;
  }
  if (device < 64) fit[device].store(n + 1, std::memory_order_release);
  return n;
}

// Launches `kernel` in thread-block clusters of `cluster` CTAs along x (the grid a multiple of it).
template <class... Params, class... Args>
inline cudaError_t launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, int smem_bytes,
                                    cudaStream_t stream, int cluster, Args&&... args) {
  cudaLaunchAttribute attribute = cluster_attribute(cluster);
  const cudaLaunchConfig_t config = launch_config(grid, block, smem_bytes, stream, &attribute);
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
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

// Returns nonzero (with a message) unless the varlen arguments fit the kernels: the tile
// list packs a head and a block in one int (varlen.cuh), its kernel holds the batch in
// shared memory.
inline int check_varlen(int batch, int heads, int blocks_per_seq, int total_q, int total_k, const void* cu_q,
                        const void* cu_k, const void* tile_list) {
  if (cu_q == nullptr || cu_k == nullptr || tile_list == nullptr) {
    fa3gen_set_error("varlen: cu_seqlens_q, cu_seqlens_k and tile_list must be set");
    return 1;
  }
  if (total_q < 0 || total_k < 0) {
    fa3gen_set_error("varlen: total_q and total_k must be >= 0");
    return 1;
  }
  if (batch > FA3GEN_VARLEN_MAX_BATCH || heads > FA3GEN_VARLEN_MAX_HEADS ||
      blocks_per_seq > FA3GEN_VARLEN_MAX_TILES_PER_SEQ) {
    fa3gen_set_error("varlen: at most 16384 sequences, 32767 heads and 65535 tiles per sequence");
    return 1;
  }
  return 0;
}

// The runtime arguments of the local and softcap axes as the kernels take them: window bounds
// with -1 (unbounded) replaced by seqlen_q + seqlen_k, which no row reaches (AttentionMask),
// and the scales of the softmax (softcapping folds softmax_scale into the scores, which become
// tanh(s * softmax_scale / cap), and the cap into the softmax's scale).
struct Masking {
  int window_left = 0, window_right = 0;
  // Local only: the keys a query can see through the window (a side of -1 counts every key;
  // varlen: the packed total), for the forward's grid policy.
  int64_t window_keys = 0;
  float softcap_pre = 0.f;
  float lse_scale = 0.f, scale_log2 = 0.f;
};

// Returns nonzero (with a message) for arguments the variant cannot honour. A window's unbounded
// side must outreach every sequence: with varlen, the totals bound it (max_seqlen is the caller's
// word, and may understate the longest sequence). Args: fa3gen_fwd_params or fa3gen_bwd_params.
template <bool Local, bool Softcap, bool Varlen, class Args>
inline int masking_args(const Args& a, Masking& out) {
  const float softmax_scale = a.softmax_scale, softcap = a.softcap;
  const int32_t window_left = a.window_left, window_right = a.window_right;
  const int seqlen_q = Varlen && Local ? a.total_q : a.seqlen_q;
  const int seqlen_k = Varlen && Local ? a.total_k : a.seqlen_k;
  if (!(softmax_scale > 0.f)) {
    fa3gen_set_error("softmax_scale must be positive");
    return 1;
  }
  if (Local && (window_left < -1 || window_right < -1)) {
    fa3gen_set_error("window_left and window_right must be >= -1 (-1: unbounded)");
    return 1;
  }
  if (Softcap && !(softcap > 0.f)) {
    fa3gen_set_error("a softcap variant needs softcap > 0");
    return 1;
  }
  const int64_t unbounded = int64_t(seqlen_q) + seqlen_k;
  if (unbounded > INT32_MAX / 2) {
    fa3gen_set_error("seqlen_q + seqlen_k too large for one launch");
    return 1;
  }
  auto bound = [&](int32_t w) { return int(w < 0 || w > unbounded ? unbounded : w); };
  if (Local) {
    out.window_left = bound(window_left);
    out.window_right = bound(window_right);
    out.window_keys = std::min<int64_t>(seqlen_k, int64_t(out.window_left) + out.window_right + 1);
  }
  out.lse_scale = softmax_scale;
  if (Softcap) {
    out.softcap_pre = softmax_scale / softcap;
    out.lse_scale = softcap;
  }
  out.scale_log2 = out.lse_scale * 1.4426950408889634f;
  return 0;
}

}  // namespace fa3gen
