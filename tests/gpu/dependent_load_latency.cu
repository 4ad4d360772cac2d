// How long a kernel's first loads from L2 take after its griddepcontrol.wait: data its
// programmatic primary just wrote against data written long before, plain / .cg / .wt stores,
// plain / .cg / .lu loads, launched as a programmatic dependent or not (%globaltimer, per CTA:
// 32 CTAs x 128 threads, 8 loads of 16 bytes each, the decode combine's pattern). Not a test:
//   nvcc -arch=sm_90a -O3 -o /tmp/dependent_load_latency tests/gpu/dependent_load_latency.cu && /tmp/dependent_load_latency
// docs/BENCHMARKS.md, "The combine started on flags instead of the split grid's end".
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
__device__ __forceinline__ unsigned long long now() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
// 256 CTAs x 128 threads, 16 B each: 512 KB.
__global__ void writer(float4* buf, int mode, int pdl) {
  if (pdl) { asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;"); }
  // some work so the grid lasts a few us
  float x = threadIdx.x;
  for (int i = 0; i < 2000; ++i) x = x * 0.999f + 1.f;
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const float4 v = make_float4(x, x, x, x);
  if (mode == 0) buf[i] = v;
  else if (mode == 1) __stcg(buf + i, v);
  else __stwt(buf + i, v);
}
// 32 CTAs x 128 threads, each loads 8 x 16 B (a "combine" row's partials) from buf.
__global__ void reader(const float4* buf, size_t offset, unsigned long long* times, float* sink, int mode, int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  const unsigned long long t1 = now();
  if (pdl) asm volatile("griddepcontrol.launch_dependents;");
  const float4* p = buf + offset + size_t(blockIdx.x) * 1024 + threadIdx.x;
  float4 v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = mode == 0 ? p[j * 128] : mode == 1 ? __ldcg(p + j * 128) : __ldlu(p + j * 128);
  float s = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += v[j].x + v[j].w;
  __syncthreads();
  const unsigned long long t2 = now();
  if (s == 12345.f) sink[0] = s;
  if (threadIdx.x == 0) times[blockIdx.x] = t2 - t1;
}
int main() {
  float4* buf; cudaMalloc(&buf, 64 << 20);
  unsigned long long* times; cudaMalloc(&times, 32 * 8);
  float* sink; cudaMalloc(&sink, 4);
  cudaStream_t s; cudaStreamCreate(&s);
  auto launch = [&](void* fn, dim3 g, dim3 b, void** args, int pdl) {
    cudaLaunchAttribute a[1]; a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; a[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t c = {}; c.gridDim = g; c.blockDim = b; c.stream = s; c.attrs = a; c.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelExC(&c, fn, args);
  };
  for (int wmode = 0; wmode < 3; ++wmode)
  for (int rmode = 0; rmode < 3; ++rmode)
  for (int fresh = 0; fresh < 2; ++fresh)
  for (int pdl = 0; pdl < 2; ++pdl) {
    // fresh = 1: read what the writer just wrote; 0: a region written long ago (offset 32 MB)
    size_t offset = fresh ? 0 : (32u << 20) / 16;
    std::vector<double> wait_to_loads;
    for (int it = 0; it < 200; ++it) {
      int w = wmode, r = rmode, p = pdl; float4* b = buf; size_t off = offset; unsigned long long* t = times; float* sk = sink;
      void* wa[] = {&b, &w, &p};
      launch((void*)writer, dim3(256), dim3(128), wa, p);
      void* ra[] = {&b, &off, &t, &sk, &r, &p};
      launch((void*)reader, dim3(32), dim3(128), ra, p);
      if (it % 20 == 19) {
        cudaStreamSynchronize(s);
        unsigned long long h[32]; cudaMemcpy(h, times, sizeof h, cudaMemcpyDeviceToHost);
        for (int c = 0; c < 32; ++c) wait_to_loads.push_back(h[c] * 1e-3);
      }
    }
    std::sort(wait_to_loads.begin(), wait_to_loads.end());
    printf("store %s load %s %s pdl %d: release->loads in us p10 %.2f median %.2f p90 %.2f\n",
           wmode == 0 ? "st   " : wmode == 1 ? "st.cg" : "st.wt", rmode == 0 ? "ld   " : rmode == 1 ? "ld.cg" : "ld.lu",
           fresh ? "just written" : "old data    ", pdl,
           wait_to_loads[wait_to_loads.size() / 10], wait_to_loads[wait_to_loads.size() / 2], wait_to_loads[wait_to_loads.size() * 9 / 10]);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
