"""A/B of two built libraries of one spec: every variant the first dispatches to (forward and
backward; key and seqlen_k range defaults; or all its variants, --all-variants), timed against
the same variant name in the second, in one process.

    python3 tests/gpu/ab_libraries.py A.so B.so --seqlens 1024 4096 16384 --json ab.json

Not a pytest module. Shapes follow the bench grid (16k tokens, hidden 2048). Each point is
measured sustained: after a warm-up, rounds of back-to-back launches of at least --min-ms each,
the two libraries alternating with the order rotated every round, each batch right after half of
--min-ms of the same library's untimed launches; a point's time is the median
over its rounds (--steady-s: each alone for seconds instead, timing.steady_ms). Prints one
markdown row per point with B / A (--control: and A' / A, A timed a second time in the same
rounds, whose spread is the noise a B / A must exceed). Varlen variants are timed on
bench_varlen.py's packed batches (16k tokens, lengths uniform in [1, 2L]) with each --seqlens
value as the mean length L, TFLOP/s on the real work; paged variants on the bench grid's shapes,
each sequence's keys in shuffled pages of 64 rows (paged_point). Local variants run with
checks.PROBE_WINDOW, a window of about one key block, unless --window gives one (e.g. 1024 0,
a sliding window of a long-context model); their FLOPs are counted as for the full matrix, so
compare B / A, not TFLOP/s across windows.
"""

import argparse
import fnmatch
import json
import statistics
import sys

import torch

from bench_varlen import TOTAL, cu_seqlens, lengths_for, real_flops
from fa3gen import Fa3genError, bench, ops, runtime, timing, varlen
from fa3gen.checks import probe_masking
from fa3gen.contract import PAGED_CHUNK_ROWS


def _forward_default(lib, info):
    """(lib, its forward default for the key of backward variant info), or None."""
    try:
        return lib, lib.find("fwd", info.dtype, info.head_dim, info.causal, local=info.local,
                             softcap=info.softcap, varlen=info.varlen)
    except Fa3genError:
        return None


def masking_kwargs(info, window=None) -> dict:
    """window_size and softcap for info: checks.probe_masking's, with `window` (left, right) for
    local variants when given."""
    kwargs = probe_masking(info)
    if window is not None and info.local:
        kwargs["window_size"] = tuple(window)
    return kwargs


def point_fns(libs, info, shape: dict, window=None):
    q, k, v, dout = timing.random_inputs(shape, ops.TORCH_DTYPES[info.dtype], 4)
    scale, extra = shape["head_dim"] ** -0.5, masking_kwargs(info, window)
    out, lse = ops._empty_outputs(q)
    if info.direction == "fwd":
        return [lambda lib=lib: ops._fwd_into(q, k, v, out, lse, info.causal, scale, info.name,
                                              lib=lib, **extra) for lib in libs]
    # out and lse from the first library that serves the forward key (one may hold only the
    # backward variants measured)
    fwd_lib, fwd = next(found for found in (_forward_default(lib, info) for lib in libs) if found)
    ops._fwd_into(q, k, v, out, lse, info.causal, scale, fwd.name, lib=fwd_lib, **extra)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return [lambda lib=lib: ops._bwd_into(dout, q, k, v, out, lse, dq, dk, dv, info.causal, scale,
                                          info.name, lib=lib, **extra) for lib in libs]


def varlen_point(libs, info, mean: int, window=None):
    """(one call a library, FLOPs) of a varlen variant on a packed batch of mean length `mean`."""
    lengths = lengths_for(mean, seed=mean)
    heads, d = 2048 // info.head_dim, info.head_dim
    cu = cu_seqlens(lengths)
    q, k, v, dout = (torch.randn(TOTAL, heads, d, device="cuda", dtype=ops.TORCH_DTYPES[info.dtype])
                     for _ in range(4))
    longest, mask = max(lengths), ops.masking(info.causal, **masking_kwargs(info, window))
    out, lse = varlen._empty_outputs(q)
    if info.direction == "fwd":
        plans = [varlen._fwd_plan(q, k, v, cu, cu, longest, longest, out, lse, mask, None,
                                  info.name, lib) for lib in libs]
        return [lambda plan=plan: varlen._fwd_run(plan, q, k, v, cu, cu, out, lse)
                for plan in plans], real_flops(lengths, heads, d, info.causal, False)
    fwd_lib, fwd = next(found for found in (_forward_default(lib, info) for lib in libs) if found)
    plan = varlen._fwd_plan(q, k, v, cu, cu, longest, longest, out, lse, mask, None, fwd.name,
                            fwd_lib)
    varlen._fwd_run(plan, q, k, v, cu, cu, out, lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    plans = [varlen._bwd_plan(dout, q, k, v, out, lse, cu, cu, longest, longest, dq, dk, dv, mask,
                              plan.scale, info.name, False, lib) for lib in libs]
    return [lambda p=p: varlen._bwd_run(p, dout, q, k, v, out, lse, cu, cu, dq, dk, dv)
            for p in plans], real_flops(lengths, heads, d, info.causal, True)


def paged_point(libs, info, shape: dict, window=None, device="cuda"):
    """(one call a library, FLOPs) of a paged forward variant: batch x seqlen query rows over
    their own seqlen keys, read from shuffled pages of PAGED_CHUNK_ROWS rows through
    varlen.paged_forward (the chunked-prefill path of flash_attn_with_kvcache)."""
    b, s, h, d = shape["batch"], shape["seqlen"], shape["heads"], shape["head_dim"]
    page = PAGED_CHUNK_ROWS
    per_seq = -(-s // page)
    dt = ops.TORCH_DTYPES[info.dtype]
    gen = torch.Generator(device=device).manual_seed(s)
    q = torch.randn(b, s, h, d, device=device, dtype=dt, generator=gen)
    order = torch.randperm(b * per_seq, device=device, generator=gen)
    k_pages, v_pages = (torch.randn(b * per_seq, page, h, d, device=device, dtype=dt, generator=gen)
                        for _ in range(2))
    table = order.to(torch.int32).reshape(b, per_seq)  # sequence i's pages, shuffled
    used = torch.full((b,), s, dtype=torch.int32, device=device)
    mask = ops.masking(info.causal, **masking_kwargs(info, window))
    outputs = varlen._empty_outputs(q.reshape(b * s, h, d))
    fns = [lambda lib=lib: varlen.paged_forward(q, k_pages, v_pages, table, used, mask, d ** -0.5,
                                                lib.get(info.name), lib, outputs) for lib in libs]
    return fns, bench.attention_flops(b, h, s, s, d, info.causal, "fwd")


def points(libs, info, seqlens, window=None):
    """[(seqlen or mean length, one call a library, FLOPs)] of one variant."""
    if info.paged:
        return [(shape["seqlen"], *paged_point(libs, info, shape, window))
                for shape in bench.grid(seqlens, [info.head_dim])]
    if info.varlen:
        return [(mean, *varlen_point(libs, info, mean, window)) for mean in seqlens]
    return [(shape["seqlen"], point_fns(libs, info, shape, window),
             bench.attention_flops(shape["batch"], shape["heads"], shape["seqlen"], shape["seqlen"],
                                   shape["head_dim"], info.causal, info.direction))
            for shape in bench.grid(seqlens, [info.head_dim])]


def summary(rows: list[dict]) -> str:
    """B / A's median and range over the points; with a control (A' / A per point), its range
    too and how many points' B / A lie outside it."""
    ratios = [r["b_over_a"] for r in rows]
    text = (f"{len(rows)} points: B / A median {statistics.median(ratios):.3f}, "
            f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    controls = [r["control"] for r in rows if "control" in r]
    if controls:
        low, high = min(controls), max(controls)
        text += (f"; control A' / A median {statistics.median(controls):.3f}, min {low:.3f}, "
                 f"max {high:.3f}; B / A above the control's max on "
                 f"{sum(r > high for r in ratios)}, below its min on {sum(r < low for r in ratios)}")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lib_a")
    parser.add_argument("lib_b")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--min-ms", type=float, default=100.0)
    parser.add_argument("--json")
    parser.add_argument("--all-variants", action="store_true",
                        help="every variant of A, not only those it dispatches to (a spec of "
                             "candidates without defaults, e.g. specs/tiles_96_192.yaml)")
    parser.add_argument("--only", action="append", default=[], metavar="GLOB",
                        help="time only variants whose name matches (repeatable), e.g. the "
                             "forwards a compile-time switch changes")
    parser.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"),
                        help="window_size of the local variants (default: checks.PROBE_WINDOW)")
    parser.add_argument("--steady-s", type=bench.steady_run_seconds, default=None, metavar="S",
                        help="time A and B each alone for S seconds (> 1) after a second of idle, "
                             "counted from 1 s, A B then B A (timing.steady_ms; fa3gen bench "
                             "--steady-s) instead of interleaved rounds: the steady state at the "
                             "power cap, where an energy difference shows; about 4 (S + 1) s a point")
    parser.add_argument("--control", action="store_true",
                        help="time A a second time in the same rounds (A, B, A'): each point gets "
                             "A' / A, and the summary the control's spread, the noise a B / A "
                             "must exceed (identical launches read up to 2.4%% apart on "
                             "2026-12-04); 1.5x the timing")
    parser.add_argument("--commit-a", help="the commit A was built from (recorded in the JSON; "
                                           "ab_trees.py passes it)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ab_libraries.py times kernels: it needs a CUDA GPU (Hopper sm_90)")
    libs = [runtime.Library(args.lib_a), runtime.Library(args.lib_b)]
    rows = []
    print("| variant | seqlen | A TFLOP/s | B TFLOP/s | B / A |" + (" A' / A |" if args.control else "")
          + "\n|---|---|---|---|---|" + ("---|" if args.control else ""))
    infos = ([libs[0].get(name) for name in libs[0].names()] if args.all_variants
             else libs[0].dispatched())
    if args.only:
        infos = [i for i in infos if any(fnmatch.fnmatch(i.name, g) for g in args.only)]
    for info in infos:
        if libs[1].get(info.name) is None:
            print(f"skipped {info.name}: not in {args.lib_b}", file=sys.stderr)
            continue
        for seqlen, fns, flops in points(libs, info, args.seqlens, args.window):
            timed = fns + fns[:1] if args.control else fns  # A, B[, A again]
            if args.steady_s:
                ms = timing.steady_ms(timed, args.steady_s)
            else:
                ms = timing.sustained_ms(timed, args.rounds, args.min_ms)
            ms_a, ms_b = ms[0], ms[1]
            row = {"variant": info.name, "seqlen": seqlen, "ms_a": ms_a, "ms_b": ms_b,
                   "tflops_a": timing.tflops(flops, ms_a), "tflops_b": timing.tflops(flops, ms_b),
                   "b_over_a": ms_a / ms_b}
            if args.control:
                row["ms_a_again"], row["control"] = ms[2], ms_a / ms[2]
            if info.local:
                row["window"] = list(masking_kwargs(info, args.window)["window_size"])
            if info.varlen:
                row["mean_length"] = seqlen  # packed: 16k tokens of lengths in [1, 2 seqlen]
            rows.append(row)
            print(f"| {info.name} | {seqlen} | {row['tflops_a']:.0f} | {row['tflops_b']:.0f} | "
                  f"{row['b_over_a']:.3f} |" + (f" {row['control']:.3f} |" if args.control else ""),
                  flush=True)
            del fns
            torch.cuda.empty_cache()
    if not rows:
        sys.exit("no variant of A was timed (a spec without defaults needs --all-variants)")
    print("\n" + summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            header = bench.provenance(libs[1])  # date, GPU, commit of this tree, B's build
            header.update(build_info_a=libs[0].build_info, commit_a=args.commit_a,
                          library_commit_a=bench.library_commit(libs[0].path))
            json.dump({"header": header, "lib_a": args.lib_a, "lib_b": args.lib_b,
                       "rows": rows}, f, indent=1)  # the GPU: header["gpu"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
