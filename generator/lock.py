"""One build per output directory at a time.

Two `fa3gen build` runs of one spec would otherwise both render and both run ninja over the same
objects, compiling everything twice and racing on the library. The second waits for the first
(and says so), then finds nothing left to do.

Two locks: `.build.lock`, held by fa3gen for the whole build, and `.compiles.lock`, held shared
by each compile (generator/compile_one.py) while it runs. A `kill -9` of fa3gen frees the first
at once; its ninja dies at its next line to the dead reader, but the compiles already running
go on, and the second lock makes the next build wait for them (`fa3gen clean` and `fa3gen
package` refuse until they end). Both are opened close-on-exec: nvcc, a compiler launcher
and a daemon it leaves behind (sccache's server) never hold them.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

LOCK_NAME = ".build.lock"
COMPILES_LOCK_NAME = ".compiles.lock"
COMPILES_LOCK_ENV = "FA3GEN_COMPILES_LOCK"  # its path, in ninja's environment (run_ninja)
BUILD_PID_ENV = "FA3GEN_BUILD_PID"  # the fa3gen that started ninja, in the same environment
KILLED_BUILDS_COMPILES = "compiles that a killed build left running"


@contextmanager
def build_lock(out_dir: Path, what: str, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold an exclusive lock on out_dir/.build.lock (flock: released by the kernel when the
    process dies, so a killed build never leaves the directory locked), after the compiles a
    killed build left running have ended."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            log(f"fa3gen: another build of {what} is running in {out_dir} (pid {holder}); "
                "waiting for it to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
            log(f"fa3gen: the other build of {what} finished; continuing")
        _claim(fd)
        _wait_for_compiles(out_dir, what, log)
        yield
    finally:
        os.close(fd)  # releases the lock


def _claim(fd: int) -> None:
    """This process's pid into the held .build.lock, before waiting for compiles: a compile of
    a killed build that takes its lock after that finds another pid and does not start
    (compile_running)."""
    mine = f"{os.getpid()}\n".encode()
    os.pwrite(fd, mine, 0)
    os.ftruncate(fd, len(mine))


def _wait_for_compiles(out_dir: Path, what: str, log: Callable[[str], None]) -> None:
    with _busy_compiles_lock(out_dir) as fd:
        if fd is None:
            return
        log(f"fa3gen: {KILLED_BUILDS_COMPILES} in {out_dir} (of {what}) are still running; "
            f"waiting for them (`fuser -v {out_dir / COMPILES_LOCK_NAME}` lists them)")
        fcntl.flock(fd, fcntl.LOCK_EX)


@contextmanager
def compile_running() -> Iterator[str | None]:
    """Held (shared) by a compile while it runs, so that no build or clean starts in its output
    folder under it, even after the fa3gen that started it was killed. Yields None, or the pid
    of another build that holds the folder now (the one that started this compile was killed
    while its ninja was starting compiles): the compile must then not run. The lock's path and
    the building fa3gen's pid come from $FA3GEN_COMPILES_LOCK and $FA3GEN_BUILD_PID; a compile
    outside a build, or in a folder it cannot open the lock in, holds nothing."""
    path = os.environ.get(COMPILES_LOCK_ENV)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644) if path else None
    except OSError:
        fd = None
    if fd is None:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield _other_build(Path(path).with_name(LOCK_NAME))
    finally:
        os.close(fd)


def _other_build(build_lock_path: Path) -> str | None:
    mine = os.environ.get(BUILD_PID_ENV)
    try:
        holder = build_lock_path.read_text().strip()
    except OSError:
        return None
    return holder if mine and holder and holder != mine else None


@contextmanager
def _busy_compiles_lock(out_dir: Path) -> Iterator[int | None]:
    """out_dir's compiles' lock, open, while compiles hold it (else None): a wait for them then
    takes the descriptor that found them busy."""
    try:
        fd = os.open(Path(out_dir) / COMPILES_LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # never compiled (or before this lock existed)
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            busy = False
        except BlockingIOError:
            busy = True
        yield fd if busy else None
    finally:
        os.close(fd)


def _compiles_busy(out_dir: Path) -> bool:
    """Whether compiles hold out_dir's compiles' lock."""
    with _busy_compiles_lock(out_dir) as fd:
        return fd is not None


@contextmanager
def lock_unless_busy(out_dir: Path) -> Iterator[str | None]:
    """For removing out_dir: hold its build lock while the block runs (yields None), or, when a
    build holds it, yield who does ("pid N", or KILLED_BUILDS_COMPILES; the block must then
    leave out_dir alone)."""
    try:
        fd = os.open(Path(out_dir) / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # no lock file (never built, or before the lock existed), or not a file
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield f"pid {os.pread(fd, 64, 0).decode(errors='replace').strip() or '?'}"
            return
        _claim(fd)
        if _compiles_busy(out_dir):
            yield KILLED_BUILDS_COMPILES
            return
        yield None
    finally:
        os.close(fd)
