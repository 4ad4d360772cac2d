"""Each backend alone for seconds: does the bench's sustained timing (rounds of ~100 ms, the
backends interleaved) read what long steady use gets under the board's power cap? The
diagnostic behind `fa3gen bench --steady-s` (the same runs: timing.steady_runs): it reports
the stretches of a run apart, and the clock-event reasons.

For each point and backend: the GPU idles --idle-s, then the backend runs back to back for
--run-s, timed in windows of about --window-ms (CUDA events; the next window is queued before
the last one is waited on, so the GPU never idles). nvidia-smi samples board power, SM clock,
temperature and the active clock-event reasons every 20 ms, stamped with host time. The report
gives each backend's TFLOP/s, power and clock over the first 200 ms, 0.2-1 s and from 1 s to
the end, and the reasons seen in that last stretch. The backends run in the given order, then
in reverse, so that neither side always runs on a warmer board.

  FA3GEN_LIB=... python3 tests/gpu/steady_state.py --point 128,0,16384 --point 256,1,16384 \
      --point 128,1,16384,bwd --out steady.json
"""

import argparse
import json
import statistics
import time

import torch

from fa3gen import bench, timing
from fa3gen.ops import flash_attn_func

FIELDS = "power.draw.instant,clocks.sm,temperature.gpu,clocks_event_reasons.active"
STRETCHES = (("0-0.2s", 0.0, 0.2), ("0.2-1s", 0.2, 1.0), ("1s-end", 1.0, 1e9))


class StampedSampler(timing.PowerSampler):
    """timing.PowerSampler's nvidia-smi process, with temperature and the clock-event reasons
    too, every sample kept with its host time (perf_counter) instead of by tag."""

    PROBE_REASONS = False  # FIELDS names the reasons itself, under this driver's name for them

    def __init__(self):
        reasons = timing.reasons_field() or "clocks_event_reasons.active"
        self.QUERY = f"--query-gpu={FIELDS.replace('clocks_event_reasons.active', reasons)}"
        super().__init__()
        self.stamped = []

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.stamped.append((time.perf_counter(), float(parts[0]), float(parts[1]),
                                     float(parts[2]), parts[3]))
            except (ValueError, IndexError):
                continue

    def between(self, t0, t1):
        return [s for s in self.stamped if t0 <= s[0] < t1]


def summarize(t_start, windows, sampler, flops):
    out = {}
    for name, lo, hi in STRETCHES:
        ws = [w for w in windows if lo <= w[0] - t_start < hi]
        ss = sampler.between(t_start + lo, t_start + hi)
        if not ws:
            continue
        out[name] = {"tflops": flops / timing.ms_per_call(ws) / 1e9, "windows": len(ws),
                     "power_w": statistics.fmean(s[1] for s in ss) if ss else None,
                     "sm_mhz": statistics.fmean(s[2] for s in ss) if ss else None,
                     "temp_c": statistics.fmean(s[3] for s in ss) if ss else None,
                     "reasons": sorted({s[4] for s in ss})}
    return out


def point_calls(d, causal, seqlen, direction="fwd"):
    """The backends' calls for one point (fa3gen, cuDNN and FA4 as fa3gen bench builds them);
    "bwd": autograd.grad of one recorded forward each, as fa3gen bench times the backward."""
    shape = bench.grid([seqlen], [d])[0]
    q, k, v, dout = timing.random_inputs(shape, torch.bfloat16, 4)
    if direction == "bwd":
        for t in (q, k, v):
            t.requires_grad_(True)
    forwards = {"fa3gen": lambda: flash_attn_func(q, k, v, causal=causal)}
    forwards.update((n, f) for n, f in bench.peer_forwards(q, k, v, causal).items() if n != "flash")
    if direction == "fwd":
        calls = forwards
    else:
        calls = {n: bench.backward_call(bench.LABELS[n], f, q, k, v, dout) for n, f in forwards.items()}
        calls = {n: c for n, c in calls.items() if c is not None}
    flops = bench.attention_flops(shape["batch"], shape["heads"], seqlen, seqlen, d, causal, direction)
    return shape, calls, flops


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--point", action="append", required=True,
                   help="HEAD_DIM,CAUSAL(0/1),SEQLEN[,bwd] (forward unless bwd)")
    p.add_argument("--run-s", type=float, default=4.0)
    p.add_argument("--idle-s", type=float, default=1.5)
    p.add_argument("--window-ms", type=float, default=20.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with StampedSampler() as sampler:
        report = {"query": sampler.QUERY.split("=", 1)[1], "run_s": args.run_s, "idle_s": args.idle_s,
                  "points": []}
        time.sleep(0.5)
        for spec in args.point:
            fields = spec.split(",")
            direction = fields[3] if len(fields) > 3 else "fwd"
            if direction not in ("fwd", "bwd"):
                p.error(f"--point {spec}: the fourth field is fwd or bwd")
            d, causal, seqlen = (int(x) for x in fields[:3])
            shape, calls, flops = point_calls(d, bool(causal), seqlen, direction)
            names = list(calls)
            for fn in calls.values():
                fn()
            torch.cuda.synchronize()
            runs = []
            for i, t_start, windows in timing.steady_runs([calls[n] for n in names], args.run_s,
                                                          args.idle_s, args.window_ms):
                s = summarize(t_start, windows, sampler, flops)
                runs.append({"backend": names[i], "stretches": s})
                line = "  ".join(f"{k}: {v['tflops']:.0f} TF {v['power_w'] or 0:.0f} W "
                                 f"{v['sm_mhz'] or 0:.0f} MHz" for k, v in s.items())
                print(f"{direction} d{d} causal={causal} {seqlen} {names[i]:6s} {line}  "
                      f"reasons {s.get('1s-end', {}).get('reasons')}", flush=True)
            report["points"].append({"direction": direction, "head_dim": d, "causal": bool(causal),
                                     "seqlen": seqlen, **shape, "runs": runs})
            del calls
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

if __name__ == "__main__":
    main()
