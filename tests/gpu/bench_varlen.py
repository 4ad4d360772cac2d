"""Variable-length batches: fa3gen's flash_attn_varlen_func beside FA4's (flash_attn.cute, when
it imports) and beside fa3gen's own padded-batch call at seqlen L, in one process, measured
sustained (fa3gen.timing.sustained_ms: rounds of back-to-back launches of at least --min-ms
each, backends alternating with the order rotated, each settled first, median).

    python3 tests/gpu/bench_varlen.py --json varlen.json

Not a pytest module. Rows (bf16, hidden 2048: heads = 2048 / head_dim): 16k tokens in all,
sequence lengths drawn uniformly from [1, 2L] (seeded; the last one trimmed to the total) for
mean L in --means; the padded row runs batch 16k / L sequences of exactly L. Forward for
d64/d128/d256, backward (autograd) for the same (d256's since 2026-12-03), causal and not. TFLOP/s count real work
only: 4 * head_dim FLOPs per visible (query, key) pair forward, 2.5x that backward.
--window W gives every call the window (W, 0) if causal, (W, W) if not; --softcap C the cap
(the varlen variants with a window or softcap, and the padded ones of the same key).
--variants also times every varlen variant the library holds for each row's key (a candidate
spec such as specs/varlen_tiles.yaml through FA3GEN_LIB): the tile to choose by max_seqlen_k.
"""

import argparse
import itertools
import json
import os
import random
import sys

import torch

from fa3gen import bench, runtime, timing
from fa3gen.contract import make_key
from fa3gen.ops import flash_attn_func, masking
from fa3gen.varlen import flash_attn_varlen_func
from bench_features import visible_pairs
from sustained_backends import measure

TOTAL = 16384
CAUSALS = {"both": (False, True), "yes": (True,), "no": (False,)}  # --causal's choices


def lengths_for(mean: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    out = []
    while sum(out) < TOTAL:
        out.append(rng.randint(1, 2 * mean))
    out[-1] -= sum(out) - TOTAL
    return [n for n in out if n > 0]


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """The int32 prefix sums [0, l0, l0 + l1, ...] on the GPU."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def pairs(n: int, causal: bool, window: int = -1) -> int:
    """Visible (query, key) pairs of one sequence of n under causal and window (W, 0 if causal
    else W); W < 0: no window."""
    return visible_pairs(n, window, 0 if causal else window)


def real_flops(lengths: list[int], heads: int, head_dim: int, causal: bool, backward: bool,
               window: int = -1) -> float:
    """The FLOPs of sequences of these lengths (q and k alike): 4 * head_dim a visible pair,
    2.5x backward."""
    return 4 * head_dim * heads * (2.5 if backward else 1.0) * sum(
        pairs(n, causal, window) for n in lengths)


def with_grid(mode: str, call):
    """call() with FA3GEN_GRID=mode (the forward's grid policy, read per call), then restored."""
    old = os.environ.get("FA3GEN_GRID")
    os.environ["FA3GEN_GRID"] = mode
    try:
        return call()
    finally:
        if old is None:
            del os.environ["FA3GEN_GRID"]
        else:
            os.environ["FA3GEN_GRID"] = old


def fa4_varlen():
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func as fa4
    except Exception as e:  # an optional column
        print(f"FA4 unavailable: {e!r}"[:300], file=sys.stderr)
        return None

    def call(q, k, v, cu, max_len, causal, window_size=(-1, -1), softcap=0.0):
        kw = {"window_size": window_size} if window_size != (-1, -1) else {}
        o = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                max_seqlen_k=max_len, causal=causal, softcap=softcap, **kw)
        return o[0] if isinstance(o, tuple) else o
    return call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--means", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--directions", nargs="+", default=["fwd", "bwd"])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-ms", type=float, default=100.0)
    p.add_argument("--no-fa4", action="store_true")
    p.add_argument("--grids", nargs="+", default=[], choices=["persistent", "tiles"],
                   help="also time fa3gen's varlen forward with FA3GEN_GRID forced to each of "
                        "these (persistent: one CTA per SM; tiles: one CTA per tile) in the "
                        "same rounds, as columns grid_<mode>")
    p.add_argument("--window", type=int, default=-1,
                   help="window (W, 0) for causal rows, (W, W) for the others (default: none)")
    p.add_argument("--softcap", type=float, default=0.0)
    p.add_argument("--variants", action="store_true",
                   help="also time every varlen variant the library holds for the row's key "
                        "(variant=, in the same rounds), as columns v_<name>: tiles to choose "
                        "by max_seqlen_k")
    p.add_argument("--json")
    args = p.parse_args()
    fa4 = None if args.no_fa4 else fa4_varlen()
    causals = CAUSALS[args.causal]
    rows = []
    print("| dir | d | causal | mean L | seqs | varlen TFLOP/s | FA4 varlen | padded at L | "
          "varlen / FA4 | varlen / padded |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d, direction, causal, mean in itertools.product(args.head_dims, args.directions, causals,
                                                        args.means):
        h, grad = 2048 // d, direction == "bwd"
        lengths = lengths_for(mean, seed=mean)
        cu = cu_seqlens(lengths)
        q, k, v = (torch.randn(TOTAL, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=grad) for _ in range(3))
        qp, kp, vp = (torch.randn(TOTAL // mean, mean, h, d, device="cuda", dtype=torch.bfloat16,
                                  requires_grad=grad) for _ in range(3))
        longest = max(lengths)
        window = (-1, -1) if args.window < 0 else (args.window, 0 if causal else args.window)
        kw = dict(causal=causal, window_size=window, softcap=args.softcap)
        calls = {
            "fa3gen": (lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, **kw),
                       (q, k, v)),
            "padded": (lambda: flash_attn_func(qp, kp, vp, **kw), (qp, kp, vp)),
        }
        if fa4 is not None:
            calls["fa4"] = (lambda: fa4(q, k, v, cu, longest, **kw), (q, k, v))
        if args.variants:
            key = make_key(direction, "bf16", d, varlen=True, **masking(**kw).key())  # as the call dispatches
            for info in runtime.get_library().variants:
                if info.key == key:
                    calls[f"v_{info.name}"] = (lambda name=info.name: flash_attn_varlen_func(
                        q, k, v, cu, cu, longest, longest, variant=name, **kw), (q, k, v))
        for mode in args.grids if direction == "fwd" else ():
            calls[f"grid_{mode}"] = (lambda mode=mode: with_grid(mode, lambda: flash_attn_varlen_func(
                q, k, v, cu, cu, longest, longest, **kw)), (q, k, v))
        res = measure(calls, direction, args.rounds, args.min_ms)
        flops = {"fa3gen": real_flops(lengths, h, d, causal, grad, args.window),
                 "padded": real_flops([mean] * (TOTAL // mean), h, d, causal, grad, args.window)}
        flops.update({name: flops["fa3gen"] for name in calls if name not in flops})
        row = dict(direction=direction, head_dim=d, causal=causal, mean=mean, heads=h,
                   sequences=len(lengths), longest=longest, flops=flops["fa3gen"],
                   window=list(window), softcap=args.softcap)
        for name, val in res.items():
            if isinstance(val, float):
                row[f"{name}_ms"], row[f"{name}_tflops"] = val, timing.tflops(flops[name], val)
            else:
                row[f"{name}_error"] = val
        rows.append(row)
        a, f4, pad = (row.get(f"{n}_tflops") for n in ("fa3gen", "fa4", "padded"))

        def num(x, name):
            return round(x) if x else row.get(f"{name}_error", "-")
        print(f"| {direction} | {d} | {causal} | {mean} | {len(lengths)} | {num(a, 'fa3gen')} | "
              f"{num(f4, 'fa4')} | {num(pad, 'padded')} | "
              f"{f'{a / f4:.2f}' if a and f4 else '-'} | {f'{a / pad:.2f}' if a and pad else '-'} |",
              flush=True)
        for name in (n for n in calls if n.startswith("v_")):
            if row.get(f"{name}_tflops") and a:
                print(f"  {name[2:]}: {row[f'{name}_tflops']:.0f} TFLOP/s "
                      f"({row[f'{name}_tflops'] / a:.3f}x)", flush=True)
        for mode in args.grids:
            if row.get(f"grid_{mode}_tflops") and a:
                print(f"  FA3GEN_GRID={mode}: {row[f'grid_{mode}_tflops']:.0f} TFLOP/s "
                      f"({row[f'grid_{mode}_tflops'] / a:.3f}x)", flush=True)
        del q, k, v, qp, kp, vp
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": bench.provenance(runtime.get_library()), "total_tokens": TOTAL, "rounds": args.rounds, "min_ms": args.min_ms,
                       "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
