"""One forward call (or with --backward one backward, its forward outside the range) between
cudaProfilerStart/Stop (three warm-up calls before), for ncu with --profile-from-start off, so
fa3gen and FA4 kernels are profiled on the same shape:

    ncu --profile-from-start off --clock-control none --metrics sass__inst_executed_per_opcode \
        --print-metric-instances details --csv --page raw python3 tests/gpu/ncu_one_forward.py fa3gen 128 0 16384

Arguments (and --window W for a sliding window): backend (fa3gen, fa4, or cudnn: cuDNN's fp8 SDPA through cudnn-frontend, e4m3 only), head dim, causal (0/1), seqlen[, dtype: bf16 (default),
fp16 or e4m3 (fa3gen only)[, a variant name (fa3gen only; default: the key's default)]]; batch x seqlen = 16k tokens, heads x head_dim = 2048 (the bench
grid). Not a pytest module. docs/results/
ncu_fwd_d128_vs_fa4.json holds what it gave on 2026-12-01.
"""

import argparse
import sys

import torch

from fa3gen import bench, timing


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("backend", choices=("fa3gen", "fa4", "cudnn"))
    p.add_argument("head_dim", type=int)
    p.add_argument("causal", choices=("0", "1"))
    p.add_argument("seqlen", type=int)
    p.add_argument("dtype", nargs="?", default="bf16", choices=("bf16", "fp16", "e4m3"))
    p.add_argument("variant", nargs="?", help="a fa3gen variant name (default: the key's default)")
    p.add_argument("--backward", action="store_true",
                   help="profile the backward's kernels (inputs require grad; dO is random)")
    p.add_argument("--window", type=int, metavar="W",
                   help="a sliding window (W, 0): with causal 1, bench_features.py's window rows")
    args = p.parse_args()
    if args.backward and args.dtype == "e4m3":
        p.error("--backward: e4m3 is a forward-only dtype")
    if args.backward and args.variant:
        p.error("--backward: the backward runs its key's default; a variant names a forward")
    which, d, causal, s = args.backend, args.head_dim, args.causal == "1", args.seqlen
    if which == "cudnn" and (args.dtype != "e4m3" or args.backward or args.variant):
        p.error("cudnn: the fp8 forward only (dtype e4m3, no variant, no --backward)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn}[args.dtype]
    q, k, v = timing.random_inputs(bench.grid([s], [d])[0], dtype, 3)
    kwargs = {}
    if args.window is not None:
        if which == "cudnn" or args.window < 0:
            p.error("--window: W >= 0, fa3gen or fa4")
        kwargs["window_size"] = (args.window, 0)
    if which == "cudnn":
        graph = bench.cudnn_fp8_graph(q, k, v, causal)
        if graph is None:
            p.error("cudnn: cudnn-frontend does not import")
        run_cudnn, cudnn_out = graph

        def flash_attn_func(q, k, v, causal):
            run_cudnn()
            return cudnn_out
    elif which == "fa4":
        from flash_attn.cute.interface import flash_attn_func
    else:
        from fa3gen import flash_attn_func
        if args.variant:
            kwargs["variant"] = args.variant
    if args.backward:
        for t in (q, k, v):
            t.requires_grad_(True)
        d_out = torch.randn_like(q)

    def forward():
        out = flash_attn_func(q, k, v, causal=causal, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)

    for _ in range(3):
        out = forward()
        if args.backward:
            torch.autograd.grad(out, (q, k, v), d_out)
    if args.backward:
        out = forward()  # outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    if args.backward:
        torch.autograd.grad(out, (q, k, v), d_out)
    else:
        forward()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
