import os
import stat
import subprocess
import sys
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


def test_paths_into_proc_by_their_folder_are_written_through(tmp_path):
    """/dev/fd/N is no link itself: its folder is (to /proc/self/fd); a relative link can climb
    there with `..`. Both were taken for files to replace (a temporary in /proc/<pid>/fd)."""
    from fa3gen.files import written_through
    read, write = os.pipe()
    try:
        assert written_through(f"/dev/fd/{write}")
        climb = tmp_path / "climb"
        climb.symlink_to("../" * len(tmp_path.parts) + f"proc/self/fd/{write}")
        assert written_through(climb)
        assert not written_through(tmp_path / "out.json")
        (tmp_path / "plain").write_text("x")
        (tmp_path / "link").symlink_to(tmp_path / "plain")
        assert not written_through(tmp_path / "link") and not written_through(tmp_path / "plain")
    finally:
        os.close(read)
        os.close(write)


def test_stdout_redirected_with_truncation_gets_the_text_where_its_stream_is(tmp_path):
    """`> file`: the stream keeps its own position in the file, so text written through another
    descriptor was overwritten by the output printed after it (`fa3gen bench --out
    /dev/stdout > r.json`); it now goes through the stream, between what is printed around it."""
    out = tmp_path / "out.txt"
    code = ("from fa3gen.files import write_atomically\n"
            "print('before')\nwrite_atomically('/dev/stdout', 'report\\n')\nprint('after')\n"
            "write_atomically('/dev/stdout', b'bytes\\n')\nprint('end')\n")
    with open(out, "w") as fh:
        subprocess.run([sys.executable, "-c", code], stdout=fh, check=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.read_text() == "before\nreport\nafter\nbytes\nend\n"
