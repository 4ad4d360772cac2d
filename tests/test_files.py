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
