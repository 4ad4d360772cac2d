"""Kernel time per call of fa3gen's forward beside cuDNN's (PyTorch SDPA's cuDNN backend) and FA4's
(when flash_attn.cute imports), from
torch.profiler: the kernels each backend launches (name, grid, block, shared memory, registers)
and their summed duration per call, over back-to-back calls after a warm-up. A burst (5-15%
above the sustained A/B of the same kernels on a power-capped H100) but GPU time only, the same
way for all,
and it names the kernel a peer chose, which the bench does not:

    python3 tests/gpu/kernel_times.py --shapes 64:1:512 64:1:1024 64:0:512 --json times.json

Shapes are head_dim:causal:seqlen on the bench grid (batch x seqlen = 16k tokens, heads x
head_dim = 2048), bf16 or --dtype fp16. `--one BACKEND` instead makes a few calls of one
backend on the first shape and nothing else, for ncu to pick a launch:

    ncu --clock-control none -k regex:fwd_kernel --launch-skip 5 --launch-count 1 \\
        --section WarpStateStats python3 tests/gpu/kernel_times.py --one fa3gen --shapes 64:1:512
    (cuDNN's kernels: -k regex:cudnn_generated ... --one cudnn)

The forward-only sibling of bwd_kernel_times.py, which splits a backward call by kernel.

Not a pytest module; fa3gen runs its key's default from the library runtime.get_library finds.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fa3gen import bench  # noqa: E402

BACKENDS = ("fa3gen", "cudnn", "fa4")  # fa4: when flash_attn.cute imports


def shape_arg(text: str) -> tuple[int, bool, int]:
    try:
        d, causal, s = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected head_dim:causal:seqlen, e.g. 64:1:512") from None
    if d <= 0 or causal not in (0, 1) or s <= 0 or bench.TOTAL_TOKENS % s or bench.HIDDEN % d:
        raise argparse.ArgumentTypeError(f"{text!r}: seqlen must divide 16384, head_dim 2048, causal be 0 or 1")
    return d, bool(causal), s


def calls(d: int, causal: bool, s: int, dtype) -> tuple[dict, float]:
    """One call of each backend on the shape (fa3gen; cuDNN through SDPA; FA4 when it imports),
    and its FLOPs (the bench's count)."""
    from fa3gen.ops import flash_attn_func

    shape = bench.grid([s], [d])[0]
    b, h = shape["batch"], shape["heads"]
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    peers = bench.peer_forwards(q, k, v, causal)
    fns = {"fa3gen": lambda: flash_attn_func(q, k, v, causal=causal)}
    fns.update({name: peers[name] for name in BACKENDS[1:] if name in peers})
    return fns, bench.attention_flops(b, h, s, s, d, causal)


def kernel_time(fn, n: int) -> tuple[float, list]:
    """Summed kernel microseconds per call over n profiled calls, and the kernels seen."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    kernels = sorted({(e["name"], str(e["args"].get("grid")), str(e["args"].get("block")),
                       e["args"].get("shared memory"), e["args"].get("registers per thread")) for e in events})
    return sum(e["dur"] for e in events) / n, [dict(zip(("name", "grid", "block", "smem", "regs"), k)) for k in kernels]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=shape_arg, nargs="+", default=[(64, True, 512)],
                   help="head_dim:causal:seqlen (default 64:1:512)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--calls", type=int, default=20, help="profiled calls a backend and shape (default 20)")
    p.add_argument("--one", choices=BACKENDS, help="only a few calls of this backend (for ncu)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("kernel_times.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.one:
        fns = calls(*args.shapes[0], dtype)[0]
        if args.one not in fns:
            print(f"kernel_times.py: {args.one} is not available here", file=sys.stderr)
            return 2
        fn = fns[args.one]
        for _ in range(8):
            fn()
        torch.cuda.synchronize()
        return 0
    rows = []
    for d, causal, s in args.shapes:
        fns, flops = calls(d, causal, s, dtype)
        for backend, fn in fns.items():
            for _ in range(args.calls):  # warm-up: first-call set-up, clocks
                fn()
            torch.cuda.synchronize()
            us, kernels = kernel_time(fn, args.calls)
            row = dict(backend=backend, dtype=args.dtype, head_dim=d, causal=causal, seqlen=s,
                       us_per_call=us, tflops=flops / us / 1e6, kernels=kernels)
            rows.append(row)
            print(f"d{d} {'causal' if causal else 'non-causal'} {s}: {backend} {us:.1f} us a call, "
                  f"{row['tflops']:.0f} TFLOP/s; " + "; ".join(
                      f"{k['name'][:110]} grid {k['grid']} block {k['block']} smem {k['smem']} regs {k['regs']}"
                      for k in kernels), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
