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
import contextlib
import datetime as _dt
import math
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from fa3gen.contract import DTYPES, IN_CHECKOUT, REPO_ROOT, library_manifest, make_key
from fa3gen.errors import Fa3genError
from fa3gen.files import write_atomically
from fa3gen.timing import (GEMM_N, ORDERS, STEADY_FROM_S, PowerSampler, gemm_tflops, joules_per_pflop,
                           random_inputs, reason_counts, report_failure, settle_for, steady_ms,
                           sustained_ms, tflops, time_or_none)

# Reports go to the checkout's docs/ (what the repository keeps), else to the working directory.
DOCS_DIR = REPO_ROOT / "docs" if IN_CHECKOUT else Path(".")
RESULTS_DIR = DOCS_DIR / "results" if IN_CHECKOUT else Path(".")
TOTAL_TOKENS = 16384  # batch * seqlen (FA3 paper grid)
HIDDEN = 2048  # heads * head_dim
BACKENDS = ("fa3gen", "cudnn", "flash", "fa4")  # fa4: when flash_attn.cute imports
LABELS = {"fa3gen": "fa3gen", "cudnn": "cuDNN", "flash": "FA2", "fa4": "FA4"}
PEERS = ("cudnn", "flash", "fa4")
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


def causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """The (query, key) pairs a causal mask aligned bottom-right lets through (query i sees
    keys j <= i + seqlen_k - seqlen_q): rows past the keys see none."""
    first = max(seqlen_k - seqlen_q + 1, 1)  # keys the first row that sees any sees
    return (seqlen_k * (seqlen_k + 1) - (first - 1) * first) // 2


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal, direction="fwd") -> float:
    """4*b*h*pairs*d (two GEMMs of 2 FLOPs per MAC), 2.5x for backward. Causal pairs follow
    the peers' convention, sq*sk/2 on square shapes (the diagonal counted half); on others the
    visible pairs less half a diagonal (FA3's sq*(sk - sq/2) for sq <= sk; rows that see no
    key count nothing)."""
    pairs = seqlen_q * seqlen_k
    if causal:
        pairs = causal_pairs(seqlen_q, seqlen_k) - min(seqlen_q, seqlen_k) / 2
    f = 4.0 * batch * heads * pairs * head_dim
    if direction == "bwd":
        f *= 2.5
    return f


def make_row(direction, dtype, shape: dict, causal: bool, variant: str | None, ms: dict,
             power: dict | None = None, clock: dict | None = None, reasons: dict | None = None) -> dict:
    """power / clock / reasons: mean board W, SM MHz and the clock-event reasons per backend
    while it ran (sustained timing)."""
    flops = attention_flops(shape["batch"], shape["heads"], shape["seqlen"], shape["seqlen"],
                            shape["head_dim"], causal, direction)
    power, clock, reasons = power or {}, clock or {}, reasons or {}
    return {
        "direction": direction, "dtype": dtype, "head_dim": shape["head_dim"], "causal": causal,
        "batch": shape["batch"], "seqlen": shape["seqlen"], "heads": shape["heads"],
        "variant": variant, "flops": flops,
        "ms": {b: ms.get(b) for b in BACKENDS},
        "tflops": {b: tflops(flops, ms.get(b)) for b in BACKENDS},
        "power_w": {b: power.get(b) for b in BACKENDS},
        "sm_mhz": {b: clock.get(b) for b in BACKENDS},
        "clock_reasons": {b: reasons.get(b) for b in BACKENDS},
        "j_per_pflop": {b: joules_per_pflop(power.get(b), ms.get(b), flops) for b in BACKENDS},
    }


def best_peer(row: dict) -> tuple[str | None, float | None]:
    """The fastest peer of a row (cuDNN, FA2, FA4) and its TFLOP/s."""
    t = row["tflops"]
    peers = [(b, t.get(b)) for b in PEERS if t.get(b)]
    return max(peers, key=lambda p: p[1]) if peers else (None, None)


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
    timing = h.get("timing") or "burst: median of CUDA-event-timed launches"
    lines = [
        BEGIN,
        "## Attention throughput (TFLOP/s)",
        "",
        f"- Date: {h.get('date')}; GPU: {h.get('gpu')}; commit: `{h.get('commit')}`",
        f"- torch {h.get('torch')}, CUDA {h.get('cuda')}, cuDNN {h.get('cudnn')}; "
        f"cuBLAS bf16 GEMM {GEMM_N}^3: {_fmt(h.get('gemm_tflops'))} TFLOP/s "
        f"({'timed as the rows' if h.get('gemm_timing') == 'rows' else 'a burst of launches'})",
        f"- fa3gen library: {h.get('library')}" + (
            f", built from `{h['library_commit']}`" if h.get("library_commit") else ""),
        f"- Reproduce: `{h.get('command') or 'fa3gen bench'}`",
        "- Grid: batch*seqlen = 16384, heads*head_dim = 2048; FLOPs = 4*b*h*s^2*d, halved when "
        "causal (backward 2.5x). — = backend failed, not built or not installed. FA2 = PyTorch "
        "SDPA flash backend, cuDNN = SDPA cuDNN backend (e4m3 rows: cuDNN's fp8 SDPA through "
        "cudnn-frontend when `cudnn` imports, e4m3 output), FA4 = flash_attn.cute when it imports.",
        f"- Timing: {timing}. W and J/PFLOP: mean board power (nvidia-smi) while the backend "
        "ran, and the energy per 10^15 FLOPs at that power.",
    ]
    runs = report.get("runs") or []
    several = len(runs) > 1  # the tables name each row's run
    for i, run in enumerate(runs[:-1]):  # the last is the header's
        n = sum(1 for r in report["rows"] if r.get("run") == i)
        built = f" (library built from `{run['library_commit']}`)" if run.get("library_commit") else ""
        lines.append(f"- {n} rows (run {i} in the tables' last column) from an earlier run: {run.get('date')}, "
                     f"{run.get('gpu')}, commit `{run.get('commit')}`{built}, torch {run.get('torch')}, "
                     f"timing: {run.get('timing') or 'burst'}, `{run.get('command') or 'fa3gen bench'}`")
    seen = [r["clock_reasons"]["fa3gen"] for r in report["rows"]
            if (r.get("clock_reasons") or {}).get("fa3gen") is not None]
    if seen:
        lines.append(f"- Clock-event reasons while fa3gen ran, over {len(seen)} rows: "
                     f"{reason_counts(seen)} (sw_power_cap alone: the 700 W cap, as in steady use).")
    for (direction, dtype, causal), rows in _groups(report["rows"]).items():
        lines += [
            "",
            f"### {direction}, {dtype}, causal={causal}",
            "",
            "| head_dim | seqlen | fa3gen | cuDNN | FA2 | FA4 | fa3gen / best peer | "
            "fa3gen W | fa3gen J/PFLOP | best peer J/PFLOP | variant |" + (" run |" if several else ""),
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|" + ("---:|" if several else ""),
        ]
        for r in rows:
            t, joules = r["tflops"], r.get("j_per_pflop") or {}
            peer, peer_t = best_peer(r)
            ratio = t["fa3gen"] / peer_t if t.get("fa3gen") and peer_t else None
            lines.append(
                f"| {r['head_dim']} | {r['seqlen']} | {_fmt(t.get('fa3gen'))} | "
                f"{_fmt(t.get('cudnn'))} | {_fmt(t.get('flash'))} | {_fmt(t.get('fa4'))} | "
                f"{_fmt(ratio, '.2f')}{f' ({LABELS[peer]})' if ratio else ''} | "
                f"{_fmt((r.get('power_w') or {}).get('fa3gen'))} | {_fmt(joules.get('fa3gen'))} | "
                f"{_fmt(joules.get(peer) if peer else None)} | {r.get('variant') or '—'} |"
                + (f" {r.get('run')} |" if several else "")
            )
    # The candidates of the latest run only, as its picked_defaults: a merged report's older
    # rows may come from another library, and a geomean across libraries picks for none.
    latest = len(report.get("runs") or [None]) - 1
    lines += _candidates_markdown([r for r in report["rows"] if r.get("run", latest) == latest])
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
    pat = _marked_block(old, path, begin, end)
    if pat.search(old):
        new = pat.sub(lambda _: block, old, count=1)
    else:
        new = old + ("" if old.endswith("\n") else "\n") + "\n" + block
    write_atomically(path, new)


def write_json(report: dict, path: Path) -> None:
    write_atomically(path, json.dumps(report, indent=2) + "\n")


def check_output_file(option: str, path: Path) -> None:
    """Refuse, before any measurement, an output path no file can be written at: a folder
    (`--out ''` is '.'), or one under a file."""
    path = Path(path)
    if not path.name or path.is_dir():
        raise Fa3genError(f"{option} {str(path)!r} is a folder: give a file path")
    check_output_folder(option, path.parent, path)


def check_output_folder(option: str, folder: Path, given: Path | None = None) -> None:
    """Refuse a folder that cannot be made: it, or the nearest of its parents that exists (the
    rest is made when written), is a file. given: the path the option named (folder's)."""
    folder = Path(folder)
    existing = next(d for d in (folder, *folder.parents) if d.exists())
    if not existing.is_dir():
        raise Fa3genError(f"{option} {given or folder}: {existing} is a file, not a folder")


def check_plot_file(option: str, path: Path) -> None:
    """check_output_file, and a suffix matplotlib writes (it takes the format from it; none:
    it would write PATH.png). Without matplotlib there is no plot to check (draw_plot)."""
    check_output_file(option, path)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix[1:].lower() not in formats:
        raise Fa3genError(f"{option} {path}: not a file name of an image format matplotlib "
                          f"writes (the suffix gives it: {', '.join(sorted(formats))})")


def check_markers(path: Path, begin: str = BEGIN, end: str = END) -> None:
    """update_markdown's check of path's markers, before the measurement that fills them."""
    path = Path(path)
    if path.is_file():
        try:
            text = path.read_text()
        except UnicodeDecodeError as e:
            raise Fa3genError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        _marked_block(text, path, begin, end)


def _marked_block(old: str, path: Path, begin: str, end: str):
    """The pattern of old's generated block; an error unless one begin marker precedes one end
    marker, or neither is there."""
    starts, ends = old.count(begin), old.count(end)
    if (starts, ends) not in ((0, 0), (1, 1)) or (starts and old.index(begin) > old.index(end)):
        # guessing which text is the generated block could delete hand-written text
        raise Fa3genError(f"{path}: expected one {begin} before one {end} (found {starts} and "
                          f"{ends}); fix the markers by hand")
    return re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)


def draw_plot(plot_fn, report: dict, path: Path) -> bool:
    """plot_fn(report, path), unless matplotlib cannot be imported (only the [test] extra
    installs it): then a one-line note and False, the other outputs written as usual."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        print(f"fa3gen: note: no plot written ({path}): matplotlib cannot be imported ({e}); "
              "pip install matplotlib to draw it", file=sys.stderr)
        return False
    plot_fn(report, path)
    return True


def point_of(row: dict) -> tuple:
    """What a row measures: the same point in two reports is the same call."""
    return (row["direction"], row["dtype"], row["head_dim"], row["causal"], row["seqlen"])


def earlier_report(path: Path) -> dict | None:
    """The report --merge adds to: None where there is none yet."""
    if not path.exists():
        return None
    try:
        report = json.loads(path.read_text())
        if not isinstance(report.get("header"), dict):
            raise TypeError
        for row in report["rows"]:
            point_of(row)  # KeyError or TypeError unless a row
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise Fa3genError(f"--merge: {path} is not a bench report ({type(exc).__name__}); "
                          "name another --out or leave out --merge") from None
    return report


def check_same_gpu(old: dict, gpu: str, path) -> None:
    """--merge adds to a report of one GPU model: a row of another would stand beside (or
    replace) its rows in one table, its ceiling and plot drawn for one board."""
    theirs = {h.get("gpu") for h in (old.get("runs") or [old["header"]])} - {None}
    if theirs and theirs != {gpu}:
        raise Fa3genError(f"--merge: {path} holds rows measured on {', '.join(sorted(theirs))}, "
                          f"this run is on {gpu}; write this GPU's rows to another --out")


def unmeasured_points(old: dict, new: dict) -> list[tuple]:
    """The points `new` has no fa3gen time for because its library lacked the variant (the
    row names none) where `old` has one: --merge keeps `old`'s row there rather than blank a
    measurement. A call that failed on a variant the library has is this run's result: its
    row replaces the old one (an old number must not stand for a regression)."""
    timed = {point_of(r) for r in old["rows"] if r["tflops"].get("fa3gen") is not None}
    return [point_of(r) for r in new["rows"] if r["tflops"].get("fa3gen") is None
            and r.get("variant") is None and point_of(r) in timed]


def merge_reports(old: dict, new: dict) -> dict:
    """`new`'s rows replace `old`'s rows of the same point, the rest of `old` stays (bench
    --merge: re-measure part of a grid), except where `new` has no fa3gen time and `old` has
    (unmeasured_points). The result's header is `new`'s; "runs" lists the header of every run
    that still gives rows, oldest first, and each row's "run" indexes it."""
    runs = old.get("runs") or [old["header"]]
    kept = [dict(r, run=r.get("run", 0)) for r in old["rows"]]
    blank = set(unmeasured_points(old, new))
    new = dict(new, rows=[r for r in new["rows"] if point_of(r) not in blank])
    fresh = {point_of(r) for r in new["rows"]}
    kept = [r for r in kept if point_of(r) not in fresh]
    used = sorted({r["run"] for r in kept})
    renumber = {i: n for n, i in enumerate(used)}
    rows = [dict(r, run=renumber[r["run"]]) for r in kept]
    rows += [dict(r, run=len(used)) for r in new["rows"]]
    return {**new, "runs": [runs[i] for i in used] + [new["header"]], "rows": rows}


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
            if gemm and kind[1] != "e4m3":  # a bf16 GEMM is no ceiling for fp8 rows
                ax.axhline(gemm, ls="--", color="gray", label="cuBLAS bf16 GEMM")
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
    earlier = (report.get("runs") or [])[:-1]  # --merge: rows of earlier runs are drawn too
    fig.suptitle(f"{h.get('gpu')}  commit {str(h.get('commit'))[:10]}  {h.get('date')}" + (
        f"  (+ rows of {len(earlier)} earlier run{'s' if len(earlier) > 1 else ''}: "
        + ", ".join(f"{str(r.get('commit'))[:10]} {r.get('date')}" for r in earlier) + ")"
        if earlier else ""), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def repo_relative(path) -> str:
    """path relative to the repository when inside it (the docs name no machine's layout)."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT.resolve()))
    except ValueError:
        return str(path)


def git_commit() -> str | None:
    """FA3GEN_COMMIT when set (a copied tree's .git can be stale), else git's HEAD in a checkout
    (an installed package's folder may sit inside another project's repository: None there)."""
    if os.environ.get("FA3GEN_COMMIT"):
        return os.environ["FA3GEN_COMMIT"]
    if not IN_CHECKOUT:
        return None
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
    return list(dict.fromkeys(names))


def positive_ms(text: str) -> float:
    """An argparse type: a finite number of milliseconds > 0 (--min-ms)."""
    value = _ms(text)
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of milliseconds > 0, got {text!r}")
    return value


def nonnegative_ms(text: str) -> float:
    """An argparse type: a finite number of milliseconds >= 0 (--settle-ms)."""
    value = _ms(text)
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of milliseconds >= 0, got {text!r}")
    return value


def _ms(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


class Given(argparse.Action):
    """Store the value and add the option's dest to the namespace's `given`: a timing option
    the chosen timing does not use is refused (refuse_unused) only when given, so the
    documented defaults stay."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def refuse_unused(args, unused: dict[str, str]) -> None:
    """An error naming the options given (Given) that the run would ignore: {dest: why}."""
    given = getattr(args, "given", frozenset())
    for dest, why in unused.items():
        if dest in given:
            raise Fa3genError(f"--{dest.replace('_', '-')} {why}")


def add_settle_arguments(p: argparse.ArgumentParser, settle_ms: float | None = None,
                         order: str = "rotate") -> None:
    """--settle-ms and --order of sustained timing (timing.sustained_ms), with these defaults
    (settle_ms None: half of --min-ms)."""
    default = "half of --min-ms" if settle_ms is None else f"{settle_ms:g}"
    p.add_argument("--settle-ms", type=nonnegative_ms, default=settle_ms, action=Given,
                   help="sustained timing: untimed launches of a backend right before each of its "
                        f"timed batches, ms (default {default}; 0: none). Without them a backend "
                        "timed after a slower one reads up to 9%% fast")
    p.add_argument("--order", choices=ORDERS, default=order, action=Given,
                   help="sustained timing: the backends' order each round, rotated by one or "
                        f"shuffled (seeded; default {order})")


def steady_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0 (--steady-s, --idle-s)."""
    value = _ms(text)  # the same parse: a float, NaN when it is not one
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def steady_run_seconds(text: str) -> float:
    """An argparse type: --steady-s, finite seconds beyond the STEADY_FROM_S a run is counted
    from."""
    value = steady_seconds(text)
    if value <= STEADY_FROM_S:
        raise argparse.ArgumentTypeError(
            f"expected more than {STEADY_FROM_S:g} s (a run is counted from {STEADY_FROM_S:g} s on), got {text!r}")
    return value


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
        return list(dict.fromkeys(values))  # each once: a repeat measured a point twice
    return parse


def output_path(option: str):
    """An argparse type: a Path, refused when empty (Path('') is '.', the working folder)."""
    from fa3gen.cli import _non_empty

    check = _non_empty(option)
    return lambda text: Path(check(text))


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
                   help="bf16, fp16, e4m3 (forward only), comma-separated (default bf16)")
    p.add_argument("--rounds", type=count(1), default=3, action=Given,
                   help="sustained timing: rounds per point, backends alternating with the "
                        "order rotated; the median is reported (default 3)")
    p.add_argument("--min-ms", type=positive_ms, default=100.0, action=Given,
                   help="sustained timing: back-to-back launches per round and backend, ms "
                        "(default 100)")
    add_settle_arguments(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--burst", action="store_true",
                      help="time each backend alone in a short burst (--warmup, --iters) instead: "
                           "reads 5-12%% higher than steady use on a power-capped board")
    mode.add_argument("--steady-s", type=steady_run_seconds, default=None, metavar="S",
                      help="time each backend alone for S seconds (more than "
                           f"{STEADY_FROM_S:g}) of back-to-back calls after --idle-s of idle, "
                           f"counted from {STEADY_FROM_S:g} s on, in the given order and then "
                           "reversed, the mean of the two: the steady state at the power cap, "
                           "where the interleaved rounds read a backend up to 4%% high; about "
                           "2 x (S + idle) s per backend and point. --all-variants candidates "
                           "keep the interleaved rounds")
    p.add_argument("--idle-s", type=steady_seconds, default=1.0, metavar="S", action=Given,
                   help="--steady-s: idle GPU before each backend's run, s (default 1)")
    p.add_argument("--warmup", type=count(0), default=5, action=Given,
                   help="--burst: untimed launches before timing each case (default 5)")
    p.add_argument("--iters", type=count(1), default=30, action=Given,
                   help="--burst: timed launches per case; the median is reported (default 30)")
    p.add_argument("--no-power", action="store_true",
                   help="do not sample board power and SM clock with nvidia-smi")
    p.add_argument("--out", type=output_path("--out"), default=RESULTS_DIR / "bench.json",
                   help="JSON report (default docs/results/bench.json)")
    p.add_argument("--markdown", type=output_path("--markdown"), default=DOCS_DIR / "BENCHMARKS.md",
                   help="markdown file whose bench markers get the tables "
                        "(default docs/BENCHMARKS.md)")
    p.add_argument("--plot", type=output_path("--plot"), default=RESULTS_DIR / "bench.png",
                   help="plot of TFLOP/s vs seqlen (default docs/results/bench.png)")
    p.add_argument("--merge", action="store_true",
                   help="keep --out's other rows: the points measured now replace theirs, and the "
                        "report lists each run that still gives rows (re-measure part of a grid)")
    p.add_argument("--no-baselines", action="store_true", help="time fa3gen only (no SDPA)")
    p.add_argument("--all-variants", action="store_true",
                   help="also time every built variant of each shape's key (rows gain a "
                        "'candidates' map), interleaved in one run: it points at keys whose "
                        "default may lose; `fa3gen tune` (rounds per candidate) decides")
    p.set_defaults(func=run)
    return p


def _command() -> str:
    """The command line that produced a report: `fa3gen ...` for the CLI, `python3 script ...`
    for the GPU scripts under tests/gpu."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("fa3gen")
    if script.name in ("fa3gen", "cli.py", "__main__.py", "-c"):
        return shlex.join(["fa3gen", *sys.argv[1:]])
    return shlex.join(["python3", *sys.argv])


def library_commit(lib_path) -> str | None:
    """The commit a library was built from: its build's manifest.json (source_commit), found
    beside the library (a copied build) or one folder up (generated/<spec>/lib/); None without
    one, or from a build that predates the field."""
    return (library_manifest(lib_path) or {}).get("source_commit")


def provenance(lib) -> dict:
    """Report header shared by bench, ablate, tune and the GPU scripts: where, when and how the
    numbers were taken."""
    import torch

    return {
        "gpu": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "library": repo_relative(lib.path),
        "library_commit": library_commit(lib.path),  # the tree that built it; "commit": this one
        "build_info": lib.build_info,
        "command": _command(),
    }


def _timing_description(args) -> str:
    """The report header's line on how the backends were timed."""
    if args.burst:
        return f"burst: each backend alone, median of {args.iters} CUDA-event-timed launches after {args.warmup}"
    if args.steady_s:
        return (f"steady: each backend alone for {args.steady_s:g} s of back-to-back launches after "
                f"{args.idle_s:g} s idle, counted from {STEADY_FROM_S:g} s, order given then reversed, "
                "mean of the two")
    return (f"sustained: {args.rounds} rounds of >= {args.min_ms:g} ms of back-to-back launches per "
            f"backend, each after {_settle(args):g} ms of its own untimed launches, backends "
            f"alternating with the order {'rotated' if args.order == 'rotate' else 'shuffled'}, median")


def gemm_ceiling(args) -> float | None:
    """The GEMM ceiling's TFLOP/s, timed as the rows are (measure_backends with args)."""
    return gemm_tflops(lambda fn: measure_backends({"gemm": fn}, args)[0].get("gemm"))


def bench_runs(direction: str, dtypes: list[str], causals: list[bool]) -> list[tuple]:
    """(direction, dtype, causal) per table, in order; e4m3 is forward only (its backward
    rows would be a table of dashes)."""
    directions = ["fwd", "bwd"] if direction == "both" else [direction]
    return [(dr, d, c) for dr in directions for d in dtypes for c in causals
            if not (dr == "bwd" and d == "e4m3")]


def refuse_unused_timing(args) -> None:
    """The timing options the chosen timing would ignore, when given: an error."""
    if args.burst:
        refuse_unused(args, {d: "is for the sustained timing, which --burst replaces: drop one of "
                             "them" for d in ("rounds", "min_ms", "settle_ms", "order")})
    else:
        refuse_unused(args, {d: "is for --burst's timing, which this run does not use: add --burst "
                             "or drop it" for d in ("warmup", "iters")})
    if not getattr(args, "steady_s", None):
        refuse_unused(args, {"idle_s": "is for --steady-s, which this run does not use: add "
                             "--steady-s or drop it"})
    elif not getattr(args, "all_variants", False):  # the rounds time only its candidates
        refuse_unused(args, {d: "is for the sustained timing, which --steady-s replaces (it "
                             "times --all-variants' candidates only): drop one of them"
                             for d in ("rounds", "min_ms", "settle_ms", "order")})


def _has_variant(lib, direction: str, dt_name: str, shape: dict, causal: bool) -> bool:
    """Whether fa3gen times this point: the variant the call dispatches to (a backward's
    forward too) is in lib."""
    try:
        for dr in (direction, "fwd"):
            lib.find(dr, dt_name, shape["head_dim"], causal, seqlen_k=shape["seqlen"])
    except Fa3genError:
        return False
    return True


def run(args) -> int:
    if not bench_runs(args.direction, args.dtype, [False]):  # only e4m3 backward asked for
        raise Fa3genError("e4m3 has no backward: bench it with --direction fwd")
    refuse_unused_timing(args)
    # the outputs, before the grid (hours): a path no file can take fails now, not at the end
    check_output_file("--out", args.out)
    check_output_file("--markdown", args.markdown)
    check_markers(args.markdown)
    check_plot_file("--plot", args.plot)
    earlier = earlier_report(args.out) if args.merge else None  # read before the timing: fail fast
    import torch

    from fa3gen import runtime
    from fa3gen.ops import TORCH_DTYPES

    if not torch.cuda.is_available():
        raise Fa3genError("fa3gen bench needs a CUDA GPU (Hopper sm_90)")
    lib = runtime.use_spec(args.spec) if args.spec else runtime.get_library()
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    runs = bench_runs(args.direction, args.dtype, causals)
    if not any(_has_variant(lib, direction, dt_name, shape, causal)
               for direction, dt_name, causal in runs for shape in grid(args.seqlens, args.head_dims)):
        raise Fa3genError(f"{lib.path} has no fa3gen variant for any point asked for (directions, "
                          "dtypes, head dims, masks): nothing to measure; build them, or ask for "
                          "what the library has (fa3gen list --spec SPEC)")

    header = provenance(lib)
    if earlier is not None:
        check_same_gpu(earlier, header["gpu"], args.out)
    header["gemm_tflops"] = gemm_ceiling(args)
    header["gemm_timing"] = "rows"  # timed as the rows are (reports before it: a burst)
    header["timing"] = _timing_description(args)
    print(f"cuBLAS bf16 GEMM {GEMM_N}^3: {_fmt(header['gemm_tflops'], '.1f')} TFLOP/s")

    rows = []
    sample = not (args.burst or args.no_power)
    with PowerSampler(torch.cuda.current_device()) if sample else contextlib.nullcontext() as sampler:
        for direction, dt_name, causal in runs:
            dtype = TORCH_DTYPES[dt_name]
            bench_shape = bench_fwd_shape if direction == "fwd" else bench_bwd_shape
            for shape in grid(args.seqlens, args.head_dims):
                row = bench_shape(lib, shape, causal, dtype, args, sampler)
                rows.append(row)
                t = row["tflops"]
                print(f"{direction} {dt_name} d={shape['head_dim']:<3} s={shape['seqlen']:<6} "
                      f"causal={causal!s:<5} fa3gen {_fmt(t['fa3gen']):>4}  cuDNN "
                      f"{_fmt(t['cudnn']):>4}  FA2 {_fmt(t['flash']):>4}  FA4 "
                      f"{_fmt(t['fa4']):>4}  TFLOP/s  fa3gen "
                      f"{_fmt(row['power_w']['fa3gen'])} W  [{row['variant']}]", flush=True)

    if not any(r["tflops"]["fa3gen"] is not None for r in rows):  # each fa3gen call failed
        print("fa3gen: error: fa3gen measured no point (see the failures above); "
              f"{args.out}, {args.markdown} and {args.plot} are left as they were", file=sys.stderr)
        return 1
    report = {"header": header, "rows": rows}
    if earlier is not None:
        blank = unmeasured_points(earlier, report)
        if blank:
            print(f"fa3gen bench: warning: no fa3gen time at {len(blank)} points {args.out} has one for "
                  f"(the library lacks their variants); --merge keeps the earlier rows there, "
                  f"e.g. {blank[0]}", file=sys.stderr)
        report = merge_reports(earlier, report)
    if args.all_variants:
        report["picked_defaults"] = pick_defaults(rows)
        for key, p in report["picked_defaults"].items():
            print(f"best for {key}: {p['variant']}")
    write_json(report, args.out)
    update_markdown(args.markdown, render_markdown(report))
    plotted = draw_plot(plot, report, args.plot)
    print(f"wrote {args.out}, {args.markdown}" + (f", {args.plot}" if plotted else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# GPU measurement (timing itself is fa3gen.timing's).


def _find_variant(lib, direction, dt_name, d, causal, seqlen_k) -> str | None:
    """The variant flash_attn_func dispatches to at this seqlen_k (range defaults included)."""
    try:
        return lib.find(direction, dt_name, d, causal, seqlen_k=seqlen_k).name
    except Fa3genError as e:
        print(f"  fa3gen: {str(e).splitlines()[0]}", file=sys.stderr)
        return None


def _time_candidates(lib, key: tuple, flops: float, call, args) -> dict:
    """TFLOP/s of every built variant of `key` (contract.make_key), each timed as
    call(variant_name), the candidates measured together: the `candidates` map of
    --all-variants."""
    fns = {info.name: (lambda name=info.name: call(name)) for info in lib.variants
           if info.key == key}
    # the interleaved rounds even under --steady-s (as documented): a candidate alone for
    # 2 x (S + idle) seconds a point would multiply the run, and the picks compare them together
    ms, _, _ = measure_backends(fns, argparse.Namespace(**{**vars(args), "steady_s": None}))
    return {name: tflops(flops, ms.get(name)) for name in fns}


def _cudnn_fp8_forward(q8, k8, v8, causal: bool):
    """cuDNN's fp8 SDPA forward (cudnn-frontend's graph API) on e4m3 (b, s, h, d) q8, k8, v8 as
    a callable, or None when `cudnn` does not import. Per-tensor descales of 1; its output is
    e4m3 (fa3gen's is bf16: cuDNN stores half the bytes). Built once per shape here."""
    graph = cudnn_fp8_graph(q8, k8, v8, causal)
    return None if graph is None else graph[0]


def cudnn_fp8_graph(q8, k8, v8, causal: bool, descales=None, p_scale: float = 1.0,
                    out_bf16: bool = False, o_scale: float = 1.0):
    """(run, out) of cuDNN's fp8 SDPA forward on e4m3 (b, s, h, d) q8, k8, v8, or None when
    `cudnn` does not import: run() computes into out, (b, s, h, d) bf16 with out_bf16, else e4m3
    stored as uint8, times o_scale (cuDNN's scale_o). descales: {"q_descale", "k_descale",
    "v_descale"} one-element fp32 tensors (per-tensor; 1 when None). p_scale: the factor P takes
    before its e4m3 cast inside the kernel (cuDNN's scale_s; descale_s is its inverse)."""
    try:
        import cudnn
    except Exception:  # an optional peer
        return None
    import torch

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    b, s, h, d = q8.shape
    dev = q8.device

    def bhsd(t):  # cuDNN's (b, h, s, d) dims over fa3gen's (b, s, h, d) memory
        return t.permute(0, 2, 1, 3)
    q, k, v = (bhsd(t.view(torch.uint8)) for t in (q8, k8, v8))
    out = torch.empty(b, s, h, d, device=dev, dtype=torch.bfloat16 if out_bf16 else torch.uint8)
    o = bhsd(out)
    stats = torch.empty(b, h, s, 1, device=dev, dtype=torch.float32)

    def scalar(x):
        return torch.full((1, 1, 1, 1), float(x), device=dev, dtype=torch.float32)
    given = descales or {}
    factors = {n: given[name].reshape(1, 1, 1, 1).float() if name in given else scalar(1.0)
               for n, name in (("dq", "q_descale"), ("dk", "k_descale"), ("dv", "v_descale"))}
    factors.update(ds=scalar(1.0 / p_scale), ss=scalar(p_scale), so=scalar(o_scale))
    amax = {n: torch.zeros(1, 1, 1, 1, device=dev) for n in ("s", "o")}
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
    tq, tk, tv = (g.tensor_like(t).set_data_type(e4m3) for t in (q, k, v))
    ts = {n: g.tensor_like(t) for n, t in factors.items()}
    to, tstats, tamax_s, tamax_o = g.sdpa_fp8(
        q=tq, k=tk, v=tv, descale_q=ts["dq"], descale_k=ts["dk"], descale_v=ts["dv"],
        descale_s=ts["ds"], scale_s=ts["ss"], scale_o=ts["so"], generate_stats=True,
        attn_scale=d ** -0.5, use_causal_mask=causal, use_padding_mask=False)
    o_type = cudnn.data_type.BFLOAT16 if out_bf16 else e4m3
    for t, like, dt in ((to, o, o_type), (tstats, stats, f32), (tamax_s, amax["s"], f32),
                        (tamax_o, amax["o"], f32)):
        t.set_output(True).set_dim(list(like.shape)).set_stride(list(like.stride())).set_data_type(dt)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    workspace = torch.empty(g.get_workspace_size(), device=dev, dtype=torch.uint8)
    pack = {tq: q, tk: k, tv: v, to: o, tstats: stats, tamax_s: amax["s"], tamax_o: amax["o"],
            **{ts[n]: factors[n] for n in factors}}
    return (lambda: g.execute(pack, workspace, handle=handle)), out


def _fa4_forward():
    """FA4's flash_attn_func (flash_attn.cute), or None when it does not import."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception:  # an optional column
        return None

    def call(q, k, v, causal):
        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    return call


def peer_forwards(q, k, v, causal: bool) -> dict:
    """The 16-bit peers' forwards on fa3gen's (batch, seqlen, heads, head_dim) q, k, v: SDPA's
    cuDNN and FA2 backends on (b, h, s, d) views (no copy), their output viewed back as (b, s,
    h, d), and FA4 when it imports ({name: callable}, names as in LABELS)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa(backend):
        def fn():
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return out.transpose(1, 2)  # a view: the grad of the transposed view is dout
        return fn

    fns = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    fa4 = _fa4_forward()
    if fa4 is not None:
        fns["fa4"] = lambda: fa4(q, k, v, causal)
    return fns


def backward_call(label: str, forward, q, k, v, dout):
    """How a backward is timed: autograd.grad of one recorded forward's output (retain_graph,
    so it can run again), or None, reported, when the forward fails."""
    import torch

    try:
        out = forward()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        report_failure(f"{label} forward", e)
        return None
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def _settle(args) -> float:
    """--settle-ms, or sustained_ms's default for --min-ms when not given."""
    return settle_for(args.min_ms, getattr(args, "settle_ms", None))


def measure_backends(fns: dict, args, sampler: PowerSampler | None = None, reasons: dict | None = None,
                     per_round: dict | None = None):
    """(ms, power W, SM MHz) per backend of fns ({name: callable or None}); `reasons`, when
    given, gets each backend's clock-event reasons from the sampler. Each callable runs
    once first; one that fails is reported and left out. Sustained (the default): all of them
    interleaved, rounds of at least --min-ms of back-to-back launches (timing.sustained_ms),
    with the sampler's mean power and clock per backend; --steady-s: each alone for that long,
    counted once its clock has settled (timing.steady_ms), power and clock as sustained;
    --burst: each alone, the median of --iters launches after --warmup (timing.time_ms).
    `per_round`, when given, gets each backend's ms of every sustained round (nothing in the
    other modes)."""
    import torch

    runnable = {}
    for name, fn in fns.items():
        if fn is None:
            continue
        try:
            fn()
            torch.cuda.synchronize()
            runnable[name] = fn
        except Exception as e:  # noqa: BLE001 - a failing backend is reported, not fatal
            report_failure(LABELS.get(name, name), e)
    ms, power, clock = {}, {}, {}
    if getattr(args, "burst", False):
        for name, fn in runnable.items():
            ms[name] = time_or_none(LABELS.get(name, name), fn, args.warmup, args.iters)
        return ms, power, clock
    names = list(runnable)
    if not names:
        return ms, power, clock
    if sampler is not None:
        sampler.reset()
    tag = sampler.tag if sampler is not None else None
    if getattr(args, "steady_s", None):
        times = steady_ms([runnable[n] for n in names], args.steady_s, args.idle_s, tag=tag)
    else:
        rounds: list = []
        times = sustained_ms([runnable[n] for n in names], args.rounds, args.min_ms,
                             settle_ms=_settle(args), order=getattr(args, "order", "rotate"), tag=tag,
                             per_round=rounds)
        if per_round is not None:
            per_round.update(zip(names, rounds))
    ms = dict(zip(names, times))
    if sampler is not None:
        for i, (w, mhz) in sampler.means(range(len(names))).items():
            power[names[i]], clock[names[i]] = w, mhz
        if reasons is not None:
            reasons.update((names[i], r) for i, r in sampler.reasons(range(len(names))).items())
    return ms, power, clock


def bench_fwd_shape(lib, shape: dict, causal: bool, dtype, args, sampler=None) -> dict:
    import torch

    from fa3gen.ops import _DTYPES, flash_attn_func

    b, s, h, d = shape["batch"], shape["seqlen"], shape["heads"], shape["head_dim"]
    dt_name = _DTYPES[dtype]
    q, k, v = random_inputs(shape, dtype, 3)
    fns: dict = {}
    variant = _find_variant(lib, "fwd", dt_name, d, causal, s)
    if variant is not None:
        fns["fa3gen"] = lambda: flash_attn_func(q, k, v, causal=causal, variant=variant)
    if not args.no_baselines and dtype.itemsize == 1:  # fp8: cuDNN's fp8 SDPA, when it imports
        try:
            fns["cudnn"] = _cudnn_fp8_forward(q, k, v, causal)
        except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
            report_failure("cuDNN fp8", e)
    if not args.no_baselines and dtype.itemsize > 1:  # SDPA and FA4 take no fp8 inputs
        fns.update(peer_forwards(q, k, v, causal))
    reasons: dict = {}
    ms, power, clock = measure_backends(fns, args, sampler, reasons)
    candidates = {}
    if getattr(args, "all_variants", False):
        candidates = _time_candidates(
            lib, make_key("fwd", dt_name, d, causal), attention_flops(b, h, s, s, d, causal),
            lambda name: flash_attn_func(q, k, v, causal=causal, variant=name), args)
    q = k = v = None  # frees the inputs: the timed lambdas share these cells
    torch.cuda.empty_cache()
    row = make_row("fwd", dt_name, shape, causal, variant, ms, power, clock, reasons)
    if candidates:
        row["candidates"] = candidates
    return row


def bench_bwd_shape(lib, shape: dict, causal: bool, dtype, args, sampler=None) -> dict:
    """Backward alone: each backend records one forward, then autograd.grad is timed."""
    import torch

    from fa3gen.ops import _DTYPES, flash_attn_func

    d, dt_name = shape["head_dim"], _DTYPES[dtype]
    q, k, v, dout = random_inputs(shape, dtype, 4)
    for t in (q, k, v):
        t.requires_grad_(True)
    fns: dict = {}
    variant = _find_variant(lib, "bwd", dt_name, d, causal, shape["seqlen"])
    fwd_variant = _find_variant(lib, "fwd", dt_name, d, causal, shape["seqlen"])
    if variant is not None and fwd_variant is not None:
        fns["fa3gen"] = backward_call("fa3gen", lambda: flash_attn_func(q, k, v, causal=causal), q, k, v, dout)
    if not args.no_baselines:
        for name, forward in peer_forwards(q, k, v, causal).items():
            fns[name] = backward_call(LABELS[name], forward, q, k, v, dout)
    reasons: dict = {}
    ms, power, clock = measure_backends(fns, args, sampler, reasons)
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
    q = k = v = dout = None  # frees the inputs: the timed lambdas share these cells
    torch.cuda.empty_cache()
    # the variant fa3gen ran, none where it could not run (a backward without its forward):
    # --merge then keeps an earlier row, as for a variant the library lacks
    row = make_row("bwd", dt_name, shape, causal, variant if fwd_variant is not None else None,
                   ms, power, clock, reasons)
    if candidates:
        row["candidates"] = candidates
    return row
