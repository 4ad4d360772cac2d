"""One forward call between cudaProfilerStart/Stop (three warm-up calls before), for ncu with
--profile-from-start off, so fa3gen and FA4 kernels are profiled on the same shape:

    ncu --profile-from-start off --clock-control none --metrics sass__inst_executed_per_opcode \
        --print-metric-instances details --csv --page raw python3 tests/gpu/ncu_one_forward.py fa3gen 128 0 16384

Arguments: backend (fa3gen or fa4), head dim, causal (0/1), seqlen[, dtype: bf16 (default),
fp16 or e4m3 (fa3gen only)[, a variant name (fa3gen only; default: the key's default)]]; batch x seqlen = 16k tokens, heads x head_dim = 2048 (the bench
grid). Not a pytest module. docs/results/
ncu_fwd_d128_vs_fa4.json holds what it gave on 2026-12-01.
"""

import sys

import torch

from fa3gen import bench, timing


def main() -> int:
    which, d, causal, s = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16,
             "e4m3": torch.float8_e4m3fn}[sys.argv[5] if len(sys.argv) > 5 else "bf16"]
    q, k, v = timing.random_inputs(bench.grid([s], [d])[0], dtype, 3)
    kwargs = {}
    if which == "fa4":
        from flash_attn.cute.interface import flash_attn_func
    else:
        from fa3gen import flash_attn_func
        if len(sys.argv) > 6:
            kwargs["variant"] = sys.argv[6]
    for _ in range(3):
        flash_attn_func(q, k, v, causal=causal, **kwargs)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    flash_attn_func(q, k, v, causal=causal, **kwargs)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
