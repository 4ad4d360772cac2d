"""Host time per call: how long the CPU spends in one attention call on a problem so small that
the GPU is never the bottleneck (batch 1, seqlen 128, 1 head, d64, bf16). Calls are issued
back to back without synchronizing and timed with perf_counter; the median of --rounds rounds
of --calls calls is reported per backend, the backends taking turns round by round (since
2026-12-07, forty-third: before, each backend's rounds ran in one stretch, so a drift of the
host's speed fell on one backend's row), forward with and without requires_grad inputs,
forward+backward, and the forward replayed from a CUDA graph (the GPU's share: what remains
without host work); fa3gen also under torch.compile(fullgraph=True). Also the first call of
the process (library load + first resolution).

    python3 tests/gpu/host_time.py [--json out.json] [--profile] [--processes N]

--processes N runs the measurement in N fresh processes one after another and reports, per
row, the median over them of each backend's time and of its ratio to cuDNN's in the same
process: host time moves between processes and hosts (1.7x on one H100 host, 2026-12-07),
and a ratio taken within a process is what the host-time targets compare. Its --json holds
every process's rows and the medians ({header, shape, processes, first_call_ms, median});
--processes 1 (the default) writes the one process's rows as before.

--profile also times fa3gen's eager backward alone (ops._eager_backward on the main thread, no
autograd engine) and prints where its host time goes (cProfile, by own time); autograd runs
backward functions on its device threads, which a profiler of the main thread does not see.

Not a pytest module. Peers (SDPA's cuDNN backend, FA4 when flash_attn.cute imports) run in the
same process, after fa3gen's first call has been timed.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch


def interleaved_us(fns: dict, contexts: dict, calls: int, rounds: int) -> dict:
    """{name: median per-call us} of each fn, the backends taking turns: each round times one
    batch of `calls` calls of every fn, the order rotated a place each round (a drift of the
    host's speed then falls on every backend alike, not on whichever ran last). contexts[name]
    (the SDPA backend choice) is entered around each batch, outside its timing."""
    names = list(fns)
    for name in names:
        with contexts.get(name, contextlib.nullcontext)():
            for _ in range(20):
                fns[name]()
    torch.cuda.synchronize()
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with contexts.get(name, contextlib.nullcontext)():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fns[name]()
                samples[name].append((time.perf_counter() - t0) / calls * 1e6)
                torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in samples.items()}


def per_call_us(fn, calls: int, rounds: int) -> float:
    """Median per-call us of fn alone (interleaved_us of one)."""
    return interleaved_us({"fn": fn}, {}, calls, rounds)["fn"]


def profile_backward(q, k, v, args) -> float:
    """Per-call µs of fa3gen's eager backward called directly (its Python, allocations and
    launches), and its cProfile by own time."""
    import cProfile
    import pstats

    from fa3gen import ops

    plan = ops._eager_fwd_plan(q, k, v, ops.masking(), None, None)
    out, lse = ops._eager_forward(plan, q.detach(), k.detach(), v.detach())
    dout = torch.randn_like(out)
    call = lambda: ops._eager_backward(plan, False, dout, q.detach(), k.detach(), v.detach(),
                                       out, lse)
    us = per_call_us(call, args.calls, args.rounds)
    print(f"fa3gen eager backward alone: {us:.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return us


PEER = "cudnn (sdpa)"  # the backend the host-time targets compare against


def sdpa(q, k, v):
    """cuDNN's attention through SDPA on flash-attn's (b, s, h, d) layout, output (b, h, s, d):
    called inside PEER_CONTEXTS' sdpa_kernel(CUDNN_ATTENTION), entered per batch of calls."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


# The backend choice is entered around each timed batch of calls, outside its timing, not per
# call: the context manager alone costs ~10 us a call, which is the harness's, not cuDNN's
# (before 2026-12-07 (forty-first) it was inside every timed call).
PEER_CONTEXTS = {PEER: lambda: torch.nn.attention.sdpa_kernel(
    torch.nn.attention.SDPBackend.CUDNN_ATTENTION)}


def summarize(runs: list[dict]) -> dict:
    """{backend: {row: {"us": median, "ratio_to_cudnn": median}}} over runs (each a --json
    output's per_call_us); a ratio only where the run has cuDNN's row."""
    out: dict = {}
    for name in dict.fromkeys(n for run in runs for n in run):
        rows = dict.fromkeys(r for run in runs for r in run.get(name, {}))
        out[name] = {}
        for row in rows:
            times = [run[name][row] for run in runs if row in run.get(name, {})]
            ratios = [run[name][row] / run[PEER][row] for run in runs
                      if row in run.get(name, {}) and run.get(PEER, {}).get(row)]
            out[name][row] = {"us": statistics.median(times)}
            if ratios:
                out[name][row]["ratio_to_cudnn"] = statistics.median(ratios)
    return out


def run_processes(args) -> int:
    """The measurement in args.processes fresh processes, one after another; the medians over
    those that finished (a failed one is reported and left out; none finishing is an error)."""
    import subprocess
    import tempfile

    runs, first_calls, header, shape = [], [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            path = f"{tmp}/run{i}.json"
            done = subprocess.run([sys.executable, __file__, "--calls", str(args.calls),
                                   "--rounds", str(args.rounds), "--json", path], check=False)
            if done.returncode != 0:
                print(f"process {i + 1}: exit {done.returncode}, left out", file=sys.stderr)
                continue
            with open(path) as fh:
                run = json.load(fh)
            runs.append(run["per_call_us"])
            first_calls.append(run["first_call_ms"])
            header, shape = run["header"], run.get("shape")
    if not runs:
        print("no process finished", file=sys.stderr)
        return 1
    summary = summarize(runs)
    print(f"median of {len(runs)} processes:")
    for name, rows in summary.items():
        print(f"{name:14s} " + "  ".join(
            f"{row} {v['us']:6.1f} us" + (f" ({v['ratio_to_cudnn']:.2f}x cuDNN)"
                                          if "ratio_to_cudnn" in v else "")
            for row, v in rows.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": header, "shape": shape, "processes": runs,
                       "first_call_ms": first_calls, "median": summary}, fh, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--processes", type=int, default=1,
                    help="fresh processes to run one after another; medians over them")
    args = ap.parse_args()
    if args.processes < 1 or (args.profile and args.processes > 1):
        ap.error("--processes must be >= 1, and --profile runs in one process")
    if args.processes > 1:
        return run_processes(args)

    shape = (1, 128, 1, 64)
    make = lambda grad: [torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                                     requires_grad=grad) for _ in range(3)]
    q, k, v = make(False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    from fa3gen.ops import flash_attn_func
    flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3

    fns = {"fa3gen": lambda q, k, v: flash_attn_func(q, k, v),
           # the custom-op path (fa3gen::fwd / fa3gen::bwd) plus torch's guards and dispatch
           "fa3gen compiled": torch.compile(lambda q, k, v: flash_attn_func(q, k, v),
                                            fullgraph=True),
           PEER: sdpa}
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4
        fns["fa4"] = lambda q, k, v: fa4(q, k, v)
    except Exception as e:  # an optional column
        print(f"FA4 unavailable: {e!r}"[:200], file=sys.stderr)

    qg, kg, vg = make(True)

    def graph_replay_us(f) -> float:
        """Per-call time of replaying a CUDA graph that holds `calls` captured calls: what is
        left when the host work is captured away (the GPU time of the tiny problem)."""
        from fa3gen.timing import graph_replay

        torch.cuda.synchronize()
        replay = graph_replay(lambda: f(q, k, v), args.calls)
        samples = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            replay()
            torch.cuda.synchronize()  # the replay's GPU time is what is measured here
            samples.append((time.perf_counter() - t0) / args.calls * 1e6)
        return statistics.median(samples)

    first = lambda o: o[0] if isinstance(o, tuple) else o
    rows = {name: {} for name in fns}
    calls = {"fwd": (lambda f: lambda: f(q, k, v), args.calls),
             "fwd requires_grad": (lambda f: lambda: f(qg, kg, vg), args.calls),
             "fwd+bwd": (lambda f: lambda: first(f(qg, kg, vg)).sum().backward(), args.calls // 4)}
    for row, (call, n) in calls.items():
        timed = interleaved_us({name: call(f) for name, f in fns.items()}, PEER_CONTEXTS, n,
                               args.rounds)
        for name, us in timed.items():
            rows[name][row] = us
    for name, f in fns.items():
        with PEER_CONTEXTS.get(name, contextlib.nullcontext)():
            try:
                rows[name]["fwd, CUDA-graph replay"] = graph_replay_us(f)
            except Exception as e:  # a backend that cannot be captured: say so, keep the rest
                print(f"{name}: graph capture failed: {e!r}"[:200], file=sys.stderr)
        print(f"{name:14s} " + "  ".join(f"{k} {v:6.1f} us" for k, v in rows[name].items()),
              flush=True)
    print(f"fa3gen first call in the process: {first_ms:.0f} ms")
    if args.profile:
        rows["fa3gen"]["eager backward alone"] = profile_backward(qg, kg, vg, args)
    if args.json:
        from fa3gen import bench, runtime  # after the timing: the first call is measured cold

        with open(args.json, "w") as fh:
            json.dump({"header": bench.provenance(runtime.get_library()), "shape": shape, "first_call_ms": first_ms, "per_call_us": rows}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
