"""Files written so that a reader (ninja, a second process, a killed run's successor) sees the
old content or the new, never a cut-off file."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def written_through(path: Path) -> bool:
    """Whether `path` is to be written into rather than replaced: an existing file that is not
    a regular one (/dev/null, a pipe), or one reached through /proc (/dev/stdout ->
    /proc/self/fd/1: replacing what that resolves to would replace the file stdout is
    redirected to, and renaming over the link as root would leave a regular file in /dev)."""
    p = Path(path)
    for _ in range(40):  # the hops of a chain of links, each in its folder's real place
        p = Path(os.path.realpath(p.parent)) / p.name  # /dev/fd/1: /proc/self/fd/1
        if p.parts[:2] == ("/", "proc"):
            return True
        if not p.is_symlink():
            return p.exists() and not p.is_file() and not p.is_dir()
        p = p.parent / os.readlink(p)
    return True  # a loop: opening it fails and says so


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write; it replaces `path` in one step when the block
    ends normally and is removed when it raises. Named by process id, so that two processes
    writing the same file never share one. A symbolic link to a regular file keeps its link:
    the file it names is replaced. A path `written_through` is handed out itself."""
    path = Path(path)
    if written_through(path):
        yield path
        return
    if path.is_symlink():
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def stdout_to_devnull() -> None:
    """After stdout's reader left (a broken pipe): later prints and the flush at exit go to
    /dev/null instead of failing again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no stdout, or one without a descriptor
        pass


class StdoutWithoutReader:
    """sys.stdout for a command whose work is not its output (a build, a written spec or
    wheel, a measurement): when the reader leaves (`| head`: a broken pipe) the output stops
    (stdout_to_devnull) and the command goes on."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (BrokenPipeError, ValueError) as e:
            self._left(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (BrokenPipeError, ValueError) as e:
            self._left(e)

    def _left(self, error: Exception) -> None:
        """The reader left: a broken pipe, or a stdout closed under us (ValueError); any other
        ValueError (text the stream cannot encode) is the command's to report."""
        if isinstance(error, ValueError) and not getattr(self._stream, "closed", False):
            raise error
        stdout_to_devnull()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def write_atomically(path: Path, data: str | bytes) -> None:
    path = Path(path)
    with replacing(path) as tmp:
        if tmp == path:  # written through: replacing hands the path itself out
            _write_through(path, data)
        elif isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)


def _write_through(path: Path, data: str | bytes) -> None:
    """Into a path written through: this process's stdout or stderr (/dev/stdout, /dev/fd/2)
    through its stream, so that the text lands where the stream is (a file opened with `>`
    keeps the stream's own position, which a write through another descriptor would not
    move: later output overwrote it); anything else appended (`>>` keeps what it holds)."""
    try:
        target = os.stat(path)
    except OSError:
        target = None
    for stream in (sys.stdout, sys.stderr):
        try:
            same = target is not None and os.path.samestat(target, os.fstat(stream.fileno()))
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's capture), closed
            same = False
        if same:
            if isinstance(data, bytes):
                stream.flush()
                stream.buffer.write(data)
                stream.buffer.flush()
            else:
                stream.write(data)
                stream.flush()
            return
    with open(path, "ab" if isinstance(data, bytes) else "a") as fh:
        fh.write(data)
