"""Progress of a long build: every ~10 s without other output, which translation units are
compiling, for how long, and an estimate of what remains.

ninja prints a status line when an edge finishes ("[done/total elapsed] NVCC name") and
compile_one prints "name: ... 41.9 s" per TU (a compile unit of variants); the TUs in flight
are the obj/*.compiling markers that compile_one keeps while it runs.
"""
from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .compile_one import MARKER_SUFFIX

_STATUS_RE = re.compile(r"^\[(\d+)/(\d+)\b")
_OTHER_EDGE_RE = re.compile(r"^\[[^\]]*\]\s*(NVCC obj/|LINK )")  # a plain TU's or the link's status
_TU_SECONDS_RE = re.compile(r"^(\S+): .*, ([\d.]+) s\b")


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


@dataclass
class Progress:
    obj_dir: Path
    jobs: int
    total: Optional[int] = None       # edges ninja runs (its status lines say; unknown before)
    done: int = 0
    start: float = field(default_factory=time.monotonic)
    tu_seconds: list[float] = field(default_factory=list)
    others: int = 0                   # edges that are not a unit's compile (plain TUs, the link)
    others_done: int = 0

    def feed(self, line: str) -> None:
        """Take one line of ninja's output."""
        m = _STATUS_RE.match(line)
        if m:
            self.done, self.total = int(m.group(1)), int(m.group(2))
            self.others_done += bool(_OTHER_EDGE_RE.match(line))
        m = _TU_SECONDS_RE.match(line)
        if m:
            self.tu_seconds.append(float(m.group(2)))

    def running(self, now: Optional[float] = None) -> list[tuple[str, float]]:
        """(unit, seconds so far) of the TUs compiling now, longest first."""
        now = time.time() if now is None else now
        out = []
        for marker in self.obj_dir.glob(f"*{MARKER_SUFFIX}"):
            try:
                out.append((marker.name[:-len(MARKER_SUFFIX)], max(0.0, now - marker.stat().st_mtime)))
            except FileNotFoundError:  # finished meanwhile
                pass
        return sorted(out, key=lambda x: -x[1])

    def remaining_seconds(self, running: list[tuple[str, float]]) -> Optional[float]:
        """Queued TUs at the mean TU time, plus what the running ones have left, over the jobs.
        The edges left that are not units (at most `others`, short) are not counted as units."""
        if self.total is None or not self.tu_seconds:
            return None
        mean = statistics.mean(self.tu_seconds)
        others_left = max(0, self.others - self.others_done)
        queued = max(0, self.total - self.done - len(running) - others_left)
        left = queued * mean + sum(max(0.0, mean - age) for _, age in running)
        return left / max(1, self.jobs)

    def report(self) -> str:
        running = self.running()
        parts = [f"fa3gen: {self.done}/{self.total if self.total is not None else '?'} done "
                 f"after {_duration(time.monotonic() - self.start)}"]
        if running:
            shown = ", ".join(f"{name} ({_duration(age)})" for name, age in running[:4])
            more = f" and {len(running) - 4} more" if len(running) > 4 else ""
            parts.append(f"compiling {shown}{more}")
        left = self.remaining_seconds(running)
        parts.append(f"about {_duration(left)} left" if left is not None
                     else "estimate after the first unit")
        return "; ".join(parts)
