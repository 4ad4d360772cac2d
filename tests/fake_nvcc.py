"""A stand-in for nvcc in CPU tests: writes the -o file and prints ptxas -v style output.

FAKE_NVCC_SPILL=<substring>: the kernels of variants whose name (or source path) contains it
  report spills. One kernel is reported per variant of the unit, named after its Traits.
FAKE_NVCC_CALLS=<file>: append one line per call (to count compiles).
FAKE_NVCC_DEP=<file>: with -MF, the depfile lists this header besides the source
  (FAKE_NVCC_DEP_FOR=<substring>: only for sources whose path contains it).
FAKE_NVCC_NO_DEPS=<substring>: sources whose path contains it get a depfile listing nothing.
FAKE_NVCC_SLEEP=<seconds>: each variant compile takes that long (concurrency, progress).
"""
import os
import re
import sys
import time


def _mangled(args: str) -> str:
    """Itanium mangling of a template argument list of class types, ints and bools."""
    out = []
    for a in (x.strip() for x in args.split(",")):
        if a in ("true", "false"):
            out.append("Lb1E" if a == "true" else "Lb0E")
        elif a.isdigit():
            out.append(f"Li{a}E")
        else:
            out.append("N" + "".join(f"{len(p)}{p}" for p in a.split("::")) + "E")
    return "".join(out)


def main(argv):
    out = argv[argv.index("-o") + 1]
    src = next((a for a in argv if a.endswith(".cu")), "")
    calls = os.environ.get("FAKE_NVCC_CALLS")
    if calls:
        with open(calls, "a") as f:
            f.write(f"{'link' if '-shared' in argv else os.path.basename(src)}\n")
    if os.environ.get("FAKE_NVCC_SLEEP") and "-MF" in argv:
        time.sleep(float(os.environ["FAKE_NVCC_SLEEP"]))
    with open(out, "w") as f:
        f.write(f"fake object of {os.path.basename(src) or 'link'}\n")
    if "-MF" in argv:  # nvcc -MD -MF: make-style dependencies of the TU
        dep, only = os.environ.get("FAKE_NVCC_DEP"), os.environ.get("FAKE_NVCC_DEP_FOR", "")
        deps = [src] + ([dep] if dep and only in src else [])
        if os.environ.get("FAKE_NVCC_NO_DEPS") and os.environ["FAKE_NVCC_NO_DEPS"] in src:
            deps = []
        with open(argv[argv.index("-MF") + 1], "w") as f:
            f.write(f"{out}: {' '.join(deps)}\n")
    if "-shared" in argv or "-v" not in argv:
        return 0
    spill = os.environ.get("FAKE_NVCC_SPILL")
    text = open(src).read() if os.path.exists(src) else ""
    # "// <variant>" then its launcher's call: fa3gen::launch_fwd<cutlass::bfloat16_t, 128, ...>
    found = re.findall(r"^// (\S+)\n.*?fa3gen::launch_(fwd|bwd)<([^>]*)>", text, re.M | re.S)
    kernels = [(name, f"_ZN6fa3gen10{d}_kernelINS_9{d.capitalize()}TraitsI{_mangled(args)}EEEEvNS_6ParamsE")
               for name, d, args in found] or [(src, "_ZN6fa3gen6detail10fwd_kernelEv")]
    for name, fn in kernels:
        n = 8 if spill and (spill in name or spill in src) else 0
        sys.stderr.write(
            "ptxas info    : 0 bytes gmem\n"
            f"ptxas info    : Compiling entry function '{fn}' for 'sm_90a'\n"
            f"ptxas info    : Function properties for {fn}\n"
            f"    0 bytes stack frame, {n} bytes spill stores, {n} bytes spill loads\n"
            "ptxas info    : Used 168 registers, used 2 barriers, 400 bytes cmem[0]\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
