"""The forward kernel's LSE store, A/B'd in one process against one library: the same call
with return_lse=True (the kernel stores LSE) and without (ABI 16: a null pointer, no store),
sustained (fa3gen.timing.sustained_ms: 5 rounds of at least 100 ms, the two alternating),
bf16, 16k tokens, hidden 2048. One JSON row per point with the per-round ratios' median and
range (the stored call's time over the null one's: above 1, skipping the store is faster).

    python3 tests/gpu/ab_lse_store.py out.json

Not a pytest module."""
import json
import statistics
import sys

import torch

from fa3gen import flash_attn_func
from fa3gen.bench import attention_flops
from fa3gen.timing import sustained_ms


def main(out: str) -> None:
    rows = []
    for d in (64, 128, 256):
        for causal in (False, True):
            for s in (512, 1024, 4096):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                stored = lambda: flash_attn_func(q, k, v, causal=causal, return_lse=True)
                null = lambda: flash_attn_func(q, k, v, causal=causal)
                per_round = []
                ms = sustained_ms([stored, null], rounds=5, min_ms=100, per_round=per_round)
                ratios = [a / b for a, b in zip(*per_round)]
                flops = attention_flops(b, h, s, s, d, causal)
                row = dict(d=d, causal=causal, s=s, tflops_lse=flops / ms[0] / 1e9,
                           tflops_null=flops / ms[1] / 1e9,
                           speedup_median=statistics.median(ratios), speedup_min=min(ratios),
                           speedup_max=max(ratios))
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(out, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
