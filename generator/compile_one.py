"""Compile one translation unit for ninja: run nvcc, time it, keep its log, check ptxas.

    python -m generator.compile_one --name N --out obj/N.o --resources obj/N.resources.json \
        -- nvcc ... -c src/N.cu -o obj/N.o

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

from fa3gen.files import write_atomically

from .ptxas import SETMAXNREG_IGNORED, WGMMA_SERIALIZED, parse_ptxas

MARKER_SUFFIX = ".compiling"


def _write_json(path: Path, data: dict) -> None:
    write_atomically(path, json.dumps(data, indent=2) + "\n")


def _excerpt(log: str, keep: int = 25) -> str:
    """First error lines plus the tail: CuTe template errors can run to thousands of lines."""
    lines = log.splitlines()
    errors = [ln for ln in lines if "error" in ln][:keep]
    tail = lines[-keep:]
    return "\n".join(errors + (["..."] if errors else []) + tail)


def summarize(name: str, log: str, seconds: float, returncode: int) -> dict:
    report = parse_ptxas(log)
    k = report.kernel()
    return {
        "name": name,
        "returncode": returncode,
        "compile_seconds": round(seconds, 2),
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
        "entries": report.to_dict()["entries"],
    }


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
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1:]
    log_path = args.log or args.out.with_suffix(".log")
    allow = spills_allowed()

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

    res = summarize(args.name, log, seconds, rc)
    res["ok"] = rc == 0 and (allow or not res["problems"])
    _write_json(args.resources, res)

    if rc != 0:
        args.out.unlink(missing_ok=True)
        print(_excerpt(log), file=sys.stderr)
        print(f"fa3gen: compiling variant {args.name} failed (exit {rc}); full log: {log_path}",
              file=sys.stderr)
        return rc
    if res["problems"]:
        what = "; ".join(res["problems"])
        if not allow:
            # Remove the object so ninja retries it instead of linking a slow kernel.
            args.out.unlink(missing_ok=True)
            print(f"fa3gen: variant {args.name} failed the resource check: {what} "
                  f"(log: {log_path}; FA3GEN_ALLOW_SPILLS=1 or --allow-spills accepts it)",
                  file=sys.stderr)
            return 1
        print(f"fa3gen: warning: variant {args.name}: {what} (allowed by FA3GEN_ALLOW_SPILLS)",
              file=sys.stderr)
    regs = res["registers"] if res["registers"] is not None else "?"
    note = "" if res["kernel"] else " (no kernel entry found in ptxas output)"
    if res["wgmma_serialized"]:
        note += " WGMMA SERIALIZED"
    print(f"{args.name}: {regs} regs, spill {res['spill_stores']}/{res['spill_loads']} B, "
          f"stack {res['stack_frame']} B, {seconds:.1f} s{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
