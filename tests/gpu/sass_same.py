"""Whether a change leaves kernels' code alone, without a GPU: each VARIANT rendered and compiled
(device code only, a cubin) from REV's build inputs and from this tree (with --define, if given),
disassembled, and compared after removing what does not change the code (instruction addresses
and encodings, kernel-parameter offsets in the constant bank, the hashes in internal symbol
names, the kernels' mangled names (their template arguments: a new axis renames every kernel),
label numbers; labels stay where they are).

    NVDISASM=... python3 tests/gpu/sass_same.py REV VARIANT... [--define NAME[=VALUE]]... [-j 2]

For a commit that means to change nothing in the default kernels (a measurement switch behind an
#ifdef, a refactor) or only some of them. Needs nvcc (and cuobjdump, or nvdisasm: NVDISASM= or on
PATH, as tests/gpu/sass_loops.py). Prints one line a variant; exits 1 when any differs. Not a
pytest module.
"""

import argparse
import concurrent.futures
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_trees import ROOT, export  # noqa: E402
from sass_loops import disassemble  # noqa: E402

# Run in a tree (PYTHONPATH and cwd): that tree's renderer and compile flags, cubin only.
COMPILE = """
import subprocess, sys
from pathlib import Path
from fa3gen.contract import parse_name
from generator import toolchain
from generator.render import render_variant
name, out, *defines = sys.argv[1:]
src = Path(out).with_suffix(".cu")
src.write_text(render_variant(parse_name(name)))
tc = toolchain.detect()
flags = [f for f in tc.flags if f not in ("-Xcompiler", "-fPIC", "-fvisibility=hidden")]
result = subprocess.run([str(tc.nvcc), *flags, *defines, "-cubin", "-o", out, str(src)],
                        capture_output=True, text=True)
sys.stderr.write(result.stderr if result.returncode else "")
sys.exit(result.returncode)
"""

_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_ENCODING = re.compile(r"/\*\s*0x[0-9a-f]+\s*\*/")
_HASH = re.compile(r"(_INTERNAL_|_GLOBAL__N__)[0-9a-f]+_")
_CONST = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
_LABEL = re.compile(r"\.L_x_\d+")  # numbered in order: one inserted branch renumbers the rest
# A kernel's mangled name spells its template arguments: a new one (a new axis, off) renames it.
_KERNEL = re.compile(r"_ZN6fa3gen\w+")


def normalized(sass: str) -> list[str]:
    """The disassembly's lines that carry code, without what moves when nothing changed."""
    out = []
    for line in sass.splitlines():
        line = _CONST.sub("c[0x0][P]", _HASH.sub(r"\1H_", _ENCODING.sub("", _ADDRESS.sub("", line))))
        line = _KERNEL.sub("KERNEL", _LABEL.sub(".L_x", line))
        line = line.strip()
        if line and not line.startswith("//"):
            out.append(line)
    return out


def compile_variant(tree: Path, name: str, out: Path, defines: list[str]) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run([sys.executable, "-c", COMPILE, name, str(out), *defines], cwd=tree,
                            env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} did not compile in {tree}:\n{result.stderr[-2000:]}")
    return normalized(disassemble(out))


def compare(name: str, old: list[str], new: list[str]) -> str | None:
    """None when identical, else a short account of the first differences."""
    if old == new:
        return None
    diff = list(difflib.unified_diff(old, new, "REV", "tree", n=0, lineterm=""))
    return f"{len(old)} -> {len(new)} lines; first differences:\n  " + "\n  ".join(diff[2:12])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                        help="compile this tree's side with the definition (repeatable)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    defines = [f"-D{d}" for d in args.define]
    with tempfile.TemporaryDirectory(prefix="sass_same_") as tmp:
        work = Path(tmp)
        commit = export(args.rev, work / "rev")
        jobs = [(tree, name, work / f"{side}_{name}.cubin", flags)
                for name in args.variants
                for side, tree, flags in (("rev", work / "rev", []), ("tree", ROOT, defines))]
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            sass = list(pool.map(lambda job: compile_variant(*job), jobs))
    differing = 0
    for i, name in enumerate(args.variants):
        why = compare(name, sass[2 * i], sass[2 * i + 1])
        differing += why is not None
        print(f"{name}: " + ("same SASS" if why is None else "differs, " + why))
    label = "this tree" + (" with " + " ".join(args.define) if args.define else "")
    print(f"{len(args.variants) - differing} of {len(args.variants)} the same in {label} as at "
          f"{commit[:10]}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
