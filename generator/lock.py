"""One build per output directory at a time.

Two `fa3gen build` runs of one spec would otherwise both render and both run ninja over the same
objects, compiling everything twice and racing on the library. The second waits for the first
(and says so), then finds nothing left to do.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

LOCK_NAME = ".build.lock"


@contextmanager
def build_lock(out_dir: Path, what: str, log: Callable[[str], None] = print) -> Iterator[int]:
    """Hold an exclusive lock on out_dir/.build.lock (flock: released by the kernel when the
    last process holding it dies, so a killed build never leaves the directory locked). Yields
    the locked descriptor: a child given it (run_ninja's hold_fds) keeps the lock while it and
    the compiles it started live, so a `kill -9` of fa3gen leaves no ninja compiling unlocked."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    if fd < 3:  # stdio was closed: keep clear of the descriptors a child's stdio takes
        low, fd = fd, fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
        os.close(low)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            log(f"fa3gen: another build of {what} is running in {out_dir} (pid {holder}); "
                "waiting for it to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
            log(f"fa3gen: the other build of {what} finished; continuing")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield fd
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def lock_unless_busy(out_dir: Path) -> Iterator[str | None]:
    """For removing out_dir: hold its build lock while the block runs (yields None), or, when a
    build holds it, yield that build's pid (the block must then leave out_dir alone)."""
    try:
        fd = os.open(Path(out_dir) / LOCK_NAME, os.O_RDWR)
    except OSError:  # no lock file (never built, or before the lock existed), or not a file
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            return
        yield None
    finally:
        os.close(fd)
