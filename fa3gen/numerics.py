"""`fa3gen numerics`: the FlashAttention-3 paper's numerical-error study.

Data as in the paper: every entry of Q, K, V drawn from N(0, 1), plus N(0, 100) with
probability 0.001 (outliers); reference: attention in FP64; error: RMSE of the output against
it. Rows:
- emulated in PyTorch (any device; fa3gen.reference): standard attention in fp16 (scores and
  softmax in fp16: the paper's baseline), FlashAttention-style fp16 and bf16 (fp32 scores and
  softmax, P rounded to the input dtype, fp32 accumulation), and FP8 e4m3 with per-tensor
  scales (the baseline), block quantization only, incoherent processing (random-sign Hadamard)
  only, and both (reference.fp8_attention_emulated);
- measured on the GPU when one is present: fa3gen's kernels (bf16, fp16, e4m3 per tensor
  without and with incoherent processing), PyTorch SDPA's FlashAttention-2 backend (fp16), and
  cuDNN's FP8 SDPA when cudnn-frontend imports (cudnn_fp8_row: the e4m3 kernel's per-tensor
  inputs, P times 256 as in fa3gen).

Writes docs/results/numerics.json and the marked block of docs/NUMERICS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from fa3gen.bench import DOCS_DIR, RESULTS_DIR, update_markdown
from fa3gen.errors import InvalidInputError

BEGIN, END = "<!-- numerics:begin -->", "<!-- numerics:end -->"
# The paper's RMSE (FlashAttention-3, section 4.3), by our row names.
PAPER = {"standard_fp16": 3.2e-4, "flash_fp16": 1.9e-4, "sdpa_fa2_fp16": 1.9e-4,
         "fa3gen_fp16": 1.9e-4, "fp8_per_tensor": 2.4e-2, "fp8_block_hadamard": 9.1e-3,
         "fp8_hadamard": 9.3e-3, "fp8_block": 2.4e-2, "fa3gen_fp8_per_tensor": 2.4e-2,
         "fa3gen_fp8_hadamard": 9.3e-3, "fa3gen_fp8_block": 2.4e-2,
         "fa3gen_fp8_block_hadamard": 9.1e-3}
LABELS = {
    "standard_fp16": "standard attention, fp16 (scores and softmax in fp16)",
    "flash_fp16": "FlashAttention-style fp16, emulated (fp32 softmax, P in fp16)",
    "flash_bf16": "FlashAttention-style bf16, emulated",
    "fa3gen_fp16": "fa3gen kernel, fp16",
    "fa3gen_bf16": "fa3gen kernel, bf16",
    "sdpa_fa2_fp16": "PyTorch SDPA FlashAttention-2 backend, fp16",
    "fp8_per_tensor": "fp8 e4m3, per-tensor scales (baseline), emulated",
    "fp8_block": "fp8, block quantization only, emulated",
    "fp8_hadamard": "fp8, incoherent processing only, emulated",
    "fp8_block_hadamard": "fp8, block quantization + incoherent processing, emulated",
    "fa3gen_fp8_per_tensor": "fa3gen e4m3 kernel, per-tensor scales",
    "fa3gen_fp8_hadamard": "fa3gen e4m3 kernel, per-tensor scales + incoherent processing",
    "fa3gen_fp8_block": "fa3gen e4m3 kernel, block scales at its tiles (fa3gen.quantize_fp8)",
    "fa3gen_fp8_block_hadamard": "fa3gen e4m3 kernel, block scales + incoherent processing",
    "cudnn_fp8": "cuDNN fp8 SDPA, per-tensor scales (the e4m3 kernel's inputs, P times 256)",
}
DEFAULT_SHAPES = ((1, 8192, 2, 128), (1, 4096, 4, 64))  # (batch, seqlen, heads, head_dim)
BLOCK = 128  # rows per scale block (the kernels' tile)


def paper_inputs(shape, seed: int, device="cpu"):
    """q, k, v in fp64: N(0, 1) plus, with probability 0.001, N(0, 100)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)

    def draw():
        x = torch.randn(shape, generator=g, device=device, dtype=torch.float64)
        outlier = torch.rand(shape, generator=g, device=device, dtype=torch.float64) < 1e-3
        return x + outlier * 10.0 * torch.randn(shape, generator=g, device=device,
                                                dtype=torch.float64)
    return draw(), draw(), draw()


def rmse(out, ref) -> float:
    return float(((out.double() - ref) ** 2).mean().sqrt())


def _attention(q, k, v, score_dtype, p_dtype):
    """softmax(q k^T / sqrt(d)) v with scores and softmax in score_dtype, P rounded to p_dtype
    and the PV product accumulated in score_dtype; (batch, seqlen, heads, d) layout."""
    import torch

    qt, kt, vt = (t.transpose(1, 2).to(score_dtype) for t in (q, k, v))
    s = torch.matmul(qt, kt.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s, dim=-1).to(p_dtype).to(score_dtype)
    return torch.matmul(p, vt.to(p_dtype).to(score_dtype)).transpose(1, 2)


def emulated_rows(q, k, v) -> dict:
    """{row: output} of the PyTorch emulations (inputs fp64)."""
    import torch

    from fa3gen.reference import fp8_attention_emulated

    h16, b16 = q.half(), q.bfloat16()
    rows = {
        "standard_fp16": _attention(h16, k.half(), v.half(), torch.float16, torch.float16),
        "flash_fp16": _attention(h16.float(), k.half().float(), v.half().float(), torch.float32,
                                 torch.float16).half(),
        "flash_bf16": _attention(b16.float(), k.bfloat16().float(), v.bfloat16().float(),
                                 torch.float32, torch.bfloat16).bfloat16(),
    }
    for name, block, hadamard in (("fp8_per_tensor", None, False), ("fp8_block", BLOCK, False),
                                  ("fp8_hadamard", None, True),
                                  ("fp8_block_hadamard", BLOCK, True)):
        rows[name] = fp8_attention_emulated(q.float(), k.float(), v.float(), block_q=block,
                                            block_k=block, hadamard=hadamard)
    return rows


def gpu_rows(q, k, v) -> tuple[dict, dict, dict]:
    """({row: output}, {row: why not measured}, {row: a note on how it ran}) of the kernels on
    the GPU."""
    import torch

    outs, missing, notes = {}, {}, {}
    try:
        from fa3gen.ops import flash_attn_func

        for dt, name in ((torch.float16, "fa3gen_fp16"), (torch.bfloat16, "fa3gen_bf16")):
            outs[name] = flash_attn_func(q.to(dt), k.to(dt), v.to(dt))
    except Exception as e:
        missing["fa3gen_fp16"] = missing["fa3gen_bf16"] = str(e).splitlines()[0][:200]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            qt, kt, vt = (t.half().transpose(1, 2) for t in (q, k, v))
            outs["sdpa_fa2_fp16"] = torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt).transpose(1, 2)
    except Exception as e:
        missing["sdpa_fa2_fp16"] = str(e).splitlines()[0][:200]
    try:
        outs.update(fa3gen_fp8_rows(q, k, v))
    except Exception as e:
        for name in FA3GEN_FP8_ROWS:
            missing[name] = str(e).splitlines()[0][:200]
    try:
        out, detail = cudnn_fp8_row(q, k, v)  # detail: the output's dtype, or why not measured
        (missing if out is None else notes)["cudnn_fp8"] = detail
        if out is not None:
            outs["cudnn_fp8"] = out
    except Exception as e:
        missing["cudnn_fp8"] = str(e).splitlines()[0][:200]
    return outs, missing, notes


def cudnn_fp8_row(q, k, v):
    """(output, its dtype) of cuDNN's fp8 SDPA on the inputs of the fa3gen_fp8_per_tensor row
    (the same per-tensor e4m3 quantization and descales), P times 256 before its e4m3 cast as
    in fa3gen; or (None, why not). Output bf16 where cuDNN builds that graph, else e4m3 scaled
    by 448 / max|V| (O is a convex combination of V's rows, so it cannot overflow), divided
    back here: that row then also carries the output's e4m3 rounding."""
    import torch

    from fa3gen import bench
    from fa3gen.fp8 import quantize_fp8
    from fa3gen.reference import FP8_P_SCALE

    q8, k8, v8, descales = quantize_fp8(q, k, v, block=False)
    v_max = float(v8.float().abs().max() * descales["v_descale"].float().max())
    errors = []
    for out_bf16 in (True, False):
        o_scale = 1.0 if out_bf16 else 448.0 / v_max
        try:
            graph = bench.cudnn_fp8_graph(q8, k8, v8, False, descales, p_scale=FP8_P_SCALE,
                                          out_bf16=out_bf16, o_scale=o_scale)
        except Exception as e:  # e.g. no bf16 output for this graph: try e4m3
            errors.append(str(e).splitlines()[0][:120])
            continue
        if graph is None:
            return None, "cudnn-frontend does not import"
        run, out = graph
        run()
        torch.cuda.synchronize()
        if out_bf16:
            return out, "bf16 output"
        return out.view(torch.float8_e4m3fn).float() / o_scale, "e4m3 output (scaled by 448 / max|V|)"
    return None, "; ".join(errors)


FA3GEN_FP8_ROWS = {  # row: (block scales, incoherent processing)
    "fa3gen_fp8_per_tensor": (False, False), "fa3gen_fp8_hadamard": (False, True),
    "fa3gen_fp8_block": (True, False), "fa3gen_fp8_block_hadamard": (True, True)}


def fa3gen_fp8_rows(q, k, v, seed: int = 0) -> dict:
    """The e4m3 kernel on inputs quantized by fa3gen.quantize_fp8, the scales as its descales:
    per tensor or per (batch, head, block of the serving variant's tiles), without and with
    incoherent processing (the same seed as the emulated rows). The block rows' blocks are the
    kernel's (tile_m rows of q, tile_n of k and v), not the emulation's 128."""
    from fa3gen.fp8 import quantize_fp8
    from fa3gen.ops import flash_attn_func

    rows = {}
    for name, (block, hadamard) in FA3GEN_FP8_ROWS.items():
        q8, k8, v8, descales = quantize_fp8(q, k, v, block=block, hadamard=hadamard, seed=seed)
        rows[name] = flash_attn_func(q8, k8, v8, **descales)
    return rows


def study(shapes, seed: int, device: str) -> dict:
    import torch

    from fa3gen.reference import FP8_P_SCALE, attention_reference

    results = []
    for shape in shapes:
        q, k, v = paper_inputs(shape, seed, device)
        ref, _ = attention_reference(q, k, v, upcast=False)  # fp64 in, fp64 out
        outs = emulated_rows(q, k, v)
        missing, notes = {}, {}
        if device == "cuda":
            got, missing, notes = gpu_rows(q, k, v)
            outs.update(got)
        else:
            for name in ("fa3gen_fp16", "fa3gen_bf16", "sdpa_fa2_fp16", *FA3GEN_FP8_ROWS,
                         "cudnn_fp8"):
                missing[name] = "needs a GPU (this run: cpu)"
        row = {"shape": list(shape), "rmse": {n: rmse(o, ref) for n, o in outs.items()},
               "not_measured": missing, "notes": notes}
        if device == "cuda":
            torch.cuda.empty_cache()
        results.append(row)
    return {"seed": seed, "device": device, "block_rows": BLOCK, "p_scale": FP8_P_SCALE,
            "results": results}


def render_markdown(report: dict) -> str:
    shapes = [r["shape"] for r in report["results"]]
    head = " | ".join(f"RMSE at ({', '.join(map(str, s))})" for s in shapes)
    lines = [BEGIN, f"Device: {report['device']}, seed {report['seed']}; shapes are (batch, seqlen, heads, "
             f"head_dim); fp8 scale blocks of {report['block_rows']} rows, P cast to e4m3 times "
             f"{report['p_scale']:g}.", "",
             f"| row | paper | {head} |", "|---|---|" + "---|" * len(shapes)]
    for name, label in LABELS.items():
        cells = []
        for r in report["results"]:
            if name in r["rmse"]:
                note = r.get("notes", {}).get(name)
                cells.append(f"{r['rmse'][name]:.2e}" + (f" ({note})" if note else ""))
            else:
                cells.append(f"not measured: {r['not_measured'].get(name, '-')}")
        paper = f"{PAPER[name]:.1e}" if name in PAPER else "-"
        cells = [c.replace("|", "\\|") for c in cells]  # a note's max|V| must not end the cell
        lines.append(f"| {label} | {paper} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [END]) + "\n"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("numerics", help="the FlashAttention-3 paper's RMSE study "
                              "(outliers, FP64 reference) for fp16/bf16/fp8 attention")
    p.add_argument("--shape", action="append", type=_shape, default=None, metavar="B,S,H,D",
                   help="problem shape (repeatable; default 1,8192,2,128 and 1,4096,4,64)")
    p.add_argument("--seed", type=_seed, default=0, help="random seed of the inputs (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available (adds the kernel rows)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "numerics.json",
                   help="the JSON results (default docs/results/numerics.json)")
    p.add_argument("--doc", type=Path, default=DOCS_DIR / "NUMERICS.md",
                   help="the markdown report, between its markers (default docs/NUMERICS.md)")
    p.set_defaults(func=run)
    return p


def _shape(text: str) -> tuple[int, int, int, int]:
    try:
        b, s, h, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,S,H,D (four ints), got {text!r}")
    if min(b, s, h, d) < 1 or d & (d - 1):
        raise argparse.ArgumentTypeError(f"{text}: sizes must be >= 1 and head_dim a power of "
                                         "two (the Hadamard transform)")
    return b, s, h, d


def _seed(text: str) -> int:
    """A seed torch.Generator takes: an int in [0, 2^64)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}")
    if not 0 <= seed < 2**64:
        raise argparse.ArgumentTypeError(f"{text}: a seed is in [0, 2^64)")
    return seed


def run(args) -> int:
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("--device cuda: no CUDA GPU here (--device cpu or auto runs the "
                                "PyTorch rows only)")
    try:
        report = study(args.shape or DEFAULT_SHAPES, args.seed, device)
    except RuntimeError as e:  # torch.OutOfMemoryError too: the fp64 reference is the largest
        if "allocate" not in str(e):
            raise
        raise InvalidInputError(f"--shape too large for the {device} memory here (the fp64 "
                                f"reference holds seqlen x seqlen scores a head): "
                                f"{str(e).splitlines()[0][:200]}") from e
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    update_markdown(args.doc, render_markdown(report), BEGIN, END, title="# Numerics\n\n")
    for r in report["results"]:
        print(f"shape {tuple(r['shape'])}: " + ", ".join(
            f"{n} {e:.2e}" for n, e in r["rmse"].items()), file=sys.stdout, flush=True)
    print(f"wrote {args.out} and {args.doc}")
    return 0
