"""How the gpu tests skip where they cannot run (tests/conftest.py, tests/gpu/conftest.py)."""
import os
import re
import subprocess
import sys

from generator.paths import REPO_ROOT


def test_without_a_cuda_device_every_gpu_test_says_so_first(tmp_path):
    # No device (CUDA_VISIBLE_DEVICES="") and no library: the device is the first thing missing,
    # so it is every test's reason, the variant-parametrized ones included.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "FA3GEN_LIB": str(tmp_path / "libfa3gen_missing.so")}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs",
                        "-p", "no:cacheprovider", "tests/gpu"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 5), p.stdout + p.stderr
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+(?::\d+)?: (.*)$", p.stdout, re.M)
    assert reasons and re.search(r"\b(\d+) skipped\b", p.stdout), p.stdout
    assert all(r.startswith("no CUDA device") for r in reasons), p.stdout
