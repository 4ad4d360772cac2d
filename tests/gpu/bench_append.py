"""A decode step that appends (flash_attn_with_kvcache with k, v): the append by the library's
kernel (the default, FA3GEN_APPEND_KERNEL=1) against the PyTorch operations (=0), per call: host time (eager
calls back to back, perf_counter, median of rounds) and GPU time (CUDA graph replay), for a
few batch sizes over a contiguous and a paged bf16 cache (8 kv heads, 32 query heads, d128,
4k keys a sequence), without and with the rotary embedding (rotary_dim d, fp32 tables).

    python3 tests/gpu/bench_append.py [--json out.json]

Not a pytest module.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fa3gen import kvcache, runtime, timing  # noqa: E402
from host_time import per_call_us  # noqa: E402


def gpu_us(fn, calls: int = 100, rounds: int = 7) -> float:
    replay = timing.graph_replay(fn, calls)
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not runtime.get_library().has_append_kernel:
        sys.exit("the library has no append kernel: build a spec with `decode:` at this commit")
    rows = []
    for batch in (1, 8, 32):
        for paged in (False, True):
            hkv, hq, d, keys = 8, 32, 128, 4096
            q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(batch, 1, hkv, d, device="cuda", dtype=torch.bfloat16)
            lengths = torch.full((batch,), keys - 8, dtype=torch.int32, device="cuda")
            extra = {}
            if paged:
                shape = (batch * keys // 64, 64, hkv, d)
                extra["block_table"] = torch.arange(batch * keys // 64, dtype=torch.int32,
                                                    device="cuda").view(batch, -1)
            else:
                shape = (batch, keys, hkv, d)
            kc, vc = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            cos, sin = (f(torch.rand(keys, d // 2, device="cuda")) for f in (torch.cos, torch.sin))
            for rotary in (False, True):
                kw = {"rotary_cos": cos, "rotary_sin": sin} if rotary else {}
                step = lambda: kvcache.flash_attn_with_kvcache(
                    q, kc, vc, k, k, cache_seqlens=lengths, causal=True, **extra, **kw)
                row = {"batch": batch, "paged": paged, "rotary": rotary}
                for name, env in (("torch", "0"), ("kernel", "1")):
                    os.environ[kvcache.APPEND_KERNEL_ENV] = env
                    row[f"{name}_host_us"] = round(per_call_us(step, 300, 7), 1)
                    row[f"{name}_gpu_us"] = round(gpu_us(step), 2)
                print(row, flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "decode step with append (and rotary), bf16 d128, 32/8 heads, 4k keys", "gpu":
                       torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
