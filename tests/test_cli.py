"""The `fa3gen` command line (fa3gen/cli.py)."""
import subprocess
import sys
from pathlib import Path

from fa3gen import cli
from generator.paths import REPO_ROOT, SPECS_DIR


def run(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_list_marks_defaults(capsys):
    rc, out, _ = run(["list", "--spec", str(SPECS_DIR / "h100.yaml")], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert "* fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp0_ov0" in lines
    assert "  fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov0" in lines
    assert len(lines) == 16 and not any("pruned" in l for l in lines)


def test_list_by_bare_name_and_explain(capsys):
    rc, out, _ = run(["list", "--spec", "h100", "--explain"], capsys)
    assert rc == 0
    assert ("- fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov0  pruned by knob_realized: "
            "pingpong=true is not realized by the templates yet") in out.splitlines()


def test_list_with_filter(capsys):
    rc, out, _ = run(["list", "--spec", "h100", "--only", "*fp16_d64*"], capsys)
    assert rc == 0 and len(out.splitlines()) == 2


def test_spec_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("axes: {direction: fwd, dtype: bf16, head_dim: 12.5}\n")
    rc, out, err = run(["list", "--spec", str(bad)], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("fa3gen: error: ") and err.count("\n") == 1
    assert "axes.head_dim" in err and "12.5" in err and "Traceback" not in err


def test_filter_error(capsys):
    rc, _, err = run(["list", "--spec", "tiny", "--only", "nothing*"], capsys)
    assert rc == 2 and "matches no variant; available: fwd_bf16_d64" in err


def test_missing_spec_file(capsys):
    rc, _, err = run(["list", "--spec", "no_such_spec"], capsys)
    assert rc == 2 and "not found" in err


def test_clean(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    (tmp_path / "tiny" / "src").mkdir(parents=True)
    (tmp_path / "h100").mkdir()
    rc, out, _ = run(["clean", "--spec", "tiny"], capsys)
    assert rc == 0 and not (tmp_path / "tiny").exists() and (tmp_path / "h100").exists()
    rc, out, _ = run(["clean", "--spec", "tiny"], capsys)
    assert rc == 0 and "nothing to clean" in out
    rc, out, _ = run(["clean"], capsys)
    assert rc == 0 and not tmp_path.exists()


def test_extra_command_modules_listed_in_one_place():
    assert cli.COMMAND_MODULES[0] == "fa3gen.bench"


def test_cli_import_does_not_import_torch():
    code = ("import sys, fa3gen.cli; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def test_entry_point_via_python_m(tmp_path):
    p = subprocess.run([sys.executable, "-m", "fa3gen.cli", "build", "--spec",
                        str(tmp_path / "missing.yaml")], capture_output=True, text=True,
                       cwd=REPO_ROOT)
    assert p.returncode == 2
    assert p.stderr.startswith("fa3gen: error: spec file not found")
