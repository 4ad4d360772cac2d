"""Compare the SASS of two built libraries, kernel by kernel, ignoring what does not change the
code: instruction addresses, encodings and the offsets of kernel parameters in the constant
bank (they move when a params struct gains a field).

    python3 tests/gpu/sass_compare.py OLD.so NEW.so

Not a pytest module; needs cuobjdump (CUDA toolkit) on PATH. For each kernel of OLD it looks for
a kernel of NEW with the same normalized code and prints how many have one; for the others, the
instruction counts and the opcodes whose counts differ from the closest NEW kernel.
"""

import argparse
import collections
import re
import subprocess
import sys

_FUNC = re.compile(r"^\s*Function : (\S+)")
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")
_CONST = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def kernels(path: str) -> dict[str, list[str]]:
    text = subprocess.run(["cuobjdump", "-sass", path], check=True, capture_output=True,
                          text=True).stdout
    out, name = {}, None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = _INSN.search(line)
        if name and m:
            out[name].append(_CONST.sub("c[0x0][P]", m.group(1)))
    return out


def opcodes(code: list[str]) -> collections.Counter:
    return collections.Counter(i.split()[0] if not i.startswith("@") else i.split()[1] for i in code)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new")
    args = p.parse_args()
    old, new = kernels(args.old), kernels(args.new)
    bodies = {tuple(code) for code in new.values()}
    same = [n for n, code in old.items() if tuple(code) in bodies]
    print(f"{len(same)} of {len(old)} kernels of {args.old} have identical normalized SASS in "
          f"{args.new} ({len(new)} kernels)")
    for name, code in old.items():
        if tuple(code) in bodies:
            continue
        ops = opcodes(code)
        closest = min(new.items(), key=lambda kv: sum(((opcodes(kv[1]) - ops) + (ops - opcodes(kv[1]))).values()))
        diff = {k: opcodes(closest[1])[k] - ops[k] for k in set(ops) | set(opcodes(closest[1]))
                if opcodes(closest[1])[k] != ops[k]}
        print(f"  {name}: {len(code)} instructions; closest {closest[0]}: {len(closest[1])}; "
              f"opcode count changes {dict(sorted(diff.items()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
