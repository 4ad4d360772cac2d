"""fa3gen under torch.compile beside the same call in eager mode: TFLOP/s of the forward on
shapes whose key has a seqlen_k range default (specs/h100.yaml), with a third column, the key's
default variant named in an eager call (what compiled calls ran before they resolved by
length). The compiled output must equal the eager one bit for bit.

    python3 tests/gpu/bench_compiled.py [--reverse | --fresh] [--rounds 3] [--json out.json]

16k tokens a shape (batch = 16384 / seqlen), 16 heads, bf16. Each column's time is the
median of --rounds rounds of 100 back-to-back calls (CUDA events; not the sustained
measurement: this compares paths to one kernel, not kernels). --reverse runs the shapes in
the opposite order (a first look at compiled calls slowing down later in a process, seen on
the H200 2026-12-04 (ninth): docs/BENCHMARKS.md); --fresh runs each shape in a process of
its own. The host columns say how long the calls took to issue (the loop's wall time before
the synchronizing event, per call): where that reaches the GPU time, the calls are host-bound.
"graphs" counts the graphs dynamo compiled for the shape (1 unless guards failed). Not a
pytest module.
"""

import argparse
import json
import statistics
import sys

import torch

SHAPES = ((64, True, 512), (64, True, 1024), (128, False, 1024), (128, False, 4096),
          (256, True, 1024))  # (head_dim, causal, seqlen)


HEADER = ("| d | causal | seqlen | eager | compiled | key default (eager) | by length | "
          "host us/call eager / compiled | GPU us/call compiled | graphs |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def fresh(args) -> int:
    """Each shape in a child process of its own (its table row and JSON rows collected)."""
    import os
    import subprocess
    import tempfile

    print(HEADER, flush=True)
    rows = []
    for i in range(len(SHAPES)):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, __file__, "--shape", str(i), "--rounds", str(args.rounds),
                   "--json", out]
            if subprocess.run(cmd).returncode:
                return 1
            with open(out) as fh:
                got = json.load(fh)
        rows += got["rows"]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": got["header"], "fresh": True, "rows": rows}, fh, indent=1)
    return 0


def ms_per_call(fn, calls: int = 100) -> tuple[float, float]:
    """(GPU ms per call between two events, host ms per call to issue them)."""
    from fa3gen.timing import batch_ms_and_host

    for _ in range(5):
        fn()
    return batch_ms_and_host(fn, calls)


def main() -> int:
    ap = argparse.ArgumentParser()
    order = ap.add_mutually_exclusive_group()
    order.add_argument("--reverse", action="store_true")
    order.add_argument("--fresh", action="store_true", help="each shape in a new process")
    ap.add_argument("--shape", type=int, help=argparse.SUPPRESS)  # --fresh's child: SHAPES[i]
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.fresh:
        return fresh(args)
    from fa3gen import flash_attn_func, runtime

    lib = runtime.get_library()
    torch.manual_seed(0)
    rows = []
    if args.shape is None:
        print(HEADER)
    shapes = [SHAPES[args.shape]] if args.shape is not None else (
        SHAPES[::-1] if args.reverse else SHAPES)
    for d, causal, seqlen in shapes:
        batch, heads = 16384 // seqlen, 16
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        key_default = lib.find("fwd", "bf16", d, causal).name
        by_length = lib.find("fwd", "bf16", d, causal, seqlen_k=seqlen).name
        compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=causal),
                                 fullgraph=True)
        fns = {"eager": lambda: flash_attn_func(q, k, v, causal=causal),
               "compiled": lambda: compiled(q, k, v),
               "key default": lambda: flash_attn_func(q, k, v, causal=causal,
                                                      variant=key_default)}
        if not torch.equal(fns["eager"](), fns["compiled"]()):
            print(f"d{d} causal={causal} {seqlen}: compiled output differs from eager",
                  file=sys.stderr)
            return 1
        times = {name: [] for name in fns}
        host = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                gpu_ms, host_ms = ms_per_call(fn)
                times[name].append(gpu_ms)
                host[name].append(host_ms)
        flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
        tflops = {name: flops / (statistics.median(t) * 1e-3) / 1e12 for name, t in times.items()}
        host_us = {name: statistics.median(t) * 1e3 for name, t in host.items()}
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        rows.append(dict(head_dim=d, causal=causal, seqlen=seqlen, by_length=by_length,
                         key_default=key_default, tflops=tflops, host_us_per_call=host_us,
                         gpu_us_per_call={n: statistics.median(t) * 1e3 for n, t in times.items()},
                         graphs=graphs))
        print(f"| {d} | {causal} | {seqlen} | {tflops['eager']:.0f} | {tflops['compiled']:.0f} | "
              f"{tflops['key default']:.0f} | {by_length if by_length != key_default else 'same'} | "
              f"{host_us['eager']:.0f} / {host_us['compiled']:.0f} | "
              f"{statistics.median(times['compiled']) * 1e3:.0f} | {graphs} |", flush=True)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    if args.json:
        from fa3gen import bench

        with open(args.json, "w") as fh:
            json.dump({"header": bench.provenance(lib), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
