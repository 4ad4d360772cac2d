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


def test_a_symbolic_link_is_written_through_not_replaced(tmp_path):
    """/dev/stdout is a link, to a regular file when stdout is redirected to one: renaming over
    it (as root) replaced the link with a regular file. The link stays and its target gets
    the bytes."""
    target = tmp_path / "target.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    write_atomically(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "target.txt"]
