// MUFU.EX2 results per clock per SM (ex2.approx.ftz.f32, 8 independent chains per thread, one
// CTA per SM, clock64 of CTA 0), alone and with 1-4 FFMAs per exp2 between, for 1-8 warps per
// scheduler. Not a test:
//   nvcc -arch=sm_90a -O3 -o /tmp/mufu_rate tests/gpu/mufu_rate.cu && /tmp/mufu_rate
// docs/BENCHMARKS.md, "cuDNN's fp8 schedule": 16 a clock from two warps a scheduler on, and
// FFMAs beside them cost nothing.
#include <cstdio>
#include <cuda_runtime.h>
template <int kFfmaPerEx2>
__global__ void ex2_loop(float* out, int iters, long long* cycles) {
  float x[8];
  for (int i = 0; i < 8; ++i) x[i] = threadIdx.x * 1e-3f + i * 1e-4f;
  float y = 0.f;
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float v;
      asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(v) : "f"(x[i]));
      x[i] = v * -0.5f;
#pragma unroll
      for (int f = 0; f < kFfmaPerEx2; ++f) y = fmaf(y, 0.999f, v);
    }
  }
  long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  float s = y;
  for (int i = 0; i < 8; ++i) s += x[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
template <int F>
void run(int threads) {
  int sms = 132, iters = 20000;
  float* out; long long* cyc;
  cudaMalloc(&out, sms * threads * 4); cudaMalloc(&cyc, sms * 8);
  ex2_loop<F><<<sms, threads>>>(out, 100, cyc);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  cudaEventRecord(a);
  ex2_loop<F><<<sms, threads>>>(out, iters, cyc);
  cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  long long c[132]; cudaMemcpy(c, cyc, sms * 8, cudaMemcpyDeviceToHost);
  double ex2 = double(threads) * iters * 8;  // per SM
  printf("threads %4d ffma/ex2 %d: %.2f ex2/clk/SM (clock64), %.3f ms, implied %.0f MHz\n", threads, F,
         ex2 / c[0], ms, c[0] / (ms * 1e3));
  cudaFree(out); cudaFree(cyc);
}
int main() {
  run<0>(128); run<0>(256); run<0>(512); run<0>(1024);
  run<1>(512); run<2>(512); run<3>(512); run<4>(1024);
  return 0;
}
