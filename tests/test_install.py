"""A regular (non-editable) install: the wheel carries the templates, kernel headers and specs,
and the tool works from it, outside the checkout, writing into the user's cache."""
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from generator.paths import REPO_ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site dir with the wheel installed, environment to run it) without the checkout."""
    tmp = tmp_path_factory.mktemp("install")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp / "dist"), str(REPO_ROOT)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{proc.stdout}\n{proc.stderr}")
    wheel = next((tmp / "dist").glob("fa3gen-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for member in ("generator/_templates/variant.cu.j2", "generator/_templates/kernels/fa3gen_abi.h",
                   "generator/_templates/kernels/fwd_mainloop.cuh", "generator/_specs/h100.yaml",
                   "fa3gen/contract.py"):
        assert member in names, member
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    # python -S: no site processing, so the checkout's editable install (a .pth finder) is not
    # active; the dependencies come from this interpreter's site-packages, after the wheel.
    env = {k: v for k, v in os.environ.items() if k not in ("FA3GEN_GENERATED", "FA3GEN_LIB")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]),
               HOME=str(tmp / "home"), XDG_CACHE_HOME="")
    return site, env, tmp


def run(installed, *args):
    site, env, tmp = installed
    return subprocess.run([sys.executable, "-S", *args], cwd=tmp, env=env, capture_output=True,
                          text=True)


def test_installed_package_finds_its_data_and_caches_outside_it(installed):
    site, _, tmp = installed
    proc = run(installed, "-c", "import generator.paths as p, fa3gen.contract as c; "
                                "print(p.TEMPLATES_DIR); print(p.SPECS_DIR); print(c.generated_root())")
    assert proc.returncode == 0, proc.stderr
    templates, specs, root = proc.stdout.split()
    assert Path(templates) == site / "generator" / "_templates"
    assert Path(specs) == site / "generator" / "_specs"
    assert Path(root) == tmp / "home" / ".cache" / "fa3gen" / "generated"


def test_installed_cli_lists_and_renders_a_spec(installed):
    site, _, tmp = installed
    proc = run(installed, "-m", "fa3gen.cli", "list", "--spec", "h100")
    assert proc.returncode == 0, proc.stderr
    assert "* fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1" in proc.stdout
    # The rendered TU includes the headers the wheel carries (no nvcc needed: before the skip).
    from generator.build import plan
    from generator.render import render_variant
    v = plan(REPO_ROOT / "specs" / "tiny.yaml").variants[0]
    proc = run(installed, "-c", "from fa3gen.contract import parse_name; from generator.render import "
                                f"render_variant; print(render_variant(parse_name({v.name!r})))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == render_variant(v).rstrip("\n")
    proc = run(installed, "-m", "fa3gen.cli", "build", "--spec", "tiny", "--dry-run")
    if "nvcc" in proc.stderr and proc.returncode != 0:
        pytest.skip(f"no CUDA toolkit: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    out = tmp / "home" / ".cache" / "fa3gen" / "generated" / "tiny"
    assert f"-> {out}" in proc.stdout and "would write: src/dispatch.cu" in proc.stdout
    assert not out.exists()  # a dry run writes nothing
