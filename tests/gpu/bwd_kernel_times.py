"""Where a backward call's GPU time goes, per kernel: fa3gen's preprocess (D, LSE, zeroed dQ
accumulator), main kernel and dQ conversion, beside FA4's and cuDNN's (through SDPA) kernels
when they are there, timed by torch.profiler over repeated backward calls on one saved
forward (torch.autograd.grad with retain_graph), bf16, batch x seqlen = 16k tokens, hidden
2048, as `fa3gen bench`.

    python3 tests/gpu/bwd_kernel_times.py --head-dims 64 128 --seqlens 1024 4096 16384 \
        [--causal both] [--settle-ms 200] [--json times.json]

Each kernel is put in a phase by its name (pre: names with "preprocess" or "dot_do_o";
post: "convert", "postprocess"; main: the longest of the rest; other: the rest, such as a
copy of dout or a zero-fill), and each phase's time is the
median over the calls of its summed kernel time in that call. Not a pytest module; the
numbers are GPU time per kernel, not the sustained rate of `fa3gen bench` (a profiled run
is neither power-settled nor interleaved), so read the shares, not the totals.
"""

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_varlen import CAUSALS  # noqa: E402

from fa3gen import bench  # noqa: E402
from fa3gen.ops import flash_attn_func  # noqa: E402

PHASES = {"pre": ("preprocess", "dot_do_o"), "post": ("convert", "postprocess")}


def phase_of(kernel_name: str) -> str:
    low = kernel_name.lower()
    return next((ph for ph, keys in PHASES.items() if any(k in low for k in keys)), "main")


def backends(q, k, v, causal):
    fns = {"fa3gen": lambda: flash_attn_func(q, k, v, causal=causal)}
    peers = bench.peer_forwards(q, k, v, causal)
    fns.update({name: peers[name] for name in ("cudnn", "fa4") if name in peers})
    return fns


def phase_times(forward, leaves, calls: int, settle_ms: float) -> dict:
    """{phase: median us per backward call} for the backward of forward()'s output, profiled
    after settle_ms of the same calls unprofiled (the board's clock then is this call's, not
    the previous row's: the first run read causal 1k rows 20% slow right after 16k ones)."""
    out = forward()
    dout = torch.randn_like(out)
    for _ in range(3):  # warm-up: first-call costs, the compile of a CuTe kernel
        torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < settle_ms:
        for _ in range(5):
            torch.autograd.grad(out, leaves, dout, retain_graph=True)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.autograd.grad(out, leaves, dout, retain_graph=True)
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and e.device_time_total > 0), key=lambda e: e.time_range.start)
    per_call = len(events) // calls
    if per_call == 0 or per_call * calls != len(events):
        raise RuntimeError(f"{len(events)} kernel events for {calls} calls: not evenly split")
    sums = {ph: [] for ph in ("pre", "main", "post", "other")}
    names = {ph: set() for ph in sums}
    for c in range(calls):
        acc = dict.fromkeys(sums, 0.0)
        run = events[c * per_call:(c + 1) * per_call]
        rest = [e for e in run if phase_of(e.name) == "main"]
        main_kernel = max(rest, key=lambda e: e.device_time_total) if rest else None
        for e in run:
            ph = phase_of(e.name)
            if ph == "main" and e is not main_kernel:
                ph = "other"  # copies, fills, a varlen tile list: whatever else the call runs
            acc[ph] += e.device_time_total
            names[ph].add(e.name[:80])
        for ph in sums:
            sums[ph].append(acc[ph])
    return {ph: statistics.median(v) for ph, v in sums.items()} | {
        "kernels": {ph: sorted(n) for ph, n in names.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--settle-ms", type=float, default=200.0,
                   help="unprofiled calls of the same backward before each profile (0: none)")
    p.add_argument("--json")
    args = p.parse_args()
    causals = CAUSALS[args.causal]
    rows = []
    for d, causal, s in itertools.product(args.head_dims, causals, args.seqlens):
        h, b = bench.HIDDEN // d, bench.TOTAL_TOKENS // s
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        for name, fwd in backends(q, k, v, causal).items():
            try:
                t = phase_times(fwd, [q, k, v], args.calls, args.settle_ms)
            except Exception as e:  # a peer that fails is a missing column
                print(f"d{d} causal={causal} s={s} {name}: failed: {e!r}"[:300], flush=True)
                continue
            total = t["pre"] + t["main"] + t["post"] + t["other"]
            rows.append(dict(head_dim=d, causal=causal, seqlen=s, backend=name, **t, total=total))
            print(f"d{d} {'causal' if causal else 'nocausal':8s} s={s:6d} {name:7s} pre {t['pre']:7.1f} "
                  f"main {t['main']:8.1f} post {t['post']:6.1f} other {t['other']:6.1f} us  (pre+post {100 * (t['pre'] + t['post']) / total:4.1f}%)",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
