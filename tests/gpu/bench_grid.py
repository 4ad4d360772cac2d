"""The dense forward's grid policy, measured: each (head_dim, causal, seqlen) row timed with
FA3GEN_GRID forced to each mode (auto: the launcher's choice; persistent: one CTA per SM;
tiles: one CTA per query tile) and, with --variants, with other built variants of the key, all
in one process, sustained and interleaved (fa3gen.timing.sustained_ms). --window W gives every
call the window (W, 0) if causal, (W, W) if not (the local variants), and its FLOPs count the
visible pairs only.

    python3 tests/gpu/bench_grid.py --head-dims 64 128 256 --seqlens 4096 16384 \
        [--causal no] [--window W] [--variants] [--json grid.json]

Not a pytest module. batch x seqlen = 16k tokens, hidden 2048, bf16, as `fa3gen bench`.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_varlen import CAUSALS, pairs, with_grid  # noqa: E402

from fa3gen import runtime, timing  # noqa: E402
from fa3gen.bench import HIDDEN, TOTAL_TOKENS  # noqa: E402
from fa3gen.contract import make_key  # noqa: E402
from fa3gen.ops import flash_attn_func, masking  # noqa: E402

MODES = ("auto", "persistent", "tiles")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="no")
    p.add_argument("--variants", action="store_true",
                   help="also every other built bf16 forward variant of the key (no feature axes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-ms", type=float, default=100.0)
    p.add_argument("--window", type=int, default=-1,
                   help="window (W, 0) for causal rows, (W, W) for the others (default: none)")
    p.add_argument("--json")
    args = p.parse_args()
    lib = runtime.get_library()
    causals = CAUSALS[args.causal]
    rows = []
    for d, causal, s in itertools.product(args.head_dims, causals, args.seqlens):
        h, b = HIDDEN // d, TOTAL_TOKENS // s
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        window = (-1, -1) if args.window < 0 else (args.window, 0 if causal else args.window)
        names = [None]
        if args.variants:
            key = make_key("fwd", "bf16", d, **masking(causal, window).key())  # as the call dispatches
            names += [x.name for x in lib.variants if x.key == key]
        calls = {}
        for name, mode in itertools.product(names, MODES):
            label = f"{name or 'default'} {mode}"
            calls[label] = (lambda name=name, mode=mode: with_grid(
                mode, lambda: flash_attn_func(q, k, v, causal=causal, window_size=window, variant=name)))
        flops = 4 * b * h * d * pairs(s, causal, args.window)
        ms = timing.sustained_ms(list(calls.values()), args.rounds, args.min_ms)
        base = ms[0]
        for label, t in zip(calls, ms):
            row = dict(head_dim=d, causal=causal, window=list(window), seqlen=s, call=label, ms=t,
                       tflops=timing.tflops(flops, t), vs_auto=base / t)
            rows.append(row)
            print(f"d{d} {'causal' if causal else 'nocausal'} w={args.window} s={s:6d} {label:55s} "
                  f"{row['tflops']:6.0f} TFLOP/s  {row['vs_auto']:.3f}x auto", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                   rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
