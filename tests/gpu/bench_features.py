"""Sliding-window and softcap attention: fa3gen beside FA4 (flash_attn.cute, when it imports)
in one process, measured sustained (fa3gen.timing.sustained_ms: rounds of back-to-back
launches of at least --min-ms each, backends alternating with the order rotated, each settled
first, median).

    python3 tests/gpu/bench_features.py --json features.json

Not a pytest module. Rows (bf16, hidden 2048: heads = 2048 / head_dim):
  window:  causal, seqlen 16k, batch 1, window (w, 0) for w in --windows, and the dense causal
           row beside them (w = -1); d64/d128/d256, forward and backward (autograd).
  softcap: causal, cap 30 and none, seqlen 4k (batch 4) and 16k (batch 1); d128/d256, forward
           and backward.
  --head-dims 192 adds both kinds at d192, which specs/h100.yaml builds without window or
  softcap: point FA3GEN_LIB at a library that has d192's dense and feature variants.
TFLOP/s count only visible (query, key) pairs: 4 * head_dim FLOPs per pair forward, 2.5x that
backward. So a window's rate is comparable with the dense causal rate: a kernel whose time
grows with the window, not with seqlen, keeps the same rate.
"""

import argparse
import json
import sys

import torch

from fa3gen import bench, runtime, timing
from fa3gen.ops import flash_attn_func
from sustained_backends import measure


HEAD_DIMS = (64, 128, 192, 256)  # the window rows' head dims (softcap rows: 128 and up)


def visible_pairs(seqlen: int, left: int, right: int = 0) -> int:
    """(query, key) pairs of seqlen x seqlen that window (left, right) shows, -1 unbounded:
    query i sees keys [i - left, i + right]; right 0 is causal."""
    i = torch.arange(seqlen, dtype=torch.int64)
    last = (i + right).clamp(max=seqlen - 1) if right >= 0 else torch.full_like(i, seqlen - 1)
    first = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    return int((last - first + 1).clamp(min=0).sum())


def backends():
    out = {"fa3gen": lambda q, k, v, window, cap: flash_attn_func(
        q, k, v, causal=True, window_size=window, softcap=cap)}
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4

        def fa4_call(q, k, v, window, cap):
            kw = {"causal": True, "softcap": cap}
            if window != (-1, -1):
                kw["window_size"] = window
            o = fa4(q, k, v, **kw)
            return o[0] if isinstance(o, tuple) else o
        out["fa4"] = fa4_call
    except Exception as e:  # an optional column
        print(f"FA4 unavailable: {e!r}"[:300], file=sys.stderr)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--softcap", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-ms", type=float, default=100.0)
    p.add_argument("--kinds", nargs="+", default=["window", "softcap"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256], choices=HEAD_DIMS,
                   help="which of the head dims with rows to time")
    p.add_argument("--directions", nargs="+", default=["fwd", "bwd"])
    p.add_argument("--json")
    args = p.parse_args()
    fns = backends()
    points = []  # (kind, direction, head_dim, seqlen, batch, window left, cap)
    for d in HEAD_DIMS:
        for direction in ("fwd", "bwd"):
            for w in [-1, *args.windows]:
                points.append(("window", direction, d, 16384, 1, w, 0.0))
    for d in (128, 192, 256):
        for direction in ("fwd", "bwd"):
            for s in (4096, 16384):
                for cap in (0.0, args.softcap):
                    points.append(("softcap", direction, d, s, 16384 // s, -1, cap))
    points = [pt for pt in points if pt[0] in args.kinds and pt[1] in args.directions
              and pt[2] in args.head_dims]
    rows = []
    print("| kind | dir | d | seqlen | window | softcap | fa3gen TFLOP/s | FA4 TFLOP/s | fa3gen / FA4 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, direction, d, s, b, w, cap in points:
        h = 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=direction == "bwd") for _ in range(3))
        window = (w, 0) if w >= 0 else (-1, -1)
        calls = {n: (lambda f=f: f(q, k, v, window, cap), (q, k, v)) for n, f in fns.items()}
        res = measure(calls, direction, args.rounds, args.min_ms)
        flops = 4 * d * h * b * visible_pairs(s, w) * (2.5 if direction == "bwd" else 1.0)
        row = dict(kind=kind, direction=direction, head_dim=d, seqlen=s, batch=b, heads=h,
                   window=list(window), softcap=cap, flops=flops)
        for name, val in res.items():
            if isinstance(val, float):
                row[f"{name}_ms"], row[f"{name}_tflops"] = val, timing.tflops(flops, val)
            else:
                row[f"{name}_error"] = val
        rows.append(row)
        a, f4 = row.get("fa3gen_tflops"), row.get("fa4_tflops")
        ratio = f"{a / f4:.2f}" if a and f4 else "-"
        print(f"| {kind} | {direction} | {d} | {s} | {window} | {cap:g} | "
              f"{a and round(a) or row.get('fa3gen_error', '-')} | "
              f"{f4 and round(f4) or row.get('fa4_error', '-')} | {ratio} |", flush=True)
        del q, k, v
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": bench.provenance(runtime.get_library()), "rounds": args.rounds, "min_ms": args.min_ms, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
