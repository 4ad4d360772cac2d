"""Parse `nvcc -Xptxas -v` output into per-kernel resource usage and diagnostics.

We read it for every variant because a spilling kernel or one whose setmaxnreg was
dropped compiles fine and silently runs slow.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Optional

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")
_CMEM = re.compile(r"(\d+) bytes cmem\[0\]")
_DIAG = re.compile(r"\((C\d{4})\)\s*(.*)")
_IN_FUNC = re.compile(r"function '([^']+)'")

# setmaxnreg dropped (C7508: entry register count unknown; C7504: kept for cross-TU compat).
SETMAXNREG_IGNORED = ("C7504", "C7508")
# wgmma.mma_async serialized (performance loss; recorded, not fatal).
WGMMA_SERIALIZED = tuple(f"C75{n:02d}" for n in range(9, 16))  # C7509 .. C7515


@dataclass
class EntryResources:
    name: str
    arch: str = ""
    registers: Optional[int] = None
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0        # static shared memory; dynamic smem is not known to ptxas
    barriers: int = 0
    cmem: int = 0


@dataclass
class Diagnostic:
    code: str
    message: str
    function: Optional[str] = None

    @property
    def setmaxnreg_ignored(self) -> bool:
        return self.code in SETMAXNREG_IGNORED or ("setmaxnreg" in self.message
                                                   and "ignored" in self.message)


@dataclass
class PtxasReport:
    entries: list[EntryResources] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)

    def kernel(self, hint: str = "fa3gen") -> Optional[EntryResources]:
        """THE kernel of a variant TU: the heaviest entry whose name mentions `hint`,
        else the heaviest entry (helpers such as memset kernels are small)."""
        pool = [e for e in self.entries if hint in e.name] or self.entries
        return max(pool, key=lambda e: e.registers or 0, default=None)

    def codes(self) -> set[str]:
        return {d.code for d in self.diagnostics}

    def problems(self) -> list[str]:
        """Why this TU counts as a failed variant (empty list: fine)."""
        out = [f"{e.name}: {e.spill_stores} bytes spill stores, {e.spill_loads} bytes spill loads"
               for e in self.entries if e.spill_stores or e.spill_loads]
        out += [f"{d.code} {d.message}" for d in self.diagnostics if d.setmaxnreg_ignored]
        return out

    def to_dict(self) -> dict:
        return {"entries": [asdict(e) for e in self.entries],
                "diagnostics": [asdict(d) for d in self.diagnostics]}


def parse_ptxas(text: str) -> PtxasReport:
    report = PtxasReport()
    by_name: dict[str, EntryResources] = {}
    current: Optional[EntryResources] = None  # entry whose "Used ..." line comes next
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = by_name.setdefault(m.group(1), EntryResources(m.group(1), m.group(2)))
            if current not in report.entries:
                report.entries.append(current)
            continue
        m = _PROPS.search(line)
        if m:
            # Non-entry (device) functions also get a properties block; ignore those.
            current = by_name.get(m.group(1))
            continue
        m = _FRAME.search(line)
        if m and current is not None:
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
            continue
        m = _USED.search(line)
        if m and current is not None:
            current.registers = int(m.group(1))
            for rx, attr in ((_BARRIERS, "barriers"), (_SMEM, "smem"), (_CMEM, "cmem")):
                mm = rx.search(line)
                if mm:
                    setattr(current, attr, int(mm.group(1)))
            continue
        m = _DIAG.search(line)
        if m and "ptxas" in line:
            fn = _IN_FUNC.search(m.group(2))
            report.diagnostics.append(Diagnostic(m.group(1), m.group(2).strip(),
                                                 fn.group(1) if fn else None))
    return report
