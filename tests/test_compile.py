"""Compile specs/tiny.yaml (one forward, one backward variant) plus a causal forward with the
real nvcc (no GPU needed): the generated C++ builds, with no spills and setmaxnreg kept, and
the two forwards share a compile unit whose ptxas entries go to each (generator/units.py).

    .venv/bin/python -m pytest -m compile tests/test_compile.py
"""
import json
import shutil
import subprocess

import pytest

from fa3gen.contract import parse_name
from generator.errors import ToolchainError
from generator.paths import KERNELS_DIR, SPECS_DIR
from generator.toolchain import find_nvcc
from generator.units import traits_mangled

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
    monkeypatch.delenv("FA3GEN_UNIT_SIZE", raising=False)
    tiny = (SPECS_DIR / "tiny.yaml").read_text()
    fwd = "axes: {direction: fwd, tile: [128, 128]}"
    assert fwd in tiny
    spec = tmp_path / "tiny.yaml"
    spec.write_text(tiny.replace(fwd, "axes: {direction: fwd, tile: [128, 128], causal: [false, true]}"))
    res = build(spec)
    names = ["bwd_bf16_d64_nocausal_m128n128_s2_ws1_pp0_ov0",
             "fwd_bf16_d64_causal_m128n128_s2_ws1_pp0_ov0",
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
        assert traits_mangled(parse_name(row["name"])) in r["kernel"]  # its own kernel
    units = {row["resources"]["unit"] for row in m["variants"]}
    assert len(units) == 2  # the forwards together, the backward alone


FAST_DIV_CHECK = r"""
#include <cstdio>
#include <cstdlib>
#include "simt_common.cuh"
using fa3gen::simt::FastDiv;
// x / d for divisors from 1 to 2^31 - 1 (small ones, powers of two and their neighbours, large
// ones) and numerators at the bounds of every quotient step near 0 and near 2^31 - 1.
int main() {
  long long checked = 0;
  auto check = [&](int d, long long x) {
    if (x < 0 || x > 0x7fffffff) return true;
    ++checked;
    return FastDiv(d).div(int(x)) == int(x / d);
  };
  for (long long d = 1; d < 0x7fffffffLL; d = d < 5000 ? d + 1 : d * 3 / 2 + 1) {
    for (long long e : {d, (d & (d - 1)) ? d : d - 1, d + 1}) {
      if (e < 1 || e > 0x7fffffff) continue;
      for (long long q : {0LL, 1LL, 2LL, 0x7fffffffLL / e - 1, 0x7fffffffLL / e}) {
        for (long long x : {q * e - 1, q * e, q * e + e - 1, 0x7fffffffLL}) {
          if (!check(int(e), x)) { std::printf("FastDiv(%lld).div(%lld) wrong\n", e, x); return 1; }
        }
      }
    }
  }
  std::printf("%lld checked\n", checked);
  return 0;
}
"""


def test_fast_div_matches_division(tmp_path):
    """simt_common.cuh's FastDiv (the quantizer's item -> block, head, batch) against `/`."""
    try:
        nvcc = find_nvcc()
    except ToolchainError as e:
        pytest.skip(str(e))
    src, exe = tmp_path / "fast_div.cu", tmp_path / "fast_div"
    src.write_text(FAST_DIV_CHECK)
    subprocess.run([str(nvcc), "-std=c++17", "-O2", f"-I{KERNELS_DIR}", str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    assert int(run.stdout.split()[0]) > 100000
