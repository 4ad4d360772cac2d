"""Where a forward kernel's warps wait, from ncu's per-instruction warp-state samples: the
steady-state loop (the instructions executed as often as its most executed warpgroup GEMM)
split into waiting for the S GEMM (WARPGROUP.DEPBAR.LE 1), waiting for every GEMM (DEPBAR.LE
0), issuing GEMMs, softmax arithmetic and the rest.

    ncu --profile-from-start off --clock-control none --section WarpStateStats \
        --section SourceCounters -o rep python3 tests/gpu/ncu_one_forward.py fa3gen 128 0 16384
    ncu -i rep.ncu-rep --page source --csv --print-source sass > k.csv
    python3 tests/gpu/ncu_phases.py k.csv [more.csv] [--json out.json]

Not a pytest module (tests/test_gpu_scripts.py checks its parser on a small CSV); docs/results/
ncu_fwd_d128_phases.json holds what it gave on 2026-12-01.
"""
import argparse
import collections
import csv
import json
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
SOFTMAX_OPS = ("MUFU", "FMNMX", "FFMA", "FADD", "FMUL", "F2FP", "FSETP", "FSEL", "SHFL")
GEMM_OPS = ("HGMMA", "QGMMA")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def phases(lines) -> dict:
    """{"all_samples", "steady_loop_warp_steps", "steady_loop_samples": {phase: samples}} of one
    kernel's source-page CSV (its first line names the kernel, the second holds the columns)."""
    rows = list(csv.reader(lines))
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    source = [r[col["Source"]].strip() for r in data]
    executed = [_number(r[col[EXECUTED]]) for r in data]
    samples = [_number(r[col[SAMPLES]]) for r in data]
    gemms = [i for i, s in enumerate(source) if s.split()[-1:] and any(g in s for g in GEMM_OPS)]
    if not gemms:
        raise ValueError("no warpgroup GEMM in this kernel's SASS")
    steps = max(executed[i] for i in gemms)
    loop = [i for i, n in enumerate(executed) if n == steps]
    split = collections.Counter()
    for i in range(min(loop), max(loop) + 1):
        text = source[i].split(None, 1)[1] if source[i].startswith("@") else source[i]
        op = text.split()[0].split(".")[0] if text else ""
        if "DEPBAR.LE gsb0, 0x1" in text:
            phase = "wait_S"
        elif "DEPBAR.LE gsb0, 0x0" in text:
            phase = "wait_all_gemms"
        elif op in GEMM_OPS:
            phase = "gemm_issue"
        elif op in SOFTMAX_OPS:
            phase = "softmax_math"
        else:
            phase = "other"
        split[phase] += samples[i]
    return {"all_samples": int(sum(samples)), "steady_loop_warp_steps": int(steps),
            "steady_loop_samples": {k: int(v) for k, v in split.most_common()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="ncu -i REP --page source --csv --print-source sass")
    parser.add_argument("--json", help="write {file: phases} here")
    args = parser.parse_args()
    out = {}
    for path in args.csv:
        with open(path, newline="") as f:
            out[path] = result = phases(f)
        loop = result["steady_loop_samples"]
        print(f"{path}: {result['all_samples']} samples, steady loop {sum(loop.values())} over "
              f"{result['steady_loop_warp_steps']} warp-steps: "
              + ", ".join(f"{k} {v}" for k, v in loop.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
