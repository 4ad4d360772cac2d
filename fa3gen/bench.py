"""`fa3gen bench`: fa3gen vs PyTorch SDPA (cuDNN, FA2) on the FA3 paper grid, plus the GEMM ceiling.

Pure parts (grid, FLOPs, report/markdown rendering, plot) take plain dicts and run on CPU;
torch is imported only inside the GPU functions so fa3gen/cli.py stays torch-free.

Report (JSON) = {"header": {...}, "rows": [row, ...]}, row = {direction, dtype, head_dim, causal,
batch, seqlen, heads, variant, flops, ms: {backend: float|None}, tflops: {backend: float|None}}.
Backends: "fa3gen", "cudnn", "flash". Backward rows: direction "bwd", FLOPs 2.5x the forward's,
time of the backward alone (autograd.grad of a recorded forward) for every backend.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from fa3gen.contract import DTYPES, IN_CHECKOUT, REPO_ROOT, make_key
from fa3gen.errors import Fa3genError
from fa3gen.timing import GEMM_N, gemm_tflops, random_inputs, report_failure, tflops, time_or_none

# Reports go to the checkout's docs/ (what the repository keeps), else to the working directory.
DOCS_DIR = REPO_ROOT / "docs" if IN_CHECKOUT else Path(".")
RESULTS_DIR = DOCS_DIR / "results" if IN_CHECKOUT else Path(".")
TOTAL_TOKENS = 16384  # batch * seqlen (FA3 paper grid)
HIDDEN = 2048  # heads * head_dim
BACKENDS = ("fa3gen", "cudnn", "flash")
LABELS = {"fa3gen": "fa3gen", "cudnn": "cuDNN", "flash": "FA2"}
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

# ---------------------------------------------------------------------------------------------
# Pure parts.


def grid(seqlens, head_dims, total_tokens=TOTAL_TOKENS, hidden=HIDDEN) -> list[dict]:
    """Shapes of the paper grid: batch = total_tokens // seqlen, heads = hidden // head_dim."""
    shapes = []
    for d in head_dims:
        for s in seqlens:
            shapes.append(
                {"head_dim": d, "seqlen": s, "batch": max(1, total_tokens // s),
                 "heads": max(1, hidden // d)}
            )
    return shapes


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal, direction="fwd") -> float:
    """4*b*h*sq*sk*d (two GEMMs of 2 FLOPs per MAC), halved when causal, 2.5x for backward."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    if direction == "bwd":
        f *= 2.5
    return f


def make_row(direction, dtype, shape: dict, causal: bool, variant: str | None, ms: dict) -> dict:
    flops = attention_flops(shape["batch"], shape["heads"], shape["seqlen"], shape["seqlen"],
                            shape["head_dim"], causal, direction)
    return {
        "direction": direction, "dtype": dtype, "head_dim": shape["head_dim"], "causal": causal,
        "batch": shape["batch"], "seqlen": shape["seqlen"], "heads": shape["heads"],
        "variant": variant, "flops": flops,
        "ms": {b: ms.get(b) for b in BACKENDS},
        "tflops": {b: tflops(flops, ms.get(b)) for b in BACKENDS},
    }


def _groups(rows):
    """(direction, dtype, causal) -> rows, in a stable order (fwd before bwd, non-causal first)."""
    out: dict[tuple, list] = {}
    for r in sorted(rows, key=lambda r: (r["direction"] != "fwd", r["direction"], r["dtype"],
                                         r["causal"], r["head_dim"], r["seqlen"])):
        out.setdefault((r["direction"], r["dtype"], r["causal"]), []).append(r)
    return out


def _fmt(x, spec=".0f"):
    return "—" if x is None else format(x, spec)


def render_markdown(report: dict) -> str:
    """The block between the bench markers: provenance header and one table per group."""
    h = report["header"]
    lines = [
        BEGIN,
        "## Attention throughput (TFLOP/s)",
        "",
        f"- Date: {h.get('date')}; GPU: {h.get('gpu')}; commit: `{h.get('commit')}`",
        f"- torch {h.get('torch')}, CUDA {h.get('cuda')}, cuDNN {h.get('cudnn')}; "
        f"cuBLAS bf16 GEMM {GEMM_N}^3: {_fmt(h.get('gemm_tflops'))} TFLOP/s",
        f"- fa3gen library: {h.get('library')}",
        f"- Reproduce: `{h.get('command') or 'fa3gen bench'}`",
        "- Grid: batch*seqlen = 16384, heads*head_dim = 2048; FLOPs = 4*b*h*s^2*d, halved when "
        "causal (backward 2.5x). Median of timed launches (CUDA events); — = backend failed or "
        "not built. FA2 = PyTorch SDPA flash backend, cuDNN = SDPA cuDNN backend.",
    ]
    for (direction, dtype, causal), rows in _groups(report["rows"]).items():
        lines += [
            "",
            f"### {direction}, {dtype}, causal={causal}",
            "",
            "| head_dim | seqlen | fa3gen | cuDNN | FA2 | fa3gen/cuDNN | variant |",
            "|---:|---:|---:|---:|---:|---:|:---|",
        ]
        for r in rows:
            t = r["tflops"]
            ratio = t["fa3gen"] / t["cudnn"] if t.get("fa3gen") and t.get("cudnn") else None
            lines.append(
                f"| {r['head_dim']} | {r['seqlen']} | {_fmt(t.get('fa3gen'))} | "
                f"{_fmt(t.get('cudnn'))} | {_fmt(t.get('flash'))} | {_fmt(ratio, '.2f')} | "
                f"{r.get('variant') or '—'} |"
            )
    lines += _candidates_markdown(report["rows"])
    lines.append(END)
    return "\n".join(lines) + "\n"


# Defaults are judged on the seqlens that the targets name (1k..16k): short sequences are
# launch-bound and would reward whichever variant has the cheapest prologue.
PICK_MIN_SEQLEN = 1024


def pick_defaults(rows) -> dict:
    """Best candidate per dispatch key: highest geometric mean TFLOP/s over seqlens >= 1k.

    Returns {key string: {"variant": name, "geomean": {name: tflops}}} for rows carrying a
    'candidates' map (bench --all-variants)."""
    scores: dict = {}
    for r in rows:
        if not r.get("candidates") or r["seqlen"] < PICK_MIN_SEQLEN:
            continue
        key = f"{r['direction']}_{r['dtype']}_d{r['head_dim']}_{'causal' if r['causal'] else 'nocausal'}"
        for name, t in r["candidates"].items():
            scores.setdefault(key, {}).setdefault(name, []).append(t)
    picked = {}
    for key, by_name in sorted(scores.items()):
        geo = {n: (math.exp(sum(math.log(x) for x in ts) / len(ts)) if all(ts) else None)
               for n, ts in by_name.items()}
        valid = {n: g for n, g in geo.items() if g}
        picked[key] = {"variant": max(valid, key=valid.get) if valid else None, "geomean": geo}
    return picked


def _candidates_markdown(rows) -> list[str]:
    picked = pick_defaults(rows)
    if not picked:
        return []
    lines = ["", "### Candidates per dispatch key (geometric mean TFLOP/s, seqlen >= "
             f"{PICK_MIN_SEQLEN}; best first)", "", "| key | candidate | TFLOP/s | picked |",
             "|:---|:---|---:|:---:|"]
    for key, p in picked.items():
        for name, g in sorted(p["geomean"].items(), key=lambda kv: -(kv[1] or 0)):
            lines.append(f"| {key} | {name} | {_fmt(g)} | {'*' if name == p['variant'] else ''} |")
    return lines


def update_markdown(path: Path, block: str, begin: str = BEGIN, end: str = END,
                    title: str = "# fa3gen benchmarks\n\n") -> None:
    """Rewrite only the text between the markers (bench's by default); hand-written text
    elsewhere stays. A missing file starts as `title`."""
    path = Path(path)
    old = path.read_text() if path.exists() else title
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pat.search(old):
        new = pat.sub(lambda _: block, old, count=1)
    else:
        new = old + ("" if old.endswith("\n") else "\n") + "\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def write_json(report: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def plot(report: dict, path: Path) -> None:
    """One subplot per (head_dim, causal) [and direction], TFLOP/s vs seqlen, GEMM dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    head_dims = sorted({r["head_dim"] for r in rows})
    kinds = sorted({(r["direction"], r["dtype"], r["causal"]) for r in rows},
                   key=lambda k: (k[0] != "fwd", k))
    if not rows:
        kinds, head_dims = [("fwd", "bf16", False)], [0]
    fig, axes = plt.subplots(len(kinds), len(head_dims), squeeze=False,
                             figsize=(4.2 * len(head_dims), 3.4 * len(kinds)))
    gemm = report["header"].get("gemm_tflops")
    for i, kind in enumerate(kinds):
        for j, d in enumerate(head_dims):
            ax = axes[i][j]
            sel = sorted((r for r in rows if (r["direction"], r["dtype"], r["causal"]) == kind
                          and r["head_dim"] == d), key=lambda r: r["seqlen"])
            for b in BACKENDS:
                pts = [(r["seqlen"], r["tflops"].get(b)) for r in sel]
                pts = [(s, t) for s, t in pts if t is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=LABELS[b])
            if gemm:
                ax.axhline(gemm, ls="--", color="gray", label="cuBLAS GEMM")
            ax.set_xscale("log", base=2)
            if sel:
                ax.set_xticks([r["seqlen"] for r in sel], [str(r["seqlen"]) for r in sel])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{kind[0]} {kind[1]} d={d} causal={kind[2]}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    h = report["header"]
    fig.suptitle(f"{h.get('gpu')}  commit {str(h.get('commit'))[:10]}  {h.get('date')}",
                 fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def git_commit() -> str | None:
    """FA3GEN_COMMIT when set (a copied tree's .git can be stale), else git's HEAD."""
    if os.environ.get("FA3GEN_COMMIT"):
        return os.environ["FA3GEN_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
            return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _dtype_list(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in names if x not in DTYPES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of dtypes from {', '.join(DTYPES)} "
            f"(e.g. bf16,fp16), got {s!r}")
    return names


def int_list(example: str):
    """An argparse type: a comma-separated list of positive integers, `example` in its message."""
    def parse(s: str) -> list[int]:
        try:
            values = [int(x) for x in s.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of positive integers (e.g. {example}), got {s!r}")
        return values
    return parse


def count(minimum: int):
    """An argparse type: a whole number of at least `minimum`."""
    def parse(s: str) -> int:
        try:
            value = int(s)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {minimum}, got {s!r}")
        return value
    return parse


# ---------------------------------------------------------------------------------------------
# CLI.


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark fa3gen vs cuDNN/FA2 on the FA3 paper grid")
    p.add_argument("--spec", default=None,
                   help="spec name, specs/<name>.yaml or a .so (default: FA3GEN_LIB, else h100)")
    p.add_argument("--seqlens", type=int_list("1024,4096"),
                   default=[512, 1024, 2048, 4096, 8192, 16384], metavar="N,N,...",
                   help="sequence lengths, comma-separated (default 512,1024,...,16384; "
                        "batch = 16384 // seqlen)")
    p.add_argument("--head-dims", type=int_list("64,128"), default=[64, 128, 256],
                   metavar="D,D,...", help="head dims, comma-separated (default 64,128,256; "
                   "heads = 2048 // head_dim)")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both",
                   help="causal rows, non-causal rows or both (default)")
    p.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both",
                   help="forward rows, backward rows or both (default)")
    p.add_argument("--dtype", type=_dtype_list, default=["bf16"], metavar="DTYPE,...",
                   help="bf16, fp16 or both comma-separated (default bf16)")
    p.add_argument("--warmup", type=count(0), default=5,
                   help="untimed launches before timing each case (default 5)")
    p.add_argument("--iters", type=count(1), default=30,
                   help="timed launches per case; the median is reported (default 30)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "bench.json",
                   help="JSON report (default docs/results/bench.json)")
    p.add_argument("--markdown", type=Path, default=DOCS_DIR / "BENCHMARKS.md",
                   help="markdown file whose bench markers get the tables "
                        "(default docs/BENCHMARKS.md)")
    p.add_argument("--plot", type=Path, default=RESULTS_DIR / "bench.png",
                   help="plot of TFLOP/s vs seqlen (default docs/results/bench.png)")
    p.add_argument("--no-baselines", action="store_true", help="time fa3gen only (no SDPA)")
    p.add_argument("--all-variants", action="store_true",
                   help="also time every built variant of each shape's key (rows gain a "
                        "'candidates' map): the measurement that picks dispatch defaults")
    p.set_defaults(func=run)
    return p


def provenance(lib) -> dict:
    """Report header shared by bench and ablate: where, when and how the numbers were taken."""
    import torch

    return {
        "gpu": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "library": str(lib.path),
        "build_info": lib.build_info,
        "command": shlex.join(["fa3gen", *sys.argv[1:]]),
    }


def run(args) -> int:
    import torch

    from fa3gen import runtime
    from fa3gen.ops import TORCH_DTYPES

    if not torch.cuda.is_available():
        raise Fa3genError("fa3gen bench needs a CUDA GPU (Hopper sm_90)")
    lib = runtime.use_spec(args.spec) if args.spec else runtime.get_library()
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]

    header = provenance(lib)
    header["gemm_tflops"] = gemm_tflops(args.warmup, args.iters)
    print(f"cuBLAS bf16 GEMM {GEMM_N}^3: {_fmt(header['gemm_tflops'], '.1f')} TFLOP/s")

    rows = []
    directions = ["fwd", "bwd"] if args.direction == "both" else [args.direction]
    runs = ((dr, d, c) for dr in directions for d in args.dtype for c in causals)
    for direction, dt_name, causal in runs:
        dtype = TORCH_DTYPES[dt_name]
        bench_shape = bench_fwd_shape if direction == "fwd" else bench_bwd_shape
        for shape in grid(args.seqlens, args.head_dims):
            row = bench_shape(lib, shape, causal, dtype, args)
            rows.append(row)
            t = row["tflops"]
            print(f"{direction} {dt_name} d={shape['head_dim']:<3} s={shape['seqlen']:<6} "
                  f"causal={causal!s:<5} fa3gen {_fmt(t['fa3gen']):>4}  cuDNN "
                  f"{_fmt(t['cudnn']):>4}  FA2 {_fmt(t['flash']):>4}  TFLOP/s  "
                  f"[{row['variant']}]", flush=True)

    report = {"header": header, "rows": rows}
    if args.all_variants:
        report["picked_defaults"] = pick_defaults(rows)
        for key, p in report["picked_defaults"].items():
            print(f"best for {key}: {p['variant']}")
    write_json(report, args.out)
    update_markdown(args.markdown, render_markdown(report))
    plot(report, args.plot)
    print(f"wrote {args.out}, {args.markdown}, {args.plot}")
    return 0


# ---------------------------------------------------------------------------------------------
# GPU measurement (timing itself is fa3gen.timing's).


def _find_variant(lib, direction, dt_name, d, causal) -> str | None:
    try:
        return lib.find(direction, dt_name, d, causal).name
    except Fa3genError as e:
        print(f"  fa3gen: {str(e).splitlines()[0]}", file=sys.stderr)
        return None


def _time_candidates(lib, key: tuple, flops: float, call, args) -> dict:
    """TFLOP/s of every built variant of `key` (contract.make_key), each
    timed as call(variant_name): the `candidates` map of --all-variants."""
    return {info.name: tflops(flops, time_or_none(info.name, lambda: call(info.name),
                                                  args.warmup, args.iters))
            for info in lib.variants if info.key == key}


def bench_fwd_shape(lib, shape: dict, causal: bool, dtype, args) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa3gen.ops import _DTYPES, flash_attn_func

    b, s, h, d = shape["batch"], shape["seqlen"], shape["heads"], shape["head_dim"]
    dt_name = _DTYPES[dtype]
    q, k, v = random_inputs(shape, dtype, 3)
    ms: dict = {}
    variant = _find_variant(lib, "fwd", dt_name, d, causal)
    if variant is not None:
        ms["fa3gen"] = time_or_none(
            "fa3gen", lambda: flash_attn_func(q, k, v, causal=causal, variant=variant),
            args.warmup, args.iters)
    candidates = {}
    if getattr(args, "all_variants", False):
        candidates = _time_candidates(
            lib, make_key("fwd", dt_name, d, causal), attention_flops(b, h, s, s, d, causal),
            lambda name: flash_attn_func(q, k, v, causal=causal, variant=name), args)
    if not args.no_baselines:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA layout (b, h, s, d), views

        def sdpa(backend):
            def fn():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return fn

        ms["cudnn"] = time_or_none("cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION),
                                   args.warmup, args.iters)
        ms["flash"] = time_or_none("FA2", sdpa(SDPBackend.FLASH_ATTENTION),
                                   args.warmup, args.iters)
    del q, k, v
    torch.cuda.empty_cache()
    row = make_row("fwd", dt_name, shape, causal, variant, ms)
    if candidates:
        row["candidates"] = candidates
    return row


def bench_bwd_shape(lib, shape: dict, causal: bool, dtype, args) -> dict:
    """Backward alone: each backend records one forward, then autograd.grad is timed."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa3gen.ops import _DTYPES, flash_attn_func

    d, dt_name = shape["head_dim"], _DTYPES[dtype]
    q, k, v, dout = random_inputs(shape, dtype, 4)
    for t in (q, k, v):
        t.requires_grad_(True)
    ms: dict = {}

    def timed_grad(label, forward):
        try:
            out = forward()
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            report_failure(f"{label} forward", e)
            return None
        return time_or_none(
            label, lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
            args.warmup, args.iters)

    variant = _find_variant(lib, "bwd", dt_name, d, causal)
    fwd_variant = _find_variant(lib, "fwd", dt_name, d, causal)
    if variant is not None and fwd_variant is not None:
        ms["fa3gen"] = timed_grad("fa3gen", lambda: flash_attn_func(q, k, v, causal=causal))
    candidates = {}
    if getattr(args, "all_variants", False) and fwd_variant is not None:
        # Every backward variant of the key, called through the op (same work as the autograd
        # path minus autograd's bookkeeping), so that candidates compare among themselves.
        scale = d**-0.5
        qd, kd, vd = (t.detach() for t in (q, k, v))
        out, lse = torch.ops.fa3gen.fwd(qd, kd, vd, causal, scale, fwd_variant)
        flops = attention_flops(shape["batch"], shape["heads"], shape["seqlen"], shape["seqlen"],
                                d, causal, "bwd")
        candidates = _time_candidates(
            lib, make_key("bwd", dt_name, d, causal), flops,
            lambda name: torch.ops.fa3gen.bwd(dout, qd, kd, vd, out, lse, causal, scale, name, False),
            args)
    if not args.no_baselines:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def sdpa(backend):
            def fn():
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                return out.transpose(1, 2)  # the grad of the transposed view is dout
            return fn

        ms["cudnn"] = timed_grad("cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION))
        ms["flash"] = timed_grad("FA2", sdpa(SDPBackend.FLASH_ATTENTION))
    del q, k, v, dout
    torch.cuda.empty_cache()
    row = make_row("bwd", dt_name, shape, causal, variant, ms)
    if candidates:
        row["candidates"] = candidates
    return row
