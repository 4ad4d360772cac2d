"""What a query tile's start and end cost, in key blocks: the local forward timed against the
window size at seqlen 16k (bf16, hidden 2048, causal windows (w, 0)), and a least-squares fit of
time per tile = a + b x (key blocks the tile visits), printed as a / b, the per-tile cost in
blocks. Run once per grid policy (the fit assumes tiles of about equal length: persistent
CTAs, windows up to 2048 keys):

    FA3GEN_GRID=persistent python3 tests/gpu/bench_window_sweep.py --json sweep_persistent.json
    FA3GEN_GRID=tiles      python3 tests/gpu/bench_window_sweep.py --json sweep_tiles.json

Not a pytest module. Sustained timing (fa3gen.timing.sustained_ms: the windows of one head
dim alternate, rotated, settled); TFLOP/s count the visible (query, key) pairs only.
"""

import argparse
import json
import os
import statistics

import torch

from fa3gen import runtime, timing
from fa3gen.ops import flash_attn_func
from bench_features import visible_pairs

SEQLEN = 16384


def _tiles(tile_m: int) -> int:
    """Query tiles of one head: a 192-row tile leaves a partial one at 16384 (86, not 85)."""
    return -(-SEQLEN // tile_m)


def blocks_visited(window: int, tile_m: int, tile_n: int) -> int:
    """Key blocks the query tiles of one head visit with window (window, 0) at SEQLEN."""
    total = 0
    for m in range(_tiles(tile_m)):
        first = max(0, m * tile_m - window) // tile_n
        last = (min(m * tile_m + tile_m, SEQLEN) - 1) // tile_n  # a last tile may be partial
        total += last - first + 1
    return total


def per_tile_blocks(rows: list[dict], tile_m: int, tile_n: int, max_window: int) -> float | None:
    """a / b of the fit ms / tiles = a + b * blocks / tiles over rows with window <= max_window."""
    tiles = _tiles(tile_m)
    pts = [(blocks_visited(r["window"], tile_m, tile_n) / tiles, r["ms"] / tiles)
           for r in rows if r["window"] <= max_window]
    if len(pts) < 2:
        return None
    b, a = statistics.linear_regression([x for x, _ in pts], [y for _, y in pts])
    return a / b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--fit-up-to", type=int, default=2048, help="largest window in the fit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-ms", type=float, default=60.0)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_window_sweep.py times kernels: it needs a CUDA GPU (Hopper sm_90)")
    lib = runtime.get_library()
    out = {"grid": os.environ.get("FA3GEN_GRID") or "auto", "seqlen": SEQLEN, "rows": [], "fits": {}}
    for d in args.head_dims:
        info = lib.find("fwd", "bf16", d, False, local=True)
        heads = 2048 // d
        q, k, v = (torch.randn(1, SEQLEN, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fns = [lambda w=w: flash_attn_func(q, k, v, causal=True, window_size=(w, 0)) for w in args.windows]
        rows = []
        for w, ms in zip(args.windows, timing.sustained_ms(fns, args.rounds, args.min_ms)):
            rows.append({"d": d, "variant": info.name, "window": w, "ms": ms,
                         "tflops": 4 * d * visible_pairs(SEQLEN, w) * heads / (ms * 1e-3) / 1e12})
            print(rows[-1], flush=True)
        fit = per_tile_blocks(rows, info.tile_m, info.tile_n, args.fit_up_to)
        out["fits"][str(d)] = fit
        print(f"d{d} {info.name}: a tile's start and end cost {fit:.2f} key blocks of {info.tile_n}"
              if fit is not None else f"d{d}: too few windows to fit", flush=True)
        out["rows"] += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
