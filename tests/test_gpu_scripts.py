"""The GPU-host scripts in tests/gpu (benchmarks, A/B, sanitizer drivers) run only where device
time is scarce: here, on the CPU, each must at least import (its module level, torch and
fa3gen imports included) and, when it has a command line, answer --help."""
import importlib.util
import json
import subprocess
import sys

import pytest

from generator.paths import REPO_ROOT

GPU_DIR = REPO_ROOT / "tests" / "gpu"
SCRIPTS = sorted(p for p in GPU_DIR.glob("*.py") if not p.name.startswith(("test_", "conftest")))

# Runs every script's main with --help in one interpreter (one torch import for all): prints
# {script: "ok" or what went wrong}.
_HELP_DRIVER = """
import contextlib, io, json, runpy, sys
result = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        result[path] = "no exit: --help did not stop it"
    except SystemExit as e:
        text = out.getvalue().lower()
        result[path] = "ok" if e.code in (0, None) and "usage" in text else f"exit {e.code}: {text[:200]}"
    except BaseException as e:
        result[path] = f"{type(e).__name__}: {e}"
print(json.dumps(result))
"""


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_gpu_script_imports(path):
    spec = importlib.util.spec_from_file_location(f"gpu_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(GPU_DIR))  # scripts import their siblings (sustained_backends)
    try:
        spec.loader.exec_module(module)  # each one's work runs only under __main__
    finally:
        sys.path.remove(str(GPU_DIR))


def test_gpu_scripts_answer_help():
    with_cli = [str(p) for p in SCRIPTS if "argparse" in p.read_text()]
    p = subprocess.run([sys.executable, "-c", _HELP_DRIVER, *with_cli], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": f"{REPO_ROOT}:{GPU_DIR}", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(result) == len(with_cli) >= 8
    assert {k: v for k, v in result.items() if v != "ok"} == {}


def test_every_gpu_script_is_found():
    assert {"bench_fp8_quantize.py", "sanitize_quantizer.py", "ab_trees.py"} <= {p.name for p in SCRIPTS}
