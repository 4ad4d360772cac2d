"""What a plain read of a decode call's bytes costs on this GPU (issue 17's 80%-of-copy target at
64 MB): a streaming read kernel, compiled here with nvcc, timed like bench_kvcache times the
decode kernels (CUDA-graph replays of 20 calls, sustained), over the same sizes; with a second,
tiny kernel after each read (the decode's combine) and with both as programmatic dependents;
and the same shares read by bulk copies (TMA) into a ring of shared memory (--bulk).
Then fa3gen's decode kernels on two layouts of the same bytes: 8 kv heads of one sequence
(a CTA reads 256-byte rows 2 KB apart) against 8 sequences of one kv head (a CTA reads its
rows contiguously).
    python3 tests/gpu/read_roof.py [--out read_roof.json] [--mb 67 537 4295]
Not a pytest module."""
import argparse
import ctypes
import json
import os
import subprocess
import tempfile

import torch

from bench_kvcache import GRAPH_CALLS, MB  # timed as bench_kvcache times the decode
from fa3gen import kvcache, timing

SOURCE = r"""
#include <cuda_runtime.h>
#include <cstdint>
// Each CTA streams a contiguous share of x (16-byte loads, 8 in flight per thread) and folds
// it into one word, written only if it matches a value it never takes (keeps the loads live).
__global__ void __launch_bounds__(256) read_share(const uint4* __restrict__ x, long long n16,
                                                  long long share16, unsigned* out, int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  const long long begin = blockIdx.x * share16, end = begin + share16 < n16 ? begin + share16 : n16;
  unsigned acc = 0;
  for (long long i = begin + threadIdx.x; i < end; i += 8 * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const long long j = i + u * blockDim.x;
      v[u] = j < end ? __ldcs(x + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}
// The same shares read by bulk copies (TMA, cp.async.bulk): one thread of the CTA keeps
// `stages` chunks of `chunk` bytes in flight into shared memory, each on its own mbarrier; the
// CTA folds one 16-byte word per thread of each chunk and frees the slot behind a CTA barrier.
__global__ void __launch_bounds__(128) read_bulk(const char* __restrict__ x, long long bytes, long long share,
                                                 int chunk, int stages, unsigned* out) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) unsigned long long full[8];
  const long long begin = blockIdx.x * share, end = begin + share < bytes ? begin + share : bytes;
  const int chunks = begin < end ? int((end - begin + chunk - 1) / chunk) : 0;
  auto bar = [&](int s) { return static_cast<unsigned>(__cvta_generic_to_shared(&full[s])); };
  auto issue = [&](int c) {
    const int s = c % stages;
    const long long off = begin + (long long)c * chunk;
    const unsigned n = unsigned(end - off < chunk ? end - off : chunk);
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(ring + s * chunk));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar(s)), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(x + off), "r"(n), "r"(bar(s)) : "memory");
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar(s)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int c = 0; c < stages && c < chunks; ++c) issue(c);
  }
  __syncthreads();
  unsigned acc = 0;
  for (int c = 0; c < chunks; ++c) {
    const int s = c % stages;
    const unsigned phase = (c / stages) & 1;
    const long long t0 = clock64();
    for (unsigned done = 0; !done;) {  // a copy that never lands traps instead of hanging the GPU
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(bar(s)), "r"(phase) : "memory");
      if (!done && clock64() - t0 > (1ll << 32)) __trap();
    }
    const uint4 v = reinterpret_cast<const uint4*>(ring + s * chunk)[threadIdx.x % (chunk / 16)];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
    __syncthreads();
    if (threadIdx.x == 0 && c + stages < chunks) issue(c + stages);
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}
// The combine's stand-in: one CTA per output row, a 512-byte store each.
__global__ void tail(unsigned* out, int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = threadIdx.x;
}
static cudaLaunchConfig_t config(dim3 grid, dim3 block, cudaStream_t s, cudaLaunchAttribute* a, int pdl) {
  cudaLaunchConfig_t c = {};
  c.gridDim = grid;
  c.blockDim = block;
  c.stream = s;
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = a;
  c.numAttrs = pdl ? 1 : 0;
  return c;
}
extern "C" int read_call(const void* x, long long bytes, int ctas, unsigned* out, int tail_ctas, int pdl,
                         cudaStream_t s) {
  cudaLaunchAttribute a[1];
  const long long n16 = bytes / 16, share16 = (n16 + ctas - 1) / ctas;
  cudaLaunchConfig_t c = config(dim3(ctas), dim3(256), s, a, pdl);
  if (cudaLaunchKernelEx(&c, read_share, static_cast<const uint4*>(x), n16, share16, out, pdl) != cudaSuccess) return 1;
  if (tail_ctas > 0) {
    c = config(dim3(tail_ctas), dim3(128), s, a, pdl);
    if (cudaLaunchKernelEx(&c, tail, out, pdl) != cudaSuccess) return 2;
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}
extern "C" int read_bulk_call(const void* x, long long bytes, int ctas, int chunk, int stages, unsigned* out,
                              cudaStream_t s) {
  bytes &= ~15ll;  // bulk copies move multiples of 16 bytes (the loads drop the same tail)
  const long long share = ((bytes + ctas - 1) / ctas + 15) / 16 * 16;
  const int smem = chunk * stages;
  if (stages > 8 || chunk % 16) return 4;
  if (cudaFuncSetAttribute(read_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 5;
  read_bulk<<<ctas, 128, smem, s>>>(static_cast<const char*>(x), bytes, share, chunk, stages, out);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}
"""


def _compile(workdir: str):
    src, so = os.path.join(workdir, "read_roof.cu"), os.path.join(workdir, "read_roof.so")
    with open(src, "w") as f:
        f.write(SOURCE)
    subprocess.run(["nvcc", "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-o", so, src], check=True)
    lib = ctypes.CDLL(so)
    lib.read_call.restype = ctypes.c_int
    lib.read_call.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                              ctypes.c_int, ctypes.c_void_p]
    lib.read_bulk_call.restype = ctypes.c_int
    lib.read_bulk_call.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_void_p]
    return lib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--mb", type=float, nargs="+", default=[67.1, 537.0, 4295.0], help="bytes read per call")
    ap.add_argument("--min-ms", type=float, default=50)
    ap.add_argument("--no-decode", action="store_true", help="the read kernels only")
    ap.add_argument("--no-read", action="store_true", help="the decode layouts only")
    ap.add_argument("--bulk", nargs="*", default=[(2, 16384, 4), (3, 16384, 4), (4, 8192, 4), (1, 32768, 6), (2, 32768, 3)],
                    type=lambda t: tuple(int(v) for v in t.split(",")), metavar="CTAS_PER_SM,CHUNK,STAGES",
                    help="bulk-copy (TMA) readers to time beside the loads (CTAs per SM, chunk bytes, stages)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbs = timing.copy_roof_gbs()
    print(f"device copy: {copy_gbs:.0f} GB/s")
    result = {"copy_gbs": round(copy_gbs), "read": [], "decode": []}
    out = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    with tempfile.TemporaryDirectory() as workdir:
        lib = _compile(workdir)
        for mb in ([] if args.no_read else args.mb):
            x = torch.empty(int(mb * MB), dtype=torch.uint8, device="cuda").fill_(1)
            variants = [(ctas, 0, 0) for ctas in (sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms)]
            variants += [(2 * sms, 32, 0), (2 * sms, 32, 1), (8 * sms, 32, 1)]
            # bulk copies: (CTAs, chunk bytes, stages), kind "bulk"; the loads' rows have bulk 0
            bulk = args.bulk
            fns = []
            for ctas, tail_ctas, pdl in variants:
                def call(ctas=ctas, tail_ctas=tail_ctas, pdl=pdl):
                    rc = lib.read_call(x.data_ptr(), x.numel(), ctas, out.data_ptr(), tail_ctas, pdl,
                                       ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                    if rc:
                        raise RuntimeError(f"read_call failed ({rc})")
                fns.append(timing.graph_replay(call, GRAPH_CALLS))
            for mult, chunk, stages in bulk:
                def call_bulk(ctas=mult * sms, chunk=chunk, stages=stages):
                    rc = lib.read_bulk_call(x.data_ptr(), x.numel(), ctas, chunk, stages, out.data_ptr(),
                                            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                    if rc:
                        raise RuntimeError(f"read_bulk_call failed ({rc})")
                fns.append(timing.graph_replay(call_bulk, GRAPH_CALLS))
            ms = timing.sustained_ms(fns, 2, args.min_ms, order="shuffle")
            rows = [dict(ctas=c, tail_ctas=t, pdl=p, bulk=0) for c, t, p in variants]
            rows += [dict(ctas=m * sms, tail_ctas=0, pdl=0, bulk=1, chunk=ch, stages=st) for m, ch, st in bulk]
            for row, m in zip(rows, ms):
                us = m * 1e3 / GRAPH_CALLS
                row.update(mb=mb, us=round(us, 2), pct_of_copy=round(mb * MB / (us * 1e-6) / 1e9 / copy_gbs * 100, 1))
                result["read"].append(row)
                how = (f"bulk {row['chunk']} B x {row['stages']}" if row["bulk"]
                       else f"tail {row['tail_ctas']}, pdl {row['pdl']}")
                print(f"read {mb:.0f} MB, {row['ctas']} CTAs, {how}: {us:.2f} us ({row['pct_of_copy']:.0f}% of copy)")
            del x
    # fa3gen's decode on two layouts of the same bytes: (seqlen_q, heads_q, heads_kv, batch, keys).
    d = 128
    layouts = [] if args.no_decode else [(1, 32, 8, 1, 16384), (1, 4, 1, 8, 16384), (1, 32, 32, 1, 4096), (1, 1, 1, 32, 4096),
               (4, 32, 8, 1, 16384), (4, 4, 1, 8, 16384), (1, 32, 8, 64, 16384), (1, 4, 1, 512, 16384)]
    fns, sizes, alive = [], [], []  # alive: the graphs read these tensors
    for sq, hq, hkv, b, n in layouts:
        g = torch.Generator(device="cuda").manual_seed(n + b)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kc = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        alive.append((q, kc, vc, seqlens))
        fns.append(timing.graph_replay(lambda q=q, kc=kc, vc=vc, s=seqlens: kvcache.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=s), GRAPH_CALLS))
        sizes.append(2 * kc.numel() * 2 + 2 * q.numel() * 2)
    ms = timing.sustained_ms(fns, 2, args.min_ms, order="shuffle") if fns else []
    for (sq, hq, hkv, b, n), m, moved in zip(layouts, ms, sizes):
        us = m * 1e3 / GRAPH_CALLS
        row = {"seqlen_q": sq, "heads_q": hq, "heads_kv": hkv, "batch": b, "cache_len": n,
               "splits": kvcache.num_splits_heuristic(b, hkv, n, sms, d), "mb": round(moved / MB, 1),
               "us": round(us, 2), "pct_of_copy": round(moved / (us * 1e-6) / 1e9 / copy_gbs * 100, 1)}
        result["decode"].append(row)
        print(f"decode sq={sq} hq={hq} hkv={hkv} b={b} n={n} ({row['mb']:.0f} MB, {row['splits']} splits): "
              f"{us:.2f} us ({row['pct_of_copy']:.0f}% of copy)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
