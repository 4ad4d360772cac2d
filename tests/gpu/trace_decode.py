"""Where a decode call's split-kernel time goes, CTA by CTA: each CTA's %globaltimer stamps at
its phases (decode.cuh, TracePoint), from a library built for it:

    export FA3GEN_GENERATED=/tmp/fa3gen_trace   # its own root: the normal build stays as it is
    python3 build.py --spec specs/h100.yaml --only 'fwd_bf16_d64_nocausal*' --define FA3GEN_DECODE_TRACE
    python3 tests/gpu/trace_decode.py [--case SQ,HKV,B,N ...] [--splits S] [--paged] [--json out.json]

Each case (seqlen_q, heads_kv, batch, cache length; bf16, d128, 32 query heads, cache_seqlens a
tensor) is captured in a CUDA graph of 20 calls and replayed a few times, so the stamps are a
steady-state call's, with the call before still draining. Printed per phase, in us after the
first CTA's start (min / median / max over CTAs; warp ends over warps): the wait on the kernel
before (programmatic dependent launch), Q in shared memory, the first slice landed, each warp's
last slice done, the warps merged, the partials stored; the combine kernel's start, release,
LSEs loaded, partials summed, warps merged and stores; and the next call's release (one period,
a call's GPU time, later). Then where the warps' finishing times spread: within a CTA (last warp
minus first), between the CTAs of one SM (their last warps), and each SM's last warp. Not a
pytest module."""
import argparse
import ctypes
import json

POINTS = ("start", "released", "q_staged", "first_slice", "warp0_done", "warp1_done", "warp2_done",
          "warp3_done", "merged", "stored", "sm")
HEADS_Q, HEAD_DIM = 32, 128  # of every case (bf16)
TRACE_CTAS = 1 << 16  # decode.cuh's kTraceCtas: the combine's stamps start at this CTA's slots
CASES = ((1, 8, 1, 16384), (1, 32, 1, 4096), (1, 8, 1, 1024), (1, 8, 1, 65536))


def trace_case(read, case, splits, paged):
    import numpy as np
    import torch
    from fa3gen import kvcache, timing
    sq, hkv, b, n = case
    q = torch.randn(b, sq, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, n, hkv, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    extra = {}
    if paged:
        kc, vc = kc.reshape(-1, 64, hkv, HEAD_DIM), vc.reshape(-1, 64, hkv, HEAD_DIM)
        extra["block_table"] = torch.randperm(b * n // 64, device="cuda").to(torch.int32).reshape(b, -1)
    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    calls = 20
    replay = timing.graph_replay(lambda: kvcache.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lengths, num_splits=splits, **extra), calls)
    for _ in range(5):
        replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    replay()
    end.record()
    torch.cuda.synchronize()
    period = begin.elapsed_time(end) * 1e3 / calls  # us per call; the stamps are the last call's
    used = kvcache._split_count(n, splits, b, hkv, kvcache.ops._num_sms(q.device.index), HEAD_DIM, None)
    ctas = used * hkv * b
    stride, rows = len(POINTS), b * HEADS_Q * sq  # the combine: one CTA per output row (when split)

    def stamps(first_cta, count):  # (count, stride) stamps from CTA slot first_cta on
        raw = (ctypes.c_ulonglong * (count * stride))()
        if read(raw, first_cta * stride, count * stride) != 0:
            raise SystemExit("fa3gen_decode_trace failed")
        return np.frombuffer(raw, dtype=np.uint64).reshape(count, stride).astype(np.int64)

    t = stamps(0, min(ctas, TRACE_CTAS))  # the kernels stamp the first TRACE_CTAS CTAs
    t0 = t[:, 0].min()
    sm, t = t[:, -1], (t[:, :-1] - t0) / 1e3
    phases = {name: t[:, i] for i, name in enumerate(POINTS[:-1]) if not name.startswith("warp")}
    done = t[:, 4:8]
    phases["warps_done"] = done.ravel()
    # Where the warps' spread of finishing times lies: within a CTA (its four warps), between
    # the CTAs of one SM, or between SMs (each SM's last warp).
    cta_last, sms = done.max(1), np.unique(sm)
    spread = {"within_cta": cta_last - done.min(1),
              "within_sm": np.array([np.ptp(cta_last[sm == s]) for s in sms]),
              "sm_last": np.array([cta_last[sm == s].max() for s in sms])}
    if used > 1:  # the combine's phases (decode.cuh: its slots of the split kernel's points), same clock
        c = (stamps(TRACE_CTAS, min(rows, TRACE_CTAS))[:, :-1] - t0) / 1e3
        for name, point in (("comb_start", "start"), ("comb_release", "released"), ("comb_lses", "q_staged"),
                            ("comb_summed", "first_slice"), ("comb_merged", "merged"), ("comb_stored", "stored")):
            phases[name] = c[:, POINTS.index(point)]
    # The next call's split kernel starts one period later: the gap from these stamps to its
    # release is the time between two calls' key streams.
    phases["next_released"] = period + phases["released"]
    summary = {k: [round(float(f(v)), 2) for f in (np.min, np.median, np.max)] for k, v in phases.items()}
    print(f"seqlen_q {sq}, kv heads {hkv}, batch {b}, {n} keys{' (paged)' if paged else ''}: "
          f"{used} splits, {ctas} CTAs, {period:.2f} us a call (us after the first start: min / median / max)")
    for k, (lo, mid, hi) in summary.items():
        print(f"  {k:12s} {lo:7.2f} {mid:7.2f} {hi:7.2f}")
    deciles = [round(float(x), 2) for x in np.percentile(phases["warps_done"], range(0, 101, 10))]
    print("  warps done, deciles:", " ".join(f"{x:.1f}" for x in deciles))
    spreads = {k: [round(float(f(v)), 2) for f in (np.min, np.median, np.max)] for k, v in spread.items()}
    print(f"  CTAs on {len(sms)} SMs, at most {int(np.bincount(sm).max())} on one")
    for k, (lo, mid, hi) in spreads.items():
        print(f"  {k:12s} {lo:7.2f} {mid:7.2f} {hi:7.2f}")
    return {"case": list(case), "paged": paged, "splits": used, "ctas": ctas, "us_per_call": round(period, 2),
            "phases": summary,
            "warps_done_deciles": deciles, "spreads": spreads}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=[], metavar="SQ,HKV,B,N")
    ap.add_argument("--splits", type=int, default=0, help="num_splits (0: the heuristic)")
    ap.add_argument("--paged", action="store_true", help="64-row pages in shuffled order")
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args()
    from fa3gen import runtime
    lib = runtime.get_library()
    read = getattr(lib._dll, "fa3gen_decode_trace", None)
    if read is None:
        raise SystemExit(f"{lib.path} has no decode trace: build it with --define FA3GEN_DECODE_TRACE")
    read.restype = ctypes.c_int
    read.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int, ctypes.c_int]
    cases = [tuple(int(x) for x in c.split(",")) for c in args.case] or CASES
    rows = [trace_case(read, case, args.splits, args.paged) for case in cases]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"library": str(lib.path), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
