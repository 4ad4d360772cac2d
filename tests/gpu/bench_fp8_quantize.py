"""The fp8 quantizer's bandwidth against a device-to-device copy, sustained (issue 14: at least
70% of the copy's bandwidth):
    python3 tests/gpu/bench_fp8_quantize.py [--baseline-so OLD.so] [--json out.json]
Shapes of the bench grid's 16k tokens (batch x seqlen = 16384, heads x head_dim = 2048) and a
larger one; bytes counted: the 16-bit input read once and the e4m3 output written once (rotary
tables not counted). Columns: block scales of 128 rows; with the Hadamard transform; with
rotary (rotary_dim = d, halves) and the Hadamard transform in the same kernel; one scale per
tensor; the PyTorch path (fp8.quantize); --block-rows adds block scales of other row counts
(the fp8 defaults' tile_n: 96, 160, 192), --hadamard-rows the Hadamard transform at each.
--baseline-so times another library's fa3gen_quantize_fp8 (e.g. an earlier commit's build; its
params struct must be a prefix of this one's) in the same process, interleaved (128-row blocks,
Hadamard, and each --block-rows, with --hadamard-rows too). --attention adds what a user pays in
all at the bench grid's d128 shapes (16k tokens, 16 heads; needs default e4m3 d128 variants):
fa3gen.quantize_fp8 of q, k, v (the public call, block scales, with and without the Hadamard
transform) beside the fp8 attention it feeds, causal and not. Not a pytest module."""
import argparse
import ctypes
import json

import torch

import fa3gen
from fa3gen import bench, fp8, runtime, timing


class _RawQuantizer:
    """A library file's fa3gen_quantize_fp8 called directly (no ABI check: an A/B baseline)."""

    def __init__(self, path: str):
        self._fn = ctypes.CDLL(path).fa3gen_quantize_fp8
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(runtime.QuantizeParams), ctypes.c_void_p]

    def quantize_fp8(self, p, stream) -> None:
        if self._fn(ctypes.byref(p), stream) != 0:
            raise RuntimeError("baseline quantizer failed")


SHAPES = ((1, 16384, 16, 128), (8, 8192, 16, 128), (1, 16384, 8, 256), (1, 16384, 32, 64))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-so", help="a library whose quantizer is timed beside this one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-ms", type=float, default=100)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--block-rows", type=int, nargs="+", default=[],
                    help="also time block scales of these row counts (columns blocks_<rows>)")
    ap.add_argument("--hadamard-rows", action="store_true",
                    help="also time the Hadamard transform at each --block-rows (columns "
                         "hadamard_<rows>; the defaults' q and k blocks take it)")
    ap.add_argument("--attention", action="store_true",
                    help="also time quantize_fp8 beside the attention it feeds")
    args = ap.parse_args()
    lib = runtime.get_library()
    if not lib.has_quantizer:
        raise SystemExit("the library has no fp8 quantizer: build a spec with e4m3 variants")
    base = _RawQuantizer(args.baseline_so) if args.baseline_so else None
    rows = []
    for b, s, h, d in SHAPES:
        x = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        src = torch.empty(x.numel() * 3 // 2, dtype=torch.uint8, device="cuda")  # 2 + 1 bytes
        dst = torch.empty_like(src)
        signs = torch.ones(d, device="cuda")
        angle = torch.rand(s, d // 2, device="cuda")
        rot = (angle.cos(), angle.sin())
        fns = {"copy": lambda: dst.copy_(src),
               "blocks": lambda: fp8._quantize_kernel(lib, x, 128, None),
               "hadamard": lambda: fp8._quantize_kernel(lib, x, 128, signs),
               "rotary_hadamard": lambda: fp8._quantize_kernel(lib, x, 128, signs, rot),
               "tensor": lambda: fp8._quantize_kernel(lib, x, None, None),
               "pytorch": lambda: fp8.quantize(x, 128)}
        for prefix, quantizer in (("", lib), ("baseline_", base)):
            if quantizer is None:
                continue
            if prefix:
                fns["baseline_blocks"] = lambda: fp8._quantize_kernel(base, x, 128, None)
                fns["baseline_hadamard"] = lambda: fp8._quantize_kernel(base, x, 128, signs)
            for rows_per_block in args.block_rows:
                fns[f"{prefix}blocks_{rows_per_block}"] = (
                    lambda r=rows_per_block, q=quantizer: fp8._quantize_kernel(q, x, r, None))
                if args.hadamard_rows:
                    fns[f"{prefix}hadamard_{rows_per_block}"] = (
                        lambda r=rows_per_block, q=quantizer: fp8._quantize_kernel(q, x, r, signs))
        ms = dict(zip(fns, timing.sustained_ms(list(fns.values()), args.rounds, args.min_ms)))
        moved = x.numel() * 3  # bytes: bf16 in, e4m3 out
        gbs = {k: (2 * src.numel() if k == "copy" else moved) / m / 1e6 for k, m in ms.items()}
        row = {"shape": [b, s, h, d], "gb_s": gbs, "us": {k: m * 1e3 for k, m in ms.items()},
               "of_copy": {k: g / gbs["copy"] for k, g in gbs.items()}}
        rows.append(row)
        print(f"(b, s, h, d) = {(b, s, h, d)}: copy {gbs['copy']:.0f} GB/s; " + ", ".join(
            f"{k} {gbs[k]:.0f} ({row['of_copy'][k]:.0%}, {row['us'][k]:.0f} us)"
            for k in fns if k != "copy"))
    out = {"header": bench.provenance(lib), "rows": rows}
    if args.attention:
        out["with_attention"] = with_attention(args.rounds, args.min_ms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def with_attention(rounds: int, min_ms: float) -> list:
    """quantize_fp8 (three tensors, the public call) and the fp8 attention on its output, timed
    sustained in one process: the share of a user's time that goes to quantizing."""
    rows = []
    for s in (1024, 4096, 16384):
        b, h, d = 16384 // s, 16, 128
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            q8, k8, v8, ds = fa3gen.quantize_fp8(q, k, v, causal=causal)
            fns = [lambda: fa3gen.quantize_fp8(q, k, v, causal=causal),
                   lambda: fa3gen.quantize_fp8(q, k, v, causal=causal, hadamard=True),
                   lambda: fa3gen.flash_attn_func(q8, k8, v8, causal=causal, **ds)]
            quant, quant_h, attn = timing.sustained_ms(fns, rounds, min_ms)
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            row = {"shape": [b, s, h, d], "causal": causal, "quantize_us": quant * 1e3,
                   "quantize_hadamard_us": quant_h * 1e3, "attention_us": attn * 1e3,
                   "attention_tflops": flops / attn / 1e9,
                   "quantize_share": quant / (quant + attn),
                   "quantize_hadamard_share": quant_h / (quant_h + attn)}
            rows.append(row)
            print(f"(b, s, h, d) = {(b, s, h, d)} causal={causal}: quantize_fp8 {quant * 1e3:.0f} us "
                  f"(Hadamard {quant_h * 1e3:.0f} us), attention {attn * 1e3:.0f} us "
                  f"({row['attention_tflops']:.0f} TFLOP/s): quantizing is "
                  f"{row['quantize_share']:.0%} ({row['quantize_hadamard_share']:.0%}) of the total")
    return rows


if __name__ == "__main__":
    main()
