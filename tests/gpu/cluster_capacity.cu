// How many thread-block clusters of 1 to 16 CTAs an H100/H200 holds at once
// (cudaOccupancyMaxActiveClusters), for the decode split kernel's shapes: one CTA an SM by
// shared memory (203-222 KB, 128-384 threads) and two (100 KB, 128 threads). Not a test:
//   nvcc -arch=sm_90a -o /tmp/cluster_capacity tests/gpu/cluster_capacity.cu && /tmp/cluster_capacity
// docs/BENCHMARKS.md, "The splits of a kv head as one cluster, no combine kernel".
#include <cstdio>
#include <cuda_runtime.h>
__global__ void k(int* x) { extern __shared__ int s[]; if (x) x[0] = s[threadIdx.x]; }
int main() {
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  printf("SMs %d smem/SM %zu optin %zu\n", prop.multiProcessorCount, prop.sharedMemPerMultiprocessor, prop.sharedMemPerBlockOptin);
  // (threads, dynamic shared memory): one CTA an SM at 203-222 KB, two at 100 KB.
  const int shapes[4][2] = {{384, 203072}, {256, 209216}, {128, 222016}, {128, 102400}};
  cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  for (auto& sh : shapes) {
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sh[1]);
    printf("threads %d smem %d:", sh[0], sh[1]);
    for (int c = 1; c <= 16; ++c) {
      cudaLaunchConfig_t cfg = {}; cudaLaunchAttribute a[1];
      a[0].id = cudaLaunchAttributeClusterDimension; a[0].val.clusterDim.x = c; a[0].val.clusterDim.y = 1; a[0].val.clusterDim.z = 1;
      cfg.gridDim = dim3(c * 16); cfg.blockDim = dim3(sh[0]); cfg.dynamicSmemBytes = sh[1]; cfg.attrs = a; cfg.numAttrs = 1;
      int n = -1; cudaError_t e = cudaOccupancyMaxActiveClusters(&n, k, &cfg);
      printf(" C%d=%d%s", c, n, e ? "(err)" : "");
    }
    printf("\n");
  }
}
