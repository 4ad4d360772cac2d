"""`fa3gen ablate`: build, check and time the factorial matrix of specs/ablation.yaml.

Each cell (warp specialization x GEMM-softmax overlap x pingpong x stages x tile) is first
checked on a small random problem against the fp32 reference; only cells that pass are timed,
at the FA3 paper's ablation shape by default. Outputs: JSON, CSV, a markdown block in
docs/ABLATION.md and a PNG of heatmaps + per-knob effects.

Pure parts (rows, knob effects, paper table, rendering, plot) take plain dicts and run on CPU;
torch is imported only inside the GPU functions so fa3gen/cli.py stays torch-free.
Row = {variant, dtype, head_dim, causal, tile_m, tile_n, stages, ws, pp, ov, paper_row, batch,
seqlen, heads, status ("ok" | "wrong" | "error"), max_err, detail, ms, tflops, ratio_to_best,
registers, spill_bytes, smem_bytes, compile_s}.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fnmatch
import io
import statistics
import sys
from pathlib import Path
from typing import Callable, Iterable

from fa3gen.bench import (DOCS_DIR, RESULTS_DIR, Given, _fmt, attention_flops, check_markers,
                          check_output_file, check_output_folder, count, draw_plot, output_path, positive_ms, provenance,
                          refuse_unused_timing, update_markdown, write_json)
from fa3gen.checks import CELL_CHECK_DESCRIPTION, check_cell
from fa3gen.cli import positive_int
from fa3gen.contract import library_manifest
from fa3gen.errors import Fa3genError
from fa3gen.timing import (WARMUP_SECONDS, PowerSampler, batch_ms, random_inputs, reason_counts,
                           settle_for, tflops, time_ms)

BEGIN, END = "<!-- ablation:begin -->", "<!-- ablation:end -->"
DEFAULT_SPEC = "ablation"  # specs/ablation.yaml, bundled with the generator
# The FA3 paper's ablation setting (Table 2): batch 4, seqlen 8448, 16 heads, head dim 128.
TIMED_BATCHES = 3
ABLATION_SHAPE = {"batch": 4, "seqlen": 8448, "heads": 16, "head_dim": 128}
# Its H100 fp16 TFLOP/s per configuration; it did not report both mechanisms off.
PAPER_H100_FP16 = {"full": 661.0, "no_overlap": 582.0, "no_ws": 570.0, "both_off": None}
PAPER_ROWS = {(True, True, True): "full", (True, True, False): "no_overlap",
              (False, False, True): "no_ws", (False, False, False): "both_off"}
PAPER_LABELS = {"full": "full (WS + overlap)", "no_overlap": "no GEMM-softmax overlap",
                "no_ws": "no warp specialization", "both_off": "both off (not in the paper)"}

BOOL_KNOBS = ("ws", "pp", "ov")
# What identifies a timed cell: two rows differing in exactly one of these form a matched pair.
IDENTITY = ("dtype", "head_dim", "causal", "tile_m", "tile_n", "stages", "ws", "pp", "ov",
            "batch", "seqlen", "heads")
# (row field, off value, on value, label) of each knob effect.
EFFECTS = (
    ("ws", False, True, "warp specialization"),
    ("ov", False, True, "GEMM-softmax overlap"),
    ("pp", False, True, "pingpong"),
    ("stages", 1, 2, "stages 1→2"),
    ("stages", 2, 3, "stages 2→3"),
    ("tile_n", 128, 176, "tile 128x128→128x176"),
)
CSV_COLUMNS = ("variant", "dtype", "head_dim", "causal", "tile_m", "tile_n", "stages", "ws", "pp",
               "ov", "paper_row", "batch", "seqlen", "heads", "status", "max_err", "ms", "tflops",
               "ratio_to_best", "registers", "spill_bytes", "smem_bytes", "compile_s", "detail")

# ---------------------------------------------------------------------------------------------
# Pure parts: rows.


def parse_shape(text: str) -> dict:
    """'b,s,h,d' -> {batch, seqlen, heads, head_dim} (argparse type)."""
    parts = text.split(",")
    try:
        vals = [int(x) for x in parts]
    except ValueError:
        vals = []
    if len(vals) != 4 or min(vals) < 1:
        raise argparse.ArgumentTypeError(
            f"expected four comma-separated positive integers batch,seqlen,heads,head_dim "
            f"(e.g. 4,8448,16,128), got {text!r}")
    return dict(zip(("batch", "seqlen", "heads", "head_dim"), vals))


def shape_str(r: dict) -> str:
    return f"{r['batch']},{r['seqlen']},{r['heads']},{r['head_dim']}"


def paper_row(ws: bool, pp: bool, ov: bool) -> str | None:
    """Which row of the paper's ablation table a cell reproduces, if any."""
    return PAPER_ROWS.get((bool(ws), bool(pp), bool(ov)))


def cell_fields(cell) -> dict:
    """Knob fields of a cell: anything with the Variant / VariantInfo attribute names."""
    return {"variant": cell.name, "dtype": cell.dtype, "head_dim": cell.head_dim,
            "causal": bool(cell.causal), "tile_m": cell.tile_m, "tile_n": cell.tile_n,
            "stages": cell.stages, "ws": bool(cell.warp_specialized), "pp": bool(cell.pingpong),
            "ov": bool(cell.intra_wg_overlap),
            "paper_row": paper_row(cell.warp_specialized, cell.pingpong, cell.intra_wg_overlap)}


def make_row(cell, shape: dict, status: str, ms: float | None = None,
             max_err: float | None = None, detail: str | None = None,
             resources: dict | None = None) -> dict:
    res = resources or {}
    flops = attention_flops(shape["batch"], shape["heads"], shape["seqlen"], shape["seqlen"],
                            shape["head_dim"], bool(cell.causal))
    timed = status == "ok" and ms is not None
    return {
        **cell_fields(cell),
        "batch": shape["batch"], "seqlen": shape["seqlen"], "heads": shape["heads"],
        "status": status, "max_err": max_err, "detail": detail,
        "ms": ms if timed else None, "tflops": tflops(flops, ms) if timed else None,
        "ratio_to_best": None,
        "registers": res.get("registers"), "spill_bytes": res.get("spill_bytes"),
        "smem_bytes": res.get("smem_bytes"), "compile_s": res.get("compile_s"),
    }


def group_key(r: dict) -> tuple:
    """Rows compared with each other: same dtype, masking and problem shape."""
    return (r["dtype"], r["causal"], r["batch"], r["seqlen"], r["heads"], r["head_dim"])


def _group_order(r: dict) -> tuple:
    """fp16 before bf16 (the paper's dtype), non-causal before causal."""
    return (r["causal"], r["dtype"] != "fp16", r["dtype"], shape_str(r))


def _timed(r: dict) -> bool:
    return r["status"] == "ok" and r.get("tflops") is not None


def add_ratio_to_best(rows: list[dict]) -> list[dict]:
    """Set ratio_to_best = tflops / best tflops of the row's group (None when not timed)."""
    best: dict[tuple, float] = {}
    for r in rows:
        if _timed(r):
            best[group_key(r)] = max(best.get(group_key(r), 0.0), r["tflops"])
    for r in rows:
        r["ratio_to_best"] = r["tflops"] / best[group_key(r)] if _timed(r) else None
    return rows


def resources_of(data: dict) -> dict[str, dict]:
    """variant name -> {registers, spill_bytes, smem_bytes, compile_s} from a build manifest's
    data; compile_s is empty for a cell that shared its translation unit with others."""
    out = {}
    for v in data.get("variants", []):
        res = v.get("resources") or {}
        smem = v.get("smem_bytes_estimate")
        # Dynamic smem is sizeof(SharedStorage), unknown to ptxas: the generator's estimate.
        if smem is not None:
            smem += res.get("smem_static") or 0
        # A TU's time is the cell's own only where the cell had its TU alone (generator/units.py)
        alone = res.get("unit", v["name"]) == v["name"]
        out[v["name"]] = {"registers": res.get("registers"),
                          "spill_bytes": res.get("spill_stores"),
                          "smem_bytes": smem, "compile_s": res.get("compile_seconds") if alone else None}
    return out


def matches(name: str, only: Iterable[str] = (), exclude: Iterable[str] = ()) -> bool:
    only, exclude = list(only), list(exclude)
    return ((not only or any(fnmatch.fnmatch(name, g) for g in only))
            and not any(fnmatch.fnmatch(name, g) for g in exclude))


def pruned_entry(p) -> dict:
    """A generator.variants.Pruned as a report entry (knob fields + constraint + reason)."""
    e = cell_fields(p.variant)
    e.update(constraint=p.constraint, reason=p.reason)
    return e


# ---------------------------------------------------------------------------------------------
# Pure parts: what the matrix says.


def _effect(rows, field, off, on) -> list[float]:
    """on/off TFLOP/s ratios over pairs of timed rows differing only in `field`."""
    def key(r):
        return tuple(r[f] for f in IDENTITY if f != field)

    offs = {key(r): r["tflops"] for r in rows if _timed(r) and r[field] == off}
    return [r["tflops"] / offs[key(r)] for r in rows
            if _timed(r) and r[field] == on and key(r) in offs]


def knob_effects(rows: list[dict], effects=EFFECTS, conditional: bool = True) -> list[dict]:
    """Median (and range) over matched pairs of TFLOP/s(knob on) / TFLOP/s(knob off), per
    group (dtype, causal, shape). With conditional, also each boolean knob's effect given
    another boolean knob's value (how the mechanisms interact); those only where pairs exist."""
    groups: dict[tuple, list] = {}
    for r in sorted(rows, key=_group_order):
        groups.setdefault(group_key(r), []).append(r)
    out = []
    for g, grows in groups.items():
        base = dict(zip(("dtype", "causal", "batch", "seqlen", "heads", "head_dim"), g))
        for field, off, on, label in effects:
            cases = [(None, grows)]
            if conditional and field in BOOL_KNOBS:
                cases += [(f"{o}={int(val)}", [r for r in grows if r[o] == val])
                          for o in BOOL_KNOBS if o != field for val in (False, True)]
            n_all = None
            for given, sub in cases:
                ratios = _effect(sub, field, off, on)
                n_all = len(ratios) if n_all is None else n_all
                # A condition that keeps no pair, or every pair (pp=1 implies ws=1), says nothing.
                if given is not None and len(ratios) in (0, n_all):
                    continue
                out.append({**base, "knob": field, "label": label, "off": off, "on": on,
                            "given": given, "pairs": len(ratios),
                            "median": statistics.median(ratios) if ratios else None,
                            "min": min(ratios, default=None), "max": max(ratios, default=None)})
    return out


def paper_table(rows: list[dict]) -> list[dict]:
    """Per shape, fp16 non-causal: the best cell (over tiles and stages) of each paper row,
    next to the paper's H100 number; ratios are to the row "full"."""
    out = []
    shapes = sorted({(r["batch"], r["seqlen"], r["heads"], r["head_dim"]) for r in rows
                     if r["dtype"] == "fp16" and not r["causal"]})
    for b, s, h, d in shapes:
        sel = [r for r in rows if r["dtype"] == "fp16" and not r["causal"] and _timed(r)
               and (r["batch"], r["seqlen"], r["heads"], r["head_dim"]) == (b, s, h, d)]
        best = {}
        for label in PAPER_ROWS.values():
            cands = [r for r in sel if r["paper_row"] == label]
            best[label] = max(cands, key=lambda r: r["tflops"], default=None)
        full = best["full"]["tflops"] if best["full"] else None
        for label in PAPER_ROWS.values():
            r, paper = best[label], PAPER_H100_FP16[label]
            out.append({
                "batch": b, "seqlen": s, "heads": h, "head_dim": d, "paper_row": label,
                "variant": r["variant"] if r else None, "tflops": r["tflops"] if r else None,
                "ratio_to_full": r["tflops"] / full if r and full else None,
                "paper_h100_tflops": paper,
                "paper_ratio_to_full": paper / PAPER_H100_FP16["full"] if paper else None,
            })
    return out


def make_report(header: dict, rows: list[dict], pruned: list[dict]) -> dict:
    add_ratio_to_best(rows)
    return {"header": header, "rows": rows, "pruned": pruned,
            "knob_effects": knob_effects(rows), "paper_table": paper_table(rows)}


# ---------------------------------------------------------------------------------------------
# Pure parts: rendering.


def render_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (int(v) if isinstance(v, bool) else "" if v is None else v)
                    for k, v in r.items()})
    return buf.getvalue()


def write_csv(rows: list[dict], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_csv(rows))


def _group_label(g: tuple, with_shape: bool) -> str:
    dtype, causal, b, s, h, d = g
    label = f"{dtype} {'causal' if causal else 'non-causal'}"
    return label + (f" ({b},{s},{h},{d})" if with_shape else "")


def _status(r: dict) -> str:
    if r["status"] == "wrong":
        return f"**wrong** (max err {_fmt(r.get('max_err'), '.1e')})"
    if r["status"] == "error":
        first = (r.get("detail") or "").strip().splitlines()
        return "**error**: " + (first[0][:60] if first else "")
    return "ok"


def _b(x) -> str:
    return str(int(bool(x)))


def clock_summary(rows: list[dict]) -> str | None:
    """One line on the board's state over the timed batches: the range of SM clock and power,
    and how many batches each clock-event reason held back (a clock below the maximum without
    sw_power_cap is the board, thermal or otherwise, not the cell). None without samples."""
    mhz = [m for r in rows for m in r.get("sm_mhz_batches") or () if m]
    watts = [w for r in rows for w in r.get("power_w_batches") or () if w]
    if not mhz:
        return None
    text = (f"Board: SM clock {min(mhz):.0f}-{max(mhz):.0f} MHz, power {min(watts):.0f}-"
            f"{max(watts):.0f} W over the timed batches")
    batches = [b for r in rows for b in r.get("clock_reasons_batches") or () if b is not None]
    if not batches:
        return text + "; clock-event reasons not recorded."
    return text + f"; clock-event reasons over {len(batches)} batches: {reason_counts(batches)}."


def render_markdown(report: dict) -> str:
    """The block between the ablation markers: header, paper table, knob effects, all cells."""
    h, rows = report["header"], report["rows"]
    shapes = sorted({shape_str(r) for r in rows})
    multi = len(shapes) > 1
    lines = [
        BEGIN,
        "## Results",
        "",
        f"- Date: {h.get('date')}; GPU: {h.get('gpu')}; commit: `{h.get('commit')}`",
        f"- torch {h.get('torch')}, CUDA {h.get('cuda')}; library: {h.get('library')}",
        f"- Reproduce: `{h.get('command') or 'fa3gen ablate'}`",
        f"- Shapes (batch,seqlen,heads,head_dim): {', '.join(shapes) or '—'}; median of "
        f"{TIMED_BATCHES} batches, " + (
            f"each at least {h['min_ms']:g} ms of back-to-back launches (sustained, as a "
            "power-capped board runs in steady use)" +
            (f"; the first after {h['settle_ms']:g} ms of untimed ones" if h.get("settle_ms") else "")
            if h.get("min_ms") else
            f"each the median of {h.get('iters')} CUDA-event-timed launches after at least "
            f"{h.get('warmup')} launches and {WARMUP_SECONDS} s of warm-up") +
        "; FLOPs = 4*b*h*s^2*d, halved when causal.",
        f"- Every cell was first checked against the fp32 reference on {h.get('check')}; "
        "a wrong cell is listed, never timed.",
        "- ws = warp specialization (producer warpgroup), ov = intra-warpgroup GEMM-softmax "
        "overlap, pp = pingpong scheduling between consumer warpgroups.",
    ]
    if (clocks := clock_summary(rows)):
        lines.append(f"- {clocks}")

    ptab = report.get("paper_table") or []
    if ptab:
        lines += ["", "### The paper's ablation (fp16, non-causal)", "",
                  "Best cell over tiles and stages for each configuration of the FA3 paper's "
                  "Table 2, next to its H100 numbers.", ""]
        lines += [("| shape " if multi else "") + "| configuration | TFLOP/s | vs full | "
                  "paper H100 | paper vs full | cell |",
                  ("|:---" if multi else "") + "|:---|---:|---:|---:|---:|:---|"]
        for p in ptab:
            lines.append(
                (f"| {shape_str(p)} " if multi else "")
                + f"| {PAPER_LABELS[p['paper_row']]} | {_fmt(p['tflops'])} | "
                f"{_fmt(p['ratio_to_full'], '.3f')} | {_fmt(p['paper_h100_tflops'])} | "
                f"{_fmt(p['paper_ratio_to_full'], '.3f')} | {p['variant'] or '—'} |")

    effects = report.get("knob_effects") or []
    if effects:
        groups = list(dict.fromkeys(
            (e["dtype"], e["causal"], e["batch"], e["seqlen"], e["heads"], e["head_dim"])
            for e in effects))
        by = {(e["label"], e["given"], (e["dtype"], e["causal"], e["batch"], e["seqlen"],
                                       e["heads"], e["head_dim"])): e for e in effects}
        effect_rows = list(dict.fromkeys((e["label"], e["given"]) for e in effects))
        effect_rows.sort(key=lambda lg: (lg[1] is not None,
                                         [x[3] for x in EFFECTS].index(lg[0]), lg[1] or ""))
        lines += ["", "### What each mechanism gains", "",
                  "Median over matched pairs (cells differing only in that knob) of TFLOP/s "
                  "with the change / without it; [min–max], n pairs. \"given\" rows hold "
                  "another knob fixed: where they differ, the mechanisms interact.", "",
                  "| change | given | " + " | ".join(_group_label(g, multi) for g in groups)
                  + " |",
                  "|:---|:---|" + "---:|" * len(groups)]
        for label, given in effect_rows:
            cells = []
            for g in groups:
                e = by.get((label, given, g))
                cells.append("—" if not e or e["median"] is None else
                             f"{e['median']:.3f}× [{e['min']:.2f}–{e['max']:.2f}] "
                             f"n={e['pairs']}")
            lines.append(f"| {label} | {given or 'all'} | " + " | ".join(cells) + " |")

    lines += ["", "### All cells", "",
              "Sorted by dtype, masking and TFLOP/s; ratio = to the best cell of the same "
              "dtype, masking and shape. Registers, spills (bytes of spill stores) and compile "
              "time from ptxas via the build manifest (the time of a cell compiled in a TU of its "
              "own; blank where cells shared one); shared memory = the generator's estimate "
              "of the dynamic allocation.", "",
              ("| shape " if multi else "") + "| dtype | causal | tile | stages | ws | pp | ov | "
              "paper row | status | ms | TFLOP/s | ratio | regs | spills | smem KiB | "
              "compile s |",
              ("|:---" if multi else "") + "|:---|:---|:---|---:|---:|---:|---:|:---|:---|"
              "---:|---:|---:|---:|---:|---:|---:|"]
    ordered = sorted(rows, key=lambda r: (r["dtype"], r["causal"], shape_str(r),
                                          -(r["tflops"] or -1.0), r["variant"]))
    for r in ordered:
        smem = r.get("smem_bytes")
        lines.append(
            (f"| {shape_str(r)} " if multi else "")
            + f"| {r['dtype']} | {r['causal']} | {r['tile_m']}x{r['tile_n']} | {r['stages']} | "
            f"{_b(r['ws'])} | {_b(r['pp'])} | {_b(r['ov'])} | {r.get('paper_row') or ''} | "
            f"{_status(r)} | {_fmt(r['ms'], '.3f')} | {_fmt(r['tflops'])} | "
            f"{_fmt(r['ratio_to_best'], '.3f')} | {_fmt(r.get('registers'), 'd')} | "
            f"{_fmt(r.get('spill_bytes'), 'd')} | "
            f"{_fmt(None if smem is None else smem / 1024, '.1f')} | "
            f"{_fmt(r.get('compile_s'), '.0f')} |")

    pruned = report.get("pruned") or []
    if pruned:
        counts: dict[tuple, int] = {}
        for p in pruned:
            why = (p["constraint"], p["reason"])
            counts[why] = counts.get(why, 0) + 1
        lines += ["", f"### Pruned cells ({len(pruned)})", ""]
        lines += [f"- {n} by `{c}`: {why}" for (c, why), n in counts.items()]
        lines += ["", "<details><summary>every pruned cell</summary>", ""]
        lines += [f"- `{p['variant']}`: {p['constraint']}" for p in pruned]
        lines += ["", "</details>"]
    lines.append(END)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Plot.

_COMBOS = [(ws, pp, ov) for ws in (True, False) for pp in (True, False) for ov in (True, False)]


def plot(report: dict, path: Path) -> None:
    """One heatmap of TFLOP/s per (dtype, causal, shape): rows (ws, pp, ov), columns
    (tile, stages); pruned cells hatched grey, wrong/error cells hatched red. Last panel: the
    median effect of each knob (bars per group, whiskers = range over matched pairs)."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    rows, pruned = report["rows"], report.get("pruned") or []
    groups = list(dict.fromkeys(group_key(r) for r in sorted(rows, key=_group_order)))
    multi = len({shape_str(r) for r in rows}) > 1
    timed = [r["tflops"] for r in rows if _timed(r)]
    vmin, vmax = (min(timed), max(timed)) if timed else (0.0, 1.0)
    n = len(groups) + 1
    ncols = 2 if n > 1 else 1
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, squeeze=False, figsize=(7.5 * ncols, 4.4 * nrows),
                             layout="constrained")
    flat = [ax for line in axes for ax in line]
    for ax, g in zip(flat, groups):
        dtype, causal, b, s, h, d = g
        grows = [r for r in rows if group_key(r) == g]
        gpruned = [p for p in pruned
                   if (p["dtype"], p["causal"], p["head_dim"]) == (dtype, causal, d)]
        cols = sorted({(r["tile_m"], r["tile_n"], r["stages"]) for r in grows + gpruned})
        vals = np.full((len(_COMBOS), len(cols)), np.nan)
        marks = {}
        for r in grows:
            i, j = _COMBOS.index((r["ws"], r["pp"], r["ov"])), cols.index(
                (r["tile_m"], r["tile_n"], r["stages"]))
            if _timed(r):
                vals[i, j] = r["tflops"]
            else:
                marks[(i, j)] = r["status"]
        for p in gpruned:
            key = (_COMBOS.index((p["ws"], p["pp"], p["ov"])),
                   cols.index((p["tile_m"], p["tile_n"], p["stages"])))
            marks.setdefault(key, "pruned")
        im = ax.imshow(np.ma.masked_invalid(vals), cmap="viridis", vmin=vmin, vmax=vmax,
                       aspect="auto")
        for (i, j), what in marks.items():
            red = what != "pruned"
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=0,
                                   hatch="xx" if red else "//",
                                   edgecolor="tab:red" if red else "0.6"))
            ax.text(j, i, what, ha="center", va="center", fontsize=7,
                    color="tab:red" if red else "0.4",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1} if red else None)
        for i in range(vals.shape[0]):
            for j in range(vals.shape[1]):
                if not np.isnan(vals[i, j]):
                    light = vals[i, j] < vmin + 0.5 * (vmax - vmin)
                    ax.text(j, i, f"{vals[i, j]:.0f}", ha="center", va="center", fontsize=8,
                            color="white" if light else "black")
        ax.set_xticks(range(len(cols)), [f"{m}x{nn}\ns{st}" for m, nn, st in cols], fontsize=8)
        ax.set_yticks(range(len(_COMBOS)),
                      [f"ws{int(ws)} pp{int(pp)} ov{int(ov)}"
                       + (f" ({paper_row(ws, pp, ov)})" if paper_row(ws, pp, ov) else "")
                       for ws, pp, ov in _COMBOS], fontsize=8)
        ax.set_title(f"TFLOP/s, {_group_label(g, multi)}", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.9, label="TFLOP/s (one scale for all panels)")

    ax = flat[len(groups)]
    effects = [e for e in report.get("knob_effects") or [] if e["given"] is None]
    labels = [x[3] for x in EFFECTS if any(e["label"] == x[3] and e["pairs"] for e in effects)]
    width = 0.8 / max(1, len(groups))
    for k, g in enumerate(groups):
        ge = {e["label"]: e for e in effects if e["pairs"] and (
            e["dtype"], e["causal"], e["batch"], e["seqlen"], e["heads"], e["head_dim"]) == g}
        xs = [i + (k - (len(groups) - 1) / 2) * width for i, lab in enumerate(labels) if lab in ge]
        es = [ge[lab] for lab in labels if lab in ge]
        if not es:
            continue
        med = [e["median"] for e in es]
        err = [[m - e["min"] for m, e in zip(med, es)], [e["max"] - m for m, e in zip(med, es)]]
        ax.bar(xs, [m - 1 for m in med], width, bottom=1, yerr=err, capsize=2,
               label=_group_label(g, multi))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s ratio, on / off (median of pairs)")
    ax.set_title("Effect of each knob (whiskers: min–max over matched pairs)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    if groups:
        ax.legend(fontsize=7)
    for extra in flat[n:]:
        extra.axis("off")
    h = report["header"]
    fig.suptitle(f"fa3gen ablation  {h.get('gpu')}  commit {str(h.get('commit'))[:10]}  "
                 f"{h.get('date')}", fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The per-cell driver (check and time are injected: GPU functions below, fakes in tests).


def run_cells(cells, shapes: list[dict], check: Callable[[object], dict],
              time: Callable[[object, dict], float], resources: dict | None = None,
              log: Callable[[str], None] = print) -> list[dict]:
    """Check each cell, then time it at every shape of its head dim, only if the check passed.

    check(cell) -> {"status": "ok" | "wrong" | "error", "max_err": float|None, "detail": str}
    time(cell, shape) -> milliseconds, or a list of per-batch milliseconds (the row reports their
    median and keeps them in ms_batches), or {"ms": [...], "sm_mhz": [...], "power_w": [...],
    "clock_reasons": [...]} (per batch; the row keeps them as sm_mhz_batches, power_w_batches
    and clock_reasons_batches). An
    exception in either makes the cell "error"."""
    rows = []
    resources = resources or {}
    for cell in cells:
        try:
            res = check(cell)
        except Exception as e:  # noqa: BLE001 - one broken cell must not stop the matrix
            res = {"status": "error", "max_err": None, "detail": f"{type(e).__name__}: {e}"}
        for shape in (s for s in shapes if s["head_dim"] == cell.head_dim):
            status, ms, batches, detail = res["status"], None, None, res.get("detail")
            per_batch = {}
            if status == "ok":
                try:
                    ms = time(cell, shape)
                except Exception as e:  # noqa: BLE001 - reported in the row
                    status, detail = "error", f"{type(e).__name__}: {e}"
            if isinstance(ms, dict):
                per_batch = {f"{k}_batches": v for k, v in ms.items() if k != "ms"}
                ms = ms["ms"]
            if isinstance(ms, (list, tuple)):
                batches, ms = list(ms), statistics.median(ms)
            row = make_row(cell, shape, status, ms, res.get("max_err"), detail,
                           resources.get(cell.name))
            if batches:
                row["ms_batches"] = batches
                row.update(per_batch)
            rows.append(row)
            log(_progress(row))
    return rows


def _progress(r: dict) -> str:
    what = (f"{_fmt(r['tflops']):>4} TFLOP/s ({r['ms']:.3f} ms)" if _timed(r)
            else (r.get("detail") or "").splitlines()[0][:160] if r.get("detail") else "")
    err = f"  max err {r['max_err']:.1e}" if r.get("max_err") is not None else ""
    return f"{r['status']:<5} {r['variant']} @ {shape_str(r)}: {what}{err}"


# ---------------------------------------------------------------------------------------------
# GPU functions (each cell's correctness check is fa3gen.checks.check_cell).


def make_timer(warmup: int, iters: int, min_ms: float | None = None,
               sampler=None) -> Callable[[object, dict], list[float] | dict]:
    """time(cell, shape) -> per-batch ms of flash_attn_func(variant=cell) on seeded inputs:
    min_ms set (the default of the command), each batch is at least min_ms of back-to-back
    launches between two events, the first after min_ms / 2 of untimed ones (sustained); else
    the median of `iters` event-timed launches after a warm-up (a burst). With a PowerSampler
    (sustained only) it returns {"ms", "sm_mhz", "power_w", "clock_reasons"}, each per batch: a
    slow batch shows whether the clock dropped with it, and the reasons say whether the power
    cap or something else held it back. Inputs are kept for one (shape, dtype) at a time: cells
    arrive grouped by dtype."""
    import torch

    from fa3gen.ops import TORCH_DTYPES, flash_attn_func

    cache: dict = {}

    def time(cell, shape) -> list[float]:
        key = (shape_str(shape), cell.dtype)
        if key not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            cache[key] = random_inputs(shape, TORCH_DTYPES[cell.dtype], 3)
        q, k, v = cache[key]
        fn = lambda: flash_attn_func(q, k, v, causal=bool(cell.causal), variant=cell.name)  # noqa: E731
        # Several timed batches per cell: on the H200 single batches of the same cell came out
        # bimodal inside one long ablation process (about 330 or 600 TFLOP/s). The median of
        # the batch medians is reported; every batch is kept in the row (ms_batches).
        if min_ms:
            batch_ms(fn, 3)  # warm-up
            per_launch = batch_ms(fn, 5)
            launches = max(3, int(min_ms / per_launch))
            # untimed lead-in, as sustained_ms gives each batch: the clock ramps up from idle
            # over ~200 ms, inside which the first timed batch used to start
            batch_ms(fn, max(1, int(settle_for(min_ms) / per_launch)))
            if sampler is not None:
                sampler.reset()
            tag = sampler.tag if sampler is not None else (lambda b: None)
            times = []
            for b in range(TIMED_BATCHES):
                tag(b)
                times.append(batch_ms(fn, launches))
                tag(None)
            if sampler is None:
                return times
            power, clock = zip(*(sampler.means(range(TIMED_BATCHES)).values()))
            return {"ms": times, "sm_mhz": list(clock), "power_w": list(power),
                    "clock_reasons": list(sampler.reasons(range(TIMED_BATCHES)).values())}
        return [time_ms(fn, warmup, iters) for _ in range(TIMED_BATCHES)]

    return time


# ---------------------------------------------------------------------------------------------
# CLI.


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ablate", help="build, check and time the ablation matrix (specs/ablation.yaml)")
    p.add_argument("--spec", default=DEFAULT_SPEC,
                   help="spec YAML or name (default specs/ablation.yaml)")
    p.add_argument("--shape", type=parse_shape, action="append", default=None,
                   metavar="B,S,H,D", help="problem shape to time (repeatable; default "
                   "4,8448,16,128: the FA3 paper's ablation shape)")
    p.add_argument("--only", action="append", default=[], metavar="GLOB",
                   help="keep only cells whose variant name matches (repeatable)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="drop cells whose variant name matches (repeatable)")
    p.add_argument("-j", "--jobs", type=positive_int, default=None,
                   help="parallel compiles of the build")
    p.add_argument("--no-build", action="store_true",
                   help="skip the build and load generated/<spec>/lib as it is (a machine "
                        "without CUTLASS: build elsewhere, bring generated/<spec>)")
    p.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                   help="a preprocessor definition for every compile of the matrix (repeatable), "
                        "as fa3gen build's: e.g. FA3GEN_FWD_NO_CLUSTER2, the cells without K/V "
                        "multicast; the report's build_info lists it")
    p.add_argument("--min-ms", type=positive_ms, default=100.0, action=Given,
                   help=f"sustained timing: each of the {TIMED_BATCHES} batches per cell is at "
                        "least this many ms of back-to-back launches (default 100)")
    p.add_argument("--burst", action="store_true",
                   help="time each batch as the median of --iters launches after --warmup "
                        "instead (the old timing)")
    p.add_argument("--warmup", type=count(0), default=5, action=Given,
                   help="--burst: untimed launches before timing each cell (default 5)")
    p.add_argument("--iters", type=count(1), default=30, action=Given,
                   help=f"--burst: timed launches per batch ({TIMED_BATCHES} batches per cell, "
                        "the median is reported; default 30)")
    p.add_argument("--no-power", action="store_true",
                   help="do not sample the SM clock and board power per batch (nvidia-smi)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR,
                   help="where ablation.json/.csv/.png go (default docs/results)")
    p.add_argument("--doc", type=output_path("--doc"), default=DOCS_DIR / "ABLATION.md",
                   help="markdown file whose ablation markers get the tables")
    p.set_defaults(func=run)
    return p


def run(args, build_fn=None) -> int:
    import torch

    from fa3gen import runtime
    from generator.build import build, plan

    if not torch.cuda.is_available():
        raise Fa3genError(f"fa3gen ablate needs a CUDA GPU (Hopper sm_90); to only build the "
                          f"matrix run: fa3gen build --spec {args.spec}")
    shapes = args.shape or [dict(ABLATION_SHAPE)]
    if args.define and args.no_build:
        raise Fa3genError("fa3gen ablate: --define changes what the build compiles; with "
                          "--no-build the library is used as built (drop one of them)")
    if args.jobs is not None and args.no_build:
        raise Fa3genError("fa3gen ablate: -j/--jobs sets the build's parallel compiles; with "
                          "--no-build nothing is compiled (drop one of them)")
    refuse_unused_timing(args)  # bench's rule: ablate has --min-ms, --warmup and --iters of it
    # the outputs, before the build and the matrix: a path that cannot take them fails now
    out = Path(args.out_dir)
    check_output_folder("--out-dir", out)
    check_output_file("--doc", args.doc)
    check_markers(args.doc, BEGIN, END)
    p = plan(args.spec, args.only, args.exclude)  # checks the spec and the globs before building
    dims = {v.head_dim for v in p.variants}
    if not any(s["head_dim"] in dims for s in shapes):  # nothing to time: say so before the build
        raise Fa3genError(f"fa3gen ablate: no cell has the head dim of any --shape "
                          f"({', '.join(shape_str(s) for s in shapes)}); the cells' head dims: "
                          f"{', '.join(map(str, sorted(dims)))}")
    for s in shapes:
        if s["head_dim"] not in dims:
            print(f"fa3gen ablate: warning: no cell has head_dim {s['head_dim']} "
                  f"(shape {shape_str(s)} is skipped)", file=sys.stderr)
    if not args.no_build:
        (build_fn or build)(args.spec, only=args.only, exclude=args.exclude, jobs=args.jobs,
                            defines=args.define)
    lib = runtime.use_spec(args.spec)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference must be true fp32

    resources = resources_of(library_manifest(lib.path) or {})
    sample = not (args.burst or args.no_power)
    with PowerSampler(torch.cuda.current_device()) if sample else contextlib.nullcontext() as sampler:
        rows = run_cells(p.variants, shapes, lambda c: check_cell(lib, c),
                         make_timer(args.warmup, args.iters, None if args.burst else args.min_ms,
                                    sampler),
                         resources,
                         log=lambda s: print(s, flush=True))
    pruned = [pruned_entry(x) for x in p.enumeration.pruned
              if matches(x.variant.name, args.only, args.exclude)]
    header = provenance(lib)
    # what the run's timing used: --warmup and --iters only in a burst, --min-ms only sustained
    header.update(spec=p.spec.name, warmup=args.warmup if args.burst else None,
                  iters=args.iters if args.burst else None,
                  min_ms=None if args.burst else args.min_ms,
                  settle_ms=None if args.burst else settle_for(args.min_ms),
                  shapes=[shape_str(s) for s in shapes],
                  check=CELL_CHECK_DESCRIPTION)
    report = make_report(header, rows, pruned)

    write_json(report, out / "ablation.json")
    write_csv(rows, out / "ablation.csv")
    plotted = draw_plot(plot, report, out / "ablation.png")
    update_markdown(args.doc, render_markdown(report), BEGIN, END, title="# Ablation\n\n")
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"wrote {out}/ablation.{{json,csv{',png' if plotted else ''}}} and {args.doc}; "
          f"{len(rows) - len(bad)} timed, {len(bad)} wrong/error, {len(pruned)} pruned")
    return 1 if bad else 0
