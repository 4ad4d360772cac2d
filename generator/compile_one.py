"""Compile one translation unit for ninja: run nvcc, time it, keep its log, check ptxas.

    python -m generator.compile_one --name N --out obj/N.o --resources obj/N.resources.json \
        [--kernel VARIANT=MANGLED_TRAITS ...] -- nvcc ... -c src/N.cu -o obj/N.o

A TU is a compile unit of variants (generator/units.py); --kernel names each, with the
mangled Traits type that its kernels' names contain, and the resources are reported per
variant (kernels that carry no variant's Traits, shared helpers, count for every variant).
A variant whose kernel spills or whose setmaxnreg was dropped (C7508) fails the build:
it would compile and run, just slowly, and nobody would notice. FA3GEN_ALLOW_SPILLS=1
turns that failure into a warning. Stdlib only: it runs once per TU, start-up matters.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from fa3gen.files import write_atomically

from .lock import compile_running
from .ptxas import SETMAXNREG_IGNORED, WGMMA_SERIALIZED, Diagnostic, PtxasReport, parse_ptxas

MARKER_SUFFIX = ".compiling"


def _write_json(path: Path, data: dict) -> None:
    write_atomically(path, json.dumps(data, indent=2) + "\n")


def _excerpt(log: str, keep: int = 25) -> str:
    """First error lines plus the tail: CuTe template errors can run to thousands of lines."""
    lines = log.splitlines()
    errors = [ln for ln in lines if "error" in ln][:keep]
    tail = lines[-keep:]
    return "\n".join(errors + (["..."] if errors else []) + tail)


def _kernel_summary(report: PtxasReport) -> dict:
    k = report.kernel()
    return {
        "kernel": k.name if k else None,
        "registers": k.registers if k else None,
        "spill_stores": k.spill_stores if k else 0,
        "spill_loads": k.spill_loads if k else 0,
        "stack_frame": k.stack_frame if k else 0,
        "smem_static": k.smem if k else 0,
        "barriers": k.barriers if k else 0,
        "setmaxnreg_ignored": bool(report.codes() & set(SETMAXNREG_IGNORED)),
        "wgmma_serialized": bool(report.codes() & set(WGMMA_SERIALIZED)),
        "warnings": [f"{d.code} {d.message}" for d in report.diagnostics],
        "problems": report.problems(),
    }


def split_by_variant(report: PtxasReport, kernels: dict[str, str]) -> dict[str, PtxasReport]:
    """The report of each variant of a unit: the entries (and diagnostics) whose name holds its
    mangled Traits (kernels: variant -> that), plus those of no variant (shared helpers). A
    unit of one variant takes every entry. A variant none of whose kernels is found fails:
    the attribution (generator/units.py: traits_mangled) no longer matches the kernels."""
    if len(kernels) <= 1:
        return {name: report for name in kernels}

    def owners(function: Optional[str]) -> list[str]:
        return [v for v, mangled in kernels.items() if function and mangled in function]

    shared = PtxasReport([e for e in report.entries if not owners(e.name)],
                         [d for d in report.diagnostics if not owners(d.function)])
    out = {}
    for variant in kernels:
        entries = [e for e in report.entries if variant in owners(e.name)]
        if not entries:
            raise ValueError(f"no kernel of variant {variant} among the unit's ptxas entries "
                             f"({', '.join(e.name for e in report.entries) or 'none'}); "
                             "generator/units.py: traits_mangled no longer matches the kernels")
        out[variant] = PtxasReport(entries + shared.entries,
                                   [d for d in report.diagnostics if variant in owners(d.function)]
                                   + shared.diagnostics)
    return out


def attribute_setmaxnreg(report: PtxasReport, cmd: list[str], work: Path) -> None:
    """ptxas prints C7508 (setmaxnreg ignored) before the entries, naming none: in a unit of
    several variants the warning would then count for all of them. Compile the unit to PTX
    once more and run ptxas on each entry alone; each diagnostic so found names its entry (the
    unnamed ones are dropped). Only a unit with such a warning pays for it (a failing build).
    Leaves the report as it is when the commands cannot run."""
    try:
        nvcc = next(i for i, a in enumerate(cmd) if Path(a).name == "nvcc")
    except StopIteration:
        return
    ptx = work / "unit.ptx"
    ptx_cmd, skip = [], 0
    for a in cmd[nvcc:]:
        if skip:
            skip -= 1
        elif a in ("-MD",):
            pass
        elif a in ("-MF", "-o"):
            skip = 1
            if a == "-o":
                ptx_cmd += ["-o", str(ptx)]
        elif a == "-c":
            ptx_cmd.append("-ptx")
        else:
            ptx_cmd.append(a)
    if subprocess.run(ptx_cmd, capture_output=True).returncode != 0 or not ptx.is_file():
        return
    ptxas = Path(cmd[nvcc]).parent / "ptxas"
    found = []
    for e in report.entries:
        run = subprocess.run([str(ptxas) if ptxas.is_file() else "ptxas", f"-arch={e.arch or 'sm_90a'}",
                              "-v", "-e", e.name, str(ptx), "-o", os.devnull],
                             capture_output=True, text=True, errors="replace")
        if run.returncode != 0:
            return
        found += [Diagnostic(d.code, d.message, e.name)
                  for d in parse_ptxas(run.stdout + run.stderr).diagnostics if d.setmaxnreg_ignored]
    report.diagnostics = [d for d in report.diagnostics
                          if not (d.setmaxnreg_ignored and d.function is None)] + found


def summarize(name: str, log: str, seconds: float, returncode: int,
              kernels: Optional[dict[str, str]] = None,
              report: Optional[PtxasReport] = None) -> dict:
    """The unit's resources: its heaviest kernel's at the top level (as for one variant), every
    entry, and under "variants" each variant's own (split_by_variant). report: the log's,
    parsed (and attributed) already."""
    report = report or parse_ptxas(log)
    out = {"name": name, "returncode": returncode, "compile_seconds": round(seconds, 2),
           **_kernel_summary(report), "entries": report.to_dict()["entries"], "variants": {}}
    if returncode == 0 and kernels and not report.entries:  # -v output lost: nothing checked
        out["problems"] = [*out["problems"], "no kernel entry in the ptxas output (-Xptxas -v)"]
    if returncode == 0 and kernels:
        try:
            out["variants"] = {v: _kernel_summary(r) for v, r in split_by_variant(report, kernels).items()}
        except ValueError as e:
            out["problems"] = [*out["problems"], str(e)]
        else:
            if len(kernels) > 1:  # the problems by variant (a shared kernel's under each)
                out["problems"] = [f"{v}: {p}" for v, r in out["variants"].items() for p in r["problems"]]
    return out


def _what(name: str, kernels: dict[str, str]) -> str:
    """How messages name the TU: "variant N", or the unit and its variants."""
    if len(kernels) <= 1:
        return f"variant {name}"
    return f"unit {name} (variants {', '.join(kernels)})"


def spills_allowed() -> bool:
    """FA3GEN_ALLOW_SPILLS set to anything but empty or 0 (build.py --allow-spills sets it)."""
    return os.environ.get("FA3GEN_ALLOW_SPILLS", "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("compile_one: expected `-- <compiler command>`", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog="compile_one")
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--resources", required=True, type=Path)
    ap.add_argument("--log", type=Path, help="default: --out with .log")
    ap.add_argument("--kernel", action="append", default=[], metavar="VARIANT=MANGLED_TRAITS",
                    help="a variant of the unit and the mangled Traits type of its kernels")
    args = ap.parse_args(argv[:split])
    kernels = dict(k.split("=", 1) for k in args.kernel if "=" in k)
    cmd = argv[split + 1:]
    log_path = args.log or args.out.with_suffix(".log")
    allow = spills_allowed()

    # The whole compile (the checks' reruns of nvcc and the outputs too) under the compiles'
    # lock: past a killed fa3gen, the next build waits for it (generator/lock.py).
    with compile_running() as other_build:
        if other_build:
            print(f"fa3gen: {args.name} not compiled: the build that started it was killed, and "
                  f"build {other_build} holds the folder now", file=sys.stderr)
            return 1
        return _compile(args, kernels, cmd, log_path, allow)


def _compile(args, kernels: dict, cmd: list, log_path: Path, allow: bool) -> int:
    start = time.monotonic()
    # While it compiles, obj/<name>.compiling says so (the build's progress report lists them).
    marker = args.out.with_suffix(MARKER_SUFFIX)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace")
        log, rc = proc.stdout, proc.returncode
    except OSError as e:
        log, rc = f"cannot run {cmd[0] if cmd else '(empty command)'}: {e}\n", 127
    finally:
        marker.unlink(missing_ok=True)
    seconds = time.monotonic() - start
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(log)

    report = parse_ptxas(log)
    if rc == 0 and len(kernels) > 1 and any(d.setmaxnreg_ignored and d.function is None
                                            for d in report.diagnostics):
        import tempfile
        with tempfile.TemporaryDirectory() as work:
            attribute_setmaxnreg(report, cmd, Path(work))
    res = summarize(args.name, log, seconds, rc, kernels, report)
    res["ok"] = rc == 0 and (allow or not res["problems"])
    _write_json(args.resources, res)

    if rc != 0:
        args.out.unlink(missing_ok=True)
        print(_excerpt(log), file=sys.stderr)
        print(f"fa3gen: compiling {_what(args.name, kernels)} failed (exit {rc}); full log: {log_path}",
              file=sys.stderr)
        return rc
    if res["problems"]:
        what = "; ".join(res["problems"])
        if not allow:
            # Remove the object so ninja retries it instead of linking a slow kernel.
            args.out.unlink(missing_ok=True)
            print(f"fa3gen: {_what(args.name, kernels)} failed the resource check: {what} "
                  f"(log: {log_path}; FA3GEN_ALLOW_SPILLS=1 or --allow-spills accepts it)",
                  file=sys.stderr)
            return 1
        print(f"fa3gen: warning: {_what(args.name, kernels)}: {what} (allowed by FA3GEN_ALLOW_SPILLS)",
              file=sys.stderr)
    regs = res["registers"] if res["registers"] is not None else "?"
    note = "" if res["kernel"] else " (no kernel entry found in ptxas output)"
    if res["wgmma_serialized"]:
        note += " WGMMA SERIALIZED"
    count = f" ({len(kernels)} variants, the heaviest kernel's)" if len(kernels) > 1 else ""
    # spills of every kernel of the unit (a spill accepted by --allow-spills may be another's)
    stores, loads = (sum(e[f"spill_{kind}"] for e in res["entries"]) for kind in ("stores", "loads"))
    print(f"{args.name}: {regs} regs, spill {stores}/{loads} B, "
          f"stack {res['stack_frame']} B{count}, {seconds:.1f} s{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
