"""Toolchain discovery and the build fingerprint (generator/toolchain.py)."""
import shutil
from pathlib import Path

import pytest

from generator import toolchain as T
from generator.errors import ToolchainError
from generator.paths import TEMPLATES_DIR


def fp(templates: Path, **kw) -> str:
    args = dict(nvcc_version="13.0", flags=["-O3"], link_flags=["-shared"], cutlass_version="4.2.0")
    args.update(kw)
    return T.fingerprint(templates_dir=templates, **args)


def test_fingerprint_tracks_templates_and_toolchain(tmp_path, under_hash_seeds):
    tpl = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR, tpl)
    base = fp(tpl)
    a, b = under_hash_seeds(  # the same in every process, else every build recompiles all
        "from tests.test_toolchain import fp; from pathlib import Path; "
        f"print(fp(Path({str(tpl)!r})))")
    assert a == b == base + "\n"
    assert fp(tpl, nvcc_version="13.1") != base
    assert fp(tpl, flags=["-O2"]) != base
    assert fp(tpl, cutlass_version="4.3.0") != base
    jinja = tpl / "variant.cu.j2"
    jinja.write_text(jinja.read_text() + "\n// changed\n")
    changed = fp(tpl)
    assert changed != base
    (tpl / "new.j2").write_text("x\n")
    assert fp(tpl) != changed


def test_kernel_headers_are_not_in_the_fingerprint(tmp_path):
    """Headers are tracked per TU by ninja (nvcc depfiles), so editing one must not force a
    rebuild of every variant through the fingerprint."""
    tpl = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR, tpl)
    base = fp(tpl)
    header = tpl / "kernels" / "bwd_kernel.cuh"
    header.write_text(header.read_text() + "\n// changed\n")
    assert fp(tpl) == base
    rels = [r for r, _ in T.template_hashes()]
    assert "variant.cu.j2" in rels and not any(r.startswith("kernels/") for r in rels)


def test_find_cutlass_from_wheel(monkeypatch):
    monkeypatch.delenv("CUTLASS_DIR", raising=False)
    inc = T.find_cutlass_include()
    assert (inc / "cute" / "tensor.hpp").is_file()
    assert T.cutlass_version(inc) == "4.2.0"


def test_cutlass_dir_override(tmp_path, monkeypatch):
    (tmp_path / "include" / "cute").mkdir(parents=True)
    (tmp_path / "include" / "cute" / "tensor.hpp").write_text("")
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path))
    assert T.find_cutlass_include() == tmp_path / "include"
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path / "nope"))
    with pytest.raises(ToolchainError, match="CUTLASS_DIR"):
        T.find_cutlass_include()


def test_nvcc_env_override(tmp_path, monkeypatch):
    fake = tmp_path / "nvcc"
    fake.write_text("")
    monkeypatch.setenv("NVCC", str(fake))
    assert T.find_nvcc() == fake
    monkeypatch.setenv("NVCC", str(tmp_path / "missing"))
    with pytest.raises(ToolchainError, match="NVCC"):
        T.find_nvcc()


def test_cutlass_not_imported(monkeypatch):
    import sys
    monkeypatch.delenv("CUTLASS_DIR", raising=False)
    sys.modules.pop("cutlass_library", None)
    T.find_cutlass_include()
    assert "cutlass_library" not in sys.modules
