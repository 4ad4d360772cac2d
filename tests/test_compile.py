"""Compile specs/tiny.yaml (one forward, one backward variant) with the real nvcc (no GPU
needed): the generated C++ builds, with no spills and setmaxnreg kept.

    .venv/bin/python -m pytest -m compile tests/test_compile.py
"""
import json
import shutil
import subprocess

import pytest

from generator.errors import ToolchainError
from generator.paths import KERNELS_DIR, SPECS_DIR
from generator.toolchain import find_nvcc

pytestmark = pytest.mark.compile


def test_tiny_spec_compiles(tmp_path, monkeypatch):
    try:
        find_nvcc()
    except ToolchainError as e:
        pytest.skip(str(e))
    if not (KERNELS_DIR / "fa3gen_fwd.cuh").is_file():
        pytest.skip("templates/kernels/fa3gen_fwd.cuh not written yet")
    from generator.build import build

    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    monkeypatch.delenv("FA3GEN_ALLOW_SPILLS", raising=False)
    res = build(SPECS_DIR / "tiny.yaml")
    names = ["bwd_bf16_d64_nocausal_m128n128_s2_ws1_pp0_ov0",
             "fwd_bf16_d64_nocausal_m128n128_s2_ws1_pp0_ov0"]
    lib = tmp_path / "tiny" / "lib" / "libfa3gen_tiny.so"
    assert res.library == lib and lib.is_file()

    nm = shutil.which("nm")
    if nm:
        syms = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True,
                              text=True, check=True).stdout
        for sym in (*(f"fa3gen_launch_{n}" for n in names), "fa3gen_variant",
                    "fa3gen_num_variants", "fa3gen_build_info", "fa3gen_last_error",
                    "fa3gen_abi_version"):
            assert any(line.split()[-1] == sym for line in syms.splitlines()), sym
        # Nothing else: an exported template instance or function-local static (GNU unique)
        # binds across libraries, and a second library's kernels then fail to launch.
        # (libstdc++'s headers give a few of their inline members default visibility.)
        exported = [line.split()[-1] for line in syms.splitlines() if line.strip()]
        ours = [s for s in exported if not s.startswith(("fa3gen_", "_ZNSt", "_ZNKSt", "_ZSt"))]
        assert ours == []

    m = json.loads((tmp_path / "tiny" / "manifest.json").read_text())
    assert sorted(row["name"] for row in m["variants"]) == names
    for row in m["variants"]:
        assert row["is_default"]
        r = row["resources"]
        assert r["registers"] and r["registers"] > 0
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0
        assert not r["setmaxnreg_ignored"]
