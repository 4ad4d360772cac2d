"""Decode over a KV cache against the copy roof and the peers, sustained (issue 17: at least 80%
of the H200's device-to-device copy bandwidth whenever at least 64 MB of K and V are read):
    python3 tests/gpu/bench_kvcache.py [--out decode.json] [--quick] [--max-mb 300] [--kv-fp8] [--dtype fp16]
        [--baseline-so OLD.so] [--no-peers] [--case SQ,HKV,B,N ...] [--num-splits N] [--settle-ms 200] [--order shuffle]
Grid: seqlen_q 1 and 4; heads_q 32 over heads_kv 8 and 32; d128 bf16 (--dtype); batch 1, 8, 64, 256;
cache lengths 1k to 128k (cases above 8 GB of KV, or --max-mb, left out); contiguous and paged (64-row pages,
shuffled) caches. Bytes = K and V rows read + q + out. Peers when they import, in the same
process and rounds: FA4 (flash_attn.cute, paged through its page_table, and contiguous) and
PyTorch SDPA's cuDNN backend (contiguous, GQA). Each backend twice: eager calls back to back
(host time included, as a Python loop sees it) and CUDA-graph replays of 20 calls (the GPU
time, as a serving engine that captures its decode step sees it). --out is rewritten after every
case ("complete": false until the last), so a run cut short by a time limit keeps what it
measured. --baseline-so adds the columns base and base_paged: the same calls with another
library's fa3gen_decode_fwd (e.g. an earlier commit's build; same params struct), in the same
process and rounds. Not a pytest module."""
import argparse
import contextlib
import ctypes
import datetime
import json
import os
import sys

import torch

from fa3gen import kvcache, ops, runtime, timing
from fa3gen.bench import add_settle_arguments, git_commit

MB = 1e6


def _fa4():
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
        return flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - a missing peer is a column of n/a, not an error
        print(f"FA4: not available ({type(e).__name__}: {e})")
        return None


def _peer(fn):
    """fn if one call runs, else the reason it does not (a peer may lack the case)."""
    try:
        fn()
        torch.cuda.synchronize()
        return fn, None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


class _RawDecode:
    """A library file's fa3gen_decode_fwd called directly (no ABI check: an A/B baseline)."""

    def __init__(self, path: str):
        self._fn = ctypes.CDLL(path).fa3gen_decode_fwd
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(runtime.DecodeParams), ctypes.c_void_p]

    @contextlib.contextmanager
    def launching(self):
        """flash_attn_with_kvcache calls inside launch this library's kernels."""
        def launch(device, params, lib=None):  # this library, whatever the plan holds
            def run(stream):
                if self._fn(ctypes.byref(params), stream) != 0:
                    raise RuntimeError("baseline decode failed")
            ops.on_current_stream(device, run)
        saved, kvcache._launch_decode = kvcache._launch_decode, launch
        try:
            yield
        finally:
            kvcache._launch_decode = saved


GRAPH_CALLS = 20


def _graphed(fn):
    """A replay of GRAPH_CALLS captured calls of fn, or None when fn cannot be captured."""
    try:
        return timing.graph_replay(fn, GRAPH_CALLS)
    except Exception:  # noqa: BLE001 - a peer that cannot be captured has no graph column
        torch.cuda.synchronize()
        return None


def _only_cudnn_sdpa() -> None:
    """SDPA's backend choice made once for the process (nothing else here calls SDPA): the
    sdpa_kernel context manager around every call had cost ~10 us a call, which the host-bound
    small cases' eager column had charged to cuDNN (before 2026-12-07, forty-first)."""
    for name in ("flash", "mem_efficient", "math"):
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(False)
    torch.backends.cuda.enable_cudnn_sdp(True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="a few cases")
    ap.add_argument("--graph-peers", action="store_true", help="also capture the peers in graphs")
    ap.add_argument("--max-mb", type=float, default=8000, help="leave out cases with more KV bytes")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="q's (and a 16-bit cache's)")
    ap.add_argument("--kv-fp8", action="store_true",
                    help="e4m3 caches with per-head factors under bf16 queries (fa3gen alone: no peer has it)")
    ap.add_argument("--baseline-so", help="a library whose decode kernels are timed beside this one's")
    ap.add_argument("--case", action="append", default=[], metavar="SQ,HKV,B,N",
                    help="only these cases (seqlen_q, heads_kv, batch, cache length; repeatable)")
    ap.add_argument("--no-peers", action="store_true", help="fa3gen alone (and --baseline-so)")
    ap.add_argument("--num-splits", type=int, default=0, help="fa3gen's split count (0: its heuristic)")
    # The eager calls of the small cases are host-bound (the GPU idles between launches), and a
    # call timed right after one starts with the power cap's headroom: settle each call 200 ms
    # first and shuffle the order (bench_chunked_prefill measured the same effect up to 9%).
    add_settle_arguments(ap, settle_ms=200.0, order="shuffle")
    args = ap.parse_args()
    fa4 = None if args.kv_fp8 or args.no_peers else _fa4()
    base = _RawDecode(args.baseline_so) if args.baseline_so else None
    elem = 1 if args.kv_fp8 else 2  # bytes per cached value
    hq, d, page = 32, 128, 64
    dt = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    copy_gbs = timing.copy_roof_gbs()
    print(f"device copy: {copy_gbs:.0f} GB/s")
    rows = []
    grid = [(sq, hkv, b, n) for sq in (1, 4) for hkv in (8, 32) for b in (1, 8, 64, 256)
            for n in (1024, 4096, 16384, 65536, 131072)]
    if args.quick:
        grid = [(1, 8, 1, 131072), (1, 8, 64, 4096), (4, 8, 8, 32768), (1, 32, 256, 1024)]
    if args.case:
        grid = [tuple(int(x) for x in c.split(",")) for c in args.case]
    for sq, hkv, b, n in grid:
        kv_bytes = 2 * b * n * hkv * d * elem
        if kv_bytes > args.max_mb * MB:
            continue
        g = torch.Generator(device="cuda").manual_seed(n + b)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt, generator=g)
        kc = torch.randn(b, n, hkv, d, device="cuda", dtype=dt, generator=g)
        vc = torch.randn(b, n, hkv, d, device="cuda", dtype=dt, generator=g)
        factors = {}
        if args.kv_fp8:
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
            factors = {"k_scale": torch.full((hkv,), 0.5, device="cuda"), "v_scale": torch.full((hkv,), 2.0, device="cuda")}
        pages = kc.reshape(b * n // page, page, hkv, d)
        vpages = vc.reshape(b * n // page, page, hkv, d)
        table = torch.randperm(b * n // page, device="cuda", generator=g).to(torch.int32).reshape(b, -1)
        seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        fns = {
            "fa3gen": lambda: kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                              num_splits=args.num_splits, **factors),
            "fa3gen_paged": lambda: kvcache.flash_attn_with_kvcache(q, pages, vpages, cache_seqlens=seqlens,
                                                                    block_table=table, num_splits=args.num_splits,
                                                                    **factors),
        }
        if base is not None:
            for name in ("fa3gen", "fa3gen_paged"):
                fns[name.replace("fa3gen", "base")] = lambda fn=fns[name]: _with(base, fn)
        skipped = {}
        if fa4 is not None:
            for name, kcache, vcache, pt in (("fa4", kc, vc, None), ("fa4_paged", pages, vpages, table)):
                # FA4's own split heuristic first; it may refuse split-KV on sm90: one split
                for splits in (0, 1):
                    fn, why = _peer(lambda kcache=kcache, vcache=vcache, pt=pt, splits=splits: fa4(
                        q, kcache, vcache, seqused_k=seqlens, page_table=pt, num_splits=splits))
                    if fn is not None:
                        fns[name] = fn
                        break
                else:
                    skipped[name] = why
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

        def cudnn():  # SDPA has only cuDNN enabled (set once, below), not a context per call
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hkv != hq)

        _only_cudnn_sdpa()
        fn, why = ((None, "no e4m3 cache") if args.kv_fp8 else (None, "--no-peers") if args.no_peers
                   else _peer(cudnn))
        if fn is None:
            skipped["cudnn"] = why
        else:
            fns["cudnn"] = fn
        names = list(fns)
        graphs = {k: g for k in names if (args.graph_peers or k.startswith(("fa3gen", "base")))
                  and (g := _graphed(fns[k])) is not None}
        gnames = list(graphs)
        ms = timing.sustained_ms([fns[k] for k in names] + [graphs[k] for k in gnames], 2, 50,
                                 settle_ms=args.settle_ms, order=args.order)
        eager, replay = ms[:len(names)], [m / GRAPH_CALLS for m in ms[len(names):]]
        moved = kv_bytes + 2 * q.numel() * 2
        row = {"seqlen_q": sq, "heads_q": hq, "heads_kv": hkv, "batch": b, "cache_len": n, "head_dim": d,
               "page_size": page, "mb_moved": round(moved / MB, 1), "copy_gbs": round(copy_gbs),
               "us": {k: round(m * 1e3, 2) for k, m in zip(names, eager)},
               "gbs": {k: round(moved / m / MB) for k, m in zip(names, eager)},
               "graph_us": {k: round(m * 1e3, 2) for k, m in zip(gnames, replay)},
               "graph_gbs": {k: round(moved / m / MB) for k, m in zip(gnames, replay)},
               "skipped": skipped}
        rows.append(row)
        write_report(args, copy_gbs, rows, complete=False)  # a run cut short keeps its rows
        cols = "  ".join(f"{k} {row['us'][k]:.0f}us" + (f"/{row['graph_us'][k]:.0f}us "
                         f"{row['graph_gbs'][k] / copy_gbs:.0%}" if k in graphs else "") for k in names)
        print(f"sq={sq} hkv={hkv} b={b} n={n} ({moved / MB:.0f} MB): {cols}"
              + (f"  [n/a: {', '.join(skipped)}]" if skipped else ""))
        del q, kc, vc, pages, vpages, table
        torch.cuda.empty_cache()
    write_report(args, copy_gbs, rows, complete=True)
    reasons = {k: v for r in rows for k, v in r["skipped"].items()}
    for k, v in reasons.items():
        print(f"{k} n/a in some cases, e.g.: {v}", file=sys.stderr)


def _with(base, fn):
    with base.launching():
        return fn()


def write_report(args, copy_gbs, rows, complete):
    """The JSON report (--out), rewritten whole and atomically after each case."""
    if not args.out:
        return
    report = {"device": torch.cuda.get_device_name(), "commit": git_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "complete": complete, "copy_gbs": round(copy_gbs),
              "baseline_so": args.baseline_so, "q": args.dtype, "cache": "e4m3, per-head factors" if args.kv_fp8 else args.dtype,
              "timing": f"fa3gen.timing.sustained_ms, 2 rounds x >= 50 ms, each call settled "
                        f"{args.settle_ms:g} ms first, order {args.order}; "
                        "us: eager calls, graph_us: CUDA graph replay of 20 calls / 20",
              "rows": rows}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
