"""README.md's two commands stay true: CI runs the test command verbatim, and the pieces the
main command names exist (build.py --check, specs/h100.yaml, the `test` extra)."""
import os
import re

from generator.paths import REPO_ROOT

README = REPO_ROOT / "README.md"
CI = REPO_ROOT / ".ci" / "run"


def command_after(marker: str) -> str:
    """The one-line command in the fenced block right after `<!-- marker -->`."""
    text = README.read_text()
    m = re.search(rf"^<!-- {re.escape(marker)} -->\n```\w*\n(.+?)\n```$", text, re.M | re.S)
    assert m, f"README.md has no fenced block right after <!-- {marker} -->"
    cmd = m.group(1).strip()
    assert "\n" not in cmd, f"{marker} must be one line, got {cmd!r}"
    return cmd


def test_ci_runs_the_readme_test_command_verbatim():
    cmd = command_after("test-command")
    assert "pytest" in cmd
    lines = [ln.strip() for ln in CI.read_text().splitlines()]
    assert cmd in lines, f".ci/run must contain the README's test command as a line: {cmd}"
    assert os.access(CI, os.X_OK), ".ci/run must be executable"
    assert "set -euo pipefail" in lines


def test_main_command_pieces_exist():
    cmd = command_after("main-command")
    assert "build.py --spec specs/h100.yaml --check" in cmd
    assert (REPO_ROOT / "specs" / "h100.yaml").is_file()
    build_py = (REPO_ROOT / "build.py").read_text()
    assert '"--check"' in build_py and "quick_check" in build_py


def test_install_part_is_shared_and_extra_exists():
    main, test = command_after("main-command"), command_after("test-command")
    install = "python3 -m pip install torch==2.13.0 -e '.[test]'"
    assert main.startswith(install + " && ") and test.startswith(install + " && ")
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 too
    assert re.search(r'^test = \[[^\]]*"pytest"', pyproject, re.M)
    assert 'testpaths = ["tests"]' in pyproject


def test_every_compile_time_switch_is_documented():
    """The preprocessor switches the kernels test (#ifdef / #ifndef FA3GEN_...) are the ones
    `fa3gen build --define` exists for: each is named in the README's build command row, and
    the README names none that the templates no longer have."""
    templates = REPO_ROOT / "templates"
    used = set()
    for path in templates.rglob("*"):
        if path.suffix in (".cuh", ".j2", ".h"):
            used |= set(re.findall(r"#\s*if(?:n?def|\s+defined\()\s*\(?(FA3GEN_[A-Z0-9_]+)",
                                   path.read_text()))
    row = next(line for line in README.read_text().splitlines()
               if line.startswith("| `fa3gen build"))
    documented = set(re.findall(r"`(FA3GEN_[A-Z0-9_]+)", row)) - {"FA3GEN_COMPILER_LAUNCHER"}
    assert used, "no switch found: the pattern no longer matches the templates"
    assert used - documented == set(), "switches the README's build row does not name"
    assert documented - used == set(), "switches the README names that the templates lack"


def test_the_annotated_spec_example_plans(tmp_path):
    """The README's annotated spec is a spec: it loads, and its dispatch gives every key one
    default (a second d128 tile once left the causal key ambiguous)."""
    from generator.build import plan

    text = README.read_text()
    m = re.search(r"^```yaml\n(name: h100 .+?)^```$", text, re.M | re.S)
    assert m, "README.md's annotated spec example (```yaml, starting with name: h100) is gone"
    path = tmp_path / "readme_example.yaml"
    path.write_text(m.group(1))
    p = plan(path)
    assert p.variants and p.defaults
    assert len({v.name for v in p.defaults.values()}) == len(p.defaults)
