import os
import stat
import threading

import pytest

from fa3gen.files import replacing, write_atomically


def test_write_atomically_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "out.json"
    write_atomically(path, "old")
    write_atomically(path, b"new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_a_pipe_or_device_is_written_through_not_replaced(tmp_path):
    """`--out /dev/null` must not replace /dev/null (as root a rename would): a path that is
    not a regular file gets the bytes written into it. Shown with a named pipe."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_atomically(fifo, "report\n")
    reader.join(timeout=10)
    assert got == ["report\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.fifo"]


def test_a_symbolic_link_keeps_its_link_and_its_target_is_replaced(tmp_path):
    """Renaming over a link replaced it with a regular file (as root, /dev/stdout's in /dev):
    the link stays and the file it names is replaced, atomically."""
    target = tmp_path / "target.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    write_atomically(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "target.txt"]


def test_a_path_through_proc_is_appended_to(tmp_path):
    """/dev/stdout redirected to a file (`>> log`) is /proc/self/fd/1: what the file holds
    stays, and the text is appended (writing it through with truncation wiped the log,
    replacing the resolved file swapped the log for the text)."""
    log = tmp_path / "log.txt"
    log.write_text("earlier output\n")
    with open(log, "a") as fh:
        link = tmp_path / "stdout"
        link.symlink_to(f"/proc/self/fd/{fh.fileno()}")
        write_atomically(link, "report\n")
    assert log.read_text() == "earlier output\nreport\n" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "stdout"]
