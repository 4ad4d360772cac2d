"""The static SASS of variants' main loops, without a GPU: render each named variant, compile it
to a cubin with the build's flags, disassemble it and print every loop that issues at least
--min-gmma warpgroup GEMMs (HGMMA for 16-bit, QGMMA for fp8), with its instruction count and
the opcodes that tell overhead apart.

    python3 tests/gpu/sass_loops.py fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1 [more names]
    python3 tests/gpu/sass_loops.py --cubin x.cubin [--events]

Not a pytest module. Needs nvcc and the CUTLASS headers (as a build does) and a disassembler:
cuobjdump or nvdisasm on PATH, or NVDISASM=path (the `nvidia-cuda-nvdisasm` wheel ships one,
nvidia/cu13/bin/nvdisasm, which runs on a machine without a GPU). A loop is a backward branch;
the innermost loop holding the GEMMs is the steady-state step (the first row of a kernel,
usually). Counts are static (one pass through the loop), not executed instructions.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHOWN = ("GMMA", "BRA", "WARPSYNC", "BAR", "ISETP", "R2UR", "UMOV", "UIADD3", "PLOP3", "FSEL",
         "NANOSLEEP")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSN = re.compile(r"/\*[0-9a-f]+\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"BRA(?:\.\S+)? `\((\.L_x_\d+)\)")


def disassemble(cubin: Path) -> str:
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    cmd = [tool, "-c", str(cubin)] if tool else ["cuobjdump", "-sass", str(cubin)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def opcode(insn: str) -> str:
    insn = re.sub(r"^@!?U?P\w+\s+", "", insn)  # drop a predicate
    return insn.split()[0].split(".")[0]


GMMA_OPS = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")  # warpgroup MMA by operand type


def _loop_bodies(sass: str, min_gmma: int) -> list[tuple[collections.Counter, list[str]]]:
    """(opcode counts, instructions) of each backward-branch loop with enough warpgroup GEMMs,
    shortest first; the counts gain "GMMA", their sum over operand types."""
    labels, insns = {}, []
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _INSN.search(line)
        if m:
            insns.append(m.group(1))
    out = []
    for i, insn in enumerate(insns):
        m = _BRANCH.search(insn)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = insns[labels[m.group(1)]:i + 1]
            ops = collections.Counter(opcode(x) for x in body)
            ops["GMMA"] = sum(ops[op] for op in GMMA_OPS)
            if ops["GMMA"] >= min_gmma:
                out.append((ops, body))
    return sorted(out, key=lambda x: len(x[1]))


def loops(sass: str, min_gmma: int) -> list[tuple[int, collections.Counter]]:
    """(instruction count, opcode counts) of each backward-branch loop with enough warpgroup
    GEMMs; the counts gain "GMMA", their sum over operand types."""
    return [(len(body), ops) for ops, body in _loop_bodies(sass, min_gmma)]


def events(body: list[str]) -> str:
    """The order of a loop's GEMMs (G), exponentials (E), named barriers (BAR) and warpgroup
    waits (WAIT n: at most n GEMM groups left in flight), runs counted: e.g. "G19 BAR WAIT1
    WAIT0 E90" says that the wait for every GEMM comes before the softmax's exponentials."""
    out = []
    for insn in body:
        op = opcode(insn)
        if op == "WARPGROUP" and "DEPBAR" in insn:
            ev = "WAIT" + str(int(insn.rsplit(",", 1)[1], 0))
        elif op in GMMA_OPS:
            ev = "G"
        elif op == "MUFU" and ".EX2" in insn:
            ev = "E"
        elif op == "BAR":
            ev = "BAR"
        else:
            continue
        if out and out[-1][0] == ev and ev in ("G", "E"):
            out[-1][1] += 1
        else:
            out.append([ev, 1])
    return " ".join(f"{ev}{n}" if n > 1 else ev for ev, n in out)


def compile_variant(name: str, workdir: Path) -> Path:
    from fa3gen.contract import parse_name
    from generator import toolchain
    from generator.render import render_variant

    tc = toolchain.detect()
    src = workdir / f"{name}.cu"
    src.write_text(render_variant(parse_name(name)))
    cubin = workdir / f"{name}.cubin"
    flags = [f for f in tc.flags if f not in ("-Xcompiler", "-fPIC", "-fvisibility=hidden")]
    res = subprocess.run([str(tc.nvcc), *flags, "-cubin", "-o", str(cubin), str(src)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{name}: nvcc failed:\n{res.stderr[-3000:]}")
    for line in res.stderr.splitlines():  # ptxas -v: registers, spills, and (C75xx) GEMM serialization
        if "spill" in line or "Used" in line or "(C75" in line:
            print(f"  {line.strip()}")
    return cubin


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="variant names to render and compile")
    parser.add_argument("--cubin", action="append", default=[], help="a compiled cubin instead")
    parser.add_argument("--min-gmma", "--min-hgmma", type=int, default=10,
                        help="report loops with at least this many warpgroup GEMMs (fp8 steps "
                             "have half as many as 16-bit ones at the same tile)")
    parser.add_argument("--events", action="store_true",
                        help="also print each loop's order of GEMMs, exponentials, barriers and "
                             "warpgroup waits (where the softmax sits against the GEMMs' waits)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubins = [(Path(c).name, Path(c)) for c in args.cubin]
        for name in args.names:
            print(name)
            cubins.append((name, compile_variant(name, Path(tmp))))
        for label, cubin in cubins:
            print(f"{label}: loops with >= {args.min_gmma} GMMA (static instruction counts)")
            for ops, body in _loop_bodies(disassemble(cubin), args.min_gmma):
                print(f"  {len(body):5d} instructions; " + " ".join(f"{k} {ops[k]}" for k in SHOWN))
                if args.events:
                    print(f"        order: {events(body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
